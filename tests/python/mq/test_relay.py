"""The queue across nodes, over loopback: the writer's arena kept for its local readers beside
remote ones, a relay per remote node (its thread, its downstream ring and arena, how the
upstream's end reaches its readers), the subscription protocol (declared ranks, refusals),
IPv6 addresses, and the socket token across a port taken over by another process.

"Nodes" here are distinct reader processes on 127.0.0.1; relayed readers attach their relay's
downstream ring in the same shm directory. The two-node versions (each node its own /dev/shm,
per-port byte counters) are in mq/test_relay_netns.py. Every multi-process test prints its
seed (conftest.py).
"""

from __future__ import annotations

import dataclasses
import os
import pickle
import signal
import socket
import threading
import time

import mq_helpers as H  # noqa: E402
import multinode_helpers as M  # noqa: E402
import pytest
import zmq
from mq_helpers import ready_in_threads  # noqa: E402

from e2e.netns import port_of, tcp_bytes_from_port  # noqa: E402
from vllm_shm_arena import MessageQueue  # noqa: E402
from vllm_shm_arena.mq import protocol  # noqa: E402

MiB = H.MiB
LOOP = "127.0.0.1"


def get(q, timeout=90.0):
    return q.get(timeout=timeout)


def reports(q, n):
    out = {}
    for _ in range(n):
        r = get(q)
        out[r["name"]] = r
    return out


SIZES = [0, 2 * MiB, 1024, 8 * MiB, 0, 24 * MiB, 3 * MiB, 0]


# ------------------------------------------------------------------------ end to end
@pytest.mark.parametrize(
    "layout",
    [
        pytest.param({"local": [0, 1], "direct": [], "relays": {2: [3]}}, id="tp4_2+2"),
        pytest.param({"local": [0, 1], "direct": [], "relays": {2: [3, 4]}}, id="2+3"),
        pytest.param({"local": [0], "direct": [1], "relays": {2: [3]}}, id="direct+relay"),
    ],
)
def test_relayed_nodes_get_every_message_in_order_from_their_arena(seed, kids, writers, layout):
    """Every reader (local, direct remote, relay's worker, relayed) gets every message intact
    and in order; both nodes' arenas are used; relayed readers hold tensors of their node's
    arena; the bytes on the queue's TCP connections per message are about the payload once
    per remote subscriber (not per remote reader); the writer's shutdown reaches everyone."""
    local, direct, relays = layout["local"], layout["direct"], layout["relays"]
    n_reader = len(local) + len(direct) + sum(1 + len(v) for v in relays.values())
    mq = MessageQueue(n_reader, len(local), local, connect_ip=LOOP, enable_shm_tensor_arena=True)
    writers(mq)
    h = mq.export_handle()
    q, hq, go = kids.ctx.Queue(), kids.ctx.Queue(), kids.ctx.Event()
    for rank in [*local, *direct]:
        kids.start(M.plain_reader, h, rank, seed, len(SIZES), q)
    for rank, relayed in relays.items():
        kids.start(M.relay_node, h, rank, relayed, seed, len(SIZES), q, hq, go)
        for i in range(1, len(relayed) + 1):
            kids.start(M.relayed_node, hq, i, seed, len(SIZES), q)
    mq.wait_until_ready(timeout=60)
    for seq, nbytes in enumerate(SIZES):
        mq.enqueue(H.make_msg(seed, seq, nbytes, H.VIEW_DTYPES[seq % 6]), timeout=60)
    payload = sum(SIZES)
    n_sub = len(direct) + len(relays)
    port = port_of(h.remote_subscribe_addr)
    link = tcp_bytes_from_port(port)
    if link is not None:  # ss says: wait until the kernel acked at least the payloads

        def acked():
            n = tcp_bytes_from_port(port)
            return n if n is not None and n >= payload * n_sub else None

        link = H.wait_until(acked, 30, f"the link's acked bytes to reach {n_sub} x the payload")
    st = mq.stats()
    mq.shutdown()
    n_names = len(local) + len(direct) + sum(1 + len(v) for v in relays.values())
    reps = reports(q, n_names)
    go.set()
    for rep in reps.values():
        assert rep["errors"] == [] and rep["count"] == len(SIZES), rep
        assert rep["end"] is not None and "shut down by the writer" in rep["end"], rep
    assert st["arena"]["hits"] >= 4, st["arena"]  # node 0's arena
    for rank, relayed in relays.items():
        rs = reps[f"relay{rank}"]["stats"]
        assert rs["role"] == "relay" and rs["messages"] == len(SIZES), rs
        assert rs["downstream"]["arena"]["hits"] >= 4, rs["downstream"]  # this node's arena
        assert reps[f"relay{rank}"]["held"] >= 1
        for i in range(1, len(relayed) + 1):
            assert reps[f"relayed{i}"]["held"] >= 1, reps[f"relayed{i}"]
            assert reps[f"relayed{i}"]["stats"]["role"] == "local_reader"
    assert st["remote_bytes"] >= payload
    assert st["remote_bytes"] <= 1.2 * payload, st["remote_bytes"] / payload
    if link is not None:
        print(f"link bytes / (payload x subscribers) = {link / (payload * n_sub):.4f}")
        assert payload * n_sub <= link <= 1.2 * payload * n_sub, (link, payload, n_sub)
    kids.join_all(30)


def test_writer_death_reaches_the_relay_and_its_readers(seed, kids):
    """The writer (every reader remote) is SIGKILLed after its messages: the relay's worker
    and its relayed reader get every message, then WriterDiedError; nothing hangs."""
    sizes = [2 * MiB, 0, 4 * MiB]
    q, hq, go, wgo, whq, got_all = (
        kids.ctx.Queue(),
        kids.ctx.Queue(),
        kids.ctx.Event(),
        kids.ctx.Event(),
        kids.ctx.Queue(),
        kids.ctx.Event(),
    )
    w = kids.start(M.dying_writer, 2, sizes, seed, whq, wgo)
    h = get(whq)
    kids.start(M.relay_node, h, 0, [1], seed, len(sizes), q, hq, go, 20.0, got_all)
    kids.start(M.relayed_node, hq, 1, seed, len(sizes), q, 20.0)
    # The writer dies once its only subscriber, the relay, has every message.
    assert got_all.wait(60), "the relay never got every message"
    wgo.set()
    t0 = time.monotonic()
    reps = reports(q, 2)
    go.set()
    w.join(10)
    assert w.exitcode == -signal.SIGKILL
    for rep in reps.values():
        assert rep["errors"] == [] and rep["count"] == len(sizes), rep
        assert rep["end"].startswith("WriterDiedError"), rep
    assert time.monotonic() - t0 < 20
    kids.join_all(30)


def test_relay_death_is_its_readers_writer_death(seed, kids, writers):
    """The relay process is SIGKILLed: its relayed reader gets the messages before, then
    WriterDiedError (its writer, the relay, died); nothing hangs."""
    mq = MessageQueue(2, 0, connect_ip=LOOP, enable_shm_tensor_arena=True)
    writers(mq)
    # The relay reports on its own queue: killed after a put, it may still hold that queue's
    # write lock.
    q, q_relay, hq, go = kids.ctx.Queue(), kids.ctx.Queue(), kids.ctx.Queue(), kids.ctx.Event()
    sizes = [2 * MiB, 0]
    relay = kids.start(
        M.relay_node, mq.export_handle(), 0, [1], seed, len(sizes), q_relay, hq, go, 3.0
    )
    kids.start(M.relayed_node, hq, 1, seed, len(sizes), q, 30.0)
    mq.wait_until_ready(timeout=60)
    for seq, nbytes in enumerate(sizes):
        mq.enqueue(H.make_msg(seed, seq, nbytes), timeout=30)
    first = get(q_relay)  # the relay's worker: read both, then timed out waiting for more
    assert first["name"] == "relay0" and first["count"] == len(sizes), first
    assert first["end"].startswith("TimeoutError"), first
    relay.kill()
    rep = get(q, 40)
    assert rep["name"] == "relayed1" and rep["count"] == len(sizes), rep
    assert rep["end"].startswith("WriterDiedError"), rep
    kids.join_all(30)


# ------------------------------------------------------------------------ in one process
@pytest.fixture
def one_node(writers):
    """``one_node(**relay_kw)`` -> (writer, relay, relayed reader): all remote (the writer has
    no local reader), in this process, ready; shut down at teardown."""

    def make(**kw):
        mq = MessageQueue(2, 0, connect_ip=LOOP, enable_shm_tensor_arena=True)
        writers(mq)
        relay = MessageQueue.create_relay(mq.export_handle(), 0, [1], **kw)
        writers(relay)
        r = MessageQueue.create_from_handle(relay.downstream_handle, 1)
        writers(r)
        ready_in_threads(mq, [relay, r], timeout=30)
        return mq, relay, r

    return make


def test_the_relay_is_a_message_queue_with_its_downstream_handle(one_node, seed):
    mq, relay, r = one_node()
    assert isinstance(relay, MessageQueue)
    assert relay.downstream_handle.local_reader_ranks == [0, 1]
    assert relay.downstream_handle.tensor_arena_handle is not None
    mq.enqueue(H.make_msg(seed, 0, 2 * MiB), timeout=10)
    for reader in (relay, r):
        assert H.check_msg(reader.dequeue(timeout=10), seed, 0) is None


def test_dequeue_timeout_on_the_relay_and_its_readers(one_node, seed):
    mq, relay, r = one_node()
    for reader in (relay, r):
        t0 = time.monotonic()
        with pytest.raises(TimeoutError):
            reader.dequeue(timeout=0.3)
        assert time.monotonic() - t0 < 3
    mq.enqueue(H.make_msg(seed, 0, MiB), timeout=10)
    for reader in (relay, r):
        assert H.check_msg(reader.dequeue(timeout=10), seed, 0) is None


def test_a_message_the_relay_cannot_unpickle_breaks_its_queue_loudly(one_node, seed):
    """After the messages before it, the relay's worker and its readers get a RuntimeError
    naming the failure; nothing after it is delivered as if nothing happened."""
    mq, relay, r = one_node()
    mq.enqueue(H.make_msg(seed, 0, MiB), timeout=10)
    mq.enqueue(H.Boom(), timeout=10)
    mq.enqueue(H.make_msg(seed, 2, MiB), timeout=10)
    for reader in (relay, r):
        assert H.check_msg(reader.dequeue(timeout=10), seed, 0) is None
        with pytest.raises(RuntimeError, match="relay of this node could not forward"):
            reader.dequeue(timeout=10)
        with pytest.raises(RuntimeError):
            reader.dequeue(timeout=5)


def test_shutting_the_relay_down_ends_its_readers(one_node, seed):
    mq, relay, r = one_node()
    mq.enqueue(H.make_msg(seed, 0, MiB), timeout=10)
    assert H.check_msg(r.dequeue(timeout=10), seed, 0) is None
    t0 = time.monotonic()
    relay.shutdown()
    assert time.monotonic() - t0 < 10
    assert not relay._end.thread.is_alive()
    with pytest.raises(RuntimeError, match="shut down"):
        r.dequeue(timeout=10)


def test_a_slow_relayed_reader_holds_back_a_bounded_backlog_and_loses_nothing(one_node, seed):
    """The relayed reader does not read: the relay stops receiving once the downstream ring is
    full, so the writer's enqueue times out after a bounded number of messages (the
    downstream chunks plus the sockets' high-water marks and the kernel's buffers). Then the
    reader reads every one of them, in order."""
    chunks = 4
    mq, relay, r = one_node(max_chunks=chunks, max_chunk_bytes=1 << 20)
    got_relay = []
    stop = threading.Event()

    def worker():  # the relay's own worker keeps up
        while not stop.is_set():
            try:
                got_relay.append(relay.dequeue(timeout=0.2)["seq"])
            except TimeoutError:
                continue
            except RuntimeError:
                return

    t = threading.Thread(target=worker, daemon=True)
    t.start()
    sent = 0
    bound = chunks + 1 + 2 * 64 + 64  # ring, one in hand, both HWMs, kernel buffers (1 MiB each)
    while sent <= bound:
        try:
            mq.enqueue(H.make_msg(seed, sent, MiB), timeout=1.0)
        except TimeoutError:
            break
        sent += 1
    assert chunks <= sent <= bound, sent
    for seq in range(sent):
        assert H.check_msg(r.dequeue(timeout=10), seed, seq) is None
    with pytest.raises(TimeoutError):
        r.dequeue(timeout=0.3)
    H.wait_until(lambda: len(got_relay) >= sent, 10, "the relay's worker to read everything")
    stop.set()
    t.join(5)
    assert got_relay == list(range(sent))


# ------------------------------------------------------------------------ subscriptions
# A bad subscriber never stops the start-up (it is refused and logged, and counted in
# stats()["tcp_refused"]); the real readers' start-up goes on, and a timeout names the last
# refusal. Strangers (no credentials) are mq/test_admission.py's.
def _refused(mq, match, timeout=2.0):
    with pytest.raises(TimeoutError, match=match):
        mq.wait_until_ready(timeout=timeout)
    assert mq.stats()["tcp_refused"] >= 1


def test_a_second_connection_of_one_principal_is_refused(writers):
    mq = MessageQueue(2, 0, connect_ip=LOOP)
    writers(mq)
    for _ in range(2):
        writers(MessageQueue.create_from_handle(mq.export_handle(), 1))
    _refused(mq, r"ranks \[0\] undeclared; last refusal: principal 1 is connected already")


def test_a_rank_that_is_not_remote_is_refused(writers):
    mq = MessageQueue(3, 1, [0], connect_ip=LOOP)
    writers(mq)
    writers(MessageQueue.create_from_handle(mq.export_handle(), 0))  # the local reader
    writers(MessageQueue.create_from_handle(mq.export_handle(), 7))
    _refused(mq, r"rank 7, which is not a remote reader .*ranks \[1, 2\]")


def test_a_wrong_secret_is_refused(writers):
    mq = MessageQueue(1, 0, connect_ip=LOOP)
    writers(mq)
    other = dataclasses.replace(mq.export_handle(), secret=b"x" * 32)
    writers(MessageQueue.create_from_handle(other, 0))
    _refused(mq, "wrong credentials")


def _raw_sub(h, principal, *topics):
    """A SUB socket with ``principal``'s credentials (from the handle) and ``topics``."""
    keys = protocol.Keys(h.secret)
    ctx = zmq.Context()
    s = ctx.socket(zmq.SUB)
    s.setsockopt(zmq.LINGER, 0)
    user = str(principal).encode()
    s.plain_username, s.plain_password = user, keys.plain_password(user)
    for t in topics:
        s.setsockopt(zmq.SUBSCRIBE, t)
    s.connect(h.remote_subscribe_addr)
    return ctx, s


def test_a_wrong_version_an_empty_declaration_or_another_principals_hello_is_refused(writers):
    for version, ranks, match in (
        (99, [0], "protocol version 99"),
        (protocol.HELLO_VERSION, [], "declared no reader"),
        (protocol.HELLO_VERSION, [1], r"declares \[1\] first, but it authenticated as principal 0"),
    ):
        mq = MessageQueue(2, 0, connect_ip=LOOP)
        writers(mq)
        h = mq.export_handle()
        head = protocol.HELLO_HEAD.pack(protocol.HELLO_MAGIC, version, len(ranks))
        hello = head + b"".join(protocol.HELLO_RANK.pack(r) for r in ranks)
        ctx, s = _raw_sub(h, 0, b"", hello)
        try:
            _refused(mq, match)
        finally:
            s.close()
            ctx.term()


def test_a_subscriber_that_declares_nothing_is_named_at_the_timeout(writers):
    mq = MessageQueue(1, 0, connect_ip=LOOP)
    writers(mq)
    ctx, s = _raw_sub(mq.export_handle(), 0, b"")
    try:
        t0 = time.monotonic()
        with pytest.raises(
            TimeoutError, match=r"ranks \[0\] undeclared; 1 subscriber\(s\) declared no reader"
        ):
            mq.wait_until_ready(timeout=1.0)
        assert time.monotonic() - t0 < 5
    finally:
        s.close()
        ctx.term()


def test_create_relay_checks_its_ranks(writers):
    mq = MessageQueue(3, 1, [0], connect_ip=LOOP)
    writers(mq)
    h = mq.export_handle()
    with pytest.raises(ValueError, match="local readers"):
        MessageQueue.create_relay(h, 0, [1])
    with pytest.raises(ValueError, match="distinct"):
        MessageQueue.create_relay(h, 1, [1])
    with pytest.raises(TypeError):
        MessageQueue.create_relay(object(), 1, [2])


# ------------------------------------------------------------------------ IPv6
def _has_ipv6_loopback() -> bool:
    try:
        with socket.socket(socket.AF_INET6, socket.SOCK_STREAM) as s:
            s.bind(("::1", 0))
        return True
    except OSError:
        return False


@pytest.mark.skipif(not _has_ipv6_loopback(), reason="no IPv6 loopback (::1) here")
def test_ipv6_connect_address(one_node, writers, seed):
    mq = MessageQueue(3, 1, [0], connect_ip="::1", enable_shm_tensor_arena=True)
    writers(mq)
    h = mq.export_handle()
    assert h.remote_addr_ipv6 and h.remote_subscribe_addr.startswith("tcp://[::1]:")
    local = MessageQueue.create_from_handle(h, 0)
    relay = MessageQueue.create_relay(h, 1, [2])
    relayed = MessageQueue.create_from_handle(relay.downstream_handle, 1)
    for e in (local, relay, relayed):
        writers(e)
    ready_in_threads(mq, [local, relay, relayed], timeout=30)
    mq.enqueue(H.make_msg(seed, 0, 2 * MiB), timeout=10)
    for r in (local, relay, relayed):
        assert H.check_msg(r.dequeue(timeout=10), seed, 0) is None


# ------------------------------------------------------------------------ port takeover
def test_a_process_that_takes_over_the_dead_writers_port_feeds_nothing(seed, kids):
    """After the writer is SIGKILLed, another process binds the same port, takes the reader's
    reconnection and publishes: the reader (direct remote) raises a clear error; it never
    delivers the impostor's message (every frame must carry the writer's MAC)."""
    whq, wgo = kids.ctx.Queue(), kids.ctx.Event()
    w = kids.start(M.dying_writer, 1, [MiB], seed, whq, wgo)
    h = get(whq)
    r = MessageQueue.create_from_handle(h, 0)
    try:
        r.wait_until_ready(timeout=30)
        assert H.check_msg(r.dequeue(timeout=30), seed, 0) is None
        wgo.set()
        w.join(10)
        assert w.exitcode == -signal.SIGKILL
        # A PLAIN server that believes any client (so the reader's handshake succeeds),
        # publishing messages shaped like the queue's, without its MAC.
        stop = threading.Event()
        evil = pickle.dumps({"seq": 1, "evil": True})
        heads = (b"", os.urandom(24), os.urandom(40))
        imp = threading.Thread(
            target=H.squat, args=(h.remote_subscribe_addr, evil, heads, stop), daemon=True
        )
        imp.start()
        with pytest.raises(
            RuntimeError, match="did not come from its writer|connection to the writer dropped"
        ):
            r.dequeue(timeout=10)
        # Whatever it sends later is never delivered either.
        with pytest.raises((RuntimeError, TimeoutError)):
            r.dequeue(timeout=1)
        stop.set()
        imp.join(10)
    finally:
        r.shutdown()


@pytest.mark.parametrize("timeout_s", [1, 3, 7, 60, 601])
def test_keepalive_gives_up_after_about_the_configured_time(timeout_s):
    """VLLM_SHM_ARENA_TCP_TIMEOUT_S -> the keepalive options: idle, then probes, spending at
    most the configured time and at least half of it (probes are whole seconds)."""
    import zmq

    from vllm_shm_arena.mq import transport

    opts = dict(transport.keepalive_options(timeout_s))
    assert opts[zmq.TCP_KEEPALIVE] == 1
    total = (
        opts[zmq.TCP_KEEPALIVE_IDLE] + opts[zmq.TCP_KEEPALIVE_INTVL] * opts[zmq.TCP_KEEPALIVE_CNT]
    )
    assert timeout_s / 2 <= total <= max(timeout_s, 2), (opts, total)
    assert transport.keepalive_options(0) == [(zmq.TCP_KEEPALIVE, 1)]


def test_both_ends_of_a_remote_connection_send_keepalive_probes(monkeypatch):
    """The writer's TCP socket and a remote reader's carry the keepalive options (a silent
    partition is then seen within VLLM_SHM_ARENA_TCP_TIMEOUT_S: mq/test_relay_netns.py)."""
    import zmq

    from vllm_shm_arena import MessageQueue

    monkeypatch.setenv("VLLM_SHM_ARENA_TCP_TIMEOUT_S", "12")
    mq = MessageQueue(1, 0, connect_ip="127.0.0.1")
    r = MessageQueue.create_from_handle(mq.export_handle(), 0)
    try:
        for sock in (mq.remote_socket, r.remote_socket):
            assert sock.getsockopt(zmq.TCP_KEEPALIVE) == 1
            assert sock.getsockopt(zmq.TCP_KEEPALIVE_IDLE) == 6
            assert sock.getsockopt(zmq.TCP_KEEPALIVE_INTVL) == 1
            assert sock.getsockopt(zmq.TCP_KEEPALIVE_CNT) == 6
    finally:
        r.shutdown()
        mq.shutdown()
