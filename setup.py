"""Builds vllm_shm_arena._C: the torch-free core in csrc/core plus one bindings file.

Install against the torch already in the environment:
    pip install --no-build-isolation -e .
DEBUG=1 builds with -O0 -g. The CUDA runtime is never linked: csrc/core/cuda_shim.cpp finds the
runtime torch has already loaded, so the same build works with CPU-only and CUDA torch.
"""

import glob
import os

import torch
from setuptools import setup
from torch.utils.cpp_extension import BuildExtension, CppExtension

ROOT = os.path.dirname(os.path.abspath(__file__))
DEBUG = os.environ.get("DEBUG", "0") == "1"


def _cuda_include_dir():
    """The CUDA toolkit's include dir, if its runtime header is there (types only)."""
    candidates = [os.environ.get("CUDA_HOME", ""), "/usr/local/cuda"]
    for base in candidates:
        inc = os.path.join(base, "include") if base else ""
        if inc and os.path.exists(os.path.join(inc, "cuda_runtime_api.h")):
            return inc
    return None


def _write_build_info():
    """Records the torch this build is compiled against, checked at import time."""
    path = os.path.join(ROOT, "vllm_shm_arena", "_build_info.py")
    text = (
        '"""Written by setup.py: the torch this extension was compiled against."""\n\n'
        f"TORCH_VERSION = {torch.__version__!r}\n"
    )
    old = open(path).read() if os.path.exists(path) else None
    if old != text:
        with open(path, "w") as f:
            f.write(text)


_write_build_info()

sources = sorted(glob.glob(os.path.join("csrc", "core", "*.cpp"))) + [
    os.path.join("csrc", "torch_bindings.cpp")
]
include_dirs = [os.path.join(ROOT, "csrc")]
define_macros = [("VSA_TORCH_VERSION", f'"{torch.__version__}"')]
cuda_inc = _cuda_include_dir()
if cuda_inc:
    include_dirs.append(cuda_inc)
    define_macros.append(("VSA_HAVE_CUDA_HEADERS", "1"))

cxx_flags = ["-std=c++17", "-fvisibility=hidden"]
cxx_flags += ["-O0", "-g"] if DEBUG else ["-O3"]

setup(
    ext_modules=[
        CppExtension(
            name="vllm_shm_arena._C",
            sources=sources,
            include_dirs=include_dirs,
            define_macros=define_macros,
            extra_compile_args={"cxx": cxx_flags},
            extra_link_args=["-ldl", "-lpthread"],
        )
    ],
    cmdclass={"build_ext": BuildExtension.with_options(use_ninja=True)},
)
