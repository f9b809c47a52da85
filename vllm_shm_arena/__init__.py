"""vllm-shm-arena: a shared-memory tensor arena for vLLM's engine-to-worker broadcast.

Large CPU tensors are copied once into shared memory and read zero-copy by every
tensor-parallel worker; with a CUDA context, the memory is page-locked so the worker's H2D
copy is a DMA. Importing this package never requires vLLM.

The public names load their modules on first use (PEP 562), so ``vllm_shm_arena.vllm_plugin``
can be imported, and can stand aside with one log line, even when the compiled extension is
stale; ``from vllm_shm_arena import MessageQueue`` then raises the clear rebuild error.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

_EXPORTS = {
    "ArenaHandle": "vllm_shm_arena.arena",
    "MIN_BYTES": "vllm_shm_arena.arena",
    "ShmTensorArena": "vllm_shm_arena.arena",
    "_TENSOR_ARENAS": "vllm_shm_arena.arena",
    "_rebuild_arena_parameter": "vllm_shm_arena.arena",
    "_rebuild_arena_tensor": "vllm_shm_arena.arena",
    "Handle": "vllm_shm_arena.message_queue",
    "MessageQueue": "vllm_shm_arena.message_queue",
    "WriterDiedError": "vllm_shm_arena.message_queue",
    "_ArenaPickler": "vllm_shm_arena.pickler",
    "_rebuild_tensor": "vllm_shm_arena.pickler",
    "_reduce_tensor": "vllm_shm_arena.pickler",
    "dumps": "vllm_shm_arena.pickler",
    "loads": "vllm_shm_arena.pickler",
}

__all__ = [
    "MIN_BYTES",
    "ArenaHandle",
    "Handle",
    "MessageQueue",
    "ShmTensorArena",
    "WriterDiedError",
    "_ArenaPickler",
    "_TENSOR_ARENAS",
    "_rebuild_arena_parameter",
    "_rebuild_arena_tensor",
    "_rebuild_tensor",
    "_reduce_tensor",
    "dumps",
    "loads",
]
assert sorted(__all__) == sorted(_EXPORTS)

if TYPE_CHECKING:  # pragma: no cover
    from vllm_shm_arena.arena import (
        _TENSOR_ARENAS,
        MIN_BYTES,
        ArenaHandle,
        ShmTensorArena,
        _rebuild_arena_parameter,
        _rebuild_arena_tensor,
    )
    from vllm_shm_arena.message_queue import Handle, MessageQueue, WriterDiedError
    from vllm_shm_arena.pickler import _ArenaPickler, _rebuild_tensor, _reduce_tensor, dumps, loads


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'vllm_shm_arena' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(list(globals()) + list(_EXPORTS))
