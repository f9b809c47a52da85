"""``MessageQueue`` under faults: interpreter exit with threads blocked in the queue,
shutdown racing queued messages, garbage collection of queues in reference cycles, and two
ranks of one queue in one process.

Anything that may abort or hang runs in a fresh interpreter (``run_py``) with a timeout.
Every test uses a private shared-memory directory (``VLLM_SHM_ARENA_SHM_DIR``), never the
shared ``/dev/shm`` itself. Multi-process tests print their seed (``VSA_SEED``, conftest.py).
"""

from __future__ import annotations

import gc
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import mq_helpers as H  # noqa: E402
import pytest
import torch
from mq_helpers import ready_in_threads  # noqa: E402

from vllm_shm_arena import MessageQueue  # noqa: E402
from vllm_shm_arena._ext import _C  # noqa: E402
from vllm_shm_arena.mq import writer as mq_writer  # noqa: E402

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
deadline = time.monotonic() + 10
while not (r1._end.lifecycle.call_lock.locked() and w2._end.lifecycle.call_lock.locked()):
    assert time.monotonic() < deadline  # both threads are inside their calls' waits
    time.sleep(0.001)
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
    assert mq._end.ring.write_marker(_C.RING_FLAG_OVERFLOW, 5.0)
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
    monkeypatch.setattr(mq_writer, "_ARENA_POLICY", "fixed")
    monkeypatch.setattr(mq_writer, "_ARENA_NUM_SLOTS", 2)
    monkeypatch.setattr(mq_writer, "_ARENA_SLOT_BYTES", 16 * MiB)
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


# ------------------------------------------------------------------------ 3. garbage collection
@pytest.fixture
def tiny_shm_dir(tmp_path):
    """A 16 MiB tmpfs (mounted as root; skipped otherwise): room for a small ring, not for
    an arena."""
    d = tmp_path / "tiny"
    d.mkdir()
    if os.geteuid() != 0:
        pytest.skip("mounting a small tmpfs needs root")
    rc = os.system(f"mount -t tmpfs -o size=16m,mode=0700 tmpfs {d} 2>/dev/null")
    if rc != 0:
        pytest.skip(f"mount -t tmpfs failed (rc={rc}): no CAP_SYS_ADMIN here")
    try:
        yield d
    finally:
        os.system(f"umount {d}")


_GC_CYCLE = """
import gc, sys, threading
from vllm_shm_arena import MessageQueue

case = sys.argv[1] if len(sys.argv) > 1 else {case!r}
gc.disable()  # collect exactly once, below
small = dict(max_chunk_bytes=1 << 20, max_chunks=2)

def half_built(**kw):
    try:
        MessageQueue(**kw)
    except Exception as e:
        err = e  # a reference cycle: this frame -> err -> traceback -> this frame
        print("constructor failed:", type(e).__name__, e, flush=True)
        return
    raise SystemExit("the constructor was expected to fail")

if case == "writer":
    w = MessageQueue(1, 1, **small)
    w.me = w
    del w
elif case == "reader":
    w = MessageQueue(1, 1, **small)
    r = MessageQueue.create_from_handle(w.export_handle(), 0)
    t = threading.Thread(target=r.wait_until_ready, args=(20,))
    t.start()
    w.wait_until_ready(20)
    t.join()
    r.me = r
    del r, t
elif case == "half_built_arena":  # the ring exists, the arena does not fit the shm dir
    half_built(n_reader=1, n_local_reader=1, enable_shm_tensor_arena=True, **small)
elif case == "half_built_bind":  # the ring and local socket exist, the TCP bind fails
    half_built(n_reader=2, n_local_reader=1, connect_ip="256.0.0.1", **small)
print("COLLECTING", flush=True)
gc.collect()
print("COLLECTED", flush=True)
"""


@pytest.mark.parametrize("case", ["writer", "reader", "half_built_arena", "half_built_bind"])
def test_gc_of_queue_in_reference_cycle_never_hangs(case, run_py, shm_dir, request):
    """A writer, a reader, or a half-built queue (constructor failed after the ring existed)
    in a reference cycle: ``gc.collect()`` returns (it blocked for good in pyzmq's
    ``Context.term()`` on sockets nobody closed) and no shm name is left."""
    env = {}
    d = shm_dir
    if case == "half_built_arena":
        d = request.getfixturevalue("tiny_shm_dir")
        env = {"VLLM_SHM_ARENA_SHM_DIR": str(d), "VLLM_SHM_ARENA_MB": "64"}
    try:
        rc, out, err = run_py(_GC_CYCLE.format(case=case), timeout=60, env=env)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"gc.collect() hung ({case}); stdout: {e.stdout!r}")
    assert "COLLECTED" in out and rc == 0, f"rc={rc}\n{out}\n{err[-3000:]}"
    if case.startswith("half_built"):
        assert "constructor failed" in out, out
    assert list(d.iterdir()) == [], "shm names left behind"


@pytest.mark.parametrize(
    "kwargs, what",
    [
        (dict(n_reader=2, n_local_reader=1, connect_ip=""), "connect_ip"),
        (dict(n_reader=2, n_local_reader=2, local_reader_ranks=[0, 0]), "duplicates"),
        (dict(n_reader=1, n_local_reader=1, max_chunk_bytes=-1), "max_chunk_bytes"),
    ],
    ids=["empty_connect_ip", "duplicate_ranks", "negative_chunk_bytes"],
)
def test_constructor_checks_arguments_before_creating_anything(kwargs, what, shm_dir):
    """Bad constructor arguments raise ``ValueError`` naming the argument before any ring,
    socket or arena exists: while the exception (and the half-built object its traceback
    holds) is alive, the shm directory stays empty."""
    with pytest.raises(ValueError, match=what) as info:
        MessageQueue(**kwargs)
    assert info.value is not None
    assert list(shm_dir.iterdir()) == [], "a resource was created before the check"


# ------------------------------------------------------------------------ 4. two ranks, one process
def test_two_ranks_of_one_queue_in_one_process_resolve_their_own_stubs(
    seed, shm_dir, writers, monkeypatch
):
    """Ranks 0 and 1 of one queue in one process (threads, as a custom executor runs them):
    each rank's arena tensors are acquired through its own reader, both read intact bytes,
    and once both let go every allocation is back (none is left held by rank 0 while rank 1
    was charged twice)."""
    print(f"VSA_SEED={seed}")
    monkeypatch.setattr(mq_writer, "_ARENA_POLICY", "fixed")
    monkeypatch.setattr(mq_writer, "_ARENA_NUM_SLOTS", 4)
    monkeypatch.setattr(mq_writer, "_ARENA_SLOT_BYTES", 16 * MiB)
    mq = MessageQueue(2, 2, enable_shm_tensor_arena=True)
    writers(mq)
    readers = [MessageQueue.create_from_handle(mq.export_handle(), rank) for rank in (0, 1)]
    for r in readers:
        writers(r)
    ready_in_threads(mq, readers)
    n = 3
    for seq in range(n):
        mq.enqueue(H.make_msg(seed, seq, 8 * MiB), timeout=10)
    assert mq.arena.stats()["hits"] == n
    got: dict[int, list] = {}
    errors: list = []

    def run(rank):
        try:
            got[rank] = [readers[rank].dequeue(timeout=10) for _ in range(n)]
        except BaseException as e:
            errors.append(f"rank {rank}: {type(e).__name__}: {e}")

    ths = [threading.Thread(target=run, args=(rank,), daemon=True) for rank in (0, 1)]
    for t in ths:
        t.start()
    for t in ths:
        t.join(30)
    assert not errors, errors
    for rank in (0, 1):
        for seq, msg in enumerate(got[rank]):
            assert H.check_msg(msg, seed, seq, full=True) is None, (rank, seq)
        assert readers[rank].arena.stats()["held"] == n, (rank, readers[rank].arena.stats())
    del msg  # the loop variable still holds rank 1's last message
    got.clear()
    gc.collect()
    for r in readers:
        r.arena.flush_releases()
    mq.arena.reclaim()
    assert mq.arena.stats()["in_use"] == 0, mq.arena.stats()


# ------------------------------------------------------------------------ 5. other users
_SPY = """
import select, sys, zmq
ctx = zmq.Context()
s = ctx.socket(zmq.SUB)
s.setsockopt(zmq.LINGER, 0)
s.setsockopt_string(zmq.SUBSCRIBE, "")
s.connect(sys.argv[1])
print("CONNECTING", flush=True)
got = 0
while True:
    if s.poll(100):
        got += sum(len(f) for f in s.recv_multipart())
    if select.select([sys.stdin], [], [], 0)[0]:  # the test closed our stdin: report
        break
print(f"GOT {got}", flush=True)
"""


@pytest.mark.skipif(os.geteuid() != 0, reason="setpriv --reuid needs CAP_SETUID (run as root)")
def test_other_uid_cannot_read_the_local_overflow_socket(seed, shm_dir, writers):
    """A process of another uid (65534) that connects to the local overflow socket receives
    nothing: not the READY, not a 2 MiB message sent over the socket to the real reader."""
    print(f"VSA_SEED={seed}")
    mq = MessageQueue(1, 1, max_chunk_bytes=1 * MiB)
    writers(mq)
    addr = mq.export_handle().local_subscribe_addr
    spy = subprocess.Popen(
        ["setpriv", "--reuid", "65534", "--regid", "65534", "--clear-groups"]
        + [sys.executable, "-c", _SPY, addr],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert spy.stdout.readline().strip() == "CONNECTING", spy.stderr.read()
        r = MessageQueue.create_from_handle(mq.export_handle(), 0)
        writers(r)
        ready_in_threads(mq, [r])
        payload = os.urandom(2 * MiB)
        mq.enqueue(payload, timeout=10)
        assert r.dequeue(timeout=10) == payload
        assert mq.stats()["overflow_messages"] == 1
        spy.stdin.close()
        spy.wait(30)
        out, err = spy.stdout.read(), spy.stderr.read()
    finally:
        spy.kill()
        spy.wait(10)
    assert out.strip() == "GOT 0", f"another uid received bytes: {out!r} {err[-2000:]}"
