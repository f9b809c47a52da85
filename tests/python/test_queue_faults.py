"""``MessageQueue`` under faults: interpreter exit with threads blocked in the queue,
shutdown racing queued messages, garbage collection of queues in reference cycles, and two
ranks of one queue in one process.

Anything that may abort or hang runs in a fresh interpreter (``run_py``) with a timeout.
Every test uses a private shared-memory directory (``VLLM_SHM_ARENA_SHM_DIR``), never the
shared ``/dev/shm`` itself. Multi-process tests print their seed (``VSA_SEED``, conftest.py).
"""

from __future__ import annotations

import os
import shutil
import signal
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import mq_helpers as H  # noqa: E402

from vllm_shm_arena import MessageQueue, message_queue  # noqa: E402

MiB = H.MiB


@pytest.fixture
def shm_dir(monkeypatch):
    """A private shared-memory directory (tmpfs) for this test, set as
    ``VLLM_SHM_ARENA_SHM_DIR`` here and in every child; removed afterwards."""
    d = Path("/dev/shm") / f"vsatest-faults-{os.getpid()}-{time.monotonic_ns()}"
    d.mkdir()
    monkeypatch.setenv("VLLM_SHM_ARENA_SHM_DIR", str(d))
    try:
        yield d
    finally:
        shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
def writers():
    """``writers(mq)`` registers a queue end to shut down at teardown."""
    made = []
    yield made.append
    for mq in made:
        mq.shutdown()


def ready_in_threads(writer, readers, timeout=20.0) -> None:
    """wait_until_ready on a writer and same-process readers, concurrently."""
    errors = []

    def run(q):
        try:
            q.wait_until_ready(timeout=timeout)
        except BaseException as e:
            errors.append(e)

    ths = [threading.Thread(target=run, args=(q,), daemon=True) for q in [writer, *readers]]
    for t in ths:
        t.start()
    for t in ths:
        t.join(timeout + 5)
    assert not errors, errors
    assert not any(t.is_alive() for t in ths)


# ------------------------------------------------------------------------ 1. interpreter exit
_EXIT_WITH_BLOCKED_THREADS = """
import sys, threading, time
from vllm_shm_arena import MessageQueue

def ready(w, r):
    t = threading.Thread(target=r.wait_until_ready, args=(20,))
    t.start()
    w.wait_until_ready(20)
    t.join()

# A reader blocked in dequeue() on an empty ring.
w1 = MessageQueue(1, 1)
r1 = MessageQueue.create_from_handle(w1.export_handle(), 0)
ready(w1, r1)
# A writer blocked in enqueue() on a full ring (one chunk, taken, never read).
w2 = MessageQueue(1, 1, max_chunk_bytes=1 << 16, max_chunks=1)
r2 = MessageQueue.create_from_handle(w2.export_handle(), 0)
ready(w2, r2)
w2.enqueue(b"fills the only chunk")

entered = threading.Barrier(3)
def deq():
    entered.wait()
    r1.dequeue()
def enq():
    entered.wait()
    w2.enqueue(b"waits for a chunk")
for f in (deq, enq):
    threading.Thread(target=f, daemon=True).start()
entered.wait()
time.sleep(0.3)  # let both threads get into the C++ wait; the property holds either way
print("MAIN RETURNS", flush=True)
"""


def test_interpreter_exit_with_threads_blocked_in_queue_calls(run_py, shm_dir):
    """Daemon threads blocked in ``dequeue()`` (empty ring) and ``enqueue()`` (full ring)
    while the main thread returns: the process exits with 0, not an abort ("terminate
    called without an active exception", exit 134)."""
    rc, out, err = run_py(_EXIT_WITH_BLOCKED_THREADS, timeout=60)
    assert "MAIN RETURNS" in out, err[-3000:]
    assert rc == 0, f"rc={rc}\n{err[-3000:]}"
    assert "terminate called" not in err, err[-3000:]
    assert list(shm_dir.iterdir()) == [], "shm names left behind"


# ------------------------------------------------------------------------ 2. shutdown loses nothing
def test_shutdown_delivers_every_enqueued_overflow_message(seed, shm_dir, writers):
    """Four ``enqueue()`` calls of messages too big for a ring chunk return, then the writer
    calls ``shutdown()``: the reader gets all four, intact and in order, then a clean "shut
    down" error, and never hangs.

    Deterministic: the reader process is stopped (SIGSTOP) while the writer enqueues, so the
    overflow frames (4 x 1.2 MiB, copied by ZeroMQ) cannot all have left the writer's ZeroMQ
    queue when ``shutdown()`` starts; it is continued once ``shutdown()`` has been called."""
    print(f"VSA_SEED={seed}")
    kids = H.Kids("fork")
    mq = MessageQueue(1, 1, max_chunk_bytes=1 * MiB)
    writers(mq)
    q = kids.ctx.Queue()
    try:
        p = kids.start(H.draining_reader, mq.export_handle(), 0, q)
        mq.wait_until_ready(timeout=30)
        assert q.get(timeout=30) == ("ready", None)
        os.kill(p.pid, signal.SIGSTOP)
        for seq in range(4):
            mq.enqueue(H.many_frames_msg(seq), timeout=30)
        assert mq.stats()["overflow_messages"] == 4
        done = threading.Event()
        th = threading.Thread(target=lambda: (mq.shutdown(), done.set()), daemon=True)
        th.start()
        os.kill(p.pid, signal.SIGCONT)
        got, end = [], None
        while end is None:
            try:
                what, detail = q.get(timeout=20)
            except Exception:
                pytest.fail(f"reader hung after {got} (no report for 20 s)")
            if what == "msg":
                got.append(detail)
            else:
                end = (what, detail)
        assert done.wait(15), "shutdown() did not return"
        assert got == [(s, True) for s in range(4)], got
        assert end[0] == "end" and end[1].startswith("RuntimeError") and "shut down" in end[1]
        kids.join_all(10)
    finally:
        for k in kids.procs:
            if k.is_alive():
                os.kill(k.pid, signal.SIGCONT)
        kids.kill_all()


def test_reader_after_overflow_marker_wakes_on_writer_shutdown(shm_dir, writers):
    """The ring holds an overflow marker whose message never went out (an ``enqueue``
    interrupted by shutdown between the marker and the socket send), then the writer shuts
    down: the reader's ``dequeue()`` raises "shut down" instead of waiting on the socket for
    good."""
    mq = MessageQueue(1, 1, max_chunk_bytes=1 * MiB)
    writers(mq)
    r = MessageQueue.create_from_handle(mq.export_handle(), 0)
    writers(r)
    ready_in_threads(mq, [r])
    assert mq._ring.write_marker(message_queue._C.RING_FLAG_OVERFLOW, 5.0)
    mq.shutdown()
    th, out = H.dequeue_in_thread(r)
    th.join(15)
    assert not th.is_alive(), "dequeue() still waiting on the socket after writer shutdown"
    assert isinstance(out["result"], RuntimeError), repr(out["result"])
    assert "shut down" in str(out["result"])


def test_enqueue_interrupted_by_shutdown_raises_shutdown_and_gives_back_slots(
    shm_dir, writers, monkeypatch
):
    """An ``enqueue`` blocked on a full ring (its tensor already copied into the arena) is
    interrupted by ``shutdown()`` from another thread: it raises the shutdown error (not
    "arena ... is closed" from its cleanup path) and its arena allocation goes back."""
    monkeypatch.setattr(message_queue, "_ARENA_POLICY", "fixed")
    monkeypatch.setattr(message_queue, "_ARENA_NUM_SLOTS", 2)
    monkeypatch.setattr(message_queue, "_ARENA_SLOT_BYTES", 16 * MiB)
    mq = MessageQueue(1, 1, max_chunk_bytes=1 * MiB, max_chunks=1, enable_shm_tensor_arena=True)
    writers(mq)
    r = MessageQueue.create_from_handle(mq.export_handle(), 0)
    writers(r)
    ready_in_threads(mq, [r])
    mq.enqueue(b"fills the only chunk", timeout=5)
    out = {}

    def run():
        try:
            mq.enqueue({"t": torch.ones(8 * MiB // 4)})
            out["result"] = "returned"
        except BaseException as e:
            out["result"] = e

    th = threading.Thread(target=run, daemon=True)
    th.start()
    deadline = time.monotonic() + 10
    while mq.arena.stats()["hits"] < 1 and time.monotonic() < deadline:
        time.sleep(0.01)  # the tensor is in the arena: enqueue now waits for a ring chunk
    assert mq.arena.stats()["hits"] == 1
    mq.shutdown()
    th.join(10)
    assert not th.is_alive(), "enqueue still blocked after shutdown()"
    res = out["result"]
    assert isinstance(res, RuntimeError) and "shut down" in str(res), repr(res)
    st = mq.arena.stats()
    assert st["in_use"] == 0 and st["aborted"] == 1, st
