"""vllm-shm-arena: a shared-memory tensor arena for vLLM's engine-to-worker broadcast.

Large CPU tensors are copied once into shared memory and read zero-copy by every
tensor-parallel worker; with a CUDA context, the memory is page-locked so the worker's H2D
copy is a DMA. Importing this package never requires vLLM.
"""

from vllm_shm_arena._ext import _C  # noqa: F401  (fails early with a clear rebuild message)
from vllm_shm_arena.arena import (
    _TENSOR_ARENAS,
    MIN_BYTES,
    ArenaHandle,
    ShmTensorArena,
    _rebuild_arena_parameter,
    _rebuild_arena_tensor,
)
from vllm_shm_arena.message_queue import Handle, MessageQueue
from vllm_shm_arena.pickler import (
    _ArenaPickler,
    _rebuild_tensor,
    _reduce_tensor,
    dumps,
    loads,
)

__version__ = "0.1.0"

__all__ = [
    "ArenaHandle",
    "Handle",
    "MessageQueue",
    "MIN_BYTES",
    "ShmTensorArena",
    "_ArenaPickler",
    "_TENSOR_ARENAS",
    "_rebuild_arena_parameter",
    "_rebuild_arena_tensor",
    "_rebuild_tensor",
    "_reduce_tensor",
    "dumps",
    "loads",
]
