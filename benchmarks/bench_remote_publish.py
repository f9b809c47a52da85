"""The writer's time to publish one message to a remote node (TCP), against one warm memcpy of
its payload (`make bench-remote-publish`).

The message is one image's ``pixel_values`` as vLLM makes it for a 2048^2 image with
Qwen2-VL (25,067,616 B of uint8). Configurations, each a fresh queue:

* ``remote``: one remote reader only (the writer's whole job is the TCP publish);
* ``remote+arena``: one local reader beside it, the tensor arena on (the local reader gets an
  arena stub, the remote one the bytes);

each with the writer's ZeroMQ I/O thread kept off the sending thread's CPU ("placed", the
default: csrc/core/thread_placement.h) and without ("unplaced"), interleaved.

Lock-step: the writer waits for every reader's acknowledgement before the next message, so the
time measured is ``enqueue`` alone, never a wait for a slow reader; the round trip (from the
``enqueue`` to the last acknowledgement) shows what the placement does to delivery. Per
configuration the median over the measured messages. Two baselines, both a ``copy_`` of the
same bytes into a warm (faulted-in) buffer: ``memcpy`` repeated back to back (caches hot: the
same two buffers each time), and ``in-loop memcpy``, one per message inside the publish loop,
half of them just before the ``enqueue`` and half just after the readers' acknowledgements, so
it meets the caches the ``enqueue`` meets (the readers' copies in between evict them). Also
reported: the writer's picklings per message (its dump calls) and its frame pool's takes (the
socket's copies: none when the remote frames are the arena's own).

    python benchmarks/bench_remote_publish.py   # -> benchmarks/results/remote_publish.{md,json}

Prints, never asserts.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import harness as ab  # noqa: E402  (benchmarks/, beside this file)

from vllm_shm_arena import (
    MessageQueue,  # noqa: E402
    pickler,  # noqa: E402
)
from vllm_shm_arena._ext import _C  # noqa: E402
from vllm_shm_arena.mq import transport as mq_transport  # noqa: E402

OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
PIXEL_BYTES = 25_067_616  # 2044^2 x 3 x 2: a 2048^2 image's pixel_values for Qwen2-VL


def _reader(handle, rank, n, conn):
    torch.set_num_threads(1)
    r = MessageQueue.create_from_handle(handle, rank)
    r.wait_until_ready(timeout=120)
    for _ in range(n):
        m = r.dequeue(timeout=120)
        ok = int(m["pixel_values"][-1]) == m["last"]
        del m
        conn.send(ok)
    conn.close()


class _CountDumps:
    """Counts the pickler's dump_message calls (one per pickling of a message)."""

    def __init__(self):
        self.calls = 0
        self._dump = pickler.dump_message

    def __call__(self, *args, **kw):
        self.calls += 1
        return self._dump(*args, **kw)


def run(config: str, n: int, warmup: int, seed: int, placement: bool = True) -> dict:
    ctx = mp.get_context("fork")
    mq_transport.PLACE_IO_THREADS = placement
    n_local = 1 if config == "remote+arena" else 0
    mq = MessageQueue(
        n_local + 1,
        n_local,
        list(range(n_local)),
        connect_ip="127.0.0.1",
        enable_shm_tensor_arena=n_local > 0,
    )
    h = mq.export_handle()
    pipes, procs = [], []
    for rank in range(n_local + 1):
        a, b = ctx.Pipe()
        p = ctx.Process(target=_reader, args=(h, rank, warmup + n, b), daemon=True)
        p.start()
        pipes.append(a)
        procs.append(p)
    mq.wait_until_ready(timeout=120)
    g = torch.Generator().manual_seed(seed)
    src = torch.randint(0, 256, (PIXEL_BYTES,), dtype=torch.uint8, generator=g)
    counter = _CountDumps()
    from vllm_shm_arena.mq import writer as mq_writer

    mq_writer.dump_message = counter
    times = []
    round_trips = []  # enqueue start -> every reader's acknowledgement
    in_loop = []  # the in-loop memcpy (module docstring)
    dst = torch.empty(PIXEL_BYTES, dtype=torch.uint8)
    dst.fill_(1)
    pool0 = None
    try:
        for i in range(warmup + n):
            if i == warmup:
                counter.calls = 0
                pool0 = _C.frame_pool_stats()
            src[-1] = i % 256
            msg = {"pixel_values": src, "last": i % 256}
            before = i % 4 < 2
            if before:
                c0 = time.perf_counter()
                dst.copy_(src)
                copy_s = time.perf_counter() - c0
            t0 = time.perf_counter()
            mq.enqueue(msg)
            t1 = time.perf_counter()
            if not all(c.recv() for c in pipes):
                raise RuntimeError(f"{config}: a reader saw wrong bytes")
            t2 = time.perf_counter()
            if not before:
                c0 = time.perf_counter()
                dst.copy_(src)
                copy_s = time.perf_counter() - c0
            if i >= warmup:
                times.append(t1 - t0)
                round_trips.append(t2 - t0)
                in_loop.append(copy_s)
        pool1 = _C.frame_pool_stats()
    finally:
        mq_writer.dump_message = counter._dump
        mq.shutdown()
        for p in procs:
            p.join(30)
    return {
        "config": config,
        "placement": placement,
        "messages": n,
        "enqueue_ms_p50": statistics.median(times) * 1e3,
        "round_trip_ms_p50": statistics.median(round_trips) * 1e3,
        "enqueue_ms_min": min(times) * 1e3,
        "in_loop_memcpy_ms_p50": statistics.median(in_loop) * 1e3,
        "picklings_per_message": counter.calls / n,
        "pool_takes_per_message": (pool1["takes"] - pool0["takes"]) / n,
        "pool_new_mappings": pool1["mapped"] - pool0["mapped"],
    }


#: (configuration, whether the writer keeps its I/O thread off its own CPU), interleaved.
CONFIGS = [
    ("remote", False),
    ("remote", True),
    ("remote+arena", False),
    ("remote+arena", True),
]


def _label(config: str, placement: bool) -> str:
    return f"{config}, I/O thread {'placed' if placement else 'unplaced'}"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--messages", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--out", default=OUT)
    args = ap.parse_args(argv)
    print(f"seed={args.seed}", flush=True)
    torch.set_num_threads(1)
    rows = []
    memcpys = []
    for rep in range(args.repeats):
        memcpys.append(ab.warm_memcpy_ms(PIXEL_BYTES / (1 << 20)))
        for config, placement in CONFIGS:
            row = run(config, args.messages, args.warmup, args.seed, placement)
            row["repeat"] = rep
            rows.append(row)
            print(
                f"rep {rep} {_label(config, placement):28s} "
                f"enqueue p50 {row['enqueue_ms_p50']:7.2f} ms "
                f"round trip {row['round_trip_ms_p50']:7.2f} ms "
                f"(memcpy {memcpys[-1]:.2f} ms, in-loop {row['in_loop_memcpy_ms_p50']:.2f} ms)"
                f"  picklings/msg {row['picklings_per_message']:.1f}"
                f"  pool takes/msg {row['pool_takes_per_message']:.1f}"
                f"  new mappings {row['pool_new_mappings']}",
                flush=True,
            )
    memcpy = statistics.median(memcpys)
    summary = {}
    for config, placement in CONFIGS:
        sel = [r for r in rows if r["config"] == config and r["placement"] == placement]
        p50 = statistics.median(r["enqueue_ms_p50"] for r in sel)
        loop = statistics.median(r["in_loop_memcpy_ms_p50"] for r in sel)
        summary[_label(config, placement)] = {
            "enqueue_ms_p50": p50,
            "round_trip_ms_p50": statistics.median(r["round_trip_ms_p50"] for r in sel),
            "over_memcpy": p50 / memcpy,
            "in_loop_memcpy_ms_p50": loop,
            "over_in_loop_memcpy": p50 / loop,
            "pool_takes_per_message": max(r["pool_takes_per_message"] for r in sel),
            "picklings_per_message": max(r["picklings_per_message"] for r in sel),
        }
    record = {
        **ab.run_record("bench_remote_publish.py", argv),
        "machine": ab.machine_info(),
        "loadavg_1m": os.getloadavg()[0],
        "payload_bytes": PIXEL_BYTES,
        "memcpy_ms": memcpy,
        "rows": rows,
        "summary": summary,
    }
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "remote_publish.json"), "w") as f:
        json.dump(record, f, indent=1)
    lines = [
        "# The writer's TCP publish of one 25 MB message vs one warm memcpy",
        "",
        f"Run: `{record['command']}` on {record['date']}, "
        f"{record['machine']['summary']}; {args.repeats} repetitions of {args.messages} "
        f"messages after {args.warmup}; load average (1 min) {record['loadavg_1m']:.2f}.",
        "",
        f"One warm memcpy of {PIXEL_BYTES:,} B, back to back: {memcpy:.2f} ms.",
        "",
        "| configuration | enqueue p50 ms | / memcpy | in-loop memcpy ms | / in-loop memcpy "
        "| round trip p50 ms | picklings per message | socket copies per message |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for config, s in summary.items():
        lines.append(
            f"| {config} | {s['enqueue_ms_p50']:.2f} | {s['over_memcpy']:.2f} | "
            f"{s['in_loop_memcpy_ms_p50']:.2f} | {s['over_in_loop_memcpy']:.2f} | "
            f"{s['round_trip_ms_p50']:.2f} | "
            f"{s['picklings_per_message']:.0f} | {s['pool_takes_per_message']:.0f} |"
        )
    with open(os.path.join(args.out, "remote_publish.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
