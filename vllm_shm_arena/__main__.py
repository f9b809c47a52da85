"""``python -m vllm_shm_arena <command>``: ``cleanup`` removes stale shared-memory segments."""

from __future__ import annotations

import sys


def main(argv: list[str]) -> int:
    """Dispatches to a command; prints the usage for anything else."""
    if argv and argv[0] == "cleanup":
        from vllm_shm_arena.cleanup import main as cleanup_main

        return cleanup_main(argv[1:])
    print("usage: python -m vllm_shm_arena cleanup [--dry-run] [--dir DIR]", file=sys.stderr)
    return 2


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
