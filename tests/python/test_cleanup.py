"""The stale-segment cleaner (``python -m vllm_shm_arena cleanup``).

Every test uses a private shm directory. A "crashed writer" is a child process that creates
segments and ``os._exit``s before ``wait_until_ready`` would have unlinked them.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

from vllm_shm_arena.cleanup import remove_stale_resources

REPO = Path(__file__).resolve().parents[2]


def _py(code: str, shm_dir, timeout: float = 120) -> subprocess.CompletedProcess:
    env = dict(os.environ, VLLM_SHM_ARENA_SHM_DIR=str(shm_dir))
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")])
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


CRASHED_WRITER = """
    import os
    from vllm_shm_arena import MessageQueue
    mq = MessageQueue(2, 2, enable_shm_tensor_arena=True)
    os._exit(0)  # crashes before wait_until_ready: its ring and arena stay behind
"""


def _vsa_names(d) -> list[str]:
    return sorted(n for n in os.listdir(d) if n.startswith("vsa_"))


def test_a_crashed_writers_segments_are_removed_and_dry_run_removes_nothing(tmp_path):
    out = _py(CRASHED_WRITER, tmp_path)
    assert out.returncode == 0, out.stderr
    left = _vsa_names(tmp_path)
    assert len(left) == 3, left  # one ring, one arena, the ring's local socket directory
    dry = remove_stale_resources(str(tmp_path), dry_run=True)
    assert sorted(r.kind for r in dry) == ["arena", "ring", "socket"]
    assert all(r.writer == "dead" and not r.removed for r in dry)
    assert _vsa_names(tmp_path) == left
    done = remove_stale_resources(str(tmp_path))
    assert all(r.removed for r in done)
    assert _vsa_names(tmp_path) == []


def test_a_live_writers_segments_and_unknown_files_are_kept(tmp_path):
    # A live writer: a child that created a queue and waits on stdin.
    code = """
        import sys
        from vllm_shm_arena import MessageQueue
        mq = MessageQueue(1, 1, enable_shm_tensor_arena=True)
        print("ready", flush=True)
        sys.stdin.readline()
        import os
        os._exit(0)  # dies as the writer, before any reader joined: its names stay
    """
    env = dict(os.environ, VLLM_SHM_ARENA_SHM_DIR=str(tmp_path))
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")])
    p = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(code)],
        env=env,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert p.stdout.readline().strip() == "ready"
        (tmp_path / "vsa_garbage").write_bytes(b"\0" * 8192)  # no magic
        (tmp_path / "vsa_short").write_bytes(b"VSA")  # too short for a header
        (tmp_path / "unrelated").write_bytes(b"keep me")  # not ours at all
        os.mkdir(tmp_path / "vsa_dir")
        reports = {r.name: r for r in remove_stale_resources(str(tmp_path))}
        live = [r for r in reports.values() if r.kind]
        assert len(live) == 3 and all(r.writer == "alive" and not r.removed for r in live)
        for name in ("vsa_garbage", "vsa_short", "vsa_dir"):
            assert reports[name].writer == "unknown" and not reports[name].removed, reports[name]
        assert "unrelated" not in reports
        assert len(_vsa_names(tmp_path)) == 6
    finally:
        p.stdin.close()
        p.wait(timeout=60)
    # Once the writer is gone, its two segments (and its socket directory) are stale and go.
    reports = remove_stale_resources(str(tmp_path))
    assert sum(r.removed for r in reports) == 3


def test_a_segment_of_another_layout_version_is_kept(tmp_path):
    out = _py(CRASHED_WRITER, tmp_path)
    assert out.returncode == 0, out.stderr
    arena = next(r.name for r in remove_stale_resources(str(tmp_path), True) if r.kind == "arena")
    with open(tmp_path / arena, "r+b") as f:
        f.seek(8)
        f.write((1).to_bytes(4, "little"))  # layout version 1: pid identities, no tokens
    reports = {r.name: r for r in remove_stale_resources(str(tmp_path))}
    assert reports[arena].writer == "unknown" and "layout version 1" in reports[arena].why
    assert (tmp_path / arena).exists()


def test_the_command_line(tmp_path):
    out = _py(CRASHED_WRITER, tmp_path)
    assert out.returncode == 0, out.stderr
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")])
    cmd = [sys.executable, "-m", "vllm_shm_arena", "cleanup", "--dir", str(tmp_path)]
    dry = subprocess.run([*cmd, "--dry-run"], env=env, capture_output=True, text=True, timeout=60)
    assert dry.returncode == 0, dry.stderr
    assert dry.stdout.count("would remove (stale)") == 3, dry.stdout
    assert len(_vsa_names(tmp_path)) == 3
    real = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=60)
    assert real.returncode == 0, real.stderr
    assert real.stdout.count("removed") >= 3 and "3 removed" in real.stdout, real.stdout
    assert _vsa_names(tmp_path) == []
    bad = subprocess.run(
        [sys.executable, "-m", "vllm_shm_arena"], env=env, capture_output=True, text=True
    )
    assert bad.returncode == 2 and "usage" in bad.stderr
