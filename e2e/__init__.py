"""End-to-end drivers (a real ``vllm serve``, vLLM's own queue tests, install compatibility)
and the two-node harness (``netns``) the tests and benchmarks share. The drivers run as scripts
from the repository root; tests and benchmarks import ``e2e.netns``."""
