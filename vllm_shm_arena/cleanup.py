"""Removing what crashed writers left in the shared-memory directory.

A queue unlinks its ring and arena names once every reader attached, so a healthy run leaves
nothing behind; a writer that crashes (or ``os._exit``s) before ``wait_until_ready`` leaves its
segments (an arena is 2 GiB of sparse file). ``remove_stale_resources`` removes a segment only
when it has the project's name prefix, is a regular file of this user, carries an arena's or a
ring's magic number and this build's layout version (the one with liveness tokens), and its
writer's kernel-held token is free: the writer is provably gone. A queue's socket directory
(``vsa_sock_<32 hex>``, made by ``_C.SocketDir``) is removed only when its name has exactly that
form, it is a directory of this user (never a symlink followed) holding nothing but its
``token`` (a regular file of this user) and optionally the socket ``s``, and the token is free:
its creator is provably gone. Everything else is kept and reported as unknown, with the reason.

    python -m vllm_shm_arena cleanup [--dry-run] [--dir /dev/shm]
"""

from __future__ import annotations

import dataclasses

from vllm_shm_arena._ext import _C


@dataclasses.dataclass(frozen=True)
class SegmentReport:
    """What the cleaner found for one name in the shm directory."""

    name: str
    kind: str  # "arena", "ring", "socket" (a socket directory's name), or "" (unrecognised)
    writer: str  # "dead" (stale), "alive", or "unknown" (kept)
    removed: bool
    why: str  # for "unknown": what was not as expected

    def line(self, dry_run: bool) -> str:
        """One human-readable line for the command's output."""
        kind = self.kind or "?"
        if self.writer == "dead":
            what = "would remove (stale)" if dry_run else ("removed" if self.removed else "kept")
            tail = f" ({self.why})" if self.why and not self.removed and not dry_run else ""
            return f"{what:<21} {kind:<6} {self.name}{tail}"
        if self.writer == "alive":
            return f"{'kept (writer alive)':<21} {kind:<6} {self.name}"
        return f"{'kept (unknown)':<21} {kind:<6} {self.name}: {self.why}"


def remove_stale_resources(shm_dir: str | None = None, dry_run: bool = False) -> list:
    """Removes stale arena and ring segments and abandoned socket directories from ``shm_dir``
    (default: the shm directory the package uses, ``$VLLM_SHM_ARENA_SHM_DIR`` or ``/dev/shm``)
    and returns one ``SegmentReport`` per ``vsa_*`` name seen. With ``dry_run`` nothing is
    removed."""
    d = shm_dir or _C.default_shm_dir()
    return [SegmentReport(*r) for r in _C.remove_stale_segments(d, bool(dry_run))]


def main(argv: list[str] | None = None) -> int:
    """``python -m vllm_shm_arena cleanup``: prints a line per segment; exit code 0."""
    import argparse

    p = argparse.ArgumentParser(
        prog="python -m vllm_shm_arena cleanup",
        description="Remove arena and ring segments (and queue socket directories) whose "
        "writer is provably dead.",
    )
    p.add_argument("--dry-run", action="store_true", help="list, remove nothing")
    p.add_argument(
        "--dir", default=None, help="shm directory (default: $VLLM_SHM_ARENA_SHM_DIR or /dev/shm)"
    )
    args = p.parse_args(argv)
    reports = remove_stale_resources(args.dir, args.dry_run)
    for r in reports:
        print(r.line(args.dry_run))
    stale = sum(r.writer == "dead" for r in reports)
    removed = sum(r.removed for r in reports)
    verb = "stale" if args.dry_run else "removed"
    print(
        f"{len(reports)} segment(s): {stale if args.dry_run else removed} {verb}, "
        f"{len(reports) - stale} kept"
    )
    return 0
