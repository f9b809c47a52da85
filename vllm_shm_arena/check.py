"""``python -m vllm_shm_arena check``: is this environment ready for the arena?

Run it where vLLM runs (the same Python environment, inside the container). It prints one line
per check::

    <STATUS> <check>: <what was found>[; <what to do>]

``STATUS`` is ``OK`` (nothing to do), ``WARN`` (works, but slower or smaller than it could be,
or could not be tested; the line says why) or ``FAIL`` (the arena will not be used, or the
queue will not start; the line says how to fix it). The exit code is 1 when any line is
``FAIL``, else 0 (2 for a bad command line). ``--json`` prints one JSON object instead:
``{"ok": bool, "checks": [{"status", "check", "message", "data"}]}``, ``data`` holding the
measured values of a check (``{}`` when there are none).

The checks, in order:

* ``extension``: the compiled extension loads, and the torch it was built against
  (``_build_info.py``) is the torch running;
* ``vllm``: the installed vLLM's version, and whether the plugin supports it (its release line
  is in ``vllm_interface.SUPPORTED_VLLM_VERSIONS`` and its interface matches the verified one);
* ``plugin``: vLLM can see the entry point (group ``vllm.general_plugins``, name
  ``shm_tensor_arena``);
* ``VLLM_PLUGINS``: when set, it lists ``shm_tensor_arena`` (vLLM then loads only the
  comma-separated names listed, exactly as written);
* ``shm``: the shm directory, its free space (and the memory cgroup's), and the arena a queue
  would get there now beside vLLM's message ring (``vllm_shm_arena.sizing``; nothing is
  created);
* ``cuda``: torch sees a CUDA device and the extension finds the CUDA runtime torch loaded;
* ``pinning``: a reader of a small arena page-locks it (``cudaHostRegister`` on a shared
  mapping of the shm directory, through the extension's own pinning path);
* ``stale``: segments crashed writers left in the shm directory (the cleaner's dry run).

    python -m vllm_shm_arena check [--json] [--dir DIR] [--readers N]
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.metadata
import importlib.util
import json
import os
import sys
from typing import Any

from vllm_shm_arena import settings, vllm_interface, vllm_plugin

OK, WARN, FAIL = "OK", "WARN", "FAIL"
#: vLLM's broadcast ring: its chunk size when VLLM_MQ_MAX_CHUNK_BYTES_MB gives none (MiB), and
#: its chunk count.
_DEFAULT_CHUNK_MB = 16
_RING_CHUNKS = 10
_ENTRY_POINT_GROUP = "vllm.general_plugins"
_ENTRY_POINT_VALUE = "vllm_shm_arena.vllm_plugin:register"
_REBUILD = (
    "rebuild it against this torch: pip install --no-build-isolation --force-reinstall "
    "--no-deps vllm-shm-arena (from a checkout: pip install --no-build-isolation -e .)"
)
_MIB = 1 << 20


@dataclasses.dataclass
class Result:
    """One line of the report."""

    status: str
    check: str
    message: str
    data: dict = dataclasses.field(default_factory=dict)

    def line(self) -> str:
        """``STATUS check: message``."""
        return f"{self.status:<4} {self.check}: {self.message}"


def _mib(n: int) -> str:
    return f"{n / (1 << 30):.1f} GiB" if n >= 10 << 30 else f"{n / _MIB:.0f} MiB"


# ---------------------------------------------------------------------------- probes
# Each one reads one fact from the environment; the tests replace them with fakes.
def _torch_version() -> str:
    import torch

    return torch.__version__


def _built_for() -> str | None:
    """The torch version setup.py recorded for the extension, or None without a record."""
    try:
        from vllm_shm_arena._build_info import TORCH_VERSION
    except ImportError:
        return None
    return TORCH_VERSION


def _load_extension():
    """The compiled module (``ImportError`` with the rebuild hint when it does not load)."""
    return importlib.import_module("vllm_shm_arena._ext")._C


def _find_vllm() -> tuple[str | None, str]:
    """(vLLM's version or None when it is not installed, where it is)."""
    if importlib.util.find_spec("vllm") is None:
        return None, ""
    vllm = importlib.import_module("vllm")
    return vllm_interface._vllm_version(vllm), os.path.dirname(getattr(vllm, "__file__", "") or "")


def _vllm_interface_changes(version: str) -> list[str]:
    """What of the interface the plugin verified for ``version`` the installed vLLM lacks."""
    from vllm.config import ParallelConfig

    mpe = importlib.import_module(vllm_interface._TARGET_MODULE)
    return vllm_interface.interface_changes(version, ParallelConfig, mpe)


def _entry_points() -> list:
    return list(importlib.metadata.entry_points(group=_ENTRY_POINT_GROUP))


def _cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


def _cuda_init() -> str:
    """Creates this process's CUDA context (as a worker has one) -> the device's name."""
    import torch

    torch.cuda.init()
    return torch.cuda.get_device_name(torch.cuda.current_device())


def _pin_probe(shm_dir: str) -> dict:
    """Attaches a reader to a small arena in ``shm_dir`` and has it hand out a tensor, which a
    process with a CUDA context pins (the reader's own pinning path) -> the reader's stats.
    The arena's name is unlinked at once: nothing is left behind."""
    import torch

    from vllm_shm_arena.arena import ShmTensorArena

    w = ShmTensorArena.create(1, num_slots=1, slot_bytes=2 * _MIB, shm_dir=shm_dir)
    try:
        r = ShmTensorArena.attach(w.handle(), 0)
        w.unlink()
        src = torch.ones(_MIB, dtype=torch.uint8)
        slot = w.write_tensor(src)
        if slot is None:
            raise RuntimeError(f"the probe arena declined a tensor: {w.stats()['declined']}")
        t = r.get_tensor(slot, src.nbytes, torch.uint8, src.shape)
        stats = dict(r.stats())
        del t
        r.close()
        return stats
    finally:
        w.close()


# ---------------------------------------------------------------------------- checks
def check_extension() -> Result:
    """``extension``: the build's torch is the running torch, and ``_C`` loads."""
    try:
        running = _torch_version()
    except Exception as e:
        return Result(FAIL, "extension", f"torch does not import ({e}); install torch first")
    built = _built_for()
    data = {"built_for": built, "torch": running}
    if built is not None and built != running:
        return Result(
            FAIL,
            "extension",
            f"built against torch {built}, but torch {running} is running; {_REBUILD}",
            data,
        )
    try:
        c = _load_extension()
    except ImportError as e:
        return Result(FAIL, "extension", str(e), data)
    where = getattr(c, "__file__", "") or "?"
    data["path"] = where
    if built is None:
        return Result(
            WARN,
            "extension",
            f"loads ({where}, built for torch {c.TORCH_VERSION}), but its build record "
            f"_build_info.py is missing; {_REBUILD}",
            data,
        )
    return Result(OK, "extension", f"built for torch {built}, torch {running} is running", data)


def check_vllm() -> Result:
    """``vllm``: installed, a supported release, and the interface the plugin verified."""
    supported = ", ".join(f"{v}.x" for v in vllm_interface.SUPPORTED_VLLM_VERSIONS)
    try:
        version, where = _find_vllm()
    except Exception as e:
        return Result(
            FAIL,
            "vllm",
            f"vLLM is installed but does not import ({type(e).__name__}: {e}); the plugin "
            "cannot load; repair the vLLM installation",
        )
    if version is None:
        return Result(
            WARN,
            "vllm",
            f"vLLM is not installed in this environment ({sys.executable}); the queue works "
            "without it, but to check the plugin run this in vLLM's environment",
        )
    data = {"version": version, "path": where}
    if not vllm_interface.is_supported_vllm_version(version):
        return Result(
            FAIL,
            "vllm",
            f"vLLM {version} is not supported (supported: {supported}): the plugin keeps vLLM's "
            "own MessageQueue; install a supported vLLM, or a vllm-shm-arena release that "
            "supports this one",
            data,
        )
    try:
        changes = _vllm_interface_changes(version)
    except Exception as e:
        return Result(
            FAIL,
            "vllm",
            f"vLLM {version}: cannot import what the plugin patches ({type(e).__name__}: {e}); "
            "the plugin keeps vLLM's own MessageQueue",
            data,
        )
    if changes:
        data["changes"] = changes
        return Result(
            FAIL,
            "vllm",
            f"vLLM {version} differs from the interface verified for its release: "
            f"{'; '.join(changes)}; the plugin keeps vLLM's own MessageQueue",
            data,
        )
    return Result(OK, "vllm", f"vLLM {version} is supported (supported: {supported})", data)


def check_entry_point() -> Result:
    """``plugin``: the ``vllm.general_plugins`` entry point ``shm_tensor_arena`` is visible."""
    name = vllm_plugin.PLUGIN_NAME
    try:
        eps = _entry_points()
    except Exception as e:
        return Result(FAIL, "plugin", f"cannot read the installed entry points ({e})")
    ours = [ep for ep in eps if ep.name == name]
    if not ours:
        return Result(
            FAIL,
            "plugin",
            f"no entry point {name!r} in group {_ENTRY_POINT_GROUP} ({sys.executable}): vLLM "
            "will not load the plugin; install vllm-shm-arena into this environment (pip "
            "install --no-build-isolation vllm-shm-arena, or -e . from a checkout)",
        )
    values = sorted({ep.value for ep in ours})
    data = {"values": values}
    if values != [_ENTRY_POINT_VALUE]:
        return Result(
            FAIL,
            "plugin",
            f"entry point {name!r} points to {', '.join(values)}, not {_ENTRY_POINT_VALUE}: "
            "another package uses the name or an old install is left over; reinstall "
            "vllm-shm-arena",
            data,
        )
    dist = getattr(ours[0], "dist", None)
    who = f" ({dist.name} {dist.version})" if dist is not None else ""
    twice = f"; listed {len(ours)} times (installed twice?)" if len(ours) > 1 else ""
    status = WARN if twice else OK
    return Result(
        status,
        "plugin",
        f"entry point {_ENTRY_POINT_GROUP}:{name} -> {_ENTRY_POINT_VALUE}{who}{twice}",
        data,
    )


def check_vllm_plugins_env() -> Result:
    """``VLLM_PLUGINS``: unset (every plugin loads) or listing ``shm_tensor_arena``."""
    name = vllm_plugin.PLUGIN_NAME
    raw = settings.vllm_plugins()
    if raw is None:
        return Result(OK, "VLLM_PLUGINS", "not set: vLLM loads every installed plugin")
    names = raw.split(",")  # vLLM's own parsing: no stripping
    if name in names:
        return Result(OK, "VLLM_PLUGINS", f"{raw!r} lists {name}")
    stripped = [n.strip() for n in names if n.strip()]
    hint = " (vLLM does not strip spaces around the names)" if name in stripped else ""
    fixed = ",".join(stripped + ([] if name in stripped else [name]))
    return Result(
        FAIL,
        "VLLM_PLUGINS",
        f"{raw!r} does not list {name}{hint}, so vLLM will not load the plugin; set "
        f"VLLM_PLUGINS={fixed} or unset it",
    )


def _ring_bytes() -> int:
    mb = settings.mq_max_chunk_mb()
    if mb is None:
        mb = _DEFAULT_CHUNK_MB
    return _RING_CHUNKS * max(mb, 1) * _MIB


def check_shm(shm_dir: str | None, n_readers: int) -> Result:
    """``shm``: the directory, its free space, and the arena a queue would get there now."""
    from vllm_shm_arena import sizing

    try:
        c = _load_extension()
    except ImportError:
        return Result(WARN, "shm", "not checked: the extension does not load (see above)")
    d = shm_dir or c.default_shm_dir()
    if not os.path.isdir(d):
        return Result(
            FAIL,
            "shm",
            f"{d} is not a directory: mount a tmpfs there (Docker gives /dev/shm; --shm-size "
            "sets its size) or point VLLM_SHM_ARENA_SHM_DIR at one",
        )
    if not os.access(d, os.W_OK | os.X_OK):
        return Result(
            FAIL, "shm", f"{d} is not writable by this user: the queue cannot create its ring"
        )
    ring = _ring_bytes()
    try:
        layout = sizing.layout_from_env()
        size = sizing.plan(n_readers, layout, d, ring_bytes=ring)
    except ValueError as e:
        return Result(FAIL, "shm", f"{e}; the queue with the arena would refuse to start")
    except OSError as e:
        return Result(FAIL, "shm", f"cannot measure {d} ({e})")
    space = size.space
    data = size.as_dict()
    cg = "no memory cgroup limit"
    if space.cgroup_available is not None:
        cg = f"the memory cgroup can charge {_mib(space.cgroup_available)}"
    where = f"{d}: {_mib(space.shm_free)} free of {_mib(space.shm_total)}, {cg}"
    if space.shm_free < ring:  # the ring's own creation check
        return Result(
            FAIL,
            "shm",
            f"{where}: less than vLLM's {_mib(ring)} message ring, so the broadcast queue "
            "cannot start (with or without the arena); enlarge it (Docker: --shm-size)",
            data,
        )
    if size.sized_by == "config":
        return Result(
            OK,
            "shm",
            f"{where}; a queue gets the configured {layout.describe()} arena beside its "
            f"{_mib(ring)} ring",
            data,
        )
    return Result(WARN, "shm", size.message.removeprefix("vllm_shm_arena: "), data)


def check_cuda() -> Result:
    """``cuda``: a CUDA device, and the runtime torch loaded, found by the extension."""
    try:
        c = _load_extension()
    except ImportError:
        return Result(WARN, "cuda", "not checked: the extension does not load (see above)")
    try:
        available = _cuda_available()
    except Exception as e:
        available, why = False, f" ({e})"
    else:
        why = ""
    if not available:
        return Result(
            WARN,
            "cuda",
            f"torch sees no CUDA device{why}: readers cannot pin the arena, so H2D copies from "
            "it are pageable; expected on a CPU-only host, else check the driver and "
            "CUDA_VISIBLE_DEVICES",
        )
    try:
        device = _cuda_init()
    except Exception as e:
        return Result(FAIL, "cuda", f"torch sees a CUDA device but cannot initialise it ({e})")
    if not c.cuda_runtime_found():
        return Result(
            WARN,
            "cuda",
            f"CUDA works in torch ({device}) but the extension finds no CUDA runtime library "
            "among the loaded ones: readers will not pin; set VLLM_SHM_ARENA_CUDART to the "
            "path of the libcudart torch uses",
            {"device": device},
        )
    return Result(OK, "cuda", f"CUDA runtime found, device {device}", {"device": device})


def check_pinning(shm_dir: str | None, cuda: Result) -> Result:
    """``pinning``: a reader page-locks a small arena (needs the CUDA context ``cuda`` made)."""
    if not settings.pin_enabled():
        return Result(WARN, "pinning", "off (VLLM_SHM_ARENA_PIN=0): H2D copies are pageable")
    if cuda.status != OK:
        return Result(WARN, "pinning", "cannot test pinning: no usable CUDA runtime (see cuda)")
    try:
        c = _load_extension()
        stats = _pin_probe(shm_dir or c.default_shm_dir())
    except Exception as e:
        return Result(WARN, "pinning", f"cannot test pinning: the probe arena failed ({e})")
    data = {k: stats.get(k) for k in ("pinned_bytes", "pin_failed", "pin_no_space")}
    if stats.get("pin_no_space"):
        return Result(
            WARN,
            "pinning",
            "the shm directory could not back the probe arena's pages for pinning (it is "
            "full): readers stay unpinned; free or enlarge it",
            data,
        )
    if stats.get("pin_failed") or not stats.get("pinned_bytes"):
        return Result(
            WARN,
            "pinning",
            "cudaHostRegister of a shared-memory arena failed (the extension logged the CUDA "
            "error above): readers fall back to pageable H2D copies (correct, slower); "
            "VLLM_SHM_ARENA_PIN=0 skips the attempt",
            data,
        )
    return Result(
        OK,
        "pinning",
        f"a reader page-locked a {_mib(stats['pinned_bytes'])} shared-memory arena "
        "(cudaHostRegister)",
        data,
    )


def check_stale(shm_dir: str | None) -> Result:
    """``stale``: segments of crashed writers in the shm directory (nothing is removed)."""
    try:
        c = _load_extension()
        from vllm_shm_arena.cleanup import remove_stale_resources

        d = shm_dir or c.default_shm_dir()
        reports = remove_stale_resources(d, dry_run=True)
    except ImportError:
        return Result(WARN, "stale", "not checked: the extension does not load (see above)")
    except Exception as e:
        return Result(WARN, "stale", f"cannot list the shm directory ({e})")
    stale = [r for r in reports if r.writer == "dead"]
    unknown = [r for r in reports if r.writer == "unknown"]
    held = 0
    for r in stale:
        try:
            held += os.stat(os.path.join(d, r.name), follow_symlinks=False).st_blocks * 512
        except OSError:
            pass
    data = {
        "stale": [r.name for r in stale],
        "unknown": [r.name for r in unknown],
        "stale_backed_bytes": held,
    }
    kept = ""
    if unknown:
        kept = f"; {len(unknown)} kept as unknown (not this build's or not this user's)"
    if stale:
        opt = f" --dir {d}" if shm_dir else ""
        return Result(
            WARN,
            "stale",
            f"{len(stale)} stale segment(s) in {d} left by crashed writers, holding "
            f"{_mib(held)}{kept}; remove them with: python -m vllm_shm_arena cleanup{opt}",
            data,
        )
    return Result(OK, "stale", f"no stale segments in {d}{kept}", data)


def run_checks(shm_dir: str | None = None, n_readers: int = 8) -> list[Result]:
    """Every check, in the order the module docstring lists them."""
    results = [
        check_extension(),
        check_vllm(),
        check_entry_point(),
        check_vllm_plugins_env(),
        check_shm(shm_dir, n_readers),
    ]
    cuda = check_cuda()
    results += [cuda, check_pinning(shm_dir, cuda), check_stale(shm_dir)]
    return results


def main(argv: list[str] | None = None) -> int:
    """``python -m vllm_shm_arena check``: prints the report; 1 if any check FAILed."""
    import argparse

    p = argparse.ArgumentParser(
        prog="python -m vllm_shm_arena check",
        description="Check this environment for the shm tensor arena (one line per check).",
    )
    p.add_argument("--json", action="store_true", help="one JSON object instead of lines")
    p.add_argument(
        "--dir", default=None, help="shm directory (default: $VLLM_SHM_ARENA_SHM_DIR or /dev/shm)"
    )
    p.add_argument(
        "--readers",
        type=int,
        default=8,
        help="local readers (workers) of the queue to size the arena for (default 8)",
    )
    args = p.parse_args(argv)
    if args.readers < 1:
        p.error(f"--readers must be >= 1, got {args.readers}")
    results = run_checks(args.dir, args.readers)
    failed = any(r.status == FAIL for r in results)
    if args.json:
        out: dict[str, Any] = {"ok": not failed, "checks": [dataclasses.asdict(r) for r in results]}
        print(json.dumps(out, indent=2, default=str))
    else:
        for r in results:
            print(r.line())
    return 1 if failed else 0
