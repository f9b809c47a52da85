"""The vLLM general plugin: swaps our ``MessageQueue`` in for the executor's broadcast queue.

vLLM 0.33 already has the switch (``ParallelConfig.enable_shm_tensor_arena``, the
``--enable-shm-tensor-arena`` CLI flag) and passes it to the ``MessageQueue`` it builds for
``rpc_broadcast_mq`` in ``vllm.v1.executor.multiproc_executor``. ``register()`` (the
``vllm.general_plugins`` entry point ``shm_tensor_arena``, which vLLM runs in every process:
API server, engine core, each worker) rebinds that module's ``MessageQueue`` name to
``ShmArenaMessageQueue``, a thin factory:

* ``ShmArenaMessageQueue(...)`` builds our queue only for the flagged queue whose readers are
  all on this node, or, on a multi-node run, laid out as vLLM's executor lays them out (node
  0's ranks local, every node as big), and for each worker's response queue on one node
  (``MessageQueue(1, 1)`` in ``WorkerProc._init_message_queues`` of a worker whose config has
  the flag; without a tensor arena; ``VLLM_SHM_ARENA_RESPONSE_QUEUES=0`` keeps vLLM's): the
  engine core then waits for each step's output on our ring, which spins only while messages
  flow and no worker computes on its CPU (``readers_cede_cpu``) and then sleeps, instead of in
  vLLM's reader, which spins for a second after every message. Every other queue (the flag
  off, other layouts, data parallelism across nodes, the response queues of a multi-node run)
  is vLLM's own class, built with the same arguments.
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

import contextvars
import importlib
import logging
from types import ModuleType
from typing import Any

from vllm_shm_arena.vllm_interface import (
    _PARALLEL_STATE,
    _TARGET_MODULE,
    _minor,
    _supported_versions_text,
    _vllm_version,
    interface_changes,
    is_supported_vllm_version,
)

#: Our entry-point name; ``VLLM_PLUGINS``, when set, must list it.
PLUGIN_NAME = "shm_tensor_arena"

# Under vLLM's "vllm" logger, so the lines use vLLM's handler, format and level.
logger = logging.getLogger(f"vllm.plugins.{PLUGIN_NAME}")

#: Set once ``register()`` has run in this process (patched or not): it logs at most once.
_attempted = False

#: The executor's parallel config while its ``_init_executor`` runs (set by the wrapper
#: ``register()`` installs around it): a data-parallel replica's node count is only there.
_EXECUTOR_CONFIG: contextvars.ContextVar[Any] = contextvars.ContextVar(
    "vllm_shm_arena_executor_config", default=None
)
#: A worker's parallel config while its ``WorkerProc._init_message_queues`` runs, where the
#: worker builds its response queue (``MessageQueue(1, 1)``: the worker writes each step's
#: output, the executor in the engine core reads it).
_WORKER_CONFIG: contextvars.ContextVar[Any] = contextvars.ContextVar(
    "vllm_shm_arena_worker_config", default=None
)


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
    ``enable_shm_tensor_arena`` is set and either every reader is node-local or the remote
    readers form a layout our join serves (``_remote_layout``, with the join installed), or
    when it is a flagged worker's response queue (``_is_response_queue``); vLLM's own class,
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
    #: vLLM's class this one stands in for, once installed (the interface check reads it).
    _vsa_stock: type | None = None

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
        elif not enable_shm_tensor_arena and cls._is_response_queue(
            n_reader, n_local_reader, local_reader_ranks, connect_ip, args, kwargs
        ):
            # A flagged worker's response queue: ours, without a tensor arena (a step's output
            # is small; the engine side joins by the handle's type), so the engine core waits
            # for the workers on our ring (spin while messages flow, then sleep on a futex)
            # rather than in vLLM's reader, which spins for a second after every message.
            # Its reader (the engine core) cedes its CPU: while the workers compute a step
            # on CPUs it shares with them, it sleeps rather than take its share of theirs.
            mq = ours(
                n_reader,
                n_local_reader,
                max_chunk_bytes=max_chunk_bytes,
                max_chunks=max_chunks,
                readers_cede_cpu=True,
            )
            logger.info(
                "vllm_shm_arena: this worker's response queue is this package's ring (no tensor "
                "arena; VLLM_SHM_ARENA_RESPONSE_QUEUES=0 keeps vLLM's)"
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
    def _is_response_queue(
        cls,
        n_reader: int,
        n_local_reader: int,
        local_reader_ranks: list[int] | None,
        connect_ip: str | None,
        args: tuple,
        kwargs: dict,
    ) -> bool:
        """Whether this is a worker's response queue that should be ours: built inside
        ``WorkerProc._init_message_queues`` of a worker whose parallel config has
        ``enable_shm_tensor_arena``, one local reader, nothing else asked, and
        ``VLLM_SHM_ARENA_RESPONSE_QUEUES`` not ``0``."""
        config = _WORKER_CONFIG.get()
        if config is None or getattr(config, "enable_shm_tensor_arena", False) is not True:
            return False
        if (n_reader, n_local_reader, local_reader_ranks, connect_ip) != (1, 1, None, None):
            return False
        if args or kwargs:
            return False
        from vllm_shm_arena import settings

        return settings.response_queues_enabled()

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
        config = _EXECUTOR_CONFIG.get()
        if config is not None and hasattr(config, "nnodes_within_dp"):
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


def _watch_config(cls: type, name: str, var: contextvars.ContextVar, config_of) -> None:
    """Wraps method ``name`` of ``cls`` (a class attribute: every instance) so that while it
    runs ``var`` holds ``config_of(self, *args, **kwargs)``, the parallel config the factory
    reads. Once: a second call finds the wrapper (``_vsa_stock``) and leaves it."""
    stock = getattr(cls, name)
    if getattr(stock, "_vsa_stock", None) is not None:
        return

    def wrapper(self, *args, **kwargs):
        token = var.set(config_of(self, *args, **kwargs))
        try:
            return stock(self, *args, **kwargs)
        finally:
            var.reset(token)

    wrapper.__name__ = wrapper.__qualname__ = name
    wrapper._vsa_stock = stock
    wrapper.__wrapped__ = stock  # inspect.signature reads vLLM's
    setattr(cls, name, wrapper)


def _install_config_watch(mpe: ModuleType) -> None:
    """``MultiprocExecutor._init_executor``, where the executor builds its broadcast queue:
    ``_EXECUTOR_CONFIG`` holds the executor's ``parallel_config`` (the queue's arguments do
    not say how nodes split into data-parallel replicas)."""
    _watch_config(
        mpe.MultiprocExecutor,
        "_init_executor",
        _EXECUTOR_CONFIG,
        lambda self, *args, **kwargs: getattr(self, "parallel_config", None),
    )


def _install_worker_watch(mpe: ModuleType) -> None:
    """``WorkerProc._init_message_queues(input_shm_handle, vllm_config)``, where a worker
    builds its response queue: ``_WORKER_CONFIG`` holds the worker's ``parallel_config`` (the
    response queue's arguments do not carry the flag)."""
    _watch_config(
        mpe.WorkerProc,
        "_init_message_queues",
        _WORKER_CONFIG,
        lambda self, handle=None, vllm_config=None, *args, **kwargs: getattr(
            vllm_config, "parallel_config", None
        ),
    )


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
    ShmArenaMessageQueue._vsa_stock = mpe.MessageQueue
    _install_config_watch(mpe)
    _install_worker_watch(mpe)
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
    _install_frontend()
    return None


def _install_frontend() -> None:
    """The frontend arena's rebinding (vllm_frontend.py); a vLLM without its names keeps its
    own multimodal path (a debug line: the queue, ours, is what the plugin is for), one whose
    names differ from what was verified the same with a warning."""
    try:
        from vllm_shm_arena import vllm_frontend

        vllm_frontend.install()
    except RuntimeError as e:
        logger.warning("vllm_shm_arena: no frontend arena (%s); keeping vLLM's own", e)
    except Exception as e:  # noqa: BLE001  (vLLM's own multimodal path stays)
        logger.debug(
            "vllm_shm_arena: no frontend arena in this vLLM (%s: %s); multimodal items go as "
            "vLLM sends them",
            type(e).__name__,
            e,
        )


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
