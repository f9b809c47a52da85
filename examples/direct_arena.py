"""The arena without the queue: ``ShmTensorArena`` + the pickler over a plain ``Pipe``.

A writer process creates a ``ShmTensorArena`` and pickles each message with
``vllm_shm_arena.pickler.dump_message(obj, arena)``: a large tensor goes into an arena slot
and only a ~100-byte stub stays in the pickle stream; a small one rides out of band next to
it. The bytes travel over a ``multiprocessing.Pipe`` to reader processes (spawned), which
attach the arena and ``loads`` the message: the large tensor's storage *is* the shared slot
(nothing copied). A slot returns to the writer once every reader has dropped its tensor.

    python examples/direct_arena.py --readers 2 --messages 3 --mib 32
"""

from __future__ import annotations

import argparse
import gc
import multiprocessing as mp
import time
from multiprocessing.connection import Connection

import torch

from vllm_shm_arena import ArenaHandle, ShmTensorArena
from vllm_shm_arena.pickler import dump_message, loads

MiB = 1 << 20


def reader_main(handle: ArenaHandle, rank: int, conn: Connection) -> None:
    """Attaches the arena as reader ``rank`` and unpickles what arrives on ``conn``."""
    arena = ShmTensorArena.attach(handle, rank)  # keep a reference: stubs resolve through it
    conn.send("attached")
    while (item := conn.recv()) is not None:
        data, buffers = item
        t0 = time.perf_counter()
        msg = loads(data, buffers)
        t_loads = time.perf_counter() - t0
        big: torch.Tensor = msg["big"]
        ok = bool(big[0].item() == msg["seq"] and big[-1].item() == msg["seq"])
        ok &= bool(torch.equal(msg["small"], torch.arange(1024) + msg["seq"]))
        held = arena.stats()["held"]  # 1: this process maps the slot, it did not copy it
        del big, msg
        gc.collect()
        arena.flush_releases()
        conn.send((t_loads, held, arena.stats()["held"], ok))
    conn.send(arena.stats())
    arena.close()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--readers", type=int, default=2, help="reader processes (default 2)")
    p.add_argument("--messages", type=int, default=3, help="messages to send (default 3)")
    p.add_argument("--mib", type=int, default=32, help="large tensor size in MiB (default 32)")
    args = p.parse_args()

    slot_bytes = max(args.mib, 8) * MiB
    arena = ShmTensorArena.create(args.readers, num_slots=4, slot_bytes=slot_bytes)
    print(f"writer: {arena!r}")
    ctx = mp.get_context("spawn")
    pipes = [ctx.Pipe() for _ in range(args.readers)]
    procs = [
        ctx.Process(target=reader_main, args=(arena.handle(), rank, child), daemon=True)
        for rank, (_, child) in enumerate(pipes)
    ]
    for proc in procs:
        proc.start()
    for parent, _ in pipes:
        assert parent.recv() == "attached"

    all_ok = True
    for seq in range(args.messages):
        obj = {
            "seq": seq,
            "big": torch.full((args.mib * MiB // 4,), float(seq)),  # >= 8 MiB: into the arena
            "small": torch.arange(1024) + seq,  # 8 KiB: out of band
        }
        t0 = time.perf_counter()
        dumped = dump_message(obj, arena)
        t_dump = time.perf_counter() - t0
        buffers = [bytes(b.raw()) for b in dumped.buffers]
        tensor_bytes = sum(t.numel() * t.element_size() for t in (obj["big"], obj["small"]))
        print(
            f"message {seq}: {tensor_bytes} tensor bytes -> pickle stream {len(dumped.data)} B "
            f"+ {sum(map(len, buffers))} B out of band; arena slots {dumped.diverted}; "
            f"dump {t_dump * 1e3:.2f} ms"
        )
        for parent, _ in pipes:
            parent.send((dumped.data, buffers))
        for rank, (parent, _) in enumerate(pipes):
            t_loads, held, held_after, ok = parent.recv()
            all_ok &= ok
            print(
                f"  reader {rank}: loads {t_loads * 1e6:.0f} us (zero-copy: held {held} slot, "
                f"{held_after} after del), {'ok' if ok else 'MISMATCH'}"
            )

    t0 = time.perf_counter()
    obj["big"].clone()
    print(
        f"for comparison, one copy of the large tensor: {(time.perf_counter() - t0) * 1e6:.0f} us"
    )

    for parent, _ in pipes:
        parent.send(None)
    reader_stats = [parent.recv() for parent, _ in pipes]
    for proc in procs:
        proc.join(timeout=60)
    arena.reclaim()
    s = arena.stats()
    declined = {k: v for k, v in s["declined"].items() if v}
    print(
        f"writer stats: hits={s['hits']} bytes={s['bytes']} declined={declined} "
        f"in_use={s['in_use']} reclaimed={s['reclaimed']}"
    )
    for rank, rs in enumerate(reader_stats):
        print(f"reader {rank} stats: {rs}")
    arena.close()
    print("done" if all_ok else "FAILED: a reader saw wrong data")
    return 0 if all_ok and all(proc.exitcode == 0 for proc in procs) else 1


if __name__ == "__main__":
    raise SystemExit(main())
