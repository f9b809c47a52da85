"""The examples run end to end (small arguments) and print what their docstrings promise."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def _run_example(name: str, *args: str) -> str:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")])
    p = subprocess.run(
        [sys.executable, str(REPO / "examples" / name), *args],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert p.returncode == 0, f"{name} exited {p.returncode}\n{p.stdout}\n{p.stderr}"
    return p.stdout


@pytest.mark.parametrize("start_method", ["spawn", "fork"])
def test_custom_executor(start_method):
    """Workers started either way see every tensor byte-exact and leave the engine's queue
    (which fork children inherit) alone."""
    out = _run_example(
        "custom_executor.py",
        "--workers",
        "2",
        "--steps",
        "3",
        "--mib",
        "9",
        "--start-method",
        start_method,
    )
    for step in range(3):
        assert re.search(rf"^step {step}: enqueue .* ms, .*, ok$", out, re.M), out
    # Every 9 MiB tensor went through the arena, none fell back.
    assert re.search(r"^arena: hits=3 bytes=28311552 declined=\{\}", out, re.M), out
    assert re.search(r"^queue: messages=4 ring=4 overflow=0", out, re.M), out
    assert re.search(r"^worker 1: messages=4 held=0", out, re.M), out
    assert out.rstrip().endswith("done"), out


def test_direct_arena():
    out = _run_example("direct_arena.py", "--readers", "2", "--messages", "2", "--mib", "8")
    assert re.search(r"^message 1: 8396800 tensor bytes -> pickle stream \d{2,3} B ", out, re.M), (
        out
    )
    assert len(re.findall(r"zero-copy: held 1 slot, 0 after del\), ok$", out, re.M)) == 4, out
    assert re.search(r"^writer stats: hits=2 bytes=16777216 .* in_use=0", out, re.M), out
    assert out.rstrip().endswith("done"), out
