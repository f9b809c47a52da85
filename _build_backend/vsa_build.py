"""PEP 517 backend: setuptools' build, compiled against the torch of the environment installed into.

A C++ torch extension only loads in the torch it was compiled against, so the build must use the
torch that is already installed where the package goes, never one of its own: listing torch in
``[build-system] requires`` makes pip's isolated build fetch the newest torch from the index (a
second multi-GB download, whose headers may not even accept this code's flags), and the result
would not load beside the environment's torch.

So torch is not a build requirement. Before setup.py runs, the backend identifies the
interpreter of the environment being installed into (the target) and asks it, started isolated
(``-I``: the build environment's PYTHONPATH and sitecustomize do not apply), where its torch
lives:

* pip's default isolation runs the backend with the installing interpreter itself and only
  hides its site-packages (PYTHONPATH, a sitecustomize): the target is ``sys.executable``;
* a build venv of the installer's own (pip ``--use-feature=venv-isolation``, uv): the first of
  the installer's interpreter (our parent process's argv[0], when a Python), its ``--python``
  option (uv), its ``$VIRTUAL_ENV`` / ``$CONDA_PREFIX``, the interpreter that made the build
  venv (pyvenv.cfg's ``command``), a ``.venv`` in its working directory or above (uv's rule)
  that runs;
* without isolation (``--no-build-isolation``) torch is importable already and used as it is.

The target's site-packages directories are appended to ``sys.path`` (after the build
environment's own, so its setuptools still wins) and setup.py compiles against that torch.
A target without torch, or of another Python, stops the build with one message saying what to
install or run; the backend never installs torch.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

from setuptools import build_meta as _setuptools
from setuptools.build_meta import (  # noqa: F401  (re-exported hooks that need no torch)
    build_sdist,
    get_requires_for_build_sdist,
)

#: What to tell the user when no environment with torch can be found.
NO_TORCH_MESSAGE = """\
vllm-shm-arena: no torch found in the environment being installed into.

This package is a C++ extension compiled against the torch already installed where it goes
(vLLM's torch); it does not install torch itself. Install torch first, e.g.
    pip install torch==2.13.0          # vLLM 0.33's pin; or simply install vLLM first
then install this package again (in a command of its own: a torch installed by the same
command comes after this build). If that environment is not the one you meant, or torch is
there but was not found, build without isolation, in the environment that has torch:
    pip install setuptools wheel ninja
    pip install --no-build-isolation vllm-shm-arena   (uv: uv pip install --no-build-isolation)
Environment being installed into: {target}"""

# Run by each candidate interpreter: where its torch lives, and which Python it is.
_PROBE = r"""
import json, os, sys, sysconfig
out = {"ext_suffix": sysconfig.get_config_var("EXT_SUFFIX"), "prefix": sys.prefix}
try:
    import torch
except Exception as e:
    out["error"] = f"{type(e).__name__}: {e}"
else:
    site = os.path.dirname(os.path.dirname(os.path.abspath(torch.__file__)))
    paths = [sysconfig.get_paths()[k] for k in ("purelib", "platlib")]
    out["torch"] = torch.__version__
    out["paths"] = [site] + [p for p in paths if p != site and os.path.isdir(p)]
print(json.dumps(out))
"""


def _venv_command_interpreter():
    """The interpreter that made this build venv (pyvenv.cfg's ``command = X -m venv DIR``)."""
    cfg = os.path.join(sys.prefix, "pyvenv.cfg")
    try:
        with open(cfg) as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    for line in lines:
        key, _, value = line.partition("=")
        if key.strip() == "command" and " -m venv " in value:
            return value.split(" -m venv ", 1)[0].strip()
    return None


def _parent():
    """The installer (our parent process): its argv, environment and working directory."""
    ppid = os.getppid()
    try:
        with open(f"/proc/{ppid}/cmdline", "rb") as f:
            argv = [a.decode(errors="replace") for a in f.read().split(b"\0") if a]
        with open(f"/proc/{ppid}/environ", "rb") as f:
            pairs = [a.decode(errors="replace").partition("=") for a in f.read().split(b"\0")]
        cwd = os.readlink(f"/proc/{ppid}/cwd")
    except OSError:
        return [], {}, os.getcwd()
    return argv, {k: v for k, _, v in pairs if k}, cwd


def _interpreter(name, path_var, cwd):
    """``name`` (a path, a bare command or a venv directory) as an interpreter path, or None."""
    if os.sep not in name:
        for d in path_var.split(os.pathsep):
            if d and os.access(os.path.join(d, name), os.X_OK):
                return os.path.join(d, name)
        return None
    exe = os.path.join(cwd, name)
    if os.path.isdir(exe):
        exe = os.path.join(exe, "bin", "python")
    return exe if os.path.exists(exe) else None


def _python_option(argv):
    """The value of ``--python``/``-p`` on the installer's command line (uv, pip)."""
    for i, a in enumerate(argv):
        if a in ("--python", "-p") and i + 1 < len(argv):
            return argv[i + 1]
        if a.startswith("--python="):
            return a.split("=", 1)[1]
    return None


def _target_candidates():
    """(interpreter, why) pairs for the environment being installed into, most direct first."""
    import sysconfig

    if sysconfig.get_paths()["purelib"] not in sys.path:
        # pip's default isolation: this interpreter is the installing one, its site-packages
        # hidden from this process only.
        yield sys.executable, "the installing interpreter, its site-packages hidden by pip"
        return
    # A build venv of its own (pip --use-feature=venv-isolation, uv), or no isolation at all.
    argv, environ, cwd = _parent()
    path_var = environ.get("PATH", "")
    if argv and "python" in os.path.basename(argv[0]):
        yield _interpreter(argv[0], path_var, cwd), "the installer's interpreter"
    opt = _python_option(argv)
    if opt:
        yield _interpreter(opt, path_var, cwd), f"the installer's --python {opt}"
    for var in ("VIRTUAL_ENV", "CONDA_PREFIX"):
        if environ.get(var):
            yield os.path.join(environ[var], "bin", "python"), f"the installer's ${var}"
    yield _venv_command_interpreter(), "the interpreter that made the build venv"
    d = cwd
    while True:  # uv's rule: a .venv in the working directory or above
        if os.path.exists(os.path.join(d, ".venv", "bin", "python")):
            yield os.path.join(d, ".venv", "bin", "python"), f"{d}/.venv"
            break
        if os.path.dirname(d) == d:
            break
        d = os.path.dirname(d)


def _probe(exe):
    """The probe's answer from ``exe`` started isolated, or a dict with an ``error``."""
    try:
        res = subprocess.run(
            [exe, "-I", "-c", _PROBE], capture_output=True, text=True, timeout=300, check=False
        )
    except (OSError, subprocess.TimeoutExpired) as e:
        return {"error": f"{type(e).__name__}: {e}"}
    lines = res.stdout.strip().splitlines()
    if res.returncode != 0 or not lines:
        return {"error": (res.stderr.strip().splitlines() or [f"exit {res.returncode}"])[-1]}
    try:
        return json.loads(lines[-1])
    except ValueError:
        return {"error": f"unreadable answer {lines[-1]!r}"}


def _use_target_torch():
    """Makes the target environment's torch importable here, or stops with one message."""
    try:
        import torch  # noqa: F401  (no isolation, or already done: the target's torch)

        return
    except ImportError:
        pass
    import sysconfig

    suffix = sysconfig.get_config_var("EXT_SUFFIX")
    asked = []
    for exe, why in _target_candidates():
        if not exe or exe in (a for a, _ in asked):
            continue
        info = _probe(exe)
        if "ext_suffix" not in info:
            asked.append((exe, f"{why}: does not run: {info.get('error')}"))
            continue
        # The first Python that runs is the target: torch from anywhere else would not be the
        # torch the package is imported beside.
        if "torch" not in info:
            raise SystemExit(
                NO_TORCH_MESSAGE.format(
                    target=f"{info['prefix']} ({why}): {info.get('error', 'no torch')}"
                )
            )
        if info["ext_suffix"] != suffix:
            raise SystemExit(
                f"vllm-shm-arena: the environment being installed into, {info['prefix']}, "
                f"is a Python for {info['ext_suffix']}, but this build runs a Python for "
                f"{suffix}; build without isolation: pip install --no-build-isolation ..."
            )
        for p in info["paths"]:
            if p not in sys.path:
                sys.path.append(p)
        import torch  # noqa: F401

        print(
            f"vllm-shm-arena: building against torch {torch.__version__} of {info['prefix']} "
            f"({why}: {exe})",
            file=sys.stderr,
        )
        return
    tried = "; ".join(f"{exe} ({why})" for exe, why in asked) or "none"
    raise SystemExit(NO_TORCH_MESSAGE.format(target=f"not identified (tried: {tried})"))


def _with_torch(hook):
    def wrapped(*args, **kwargs):
        _use_target_torch()
        return hook(*args, **kwargs)

    wrapped.__name__ = hook.__name__
    wrapped.__doc__ = f"setuptools' {hook.__name__}, against the target environment's torch."
    return wrapped


get_requires_for_build_wheel = _with_torch(_setuptools.get_requires_for_build_wheel)
prepare_metadata_for_build_wheel = _with_torch(_setuptools.prepare_metadata_for_build_wheel)
build_wheel = _with_torch(_setuptools.build_wheel)
get_requires_for_build_editable = _with_torch(_setuptools.get_requires_for_build_editable)
prepare_metadata_for_build_editable = _with_torch(_setuptools.prepare_metadata_for_build_editable)
build_editable = _with_torch(_setuptools.build_editable)

__all__ = [
    "build_editable",
    "build_sdist",
    "build_wheel",
    "get_requires_for_build_editable",
    "get_requires_for_build_sdist",
    "get_requires_for_build_wheel",
    "prepare_metadata_for_build_editable",
    "prepare_metadata_for_build_wheel",
]
