"""Exactly once, in order, from the writer only: the queue under timeouts, interrupts, threads
and slow readers.

Each scenario runs writer and readers in one process (threads), so it can step in between the
queue's own steps (a late exception right after the ring published, a socket send held back)
without sleeps deciding the outcome; every wait has a timeout, so a regression fails, never
hangs.
"""

from __future__ import annotations

import contextlib
import gc
import os
import random
import threading
import time
import weakref

import pytest
import torch
from mq_helpers import inside_a_call, ready_in_threads, wait_until

from vllm_shm_arena import MessageQueue
from vllm_shm_arena.mq import transport

MiB = 1 << 20


def _pair(n_readers=1, arena=False, chunk=1 * MiB, chunks=4):
    w = MessageQueue(
        n_readers,
        n_readers,
        max_chunk_bytes=chunk,
        max_chunks=chunks,
        enable_shm_tensor_arena=arena,
    )
    rs = [MessageQueue.create_from_handle(w.export_handle(), r) for r in range(n_readers)]
    ready_in_threads(w, rs)
    return w, rs


def _close(*qs):
    for q in qs:
        q.shutdown()


class _Proxy:
    """Stands in for one of the queue's objects (its ring) and calls ``hook`` around one
    method, forwarding everything else."""

    def __init__(self, inner, name, hook):
        self._inner, self._name, self._hook = inner, name, hook

    def __getattr__(self, attr):
        real = getattr(self._inner, attr)
        if attr != self._name:
            return real
        return lambda *a, **kw: self._hook(real, *a, **kw)


@contextlib.contextmanager
def _hook_send(sock, hook):
    """Calls ``hook(real, frame, flags)`` for each frame the queue sends on ``sock`` (the
    queue sends a message's frames in one C call, transport._send_frames: this stands in for
    it, frame by frame)."""
    real = transport._send_frames
    handle = sock.underlying

    def send_frames(h, frames, first_flags, more, progress, part_bytes, split_above):
        if h != handle:
            return real(h, frames, first_flags, more, progress, part_bytes, split_above)
        progress[0] = 0
        for i, f in enumerate(frames):
            flags = (first_flags if i == 0 else 0) | (more if i + 1 < len(frames) else 0)
            hook(lambda fr, fl: real(h, [fr], fl, 0, [0], part_bytes, split_above), f, flags)
            progress[0] = i + 1

    transport._send_frames = send_frames
    try:
        yield
    finally:
        transport._send_frames = real


# ------------------------------------------------------------------ a timed-out dequeue
@pytest.mark.parametrize("arena", [False, True], ids=["socket", "arena"])
def test_a_timed_out_dequeue_leaves_the_queue_as_it_was(arena, socket_overflow):
    """The overflow message's socket half is held back until the reader's dequeue timed out:
    the reader must still get 1, 2, 3 in order (before: [2, 1, ...], one behind for good)."""
    w, (r,) = _pair(arena=arena)
    release = threading.Event()
    sent_marker = threading.Event()

    def hold_first(real, *a):
        if not release.is_set():
            sent_marker.set()
            assert release.wait(20)
        return real(*a)

    hook = _hook_send(w.local_socket, hold_first)
    hook.__enter__()
    # Non-contiguous: the arena declines it, so it goes over the socket even with the arena on
    # (and then the message itself does not fit a 1 MiB chunk either way).
    base = torch.arange(2 * MiB, dtype=torch.int32).reshape(-1, 2)
    errors = []

    def send():
        try:
            for seq in (1, 2, 3):
                w.enqueue({"seq": seq, "t": (base + seq)[:, 0]}, timeout=30)
        except BaseException as e:  # pragma: no cover - reported below
            errors.append(e)

    if arena:  # a blob would carry it without the socket: keep the arena from taking it
        w._end.blob_max = 0
    th = threading.Thread(target=send, daemon=True)
    th.start()
    try:
        assert sent_marker.wait(20)
        with pytest.raises(TimeoutError):
            r.dequeue(timeout=0.3)
        release.set()
        got = [r.dequeue(timeout=20) for _ in range(3)]
        assert [m["seq"] for m in got] == [1, 2, 3]
        for m in got:
            assert torch.equal(m["t"], base[:, 0] + m["seq"])
        th.join(20)
        assert not errors, errors
    finally:
        release.set()
        hook.__exit__(None, None, None)
        _close(w, r)


# ------------------------------------------------------------------ threads
def test_two_threads_dequeuing_one_reader_neither_lose_nor_duplicate(seed):
    print(f"seed={seed}")
    n = 1500
    w, (r,) = _pair(chunk=64 << 10, chunks=8)
    got: list[int] = []
    lock = threading.Lock()
    errors = []

    def consume():
        try:
            while True:
                m = r.dequeue(timeout=30)
                if m is None:
                    return
                with lock:
                    got.append(m)
        except BaseException as e:
            errors.append(e)

    ths = [threading.Thread(target=consume, daemon=True) for _ in range(2)]
    for t in ths:
        t.start()
    rng = random.Random(seed)
    try:
        for i in range(n):
            w.enqueue(i if rng.random() < 0.9 else (i, b"x" * (100 << 10)), timeout=30)
        w.enqueue(None, timeout=30)
        w.enqueue(None, timeout=30)
        for t in ths:
            t.join(60)
        assert not errors, errors
        seqs = sorted(m if isinstance(m, int) else m[0] for m in got)
        assert seqs == list(range(n)), (len(seqs), len(set(seqs)))
    finally:
        _close(w, r)


def test_two_threads_enqueuing_deliver_every_message_once(seed):
    print(f"seed={seed}")
    per_thread = 600
    w, (r,) = _pair(chunk=64 << 10, chunks=4)
    errors = []

    def produce(tag):
        rng = random.Random(seed + tag)
        try:
            for i in range(per_thread):
                big = rng.random() < 0.1
                w.enqueue((tag, i, b"y" * (100 << 10) if big else b""), timeout=30)
        except BaseException as e:
            errors.append(e)

    ths = [threading.Thread(target=produce, args=(k,), daemon=True) for k in range(2)]
    for t in ths:
        t.start()
    try:
        got = [r.dequeue(timeout=30) for _ in range(2 * per_thread)]
        for t in ths:
            t.join(30)
        assert not errors, errors
        for tag in range(2):
            mine = [m[1] for m in got if m[0] == tag]
            assert mine == list(range(per_thread))  # each thread's messages once, in order
        with pytest.raises(TimeoutError):
            r.dequeue(timeout=0.2)  # nothing extra
    finally:
        _close(w, r)


def test_a_timeout_is_honoured_while_another_thread_holds_the_queue():
    w, (r,) = _pair(chunk=64 << 10, chunks=1)
    try:
        w.enqueue(1)  # the one chunk is full until the reader reads
        holder = threading.Thread(target=lambda: w.enqueue(2, timeout=3), daemon=True)
        holder.start()
        wait_until(lambda: inside_a_call(w), 10, "the other thread's enqueue to start")
        t0 = time.monotonic()
        with pytest.raises(TimeoutError):
            w.enqueue(3, timeout=0.3)
        assert time.monotonic() - t0 < 2.5  # not behind the other thread's 3 s wait
        assert r.dequeue(timeout=5) == 1  # frees the chunk the other thread waits for
        holder.join(10)
        assert r.dequeue(timeout=5) == 2
    finally:
        _close(w, r)


# ------------------------------------------------------------------ once sent, never taken back
def test_an_exception_right_after_the_ring_published_never_frees_the_message():
    """KeyboardInterrupt fires right after the ring published the message (as a signal
    handler's exception would): the message is sent, so its arena tensor must stay valid and
    the next message must not be copied over it (before: all of it overwritten, then 'stale
    stub' for the reader)."""
    w, (r,) = _pair(arena=True, chunk=1 * MiB, chunks=4)
    real_ring = w._end.ring
    fired = []

    def interrupt_once(real, *a, **kw):
        out = real(*a, **kw)
        if not fired:
            fired.append(out)
            raise KeyboardInterrupt
        return out

    t1 = torch.full((512 << 10,), 7, dtype=torch.int32)  # 2 MiB: into the arena
    try:
        w._end.ring = _Proxy(real_ring, "write", interrupt_once)
        with pytest.raises(KeyboardInterrupt) as ei:
            w.enqueue({"t": t1}, timeout=10)
        assert "was sent" in "".join(getattr(ei.value, "__notes__", []))
        w._end.ring = real_ring
        m1 = r.dequeue(timeout=10)
        assert torch.equal(m1["t"], t1)
        w.enqueue({"t": torch.full((512 << 10,), 9, dtype=torch.int32)}, timeout=10)
        m2 = r.dequeue(timeout=10)
        assert int(m2["t"][0]) == 9
        assert torch.equal(m1["t"], t1), "the next message was written over a held tensor"
        assert w.stats()["arena"]["aborted"] == 0
    finally:
        w._end.ring = real_ring
        _close(w, r)


def test_an_exception_before_anything_was_sent_gives_the_slots_back():
    w, (r,) = _pair(arena=True, chunk=1 * MiB, chunks=4)
    real_ring = w._end.ring

    def interrupt(real, *a, **kw):
        raise KeyboardInterrupt

    try:
        w._end.ring = _Proxy(real_ring, "reserve", interrupt)
        with pytest.raises(KeyboardInterrupt):
            w.enqueue({"t": torch.ones(512 << 10, dtype=torch.int32)}, timeout=10)
        w._end.ring = real_ring
        assert w.stats()["arena"]["aborted"] == 1
        w.enqueue("next", timeout=10)
        assert r.dequeue(timeout=10) == "next"  # nothing half-sent in between
    finally:
        w._end.ring = real_ring
        _close(w, r)


def test_an_interrupted_multipart_send_breaks_the_queue_instead_of_corrupting_it(
    socket_overflow,
):
    w, (r,) = _pair(arena=False, chunk=64 << 10, chunks=4)
    calls = []

    def interrupt_second_frame(real, *a):
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return real(*a)

    try:
        with _hook_send(w.local_socket, interrupt_second_frame):
            with pytest.raises(KeyboardInterrupt):
                w.enqueue((b"z" * (200 << 10), torch.ones(64 << 10)), timeout=10)
        with pytest.raises(RuntimeError, match="broken"):
            w.enqueue("next", timeout=1)
        with pytest.raises(RuntimeError):  # a clear error, never a message made of two halves
            r.dequeue(timeout=10)
    finally:
        _close(w, r)


def test_a_broken_queue_lends_no_arena_memory():
    w, (r,) = _pair(arena=True)
    try:
        w._end.break_off("test")
        with pytest.raises(RuntimeError, match="broken"):
            w.empty((1024,), torch.float32)
    finally:
        _close(w, r)


# ------------------------------------------------------------------ a slow reader
@pytest.mark.parametrize("arena", [False, True], ids=["socket", "arena"])
def test_a_slow_reader_never_breaks_the_queue(arena, seed):
    """A reader that takes its time, a writer that enqueues with a short timeout and retries
    on TimeoutError, a ring of 4 x 1 MiB chunks, one message in seven a 2 MiB non-contiguous
    tensor (too big for a chunk): every message arrives once, in order, and the queue never
    breaks (before: broken for good under load)."""
    print(f"seed={seed}")
    n = 42
    w, (r,) = _pair(arena=arena, chunk=1 * MiB, chunks=4)
    base = torch.arange(1 * MiB, dtype=torch.int32).reshape(-1, 2)  # [:, 0] is 2 MiB, strided
    got = []
    errors = []

    def slow_reader():
        try:
            for _ in range(n):
                m = r.dequeue(timeout=60)
                time.sleep(0.03)
                got.append(m)
        except BaseException as e:
            errors.append(e)

    th = threading.Thread(target=slow_reader, daemon=True)
    th.start()
    retries = 0
    try:
        for seq in range(n):
            msg = {"seq": seq, "t": (base + seq)[:, 0] if seq % 7 == 3 else seq}
            while True:
                try:
                    w.enqueue(msg, timeout=0.01)
                    break
                except TimeoutError:
                    retries += 1
        th.join(120)
        assert not errors, errors
        assert [m["seq"] for m in got] == list(range(n))
        for m in got:
            if isinstance(m["t"], torch.Tensor):
                assert torch.equal(m["t"], base[:, 0] + m["seq"])
        assert retries > 0  # the reader was slow enough to make the writer wait
        if arena:
            assert w.stats()["blob_messages"] == sum(1 for s in range(n) if s % 7 == 3)
    finally:
        _close(w, r)


def test_enqueue_never_aliases_the_callers_memory_after_it_returns():
    """A remote (TCP) reader gets what was sent, whatever the caller writes into its tensor
    after enqueue returned."""
    w = MessageQueue(1, 0, max_chunk_bytes=1 * MiB, max_chunks=4, connect_ip="127.0.0.1")
    r = MessageQueue.create_from_handle(w.export_handle(), 0)
    ready_in_threads(w, [r])
    try:
        t = torch.zeros(4 * MiB, dtype=torch.uint8)
        w.enqueue(t, timeout=10)
        t.fill_(1)
        assert int(r.dequeue(timeout=10).sum()) == 0
    finally:
        _close(w, r)


# ------------------------------------------------------------------ deterministic shutdown
@pytest.mark.parametrize("arena", [False, True], ids=["no-arena", "arena"])
def test_shutdown_and_del_free_the_queue_without_a_garbage_collection(arena):
    w, (r,) = _pair(arena=arena)
    was = gc.isenabled()
    gc.disable()
    try:
        for i in range(3):  # reports owed: the one-shot timer is armed
            w.enqueue({"i": i, "t": torch.ones(512 << 10)}, timeout=10)
            r.dequeue(timeout=10)
        refs = [weakref.ref(w), weakref.ref(r)]
        arena_ref = weakref.ref(r.arena) if arena else None
        w.shutdown()
        r.shutdown()
        del w, r
        assert [x() for x in refs] == [None, None]
        if arena:
            assert arena_ref() is None
    finally:
        if was:
            gc.enable()


def test_a_stub_resolved_after_its_readers_queue_shut_down_raises_clearly():
    import pickle

    from vllm_shm_arena import arena as arena_mod

    w, (r,) = _pair(arena=True)
    try:
        w.enqueue(torch.ones(512 << 10), timeout=10)
        frames = None
        status, _flags, frames = r._end.ring.read(10.0)
        assert status == "ok"
        reader_arena = r.arena
        r.shutdown()
        with arena_mod.resolving_stubs(reader_arena):
            with pytest.raises(RuntimeError, match="closed|not attached"):
                pickle.loads(frames[1], buffers=frames[2:])
    finally:
        _close(w)


def test_no_thread_left_behind_after_shutdown():
    before = {t.ident for t in threading.enumerate()}
    w, (r,) = _pair(arena=True)
    for i in range(3):
        w.enqueue(i, timeout=10)
        r.dequeue(timeout=10)
    w.shutdown()
    r.shutdown()
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        extra = [t for t in threading.enumerate() if t.ident not in before and t.is_alive()]
        if not extra:
            break
        time.sleep(0.05)
    assert not extra, extra
    assert os.getpid()  # the process is fine


# ------------------------------------------------------------------ the local channel
_SQUATTER = """
import os, pickle, sys, time, zmq
sock_dir, marker = sys.argv[1], sys.argv[2]
class Evil:
    def __reduce__(self):
        return (open, (marker, "w"))
try:
    os.mkdir(sock_dir, 0o777)
except OSError as e:
    print("BLOCKED", type(e).__name__, flush=True)
    sys.exit(0)
ctx = zmq.Context()
s = ctx.socket(zmq.XPUB)
s.setsockopt(zmq.LINGER, 0)
s.bind("ipc://" + sock_dir + "/s")
print("BOUND", flush=True)
end = time.monotonic() + 8
while time.monotonic() < end:
    for head in (b"", os.urandom(24), os.urandom(40)):  # each shape a sealed head may have
        s.send_multipart([head, pickle.dumps(Evil())])
    time.sleep(0.05)
"""


@pytest.mark.skipif(os.geteuid() != 0, reason="setpriv --reuid needs CAP_SETUID (run as root)")
def test_a_reader_never_takes_a_message_from_another_user_after_its_connection_drops(
    tmp_path, monkeypatch
):
    """After ready, another uid takes the local socket's name in a world-writable shm
    directory (the queue removed its directory once its readers were in, so that a SIGKILL
    leaves nothing); then the reader's connection drops while it waits for an overflow message,
    and ZeroMQ reconnects it to the squatter. The reader must get a clear error, never the other
    user's pickle: every frame it takes from a socket must carry its writer's MAC."""
    import subprocess
    import sys
    import tempfile

    shm = tempfile.mkdtemp(
        prefix="vsa-squat-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None
    )
    os.chmod(shm, 0o1777)
    marker = os.path.join(shm, "pwned")
    monkeypatch.setenv("VLLM_SHM_ARENA_SHM_DIR", shm)
    w, (r,) = _pair(chunk=64 << 10)
    sock_dir = os.path.dirname(w.export_handle().local_subscribe_addr.removeprefix("ipc://"))
    squatter = subprocess.Popen(
        ["setpriv", "--reuid", "65534", "--regid", "65534", "--clear-groups"]
        + [sys.executable, "-c", _SQUATTER, sock_dir, marker],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        line = squatter.stdout.readline().strip()
        assert line, squatter.stderr.read()
        # The queue announces an overflow message, then its socket goes away.
        from vllm_shm_arena._ext import _C

        w._end.ring.write_marker(_C.RING_FLAG_OVERFLOW, 5.0)
        w.local_socket.close(linger=0)
        with pytest.raises(RuntimeError, match="connection|shut down|did not come from its"):
            r.dequeue(timeout=5)
        assert not os.path.exists(marker), "the reader unpickled another user's message"
        assert line.startswith(("BOUND", "BLOCKED")), line
    finally:
        squatter.kill()
        squatter.wait(10)
        _close(w, r)
        import shutil

        shutil.rmtree(shm, ignore_errors=True)


@pytest.mark.parametrize("where", ["local", "remote"])
def test_a_socket_message_not_sealed_with_the_readers_secret_is_never_unpickled(
    where, tmp_path, socket_overflow
):
    """Whatever answers at the queue's socket address is not the writer unless it seals its
    frames with the handle's secret: a reader joined with another secret (what an impostor
    has) gets a clear error and unpickles nothing. On the remote socket the writer already
    refuses such a subscriber at the handshake (its credentials derive from the secret); the
    reader's own check across a port taken over is mq/test_relay.py's."""
    import dataclasses

    marker = tmp_path / "ran"
    if where == "local":
        w = MessageQueue(1, 1, max_chunk_bytes=64 << 10, max_chunks=4)
    else:
        w = MessageQueue(1, 0, connect_ip="127.0.0.1")
    h = dataclasses.replace(w.export_handle(), secret=b"\0" * 32)
    r = MessageQueue.create_from_handle(h, 0)
    if where == "remote":
        try:
            with pytest.raises(TimeoutError, match="wrong credentials"):
                w.wait_until_ready(timeout=3)
            assert w.stats()["tcp_refused"] >= 1
        finally:
            _close(w, r)
        return
    t = threading.Thread(target=w.wait_until_ready, args=(10,), daemon=True)
    t.start()
    with pytest.raises(RuntimeError, match="a READY .*did not come from its writer"):
        r.wait_until_ready(timeout=10)
    t.join(10)
    try:
        w.enqueue((open, str(marker)), timeout=10)  # a message the impostor's reader unpacks
        w.enqueue(b"x" * (200 << 10), timeout=10)
        with pytest.raises(RuntimeError, match="did not come from its writer"):
            r.dequeue(timeout=10)
            r.dequeue(timeout=10)
        assert not marker.exists()
    finally:
        _close(w, r)
