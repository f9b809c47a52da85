#!/usr/bin/env bash
# The GPU checks, in one go, for a machine with an NVIDIA GPU (e.g. the lent H200: Python 3.12,
# torch cu130, nvcc, no network, no vLLM). Builds the extension there against that machine's
# torch, runs the CUDA tests and the GPU benchmarks, and writes everything to $OUT (default
# benchmarks/results/gpu). Failures are recorded, not fatal. What the host lacks travels in
# .whl/, made here by scripts/gpu_bundle.sh: pyzmq and friends as wheels, and vLLM's queue as
# its Python files only (vllm-queue-py.tar.gz), for the comparison against vLLM's own queue.
#
# Sections, most important first; each gets its own timeout, cut to what is left of BUDGET_S
# (default 540 s: the device runs one command for at most 10 minutes) and skipped when less
# than 20 s is left. CONSUME=cpu runs the same script on a machine without a GPU (a dry run).
# ONLY (an extended regular expression) runs only the sections whose names match it, for a
# second, shorter run in what is left of a session's device time. VS_TP and VS_ONLY (comma-
# separated workload prefixes) narrow the comparison with vLLM's queue (defaults: TP 1 4 8;
# 8 MiB, 200 MiB, burst, the 1024^2 image, the scheduler step); one cell takes 10-15 s
# there, each reader being a spawned process.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-benchmarks/results/gpu}
mkdir -p "$OUT"
PY=${PY:-python3}
CONSUME=${CONSUME:-cuda}
BUDGET_S=${BUDGET_S:-540}
DEADLINE=$(($(date +%s) + BUDGET_S))
export PYTHONUNBUFFERED=1
log() { echo "== $*"; }
# budget WANT: seconds a section may take (WANT, or what is left), 0 when it must be skipped.
budget() {
  local left=$((DEADLINE - $(date +%s) - 10))
  if [ "$left" -lt 20 ]; then echo 0; elif [ "$left" -lt "$1" ]; then echo "$left"; else echo "$1"; fi
}
# section NAME WANT CMD...: runs CMD under the budget, or says it was skipped.
section() {
  local name=$1 want=$2 t
  shift 2
  if [ -n "${ONLY:-}" ] && ! [[ $name =~ $ONLY ]]; then
    log "$name: not in ONLY"
    return 0
  fi
  t=$(budget "$want")
  if [ "$t" -eq 0 ]; then
    log "$name: skipped (budget of ${BUDGET_S} s spent)"
    return 0
  fi
  log "$name (timeout ${t} s)"
  timeout "$t" "$@"
  local rc=$?
  [ "$rc" -eq 0 ] || log "$name: rc=$rc"
}

{
  log "machine"
  uname -r
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  $PY -c "import torch, sys; print('torch', torch.__version__, 'python', sys.version.split()[0])"
  nproc; df -h /dev/shm | tail -1
} 2>&1 | tee "$OUT/build.log"

if ls .whl/*.whl >/dev/null 2>&1; then
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi

log "build"
start=$(date +%s)
MAX_JOBS=$(nproc) $PY -m pip install -q --no-build-isolation --no-deps -e . >>"$OUT/build.log" 2>&1
echo "build rc=$? in $(($(date +%s) - start)) s" | tee -a "$OUT/build.log"

cmake -S tests/cpp -B build/cpp >/dev/null 2>&1 && cmake --build build/cpp -j"$(nproc)" \
  --target fakecudart copy_bench >/dev/null 2>&1

# A crash in the arena's write on this host is the first thing to know, with its backtrace
# (cuda-gdb debugs host code where gdb is absent, as on the lent H200).
log "arena write smoke"
if ! timeout 60 $PY benchmarks/gpu_probe/arena_write_smoke.py 1 8 64 >"$OUT/write_smoke.txt" 2>&1; then
  cat "$OUT/write_smoke.txt"
  dbg=$(command -v gdb || command -v cuda-gdb || ls /usr/local/cuda/bin/cuda-gdb 2>/dev/null)
  if [ -n "$dbg" ]; then
    timeout 120 "$dbg" -q -batch -ex run -ex bt -ex "info registers rip" --args $PY \
      benchmarks/gpu_probe/arena_write_smoke.py 1 8 64 2>&1 | grep -v "^\[New Thread\|^\[Thread" |
      tail -60 | tee -a "$OUT/write_smoke.txt"
  fi
  for t in 1 2; do
    echo "-- again with $t copy thread(s)" | tee -a "$OUT/write_smoke.txt"
    timeout 60 $PY benchmarks/gpu_probe/arena_write_smoke.py 1 8 64 --threads $t 2>&1 | tail -4 |
      tee -a "$OUT/write_smoke.txt"
  done
fi
tail -3 "$OUT/write_smoke.txt"

section "cuda tests" 90 $PY -m pytest -q -p no:cacheprovider -rs tests/python/test_cuda_gpu.py \
  tests/python/test_cuda_fake.py tests/python/mq/test_forwarding.py 2>&1 | tee "$OUT/cuda_tests.txt"

section "gpu_h2d" 60 $PY benchmarks/gpu_h2d.py --out "$OUT" 2>&1 | tee "$OUT/gpu_h2d.txt"

section "broadcast A/B with H2D consumers" 120 $PY benchmarks/broadcast_ab.py --consume "$CONSUME" \
  --tp 1 4 --sizes 8 200 --modes oob arena --messages 10 --warmup 8 --small-messages 100 \
  --workloads --out "$OUT" 2>&1 | grep -v "it/s]" | tee "$OUT/broadcast_ab_cuda.txt"

# Ours vs vLLM's own queue (stock and its arena), readers copying to the GPU, and the
# tensor-free messages every decode step pays, on this many-core host. vLLM is loaded from its
# Python files alone; if that does not import here, the error is the result.
if [ -f .whl/vllm-queue-py.tar.gz ]; then
  mkdir -p /tmp/vllm_py && tar -C /tmp/vllm_py -xzf .whl/vllm-queue-py.tar.gz
  export PYTHONPATH=/tmp/vllm_py${PYTHONPATH:+:$PYTHONPATH}
fi
if [ -n "${VS_ONLY:-}" ]; then IFS=, read -r -a VS_ONLY <<<"$VS_ONLY"; else
  VS_ONLY=("8 MiB" "200 MiB" burst "pixel_values 1024" scheduler)
fi
if $PY -c "from vllm.distributed.device_communicators.shm_broadcast import MessageQueue" \
  >"$OUT/vllm_import.txt" 2>&1; then
  echo "vLLM's MessageQueue imports from its Python files" | tee -a "$OUT/vllm_import.txt"
  section "vs vLLM's queue" 170 $PY benchmarks/bench_vs_vllm.py --consume "$CONSUME" \
    --tp ${VS_TP:-1 4 8} --repeats 1 --only "${VS_ONLY[@]}" --out "$OUT/vs_vllm" 2>&1 | grep -v "^\[" | tee "$OUT/vs_vllm.txt"
else
  log "vs vLLM's queue: not possible here, vLLM's queue does not import (vllm_import.txt):"
  tail -n 3 "$OUT/vllm_import.txt"
fi

# Copy threads and streaming stores where there are CPUs to spare.
section "copy_bench" 40 ./build/cpp/copy_bench 5 2>&1 | tee "$OUT/copy_bench.txt"
section "copy threads A/B" 45 $PY benchmarks/broadcast_ab.py --copy-threads-ab 4 --tp 1 4 \
  --sizes 64 200 --messages 12 --warmup 4 --consume "$CONSUME" --out "$OUT" 2>&1 |
  tee "$OUT/copy_threads_ab.txt"
section "streaming stores A/B" 45 $PY benchmarks/broadcast_ab.py --stream-ab --tp 1 4 \
  --sizes 16 64 200 --messages 12 --warmup 4 --consume "$CONSUME" --out "$OUT" 2>&1 |
  tee "$OUT/stream_ab.txt"
log "done in $((BUDGET_S - (DEADLINE - $(date +%s)))) s"
