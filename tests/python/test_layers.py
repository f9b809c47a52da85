"""Which way the package's imports run: every module imports only modules below it in
``ORDER`` (bottom first), so there is no cycle, the arena knows neither the pickler nor the
queue, and no part of the queue (vllm_shm_arena/mq/) imports the facade that is built on it.

Read from the sources (``ast``), function-level imports and ``importlib.import_module``
calls with a literal name included; the package's own ``__init__`` files (lazy re-exports)
are not modules of a layer.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "vllm_shm_arena"

#: Bottom first. A module may import the ones before it, never one after it.
ORDER = [
    "_C",  # the compiled extension
    "_build_info",  # written by the build
    "settings",
    "_ext",
    "metrics",
    "arena",
    "pickler",
    "sizing",
    "cleanup",
    "mq.protocol",
    "mq.lifecycle",
    "mq.reporting",
    "mq.admission",
    "mq.transport",
    "mq.end",
    "mq.reader",
    "mq.writer",
    "mq.relay",
    "mq.groups",
    "message_queue",
    "frontend",  # the frontend arena's primitives (API server, engine core)
    "vllm_multinode",  # the multi-node join the plugin installs
    "vllm_interface",  # what of vLLM the plugin relies on, and its check
    "vllm_frontend",  # the frontend primitives' rebinding into vLLM's multimodal path
    "vllm_plugin",
    "check",
    "__main__",
]


def _module_name(path: Path) -> str:
    rel = path.relative_to(PACKAGE).with_suffix("")
    return ".".join(rel.parts)


def _targets(path: Path) -> set[str]:
    """The package's modules ``path`` imports (names relative to the package)."""
    out: set[str] = set()
    prefix = "vllm_shm_arena."
    for node in ast.walk(ast.parse(path.read_text())):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            if node.module == "vllm_shm_arena" or node.module == "vllm_shm_arena.mq":
                names = [f"{node.module}.{a.name}" for a in node.names]
            else:
                names = [node.module]
        elif (
            isinstance(node, ast.Call)
            and getattr(node.func, "attr", None) == "import_module"
            and node.args
            and isinstance(node.args[0], ast.Constant)
            and isinstance(node.args[0].value, str)
        ):
            names = [node.args[0].value]
        for n in names:
            if n.startswith(prefix):
                out.add(n[len(prefix) :])
    return out


def _graph() -> dict[str, set[str]]:
    graph = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        if path.name == "__init__.py":
            continue
        graph[_module_name(path)] = _targets(path)
    return graph


def test_every_module_has_a_place_in_the_order():
    missing = sorted(set(_graph()) - set(ORDER))
    assert not missing, f"add these to ORDER (where their imports put them): {missing}"


@pytest.mark.parametrize(
    "module", [m for m in ORDER if (PACKAGE / f"{m.replace('.', '/')}.py").exists()]
)
def test_imports_run_one_way(module):
    graph = _graph()
    rank = {m: i for i, m in enumerate(ORDER)}
    upward = sorted(t for t in graph[module] if t in rank and rank[t] >= rank[module])
    assert not upward, f"{module} imports {upward}, which sit(s) at or above it"
    unknown = sorted(t for t in graph[module] if t not in rank and t not in ("mq",))
    assert not unknown, f"{module} imports modules outside ORDER: {unknown}"


def test_the_queue_parts_never_import_the_facade():
    graph = _graph()
    for module, targets in graph.items():
        if module.startswith("mq."):
            assert "message_queue" not in targets, module


def test_the_arena_knows_neither_the_pickler_nor_the_queue():
    targets = _graph()["arena"]
    assert not {t for t in targets if t == "pickler" or t.startswith("mq") or "queue" in t}


def test_the_architecture_page_lists_the_imports_the_code_has():
    page = (PACKAGE.parent / "docs" / "architecture.md").read_text()
    block = page.split("## Imports", 1)[1].split("```", 2)[1]
    listed = {}
    for line in block.strip().splitlines():
        module, _, targets = line.partition("──▶")
        targets = targets.strip()
        listed[module.strip()] = (
            set() if targets.startswith("(") else {t.strip() for t in targets.split(",")}
        )
    graph = {
        m: {t for t in targets if t in ORDER and t not in ("_C", "_build_info")}
        for m, targets in _graph().items()
        if m not in ("_C", "_build_info")
    }
    assert listed == graph, "docs/architecture.md's Imports list differs from the code"
