"""`make vllm-queue-tests`: puts vllm_shm_arena's queue where vLLM's own tests look for vLLM's.

On ``PYTHONPATH`` this file is imported at the start of every interpreter, so spawned and
forked children get the same swap as the pytest process. It does not import vLLM itself: an
import hook waits for vLLM's ``shm_broadcast`` / ``shm_tensor_arena`` modules to be executed,
then rebinds their names (``_SWAPS``) to ours. Tests that did
``from ...shm_broadcast import MessageQueue`` therefore get ours, and so does vLLM code that
looks the names up in the module. ``VSA_SWAP=0`` leaves vLLM alone (the baseline run).
"""

from __future__ import annotations

import importlib
import importlib.abc
import os
import sys

_SB = "vllm.distributed.device_communicators.shm_broadcast"
_STA = "vllm.distributed.device_communicators.shm_tensor_arena"

#: module -> {vLLM's name: (our module, our name)}
_SWAPS: dict[str, dict[str, tuple[str, str]]] = {
    _SB: {
        "MessageQueue": ("vllm_shm_arena.message_queue", "MessageQueue"),
        "Handle": ("vllm_shm_arena.message_queue", "Handle"),
        "_reduce_tensor": ("vllm_shm_arena.pickler", "_reduce_tensor"),
        "_rebuild_tensor": ("vllm_shm_arena.pickler", "_rebuild_tensor"),
    },
    _STA: {
        "ShmTensorArena": ("vllm_shm_arena.arena", "ShmTensorArena"),
        "_ArenaPickler": ("vllm_shm_arena.pickler", "_ArenaPickler"),
        "_rebuild_arena_tensor": ("vllm_shm_arena.arena", "_rebuild_arena_tensor"),
        "_TENSOR_ARENAS": ("vllm_shm_arena.arena", "_TENSOR_ARENAS"),
    },
}


class _SwapLoader(importlib.abc.Loader):
    """Runs vLLM's module as usual, then rebinds the swapped names."""

    def __init__(self, inner: importlib.abc.Loader, name: str):
        self._inner = inner
        self._name = name

    def create_module(self, spec):
        return self._inner.create_module(spec)

    def exec_module(self, module) -> None:
        self._inner.exec_module(module)
        for attr, (mod, name) in _SWAPS[self._name].items():
            setattr(module, attr, getattr(importlib.import_module(mod), name))


class _SwapFinder(importlib.abc.MetaPathFinder):
    """Finds the two vLLM modules with the other finders and wraps their loaders."""

    def find_spec(self, fullname, path, target=None):
        if fullname not in _SWAPS:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None and spec.loader is not None:
                spec.loader = _SwapLoader(spec.loader, fullname)
                return spec
        return None


if os.environ.get("VSA_SWAP", "1") == "1":
    sys.meta_path.insert(0, _SwapFinder())
