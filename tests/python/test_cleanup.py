"""The stale-segment cleaner (``python -m vllm_shm_arena cleanup``).

Every test uses a private shm directory. A "crashed writer" is a child process that creates
segments and ``os._exit``s before ``wait_until_ready`` would have unlinked them.
"""

from __future__ import annotations

import os
import re
import stat
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from vllm_shm_arena._ext import _C
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


def _segments(reports) -> list:
    """The arena and ring reports. A queue's socket directory is judged on its own token (see
    the SocketDir tests below), whatever the queue names it, so queue tests leave it out."""
    return [r for r in reports if r.kind in ("arena", "ring")]


def test_a_crashed_writers_segments_are_removed_and_dry_run_removes_nothing(tmp_path):
    out = _py(CRASHED_WRITER, tmp_path)
    assert out.returncode == 0, out.stderr
    left = _vsa_names(tmp_path)
    dry = remove_stale_resources(str(tmp_path), dry_run=True)
    assert sorted(r.kind for r in _segments(dry)) == ["arena", "ring"]
    assert all(r.writer == "dead" and not r.removed for r in _segments(dry))
    assert not any(r.removed for r in dry)
    assert _vsa_names(tmp_path) == left
    done = remove_stale_resources(str(tmp_path))
    assert all(r.removed for r in _segments(done))
    # What may remain is the queue's socket directory, and only if it is not a SocketDir.
    assert all(n.startswith("vsa_sock_") for n in _vsa_names(tmp_path)), _vsa_names(tmp_path)


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
        live = _segments(reports.values())
        assert len(live) == 2 and all(r.writer == "alive" and not r.removed for r in live)
        assert not any(r.removed for r in reports.values() if r.kind == "socket")
        for name in ("vsa_garbage", "vsa_short", "vsa_dir"):
            assert reports[name].writer == "unknown" and not reports[name].removed, reports[name]
        assert "unrelated" not in reports
        assert len(_vsa_names(tmp_path)) == 6
    finally:
        p.stdin.close()
        p.wait(timeout=60)
    # Once the writer is gone, its two segments are stale and go.
    reports = remove_stale_resources(str(tmp_path))
    assert sorted(r.kind for r in reports if r.removed and r.kind != "socket") == ["arena", "ring"]


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
    left = _vsa_names(tmp_path)
    dry = subprocess.run([*cmd, "--dry-run"], env=env, capture_output=True, text=True, timeout=60)
    assert dry.returncode == 0, dry.stderr
    stale = [line for line in dry.stdout.splitlines() if line.startswith("would remove (stale)")]
    assert sum(" arena " in line or " ring " in line for line in stale) == 2, dry.stdout
    assert _vsa_names(tmp_path) == left
    real = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=60)
    assert real.returncode == 0, real.stderr
    removed = int(re.search(r"(\d+) removed", real.stdout).group(1))
    assert removed >= 2 and removed == len(left) - len(_vsa_names(tmp_path)), real.stdout
    assert all(n.startswith("vsa_sock_") for n in _vsa_names(tmp_path)), real.stdout
    bad = subprocess.run(
        [sys.executable, "-m", "vllm_shm_arena"], env=env, capture_output=True, text=True
    )
    assert bad.returncode == 2 and "usage" in bad.stderr


CRASHED_SOCKET_DIR = """
    import os
    from vllm_shm_arena._ext import _C
    sd = _C.SocketDir("")  # "" = $VLLM_SHM_ARENA_SHM_DIR
    print(sd.path, flush=True)
    os._exit(0)  # crashes holding it: the directory stays, its token free
"""


def test_a_socket_dir_is_fresh_and_private_and_remove_is_idempotent(tmp_path):
    sut = _C.SocketDir(str(tmp_path))
    other = _C.SocketDir(str(tmp_path))
    assert sut.path != other.path
    assert re.fullmatch(r"vsa_sock_[0-9a-f]{32}", os.path.basename(sut.path)), sut.path
    assert os.path.dirname(sut.path) == str(tmp_path)
    assert sut.socket_path == sut.path + "/s"
    st = os.lstat(sut.path)
    assert stat.S_ISDIR(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o700
    assert st.st_uid == os.geteuid()
    assert os.listdir(sut.path) == ["token"]
    sut.unlink_socket()  # nothing bound yet: still fine
    sut.remove()
    sut.remove()
    assert not os.path.exists(sut.path)
    del other  # the destructor removes it too
    assert _vsa_names(tmp_path) == []


def test_socket_dir_errors_are_typed(tmp_path):
    with pytest.raises(OSError, match="shm directory"):
        _C.SocketDir("/nonexistent-vsa-dir")
    with pytest.raises(ValueError, match="too long for a unix socket"):
        _C.SocketDir("/" + "x" * 100)


def test_a_forked_childs_copy_of_a_socket_dir_removes_nothing(tmp_path):
    sut = _C.SocketDir(str(tmp_path))
    pid = os.fork()
    if pid == 0:
        sut.remove()
        os._exit(0 if os.path.exists(sut.path + "/token") else 1)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert os.listdir(sut.path) == ["token"]
    sut.remove()


def test_a_crashed_socket_dir_is_removed_and_live_or_foreign_ones_are_kept(tmp_path):
    out = _py(CRASHED_SOCKET_DIR, tmp_path)
    assert out.returncode == 0, out.stderr
    dead = os.path.basename(out.stdout.strip())
    live = _C.SocketDir(str(tmp_path))
    os.mkdir(tmp_path / "vsa_sock_notes")
    (tmp_path / "vsa_sock_notes" / "todo.txt").write_text("keep me")
    dry = {r.name: r for r in remove_stale_resources(str(tmp_path), dry_run=True)}
    assert dry[dead].kind == "socket" and dry[dead].writer == "dead" and not dry[dead].removed
    assert (tmp_path / dead / "token").exists()
    reports = {r.name: r for r in remove_stale_resources(str(tmp_path))}
    assert set(reports) == {dead, os.path.basename(live.path), "vsa_sock_notes"}
    assert reports[dead].removed and not (tmp_path / dead).exists()
    mine = reports[os.path.basename(live.path)]
    assert mine.writer == "alive" and not mine.removed
    assert (tmp_path / os.path.basename(live.path) / "token").exists()
    notes = reports["vsa_sock_notes"]
    assert notes.writer == "unknown" and not notes.removed and notes.why
    assert (tmp_path / "vsa_sock_notes" / "todo.txt").read_text() == "keep me"
    live.remove()
