"""The vLLM general plugin: swaps our ``MessageQueue`` in for the executor's broadcast queue.

vLLM 0.33 already has the switch (``ParallelConfig.enable_shm_tensor_arena``, the
``--enable-shm-tensor-arena`` CLI flag) and passes it to the ``MessageQueue`` it builds for
``rpc_broadcast_mq`` in ``vllm.v1.executor.multiproc_executor``. ``register()`` (the
``vllm.general_plugins`` entry point ``shm_tensor_arena``, which vLLM runs in every process:
API server, engine core, each worker) rebinds that module's ``MessageQueue`` name to
``ShmArenaMessageQueue``, a thin factory:

* ``ShmArenaMessageQueue(...)`` builds our queue only for the flagged queue whose readers are
  all on this node; every other queue (the response queues, the flag off, remote readers) is
  vLLM's own class, built with the same arguments.
* ``ShmArenaMessageQueue.create_from_handle(handle, rank)`` dispatches on the handle's type,
  so a worker joins whichever kind of queue the engine built.

Only this module imports vLLM, and only inside ``register()``. ``register()`` never raises:
an unsupported vLLM, or an extension that does not load (a build for another torch), logs
one line and leaves vLLM's own queue in place. Versions of vLLM without the native
``enable_shm_tensor_arena`` field are not supported (see ``SUPPORTED_VLLM_VERSIONS``).
"""

from __future__ import annotations

import importlib
import logging
import re
from types import ModuleType
from typing import Any

#: vLLM releases this plugin was verified against, as "major.minor" (any patch release).
SUPPORTED_VLLM_VERSIONS: tuple[str, ...] = ("0.33",)
#: Our entry-point name; ``VLLM_PLUGINS``, when set, must list it.
PLUGIN_NAME = "shm_tensor_arena"
#: The module whose ``MessageQueue`` name the plugin rebinds.
_TARGET_MODULE = "vllm.v1.executor.multiproc_executor"

# Under vLLM's "vllm" logger, so the lines use vLLM's handler, format and level.
logger = logging.getLogger(f"vllm.plugins.{PLUGIN_NAME}")

#: Set once ``register()`` has run in this process (patched or not): it logs at most once.
_attempted = False


def _supported_versions_text() -> str:
    return ", ".join(f"{v}.x" for v in SUPPORTED_VLLM_VERSIONS)


def is_supported_vllm_version(version: str) -> bool:
    """Whether ``version`` (e.g. ``"0.33.1"``, ``"0.33.0+cu130"``) is a supported release.
    Development builds of the next release (``0.34.0.dev12``) are not."""
    m = re.match(r"(\d+)\.(\d+)(\.\d+)?(.*)$", version)
    if m is None:
        return False
    if ".dev" in m.group(4) or m.group(4).startswith("dev"):
        return False
    return f"{m.group(1)}.{m.group(2)}" in SUPPORTED_VLLM_VERSIONS


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

    def __new__(
        cls,
        n_reader: int,
        n_local_reader: int,
        local_reader_ranks: list[int] | None = None,
        max_chunk_bytes: int = 24 << 20,
        max_chunks: int = 10,
        connect_ip: str | None = None,
        enable_shm_tensor_arena: bool = False,
        **kwargs: Any,
    ) -> Any:
        stock, ours = cls._classes()
        if enable_shm_tensor_arena and n_local_reader > 0 and n_reader == n_local_reader:
            if kwargs:
                logger.debug("vllm_shm_arena: ignoring MessageQueue arguments %s", sorted(kwargs))
            # OSError (e.g. /dev/shm too small) propagates: the user asked for the arena.
            mq = ours(
                n_reader,
                n_local_reader,
                local_reader_ranks,
                max_chunk_bytes=max_chunk_bytes,
                max_chunks=max_chunks,
                connect_ip=connect_ip,
                enable_shm_tensor_arena=True,
            )
            logger.info(
                "vllm_shm_arena: broadcast queue to %d local readers uses the C++ shm tensor "
                "arena (%s)",
                n_reader,
                mq.arena.layout if mq.arena is not None else "none",
            )
            return mq
        if enable_shm_tensor_arena:
            logger.warning(
                "vllm_shm_arena: --enable-shm-tensor-arena is set but %d of %d readers of "
                "this queue are on other nodes; using vLLM's own MessageQueue for it",
                n_reader - n_local_reader,
                n_reader,
            )
        return stock(
            n_reader,
            n_local_reader,
            local_reader_ranks,
            max_chunk_bytes=max_chunk_bytes,
            max_chunks=max_chunks,
            connect_ip=connect_ip,
            enable_shm_tensor_arena=enable_shm_tensor_arena,
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
    def _classes(cls) -> tuple[type, type]:
        if cls._stock_cls is None or cls._ours_cls is None:
            raise RuntimeError("vllm_shm_arena.vllm_plugin.register() has not run")
        return cls._stock_cls, cls._ours_cls


def _patch(mpe: ModuleType, mq_module: ModuleType) -> None:
    ShmArenaMessageQueue._stock_cls = mpe.MessageQueue
    ShmArenaMessageQueue._stock_handle_cls = mpe.Handle
    ShmArenaMessageQueue._ours_cls = mq_module.MessageQueue
    ShmArenaMessageQueue._ours_handle_cls = mq_module.Handle
    mpe.MessageQueue = ShmArenaMessageQueue


def _register() -> str | None:
    """Does the work of ``register()``; returns why it left vLLM alone, or None if patched."""
    try:
        import vllm
    except ImportError as e:
        return f"vLLM cannot be imported ({e}); nothing to patch"
    version = str(getattr(vllm, "__version__", "unknown"))
    if not is_supported_vllm_version(version):
        return (
            f"vLLM {version} is not supported (supported: {_supported_versions_text()}); "
            "keeping vLLM's own MessageQueue"
        )
    from vllm.config import ParallelConfig

    if "enable_shm_tensor_arena" not in getattr(ParallelConfig, "__dataclass_fields__", {}):
        return (
            f"vLLM {version} has no ParallelConfig.enable_shm_tensor_arena (versions without "
            "the native flag are not supported); keeping vLLM's own MessageQueue"
        )
    try:
        mq_module = _import_extension()
    except ImportError as e:
        import torch

        return (
            f"cannot load the extension with torch {torch.__version__} and vLLM {version} "
            f"({e}); keeping vLLM's own MessageQueue"
        )
    try:
        mpe = importlib.import_module(_TARGET_MODULE)
    except ImportError as e:
        return f"cannot import {_TARGET_MODULE} ({e}); keeping vLLM's own MessageQueue"
    if mpe.MessageQueue is not ShmArenaMessageQueue:
        _patch(mpe, mq_module)
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
