#!/usr/bin/env bash
# Brings a fresh machine to the point where the benchmark and the tests can run:
# Debian packages (a C++ toolchain, CMake, Catch2), a .venv with the pinned Python packages,
# the C++ extension built in place, and the core's Catch2 test binary. Idempotent and quick
# when everything is already there.
set -euo pipefail
cd "$(dirname "$0")/.."

SUDO=""
if [ "$(id -u)" != 0 ] && command -v sudo >/dev/null; then SUDO=sudo; fi

need_apt=()
for pkg in catch2 cmake g++ make nftables; do
  dpkg -s "$pkg" >/dev/null 2>&1 || need_apt+=("$pkg")
done
if [ ${#need_apt[@]} -gt 0 ]; then
  echo "bootstrap: installing Debian packages: ${need_apt[*]}"
  $SUDO apt-get update -q
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -q "${need_apt[@]}"
fi

if [ ! -x .venv/bin/python ]; then
  echo "bootstrap: creating .venv"
  python3 -m venv .venv
fi
stamp=.venv/.requirements.sha
want=$(sha256sum requirements-dev.txt | cut -d' ' -f1)
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  echo "bootstrap: installing Python packages (requirements-dev.txt)"
  .venv/bin/python -m pip install -q --upgrade pip
  .venv/bin/python -m pip install -q -r requirements-dev.txt
  echo "$want" > "$stamp"
fi

# Rebuild the extension when any C++ source or the build script changed since the last build.
so=$(ls vllm_shm_arena/_C*.so 2>/dev/null | head -n1 || true)
if [ -z "$so" ] || [ -n "$(find csrc setup.py -newer "$so" -type f 2>/dev/null | head -n1)" ]; then
  echo "bootstrap: building the extension (pip install --no-build-isolation -e .)"
  MAX_JOBS=${MAX_JOBS:-2} .venv/bin/python -m pip install -q --no-build-isolation --no-deps -e .
  touch vllm_shm_arena/_C*.so
fi

# The core's C++ tests and the fake CUDA runtime.
cmake -S tests/cpp -B build/cpp -DCMAKE_BUILD_TYPE=RelWithDebInfo >/dev/null
cmake --build build/cpp -j"${MAX_JOBS:-2}" >/dev/null
