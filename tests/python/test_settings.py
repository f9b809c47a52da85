"""settings.py: every environment variable the Python side reads, declared once.

The parser of each variable on good, bad and empty values (a bad one is a ``ValueError``
naming the variable and the value), the documentation generated from the declarations (the
module docstring, docs/configuration.md's table), the defaults agreeing with the constants the
modules use, and that no other module reads the environment itself.
"""

from __future__ import annotations

import ast
import math
import re
from pathlib import Path

import pytest

from vllm_shm_arena import arena, settings, sizing

REPO = Path(__file__).resolve().parents[2]
PACKAGE = REPO / "vllm_shm_arena"

# variable -> (raw value, parsed value) pairs a reader accepts
GOOD = {
    "VLLM_SHM_ARENA_POLICY": [("variable", "variable"), ("fixed", "fixed")],
    "VLLM_SHM_ARENA_MB": [("1", 1), ("2048", 2048)],
    "VLLM_SHM_ARENA_MAX_ALLOCATIONS": [("1", 1), ("4096", 4096)],
    "VLLM_SHM_ARENA_NUM_SLOTS": [("1", 1), ("8", 8)],
    "VLLM_SHM_ARENA_SLOT_MB": [("1", 1), ("256", 256)],
    "VLLM_SHM_ARENA_FREE_FRACTION": [("1", 1.0), ("0.25", 0.25), ("1e-3", 1e-3)],
    "VLLM_SHM_ARENA_MIN_MB": [("1", 1), ("64", 64)],
    "VLLM_SHM_ARENA_PIN": [("0", False), ("1", True), ("no", True)],
    "VLLM_SHM_ARENA_FRONTEND": [("0", False), ("1", True), ("no", True)],
    "VLLM_SHM_ARENA_RESPONSE_QUEUES": [("0", False), ("1", True), ("off", True)],
    "VLLM_SHM_ARENA_FRONTEND_HANDLE": [('{"name": "vsa_x"}', '{"name": "vsa_x"}')],
    "VLLM_SHM_ARENA_PIN_CHUNK_MB": [("0", 0), ("16", 16)],
    "VLLM_SHM_ARENA_TCP_TIMEOUT_S": [("0", 0), ("3", 3), ("60", 60), ("65535", 65535)],
    "VLLM_SHM_ARENA_TCP_SECURITY": [("authenticated", "authenticated"), ("encrypted", "encrypted")],
    "VLLM_SHM_ARENA_STREAM_MIN_MB": [("0", 0), ("7", 7)],
    "VLLM_SHM_ARENA_FRAME_POOL_MB": [("0", 0), ("512", 512)],
    "VLLM_SHM_ARENA_BLOB_MB": [("0", 0), ("64", 64)],
    "VLLM_SHM_ARENA_DEBUG_CHECKSUM": [("1", True), ("0", False), ("yes", False)],
    "VLLM_RINGBUFFER_WARNING_INTERVAL": [("60", 60.0), ("0.5", 0.5), ("0", 0.0)],
    "VLLM_HOST_IP": [("10.0.0.7", "10.0.0.7")],
    "VLLM_MQ_MAX_CHUNK_BYTES_MB": [("4", 4), ("lots", None)],
    "VLLM_PLUGINS": [("a,b", "a,b"), ("", "")],
    "PROMETHEUS_MULTIPROC_DIR": [("/tmp/prom", "/tmp/prom")],
}
# variable -> raw values it refuses
BAD = {
    "VLLM_SHM_ARENA_POLICY": ["Fixed", "slots", " variable"],
    "VLLM_SHM_ARENA_MB": ["0", "-1", "64.5", "big"],
    "VLLM_SHM_ARENA_MAX_ALLOCATIONS": ["0", "many"],
    "VLLM_SHM_ARENA_NUM_SLOTS": ["0", "-8", "8.0"],
    "VLLM_SHM_ARENA_SLOT_MB": ["0", "256M"],
    "VLLM_SHM_ARENA_FREE_FRACTION": ["0", "-0.5", "1.5", "half", "nan", "inf"],
    "VLLM_SHM_ARENA_MIN_MB": ["0", "-1", "64.5", "big"],
    "VLLM_SHM_ARENA_PIN_CHUNK_MB": ["-1", "x"],
    # Hole 7: 65536 and up were accepted, and the kernel then refused every connection's
    # keepalive idle time (half of it) silently.
    "VLLM_SHM_ARENA_TCP_TIMEOUT_S": ["-1", "2.5", "soon", "65536", "100000"],
    "VLLM_SHM_ARENA_TCP_SECURITY": ["none", "plain", "Encrypted", " authenticated"],
    "VLLM_SHM_ARENA_STREAM_MIN_MB": ["-1", "lots", "3.5"],
    "VLLM_SHM_ARENA_FRAME_POOL_MB": ["-1", "lots", "0.5"],
    "VLLM_SHM_ARENA_BLOB_MB": ["-1", "lots", "0.5"],
    "VLLM_RINGBUFFER_WARNING_INTERVAL": ["-1", "nan", "soon"],
}
#: Variables whose reader treats every value as valid (flags, text, vLLM's lenient parse).
NEVER_BAD = {
    "VLLM_SHM_ARENA_FRONTEND_HANDLE",
    "VLLM_SHM_ARENA_PIN",
    "VLLM_SHM_ARENA_FRONTEND",
    "VLLM_SHM_ARENA_RESPONSE_QUEUES",
    "VLLM_SHM_ARENA_DEBUG_CHECKSUM",
    "VLLM_HOST_IP",
    "VLLM_MQ_MAX_CHUNK_BYTES_MB",
    "VLLM_PLUGINS",
    "PROMETHEUS_MULTIPROC_DIR",
}
NAMES = [v.name for v in settings.VARIABLES]


def test_every_variable_is_covered_by_these_tests():
    assert sorted(GOOD) == sorted(NAMES)
    assert sorted(set(BAD) | NEVER_BAD) == sorted(NAMES)
    assert not set(BAD) & NEVER_BAD


@pytest.mark.parametrize("name", NAMES)
def test_good_values_parse(name):
    for raw, want in GOOD[name]:
        assert settings.value(name, {name: raw}) == want, (name, raw)


@pytest.mark.parametrize("name", sorted(BAD))
def test_a_bad_value_is_a_value_error_naming_the_variable_and_the_value(name):
    for raw in BAD[name]:
        with pytest.raises(ValueError) as ei:
            settings.value(name, {name: raw})
        msg = str(ei.value)
        assert msg.startswith(f"{name} must be "), msg
        assert repr(raw) in msg, msg


@pytest.mark.parametrize("name", NAMES)
def test_unset_and_empty_give_the_default(name):
    var = next(v for v in settings.VARIABLES if v.name == name)
    assert settings.value(name, {}) == var.unset
    if name == "VLLM_PLUGINS":
        # vLLM reads an empty VLLM_PLUGINS as "no plugin": it is not unset.
        assert settings.value(name, {name: ""}) == ""
    else:
        assert settings.value(name, {name: ""}) == var.unset


def test_accessors_read_the_environment_when_called(monkeypatch):
    monkeypatch.setenv("VLLM_SHM_ARENA_MB", "64")
    assert settings.arena_bytes() == 64 << 20
    monkeypatch.setenv("VLLM_SHM_ARENA_MB", "128")
    assert settings.arena_bytes() == 128 << 20
    monkeypatch.setenv("VLLM_SHM_ARENA_MB", "zero")
    with pytest.raises(ValueError, match="VLLM_SHM_ARENA_MB"):
        settings.arena_bytes()
    # ... and a mapping given instead of the environment.
    assert settings.arena_slot_bytes({"VLLM_SHM_ARENA_SLOT_MB": "3"}) == 3 << 20
    assert settings.min_arena_bytes({}) == 64 << 20
    assert settings.pin_chunk_bytes({"VLLM_SHM_ARENA_PIN_CHUNK_MB": "2"}) == 2 << 20
    assert settings.stream_min_bytes({}) is None
    assert settings.stream_min_bytes({"VLLM_SHM_ARENA_STREAM_MIN_MB": "1"}) == 1 << 20


def test_the_lower_case_prometheus_spelling_is_read_when_the_upper_case_one_is_unset():
    assert settings.prometheus_multiproc_dir({"prometheus_multiproc_dir": "/a"}) == "/a"
    both = {"PROMETHEUS_MULTIPROC_DIR": "/b", "prometheus_multiproc_dir": "/a"}
    assert settings.prometheus_multiproc_dir(both) == "/b"
    empty_upper = {"PROMETHEUS_MULTIPROC_DIR": "", "prometheus_multiproc_dir": "/a"}
    assert settings.prometheus_multiproc_dir(empty_upper) == "/a"
    assert settings.prometheus_multiproc_dir({}) is None


def test_the_policy_is_read_unchecked_and_checked_when_used():
    """A queue reads the policy at import and checks it only when asked for an arena."""
    env = {"VLLM_SHM_ARENA_POLICY": "slots"}
    assert settings.arena_policy_unchecked(env) == "slots"
    assert settings.arena_policy_unchecked({}) == "variable"
    with pytest.raises(ValueError, match="VLLM_SHM_ARENA_POLICY must be 'variable' or 'fixed'"):
        settings.check_arena_policy("slots")
    assert settings.check_arena_policy("fixed") == "fixed"


def test_an_undeclared_name_is_a_key_error():
    with pytest.raises(KeyError):
        settings.value("VLLM_SHM_ARENA_NOT_A_SETTING", {})


def test_sizing_reads_its_settings_through_this_module(monkeypatch):
    env = {
        "VLLM_SHM_ARENA_POLICY": "fixed",
        "VLLM_SHM_ARENA_NUM_SLOTS": "3",
        "VLLM_SHM_ARENA_SLOT_MB": "5",
    }
    layout = sizing.layout_from_env(env)
    assert (layout.policy, layout.num_slots, layout.slot_bytes) == ("fixed", 3, 5 << 20)
    with pytest.raises(ValueError, match="VLLM_SHM_ARENA_MAX_ALLOCATIONS"):
        sizing.layout_from_env({"VLLM_SHM_ARENA_MAX_ALLOCATIONS": "0"})


def test_defaults_agree_with_the_constants_of_the_modules_that_use_them():
    d = {v.name: v.unset for v in settings.VARIABLES}
    assert d["VLLM_SHM_ARENA_MB"] << 20 == arena.DEFAULT_ARENA_BYTES
    assert d["VLLM_SHM_ARENA_MAX_ALLOCATIONS"] == arena.DEFAULT_MAX_ALLOCATIONS
    assert d["VLLM_SHM_ARENA_NUM_SLOTS"] == arena.DEFAULT_NUM_SLOTS
    assert d["VLLM_SHM_ARENA_SLOT_MB"] << 20 == arena.DEFAULT_SLOT_BYTES
    assert d["VLLM_SHM_ARENA_POLICY"] == sizing.Layout().policy
    assert math.isclose(d["VLLM_SHM_ARENA_FREE_FRACTION"], sizing.DEFAULT_FREE_FRACTION)
    assert d["VLLM_SHM_ARENA_MIN_MB"] << 20 == sizing.DEFAULT_MIN_BYTES


# ------------------------------------------------------------------ the documentation
def test_the_module_docstring_lists_every_variable_as_declared():
    assert settings.listing() in settings.__doc__, (
        "the docstring's list is not the declared one: paste settings.listing() into it"
    )
    for name in (*NAMES, *settings.READ_BY_EXTENSION):
        assert f"``{name}``" in settings.__doc__, name


def test_the_configuration_pages_table_is_the_generated_one():
    """docs/configuration.md includes ``settings.table()`` between two markers; regenerate it
    with ``python -c "from vllm_shm_arena import settings; print(settings.table())"``."""
    text = (REPO / "docs" / "configuration.md").read_text()
    m = re.search(
        r"<!-- settings table: .*? -->\n(.*?)\n<!-- end of the settings table -->", text, re.S
    )
    assert m, "docs/configuration.md has no settings table between its markers"
    assert m.group(1) == settings.table()
    for name in settings.READ_BY_EXTENSION:
        assert name in text


# ------------------------------------------------------------------ nobody else reads it
def _environment_reads(path: Path) -> list[str]:
    """Where ``path`` touches ``os.environ`` / ``os.getenv`` (or imports them from os)."""
    tree = ast.parse(path.read_text())
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr in ("environ", "getenv", "environb"):
            if isinstance(node.value, ast.Name) and node.value.id == "os":
                found.append(f"{path.relative_to(PACKAGE)}:{node.lineno}")
        if isinstance(node, ast.ImportFrom) and node.module == "os":
            if {a.name for a in node.names} & {"environ", "getenv", "environb"}:
                found.append(f"{path.relative_to(PACKAGE)}:{node.lineno}")
    return found


def test_no_module_but_settings_reads_the_environment():
    reads = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if path.name in ("settings.py", "_build_info.py"):
            continue
        reads += _environment_reads(path)
    assert reads == [], f"read the environment through settings.py instead: {reads}"
