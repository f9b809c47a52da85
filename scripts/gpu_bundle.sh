#!/usr/bin/env bash
# Packs what scripts/gpu_check.sh needs on a GPU host that has torch but no vLLM and no
# network, into .whl/ (carried to the host with the working tree; well under 64 MiB):
#
#   .whl/vllm-queue-py.tar.gz  only the Python files of vLLM 0.33.0 that importing and running
#                              its MessageQueue (shm_broadcast, arena on and off) loads, found
#                              by tracing sys.modules in .venv-vllm while bench_vs_vllm runs
#                              one cell of each vLLM mode; none of vLLM's compiled parts
#   .whl/*.whl                 pyzmq and the pure-Python or manylinux wheels those files import
#                              (psutil, regex, packaging, urllib3) for the host's Python
#
# Needs .venv-vllm (`VLLM_TEST_SETUP_ONLY=1 bash e2e/vllm_test.sh`). HOST_PY: the GPU
# host's Python version (default 3.12, the lent H200's).
set -euo pipefail
cd "$(dirname "$0")/.."
HOST_PY=${HOST_PY:-3.12}
VPY=${VLLM_VENV:-.venv-vllm}/bin/python
[ -x "$VPY" ] || { echo "gpu_bundle: $VPY missing; run VLLM_TEST_SETUP_ONLY=1 bash e2e/vllm_test.sh" >&2; exit 2; }
mkdir -p .whl

list=$(mktemp)
trap 'rm -f "$list"' EXIT
# One message through each of vLLM's modes (stock, its arena), then every vllm module loaded.
"$VPY" - "$list" <<'EOF'
import os, sys
sys.path.insert(0, "benchmarks")
import harness as ab
for mode in ("vllm-oob", "vllm-arena"):
    ab.run_cell(mode, 1, 8, 2, 1, 1234)
import vllm
root = os.path.dirname(os.path.dirname(vllm.__file__))
files = sorted({
    os.path.relpath(m.__file__, root)
    for name, m in list(sys.modules.items())
    if (name == "vllm" or name.startswith("vllm.")) and getattr(m, "__file__", None)
})
compiled = [f for f in files if not f.endswith(".py")]
assert not compiled, f"vLLM's queue loaded compiled parts: {compiled}"
with open(sys.argv[1], "w") as f:
    f.write(root + "\n" + "\n".join(files) + "\n")
print(f"gpu_bundle: {len(files)} vLLM Python files, no compiled parts")
EOF
root=$(head -n1 "$list")
tail -n +2 "$list" | tar -C "$root" -czf .whl/vllm-queue-py.tar.gz -T -

# The third-party modules those files import that a torch-only host may lack.
"$VPY" -m pip download -q --no-deps --only-binary=:all: --python-version "$HOST_PY" \
  --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 \
  -d .whl pyzmq psutil regex packaging urllib3
ls -l .whl
du -sh .whl
