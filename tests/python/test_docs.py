"""The docs name only what exists: every repository path, every backticked dotted Python name
of this package (or of its extension, ``_C``) and every backticked C++ ``Class::member`` in the
README and docs/*.md (docs/notes/ keeps history, so it is left out) must be in the tree. The
next rename then fails here, not in a reader's hands.

Names of other packages (torch, vLLM, ZeroMQ) are not checked here: vLLM's are the plugin's
interface snapshot's job (vllm_interface.py).
"""

from __future__ import annotations

import glob
import importlib
import itertools
import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
#: Top-level folders whose paths the docs may name.
ROOTS = ("csrc", "vllm_shm_arena", "tests", "benchmarks", "scripts", "docs", "examples", "e2e")
#: Paths made by running something (a build, a benchmark's scratch), not kept in the tree.
GENERATED = ("build/", ".venv", "dist/", ".compat/", "vllm_shm_arena/_build_info.py")

_PATH = re.compile(r"(?<![\w./-])((?:" + "|".join(ROOTS) + r")/[\w./{},*<>\[\]-]*)")
_TICKED = re.compile(r"`([^`\n]+)`")
_DOTTED = re.compile(r"^([A-Za-z_]\w*)((?:\.[A-Za-z_]\w*)+)(?:\(\))?$")
#: Endings that make a dotted token a file name, not a Python name.
_FILE_ENDINGS = (".py", ".md", ".cpp", ".h", ".json", ".txt", ".png", ".sh", ".so", ".toml")
_CPP_MEMBER = re.compile(r"^([A-Z]\w*)::(~?\w+)(?:\(\))?$")


def _text(page: Path) -> str:
    return page.read_text()


def _expand(path: str) -> list[str]:
    """``a.{md,json}`` -> ``a.md``, ``a.json`` (one brace group or several)."""
    parts = re.split(r"(\{[^{}]*\})", path)
    options = [p[1:-1].split(",") if p.startswith("{") else [p] for p in parts]
    return ["".join(c) for c in itertools.product(*options)]


def repository_paths(text: str) -> list[str]:
    out = []
    for m in _PATH.finditer(text):
        p = m.group(1).rstrip(".,;:)]")
        if "<" in p or ">" in p or "[" in p or p.startswith(GENERATED):
            continue  # a placeholder (<checkout>), an index ([i]) or a generated path
        out.extend(_expand(p))
    return out


def _exists(path: str) -> bool:
    if any(c in path for c in "*?"):
        return bool(glob.glob(str(REPO / path)))
    return (REPO / path).exists()


@pytest.mark.parametrize("page", PAGES, ids=[p.relative_to(REPO).as_posix() for p in PAGES])
def test_every_repository_path_a_page_names_exists(page):
    missing = sorted({p for p in repository_paths(_text(page)) if not _exists(p)})
    assert not missing, f"{page.name} names paths that are not in the tree: {missing}"


# ------------------------------------------------------------------ Python names
def _package_roots() -> dict[str, object]:
    """The first components a dotted name of ours may start with -> what they are."""
    import vllm_shm_arena
    from vllm_shm_arena._ext import _C

    roots: dict[str, object] = {"vllm_shm_arena": vllm_shm_arena, "_C": _C}
    package = REPO / "vllm_shm_arena"
    roots["mq"] = importlib.import_module("vllm_shm_arena.mq")
    for path in package.rglob("*.py"):
        rel = path.relative_to(package).with_suffix("")
        if rel.name == "__init__" or rel.name == "__main__":
            continue
        module = importlib.import_module("vllm_shm_arena." + ".".join(rel.parts))
        if len(rel.parts) == 1:  # a top-level module; mq's parts go by mq.<part>
            roots.setdefault(rel.name, module)
        for name, obj in vars(module).items():
            if isinstance(obj, type) and getattr(obj, "__module__", "").startswith(
                ("vllm_shm_arena", "vllm_shm_arena.message_queue")
            ):
                roots.setdefault(name, obj)
    for name in dir(_C):
        if not name.startswith("__"):
            roots.setdefault(name, getattr(_C, name))
    return roots


def _resolves(root: object, attrs: list[str]) -> bool:
    obj = root
    for a in attrs:
        if isinstance(obj, type(importlib)):  # a module: its submodules too
            try:
                obj = getattr(obj, a)
                continue
            except AttributeError:
                try:
                    obj = importlib.import_module(f"{obj.__name__}.{a}")
                    continue
                except ImportError:
                    return False
        if not hasattr(obj, a):
            # Dataclass fields with a default factory and instance attributes documented by
            # their class are not class attributes: look in the annotations and __slots__.
            fields = getattr(obj, "__dataclass_fields__", {})
            slots = getattr(obj, "__slots__", ())
            annotations = getattr(obj, "__annotations__", {})
            if a in fields or a in slots or a in annotations:
                return True
            return False
        obj = getattr(obj, a)
    return True


def python_names(text: str, roots: dict) -> list[tuple[str, bool]]:
    out = []
    for m in _TICKED.finditer(text):
        token = m.group(1).strip()
        d = _DOTTED.match(token)
        if d is None or d.group(1) not in roots or token.endswith(_FILE_ENDINGS):
            continue
        attrs = d.group(2).lstrip(".").split(".")
        out.append((m.group(1), _resolves(roots[d.group(1)], attrs)))
    return out


@pytest.mark.parametrize("page", PAGES, ids=[p.relative_to(REPO).as_posix() for p in PAGES])
def test_every_dotted_name_of_ours_a_page_names_exists(page):
    roots = _package_roots()
    missing = sorted({n for n, ok in python_names(_text(page), roots) if not ok})
    assert not missing, f"{page.name} names what the package does not have: {missing}"


# ------------------------------------------------------------------ C++ names
def _cpp_sources() -> dict[Path, str]:
    files = [*REPO.glob("csrc/**/*.h"), *REPO.glob("csrc/**/*.cpp")]
    return {f: f.read_text() for f in files}


def cpp_member_exists(cls: str, member: str, sources: dict[Path, str]) -> bool:
    """``cls`` is declared (class or struct) in csrc and ``member`` is named in its header or
    its source file, or defined as ``cls::member``."""
    qualified = re.compile(rf"\b{cls}::{re.escape(member)}\b")
    if any(qualified.search(t) for t in sources.values()):
        return True
    declared = re.compile(rf"\b(?:class|struct)\s+{cls}\b")
    for path, text in sources.items():
        if declared.search(text):
            stems = {path.with_suffix(".h"), path.with_suffix(".cpp")}
            if any(re.search(rf"\b{re.escape(member)}\b", sources.get(s, "")) for s in stems):
                return True
    return False


@pytest.mark.parametrize("page", PAGES, ids=[p.relative_to(REPO).as_posix() for p in PAGES])
def test_every_cpp_member_a_page_names_exists(page):
    sources = _cpp_sources()
    missing = []
    for m in _TICKED.finditer(_text(page)):
        c = _CPP_MEMBER.match(m.group(1).strip())
        if c and not cpp_member_exists(c.group(1), c.group(2), sources):
            missing.append(m.group(1))
    assert not missing, f"{page.name} names C++ members that are not in csrc/: {missing}"


# ------------------------------------------------------------------ tests
_TEST_REF = re.compile(r"((?:[\w./-]*/)?test_\w+\.py)::(\w+)")


def named_tests(text: str) -> list[tuple[str, bool]]:
    """``test_x.py::test_name`` (with or without its folder): a test file of that name under
    tests/ defines ``test_name`` (a function, or a method of a test class)."""
    out = []
    for m in _TEST_REF.finditer(text):
        path, name = m.group(1), m.group(2)
        candidates = [REPO / path] if "/" in path else list(REPO.glob(f"tests/**/{path}"))
        defines = re.compile(rf"^\s*(?:async\s+)?def {name}\(", re.MULTILINE)
        ok = any(c.is_file() and defines.search(c.read_text()) for c in candidates)
        out.append((m.group(0), ok))
    return out


@pytest.mark.parametrize("page", PAGES, ids=[p.relative_to(REPO).as_posix() for p in PAGES])
def test_every_test_a_page_names_exists(page):
    missing = sorted({r for r, ok in named_tests(_text(page)) if not ok})
    assert not missing, f"{page.name} names tests that are not in tests/: {missing}"


# ------------------------------------------------------------------ the checker itself
def test_the_checks_catch_what_they_are_for():
    roots = _package_roots()
    assert repository_paths("see `benchmarks/results/broadcast_ab.{md,json}`.") == [
        "benchmarks/results/broadcast_ab.md",
        "benchmarks/results/broadcast_ab.json",
    ]
    assert not _exists("vllm_shm_arena/no_such_module.py")
    names = dict(python_names("`MessageQueue.create_relay` and `MessageQueue.no_such`", roots))
    assert names == {"MessageQueue.create_relay": True, "MessageQueue.no_such": False}
    sources = _cpp_sources()
    assert cpp_member_exists("ArenaWriter", "abort", sources)
    assert not cpp_member_exists("ArenaWriter", "no_such_member", sources)
    ok = "test_docs.py::test_every_test_a_page_names_exists"
    refs = dict(named_tests(f"`{ok}` and `mq/test_end.py::test_nothing_here`"))
    assert refs == {ok: True, "mq/test_end.py::test_nothing_here": False}
