#!/usr/bin/env bash
# `make vllm-queue-tests`: vLLM's own queue tests against our queue.
#
# Runs tests/distributed/test_shm_broadcast.py and test_mq_connect_ip.py from vLLM's sdist
# (VLLM_VERSION, default 0.33.0) with our MessageQueue, Handle, pickling functions and arena
# class in place of vLLM's (e2e/vllm_queue_tests/sitecustomize.py, on PYTHONPATH so that
# spawned and forked children swap too). Each file runs in its own pytest process under
# VSA_FILE_TIMEOUT seconds (each test under VSA_TEST_TIMEOUT); then passed / failed / skipped
# / not reached are printed per file and in total, with each failure's reason. VSA_SWAP=0
# runs the same files against vLLM's own classes (the baseline). Needs the .venv-vllm of
# e2e/vllm_test.sh (built on first use). Exit status: 1 if any test failed.
set -euo pipefail
cd "$(dirname "$0")/.."

VLLM_VERSION=${VLLM_VERSION:-0.33.0}
VENV=${VLLM_VENV:-.venv-vllm}
PY="$VENV/bin/python"
FILE_TIMEOUT=${VSA_FILE_TIMEOUT:-1200}
FILES=(test_shm_broadcast.py test_mq_connect_ip.py)

VLLM_TEST_SETUP_ONLY=1 bash e2e/vllm_test.sh
# `multiprocess`: imported by test_shm_broadcast.py. setuptools-rust/-scm, jinja2: what pip
# needs to read the sdist's metadata on download.
"$PY" -m pip install -q multiprocess setuptools-rust setuptools-scm jinja2

src="$VENV/vllm-src-$VLLM_VERSION"
if [ ! -f "$src/tests/distributed/test_shm_broadcast.py" ]; then
  dl=$(mktemp -d)
  # pip builds the sdist's metadata to check it. On a machine without CUDA vLLM's setup.py
  # would call the build "$VLLM_VERSION+cpu" (the override keeps the version exact) and list
  # a direct-URL triton-cpu requirement that pip refuses ("empty" target: no such line).
  VLLM_TARGET_DEVICE=empty VLLM_VERSION_OVERRIDE=$VLLM_VERSION "$PY" -m pip download -q \
    --no-deps --no-binary :all: --no-build-isolation "vllm==$VLLM_VERSION" -d "$dl"
  mkdir -p "$src"
  tar xzf "$dl/vllm-$VLLM_VERSION.tar.gz" -C "$src" --strip-components=1 \
    "${FILES[@]/#/vllm-$VLLM_VERSION/tests/distributed/}"
  rm -rf "$dl"
fi

run=$(mktemp -d)
# Our queue's shared memory goes to a private directory (vLLM's own classes, in the
# baseline and where a test builds them directly, use /dev/shm).
shm=$(mktemp -d /dev/shm/vsa-vllm-queue-tests.XXXXXX)
trap 'rm -rf "$run" "$shm"' EXIT
cp e2e/vllm_queue_tests/conftest.py "${FILES[@]/#/$src/tests/distributed/}" "$run/"
export PYTHONPATH="$PWD/e2e/vllm_queue_tests:$PWD${PYTHONPATH:+:$PYTHONPATH}"
export VLLM_SHM_ARENA_SHM_DIR="$shm"
export VSA_SWAP=${VSA_SWAP:-1}
echo "vllm-queue-tests: vLLM $VLLM_VERSION's queue tests, swap=$VSA_SWAP (1: our classes)"

results=()
for f in "${FILES[@]}"; do
  out="$run/${f%.py}.jsonl"
  : > "$out"
  results+=("$out")
  start=$(date +%s)
  rc=0
  VSA_RESULTS="$out" timeout -k 10 "$FILE_TIMEOUT" "$PY" -m pytest -q -p no:cacheprovider \
    --rootdir "$run" "$run/$f" > "$run/${f%.py}.log" 2>&1 || rc=$?
  note=""
  if [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; then note=" (killed by the $FILE_TIMEOUT s timeout)"; fi
  echo "vllm-queue-tests: $f: pytest exit $rc after $(( $(date +%s) - start )) s$note"
  if [ -n "${VSA_KEEP_LOGS:-}" ]; then cp "$run/${f%.py}.log" "$VSA_KEEP_LOGS/"; fi
done
"$PY" e2e/vllm_queue_tests/summary.py "${results[@]}"
