"""mq/reporting.py on its own, with a fake clock, a fake timer and fake rings and arenas: when
reports are made (at most once a second, the owed one by a one-shot timer), what the timer
skips, and what each report logs. No queue is built."""

from __future__ import annotations

import gc
import logging
import os
import threading
import weakref

import pytest

from vllm_shm_arena.mq import reporting
from vllm_shm_arena.mq.lifecycle import Lifecycle
from vllm_shm_arena.mq.reporting import RateLimitedLog, Reporter, report_from_timer


class Clock:
    def __init__(self, t: float = 100.0):
        self.t = t

    def __call__(self) -> float:
        return self.t


class FakeTimer:
    """Records what ``threading.Timer`` would have been asked to run."""

    made: list = []

    def __init__(self, interval, fn, args):
        self.interval, self.fn, self.args = interval, fn, args
        self.started = self.cancelled = False
        self.daemon = False
        FakeTimer.made.append(self)

    def start(self):
        self.started = True

    def cancel(self):
        self.cancelled = True

    def fire(self):
        self.fn(*self.args)


class FakeEnd:
    """What the reporter and its timer need of an end."""

    def __init__(self, clock):
        self.lifecycle = Lifecycle(self)
        self.reporter = Reporter(clock=clock, timer=FakeTimer)
        self.reports = 0

    def report(self):
        self.reports += 1


@pytest.fixture
def end():
    FakeTimer.made = []
    clock = Clock()
    e = FakeEnd(clock)
    e.clock = clock
    return e


# ------------------------------------------------------------------ when
def test_a_report_is_made_at_once_then_at_most_once_a_second(end):
    sut = end.reporter
    sut.maybe_report(end)
    assert end.reports == 1 and FakeTimer.made == []
    end.clock.t += 0.25
    sut.maybe_report(end)
    sut.maybe_report(end)
    assert end.reports == 1
    (timer,) = FakeTimer.made  # one timer for the report owed, not one per call
    assert timer.started and timer.daemon and timer.interval == pytest.approx(0.75)
    end.clock.t += 1.0
    sut.maybe_report(end)  # a second later the call reports itself
    assert end.reports == 2


def test_the_timer_makes_the_report_owed_and_the_next_one_can_be_owed_again(end):
    sut = end.reporter
    sut.maybe_report(end)
    end.clock.t += 0.5
    sut.maybe_report(end)
    (timer,) = FakeTimer.made
    end.clock.t += 0.5
    timer.fire()
    assert end.reports == 2 and sut.timer is None and sut.last_report == end.clock.t
    end.clock.t += 0.1
    sut.maybe_report(end)
    assert len(FakeTimer.made) == 2  # owed again: a new timer


def test_the_timer_skips_a_closed_end_and_a_busy_one(end):
    sut = end.reporter
    sut.maybe_report(end)
    end.clock.t += 0.5
    sut.maybe_report(end)
    end.lifecycle.call_lock.acquire()  # the end is inside a call: that call reports
    try:
        FakeTimer.made[-1].fire()
    finally:
        end.lifecycle.call_lock.release()
    assert end.reports == 1 and sut.timer is None
    sut.maybe_report(end)
    end.lifecycle.closed = True
    FakeTimer.made[-1].fire()
    assert end.reports == 1


def test_the_timer_skips_an_end_of_another_process(end):
    sut = end.reporter
    sut.maybe_report(end)
    end.clock.t += 0.5
    sut.maybe_report(end)
    end.lifecycle.pid = os.getpid() + 1
    FakeTimer.made[-1].fire()
    assert end.reports == 1


def test_the_timer_holds_the_end_weakly_and_a_gone_end_is_skipped():
    FakeTimer.made = []
    clock = Clock()
    end = FakeEnd(clock)
    end.reporter.maybe_report(end)
    clock.t += 0.5
    end.reporter.maybe_report(end)
    timer = FakeTimer.made[-1]
    ref = weakref.ref(end)
    del end
    gc.collect()
    assert ref() is None, "the owed report kept the end alive"
    timer.fire()  # nothing to report to: no error


def test_a_failing_report_never_leaves_the_timer_thread(end, caplog):
    def boom():
        raise ValueError("stats exploded")

    end.report = boom
    with caplog.at_level(logging.DEBUG, logger="vllm_shm_arena"):
        report_from_timer(weakref.ref(end))
    assert "a timed stats report failed" in caplog.text
    assert not end.lifecycle.call_lock.locked()


def test_cancel_drops_the_report_owed(end):
    sut = end.reporter
    sut.maybe_report(end)
    end.clock.t += 0.5
    sut.maybe_report(end)
    timer = FakeTimer.made[-1]
    sut.cancel()
    assert timer.cancelled and sut.timer is None
    sut.cancel()  # nothing owed: no-op


def test_a_real_timer_fires_within_about_a_second():
    class RealEnd:
        def __init__(self):
            self.lifecycle = Lifecycle(self)
            self.reporter = Reporter()
            self.done = threading.Event()

        def report(self):
            self.done.set()

    e = RealEnd()
    e.reporter.last_report = e.reporter.clock()  # a report was just made
    e.reporter.maybe_report(e)
    assert not e.done.is_set()
    assert e.done.wait(5)


# ------------------------------------------------------------------ the rate limit
def test_the_rate_limited_log_gives_one_line_per_key_per_interval(caplog):
    clock = Clock()
    sut = RateLimitedLog(interval_s=10.0, clock=clock)
    with caplog.at_level(logging.WARNING, logger="vllm_shm_arena"):
        sut("a", logging.WARNING, "first %d", 1)
        sut("a", logging.WARNING, "again %d", 2)
        sut("b", logging.WARNING, "other key")
        clock.t += 10.0
        sut("a", logging.WARNING, "later %d", 3)
    assert [r.getMessage() for r in caplog.records] == ["first 1", "other key", "later 3"]


# ------------------------------------------------------------------ what
class Ring:
    def __init__(self):
        self.dropped = self.unknown = 0

    def dropped_readers(self):
        return self.dropped

    def liveness_unknown(self):
        return self.unknown


class WriterArena:
    name = "vsa_fake"
    slot_bytes = 64 << 20

    def __init__(self):
        self.s = {
            "dead_readers": 0,
            "liveness_unknown": 0,
            "hits": 0,
            "declined": {"no_free_slot": 0, "oversize": 0, "no_space": 0},
            "holdings": [],
        }
        self.holdings_asked = []

    def stats(self, holdings=True):
        self.holdings_asked.append(holdings)
        return dict(self.s)


def test_liveness_verdicts_are_logged_once_per_new_count_without_walking_holdings(caplog):
    sut = Reporter(clock=Clock(), timer=FakeTimer)
    ring, arena = Ring(), WriterArena()
    with caplog.at_level(logging.WARNING, logger="vllm_shm_arena"):
        sut.report_liveness(ring, arena)
        assert caplog.records == []
        ring.dropped, arena.s["liveness_unknown"] = 1, 2
        sut.report_liveness(ring, arena)
        sut.report_liveness(ring, arena)  # nothing new
        arena.s["dead_readers"] = 1
        sut.report_liveness(None, arena)
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 3, lines
    assert "1 reader(s) found dead (ring rank dropped)" in lines[0]
    assert "2 liveness probe(s)" in lines[1] and "(arena)" in lines[1]
    assert "1 reader(s) found dead (arena allocations)" in lines[2]
    assert set(arena.holdings_asked) == {False}


def test_the_writer_arena_report_records_metrics_and_rate_limits_its_warnings(monkeypatch, caplog):
    recorded = []
    monkeypatch.setattr(
        reporting.metrics, "record_writer_stats", lambda s, key: recorded.append((key, s))
    )
    clock = Clock()
    sut = Reporter(clock=clock, timer=FakeTimer)
    arena = WriterArena()
    with caplog.at_level(logging.WARNING, logger="vllm_shm_arena"):
        sut.report_writer_arena(arena)
        assert caplog.records == [] and recorded[-1][0] == "vsa_fake"
        arena.s["declined"] = {"no_free_slot": 3, "oversize": 1, "no_space": 0}
        arena.s["holdings"] = [
            {"rank": 1, "slots_held": 2, "oldest_age_s": reporting.STARVING_AGE_S + 5},
            {"rank": 0, "slots_held": 0, "oldest_age_s": 999.0},
        ]
        sut.report_writer_arena(arena)
        arena.s["declined"] = {"no_free_slot": 4, "oversize": 1, "no_space": 0}
        sut.report_writer_arena(arena)  # grew again, but within the rate limit
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 3, lines
    assert "arena exhausted" in lines[0] and "(3 so far)" in lines[0]
    assert "larger than an arena slot (64 MiB)" in lines[1]
    assert "reader 1 has held 2 arena slot(s)" in lines[2]
    assert len(recorded) == 3


def test_the_reader_arena_report_warns_when_more_checksums_mismatched(monkeypatch, caplog):
    recorded = []
    monkeypatch.setattr(
        reporting.metrics, "record_reader_stats", lambda s, **kw: recorded.append((s, kw))
    )

    class ReaderArena:
        mismatches = 0
        name = "vsa_test"

        def stats(self):
            return {"checksum_mismatches": self.mismatches}

    sut = Reporter(clock=Clock(), timer=FakeTimer)
    a = ReaderArena()
    with caplog.at_level(logging.WARNING, logger="vllm_shm_arena"):
        sut.report_reader_arena(a)
        a.mismatches = 2
        sut.report_reader_arena(a)
        sut.report_reader_arena(a)
        sut.report_reader_arena(a, "frontend")  # another arena's count: warned on its own
    assert len(recorded) == 4
    assert [kw["arena"] for _, kw in recorded] == ["queue"] * 3 + ["frontend"]
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 2
    assert "2 queue arena tensor(s) changed between write and release" in lines[0]
    assert "2 frontend arena tensor(s)" in lines[1]


def test_counters_start_at_zero():
    assert Reporter().counters == {
        "messages": 0,
        "ring_messages": 0,
        "overflow_messages": 0,
        "blob_messages": 0,
        "bytes": 0,
    }
