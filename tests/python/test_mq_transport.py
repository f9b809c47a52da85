"""mq/transport.py on its own: a writer's sockets and readers' sockets, with no ring and no
queue. The handshake (exact subscriber count, the local socket's name removed once they are
in), the token on every message, the writer's last frame, the waits' timeouts, and what a
reader does when the ring it is told about says the writer is gone."""

from __future__ import annotations

import os
import stat
import threading
import time

import pytest

from vllm_shm_arena.mq import transport
from vllm_shm_arena.mq.lifecycle import Lifecycle
from vllm_shm_arena.mq.protocol import WriterDiedError
from vllm_shm_arena.mq.reporting import RateLimitedLog
from vllm_shm_arena.mq.transport import ReaderSocket, Roster, WriterSockets

TOKEN = b"t" * 16


class Owner:
    """Stands in for the end a Lifecycle belongs to."""

    def __init__(self):
        self.lifecycle = Lifecycle(self)


class Sending:
    def __init__(self):
        self.sent = {}


@pytest.fixture
def ends():
    """``ends(n_local, n_remote, token=TOKEN)`` -> (writer sockets, [reader sockets]); all
    closed at teardown."""
    made = []

    def make(n_local=0, n_remote=1, token=TOKEN, reader_tokens=None):
        wo = Owner()
        w = WriterSockets(wo.lifecycle, TOKEN, RateLimitedLog())
        local = w.bind_local(os.environ["VLLM_SHM_ARENA_SHM_DIR"]) if n_local else None
        remote = w.bind_remote("127.0.0.1") if n_remote else None
        rs = []
        for i in range(n_local + n_remote):
            ro = Owner()
            tok = (reader_tokens or {}).get(i, token)
            addr, is_local = (local, True) if i < n_local else (remote, False)
            declare = None if is_local else [i - n_local]
            rs.append(ReaderSocket(ro.lifecycle, tok, addr, is_local, declare=declare))
            made.append(ro)
        made.append(wo)
        return w, rs

    yield make
    for o in made:
        o.lifecycle.resources.release()


def handshake(w, rs, n_local, n_remote, writer_dead=lambda: False):
    errors = []

    def run(r):
        try:
            r.await_ready(time.monotonic() + 20, writer_dead)
        except BaseException as e:
            errors.append(e)

    ths = [threading.Thread(target=run, args=(r,), daemon=True) for r in rs]
    for t in ths:
        t.start()
    w.await_subscribers(n_local, Roster(n_remote), time.monotonic() + 20)
    for t in ths:
        t.join(20)
    assert not errors, errors


def test_a_message_reaches_every_reader_with_the_token_removed(ends):
    w, rs = ends(n_local=0, n_remote=2)
    handshake(w, rs, 0, 2)
    frames = [b"records", b"pickle", bytearray(b"buffer")]
    sending = Sending()
    w.send(w.remote, frames, None, sending, may_wait=True)
    assert sending.sent == {id(w.remote): 3}
    for r in rs:
        got = r.recv(time.monotonic() + 10)
        assert [bytes(f) for f in got] == [b"records", b"pickle", b"buffer"]


def test_the_local_socket_lives_in_a_private_directory_whose_name_goes_after_the_handshake(
    ends,
):
    w, rs = ends(n_local=1, n_remote=0)
    path = w.local.getsockopt_string(transport.zmq.LAST_ENDPOINT).removeprefix("ipc://")
    d = os.path.dirname(path)
    assert stat.S_IMODE(os.stat(d).st_mode) == 0o700
    assert os.path.exists(path)
    handshake(w, rs, 1, 0)
    assert not os.path.exists(path), "the socket's name is still there for others to connect"
    assert os.path.isdir(d), "the directory must stay, so its name is never free"
    w.send(w.local, [b"", b"p"], None, Sending(), may_wait=False)
    assert [bytes(f) for f in rs[0].recv(time.monotonic() + 10)] == [b"", b"p"]


def test_more_subscribers_than_expected_refuse_to_start(ends):
    w, rs = ends(n_local=0, n_remote=2)
    for r in rs:
        assert r.sock is not None
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and not w.remote.poll(100):
        pass
    time.sleep(0.3)  # both subscriptions queued
    with pytest.raises(RuntimeError, match="more than the 1 expected readers"):
        w.await_subscribers(0, Roster(1), time.monotonic() + 10)


def test_the_handshake_times_out_without_its_readers(ends):
    w, _ = ends(n_local=0, n_remote=0)
    w.remote = w._xpub(1)
    w.remote.bind_to_random_port("tcp://127.0.0.1")
    t0 = time.monotonic()
    with pytest.raises(TimeoutError, match="readers to subscribe"):
        w.await_subscribers(0, Roster(1), time.monotonic() + 0.3)
    assert time.monotonic() - t0 < 5


def test_a_subscriber_with_another_token_is_refused(ends):
    w, _ = ends(n_local=0, n_remote=1, reader_tokens={0: b"x" * 16})
    with pytest.raises(RuntimeError, match="wrong socket token"):
        w.await_subscribers(0, Roster(1), time.monotonic() + 10)


def test_a_reader_with_another_token_takes_nothing(ends):
    w, rs = ends(n_local=0, n_remote=1)
    handshake(w, rs, 0, 1)
    rs[0].token = b"x" * 16  # the writer's messages no longer carry this reader's token
    w.send(w.remote, [b"", b"evil pickle"], None, Sending(), may_wait=True)
    with pytest.raises(RuntimeError, match="did not come from its writer"):
        rs[0].recv(time.monotonic() + 10)
    assert rs[0].lost


def test_the_writers_last_frame_tells_readers_nothing_follows(ends):
    w, rs = ends(n_local=0, n_remote=1)
    handshake(w, rs, 0, 1)
    w.send(w.remote, [b"", b"last message"], None, Sending(), may_wait=True)
    w.close(drain_s=2.0)
    assert [bytes(f) for f in rs[0].recv(time.monotonic() + 10)][1] == b"last message"
    with pytest.raises(RuntimeError, match="shut down by the writer"):
        rs[0].recv(time.monotonic() + 10)


def test_a_reader_before_ready_sees_the_writers_shutdown(ends):
    w, rs = ends(n_local=0, n_remote=1)
    deadline = time.monotonic() + 10
    while not w.remote.poll(100) and time.monotonic() < deadline:
        pass
    w.remote.recv()  # the subscription, without READY
    w.close(drain_s=2.0)
    with pytest.raises(RuntimeError, match="shut down by the writer"):
        rs[0].await_ready(time.monotonic() + 10, lambda: False)


def test_a_reader_wait_times_out_and_stops_at_shutdown(ends):
    w, rs = ends(n_local=0, n_remote=1)
    handshake(w, rs, 0, 1)
    with pytest.raises(TimeoutError, match="on the socket"):
        rs[0].recv(time.monotonic() + 0.2)
    rs[0]._life.shutdown.set()
    with pytest.raises(RuntimeError, match="MessageQueue was shut down"):
        rs[0].recv(None)
    w._life.shutdown.set()
    with pytest.raises(RuntimeError, match="MessageQueue was shut down"):
        w.send(w.remote, [b"", b"x"], None, Sending(), may_wait=True)


class RingWatch:
    def __init__(self, dead=False, shut=False):
        self.dead, self.shut = dead, shut

    def writer_is_dead(self):
        return self.dead

    def shut_down(self):
        return self.shut


def test_a_message_announced_by_a_dead_writers_ring_is_a_writer_died_error(ends):
    w, rs = ends(n_local=1, n_remote=0)
    handshake(w, rs, 1, 0)
    with pytest.raises(WriterDiedError, match="announced a message it never sent"):
        rs[0].recv(time.monotonic() + 10, ring=RingWatch(dead=True))


def test_what_a_dead_writer_sent_before_is_still_delivered(ends):
    w, rs = ends(n_local=1, n_remote=0)
    handshake(w, rs, 1, 0)
    w.send(w.local, [b"", b"sent before it died"], None, Sending(), may_wait=False)
    time.sleep(0.3)
    got = rs[0].recv(time.monotonic() + 10, ring=RingWatch(dead=True))
    assert bytes(got[1]) == b"sent before it died"


def test_a_message_the_writer_shut_down_without_sending_is_given_up_after_the_grace(
    ends, monkeypatch
):
    monkeypatch.setattr(transport, "SHUTDOWN_GRACE_S", 0.3)
    w, rs = ends(n_local=1, n_remote=0)
    handshake(w, rs, 1, 0)
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match="before it sent the message its ring announced"):
        rs[0].recv(time.monotonic() + 20, ring=RingWatch(shut=True))
    assert 0.3 <= time.monotonic() - t0 < 10


def test_a_dropped_local_connection_is_an_error_once_what_came_before_is_read(ends):
    w, rs = ends(n_local=1, n_remote=0)
    handshake(w, rs, 1, 0)
    w.send(w.local, [b"", b"before the drop"], None, Sending(), may_wait=False)
    time.sleep(0.3)
    w.local.close(linger=0)
    got = rs[0].recv(time.monotonic() + 10, ring=RingWatch())
    assert bytes(got[1]) == b"before the drop"
    with pytest.raises(RuntimeError, match="connection to the writer's local socket dropped"):
        rs[0].recv(time.monotonic() + 10, ring=RingWatch())
    assert rs[0].lost


def test_remote_readers_connect_to_vllm_host_ip_when_no_address_is_given(monkeypatch):
    monkeypatch.setenv("VLLM_HOST_IP", "10.1.2.3")
    assert transport.local_ip() == "10.1.2.3"
    monkeypatch.setenv("VLLM_HOST_IP", "")
    assert isinstance(transport.local_ip(), str) and transport.local_ip()
