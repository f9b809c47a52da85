"""What a queue end tells the operator: its counters, rate-limited log lines, and the reports
made at most once a second (liveness verdicts, arena declines and starvation, reader
checksums, metrics), by a one-shot timer when a report came due while the queue went idle.

``Reporter`` holds no reference to its end; the end passes itself (``maybe_report``) and the
timer holds it weakly, so a queue dropped without ``shutdown()`` is never kept alive by a
report it owes. What the timer needs of an end: ``reporter``, ``lifecycle`` (pid, closed,
call lock) and ``report()``.
"""

from __future__ import annotations

import logging
import os
import threading
import time
import weakref
from collections.abc import Callable
from typing import Any

from vllm_shm_arena import metrics

logger = logging.getLogger("vllm_shm_arena")

#: A reader holding slots this long is reported as starving the arena.
STARVING_AGE_S = 30.0


class RateLimitedLog:
    """One log line per key per interval."""

    def __init__(self, interval_s: float = 10.0, clock: Callable[[], float] = time.monotonic):
        self.interval_s = interval_s
        self._clock = clock
        self._last: dict[str, float] = {}

    def __call__(self, key: str, level: int, msg: str, *args) -> None:
        now = self._clock()
        if now - self._last.get(key, -1e9) >= self.interval_s:
            self._last[key] = now
            logger.log(level, msg, *args)


class Reporter:
    """One end's counters and reports.

    ``counters``: messages, ring_messages, overflow_messages (too big for a ring chunk),
    blob_messages (those of them that went through the arena; the rest went over the local
    socket), bytes. ``clock`` and ``timer`` (a ``threading.Timer``-like factory) are
    replaceable for tests.
    """

    #: Reports come at most this often (stats() walks every allocation and reader: too much
    #: for every message).
    INTERVAL_S = 1.0

    def __init__(
        self,
        clock: Callable[[], float] = time.monotonic,
        timer: Callable[..., Any] = threading.Timer,
    ) -> None:
        self.counters = {
            "messages": 0,
            "ring_messages": 0,
            "overflow_messages": 0,
            "blob_messages": 0,
            "bytes": 0,
        }
        self.clock = clock
        self._timer_factory = timer
        self.log = RateLimitedLog(clock=clock)
        self.last_report = 0.0
        self.timer = None  # a report owed (see maybe_report)
        self._liveness_logged: dict[str, int] = {}  # verdict counts already logged
        self._last_decline: dict[str, int] = {}
        self._mismatches: dict[str, int] = {}  # per arena kind: the last count warned of

    # ------------------------------------------------------------------ when
    def maybe_report(self, end) -> None:
        """Calls ``end.report()`` if the last report is ``INTERVAL_S`` old; otherwise makes
        sure a one-shot timer makes it, so totals settle within about a second of the last
        message even when the queue then goes idle. Called with the end's call lock held."""
        now = self.clock()
        if now - self.last_report >= self.INTERVAL_S:
            self.last_report = now
            end.report()
        elif self.timer is None:
            t = self._timer_factory(
                self.INTERVAL_S - (now - self.last_report), report_from_timer, (weakref.ref(end),)
            )
            t.daemon = True
            self.timer = t
            t.start()

    def cancel(self) -> None:
        """Drops the report owed, if any (the end is closing)."""
        timer, self.timer = self.timer, None
        if timer is not None:
            timer.cancel()

    # ------------------------------------------------------------------ what
    def report_liveness(self, ring, arena) -> None:
        """Logs every liveness verdict other than alive, once per new count: readers found
        dead (their holdings reclaimed, their ring rank dropped) and probes the kernel did not
        answer (those readers were kept as alive). ``ring``: the writer's ring or None;
        ``arena``: its arena or None."""
        counts = {}
        if ring is not None:
            counts["ring_dropped"] = ring.dropped_readers()
            counts["ring_unknown"] = ring.liveness_unknown()
        if arena is not None:
            s = arena.stats(holdings=False)
            counts["arena_dead"] = s["dead_readers"]
            counts["arena_unknown"] = s["liveness_unknown"]
        for key, n in counts.items():
            if n <= self._liveness_logged.get(key, 0):
                continue
            self._liveness_logged[key] = n
            if key.endswith("unknown"):
                logger.warning(
                    "vllm_shm_arena: %d liveness probe(s) of a lagging reader got no answer from "
                    "the kernel (%s); those readers are kept as alive",
                    n,
                    "ring" if key.startswith("ring") else "arena",
                )
            else:
                logger.warning(
                    "vllm_shm_arena: %d reader(s) found dead (%s); what they held was reclaimed",
                    n,
                    "ring rank dropped" if key.startswith("ring") else "arena allocations",
                )

    def report_writer_arena(self, arena) -> None:
        """The writer arena's metrics, and a rate-limited warning per decline reason that grew
        and per reader holding slots longer than ``STARVING_AGE_S``."""
        s = arena.stats()
        metrics.record_writer_stats(s, key=arena.name)
        d = s["declined"]
        for key, what in (
            (
                "no_free_slot",
                "arena exhausted (every slot held by readers); "
                "tensors fell back to the out-of-band path",
            ),
            (
                "oversize",
                f"tensor larger than an arena slot ({arena.slot_bytes >> 20} MiB) "
                "fell back to the out-of-band path",
            ),
            ("no_space", "/dev/shm is full: arena writes fall back to the out-of-band path"),
        ):
            if d[key] != self._last_decline.get(key, 0):
                self._last_decline[key] = d[key]
                self.log(key, logging.WARNING, "vllm_shm_arena: %s (%d so far)", what, d[key])
        for h in s["holdings"]:
            if h["slots_held"] and h["oldest_age_s"] > STARVING_AGE_S:
                self.log(
                    f"starve{h['rank']}",
                    logging.WARNING,
                    "vllm_shm_arena: reader %d has held %d arena slot(s) for %.0f s; "
                    "tensors kept alive this long starve the arena",
                    h["rank"],
                    h["slots_held"],
                    h["oldest_age_s"],
                )

    def report_reader_arena(self, arena, kind: str = metrics.QUEUE) -> None:
        """A reader arena's metrics (``kind``: the ``arena`` label), and a warning when more
        checksum mismatches were seen in it."""
        rs = arena.stats()
        metrics.record_reader_stats(rs, key=f"reader:{arena.name}", arena=kind)
        seen = self._mismatches.get(kind, 0)
        if rs["checksum_mismatches"] > seen:
            self._mismatches[kind] = rs["checksum_mismatches"]
            logger.warning(
                "vllm_shm_arena: %d %s arena tensor(s) changed between write and release "
                "(an in-place write by a reader? other readers saw it too)",
                rs["checksum_mismatches"],
                kind,
            )


def report_from_timer(ref: weakref.ref) -> None:
    """A report an end owed (see ``Reporter.maybe_report``), made from the timer thread under
    the end's call lock; skipped if the end is gone or closed, and left to the next call if
    that end is busy now (the busy call reports itself)."""
    end = ref()
    if end is None:
        return
    end.reporter.timer = None
    life = end.lifecycle
    # Threads do not survive fork, but a child could still call this by hand.
    if os.getpid() != life.pid or life.closed:
        return
    if not life.call_lock.acquire(blocking=False):
        return
    try:
        if life.closed:
            return
        end.reporter.last_report = end.reporter.clock()
        end.report()
    except Exception:  # a report must never take the process down from a timer thread
        logger.debug("vllm_shm_arena: a timed stats report failed", exc_info=True)
    finally:
        life.call_lock.release()
