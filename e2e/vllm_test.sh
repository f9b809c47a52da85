#!/usr/bin/env bash
# `make vllm-test`: runs tests/python/test_vllm_real.py (and the vLLM cases of
# tests/python/test_frontend.py and test_vllm_frontend.py) against the real vLLM wheel.
#
# Builds .venv-vllm once (torch, the vLLM wheel without its dependencies, and exactly the
# packages that importing vllm.v1.executor.multiproc_executor needs on a CPU-only machine; see
# docs/notes/vllm_integration_notes.md section 6), builds our extension for that venv's torch, and
# runs the tests marked `vllm`. Later runs reuse the venv and only rebuild the extension when a
# C++ source changed. Extra arguments go to pytest.
#
# The extension is built in place (`pip install -e .`), so .venv and .venv-vllm share
# vllm_shm_arena/_C*.so: both pin the same torch, which is what makes one build serve both.
set -euo pipefail
cd "$(dirname "$0")/.."

VLLM_VERSION=${VLLM_VERSION:-0.33.0}
TORCH_VERSION=${TORCH_VERSION:-2.13.0}
VENV=${VLLM_VENV:-.venv-vllm}
PY="$VENV/bin/python"

# What `import vllm.v1.executor.multiproc_executor` needs beyond torch/pyzmq/numpy, in the
# order the ImportErrors appeared (vLLM's full requirement list pulls in CUDA wheels).
DEPS=(
  packaging psutil 'pyzmq>=25.0.0' urllib3 regex numpy
  'pydantic>=2.12.0' cbor2 'transformers>=5.16.1,<5.21.0' 'aiohttp>=3.14.4'
  'requests>=2.33.0' 'oss-harmony>=0.0.11' 'openai>=2.25.0' 'pillow>=13.0.0' pybase64
  cachetools msgspec cloudpickle uvloop py-cpuinfo 'prometheus_client>=0.18.0'
  'xgrammar==0.2.8' 'fastapi>=0.133.0,<0.137.0' partial-json-parser 'llguidance>=1.7.0,<1.8.0'
)

if [ ! -x "$PY" ]; then
  echo "vllm-test: creating $VENV"
  python3 -m venv "$VENV"
fi

stamp="$VENV/.vllm-test-stamp"
want="vllm==$VLLM_VERSION torch==$TORCH_VERSION ${DEPS[*]}"
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  echo "vllm-test: installing torch==$TORCH_VERSION, vllm==$VLLM_VERSION (--no-deps) and its import deps"
  "$PY" -m pip install -q --upgrade pip
  "$PY" -m pip install -q "torch==$TORCH_VERSION" pyzmq pytest numpy setuptools wheel ninja
  dl=$(mktemp -d)
  trap 'rm -rf "$dl"' EXIT
  "$PY" -m pip download -q --no-deps "vllm==$VLLM_VERSION" -d "$dl"
  "$PY" -m pip install -q --no-deps "$dl"/vllm-*.whl
  # The constraint keeps a dependency from swapping torch under the extension.
  "$PY" -m pip install -q "${DEPS[@]}" "torch==$TORCH_VERSION"
  echo "$want" > "$stamp"
fi

# (Re)build when the package is not installed here (its vllm.general_plugins entry point
# comes with the install), the extension does not load, or a C++ source is newer.
so=$(ls vllm_shm_arena/_C*.so 2>/dev/null | head -n1 || true)
if [ -z "$so" ] || ! "$PY" -c "import vllm_shm_arena._ext" >/dev/null 2>&1 \
  || ! "$PY" -c "import importlib.metadata as m; m.version('vllm-shm-arena')" >/dev/null 2>&1 \
  || [ -n "$(find csrc setup.py -newer "$so" -type f 2>/dev/null | head -n1)" ]; then
  echo "vllm-test: building the extension (pip install --no-build-isolation -e .)"
  MAX_JOBS=${MAX_JOBS:-2} "$PY" -m pip install -q --no-build-isolation --no-deps -e .
  touch vllm_shm_arena/_C*.so
fi

"$PY" -c "import vllm, torch; print(f'vllm-test: vllm {vllm.__version__}, torch {torch.__version__}')"
# e2e/vllm_queue_tests.sh uses this script to build the venv only.
if [ "${VLLM_TEST_SETUP_ONLY:-0}" = 1 ]; then exit 0; fi
exec "$PY" -m pytest -q -p no:cacheprovider -m vllm tests/python/test_vllm_real.py tests/python/test_frontend.py tests/python/test_vllm_frontend.py "$@"
