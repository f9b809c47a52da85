"""mq/transport.py on its own: a writer's sockets and readers' sockets, with no ring and no
queue. The handshake (exact subscriber count, the local socket's name and directory removed
once they are in), sealed frames on every message, the writer's last frame, the waits'
timeouts, and what a reader does when the ring it is told about says the writer is gone.
Who may connect (ZAP) and what a stranger can do is mq/test_admission.py's."""

from __future__ import annotations

import os
import secrets
import stat
import threading
import time

import pytest

from vllm_shm_arena._ext import _C
from vllm_shm_arena.mq import protocol, transport
from vllm_shm_arena.mq.admission import Roster
from vllm_shm_arena.mq.lifecycle import Lifecycle
from vllm_shm_arena.mq.protocol import Forged, Keys, ShutDownByWriter, WriterDiedError
from vllm_shm_arena.mq.reporting import RateLimitedLog
from vllm_shm_arena.mq.transport import ReaderSocket, WriterSockets

KEYS = Keys(b"k" * protocol.SECRET_BYTES)


class Owner:
    """Stands in for the end a Lifecycle belongs to."""

    def __init__(self):
        self.lifecycle = Lifecycle(self)


class Sending:
    def __init__(self):
        self.sent = {}


@pytest.fixture
def ends():
    """``ends(n_local, n_remote, reader_keys={i: Keys})`` -> (writer sockets, [reader
    sockets]); all closed at teardown."""
    made = []

    def make(n_local=0, n_remote=1, reader_keys=None, expect_remote=None):
        wo = Owner()
        w = WriterSockets(wo.lifecycle, KEYS, RateLimitedLog())
        local = w.bind_local(os.environ["VLLM_SHM_ARENA_SHM_DIR"]) if n_local else None
        n = n_remote if expect_remote is None else expect_remote
        remote = w.bind_remote("127.0.0.1", Roster(n), "authenticated") if n else None
        rs = []
        for i in range(n_local + n_remote):
            ro = Owner()
            keys = (reader_keys or {}).get(i, KEYS)
            addr, is_local = (local, True) if i < n_local else (remote, False)
            declare = None if is_local else [i - n_local]
            rs.append(ReaderSocket(ro.lifecycle, keys, addr, is_local, declare=declare))
            made.append(ro)
        made.append(wo)
        return w, rs

    yield make
    for o in made:
        o.lifecycle.resources.release()


def handshake(w, rs, n_local, writer_dead=lambda: False):
    errors = []

    def run(r):
        try:
            r.await_ready(time.monotonic() + 20, writer_dead)
        except BaseException as e:
            errors.append(e)

    ths = [threading.Thread(target=run, args=(r,), daemon=True) for r in rs]
    for t in ths:
        t.start()
    w.await_subscribers(n_local, time.monotonic() + 20)
    for t in ths:
        t.join(20)
    assert not errors, errors


def sealed(seq, frames, keys=KEYS):
    return [protocol.seal(keys.mac_key, seq, frames), *frames[1:]]


def recv(r, deadline, ring=None):
    """A reader's next message -> (sequence number, frames without the sealed head)."""
    box = {}
    r.receive(deadline, lambda f, args: _C.call_store(box, "m", f, args), ring=ring)
    return r.open(box["m"])


def test_a_sealed_message_reaches_every_reader_with_its_sequence_number(ends):
    w, rs = ends(n_local=0, n_remote=2)
    handshake(w, rs, 0)
    frames = [b"records", b"pickle", bytearray(b"buffer")]
    sending = Sending()
    w.send(w.remote, sealed(7, frames), None, sending, may_wait=True)
    assert sending.sent == {id(w.remote): [3]}
    for r in rs:
        seq, got = recv(r, time.monotonic() + 10)
        assert seq == 7 and [bytes(f) for f in got] == [b"records", b"pickle", b"buffer"]


def test_the_local_socket_lives_in_a_private_directory_that_goes_after_the_handshake(ends):
    w, rs = ends(n_local=1, n_remote=0)
    path = w.local.getsockopt_string(transport.zmq.LAST_ENDPOINT).removeprefix("ipc://")
    d = os.path.dirname(path)
    assert stat.S_IMODE(os.stat(d).st_mode) == 0o700
    assert os.path.exists(path)
    handshake(w, rs, 1)
    # Hole 12: nothing is left for a SIGKILL to strand (whoever takes the name later cannot
    # seal a frame).
    assert not os.path.exists(path), "the socket's name is still there for others to connect"
    assert not os.path.exists(d), "the directory is still there after the handshake"
    w.send(w.local, sealed(1, [b"", b"p"]), None, Sending(), may_wait=False)
    seq, got = recv(rs[0], time.monotonic() + 10)
    assert seq == 1 and [bytes(f) for f in got] == [b"", b"p"]


def test_more_local_subscribers_than_expected_refuse_to_start(ends):
    # One subscriber more than expected: a reader subscribed where none was expected. (With
    # two readers and one expected, nothing observable says when the second subscription is
    # queued behind the first, so the test could not know what the writer will see.)
    w, rs = ends(n_local=1, n_remote=0)
    assert w.local.poll(10_000), "the reader's subscription never arrived"
    with pytest.raises(RuntimeError, match="more than the 0 expected readers"):
        w.await_subscribers(0, time.monotonic() + 10)


def test_the_handshake_times_out_without_its_readers(ends):
    w, _ = ends(n_local=0, n_remote=0, expect_remote=1)
    t0 = time.monotonic()
    with pytest.raises(TimeoutError, match=r"readers to subscribe \(1 of 1 ranks undeclared"):
        w.await_subscribers(0, time.monotonic() + 0.3)
    assert time.monotonic() - t0 < 5


def test_a_subscriber_with_another_secret_is_refused_at_the_handshake(ends):
    w, _ = ends(n_local=0, n_remote=1, reader_keys={0: Keys(secrets.token_bytes(32))})
    with pytest.raises(TimeoutError, match="wrong credentials"):
        w.await_subscribers(0, time.monotonic() + 2)
    assert w.refused() >= 1


def test_a_reader_with_another_secret_takes_nothing(ends):
    w, rs = ends(n_local=1, n_remote=0)
    handshake(w, rs, 1)
    rs[0].mac_key = Keys(secrets.token_bytes(32)).mac_key  # what an impostor's frames look like
    w.send(w.local, sealed(1, [b"", b"evil pickle"]), None, Sending(), may_wait=False)
    with pytest.raises(Forged, match="did not come from its writer"):
        recv(rs[0], time.monotonic() + 10)


@pytest.mark.parametrize(
    "frames",
    [
        [b"", b"pickle"],  # too short to be sealed
        [bytes(24), b"pickle"],  # a zero MAC
        [b"VSA-READY", b"x"],
    ],
    ids=["short", "zero-mac", "two-frame-ready"],
)
def test_a_frame_of_any_shape_without_the_writers_mac_is_forged(frames):
    r = ReaderSocket.__new__(ReaderSocket)  # open() needs only the key
    r.mac_key = KEYS.mac_key
    with pytest.raises(Forged):
        r.open([transport.zmq.Frame(f) for f in frames])


def test_ready_and_the_last_frame_are_sealed_too():
    key = KEYS.mac_key
    assert protocol.control_frame(key, protocol.ready_frame(key)) == ("ready", 0)
    assert protocol.control_frame(key, protocol.shutdown_frame(key, 41)) == ("shutdown", 41)
    forged_last = protocol.shutdown_frame(Keys(b"x" * 32).mac_key, 41)
    for bad in (b"READY", protocol.READY_FRAME, forged_last, protocol.SHUTDOWN_FRAME + bytes(24)):
        with pytest.raises(Forged):
            protocol.control_frame(key, bad)


def test_the_writers_last_frame_tells_readers_nothing_follows_and_what_it_sent(ends):
    w, rs = ends(n_local=0, n_remote=1)
    handshake(w, rs, 0)
    w.send(w.remote, sealed(1, [b"", b"last message"]), None, Sending(), may_wait=True)
    w.close(drain_s=2.0, last_seq=1)
    seq, got = recv(rs[0], time.monotonic() + 10)
    assert seq == 1 and bytes(got[1]) == b"last message"
    with pytest.raises(ShutDownByWriter, match="shut down by the writer") as ei:
        recv(rs[0], time.monotonic() + 10)
    assert ei.value.last_seq == 1


def test_a_reader_before_ready_sees_the_writers_shutdown(ends):
    w, rs = ends(n_local=1, n_remote=0)
    deadline = time.monotonic() + 10
    while not w.local.poll(100) and time.monotonic() < deadline:
        pass
    w.local.recv()  # the subscription, without READY
    w.close(drain_s=2.0, last_seq=0)
    with pytest.raises(RuntimeError, match="shut down by the writer"):
        rs[0].await_ready(time.monotonic() + 10, lambda: False)


def test_a_reader_wait_times_out_and_stops_at_shutdown(ends):
    w, rs = ends(n_local=0, n_remote=1)
    handshake(w, rs, 0)
    with pytest.raises(TimeoutError, match="on the socket"):
        recv(rs[0], time.monotonic() + 0.2)
    rs[0]._life.shutdown.set()
    with pytest.raises(RuntimeError, match="MessageQueue was shut down"):
        recv(rs[0], None)
    w._life.shutdown.set()
    with pytest.raises(RuntimeError, match="MessageQueue was shut down"):
        w.send(w.remote, sealed(1, [b"", b"x"]), None, Sending(), may_wait=True)


class RingWatch:
    def __init__(self, dead=False, shut=False):
        self.dead, self.shut = dead, shut

    def writer_is_dead(self):
        return self.dead

    def shut_down(self):
        return self.shut


def _wait_readable(r, timeout=10.0):
    deadline = time.monotonic() + timeout
    while not r.sock.poll(10):
        assert time.monotonic() < deadline, "the frame never arrived"


def test_a_message_announced_by_a_dead_writers_ring_is_a_writer_died_error(ends):
    w, rs = ends(n_local=1, n_remote=0)
    handshake(w, rs, 1)
    with pytest.raises(WriterDiedError, match="announced a message it never sent"):
        recv(rs[0], time.monotonic() + 10, ring=RingWatch(dead=True))


def test_what_a_dead_writer_sent_before_is_still_delivered(ends):
    w, rs = ends(n_local=1, n_remote=0)
    handshake(w, rs, 1)
    w.send(w.local, sealed(1, [b"", b"sent before it died"]), None, Sending(), may_wait=False)
    _wait_readable(rs[0])
    _, got = recv(rs[0], time.monotonic() + 10, ring=RingWatch(dead=True))
    assert bytes(got[1]) == b"sent before it died"


def test_a_message_the_writer_shut_down_without_sending_is_given_up_after_the_grace(
    ends, monkeypatch
):
    monkeypatch.setattr(transport, "SHUTDOWN_GRACE_S", 0.3)
    w, rs = ends(n_local=1, n_remote=0)
    handshake(w, rs, 1)
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match="before it sent the message its ring announced"):
        recv(rs[0], time.monotonic() + 20, ring=RingWatch(shut=True))
    assert 0.3 <= time.monotonic() - t0 < 10


def test_a_dropped_local_connection_is_an_error_once_what_came_before_is_read(ends):
    w, rs = ends(n_local=1, n_remote=0)
    handshake(w, rs, 1)
    w.send(w.local, sealed(1, [b"", b"before the drop"]), None, Sending(), may_wait=False)
    _wait_readable(rs[0])
    w.local.close(linger=0)
    _, got = recv(rs[0], time.monotonic() + 10, ring=RingWatch())
    assert bytes(got[1]) == b"before the drop"
    with pytest.raises(RuntimeError, match="connection to the writer's local socket dropped"):
        recv(rs[0], time.monotonic() + 10, ring=RingWatch())
    assert rs[0].lost


def test_remote_readers_connect_to_vllm_host_ip_when_no_address_is_given(monkeypatch):
    monkeypatch.setenv("VLLM_HOST_IP", "10.1.2.3")
    assert transport.local_ip() == "10.1.2.3"
    monkeypatch.setenv("VLLM_HOST_IP", "")
    assert isinstance(transport.local_ip(), str) and transport.local_ip()


def test_a_large_send_wakes_the_io_thread_off_the_senders_cpu_then_gives_its_cpus_back(
    ends, monkeypatch
):
    """The writer's ZeroMQ I/O thread (found by its context's thread names after the
    handshake) has the sending thread's CPU taken out of its mask while a send of
    PLACED_SEND_BYTES or more runs, and its whole mask back once the send returns; a small send
    leaves the mask alone (csrc/core/thread_placement.h)."""
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        pytest.skip("needs two CPUs")
    w, rs = ends(n_local=0, n_remote=1)
    handshake(w, rs, 0)
    io = _C.find_threads(f"{w.thread_prefix}/ZMQbg/IO/")
    assert len(io) == 1 and len(w.placement) == 1
    whole = os.sched_getaffinity(io[0])
    assert len(whole) >= 2
    seen = []
    send_frames = transport._send_frames

    def spy(*args):
        seen.append(os.sched_getaffinity(io[0]))
        return send_frames(*args)

    monkeypatch.setattr(transport, "_send_frames", spy)
    saved = os.sched_getaffinity(0)
    try:
        for seq, cpu in enumerate(cpus[:2], start=1):
            os.sched_setaffinity(0, {cpu})  # this thread only: its CPU is known
            big = bytearray(transport.PLACED_SEND_BYTES)
            w.send(w.remote, sealed(seq, [b"r", b"p", big]), None, Sending(), True, len(big))
            assert seen[-1] == whole - {cpu}
            assert os.sched_getaffinity(io[0]) == whole
            assert recv(rs[0], time.monotonic() + 10)[0] == seq
        w.send(w.remote, sealed(3, [b"r", b"p", b"small"]), None, Sending(), True, 7)
        assert seen[-1] == whole
    finally:
        os.sched_setaffinity(0, saved)
    assert w.placement.moves == 2
