"""Prometheus metrics for the arenas, named like vLLM's own (``vllm:`` prefix).

Every metric has an ``arena`` label: ``queue`` (the broadcast queue's tensor arena: the
engine core writes, the workers read) or ``frontend`` (the frontend arena: vLLM's API server
writes, the engine core and the workers read; ``vllm_frontend``).

Writers (the engine core for ``queue``, the API server for ``frontend``):

* ``vllm:shm_arena_hits_total``: tensors copied into the arena (one copy for all readers);
* ``vllm:shm_arena_bytes_total``: their bytes;
* ``vllm:shm_arena_declined_total{reason}``: tensors the arena turned down, which went as
  they would without it; ``reason`` is one of ``DECLINE_REASONS`` (``too_small``,
  ``no_free_slot``, ``no_space``...: the core's names, read from the extension);
* ``vllm:shm_arena_reclaimed_slots_total``: allocations recycled once every reader let go;
* ``vllm:shm_arena_dead_readers_total``: readers found dead (what they held was taken back);
* ``vllm:shm_arena_slots_in_use``: allocations some reader may still read (``frontend``:
  vLLM's multimodal caches in the engine core, the workers' tensors, items in flight);
* ``vllm:shm_arena_capacity_bytes``: tensor bytes the live arenas can hold (smaller than
  configured where the shm directory is small: see ``vllm_shm_arena.sizing``);
* ``vllm:shm_arena_requested_bytes``: what those arenas were configured to hold
  (``VLLM_SHM_ARENA_MB``, or slots x slot size; ``frontend``: vLLM's multimodal cache size
  plus headroom); above the capacity when one was shrunk.

The frontend arena only (``arena="frontend"``):

* ``vllm:shm_arena_stubs_total``: stubs the API server sent to the engine core (a tensor sent
  again, e.g. for ``n`` > 1, is one more stub, never another copy);
* ``vllm:shm_arena_forwarded_total``: its tensors the engine core sent to the workers by
  reference (counted by the engine core; not in any hits);
* ``vllm:shm_arena_acked_total{rank}``: the stubs each rank acked (exported by that rank's
  process: the engine core for rank 0, worker ``i`` for rank ``1 + i``), each once the
  tensors it became were done (pinned: after their H2D copy);
* ``vllm:shm_arena_owed{rank}``: the acks each rank owes it now, over its live allocations:
  stubs sent to the engine core (rank 0) and forwarded to worker ``i`` (rank ``1 + i``) whose
  tensors are still alive there, or not yet dequeued. It returns to 0 when a rank let go of
  everything; one that only grows is a process holding images (a slow or stuck worker, a
  leak). A dead or detached rank owes nothing.

Readers (the workers; summed over live processes):

* ``vllm:shm_arena_pinned_bytes``: arena bytes page-locked for DMA;
* ``vllm:shm_arena_reader_held_slots``: allocations whose tensors are still alive in a reader;
* ``vllm:shm_arena_pending_releases``: allocations waiting for their H2D copy to finish;
* ``vllm:shm_arena_checksum_mismatches_total``: with ``VLLM_SHM_ARENA_DEBUG_CHECKSUM=1``,
  releases whose tensor bytes had changed since the writer checksummed them.

With ``PROMETHEUS_MULTIPROC_DIR`` set (before ``prometheus_client`` is first imported, as
prometheus_client requires) the values go to files there, and a
``MultiProcessCollector`` in any process (vLLM's API server) exports those of every process.
The metrics are created on first use; without ``prometheus_client`` every function here is a
no-op. ``stats()`` counters are cumulative: each call adds the increase since the previous
call for the same ``key``.
"""

from __future__ import annotations

import atexit
import functools
import logging
import os
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from vllm_shm_arena import settings

logger = logging.getLogger("vllm_shm_arena")

#: Name prefix, as vLLM's own metrics.
PREFIX = "vllm:shm_arena_"
#: The ``arena`` label's values: the broadcast queue's tensor arena, and the frontend arena
#: (vLLM's API server -> engine core -> workers, by reference).
QUEUE = "queue"
FRONTEND = "frontend"

_lock = threading.Lock()
_metrics: _Metrics | None = None
#: True once importing prometheus_client failed: every call is a no-op from then on.
_unavailable = False
#: Last cumulative value seen per (key, counter name), to turn totals into increments.
_last: dict[tuple[str, str], int] = {}
#: (kind, capacity, requested bytes) of this process's live arenas, by key: the gauges are the
#: sums per kind (the ``arena`` label).
_sizes: dict[str, tuple[str, int, int]] = {}
#: The kinds ``_sizes`` has held (their gauges are set, to 0 once none is left).
_kinds: set[str] = set()
#: Keys of arenas gone since the gauges were last set (see forget_arena_size).
_forgotten: list[str] = []


def __getattr__(name: str) -> Any:
    """``DECLINE_REASONS``: the decline reasons reported by the writer's
    ``stats()["declined"]``, in the core's order (``_C.DECLINE_REASONS``). Looked up on first
    use, so that importing this module still needs neither torch nor the extension."""
    if name == "DECLINE_REASONS":
        from vllm_shm_arena._ext import _C

        return tuple(_C.DECLINE_REASONS)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _multiproc_dir() -> str | None:
    return settings.prometheus_multiproc_dir()


class _Metrics:
    """The collectors (registered in prometheus_client's default registry), each labelled by
    ``arena`` (``QUEUE`` or ``FRONTEND``)."""

    def __init__(self, prom: Any) -> None:
        self._prom = prom
        counter, gauge = prom.Counter, prom.Gauge
        live = {"multiprocess_mode": "livesum"}
        self.hits = self._make(counter, "hits", "Tensors copied into a shm arena (one copy each)")
        self.bytes = self._make(counter, "bytes", "Bytes of tensors copied into a shm arena")
        self.forwarded = self._make(
            counter,
            "forwarded",
            "Tensors of the frontend arena the engine core sent to the workers by reference",
        )
        self.stubs = self._make(
            counter, "stubs", "Frontend arena stubs sent to the engine core (a repeat is one more)"
        )
        self.declined = self._make(
            counter,
            "declined",
            "Tensors a shm arena declined (sent as usual instead), by reason",
            extra=["reason"],
        )
        self.reclaimed = self._make(
            counter, "reclaimed_slots", "Arena slots recycled once every reader let go"
        )
        self.dead_readers = self._make(
            counter, "dead_readers", "Arena readers found dead (what they held taken back)"
        )
        self.checksum_mismatches = self._make(
            counter,
            "checksum_mismatches",
            "Arena tensors whose bytes changed between write and release (debug checksums)",
        )
        self.slots_in_use = self._make(
            gauge, "slots_in_use", "Arena allocations some process may still read", **live
        )
        self.acked = self._make(
            counter,
            "acked",
            "Stubs a reader rank acked to a counted arena (each when its tensors were done)",
            extra=["rank"],
        )
        self.owed = self._make(
            gauge,
            "owed",
            "Acks each reader rank owes a counted arena now (sent or forwarded, still held)",
            extra=["rank"],
            **live,
        )
        self.pinned_bytes = self._make(
            gauge, "pinned_bytes", "Arena bytes page-locked by readers for DMA", **live
        )
        self.held = self._make(
            gauge, "reader_held_slots", "Arena slots whose tensors readers keep alive", **live
        )
        self.pending = self._make(
            gauge,
            "pending_releases",
            "Arena slots waiting for a reader's H2D copy to finish",
            **live,
        )
        self.capacity = self._make(
            gauge, "capacity_bytes", "Tensor bytes the live shm arenas hold", **live
        )
        self.requested = self._make(
            gauge,
            "requested_bytes",
            "Tensor bytes the live shm arenas were configured to hold",
            **live,
        )

    def _make(
        self, kind: Any, short: str, doc: str, extra: Sequence[str] = (), **kwargs: Any
    ) -> Any:
        name = PREFIX + short
        try:
            return kind(name, doc, labelnames=["arena", *extra], **kwargs)
        except ValueError:
            # Already in the default registry (this module was reset, e.g. by a test): reuse.
            existing = self._prom.REGISTRY._names_to_collectors.get(name)
            if existing is None:
                raise
            return existing


def _get() -> _Metrics | None:
    """The collectors, created on first use; None when prometheus_client is missing."""
    global _metrics, _unavailable
    if _metrics is not None or _unavailable:
        return _metrics
    with _lock:
        if _metrics is None and not _unavailable:
            try:
                import prometheus_client as prom
            except ImportError:
                _unavailable = True
                return None
            _metrics = _Metrics(prom)
            if _multiproc_dir() is not None:
                # Live gauges of this process must not outlive it in the shared directory.
                atexit.register(_mark_dead, os.getpid())
    return _metrics


def _mark_dead(pid: int) -> None:
    if os.getpid() != pid:  # a forked child exiting does not speak for its parent
        return
    try:
        from prometheus_client import multiprocess

        multiprocess.mark_process_dead(pid)
    except Exception:
        pass


def enabled() -> bool:
    """Whether metrics are recorded (``prometheus_client`` is importable, no error so far)."""
    return _get() is not None and not _unavailable


def _increase(key: str, name: str, total: Any) -> int:
    """How much the cumulative ``total`` grew since the last call (the whole value after a
    reset, e.g. a new arena under the same key)."""
    total = int(total or 0)
    last = _last.get((key, name), 0)
    _last[(key, name)] = total
    return total - last if total >= last else total


def _inc_all(incs: list) -> None:
    """Adds each ``(counter, n)``'s ``n`` (from ``_increase``) to its counter, when not 0."""
    for counter, n in incs:
        if n:
            counter.inc(n)


def _never_raise(fn: Callable[..., None]) -> Callable[..., None]:
    """Metrics must never break the queue: the first failure is logged and turns them off."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> None:
        global _unavailable
        if _unavailable:
            return
        try:
            fn(*args, **kwargs)
        except Exception:
            _unavailable = True
            logger.warning("vllm_shm_arena: metrics disabled after an error", exc_info=True)

    return wrapper


def _record_writer(m: _Metrics, stats: Mapping[str, Any], key: str, arena: str) -> None:
    """A writer's cumulative counters (their increase since the last call for ``key``) and
    its slots in use, under ``arena``."""
    with _lock:
        incs = [
            (counter.labels(arena=arena), _increase(key, name, stats.get(name)))
            for name, counter in (
                ("hits", m.hits),
                ("bytes", m.bytes),
                ("reclaimed", m.reclaimed),
                ("dead_readers", m.dead_readers),
            )
        ]
        # Forwards are the frontend arena's tensors, whichever queue counted them.
        incs.append(
            (
                m.forwarded.labels(arena=FRONTEND),
                _increase(key, "forwarded", stats.get("forwarded")),
            )
        )
        declined = stats.get("declined") or {}
        decl_incs = {r: _increase(key, f"declined:{r}", n) for r, n in declined.items()}
    _inc_all(incs)
    for reason, n in decl_incs.items():
        if n:  # (a label set is a series from its first use: none for a reason never seen)
            m.declined.labels(arena=arena, reason=str(reason)).inc(n)
    if "in_use" in stats:
        m.slots_in_use.labels(arena=arena).set(int(stats["in_use"]))


@_never_raise
def record_writer_stats(stats: Mapping[str, Any], key: str = "writer") -> None:
    """Exports a queue arena writer's ``ShmTensorArena.stats()`` (or a
    ``MessageQueue.stats()`` holding it under ``"arena"``), as ``arena="queue"`` (its
    ``forwarded``: ``arena="frontend"``). ``key`` tells apart several writers in one process
    (e.g. the arena's name). Call it at most about once a second. Never raises."""
    m = _get()
    if m is None:
        return
    if "hits" not in stats and isinstance(stats.get("arena"), Mapping):
        stats = stats["arena"]
    if _forgotten:
        _set_sizes()
    _record_writer(m, stats, key, QUEUE)


@_never_raise
def record_reader_stats(stats: Mapping[str, Any], key: str = "reader", arena: str = QUEUE) -> None:
    """Exports a reader's ``ShmTensorArena.stats()`` (``pinned_bytes``, ``held``,
    ``pending_releases``) as this process's gauge values for ``arena`` (summed over live
    processes), and the increase of its cumulative ``checksum_mismatches`` and, for the
    frontend arena, of the stubs its ``rank`` ``acked`` (``key`` tells apart several readers
    in one process). Never raises."""
    m = _get()
    if m is None:
        return
    if "held" not in stats and isinstance(stats.get("arena"), Mapping):
        stats = stats["arena"]
    with _lock:
        mismatches = _increase(key, "checksum_mismatches", stats.get("checksum_mismatches"))
        acked = _increase(key, "acked", stats.get("acked"))
    # inc(0) too: a reader that reported shows 0 at /metrics, not nothing.
    m.checksum_mismatches.labels(arena=arena).inc(mismatches)
    if arena == FRONTEND and "rank" in stats:  # a counted arena: acks are per stub
        m.acked.labels(arena=arena, rank=str(stats["rank"])).inc(acked)
    m.pinned_bytes.labels(arena=arena).set(int(stats.get("pinned_bytes") or 0))
    m.held.labels(arena=arena).set(int(stats.get("held") or 0))
    m.pending.labels(arena=arena).set(int(stats.get("pending_releases") or 0))


@_never_raise
def record_frontend_stats(
    filled: int, filled_bytes: int, stats: Mapping[str, Any], key: str = "frontend"
) -> None:
    """Exports the frontend arena (``arena="frontend"``): the tensors ``filled`` into it and
    their ``filled_bytes`` (cumulative: hits and bytes), and from its writer's
    ``ShmTensorArena.stats()`` the stubs sent (``sends``), declines, reclaims, dead readers,
    allocations in use and the acks each rank owes now (``holdings``). Never raises."""
    m = _get()
    if m is None:
        return
    with _lock:
        stubs = _increase(key, "stubs", stats.get("sends"))
    m.stubs.labels(arena=FRONTEND).inc(stubs)
    _record_writer(m, {**stats, "hits": filled, "bytes": filled_bytes}, key, FRONTEND)
    for h in stats.get("holdings") or ():
        m.owed.labels(arena=FRONTEND, rank=str(h["rank"])).set(int(h.get("owed") or 0))


@_never_raise
def record_arena_size(
    key: str, capacity_bytes: int, requested_bytes: int, arena: str = QUEUE
) -> None:
    """A writer's arena was created holding ``capacity_bytes`` of tensors out of the
    ``requested_bytes`` configured: the capacity and requested gauges of ``arena`` become the
    sums over this process's live arenas of that kind (``key``: the arena's name). Never
    raises."""
    with _lock:
        _sizes[key] = (arena, int(capacity_bytes), int(requested_bytes))
    _set_sizes()


@_never_raise
def forget_arena_size(key: str) -> None:
    """The arena ``key`` is gone: it leaves the capacity and requested gauges (at the next
    update of any gauge). Never raises, never blocks: it runs from a ``weakref.finalize``,
    i.e. from any garbage collection, possibly while this thread holds ``_lock``, so it only
    appends (atomic) to a list that the next holder of the lock drains, and updates the
    gauges now only when the lock is free."""
    _forgotten.append(key)
    if _lock.acquire(blocking=False):
        _lock.release()
        _set_sizes()


def _set_sizes() -> None:
    m = _get()
    if m is None:
        return
    with _lock:
        while _forgotten:
            _sizes.pop(_forgotten.pop(), None)
        sizes = list(_sizes.values())
        # Every kind this process ever had stays a series (0 once its arenas are gone).
        totals = dict.fromkeys(_kinds, (0, 0))
        for arena, c, r in sizes:
            _kinds.add(arena)
            tc, tr = totals.get(arena, (0, 0))
            totals[arena] = (tc + c, tr + r)
    for arena, (c, r) in totals.items():
        m.capacity.labels(arena=arena).set(c)
        m.requested.labels(arena=arena).set(r)


def _reset() -> None:
    """Forgets the collectors and the last-seen totals (tests)."""
    global _metrics, _unavailable
    with _lock:
        _metrics = None
        _unavailable = False
        _last.clear()
        _sizes.clear()
        _kinds.clear()
