#!/usr/bin/env bash
# Builds and runs the torch-free GPU probe (see gpu_probe.cu). Output goes to stdout and to
# ${OUT:-/tmp}/gpu_probe.txt. Needs nvcc and one GPU; no network, no torch.
#   BUILD_ONLY=1 benchmarks/gpu_probe/build_and_run.sh   # compile only (works without a GPU)
set -u
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
ROOT="$(cd "$HERE/../.." && pwd)"
OUTDIR="${OUT:-/tmp}"
mkdir -p "$OUTDIR"
LOG="$OUTDIR/gpu_probe.txt"
BUILD="${BUILD_DIR:-/tmp/vsa_gpu_probe}"
mkdir -p "$BUILD"
NVCC="${NVCC:-$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)}"
# nvcc may be a wrapper script, so look for the toolkit that holds libcudart.
for c in "${CUDA_HOME:-}" /usr/local/cuda "$(dirname "$(dirname "$(readlink -f "$NVCC")")")"; do
  if [ -n "$c" ] && ls "$c"/lib64/libcudart.so* >/dev/null 2>&1; then CUDA_HOME="$c"; break; fi
done
CUDA_HOME="${CUDA_HOME:-/usr/local/cuda}"
BIN="$BUILD/gpu_probe"

# The shared runtime, so that the core's CudaRuntime::find() sees a loaded libcudart.so*.
LINK=(-cudart shared -Xlinker -rpath -Xlinker "$CUDA_HOME/lib64" -ldl -lpthread)
CORE=(-DVSA_PROBE_WITH_CORE=1 -DVSA_HAVE_CUDA_HEADERS=1 -I"$ROOT/csrc"
      "$ROOT/csrc/core/cuda_shim.cpp" "$ROOT/csrc/core/pin_registry.cpp"
      "$ROOT/csrc/core/release_gate.cpp")

build() {  # build <description> <nvcc args...>
  local what="$1"
  shift
  echo "build ($what): $NVCC -O2 -std=c++17 $* -o $BIN gpu_probe.cu ${LINK[*]}"
  "$NVCC" -O2 -std=c++17 "$@" -o "$BIN" "$HERE/gpu_probe.cu" "${LINK[@]}" >"$BUILD/build.log" 2>&1
  local rc=$?
  [ $rc -ne 0 ] && tail -20 "$BUILD/build.log"
  return $rc
}

{
  echo "# gpu_probe $(date -u +%Y-%m-%dT%H:%M:%SZ) on $(hostname)"
  "$NVCC" --version | tail -1
  build "sm_90 + core" -arch=sm_90 "${CORE[@]}" ||
    build "core" "${CORE[@]}" ||
    build "sm_90, probe only" -arch=sm_90 ||
    build "probe only" ||
    { echo "RESULT: build failed"; exit 1; }
  if [ "${BUILD_ONLY:-0}" = 1 ]; then
    echo "built $BIN"
    exit 0
  fi
  command -v nvidia-smi >/dev/null &&
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  timeout 300 "$BIN"
  echo "exit $?"
} 2>&1 | tee "$LOG"
exit "${PIPESTATUS[0]}"
