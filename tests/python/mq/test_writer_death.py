"""Readers notice a dead writer (issue: the queue under faults, item 1).

The writer runs in a subprocess that prints its pickled handle, waits until the reader is
ready, sends what the test asks, then is SIGKILLed (or kills itself mid-send). The reader, in
this process, must get every message sent before the death and then a WriterDiedError, well
before its own timeout, whether it waits on the ring, on the overflow socket, or for READY.
"""

from __future__ import annotations

import base64
import os
import pickle
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
from mq_helpers import ready_in_threads

from vllm_shm_arena import MessageQueue, WriterDiedError
from vllm_shm_arena.cleanup import remove_stale_resources

REPO = Path(__file__).resolve().parents[3]

WRITER = """
import base64, os, pickle, signal, sys, torch
from vllm_shm_arena import MessageQueue
mode = sys.argv[1]
mq = MessageQueue(1, 1, max_chunk_bytes=1 << 20, enable_shm_tensor_arena=True)
print(base64.b64encode(pickle.dumps(mq.export_handle())).decode(), flush=True)
if mode == "before_ready":
    sys.stdin.readline()
    os.kill(os.getpid(), signal.SIGKILL)
mq.wait_until_ready(timeout=60)
mq.enqueue({"n": 1, "t": torch.full((2 << 20,), 7, dtype=torch.uint8)})  # via the arena
mq.enqueue({"n": 2})
if mode == "mid_overflow":
    # Publishes the ring's overflow marker, then dies before the socket frames go out (no
    # blob: the message must go over the socket).
    mq._end.blob_max = 0
    mq._end.sockets.send = lambda *a, **k: os.kill(os.getpid(), signal.SIGKILL)
    mq.enqueue({"n": 3, "blob": b"x" * (4 << 20)})
print("sent", flush=True)
sys.stdin.readline()
os.kill(os.getpid(), signal.SIGKILL)
"""


def _start_writer(mode: str):
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")])
    p = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(WRITER), mode],
        env=env,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    handle = pickle.loads(base64.b64decode(p.stdout.readline()))
    return p, handle


def _in_thread(fn, timeout: float):
    """Runs fn() in a thread; returns (result, exception, seconds) or fails on a hang."""
    out = {}

    def run():
        t0 = time.monotonic()
        try:
            out["result"] = fn()
        except BaseException as e:
            out["error"] = e
        out["seconds"] = time.monotonic() - t0

    th = threading.Thread(target=run, daemon=True)
    th.start()
    th.join(timeout)
    assert not th.is_alive(), f"still blocked after {timeout} s"
    return out.get("result"), out.get("error"), out["seconds"]


def test_a_reader_blocked_in_dequeue_learns_the_writer_died():
    p, handle = _start_writer("ring")
    r = MessageQueue.create_from_handle(handle, 0)
    try:
        r.wait_until_ready(timeout=60)
        first = r.dequeue(timeout=60)
        assert first["n"] == 1 and int(first["t"][0]) == 7
        assert r.dequeue(timeout=60) == {"n": 2}
        assert p.stdout.readline().strip() == "sent"
        p.stdin.write("\n")
        p.stdin.flush()
        p.wait(timeout=30)
        _, err, seconds = _in_thread(lambda: r.dequeue(timeout=None), timeout=60)
        print(f"dead writer noticed in dequeue(timeout=None) after {seconds:.2f} s")
        assert isinstance(err, WriterDiedError), err
        # A tensor already held stays readable after the writer is gone.
        assert int(first["t"][-1]) == 7
    finally:
        r.shutdown()
        if p.poll() is None:
            p.kill()


def test_a_reader_waiting_for_an_announced_overflow_message_learns_the_writer_died():
    p, handle = _start_writer("mid_overflow")
    r = MessageQueue.create_from_handle(handle, 0)
    try:
        r.wait_until_ready(timeout=60)
        assert r.dequeue(timeout=60)["n"] == 1
        assert r.dequeue(timeout=60) == {"n": 2}
        p.wait(timeout=60)
        assert p.returncode == -signal.SIGKILL
        _, err, seconds = _in_thread(lambda: r.dequeue(timeout=120), timeout=60)
        print(f"dead writer noticed on the overflow socket after {seconds:.2f} s")
        assert isinstance(err, WriterDiedError), err
    finally:
        r.shutdown()
        if p.poll() is None:
            p.kill()


def test_a_reader_waiting_for_ready_learns_the_writer_died():
    p, handle = _start_writer("before_ready")
    r = MessageQueue.create_from_handle(handle, 0)
    try:
        p.stdin.write("\n")
        p.stdin.flush()
        p.wait(timeout=30)
        _, err, seconds = _in_thread(lambda: r.wait_until_ready(timeout=120), timeout=60)
        print(f"dead writer noticed in wait_until_ready after {seconds:.2f} s")
        assert isinstance(err, WriterDiedError), err
    finally:
        r.shutdown()
        if p.poll() is None:
            p.kill()
        # It died before READY, so its names were never unlinked: what the cleaner is for.
        removed = [x.name for x in remove_stale_resources() if x.removed]
        assert handle.tensor_arena_handle.name in removed, removed


def test_a_live_but_silent_writer_is_not_reported_dead():
    """No false positives: a writer that is alive but sends nothing gives a TimeoutError."""
    mq = MessageQueue(1, 1)
    r = MessageQueue.create_from_handle(mq.export_handle(), 0)
    ready_in_threads(mq, [r])
    try:
        with pytest.raises(TimeoutError):
            r.dequeue(timeout=0.5)
    finally:
        mq.shutdown()
        r.shutdown()


def test_liveness_verdicts_other_than_alive_are_logged_once_per_new_count(caplog):
    """Readers found dead and probes the kernel did not answer are reported, each new count
    once (the counts come from the ring and the arena writer)."""
    import logging

    class Ring:
        dropped, unknown = 0, 0

        def dropped_readers(self):
            return self.dropped

        def liveness_unknown(self):
            return self.unknown

    mq = MessageQueue(1, 1)
    real, fake = mq._end.ring, Ring()
    mq._end.ring = fake
    try:
        with caplog.at_level(logging.WARNING, logger="vllm_shm_arena"):
            mq._end.report_liveness()
            fake.dropped, fake.unknown = 1, 3
            mq._end.report_liveness()
            mq._end.report_liveness()  # nothing new: nothing logged
            fake.dropped = 2
            mq._end.report_liveness()
        lines = [r.getMessage() for r in caplog.records]
        assert sum("found dead" in m for m in lines) == 2, lines
        assert sum("got no answer" in m for m in lines) == 1, lines
    finally:
        mq._end.ring = real
        mq.shutdown()


READER_THAT_STOPS = """
import base64, pickle, sys
from vllm_shm_arena import MessageQueue
r = MessageQueue.create_from_handle(pickle.loads(base64.b64decode(sys.argv[1])), 0)
r.wait_until_ready(timeout=60)
print("ready", flush=True)
sys.stdin.readline()
n = int(sys.argv[2])
got = [r.dequeue(timeout=60) for _ in range(n)]
print(" ".join(str(m["n"]) + ":" + str(len(m.get("blob", b""))) for m in got), flush=True)
"""


def test_enqueue_timeout_is_honoured_whatever_a_subscriber_does():
    """A reader stops (SIGSTOP) while large overflow messages are sent to it: enqueue never
    waits on the socket (it returns once the message is committed), waits only for the ring,
    and there a timeout means not sent: a retry works, the queue is never broken, and once the
    reader resumes it gets every sent message once, in order."""
    mq = MessageQueue(1, 1, max_chunk_bytes=1 << 20, max_chunks=4, enable_shm_tensor_arena=True)
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")])
    handle = base64.b64encode(pickle.dumps(mq.export_handle())).decode()
    n = 8
    p = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(READER_THAT_STOPS), handle, str(n)],
        env=env,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        mq.wait_until_ready(timeout=60)
        assert p.stdout.readline().strip() == "ready"
        os.kill(p.pid, signal.SIGSTOP)
        import torch

        sent, timeouts = 0, 0
        while sent < n:
            # 64 MiB: too big for a blob, so the local socket carries it.
            msg = {"n": sent, "t": torch.ones(8 << 20, dtype=torch.uint8)}
            if sent % 2 == 0:
                msg["blob"] = b"x" * (64 << 20)
            _, err, seconds = _in_thread(lambda m=msg: mq.enqueue(m, timeout=0.5), timeout=60)
            if err is None:
                sent += 1
                continue
            assert isinstance(err, TimeoutError), err
            timeouts += 1
            if timeouts == 2:
                os.kill(p.pid, signal.SIGCONT)
                p.stdin.write("go\n")
                p.stdin.flush()
        print(f"{timeouts} enqueue(timeout=0.5) calls timed out behind the stopped reader")
        assert timeouts >= 2  # the ring (4 chunks) filled: the timeouts were not sends
        out = p.stdout.readline().split()
        assert out == [f"{i}:{(64 << 20) if i % 2 == 0 else 0}" for i in range(n)], out
        assert mq.stats()["overflow_messages"] == n // 2
    finally:
        os.kill(p.pid, signal.SIGCONT)
        p.kill()
        p.wait(timeout=30)
        mq.shutdown()
