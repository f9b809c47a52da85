"""``python -m vllm_shm_arena check``: every line's failure case, with fakes for the probes.

Each check is a function of ``vllm_shm_arena.check`` that reads the environment through small
probe functions (``_built_for``, ``_find_vllm``, ``_entry_points``, ``_cuda_available``, ...);
the tests replace those. Pinning goes through the real reader against the fake CUDA runtime
(tests/fake_cudart, built into build/cpp by the C++ test build), as in test_cuda_fake.py.
"""

from __future__ import annotations

import ctypes
import importlib.metadata
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

import vllm_shm_arena.arena as arena_mod
from vllm_shm_arena import check, sizing
from vllm_shm_arena.__main__ import main as package_main

REPO = Path(__file__).resolve().parents[2]
FAKE_CUDART = REPO / "build" / "cpp" / "libfakecudart.so"
MiB = 1 << 20
GiB = 1 << 30


@pytest.fixture
def shm(monkeypatch):
    """An empty private shm directory (the default of every check here), removed afterwards."""
    d = Path(
        tempfile.mkdtemp(prefix="vsa-check-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
    )
    monkeypatch.setenv("VLLM_SHM_ARENA_SHM_DIR", str(d))
    yield d
    shutil.rmtree(d, ignore_errors=True)


def _statuses(results) -> dict[str, str]:
    return {r.check: r.status for r in results}


# ------------------------------------------------------------------------ extension
def test_extension_ok():
    r = check.check_extension()
    assert r.status == "OK", r.line()


def test_extension_built_for_another_torch_fails_with_the_rebuild_command(monkeypatch):
    monkeypatch.setattr(check, "_built_for", lambda: "1.0.0+old")
    r = check.check_extension()
    assert r.status == "FAIL" and "torch 1.0.0+old" in r.message, r.line()
    assert "pip install --no-build-isolation" in r.message


def test_extension_that_does_not_load_fails(monkeypatch):
    def broken():
        raise ImportError("cannot load vllm_shm_arena._C (undefined symbol); rebuild it")

    monkeypatch.setattr(check, "_load_extension", broken)
    r = check.check_extension()
    assert r.status == "FAIL" and "undefined symbol" in r.message, r.line()
    # The checks that need the extension say so instead of crashing.
    assert check.check_shm(None, 8).status == "WARN"
    assert check.check_cuda().status == "WARN"
    assert check.check_stale(None).status == "WARN"


def test_extension_without_build_record_warns(monkeypatch):
    monkeypatch.setattr(check, "_built_for", lambda: None)
    r = check.check_extension()
    assert r.status == "WARN" and "_build_info.py" in r.message, r.line()


def test_torch_that_does_not_import_fails(monkeypatch):
    def no_torch():
        raise ImportError("No module named 'torch'")

    monkeypatch.setattr(check, "_torch_version", no_torch)
    assert check.check_extension().status == "FAIL"


# ------------------------------------------------------------------------ vllm
def test_vllm_missing_warns(monkeypatch):
    monkeypatch.setattr(check, "_find_vllm", lambda: (None, ""))
    r = check.check_vllm()
    assert r.status == "WARN" and "not installed" in r.message, r.line()


def test_vllm_unsupported_version_fails(monkeypatch):
    monkeypatch.setattr(check, "_find_vllm", lambda: ("0.31.2", "/site/vllm"))
    r = check.check_vllm()
    assert r.status == "FAIL" and "0.31.2 is not supported" in r.message, r.line()
    assert "0.33.x" in r.message


def test_vllm_dev_build_is_not_supported(monkeypatch):
    monkeypatch.setattr(check, "_find_vllm", lambda: ("0.34.0.dev12", "/site/vllm"))
    assert check.check_vllm().status == "FAIL"


def test_vllm_interface_change_fails(monkeypatch):
    monkeypatch.setattr(check, "_find_vllm", lambda: ("0.33.1", "/site/vllm"))
    monkeypatch.setattr(check, "_vllm_interface_changes", lambda v: ["Handle has no field 'x'"])
    r = check.check_vllm()
    assert r.status == "FAIL" and "Handle has no field 'x'" in r.message, r.line()


def test_vllm_that_does_not_import_fails(monkeypatch):
    def broken():
        raise RuntimeError("CUDA driver too old")

    monkeypatch.setattr(check, "_find_vllm", broken)
    r = check.check_vllm()
    assert r.status == "FAIL" and "CUDA driver too old" in r.message, r.line()


def test_vllm_supported_ok(monkeypatch):
    monkeypatch.setattr(check, "_find_vllm", lambda: ("0.33.0", "/site/vllm"))
    monkeypatch.setattr(check, "_vllm_interface_changes", lambda v: [])
    r = check.check_vllm()
    assert r.status == "OK" and "0.33.0" in r.message, r.line()


# ------------------------------------------------------------------------ entry point, VLLM_PLUGINS
def _ep(name="shm_tensor_arena", value="vllm_shm_arena.vllm_plugin:register"):
    return importlib.metadata.EntryPoint(name, value, "vllm.general_plugins")


def test_entry_point_visible_ok():
    # The package is installed (editable) in the test environment.
    r = check.check_entry_point()
    assert r.status == "OK", r.line()


def test_entry_point_missing_fails(monkeypatch):
    monkeypatch.setattr(check, "_entry_points", lambda: [_ep(name="someone_else")])
    r = check.check_entry_point()
    assert r.status == "FAIL" and "will not load" in r.message, r.line()
    assert "pip install" in r.message


def test_entry_point_pointing_elsewhere_fails(monkeypatch):
    monkeypatch.setattr(check, "_entry_points", lambda: [_ep(value="other.module:register")])
    r = check.check_entry_point()
    assert r.status == "FAIL" and "other.module:register" in r.message, r.line()


def test_entry_point_listed_twice_warns(monkeypatch):
    monkeypatch.setattr(check, "_entry_points", lambda: [_ep(), _ep()])
    assert check.check_entry_point().status == "WARN"


@pytest.mark.parametrize(
    "value, status",
    [
        (None, "OK"),
        ("shm_tensor_arena", "OK"),
        ("lora_resolver,shm_tensor_arena", "OK"),
        ("lora_resolver", "FAIL"),
        ("", "FAIL"),  # vLLM: set but empty loads no plugin
        ("lora_resolver, shm_tensor_arena", "FAIL"),  # vLLM does not strip the space
    ],
)
def test_vllm_plugins_follows_vllms_rule(value, status, monkeypatch):
    if value is None:
        monkeypatch.delenv("VLLM_PLUGINS", raising=False)
    else:
        monkeypatch.setenv("VLLM_PLUGINS", value)
    r = check.check_vllm_plugins_env()
    assert r.status == status, r.line()
    if status == "FAIL":
        assert "VLLM_PLUGINS=" in r.message and "shm_tensor_arena" in r.message
    if value == "lora_resolver, shm_tensor_arena":
        assert "does not strip spaces" in r.message
        assert "VLLM_PLUGINS=lora_resolver,shm_tensor_arena " in r.message


# ------------------------------------------------------------------------ shm
def test_shm_ok_on_a_large_directory(shm):
    r = check.check_shm(None, 8)
    free = os.statvfs(shm).f_bavail * os.statvfs(shm).f_frsize
    if free < 3 * GiB:
        pytest.skip(f"the shm directory has only {free >> 20} MiB free")
    assert r.status == "OK" and "configured 2048 MiB variable-size" in r.message, r.line()
    assert r.data["arena_bytes"] == 2048 * MiB and r.data["sized_by"] == "config"
    assert list(shm.iterdir()) == [], "the check created something"


def test_shm_missing_directory_fails(tmp_path):
    r = check.check_shm(str(tmp_path / "nope"), 8)
    assert r.status == "FAIL" and "not a directory" in r.message, r.line()


def test_shm_bad_setting_fails_naming_the_variable(shm, monkeypatch):
    monkeypatch.setenv("VLLM_SHM_ARENA_MIN_MB", "lots")
    r = check.check_shm(None, 8)
    assert r.status == "FAIL" and "VLLM_SHM_ARENA_MIN_MB" in r.message, r.line()


def _fake_space(free, total=None, cgroup=None):
    def measure(shm_dir=None, ring_path=None, ring_bytes=0):
        return sizing.DirSpace(
            dir=shm_dir or "/dev/shm",
            shm_free=free,
            shm_total=total or free,
            cgroup_available=cgroup,
            package_backed=0,
            live_arenas=0,
            ring_bytes=ring_bytes,
            ring_unbacked=ring_bytes,
        )

    return measure


def test_shm_small_directory_warns_with_the_size_a_queue_gets(shm, monkeypatch):
    monkeypatch.setattr(sizing, "measure", _fake_space(GiB))
    r = check.check_shm(None, 8)
    # Half of 1 GiB less vLLM's 160 MiB ring, less the arena's tables, in whole MiB.
    assert r.status == "WARN" and "tensor arena of 430 MiB instead of 2048 MiB" in r.message, (
        r.line()
    )
    assert "--shm-size=3g" in r.message and r.data["arena_bytes"] == 430 * MiB


def test_shm_too_small_for_an_arena_warns(shm, monkeypatch):
    monkeypatch.setattr(sizing, "measure", _fake_space(256 * MiB))
    r = check.check_shm(None, 8)
    assert r.status == "WARN" and "no tensor arena" in r.message, r.line()


def test_shm_too_small_for_the_ring_fails(shm, monkeypatch):
    monkeypatch.setattr(sizing, "measure", _fake_space(100 * MiB))
    r = check.check_shm(None, 8)
    assert r.status == "FAIL" and "cannot start" in r.message, r.line()


def test_shm_ring_size_follows_vllms_chunk_setting(shm, monkeypatch):
    monkeypatch.setattr(sizing, "measure", _fake_space(100 * MiB))
    monkeypatch.setenv("VLLM_MQ_MAX_CHUNK_BYTES_MB", "4")  # a 40 MiB ring fits
    assert check.check_shm(None, 8).status == "WARN"


def test_shm_memory_cgroup_bound_says_so(shm, monkeypatch):
    monkeypatch.setattr(sizing, "measure", _fake_space(8 * GiB, cgroup=GiB))
    r = check.check_shm(None, 8)
    assert r.status == "WARN" and "memory cgroup" in r.message, r.line()
    assert "memory limit" in r.message and r.data["sized_by"] == "cgroup"


def test_shm_on_a_real_small_tmpfs(tmp_path):
    if os.geteuid() != 0:
        pytest.skip("mounting a private tmpfs needs root")
    d = tmp_path / "tmpfs"
    d.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=512m", "tmpfs", str(d)]).returncode:
        pytest.skip("mount -t tmpfs failed: no CAP_SYS_ADMIN here")
    try:
        r = check.check_shm(str(d), 2)
        # Half of 512 MiB less a 160 MiB ring, less the arena's tables (a queue's real ring
        # also has a 4 KiB header: test_sizing's 173 MiB).
        assert r.status == "WARN" and "tensor arena of 174 MiB" in r.message, r.line()
        assert list(d.iterdir()) == []
    finally:
        subprocess.run(["umount", "-l", str(d)])


# ------------------------------------------------------------------------ cuda, pinning
def test_cuda_absent_warns_and_pinning_cannot_be_tested(monkeypatch):
    monkeypatch.setattr(check, "_cuda_available", lambda: False)
    c = check.check_cuda()
    assert c.status == "WARN" and "no CUDA device" in c.message, c.line()
    p = check.check_pinning(None, c)
    assert p.status == "WARN" and "cannot test pinning" in p.message, p.line()


def test_cuda_that_does_not_initialise_fails(monkeypatch):
    def broken():
        raise RuntimeError("CUDA error: no kernel image")

    monkeypatch.setattr(check, "_cuda_available", lambda: True)
    monkeypatch.setattr(check, "_cuda_init", broken)
    r = check.check_cuda()
    assert r.status == "FAIL" and "no kernel image" in r.message, r.line()


def test_cuda_runtime_not_found_warns(monkeypatch):
    class NoRuntime:
        def cuda_runtime_found(self):
            return False

    monkeypatch.setattr(check, "_cuda_available", lambda: True)
    monkeypatch.setattr(check, "_cuda_init", lambda: "Fake GPU")
    monkeypatch.setattr(check, "_load_extension", NoRuntime)
    r = check.check_cuda()
    assert r.status == "WARN" and "VLLM_SHM_ARENA_CUDART" in r.message, r.line()


def test_pinning_off_warns(monkeypatch):
    monkeypatch.setenv("VLLM_SHM_ARENA_PIN", "0")
    r = check.check_pinning(None, check.Result("OK", "cuda", ""))
    assert r.status == "WARN" and "VLLM_SHM_ARENA_PIN=0" in r.message, r.line()


def test_pinning_probe_error_warns(monkeypatch):
    def broken(shm_dir):
        raise OSError("not enough shared memory")

    monkeypatch.setattr(check, "_pin_probe", broken)
    r = check.check_pinning(None, check.Result("OK", "cuda", ""))
    assert r.status == "WARN" and "not enough shared memory" in r.message, r.line()


@pytest.fixture
def fake_cuda(monkeypatch):
    """The fake CUDA runtime as the one torch loaded, and a CUDA context in this process."""
    if not FAKE_CUDART.exists():
        pytest.skip(f"fake CUDA runtime not built ({FAKE_CUDART}); run make test")
    monkeypatch.setenv("VLLM_SHM_ARENA_CUDART", str(FAKE_CUDART))
    monkeypatch.setattr(arena_mod, "_cuda_seen", True)
    monkeypatch.setattr(check, "_cuda_available", lambda: True)
    monkeypatch.setattr(check, "_cuda_init", lambda: "Fake GPU")
    lib = ctypes.CDLL(str(FAKE_CUDART))
    lib.fake_cudart_reset()
    yield lib
    lib.fake_cudart_reset()


def test_pinning_ok_through_the_readers_own_path(fake_cuda, shm):
    c = check.check_cuda()
    assert c.status == "OK", c.line()
    r = check.check_pinning(None, c)
    assert r.status == "OK" and "page-locked" in r.message, r.line()
    assert r.data["pinned_bytes"] > 0
    assert list(shm.iterdir()) == [], "the probe left its arena behind"


def test_pinning_failure_warns(fake_cuda, shm):
    fake_cuda.fake_cudart_fail_register(1)  # cudaErrorInvalidValue
    r = check.check_pinning(None, check.check_cuda())
    assert r.status == "WARN" and "cudaHostRegister" in r.message, r.line()
    assert "pageable" in r.message and r.data["pin_failed"]


# ------------------------------------------------------------------------ stale segments
def test_no_stale_segments_ok(shm):
    r = check.check_stale(None)
    assert r.status == "OK", r.line()


def test_stale_segments_warn_with_count_and_the_cleanup_command(shm):
    code = (
        "import os; from vllm_shm_arena import ShmTensorArena; "
        f"w = ShmTensorArena.create(1, 1, 4 << 20, shm_dir={str(shm)!r}); os._exit(0)"
    )
    env = dict(os.environ, PYTHONPATH=str(REPO))
    for _ in range(2):
        subprocess.run([sys.executable, "-c", code], check=True, env=env, cwd=REPO)
    r = check.check_stale(str(shm))
    assert r.status == "WARN" and r.message.startswith("2 stale segment(s)"), r.line()
    assert f"python -m vllm_shm_arena cleanup --dir {shm}" in r.message
    assert len(list(shm.iterdir())) == 2, "the check removed something"


def test_stale_listing_error_warns(tmp_path):
    r = check.check_stale(str(tmp_path / "missing"))
    assert r.status == "WARN" and "cannot list" in r.message, r.line()


# ------------------------------------------------------------------------ the command
def _all(status):
    return lambda shm_dir=None, n_readers=8: [
        check.Result("OK", "a", "fine"),
        check.Result(status, "b", "something"),
    ]


@pytest.mark.parametrize("status, rc", [("OK", 0), ("WARN", 0), ("FAIL", 1)])
def test_exit_code_is_nonzero_iff_a_check_fails(status, rc, monkeypatch, capsys):
    monkeypatch.setattr(check, "run_checks", _all(status))
    assert check.main([]) == rc
    lines = capsys.readouterr().out.splitlines()
    assert lines == ["OK   a: fine", f"{status:<4} b: something"]


def test_json_output(monkeypatch, capsys):
    monkeypatch.setattr(check, "run_checks", _all("FAIL"))
    assert check.main(["--json"]) == 1
    out = json.loads(capsys.readouterr().out)
    assert out["ok"] is False
    assert out["checks"][1] == {"status": "FAIL", "check": "b", "message": "something", "data": {}}


def test_the_real_command_prints_one_line_per_check(shm):
    p = subprocess.run(
        [sys.executable, "-m", "vllm_shm_arena", "check"],
        cwd=REPO,
        env=dict(os.environ, PYTHONPATH=str(REPO)),
        capture_output=True,
        text=True,
        timeout=300,
    )
    print(p.stdout)
    lines = p.stdout.splitlines()
    names = [ln.split(":", 1)[0].split()[1] for ln in lines]
    assert names == [
        "extension",
        "vllm",
        "plugin",
        "VLLM_PLUGINS",
        "shm",
        "cuda",
        "pinning",
        "stale",
    ], p.stdout
    assert all(ln.split()[0] in ("OK", "WARN", "FAIL") for ln in lines), p.stdout
    assert p.returncode == (1 if any(ln.startswith("FAIL") for ln in lines) else 0), p.stderr


def test_package_main_dispatches_check_and_lists_both_commands(monkeypatch, capsys):
    monkeypatch.setattr(check, "run_checks", _all("OK"))
    assert package_main(["check"]) == 0
    assert package_main(["help"]) == 2
    usage = capsys.readouterr().err
    assert "vllm_shm_arena check" in usage and "vllm_shm_arena cleanup" in usage
