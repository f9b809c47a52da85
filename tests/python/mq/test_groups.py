"""MessageQueue.create_from_process_group over a torch.distributed gloo group.

Three spawned ranks on this machine: rank 0 writes, ranks 1 and 2 read through shared memory
(same host), with the arena on. Loopback rendezvous only.
"""

from __future__ import annotations

import multiprocessing
import os
import socket
import sys

import pytest
import torch

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

WORLD = 3
N_MSGS = 5
MiB = 1 << 20


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_main(rank: int, port: int, q) -> None:
    sys.path.insert(0, REPO)
    import torch.distributed as dist

    from vllm_shm_arena import MessageQueue

    try:
        dist.init_process_group(
            "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD
        )
        mq = MessageQueue.create_from_process_group(
            dist.group.WORLD, 16 << 20, 10, writer_rank=0, enable_shm_tensor_arena=True
        )
        if rank == 0:
            for i in range(N_MSGS):
                mq.enqueue({"i": i, "t": torch.full((4 * MiB,), i, dtype=torch.int32)})
            dist.barrier()  # every reader has checked its messages
            q.put((rank, "ok", mq.stats()["arena"]["hits"]))
        else:
            for i in range(N_MSGS):
                msg = mq.dequeue(timeout=60)
                t = msg["t"]
                if msg["i"] != i or int(t[0]) != i or int(t[-1]) != i or t.numel() != 4 * MiB:
                    raise AssertionError(f"rank {rank}: message {i} is wrong")
                del msg, t
            dist.barrier()
            q.put((rank, "ok", mq.stats()["role"]))
        mq.shutdown()
        dist.destroy_process_group()
    except BaseException as e:  # report, never hang the parent
        q.put((rank, f"error: {type(e).__name__}: {e}", None))


def test_create_from_process_group_gloo():
    ctx = multiprocessing.get_context("spawn")
    q = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_rank_main, args=(r, port, q)) for r in range(WORLD)]
    for p in procs:
        p.start()
    try:
        results = {}
        for _ in range(WORLD):
            rank, status, extra = q.get(timeout=180)
            results[rank] = (status, extra)
        assert all(status == "ok" for status, _ in results.values()), results
        assert results[0][1] == N_MSGS  # every 16 MiB tensor went through the arena
        assert results[1][1] == results[2][1] == "local_reader"
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()


if __name__ == "__main__":  # pragma: no cover
    pytest.main([__file__, "-q"])
