"""Who gets in and what gets out of a queue's TCP socket, over loopback: strangers (no handle,
no secret) are refused at the ZeroMQ handshake and receive, stall, stop and bloat nothing;
whatever binds a dead writer's port feeds no reader; a TCP reset never loses a message in
silence; the encrypted setting; the keepalive limits. One test per hole the network issue
named (numbered as there); the two-node version with a third "stranger" namespace is
mq/test_relay_netns.py's.

Strangers here use pyzmq and plain sockets, as an attacker would; the queue's ends are in this
process (threads) unless a test kills the writer.
"""

from __future__ import annotations

import dataclasses
import os
import pickle
import socket
import subprocess
import sys
import threading
import time

import pytest
import torch
import zmq
from mq_helpers import reading_thread, ready_in_threads, squat, wait_until

from vllm_shm_arena import MessageQueue, settings
from vllm_shm_arena.mq import admission, protocol, transport
from vllm_shm_arena.mq.protocol import SequenceError

MiB = 1 << 20
LOOP = "127.0.0.1"


def _stranger_sub(addr, *topics, plain=None, curve=False):
    """A SUB socket subscribed to ``topics`` at ``addr``: NULL mechanism, or PLAIN with
    ``plain`` = (user, password), or CURVE with keys of its own."""
    ctx = zmq.Context()
    s = ctx.socket(zmq.SUB)
    s.setsockopt(zmq.LINGER, 0)
    if plain is not None:
        s.plain_username, s.plain_password = plain
    if curve:
        server_public = zmq.curve_keypair()[0]
        public, secret = zmq.curve_keypair()
        s.curve_serverkey, s.curve_publickey, s.curve_secretkey = server_public, public, secret
    for t in topics:
        s.setsockopt(zmq.SUBSCRIBE, t)
    s.connect(addr)
    return ctx, s


def _close(ctx, s):
    s.close(linger=0)
    ctx.term()


def _port(addr: str) -> int:
    return int(addr.rsplit(":", 1)[1])


def _refused_at_least(mq, n, timeout=10.0):
    deadline = time.monotonic() + timeout
    while mq.stats()["tcp_refused"] < n:
        assert time.monotonic() < deadline, mq.stats()["tcp_refused"]
        time.sleep(0.01)


def _rss_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


# ------------------------------------------------------------------ 1. strangers get nothing
def test_hole_1_a_stranger_gets_neither_ready_nor_any_message(writers, caplog):
    """A subscriber without credentials, before the real reader and after: before this issue
    it was counted, got READY, and then every broadcast with the queue's token in it."""
    mq = MessageQueue(1, 0, connect_ip=LOOP)
    writers(mq)
    h = mq.export_handle()
    strangers = [
        _stranger_sub(h.remote_subscribe_addr, b""),  # NULL mechanism
        _stranger_sub(h.remote_subscribe_addr, b"", plain=(b"0", b"guess")),  # a guessed password
        _stranger_sub(h.remote_subscribe_addr, b"", curve=True),  # another mechanism
    ]
    try:
        r = MessageQueue.create_from_handle(h, 0)
        writers(r)
        ready_in_threads(mq, [r])
        strangers.append(_stranger_sub(h.remote_subscribe_addr, b""))  # after ready
        for i in range(20):
            mq.enqueue({"i": i, "t": torch.full((MiB,), i, dtype=torch.uint8)})
        for i in range(20):
            assert r.dequeue(timeout=10)["i"] == i
        for _, s in strangers:
            assert not s.poll(300), "a stranger received a frame"
        _refused_at_least(mq, 4)
        assert "refused a peer of the queue's TCP socket from 127.0.0.1" in caplog.text
    finally:
        for ctx, s in strangers:
            _close(ctx, s)


# ------------------------------------------------------------------ 2. no code from a squatter
_DYING_WRITER = r"""
import os, pickle, signal, sys, time, base64
from vllm_shm_arena import MessageQueue
mq = MessageQueue(1, 0, connect_ip="127.0.0.1")
print(base64.b64encode(pickle.dumps(mq.export_handle())).decode(), flush=True)
mq.wait_until_ready(timeout=60)
mq.enqueue("before the death", timeout=30)
sys.stdin.readline()
os.kill(os.getpid(), signal.SIGKILL)
"""


class _Evil:
    """Unpickles into a file created at ``marker``."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


def _remote_pair(writers):
    """A writer with one remote reader over loopback, ready -> (writer, handle, reader)."""
    mq = MessageQueue(1, 0, connect_ip=LOOP)
    writers(mq)
    h = mq.export_handle()
    r = MessageQueue.create_from_handle(h, 0)
    writers(r)
    ready_in_threads(mq, [r])
    return mq, h, r


def test_hole_2_whatever_binds_a_dead_writers_port_runs_no_code_in_a_reader(tmp_path):
    """A stranger subscribes while the queue runs (capturing whatever it may: before this
    issue, every broadcast with the queue's token in it); the writer is SIGKILLed; the stranger
    binds its port and publishes pickles, replaying the captured header if it has one, as a
    PLAIN server otherwise. Before: ZeroMQ reconnected the reader, and its next dequeue
    unpickled the stranger's message. Now the reader raises a clear error and runs nothing."""
    import base64

    marker = str(tmp_path / "pwned")
    w = subprocess.Popen(
        [sys.executable, "-c", _DYING_WRITER],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    stop = threading.Event()
    try:
        h = pickle.loads(base64.b64decode(w.stdout.readline()))
        spy = _stranger_sub(h.remote_subscribe_addr, b"")
        r = MessageQueue.create_from_handle(h, 0)
        try:
            r.wait_until_ready(timeout=30)
            assert r.dequeue(timeout=30) == "before the death"
            captured = None
            if spy[1].poll(1000):
                frames = spy[1].recv_multipart()
                while len(frames) < 2 and spy[1].poll(1000):  # READY: the message comes next
                    frames = spy[1].recv_multipart()
                captured = frames[0] if len(frames) >= 2 else None
            _close(*spy)
            w.stdin.write("die\n")
            w.stdin.flush()
            w.wait(10)
            # With a captured header, replayed with no security, as that queue's readers
            # expect; without one, a PLAIN server (PLAIN authenticates the client only)
            # sending first frames shaped like the queue's.
            heads = [captured] if captured is not None else [b"", os.urandom(24), os.urandom(40)]
            ready = threading.Event()
            sq = threading.Thread(
                target=squat,
                args=(h.remote_subscribe_addr, pickle.dumps(_Evil(marker)), heads, stop),
                kwargs={"plain_server": captured is None, "ready": ready},
                daemon=True,
            )
            sq.start()
            assert ready.wait(15)
            with pytest.raises(RuntimeError, match="did not come from its writer|dropped"):
                r.dequeue(timeout=15)
            with pytest.raises((RuntimeError, TimeoutError)):  # nothing later either
                r.dequeue(timeout=1)
            assert not os.path.exists(marker), "a reader unpickled the squatter's message"
        finally:
            r.shutdown()
    finally:
        stop.set()
        w.kill()
        w.wait(10)


# ------------------------------------------------------------------ 3. no stall
def test_hole_3_a_stranger_that_never_reads_never_makes_enqueue_wait(writers):
    """Before: a stranger's subscription counted in the socket's back-pressure (XPUB_NODROP),
    so enqueue() without a timeout (vLLM's call) blocked after 64 messages."""
    mq = MessageQueue(1, 0, connect_ip=LOOP)
    writers(mq)
    h = mq.export_handle()
    stalls = [_stranger_sub(h.remote_subscribe_addr, b"") for _ in range(3)]
    try:
        for _, s in stalls:
            s.setsockopt(zmq.RCVHWM, 1)
        r = MessageQueue.create_from_handle(h, 0)
        writers(r)
        ready_in_threads(mq, [r])
        reader, got, errors = reading_thread(r, 300, key="i")
        done = threading.Event()

        def send():
            for i in range(300):
                mq.enqueue({"i": i, "t": torch.zeros(64 << 10, dtype=torch.uint8)})  # no timeout
            done.set()

        threading.Thread(target=send, daemon=True).start()
        assert done.wait(60), "enqueue waited on a stranger that never reads"
        reader.join(60)
        assert not errors and got == list(range(300))
    finally:
        for ctx, s in stalls:
            _close(ctx, s)


# ------------------------------------------------------------------ 4. junk never stops start-up
def test_hole_4_junk_before_and_during_start_up_never_stops_it(writers):
    """Before: a stranger's b"junk" subscription (or a wrong hello) made wait_until_ready
    raise, and the real readers timed out."""
    mq = MessageQueue(2, 0, connect_ip=LOOP)
    writers(mq)
    h = mq.export_handle()
    junk = [
        _stranger_sub(h.remote_subscribe_addr, b"junk"),
        # A hello-looking topic without credentials.
        _stranger_sub(
            h.remote_subscribe_addr, b"", protocol.HELLO_MAGIC + b"\x02\x01\x00" + bytes(4)
        ),
    ]
    raw = socket.create_connection((LOOP, _port(h.remote_subscribe_addr)))
    raw.sendall(os.urandom(4096))  # not even ZMTP
    try:
        r0 = MessageQueue.create_from_handle(h, 0)
        writers(r0)
        junk.append(_stranger_sub(h.remote_subscribe_addr, b"junk", plain=(b"1", b"x" * 64)))
        r1 = MessageQueue.create_from_handle(h, 1)
        writers(r1)
        ready_in_threads(mq, [r0, r1], timeout=30)
        mq.enqueue("after the junk", timeout=10)
        assert r0.dequeue(timeout=10) == r1.dequeue(timeout=10) == "after the junk"
        assert mq.stats()["tcp_refused"] >= 3
    finally:
        raw.close()
        for ctx, s in junk:
            _close(ctx, s)


# ------------------------------------------------------------------ 5. no bloat
def test_hole_5_a_subscription_flood_does_not_grow_the_writer(writers):
    """3.8 MiB of random subscription topics, from strangers and through a raw ZMTP-looking
    stream: before, the writer grew by ~190 MiB and held it while the peer stayed."""
    mq, h, r = _remote_pair(writers)
    mq.enqueue("warm", timeout=10)
    assert r.dequeue(timeout=10) == "warm"
    rss0 = _rss_bytes()
    # The strangers run in a process of their own: their own sockets' memory is not the
    # writer's.
    flood = subprocess.Popen(
        [sys.executable, "-c", _FLOOD, h.remote_subscribe_addr],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert flood.stdout.readline().strip() == "flooded"
        _refused_at_least(mq, 4)  # the writer has dealt with every stranger
        for i in range(40):  # and its socket reads whatever else it will meanwhile
            mq.enqueue(i, timeout=10)
            assert r.dequeue(timeout=10) == i
        grown = _rss_bytes() - rss0
        print(f"\nwriter process RSS growth under the flood: {grown / MiB:.1f} MiB")
        assert grown < 20 * MiB, f"the writer grew by {grown / MiB:.1f} MiB"
    finally:
        flood.kill()
        flood.wait(10)


_FLOOD = r"""
import os, socket, sys, time, zmq
addr = sys.argv[1]
host, port = addr[len("tcp://"):].rsplit(":", 1)
ctx = zmq.Context()
socks = []
for _ in range(4):  # 4 x 0.95 MiB of random 64-byte topics
    s = ctx.socket(zmq.SUB)
    s.setsockopt(zmq.LINGER, 0)
    s.setsockopt(zmq.SNDHWM, 0)  # every subscription goes out
    for _ in range((3_800_000 // 4) // 64):
        s.setsockopt(zmq.SUBSCRIBE, os.urandom(64))
    s.connect(addr)
    socks.append(s)
# One huge frame straight after a ZMTP 3.0 greeting: ZMQ_MAXMSGSIZE cuts it off.
raw = socket.create_connection((host, int(port)))
raw.sendall(b"\xff" + bytes(8) + b"\x7f" + b"\x03\x00" + b"NULL".ljust(20, b"\0") + bytes(32))
try:
    raw.sendall(b"\x06" + (64 << 20).to_bytes(8, "big") + os.urandom(1 << 20))
except OSError:
    pass
print("flooded", flush=True)
time.sleep(60)  # the connections stay until the test kills this process
"""


# ------------------------------------------------------------------ 6. no silent loss
def _ss_kill(port: int) -> None:
    """Kills the reader-side TCP sockets connected to ``port`` (as a reset would)."""
    out = subprocess.run(
        ["ss", "-K", "dst", LOOP, "dport", "=", str(port)], capture_output=True, text=True
    )
    assert out.returncode == 0, out.stderr


def _ss_available() -> bool:
    try:
        return subprocess.run(["ss", "-V"], capture_output=True).returncode == 0
    except OSError:
        return False


needs_ss_kill = pytest.mark.skipif(
    os.geteuid() != 0 or not _ss_available(), reason="ss -K needs root and iproute2"
)


@needs_ss_kill
def test_hole_6_a_reset_that_overlaps_sends_is_an_error_at_the_gap(writers):
    """The reader's TCP connection is reset while the writer keeps sending: before, the reader
    reconnected, the writer took it back, and the messages sent meanwhile were gone without a
    word while later ones arrived. Now every message before the gap is delivered, in order,
    then the dequeue raises an error naming both sequence numbers, and nothing after it."""
    mq, h, r = _remote_pair(writers)
    port = _port(h.remote_subscribe_addr)
    stop = threading.Event()
    sent = []

    killed = threading.Event()

    def send():
        # As fast as the reader's backlog cap lets it until the reset: the reader always has
        # messages waiting, so it never idles (nor looks at its connection) meanwhile. Then
        # one every 10 ms, as a step loop would: the writer's socket takes the reader back
        # as it sends, and what it sent while the reader was away is gone.
        i = 0
        while not stop.is_set() and i < 100_000:
            try:
                mq.enqueue(i, timeout=30)
            except RuntimeError:
                return  # shut down at teardown
            sent.append(i)
            i += 1
            if killed.is_set():
                time.sleep(0.01)

    t = threading.Thread(target=send, daemon=True)
    t.start()
    got = []
    try:
        for _ in range(50):
            got.append(r.dequeue(timeout=10))
        _ss_kill(port)
        killed.set()
        with pytest.raises(SequenceError, match=r"message \d+ arrived after message \d+") as ei:
            while True:
                m = r.dequeue(timeout=10)
                assert m == got[-1] + 1, f"messages {got[-1] + 1}..{m - 1} lost in silence"
                got.append(m)
        last = got[-1]
        assert got == list(range(last + 1)), "a message before the gap was lost or reordered"
        assert f"after message {last + 1}:" in str(ei.value)  # sequence numbers start at 1
        with pytest.raises(SequenceError):  # and it stays so: nothing past the gap
            r.dequeue(timeout=1)
    finally:
        stop.set()
        t.join(30)


@needs_ss_kill
def test_hole_6_a_reset_while_nothing_is_sent_is_resumed_without_loss(writers):
    """A reset between sends: ZeroMQ reconnects the reader (which waits in dequeue, so its
    socket does the reconnecting), the writer admits it again once its old connection is gone,
    and no message is missing, so none is reported missing."""
    mq, h, r = _remote_pair(writers)
    reader, got, errors = reading_thread(r, 10)
    for i in range(5):
        mq.enqueue(i, timeout=10)
    wait_until(lambda: len(got) >= 5 or errors, 10, "the first five messages")
    assert not errors, errors
    adm = mq._end.sockets.admission
    _ss_kill(_port(h.remote_subscribe_addr))

    def back():  # the writer admitted the reader again and took its hello
        with mq._end.sockets.io_lock:
            mq._end.sockets.read_subscriptions()
        with adm.lock:
            again = adm.admitted == 2 and 0 in adm.connected.values()
        return again and adm.roster.complete()

    wait_until(back, 20, "the reader to come back")
    for i in range(5, 10):
        mq.enqueue(i, timeout=10)
    reader.join(30)
    assert not errors and got == list(range(10)), (got, errors)


# ------------------------------------------------------------------ 7. keepalive in range
def test_hole_7_the_largest_timeout_gives_options_the_kernel_takes(monkeypatch, writers):
    """65536 s and up used to be accepted, and the kernel then refused the keepalive idle time:
    every connection failed in silence. Now that is a ValueError naming the variable
    (test_settings.py); the largest accepted value works end to end."""
    opts = dict(transport.keepalive_options(settings.MAX_TCP_TIMEOUT_S))
    assert opts[zmq.TCP_KEEPALIVE_IDLE] <= 32767  # MAX_TCP_KEEPIDLE
    assert opts[zmq.TCP_KEEPALIVE_INTVL] <= 32767  # MAX_TCP_KEEPINTVL
    assert 1 <= opts[zmq.TCP_KEEPALIVE_CNT] <= 127  # MAX_TCP_KEEPCNT
    monkeypatch.setenv("VLLM_SHM_ARENA_TCP_TIMEOUT_S", str(settings.MAX_TCP_TIMEOUT_S))
    mq = MessageQueue(1, 0, connect_ip=LOOP)
    writers(mq)
    r = MessageQueue.create_from_handle(mq.export_handle(), 0)
    writers(r)
    ready_in_threads(mq, [r])
    mq.enqueue("kept alive", timeout=10)
    assert r.dequeue(timeout=10) == "kept alive"
    monkeypatch.setenv("VLLM_SHM_ARENA_TCP_TIMEOUT_S", str(settings.MAX_TCP_TIMEOUT_S + 1))
    with pytest.raises(ValueError, match="VLLM_SHM_ARENA_TCP_TIMEOUT_S"):
        MessageQueue(1, 0, connect_ip=LOOP)


# ------------------------------------------------------------------ the encrypted setting
def test_the_encrypted_setting_carries_messages_and_refuses_other_keys(monkeypatch, writers):
    monkeypatch.setenv("VLLM_SHM_ARENA_TCP_SECURITY", "encrypted")
    mq = MessageQueue(3, 1, [0], connect_ip=LOOP, enable_shm_tensor_arena=True)
    writers(mq)
    h = mq.export_handle()
    assert h.tcp_security == "encrypted"
    monkeypatch.setenv("VLLM_SHM_ARENA_TCP_SECURITY", "authenticated")  # readers follow h
    stranger = _stranger_sub(h.remote_subscribe_addr, b"", curve=True)
    impostor = dataclasses.replace(h, secret=b"y" * 32)
    bad = MessageQueue.create_from_handle(impostor, 2)
    try:
        local = MessageQueue.create_from_handle(h, 0)
        relay = MessageQueue.create_relay(h, 1, [2])
        relayed = MessageQueue.create_from_handle(relay.downstream_handle, 1)
        for e in (local, relay, relayed):
            writers(e)
        ready_in_threads(mq, [local, relay, relayed], timeout=30)
        t = torch.arange(3 * MiB // 4, dtype=torch.int32)
        for i in range(3):
            mq.enqueue({"i": i, "t": t + i}, timeout=10)
        for q in (local, relay, relayed):
            for i in range(3):
                m = q.dequeue(timeout=10)
                assert m["i"] == i and torch.equal(m["t"], t + i)
        _refused_at_least(mq, 1)  # the impostor's key (the stranger fails before ZAP)
        assert not stranger[1].poll(200)
    finally:
        bad.shutdown()
        _close(*stranger)


def test_the_encrypted_setting_needs_the_remote_ranks(monkeypatch):
    monkeypatch.setenv("VLLM_SHM_ARENA_TCP_SECURITY", "encrypted")
    with pytest.raises(ValueError, match="remote_reader_ranks"):
        MessageQueue(2, 1, [5], connect_ip=LOOP)  # remote ranks unknown: any 1 rank not 5


# ------------------------------------------------------------------ the ZAP handler's life
@pytest.mark.parametrize("how", ["shutdown", "dropped"])
def test_the_zap_handler_ends_with_its_queue(how):
    """Its socket lives in the writer's context, so terminating the context ends it: neither
    shutdown() nor a queue dropped without one (its finalizer) waits for good or leaves the
    thread behind."""
    import gc

    mq = MessageQueue(1, 0, connect_ip=LOOP)
    r = MessageQueue.create_from_handle(mq.export_handle(), 0)
    ready_in_threads(mq, [r])
    assert [t for t in threading.enumerate() if t.name == "vllm_shm_arena-zap"]
    t0 = time.monotonic()
    if how == "shutdown":
        mq.shutdown()
    else:
        del mq
        gc.collect()
    r.shutdown()
    deadline = time.monotonic() + 10
    while [t for t in threading.enumerate() if t.name == "vllm_shm_arena-zap"]:
        assert time.monotonic() < deadline, "the ZAP handler outlived its queue"
        time.sleep(0.02)
    assert time.monotonic() - t0 < 10


def test_a_peer_address_lookup_never_fails_on_a_reused_descriptor():
    """The ZAP thread reads a new connection's peer from its descriptor, which ZeroMQ may have
    closed and reused by then: a Unix socket's, a closed one, anything gives "" (a failure here
    once killed the handler thread, and every later handshake waited for good)."""
    a, b = socket.socketpair()
    tcp = socket.create_server((LOOP, 0))
    c = socket.create_connection(tcp.getsockname())
    try:
        assert admission._peer_of(a.fileno()) == ""
        assert admission._peer_of(c.fileno()) == LOOP
        fd = os.dup(b.fileno())
        os.close(fd)
        assert admission._peer_of(fd) == ""
    finally:
        for s in (a, b, tcp, c):
            s.close()


def test_the_zap_handler_outlives_a_failure_of_its_own(writers, monkeypatch):
    calls = []

    def broken(self, event):
        calls.append(event)
        raise ValueError("a bug in the event handling")

    monkeypatch.setattr(admission.ZapHandler, "_on_event", broken)
    mq, h, r = _remote_pair(writers)  # the handshake still completes
    mq.enqueue("after", timeout=10)
    assert r.dequeue(timeout=10) == "after" and calls
