"""How big a new queue's tensor arena is: the configured size when the shm directory can hold
it, else a share of what is free there, else no arena.

The configured arena is ``VLLM_SHM_ARENA_MB`` (default 2048 MiB, variable-size layout) or, with
``VLLM_SHM_ARENA_POLICY=fixed``, ``VLLM_SHM_ARENA_NUM_SLOTS`` x ``VLLM_SHM_ARENA_SLOT_MB``. A
host with a small ``/dev/shm`` (Docker's ``--shm-size=1g``, a Kubernetes memory-backed emptyDir
of a few hundred MiB) cannot hold it, while the queue without the arena starts there; the queue
with the arena must start there too. So, when a queue is created:

* **free** is what the shm directory can still back: its free space (``statvfs``), and no more
  than the memory cgroup can still charge (tmpfs pages count against a container's memory
  limit: cgroup v2 ``memory.max - memory.current``, v1 ``memory.limit_in_bytes -
  memory.usage_in_bytes``, the tightest of this process's cgroup and its ancestors; a missing
  file is no limit).
* **room** is free minus the part of this queue's own message ring not backed yet: what the
  arena could ever back once the ring has filled.
* The configured arena is used whenever its whole segment fits in room.
* Otherwise the arena gets a **share**: ``VLLM_SHM_ARENA_FREE_FRACTION`` (default 0.5) of the
  **pool**, and never more than room. The pool is free plus the pages this package's live
  segments in the directory already back (this queue's ring included), minus this queue's whole
  ring: what the directory would have for this queue's arena if no other queue of this package
  had backed anything. What the rest of the directory holds (other programs' files) stays
  outside the pool; the part of the pool the fraction leaves (half, by default) is headroom for
  them and for growth.
* Variable-size layout: the share rounded down to whole MiB. Fixed layout: as many of the
  configured slots as fit in it (never more than configured). Below the floor -- one slot of
  the fixed layout, ``VLLM_SHM_ARENA_MIN_MB`` (default 64 MiB) of the variable one, or the
  configured size when that is smaller -- the queue has no arena: every tensor goes out of band.

Why other arenas' claims are not subtracted: data-parallel ranks on one node create one queue
each, one after another. Subtracting what earlier arenas may grow to would hand out one half,
then one quarter, ...; treating what they have backed as still free gives each the same share,
because
an arena segment is a cap, not a reservation: its data pages are backed per allocation
(``fallocate``) when a tensor is written, and when the directory fills up, the allocation is
declined and that tensor goes out of band (counted as ``declined["no_space"]``), never a
SIGBUS. Several shares may add up to more than the directory holds; they then compete for it
tensor by tensor. Segments are found by listing the directory (the stale-segment cleaner's
inspection: a ``vsa_`` arena or ring of this user whose writer's token is held). Names are
unlinked once every reader has attached, so what an older queue backed after that is no
longer visible: it counts like any other user of the directory and lowers later shares, which
errs on the side of headroom.

One warning is logged when the arena is smaller than configured or missing, saying what the
queue got and how to get the full size (a warning, not an info line: vLLM shows only its own
loggers' info lines, and an operator who sized the arena should see that it was cut).
Creating the arena never makes the queue fail for lack of room: an ``OSError`` from the
creation (the directory filled up in between) also leaves the queue without an arena, with a
warning.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import weakref
from collections.abc import Mapping

from vllm_shm_arena import metrics, settings
from vllm_shm_arena._ext import _C
from vllm_shm_arena.arena import (
    DEFAULT_ARENA_BYTES,
    DEFAULT_MAX_ALLOCATIONS,
    DEFAULT_NUM_SLOTS,
    DEFAULT_SLOT_BYTES,
    ShmTensorArena,
)

logger = logging.getLogger("vllm_shm_arena")

#: The share of the pool a shrunk arena may take, and the smallest variable-size arena.
FREE_FRACTION_ENV = "VLLM_SHM_ARENA_FREE_FRACTION"
MIN_MB_ENV = "VLLM_SHM_ARENA_MIN_MB"
DEFAULT_FREE_FRACTION = 0.5
DEFAULT_MIN_BYTES = 64 << 20

_MIB = 1 << 20
_CGROUP_ROOT = "/sys/fs/cgroup"
_PROC_CGROUP = "/proc/self/cgroup"
#: cgroup v1 reports "no limit" as a huge number near PAGE_COUNTER_MAX.
_V1_UNLIMITED = 1 << 62


@dataclasses.dataclass(frozen=True)
class Layout:
    """The configured arena: ``policy`` "variable" (``arena_bytes``, at most
    ``max_allocations`` tensors) or "fixed" (``num_slots`` x ``slot_bytes``)."""

    policy: str = "variable"
    arena_bytes: int = DEFAULT_ARENA_BYTES
    max_allocations: int = DEFAULT_MAX_ALLOCATIONS
    num_slots: int = DEFAULT_NUM_SLOTS
    slot_bytes: int = DEFAULT_SLOT_BYTES

    @property
    def capacity(self) -> int:
        """Bytes of tensor data the configured arena holds."""
        if self.policy == "fixed":
            return self.num_slots * self.slot_bytes
        return self.arena_bytes

    def describe(self, num_slots: int | None = None, short: bool = False) -> str:
        """The geometry in words ("2048 MiB variable-size", "8 x 256 MiB slots"; ``short``:
        without the layout's name for the variable one)."""
        if self.policy == "fixed":
            n = self.num_slots if num_slots is None else num_slots
            return f"{n} x {_mib(self.slot_bytes)} slots"
        return _mib(self.arena_bytes) + ("" if short else " variable-size")


def layout_from_env(environ: Mapping[str, str] | None = None) -> Layout:
    """The arena ``VLLM_SHM_ARENA_POLICY``/``_MB``/``_MAX_ALLOCATIONS``/``_NUM_SLOTS``/
    ``_SLOT_MB`` describe now (the queue reads them once, at import: mq/writer.py).
    ``ValueError`` naming the variable for a bad value (settings.py)."""
    return Layout(
        policy=settings.arena_policy(environ),
        arena_bytes=settings.arena_bytes(environ),
        max_allocations=settings.arena_max_allocations(environ),
        num_slots=settings.arena_num_slots(environ),
        slot_bytes=settings.arena_slot_bytes(environ),
    )


def free_fraction(environ: Mapping[str, str] | None = None) -> float:
    """``VLLM_SHM_ARENA_FREE_FRACTION``: the share of the pool a shrunk arena takes, in (0, 1]
    (default 0.5). ``ValueError`` naming the variable otherwise."""
    return settings.free_fraction(environ)


def min_bytes(environ: Mapping[str, str] | None = None) -> int:
    """``VLLM_SHM_ARENA_MIN_MB``: the smallest variable-size arena worth creating, in bytes
    (default 64 MiB). ``ValueError`` naming the variable for anything but a whole number >= 1."""
    return settings.min_arena_bytes(environ)


# ---------------------------------------------------------------------------- measuring
def _read_limit(path: str) -> int | None:
    """An integer cgroup file; None when missing, unreadable, "max" or malformed."""
    try:
        with open(path) as f:
            raw = f.read().strip()
    except OSError:
        return None
    if raw == "max":
        return None
    try:
        return int(raw)
    except ValueError:
        return None


def _own_cgroups(proc_cgroup: str) -> tuple[str | None, str | None]:
    """This process's (v2 path, v1 memory-controller path) from /proc/self/cgroup."""
    v2 = v1 = None
    try:
        with open(proc_cgroup) as f:
            lines = f.read().splitlines()
    except OSError:
        return None, None
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        hid, controllers, path = parts
        if hid == "0" and controllers == "":
            v2 = path
        elif "memory" in controllers.split(","):
            v1 = path
    return v2, v1


def _ancestors(base: str, path: str | None) -> list[str]:
    """``base/path`` and every directory above it up to ``base`` (innermost first)."""
    out = []
    parts = [p for p in (path or "/").split("/") if p and p != ".."]
    for n in range(len(parts), -1, -1):
        out.append(os.path.join(base, *parts[:n]))
    return out


def cgroup_memory_available(
    root: str = _CGROUP_ROOT, proc_cgroup: str = _PROC_CGROUP
) -> int | None:
    """Bytes this process's memory cgroup can still charge (limit minus usage, the tightest
    over its cgroup and the ancestors with a limit), or None when no limit applies or none can
    be read. cgroup v2 (``memory.max``, ``memory.current``) first, then v1
    (``memory/memory.limit_in_bytes``, ``memory.usage_in_bytes``; its "unlimited" sentinel is no
    limit). A directory that does not exist (a host path seen from inside a container) is
    skipped; the root is always tried, which is the container's own cgroup under a cgroup
    namespace."""
    v2_path, v1_path = _own_cgroups(proc_cgroup)
    found: list[int] = []
    for d in _ancestors(root, v2_path):
        limit = _read_limit(os.path.join(d, "memory.max"))
        usage = _read_limit(os.path.join(d, "memory.current")) if limit is not None else None
        if limit is not None and usage is not None:
            found.append(max(0, limit - usage))
    if not found:
        for d in _ancestors(os.path.join(root, "memory"), v1_path):
            limit = _read_limit(os.path.join(d, "memory.limit_in_bytes"))
            if limit is None or limit >= _V1_UNLIMITED:
                continue
            usage = _read_limit(os.path.join(d, "memory.usage_in_bytes"))
            if usage is not None:
                found.append(max(0, limit - usage))
    return min(found) if found else None


def _backed(st: os.stat_result) -> int:
    return st.st_blocks * 512


@dataclasses.dataclass(frozen=True)
class DirSpace:
    """What the shm directory ``dir`` offers a new arena (bytes)."""

    dir: str
    #: statvfs: bytes an unprivileged writer can still back; and the directory's size.
    shm_free: int
    shm_total: int
    #: What the memory cgroup can still charge; None: no limit.
    cgroup_available: int | None
    #: Pages backed by this package's live segments visible in ``dir`` (this queue's ring too).
    package_backed: int
    #: Live arenas of this package visible in ``dir``.
    live_arenas: int
    #: This queue's ring: its whole size and the part not backed yet.
    ring_bytes: int
    ring_unbacked: int

    @property
    def free(self) -> int:
        """What can still be backed: the directory's free space within the cgroup's."""
        if self.cgroup_available is None:
            return self.shm_free
        return min(self.shm_free, self.cgroup_available)

    @property
    def room(self) -> int:
        """What the arena could back beside the rest of this queue's ring."""
        return max(0, self.free - self.ring_unbacked)

    @property
    def pool(self) -> int:
        """Free space as if this package's segments backed nothing, minus this queue's ring."""
        return max(0, self.free + self.package_backed - self.ring_bytes)

    @property
    def cgroup_bound(self) -> bool:
        """Whether the cgroup, not the directory, limits what can be backed."""
        return self.cgroup_available is not None and self.cgroup_available < self.shm_free


def _package_segments(shm_dir: str) -> tuple[int, int]:
    """(pages backed by this user's live vsa_ arenas and rings in ``shm_dir``, live arenas).
    Anything that cannot be inspected counts as not ours (0, 0): it then stays outside the
    pool, which only makes the share smaller."""
    try:
        reports = _C.remove_stale_segments(shm_dir, True)
    except Exception:  # an unlistable directory: sizing goes on without the add-back
        logger.debug("vllm_shm_arena: cannot list %s for live arenas", shm_dir, exc_info=True)
        return 0, 0
    backed = arenas = 0
    for name, kind, writer, _removed, _why in reports:
        if kind not in ("arena", "ring") or writer != "alive":
            continue
        try:
            st = os.stat(os.path.join(shm_dir, name), follow_symlinks=False)
        except OSError:  # unlinked in the meantime
            continue
        backed += _backed(st)
        arenas += kind == "arena"
    return backed, arenas


def measure(
    shm_dir: str | None = None, ring_path: str | None = None, ring_bytes: int = 0
) -> DirSpace:
    """Measures ``shm_dir`` (default: the package's shm directory) for a queue whose ring is
    the segment at ``ring_path`` or, without one, a ring of ``ring_bytes`` not yet created.
    ``OSError`` if the directory cannot be measured (statvfs fails)."""
    d = shm_dir or _C.default_shm_dir()
    st = os.statvfs(d)
    ring_unbacked = ring_bytes
    if ring_path is not None:
        try:
            rs = os.stat(ring_path, follow_symlinks=False)
            ring_bytes = rs.st_size
            ring_unbacked = max(0, rs.st_size - _backed(rs))
        except OSError:
            pass
    backed, arenas = _package_segments(d)
    return DirSpace(
        dir=d,
        shm_free=st.f_bavail * st.f_frsize,
        shm_total=st.f_blocks * st.f_frsize,
        cgroup_available=cgroup_memory_available(),
        package_backed=backed,
        live_arenas=arenas,
        ring_bytes=ring_bytes,
        ring_unbacked=ring_unbacked,
    )


# ---------------------------------------------------------------------------- choosing
@dataclasses.dataclass(frozen=True)
class ArenaSize:
    """The arena a queue gets. ``arena_bytes`` == 0: none (every tensor goes out of band)."""

    policy: str
    #: Tensor data bytes configured and chosen (fixed: slots x slot bytes).
    requested_bytes: int
    arena_bytes: int
    #: The whole segment chosen (tables included); 0 without an arena.
    region_bytes: int
    #: Fixed layout: slots chosen (of ``layout.num_slots``); variable: allocations at a time.
    num_slots: int
    #: Fixed layout: bytes per slot; variable: the largest tensor (the whole data region).
    slot_bytes: int
    #: "config" (the configured size), "shm_free" (shrunk to the directory's free space),
    #: "cgroup" (shrunk to the memory cgroup's), "error" (creation failed).
    sized_by: str
    free_fraction: float
    floor_bytes: int
    space: DirSpace
    #: The log line explaining a smaller or missing arena ("" for the configured one).
    message: str = ""

    def as_dict(self) -> dict:
        """For ``MessageQueue.stats()["arena_size"]`` and the check command's ``--json``."""
        d = {
            "policy": self.policy,
            "arena_bytes": self.arena_bytes,
            "requested_bytes": self.requested_bytes,
            "region_bytes": self.region_bytes,
            "num_slots": self.num_slots,
            "slot_bytes": self.slot_bytes,
            "sized_by": self.sized_by,
            "free_fraction": self.free_fraction,
            "floor_bytes": self.floor_bytes,
        }
        d["space"] = dataclasses.asdict(self.space)
        return d


#: Regions beside the arena come in whole blocks of this size (a huge page on x86-64).
_REGION_GRANULE = 2 << 20


def _mib(n: int) -> str:
    return f"{n / _MIB:.0f} MiB" if n % _MIB == 0 or n >= 100 * _MIB else f"{n / _MIB:.1f} MiB"


def _gib_ceil(n: int) -> int:
    return max(1, -(-n // (1 << 30)))


def _variable_tables(n_readers: int, max_allocations: int) -> int:
    # The tables do not depend on the data size: measure them once with 1 MiB of data.
    return _C.arena_region_bytes(n_readers, 0, 0, _MIB, max_allocations) - _MIB


def _fixed_region(n_readers: int, num_slots: int, slot_bytes: int) -> int:
    return _C.arena_region_bytes(n_readers, num_slots, slot_bytes, 0, 1)


def _advice(layout: Layout, space: DirSpace, full_region: int) -> str:
    """How to get the configured size."""
    short = max(0, full_region + space.ring_unbacked - space.free)
    knob = "VLLM_SHM_ARENA_NUM_SLOTS" if layout.policy == "fixed" else "VLLM_SHM_ARENA_MB"
    full = layout.describe(short=True)
    if space.cgroup_bound:
        return (
            f"For the full {full}, raise the container's memory limit by at least "
            f"{_mib(short)}, or lower {knob}."
        )
    need = _gib_ceil(space.shm_total + short)
    return (
        f"For the full {full}, give {space.dir} at least {need} GiB (Docker: "
        f"--shm-size={need}g; Kubernetes: a memory-backed emptyDir of {need}Gi at /dev/shm; "
        f"bare metal: mount -o remount,size={need}G {space.dir}), or lower {knob}."
    )


def _where(space: DirSpace, fraction: float, share: int) -> str:
    """Why the share is what it is."""
    cg = ""
    if space.cgroup_available is not None:
        cg = f" (the memory cgroup can charge {_mib(space.cgroup_available)})"
    held = ""
    if space.package_backed >= _MIB:
        held = f", counting the {_mib(space.package_backed)} this package's live queues back there"
    return (
        f"{space.dir} has {_mib(space.shm_free)} free{cg} and this queue's message ring takes "
        f"{_mib(space.ring_bytes)}; {fraction:g} of the rest{held} ({FREE_FRACTION_ENV}) is "
        f"{_mib(share)}"
    )


def choose(
    n_readers: int,
    layout: Layout,
    space: DirSpace,
    fraction: float = DEFAULT_FREE_FRACTION,
    floor: int = DEFAULT_MIN_BYTES,
) -> ArenaSize:
    """The arena for ``n_readers`` in ``space`` (the rule in this module's docstring). Creates
    nothing. ``ValueError`` from the extension for a layout it cannot build."""
    variable = layout.policy != "fixed"
    if variable:
        tables = _variable_tables(n_readers, layout.max_allocations)
        full_region = tables + -(-layout.arena_bytes // 4096) * 4096
    else:
        full_region = _fixed_region(n_readers, layout.num_slots, layout.slot_bytes)
    base = dict(
        policy=layout.policy,
        requested_bytes=layout.capacity,
        free_fraction=fraction,
        space=space,
    )
    if full_region <= space.room:
        return ArenaSize(
            arena_bytes=layout.capacity,
            region_bytes=full_region,
            num_slots=layout.max_allocations if variable else layout.num_slots,
            slot_bytes=layout.arena_bytes if variable else layout.slot_bytes,
            sized_by="config",
            floor_bytes=min(floor, layout.capacity) if variable else layout.slot_bytes,
            **base,
        )
    share = min(int(fraction * space.pool), space.room)
    sized_by = "cgroup" if space.cgroup_bound else "shm_free"
    if variable:
        floor_bytes = min(floor, layout.arena_bytes)
        data = max(0, share - tables) // _MIB * _MIB
        ok = data >= floor_bytes and data > 0
        num_slots, slot_bytes = layout.max_allocations, data
        region = tables + data if ok else 0
        what = _mib(data)
    else:
        floor_bytes = layout.slot_bytes
        n = min(layout.num_slots, share // max(1, layout.slot_bytes))
        while n >= 1 and _fixed_region(n_readers, n, layout.slot_bytes) > share:
            n -= 1
        ok = n >= 1
        data = n * layout.slot_bytes if ok else 0
        num_slots, slot_bytes = (n if ok else 0), layout.slot_bytes
        region = _fixed_region(n_readers, n, layout.slot_bytes) if ok else 0
        what = layout.describe(num_slots=n)
    advice = _advice(layout, space, full_region)
    if ok:
        message = (
            f"vllm_shm_arena: tensor arena of {what} instead of {layout.describe(short=True)}: "
            f"{_where(space, fraction, share)}. The size is a cap, not a reservation: pages are "
            f"backed per tensor, and once {space.dir} is full tensors go out of band. {advice}"
        )
    else:
        smallest = (
            f"one {_mib(layout.slot_bytes)} slot"
            if not variable
            else f"the {_mib(floor_bytes)} smallest arena ({MIN_MB_ENV})"
        )
        message = (
            f"vllm_shm_arena: no tensor arena for this queue, every tensor goes out of band: "
            f"{_where(space, fraction, share)}, less than {smallest}. {advice}"
        )
    return ArenaSize(
        arena_bytes=data if ok else 0,
        region_bytes=region,
        num_slots=num_slots,
        slot_bytes=slot_bytes if ok else 0,
        sized_by=sized_by,
        floor_bytes=floor_bytes,
        message=message,
        **base,
    )


def region_share(want: int, shm_dir: str | None = None, ring_path: str | None = None) -> int:
    """A region beside the arena (a queue's blob region, the frontend arena): ``want`` bytes
    at most, and at most VLLM_SHM_ARENA_FREE_FRACTION of what ``shm_dir`` can back beside the
    ring at ``ring_path`` (``measure``), in whole 2 MiB blocks. ``OSError`` if the directory
    cannot be measured."""
    room = int(measure(shm_dir, ring_path).room * settings.free_fraction())
    return min(want, room) // _REGION_GRANULE * _REGION_GRANULE


def plan(
    n_readers: int,
    layout: Layout,
    shm_dir: str | None = None,
    ring_path: str | None = None,
    ring_bytes: int = 0,
) -> ArenaSize:
    """The arena a queue with ``n_readers`` local readers would get now in ``shm_dir`` beside
    its ring (``ring_path``, or ``ring_bytes`` for one not yet created), with the
    ``VLLM_SHM_ARENA_FREE_FRACTION``/``_MIN_MB`` settings of the environment. Creates nothing;
    ``ValueError`` naming the variable for a bad setting."""
    fraction, floor = free_fraction(), min_bytes()
    return choose(n_readers, layout, measure(shm_dir, ring_path, ring_bytes), fraction, floor)


def create_arena(
    n_readers: int, layout: Layout, shm_dir: str, ring_path: str | None = None
) -> tuple[ShmTensorArena | None, ArenaSize]:
    """Creates the arena ``plan`` chooses and logs one warning when it is smaller than
    configured or missing. Returns ``(arena or None, size)``. Never raises
    ``OSError`` for lack of room: a creation that fails with one leaves no arena (warning)."""
    size = plan(n_readers, layout, shm_dir, ring_path)
    if size.arena_bytes == 0:
        logger.warning("%s", size.message)
        return None, size
    try:
        if layout.policy == "fixed":
            arena = ShmTensorArena.create(
                n_readers, num_slots=size.num_slots, slot_bytes=size.slot_bytes, shm_dir=shm_dir
            )
        else:
            arena = ShmTensorArena.create(
                n_readers,
                policy="variable",
                arena_bytes=size.arena_bytes,
                max_allocations=layout.max_allocations,
                shm_dir=shm_dir,
            )
    except OSError as e:
        size = dataclasses.replace(
            size,
            arena_bytes=0,
            region_bytes=0,
            sized_by="error",
            message=(
                f"vllm_shm_arena: no tensor arena for this queue (every tensor goes out of "
                f"band): creating a {_mib(size.region_bytes)} arena in {shm_dir} failed: {e}"
            ),
        )
        logger.warning("%s", size.message)
        return None, size
    if size.sized_by != "config":
        logger.warning("%s", size.message)
    metrics.record_arena_size(arena.name, size.arena_bytes, size.requested_bytes)
    # The gauges count this process's live arenas: an arena's entry goes with the object.
    weakref.finalize(arena, metrics.forget_arena_size, arena.name)
    return arena, size
