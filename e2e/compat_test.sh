#!/usr/bin/env bash
# `make compat-test`: builds and smoke-tests this package against each torch release a vLLM
# user may have, installed the way a user installs it. Not part of `make test` (each torch is
# a venv of 1-6 GB; the first run downloads and takes long).
#
# For each version in COMPAT_TORCH_VERSIONS: a venv under COMPAT_DIR (.compat/) holding that
# torch, numpy, pyzmq, pytest and pytest-timeout (made once, reused while its stamp matches);
# this checkout installed into it with `pip install <checkout>` and pip's defaults (build
# isolation on), which must build against that venv's torch and leave it in place; then
# e2e/compat_smoke.py (import, arena write/get, a MessageQueue round trip with the arena
# on) and the fastest test files run against the installed copy, from a directory holding no
# source tree. Prints a table at the end and writes it to COMPAT_DIR/compat.md.
#
# COMPAT_SETUP_ONLY=1 makes the venvs and stops. Exits non-zero when any cell failed.
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)

VERSIONS=${COMPAT_TORCH_VERSIONS:-"2.11.0 2.13.0 2.14.1"}
DIR=${COMPAT_DIR:-.compat}
PYTHON=${PYTHON:-python3}
# The quickest test files that still cover the arena, the bindings, the pickler and the queue.
TEST_FILES=${COMPAT_TEST_FILES:-"test_bindings.py test_bad_input.py test_arena.py test_pickler.py"}
export MAX_JOBS=${MAX_JOBS:-2}
mkdir -p "$DIR"
DIR=$(cd "$DIR" && pwd)

make_venv() {
  local v=$1 venv=$2
  local want="torch==$v numpy pyzmq pytest pytest-timeout"
  if [ "$(cat "$venv/.compat-stamp" 2>/dev/null)" = "$want" ]; then return 0; fi
  echo "compat: creating $venv ($want)"
  rm -rf "$venv"
  "$PYTHON" -m venv "$venv" || return 1
  "$venv/bin/python" -m pip install -q --upgrade pip || return 1
  # shellcheck disable=SC2086
  "$venv/bin/python" -m pip install -q $want || return 1
  echo "$want" >"$venv/.compat-stamp"
}

rows=()
failed=0
for v in $VERSIONS; do
  venv="$DIR/torch-$v"
  log="$DIR/torch-$v.log"
  : >"$log"
  if ! make_venv "$v" "$venv" >>"$log" 2>&1; then
    rows+=("| $v | - | - | venv setup failed (see $log) | - |")
    failed=1
    continue
  fi
  [ "${COMPAT_SETUP_ONLY:-0}" = 1 ] && continue
  py="$venv/bin/python"
  torch_before=$("$py" -c 'import torch; print(torch.__version__)')

  # Installed as a user would: a fresh install (no cached wheel of ours), pip's defaults.
  "$py" -m pip uninstall -q -y vllm-shm-arena >>"$log" 2>&1
  t0=$(date +%s.%N)
  if "$py" -m pip install -v --no-cache-dir "$ROOT" >>"$log" 2>&1; then
    install="ok"
  else
    install="FAILED"
  fi
  t1=$(date +%s.%N)
  build_s=$(printf '%.0f' "$(echo "$t1 - $t0" | bc)")
  torch_after=$("$py" -c 'import torch; print(torch.__version__)')
  if [ "$install" = ok ] && [ "$torch_after" != "$torch_before" ]; then
    install="ok, but torch $torch_before was replaced by $torch_after"
    failed=1
  fi
  if grep -q "Downloading torch-\|Collecting torch" "$log"; then
    install="$install; a torch was downloaded for the build"
    failed=1
  fi

  std="-"
  smoke="not run"
  if [ "$install" = ok ]; then
    tmp=$(mktemp -d)
    # The tests import the package from the directory above tests/ (conftest's REPO): a copy
    # without the package makes them use the installed one.
    mkdir -p "$tmp/tests"
    cp -r tests/python "$tmp/tests/python"
    cp pyproject.toml "$tmp/"
    std=$(cd "$tmp" && "$py" -P -c 'from vllm_shm_arena import _build_info as b; print("C++" + str(b.CXX_STANDARD))' 2>>"$log" || echo "?")
    if (cd "$tmp" && "$py" -P "$ROOT/e2e/compat_smoke.py") >>"$log" 2>&1; then
      files=""
      for f in $TEST_FILES; do files="$files tests/python/$f"; done
      # shellcheck disable=SC2086
      if out=$(cd "$tmp" && "$py" -P -m pytest -q -p no:cacheprovider $files 2>&1); then
        smoke="ok; $(echo "$out" | grep -E '(passed|failed)' | tail -n1)"
      else
        smoke="pytest FAILED: $(echo "$out" | grep -E '(passed|failed|error)' | tail -n1)"
        failed=1
      fi
      echo "$out" >>"$log"
    else
      smoke="smoke FAILED (see $log)"
      failed=1
    fi
    rm -rf "$tmp"
  else
    failed=1
  fi
  rows+=("| $torch_before | $std | $build_s | $install | $smoke |")
done

[ "${COMPAT_SETUP_ONLY:-0}" = 1 ] && exit $failed
{
  echo "| torch | C++ std | build s | install (pip install <checkout>, pip defaults) | smoke |"
  echo "|---|---|---:|---|---|"
  printf '%s\n' "${rows[@]}"
} | tee "$DIR/compat.md"
exit $failed
