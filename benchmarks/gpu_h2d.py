"""H2D from the arena: pinned arena vs the same memory unpinned vs torch pin_memory() vs
pageable memory, for 8/64/200 MB; plus the one-time registration cost.

Needs a CUDA GPU. Each source is timed with CUDA events around ``dst.copy_(src,
non_blocking=True)``, median of several runs after a warm-up. Prints a table and writes
benchmarks/results/gpu_h2d.json (or --out).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")


def time_h2d(src: torch.Tensor, dst: torch.Tensor, reps: int) -> tuple[float, float]:
    """(median GB/s, median latency ms) of an async H2D of src into dst."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    dst.copy_(src, non_blocking=True)
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start.record()
        dst.copy_(src, non_blocking=True)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    ms = statistics.median(times)
    return src.numel() * src.element_size() / (ms * 1e-3) / 1e9, ms


def arena_tensor(size: int, pinned: bool):
    """A tensor over an arena slot, as a reader sees it (pinned when asked and possible)."""
    import vllm_shm_arena.arena as arena_mod
    from vllm_shm_arena import ShmTensorArena

    arena_mod._PIN_ENABLED = pinned
    w = ShmTensorArena.create(1, num_slots=1, slot_bytes=size)
    r = ShmTensorArena.attach(w.handle(), 0)
    w.unlink()
    src = torch.randint(0, 255, (size,), dtype=torch.uint8)
    slot, gen = w.write(src)
    t0 = time.perf_counter()
    t = r.get_tensor(slot, size, torch.uint8, (size,), generation=gen)
    first_ms = (time.perf_counter() - t0) * 1e3
    return t, (w, r), first_ms, src


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sizes", type=int, nargs="+", default=[8, 64, 200], help="MB")
    ap.add_argument("--reps", type=int, default=9)
    ap.add_argument("--out", default=RESULTS)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("no CUDA GPU: nothing to measure")
        return 0
    torch.cuda.init()
    torch.zeros(1, device="cuda")  # create the context: the arena pins only when one exists
    gpu = torch.cuda.get_device_name()
    driver = subprocess.run(
        ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
        capture_output=True,
        text=True,
    ).stdout.strip()
    rows = []
    for mb in args.sizes:
        size = mb * 1_000_000
        size = (size + 4095) // 4096 * 4096
        dst = torch.empty(size, dtype=torch.uint8, device="cuda")
        row = {"size_mb": mb}
        t, keep, first_ms, src = arena_tensor(size, pinned=True)
        st = keep[1].stats()
        row["arena_pinned_is_pinned"] = bool(t.is_pinned())
        row["arena_first_get_tensor_ms"] = first_ms
        row["register_ms_per_gib"] = (
            st["pin_seconds"] * 1e3 / (st["pinned_bytes"] / 2**30) if st["pinned_bytes"] else None
        )
        row["arena_pinned_gbps"], row["arena_pinned_ms"] = time_h2d(t, dst, args.reps)
        torch.cuda.synchronize()
        row["arena_pinned_bytes_ok"] = bool(torch.equal(dst.cpu(), src))
        del t, keep
        t, keep, _, _ = arena_tensor(size, pinned=False)
        row["arena_unpinned_is_pinned"] = bool(t.is_pinned())
        row["arena_unpinned_gbps"], row["arena_unpinned_ms"] = time_h2d(t, dst, args.reps)
        del t, keep
        p = torch.empty(size, dtype=torch.uint8, pin_memory=True)
        p.fill_(1)
        row["torch_pinned_gbps"], row["torch_pinned_ms"] = time_h2d(p, dst, args.reps)
        del p
        g = torch.ones(size, dtype=torch.uint8)
        row["pageable_gbps"], row["pageable_ms"] = time_h2d(g, dst, args.reps)
        del g, dst
        row["pinned_arena_vs_torch_pinned"] = row["arena_pinned_gbps"] / row["torch_pinned_gbps"]
        row["pinned_arena_vs_pageable"] = row["arena_pinned_gbps"] / row["pageable_gbps"]
        rows.append(row)
    result = {
        "machine": {
            "gpu": gpu,
            "driver": driver,
            "kernel": platform.release(),
            "torch": torch.__version__,
            "cpus": os.cpu_count(),
        },
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        "rows": rows,
    }
    print(f"{gpu}, driver {driver}, kernel {platform.release()}, torch {torch.__version__}")
    print(
        f"{'MB':>5} {'arena pinned':>13} {'arena unpinned':>15} {'torch pinned':>13} "
        f"{'pageable':>9} {'vs torch-pinned':>16} {'vs pageable':>12} {'reg ms/GiB':>11}"
    )
    for r in rows:
        reg = r["register_ms_per_gib"]
        print(
            f"{r['size_mb']:>5} {r['arena_pinned_gbps']:>10.1f}GB/s "
            f"{r['arena_unpinned_gbps']:>12.1f}GB/s"
            f" {r['torch_pinned_gbps']:>10.1f}GB/s {r['pageable_gbps']:>6.1f}GB/s"
            f" {r['pinned_arena_vs_torch_pinned']:>15.2f}x {r['pinned_arena_vs_pageable']:>11.2f}x"
            f" {reg if reg is None else round(reg, 1):>11}"
            f"  pinned={r['arena_pinned_is_pinned']} bytes_ok={r['arena_pinned_bytes_ok']}"
        )
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "gpu_h2d.json"), "w") as f:
        json.dump(result, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
