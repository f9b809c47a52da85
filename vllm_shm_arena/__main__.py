"""``python -m vllm_shm_arena <command>``: ``check`` reports whether this environment is ready
for the arena; ``cleanup`` removes stale shared-memory segments."""

from __future__ import annotations

import sys

USAGE = (
    "usage: python -m vllm_shm_arena check [--json] [--dir DIR] [--readers N]\n"
    "       python -m vllm_shm_arena cleanup [--dry-run] [--dir DIR]"
)


def main(argv: list[str]) -> int:
    """Dispatches to a command; prints the usage for anything else."""
    if argv and argv[0] == "cleanup":
        from vllm_shm_arena.cleanup import main as cleanup_main

        return cleanup_main(argv[1:])
    if argv and argv[0] == "check":
        from vllm_shm_arena.check import main as check_main

        return check_main(argv[1:])
    print(USAGE, file=sys.stderr)
    return 2


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
