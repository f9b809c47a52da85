"""mq/lifecycle.py on its own: the exit gate, the exit hook over fake ends, the resources a
finalizer releases, and one end's ``Lifecycle`` (call lock, shutdown flag, idempotent close,
a forked child's copy). No ring, socket or arena is built."""

from __future__ import annotations

import logging
import os
import threading
import time
import weakref

import pytest

from vllm_shm_arena.mq import lifecycle
from vllm_shm_arena.mq.lifecycle import Lifecycle, NoGilCalls, Resources


class FakeEnd:
    """What the exit hook needs of an end."""

    CLOSE_DRAIN_S = 1.5

    def __init__(self, fail: bool = False):
        self.lifecycle = Lifecycle(self)
        self.closed_with = []
        self.fail = fail

    def close(self, drain_s):
        self.closed_with.append(drain_s)
        if self.fail:
            raise OSError("closing failed")


class Closable:
    def __init__(self, log, name):
        self.log, self.name = log, name

    def close(self, linger=None):
        self.log.append((self.name, "close", linger))

    def term(self):
        self.log.append((self.name, "term"))

    def shutdown(self):
        self.log.append((self.name, "shutdown"))

    def remove(self):
        self.log.append((self.name, "remove"))


# ------------------------------------------------------------------ the gate
def test_the_gate_counts_threads_inside_and_refuses_new_calls_once_closed():
    sut = NoGilCalls()
    entered, leave = threading.Event(), threading.Event()

    def inside():
        with sut:
            entered.set()
            leave.wait(10)

    th = threading.Thread(target=inside, daemon=True)
    th.start()
    assert entered.wait(10)
    t0 = time.monotonic()
    assert sut.close_and_wait(0.2) == 1  # still inside after the bounded wait
    assert time.monotonic() - t0 >= 0.15
    with pytest.raises(RuntimeError, match="interpreter is exiting"):
        with sut:
            pass
    leave.set()
    th.join(10)
    assert sut.close_and_wait(5) == 0


def test_the_gate_wait_returns_as_soon_as_the_last_thread_leaves():
    sut = NoGilCalls()
    entered = threading.Event()

    def inside():
        with sut:
            entered.set()
            time.sleep(0.2)

    th = threading.Thread(target=inside, daemon=True)
    th.start()
    assert entered.wait(10)
    t0 = time.monotonic()
    assert sut.close_and_wait(10) == 0
    assert time.monotonic() - t0 < 5
    th.join(10)


# ------------------------------------------------------------------ the exit hook
def test_the_exit_hook_wakes_then_closes_this_processs_ends(caplog):
    live = weakref.WeakSet()
    mine, failing, inherited = FakeEnd(), FakeEnd(fail=True), FakeEnd()
    inherited.lifecycle.pid = os.getpid() + 1  # as a forked child sees its parent's end
    for e in (mine, failing, inherited):
        live.add(e)
    gate = NoGilCalls()
    with caplog.at_level(logging.DEBUG, logger="vllm_shm_arena"):
        lifecycle.shutdown_at_exit(live, gate, wait_s=1.0)
    assert mine.lifecycle.shutdown.is_set() and mine.closed_with == [1.5]
    assert failing.closed_with == [1.5]  # its failure did not stop the others
    assert "closing a queue at exit failed" in caplog.text
    assert not inherited.lifecycle.shutdown.is_set() and inherited.closed_with == []
    with pytest.raises(RuntimeError):  # the gate is closed for good
        with gate:
            pass


def test_the_exit_hook_says_when_a_thread_stays_inside_a_call(caplog):
    live = weakref.WeakSet()
    end = FakeEnd()
    live.add(end)
    gate = NoGilCalls()
    entered, leave = threading.Event(), threading.Event()

    def stuck():
        with gate:
            entered.set()
            leave.wait(10)

    th = threading.Thread(target=stuck, daemon=True)
    th.start()
    assert entered.wait(10)
    try:
        with caplog.at_level(logging.WARNING, logger="vllm_shm_arena"):
            lifecycle.shutdown_at_exit(live, gate, wait_s=0.1)
        assert "1 thread(s) still inside a queue call at exit" in caplog.text
        assert end.closed_with == [1.5]  # closed anyway (its calls are bounded)
    finally:
        leave.set()
        th.join(10)


def test_the_registry_never_keeps_an_end_alive():
    end = FakeEnd()
    ref = weakref.ref(end)
    assert end in lifecycle.LIVE
    del end
    assert ref() is None


# ------------------------------------------------------------------ resources
def test_resources_release_everything_once_registered():
    log = []
    sut = Resources(os.getpid())
    sut.ctx = Closable(log, "ctx")
    sut.sockets += [Closable(log, "s1"), Closable(log, "s2")]
    sut.ring_writer = Closable(log, "ring")
    sut.socket_dir = Closable(log, "dir")
    sut.release()
    assert log == [
        ("dir", "remove"),
        ("s1", "close", 0),
        ("s2", "close", 0),
        ("ctx", "term"),
        ("ring", "shutdown"),
    ]
    assert sut.socket_dir is None


def test_resources_of_another_process_are_left_alone():
    log = []
    sut = Resources(os.getpid() + 1)  # a forked child's inherited copy
    sut.ctx = Closable(log, "ctx")
    sut.sockets.append(Closable(log, "s"))
    sut.release()
    assert log == []


def test_the_finalizer_releases_the_resources_when_the_end_is_dropped():
    log = []
    end = FakeEnd()
    end.lifecycle.resources.ctx = Closable(log, "ctx")
    del end
    assert log == [("ctx", "term")]


# ------------------------------------------------------------------ one end's lifecycle
def test_take_honours_its_timeout_and_names_what_holds_the_lock():
    sut = Lifecycle(FakeEnd())
    sut.take(None, "call")
    try:
        t0 = time.monotonic()
        with pytest.raises(TimeoutError, match="another thread's enqueue"):
            sut.take(0.1, "enqueue")
        assert time.monotonic() - t0 < 5
        with pytest.raises(TimeoutError):
            sut.take(-1.0, "enqueue")  # a negative timeout: no wait at all
    finally:
        sut.side_lock.release()


def test_time_left_and_check_running():
    sut = Lifecycle(FakeEnd())
    assert sut.time_left(None, "x") is None
    assert 0 < sut.time_left(time.monotonic() + 10, "x") <= 10
    with pytest.raises(TimeoutError, match="timed out waiting for a chunk; the message was not"):
        sut.time_left(time.monotonic() - 1, "a chunk")
    sut.shutdown.set()
    with pytest.raises(RuntimeError, match="shut down"):
        sut.check_running()
    with pytest.raises(RuntimeError, match="shut down"):
        sut.time_left(None, "x")


def test_close_runs_the_ends_steps_once_under_its_lock_then_marks_the_resources_released():
    log = []
    end = FakeEnd()
    sut = end.lifecycle
    sut.resources.ctx = Closable(log, "ctx")

    def steps(drain_s):
        log.append(("steps", drain_s, sut.side_lock.locked()))

    sut.close(2.0, steps)
    sut.close(2.0, steps)  # idempotent
    assert log == [("steps", 2.0, True), ("ctx", "term")]
    assert sut.closed and not sut.finalizer.alive and not sut.side_lock.locked()


def test_close_does_not_wait_for_good_on_a_busy_lock():
    sut = FakeEnd().lifecycle
    sut.side_lock.acquire()  # a call that never returns
    seen = []
    t0 = time.monotonic()
    sut.close(0.0, lambda d: seen.append(sut.side_lock.locked()))
    assert seen == [True] and time.monotonic() - t0 < 5
    assert sut.side_lock.locked()  # the other call's lock is not released by close
    sut.side_lock.release()


def test_close_in_a_forked_child_does_nothing():
    end = FakeEnd()
    sut = end.lifecycle
    sut.pid = os.getpid() + 1
    seen = []
    sut.close(0.0, seen.append)
    assert seen == [] and not sut.closed and sut.finalizer.alive


def test_abandon_releases_a_half_built_end_now():
    log = []
    end = FakeEnd()
    end.lifecycle.resources.ctx = Closable(log, "ctx")
    end.lifecycle.abandon()
    assert log == [("ctx", "term")] and end.lifecycle.closed
    end.lifecycle.close(0.0, lambda d: log.append("steps"))  # closed already
    assert log == [("ctx", "term")]
