"""Loads the compiled extension, turning a stale build into a clear "rebuild" error."""

from __future__ import annotations

import torch

_REBUILD_HINT = (
    "rebuild it against the torch in this environment: "
    "pip install --no-build-isolation --force-reinstall --no-deps vllm-shm-arena "
    "(or, from a checkout, pip install --no-build-isolation -e .)"
)


def _load():
    try:
        from vllm_shm_arena._build_info import TORCH_VERSION as built_for
    except ImportError:
        built_for = None
    if built_for is not None and built_for != torch.__version__:
        raise ImportError(
            f"vllm_shm_arena._C was built against torch {built_for}, but torch "
            f"{torch.__version__} is installed; {_REBUILD_HINT}"
        )
    try:
        from vllm_shm_arena import _C
    except ImportError as e:
        raise ImportError(f"cannot load vllm_shm_arena._C ({e}); {_REBUILD_HINT}") from e
    if _C.TORCH_VERSION != torch.__version__:
        raise ImportError(
            f"vllm_shm_arena._C was built against torch {_C.TORCH_VERSION}, but torch "
            f"{torch.__version__} is installed; {_REBUILD_HINT}"
        )
    return _C


_C = _load()
