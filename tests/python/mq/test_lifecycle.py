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

from vllm_shm_arena._ext import _C
from vllm_shm_arena.mq import lifecycle
from vllm_shm_arena.mq.lifecycle import Lifecycle, Resources


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
@pytest.fixture
def ring_reader(tmp_path):
    """A ring nobody writes to: its read(t) waits t seconds inside a gated GIL-free call. The
    gate (process-wide) is open again afterwards."""
    w = _C.MessageRingWriter(1, 2, 4096, str(tmp_path))
    r = _C.MessageRingReader(w.name, 0, str(tmp_path))
    yield r
    _C.nogil_gate_reopen()
    w.shutdown()
    w.unlink()


def _inside_a_gated_call(reader, seconds: float) -> threading.Thread:
    th = threading.Thread(target=reader.read, args=(seconds,), daemon=True)
    th.start()
    deadline = time.monotonic() + 10
    while _C.nogil_gate_inside() == 0:
        assert time.monotonic() < deadline, "the thread never entered its call"
        time.sleep(0.001)
    return th


def test_the_gate_counts_threads_inside_and_refuses_new_calls_once_closed(ring_reader):
    th = _inside_a_gated_call(ring_reader, 1.5)
    t0 = time.monotonic()
    assert _C.nogil_gate_close_and_wait(0.2) == 1  # still inside after the bounded wait
    assert time.monotonic() - t0 >= 0.15
    with pytest.raises(RuntimeError, match="interpreter is exiting"):
        ring_reader.read(0.0)
    th.join(10)
    assert _C.nogil_gate_close_and_wait(5) == 0


def test_the_gate_wait_returns_as_soon_as_the_last_thread_leaves(ring_reader):
    th = _inside_a_gated_call(ring_reader, 0.2)
    t0 = time.monotonic()
    assert _C.nogil_gate_close_and_wait(10) == 0
    assert time.monotonic() - t0 < 5
    th.join(10)


def test_a_child_forked_while_a_thread_is_inside_a_call_counts_none(ring_reader):
    """Hole 11: the child has no such thread, so its exit hook must not wait for one, nor say
    that one stayed (before: the inherited count made it wait 2 s and log a false warning)."""
    th = _inside_a_gated_call(ring_reader, 1.0)
    r, wfd = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child reports through the pipe
        try:
            t0 = time.monotonic()
            left = _C.nogil_gate_close_and_wait(2.0)
            os.write(wfd, f"{_C.nogil_gate_inside()} {left} {time.monotonic() - t0:.3f}".encode())
        finally:
            os._exit(0)
    os.close(wfd)
    inside, left, waited = os.read(r, 100).decode().split()
    os.waitpid(pid, 0)
    os.close(r)
    th.join(10)
    assert (inside, left) == ("0", "0") and float(waited) < 1.0


# ------------------------------------------------------------------ the exit hook
class FakeGate:
    def __init__(self, left=0):
        self.left, self.calls = left, []

    def __call__(self, wait_s):
        self.calls.append(wait_s)
        return self.left


def test_the_exit_hook_wakes_then_closes_this_processs_ends(caplog):
    live = weakref.WeakSet()
    mine, failing, inherited = FakeEnd(), FakeEnd(fail=True), FakeEnd()
    inherited.lifecycle.pid = os.getpid() + 1  # as a forked child sees its parent's end
    for e in (mine, failing, inherited):
        live.add(e)
    gate = FakeGate()
    with caplog.at_level(logging.DEBUG, logger="vllm_shm_arena"):
        lifecycle.shutdown_at_exit(live, gate, wait_s=1.0)
    assert gate.calls == [1.0]  # the gate closed (and waited) before any end was closed
    assert mine.lifecycle.shutdown.is_set() and mine.closed_with == [1.5]
    assert failing.closed_with == [1.5]  # its failure did not stop the others
    assert "closing a queue at exit failed" in caplog.text
    assert not inherited.lifecycle.shutdown.is_set() and inherited.closed_with == []


def test_the_exit_hook_says_when_a_thread_stays_inside_a_call(caplog):
    live = weakref.WeakSet()
    end = FakeEnd()
    live.add(end)
    with caplog.at_level(logging.WARNING, logger="vllm_shm_arena"):
        lifecycle.shutdown_at_exit(live, FakeGate(left=1), wait_s=0.1)
    assert "1 thread(s) still inside a queue call at exit" in caplog.text
    assert end.closed_with == [1.5]  # closed anyway (its calls are bounded)


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
def test_a_call_honours_its_timeout_and_names_what_holds_the_lock():
    sut = Lifecycle(FakeEnd())
    taken = threading.Event()
    done = threading.Event()

    def holder():
        sut.call(None, "call", lambda: (taken.set(), done.wait(10)))

    th = threading.Thread(target=holder, daemon=True)
    th.start()
    assert taken.wait(10)
    try:
        t0 = time.monotonic()
        with pytest.raises(TimeoutError, match="another thread's enqueue"):
            sut.call(0.1, "enqueue", lambda: None)
        assert time.monotonic() - t0 < 5
        with pytest.raises(TimeoutError):
            sut.call(-1.0, "enqueue", lambda: None)  # a negative timeout: no wait at all
    finally:
        done.set()
        th.join(10)
    assert not sut.call_lock.locked()


def test_a_call_returns_what_its_function_returns_and_lets_go_whatever_it_raises():
    sut = Lifecycle(FakeEnd())
    assert sut.call(None, "call", lambda a, b: (a, b, sut.call_lock.locked()), 1, 2) == (1, 2, True)
    with pytest.raises(KeyError):
        sut.call(None, "call", {}.__getitem__, "x")
    assert not sut.call_lock.locked()


def test_a_call_from_inside_a_call_of_the_same_thread_is_refused_not_deadlocked():
    sut = Lifecycle(FakeEnd())

    def outer():
        with pytest.raises(RuntimeError, match="do not nest"):
            sut.call(None, "dequeue", lambda: None)
        return sut.call_lock.locked()

    assert sut.call(None, "dequeue", outer) is True
    assert not sut.call_lock.locked()


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
        log.append(("steps", drain_s, sut.call_lock.locked()))

    sut.close(2.0, steps)
    sut.close(2.0, steps)  # idempotent
    assert log == [("steps", 2.0, True), ("ctx", "term")]
    assert sut.closed and not sut.finalizer.alive and not sut.call_lock.locked()


def test_close_does_not_wait_for_good_on_a_busy_lock():
    sut = FakeEnd().lifecycle
    sut.call_lock.acquire()  # a call that never returns
    seen = []
    t0 = time.monotonic()
    sut.close(0.0, lambda d: seen.append(sut.call_lock.locked()))
    assert seen == [True] and time.monotonic() - t0 < 5
    assert sut.call_lock.locked()  # the other call's lock is not released by close
    sut.call_lock.release()


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
