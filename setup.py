"""Builds vllm_shm_arena._C: the torch-free core in csrc/core plus the bindings above it
(csrc/bindings/*.cpp and csrc/torch_bindings.cpp, the module).

The extension is compiled against the torch of the environment it is installed into:
    pip install .                          # pip's defaults; see _build_backend/vsa_build.py
    pip install --no-build-isolation -e .  # development, in place
DEBUG=1 builds with -O0 -g. VSA_TORCH_LOCAL_VERSION=1 gives the package a local version naming
the torch it is built against (0.1.0+torch2.13.0.cpu), for wheels meant to be handed around.
The CUDA runtime is never linked: csrc/core/cuda_shim.cpp finds the runtime torch has already
loaded, so the same build works with CPU-only and CUDA torch.

The C++ standard is the one torch's cpp_extension adds by itself (it adds one when the flags
name none), checked against the minimum torch's headers demand; see _cxx_standard.
"""

import glob
import inspect
import os
import re
import sys

from setuptools import setup

ROOT = os.path.dirname(os.path.abspath(__file__))
DEBUG = os.environ.get("DEBUG", "0") == "1"
BASE_VERSION = "0.1.0"

try:
    import torch
    from torch.utils.cpp_extension import BuildExtension, CppExtension, include_paths
except ImportError:
    torch = None

# Commands that compile; the rest (sdist, egg_info, dist_info) need no torch.
_BUILD_COMMANDS = {
    "build",
    "build_ext",
    "bdist_wheel",
    "bdist",
    "install",
    "develop",
    "editable_wheel",
}


def _cuda_include_dir():
    """The CUDA toolkit's include dir, if its runtime header is there (types only)."""
    candidates = [os.environ.get("CUDA_HOME", ""), "/usr/local/cuda"]
    for base in candidates:
        inc = os.path.join(base, "include") if base else ""
        if inc and os.path.exists(os.path.join(inc, "cuda_runtime_api.h")):
            return inc
    return None


def _header_min_standard():
    """The oldest C++ standard torch's headers accept (their `__cplusplus <` guard), or 17."""
    for inc in include_paths():
        path = os.path.join(inc, "torch", "all.h")
        if os.path.exists(path):
            with open(path) as f:
                m = re.search(r"__cplusplus\s*<\s*(\d{4})(\d{2})L", f.read())
            if m:
                # 201703L -> 17, 202002L -> 20.
                return int(m.group(1)) % 100
    return 17


def _cpp_extension_standard():
    """The standard BuildExtension adds when the flags name none (None if it cannot be read)."""
    try:
        src = inspect.getsource(BuildExtension.build_extensions)
    except (OSError, TypeError):
        return None
    m = re.search(r"""cpp_flag_prefix\s*\+\s*['"]c\+\+(\d+)['"]""", src)
    return int(m.group(1)) if m else None


def _cxx_standard():
    """(standard, flags): the standard to build with, and the -std flag to pass, if any.

    torch's own choice wins, so the extension is compiled the way torch compiles extensions
    (no -std passed: cpp_extension adds its own). Where that choice cannot be read, or is older
    than the headers accept, the headers' minimum is passed explicitly.
    """
    need = max(17, _header_min_standard())
    default = _cpp_extension_standard()
    if default is not None and default >= need:
        return default, []
    return need, [f"-std=c++{need}"]


def _local_version():
    """The torch this build is for, as a local version label: torch2.13.0.cpu."""
    return "torch" + re.sub(r"[^0-9A-Za-z.]", ".", torch.__version__)


def _build_info_text(cxx_standard):
    return (
        '"""Written by setup.py: the torch this extension was compiled against."""\n\n'
        f"TORCH_VERSION = {torch.__version__!r}\n"
        f"CXX_STANDARD = {cxx_standard}\n"
    )


version = BASE_VERSION
ext_modules = []
cmdclass = {}

if torch is None:
    if _BUILD_COMMANDS.intersection(sys.argv[1:]):
        sys.exit(
            "vllm-shm-arena: torch is not importable; this extension is compiled against the "
            "torch of the environment it is installed into. Install torch first "
            "(e.g. pip install torch==2.13.0, vLLM 0.33's), then build again."
        )
else:
    CXX_STANDARD, std_flags = _cxx_standard()
    if os.environ.get("VSA_TORCH_LOCAL_VERSION", "0") == "1":
        version = f"{BASE_VERSION}+{_local_version()}"

    class _BuildExt(BuildExtension.with_options(use_ninja=True)):
        """BuildExtension that keeps objects per torch and writes _build_info.py beside _C."""

        def finalize_options(self):
            super().finalize_options()
            # Object files built for one torch are never reused for another.
            tag = re.sub(r"[^0-9A-Za-z.]", "_", torch.__version__)
            self.build_temp = os.path.join(self.build_temp, f"torch-{tag}")
            # build_ext skips an extension whose output is newer than its sources, even when
            # that output was built for another torch; ninja still recompiles only what changed.
            self.force = True

        def run(self):
            super().run()
            # Next to the built _C: the package dir of the wheel being built, or the source
            # tree for an in-place build (a wheel build leaves the source tree untouched).
            base = ROOT if self.inplace else self.build_lib
            path = os.path.join(base, "vllm_shm_arena", "_build_info.py")
            text = _build_info_text(CXX_STANDARD)
            old = open(path).read() if os.path.exists(path) else None
            if old != text:
                with open(path, "w") as f:
                    f.write(text)
            print(
                f"vllm-shm-arena: built against torch {torch.__version__} "
                f"({os.path.dirname(torch.__file__)}) as C++{CXX_STANDARD}",
                file=sys.stderr,
            )

    # The torch-free core, the bindings beside the module, and the module itself.
    sources = (
        sorted(glob.glob(os.path.join("csrc", "core", "*.cpp")))
        + sorted(glob.glob(os.path.join("csrc", "bindings", "*.cpp")))
        + [os.path.join("csrc", "torch_bindings.cpp")]
    )
    include_dirs = [os.path.join(ROOT, "csrc")]
    define_macros = [("VSA_TORCH_VERSION", f'"{torch.__version__}"')]
    cuda_inc = _cuda_include_dir()
    if cuda_inc:
        include_dirs.append(cuda_inc)
        define_macros.append(("VSA_HAVE_CUDA_HEADERS", "1"))

    cxx_flags = std_flags + ["-fvisibility=hidden"]
    cxx_flags += ["-O0", "-g"] if DEBUG else ["-O3"]
    ext_modules = [
        CppExtension(
            name="vllm_shm_arena._C",
            sources=sources,
            include_dirs=include_dirs,
            define_macros=define_macros,
            extra_compile_args={"cxx": cxx_flags},
            extra_link_args=["-ldl", "-lpthread"],
        )
    ]
    cmdclass = {"build_ext": _BuildExt}

setup(version=version, ext_modules=ext_modules, cmdclass=cmdclass)
