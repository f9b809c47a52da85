"""Loads the compiled extension, turning a stale build into a clear "rebuild" error."""

from __future__ import annotations

import torch

# pip's defaults rebuild against the environment's torch (the in-tree build backend finds it);
# --no-cache-dir so that pip cannot hand back a wheel of ours it cached for another torch.
_REBUILD_HINT = (
    "rebuild it against the torch in this environment: "
    "pip install --force-reinstall --no-deps --no-cache-dir <what you installed it from> "
    "(from a checkout: pip install --force-reinstall --no-deps --no-cache-dir .; for "
    "development: pip install --no-build-isolation -e .), or install a wheel built for "
    "torch {torch}"
)


def _hint() -> str:
    return _REBUILD_HINT.format(torch=torch.__version__)


def _load():
    try:
        from vllm_shm_arena._build_info import TORCH_VERSION as built_for
    except ImportError:
        built_for = None
    if built_for is not None and built_for != torch.__version__:
        raise ImportError(
            f"vllm_shm_arena._C was built against torch {built_for}, but torch "
            f"{torch.__version__} is installed; {_hint()}"
        )
    try:
        from vllm_shm_arena import _C
    except ImportError as e:
        raise ImportError(f"cannot load vllm_shm_arena._C ({e}); {_hint()}") from e
    if _C.TORCH_VERSION != torch.__version__:
        raise ImportError(
            f"vllm_shm_arena._C was built against torch {_C.TORCH_VERSION}, but torch "
            f"{torch.__version__} is installed; {_hint()}"
        )
    return _C


_C = _load()
