"""Writes tensors of the given sizes (MiB) into a fresh 4 x 64 MiB arena, printing each
result: the first thing scripts/gpu_check.sh runs on a GPU host, under cuda-gdb for a
backtrace when it crashes (on 2026-12-04 the 8 MiB write died with SIGSEGV on the H200 host:
benchmarks/results/gpu/2026-12-04/README.md).

    python benchmarks/gpu_probe/arena_write_smoke.py 1 8 64 [--cuda] [--threads N]
"""

import sys

import torch

if "--cuda" in sys.argv:
    torch.zeros(1, device="cuda")  # a CUDA context first, as a worker has
from vllm_shm_arena import (
    _C,  # noqa: E402
    ShmTensorArena,  # noqa: E402
)

if "--threads" in sys.argv:  # a fixed copy-thread count (1: no pool threads), to bisect a crash
    _C.set_copy_threads(int(sys.argv[sys.argv.index("--threads") + 1]))
    del sys.argv[sys.argv.index("--threads") : sys.argv.index("--threads") + 2]
w = ShmTensorArena.create(1, num_slots=4, slot_bytes=64 << 20)
for mib in (a for a in sys.argv[1:] if not a.startswith("--")):
    n = int(float(mib) * (1 << 20))
    print("write", n, w.write(torch.ones(n, dtype=torch.uint8)), flush=True)
print("ok", flush=True)
