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
import sys
import threading
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
import mq_helpers as H  # noqa: E402

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
