"""A custom executor in miniature: one engine process broadcasting to N worker processes.

The engine builds ``MessageQueue(N, N, enable_shm_tensor_arena=True)`` (every reader on this
node, so large tensors go through the shared-memory arena: one copy, read by all workers).
Each worker joins with ``create_from_handle``, copies the tensor it receives to the GPU when
there is one (the arena pins its pages, so that copy is a DMA) or into a host buffer
otherwise, and reports its timing back. The engine prints per-step timings and the arena's
counters.

    python examples/custom_executor.py --workers 2 --steps 5 --mib 16 [--start-method fork]

Only abstract ``ipc://@`` sockets and shared memory are used: nothing leaves this machine.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import time
from multiprocessing.queues import Queue

import torch

from vllm_shm_arena import Handle, MessageQueue

MiB = 1 << 20


def worker_main(handle: Handle, rank: int, replies: Queue) -> None:
    """One worker: joins the queue, then copies every tensor it gets to its device."""
    mq = MessageQueue.create_from_handle(handle, rank)
    on_gpu = torch.cuda.is_available()
    dst: torch.Tensor | None = None
    mq.wait_until_ready()
    while True:
        msg = mq.dequeue()
        t1 = time.perf_counter()
        if msg is None:
            break
        src: torch.Tensor = msg["tensor"]
        if dst is None or dst.shape != src.shape:
            # Allocating here also creates the CUDA context, before the next message arrives:
            # from then on the arena pins what this worker reads.
            dst = torch.empty_like(src, device="cuda" if on_gpu else "cpu")
        dst.copy_(src, non_blocking=on_gpu)
        if on_gpu:
            torch.cuda.synchronize()
        t2 = time.perf_counter()
        ok = bool(dst[0].item() == msg["step"] and dst[-1].item() == msg["step"])
        del src, msg  # the arena slot goes back once every worker has dropped its tensor
        # last_dequeue_s: from the message's arrival to the object in hand (no waiting).
        replies.put((rank, mq.last_dequeue_s, t2 - t1, ok))
    replies.put((rank, "stats", mq.stats()))
    mq.shutdown()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workers", type=int, default=2, help="worker processes (default 2)")
    p.add_argument("--steps", type=int, default=5, help="messages to broadcast (default 5)")
    p.add_argument("--mib", type=int, default=16, help="tensor size in MiB (default 16)")
    p.add_argument(
        "--start-method",
        choices=("spawn", "fork"),
        default="spawn",
        help="how workers are started (default spawn; fork children inherit the engine's queue "
        "and must leave it alone)",
    )
    args = p.parse_args()
    n = args.workers

    mq = MessageQueue(n, n, enable_shm_tensor_arena=True)
    ctx = mp.get_context(args.start_method)
    replies = ctx.Queue()
    procs = [
        ctx.Process(target=worker_main, args=(mq.export_handle(), r, replies), daemon=True)
        for r in range(n)
    ]
    for proc in procs:
        proc.start()
    mq.wait_until_ready(timeout=120)
    device = "cuda" if torch.cuda.is_available() else "host buffer"
    print(f"engine: {n} workers, {args.steps} steps, {args.mib} MiB float32 tensors -> {device}")

    tensor = torch.empty(args.mib * MiB // 4, dtype=torch.float32)
    all_ok = True
    for step in range(args.steps):
        tensor.fill_(float(step))  # safe: enqueue returns once nothing aliases the tensor
        t0 = time.perf_counter()
        mq.enqueue({"step": step, "tensor": tensor})
        t_enq = time.perf_counter() - t0
        got = [replies.get(timeout=120) for _ in range(n)]
        t_all = time.perf_counter() - t0
        all_ok &= all(ok for *_, ok in got)
        recv_ms = max(g[1] for g in got) * 1e3
        copy_ms = max(g[2] for g in got) * 1e3
        print(
            f"step {step}: enqueue {t_enq * 1e3:.2f} ms, worker unpickle <= {recv_ms:.2f} ms, "
            f"copy <= {copy_ms:.2f} ms, round trip {t_all * 1e3:.2f} ms, "
            f"{'ok' if all(ok for *_, ok in got) else 'MISMATCH'}"
        )

    mq.enqueue(None)
    worker_stats = sorted(replies.get(timeout=120) for _ in range(n))
    for proc in procs:
        proc.join(timeout=60)
    stats = mq.stats()
    arena = stats.get("arena", {})
    declined = {k: v for k, v in arena.get("declined", {}).items() if v}
    print(
        f"arena: hits={arena.get('hits', 0)} bytes={arena.get('bytes', 0)} "
        f"declined={declined} in_use={arena.get('in_use', 0)}"
    )
    print(
        f"queue: messages={stats['messages']} ring={stats['ring_messages']} "
        f"overflow={stats['overflow_messages']} bytes_sent={stats['bytes']}"
    )
    for rank, _, ws in worker_stats:
        a = ws.get("arena", {})
        print(
            f"worker {rank}: messages={ws['messages']} held={a.get('held')} "
            f"pinned_bytes={a.get('pinned_bytes')}"
        )
    mq.shutdown()
    print("done" if all_ok else "FAILED: a worker saw wrong data")
    return 0 if all_ok and all(proc.exitcode == 0 for proc in procs) else 1


if __name__ == "__main__":
    raise SystemExit(main())
