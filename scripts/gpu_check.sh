#!/usr/bin/env bash
# The GPU checks, in one go, for a machine with an NVIDIA GPU (e.g. the lent H200: Python 3.12,
# torch cu130, nvcc, no network; pyzmq comes as a wheel in .whl/). Builds the extension there
# against that machine's torch, runs the CUDA tests and the GPU benchmarks, and writes
# everything to $OUT (default benchmarks/results/gpu). Failures are recorded, not fatal.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-benchmarks/results/gpu}
mkdir -p "$OUT"
PY=${PY:-python3}
export PYTHONUNBUFFERED=1
log() { echo "== $*"; }

{
  log "machine"
  uname -r
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  $PY -c "import torch, sys; print('torch', torch.__version__, 'python', sys.version.split()[0])"
  nproc; df -h /dev/shm | tail -1
} 2>&1 | tee "$OUT/build.log"

if ls .whl/*.whl >/dev/null 2>&1; then
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
fi

log "build"
start=$(date +%s)
MAX_JOBS=$(nproc) $PY -m pip install -q --no-build-isolation --no-deps -e . >>"$OUT/build.log" 2>&1
echo "build rc=$? in $(($(date +%s) - start)) s" | tee -a "$OUT/build.log"

log "cuda tests"
cmake -S tests/cpp -B build/cpp >/dev/null 2>&1 && cmake --build build/cpp -j"$(nproc)" \
  --target fakecudart >/dev/null 2>&1
timeout 120 $PY -m pytest -q -p no:cacheprovider -rs tests/python/test_cuda_gpu.py \
  tests/python/test_cuda_fake.py 2>&1 | tee "$OUT/cuda_tests.txt"

log "gpu_h2d"
timeout 120 $PY benchmarks/gpu_h2d.py --out "$OUT" 2>&1 | tee "$OUT/gpu_h2d.txt"

log "broadcast A/B with H2D consumers"
timeout 240 $PY benchmarks/broadcast_ab.py --consume cuda --tp 1 4 --sizes 8 200 \
  --modes oob arena --messages 10 --warmup 8 --small-messages 100 --out "$OUT" 2>&1 |
  grep -v "it/s]" | tee "$OUT/broadcast_ab_cuda.txt"
log "done"
