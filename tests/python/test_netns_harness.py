"""The two-node harness (e2e/netns_nodes.sh, e2e/netns.py): the nodes are apart
(own /dev/shm, hostname), the queue link carries TCP and ZeroMQ over IPv4 and IPv6, the port
counters see the bytes sent (headers aside), the rate limit holds, the stranger reaches node 0
(and only node 0) over its own link, and `down` / a failed `up` leave nothing behind. Skipped
where namespaces cannot be made (not root, a container)."""

from __future__ import annotations

import os
import subprocess
import time

import pytest
from mq_helpers import wait_until

from e2e.netns import (
    SCRIPT,
    STRANGER,
    TwoNodes,
    parse_counters,
    two_nodes_or_skip,
    unavailable_reason,
)

MiB = 1 << 20

# Reads everything from one TCP connection on (host, port); prints the byte count.
_TCP_RECV = """
import socket, sys
s = socket.socket()
s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind((sys.argv[1], int(sys.argv[2])))
s.listen(1)
print("listening", flush=True)
c, _ = s.accept()
got = 0
while b := c.recv(1 << 20):
    got += len(b)
print(got, flush=True)
"""

# Sends n bytes to (host, port).
_TCP_SEND = """
import socket, sys
c = socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=30)
c.sendall(b"x" * int(sys.argv[3]))
c.close()
"""

# ZeroMQ PUB on (addr, port): waits for one subscriber, then sends count messages of size bytes.
_ZMQ_PUB = """
import sys, zmq
addr, port, count, size = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
ctx = zmq.Context()
s = ctx.socket(zmq.XPUB)
if ":" in addr:
    s.setsockopt(zmq.IPV6, 1)
    addr = f"[{addr}]"
s.bind(f"tcp://{addr}:{port}")
print("listening", flush=True)
assert s.recv()[0] == 1  # the subscription
payload = bytes(range(256)) * (size // 256)
for i in range(count):
    s.send(payload)
ack = ctx.socket(zmq.PULL)  # the subscriber says when it has everything
ack.setsockopt(zmq.IPV6, 1)
ack.bind(f"tcp://{addr}:{port + 1}")
print("acked", ack.recv().decode(), flush=True)
s.close(linger=0)
ack.close(linger=0)
ctx.term()
"""

_ZMQ_SUB = """
import sys, zmq
addr, port, count = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
ctx = zmq.Context()
s = ctx.socket(zmq.SUB)
if ":" in addr:
    s.setsockopt(zmq.IPV6, 1)
    addr = f"[{addr}]"
s.setsockopt(zmq.SUBSCRIBE, b"")
s.connect(f"tcp://{addr}:{port}")
got = sum(len(s.recv()) for _ in range(count))
ack = ctx.socket(zmq.PUSH)
ack.setsockopt(zmq.IPV6, 1)
ack.connect(f"tcp://{addr}:{port + 1}")
ack.send(str(got).encode())
ack.close(linger=5000)
s.close(linger=0)
ctx.term()
"""


def _finish(p: subprocess.Popen, timeout: float = 60) -> str:
    out, err = p.communicate(timeout=timeout)
    assert p.returncode == 0, f"rc {p.returncode}: {err}"
    return out


def _wait_line(p: subprocess.Popen, want: str, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        line = p.stdout.readline()
        if line.strip() == want:
            return
        if not line and p.poll() is not None:
            break
    p.kill()
    raise AssertionError(f"no {want!r} from the child: {p.communicate()[1]}")


def _overhead_bound(payload: int) -> int:
    """Headers that may come with ``payload`` bytes of TCP payload in one direction: at most
    one segment per 1448 payload bytes (no TSO at all), 80 bytes of IPv6 and TCP headers each,
    plus the handshake and teardown."""
    return (payload // 1448 + 1) * 80 + 4096


@pytest.fixture(scope="module")
def nodes():
    with two_nodes_or_skip(other_link=True) as n:
        yield n


def test_nodes_are_apart(nodes):
    seen = {}
    for node in (0, 1):
        p = nodes.popen(
            node,
            [
                "sh",
                "-c",
                "hostname; echo $VLLM_HOST_IP $VSA_NODE $GLOO_SOCKET_IFNAME; "
                "touch /dev/shm/vsa-harness-$VSA_NODE; ls /dev/shm; getent hosts $(hostname)",
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        seen[node] = _finish(p).split("\n")
    for node in (0, 1):
        host, env, files, resolved = seen[node][:4]
        assert host == f"{nodes.prefix}-n{node}"
        assert env.split() == [nodes.addr(node), str(node), "vsa-o"]
        assert files.split() == [f"vsa-harness-{node}"]  # a private /dev/shm each
        assert resolved.split() == [nodes.addr(node), host]
    assert not os.path.exists("/dev/shm/vsa-harness-0")  # not the host's either


def test_tcp_bytes_are_counted_per_port(nodes):
    nodes.require_port_counters()
    port, quiet_port, n = 15555, 15556, 32 * MiB
    nodes.watch(port, quiet_port)
    before = nodes.counters()
    recv = nodes.python(1, _TCP_RECV, nodes.addr(1), str(port))
    _wait_line(recv, "listening")
    _finish(nodes.python(0, _TCP_SEND, nodes.addr(1), str(port), str(n)))
    assert int(_finish(recv)) == n
    d = nodes.counters() - before
    sent = d.tx(0, port)
    print(
        f"{n} payload bytes -> node 0 tx {sent} ({d.get_counter(0, port, 'tx').packets} segments)"
    )
    assert n < sent <= n + _overhead_bound(n)
    assert d.rx(1, port) == pytest.approx(sent, rel=0.01)  # the same packets, seen on arrival
    assert 0 < d.rx(0, port) <= _overhead_bound(n)  # the ACKs
    assert d.tx(0, "tcp") >= sent
    assert d.tx(0, quiet_port) == d.rx(1, quiet_port) == 0
    assert d.tx(0, port, link="o") == 0  # the queue link only
    assert d.tx(0, "if") >= sent


def test_interface_counters_see_the_bytes_without_nft(nodes):
    """The per-interface counters (all the harness has where nft is missing)."""
    port, n = 15557, 8 * MiB
    before = nodes.counters()
    recv = nodes.python(1, _TCP_RECV, nodes.addr(1), str(port))
    _wait_line(recv, "listening")
    _finish(nodes.python(0, _TCP_SEND, nodes.addr(1), str(port), str(n)))
    assert int(_finish(recv)) == n
    d = nodes.counters() - before
    # Ethernet headers and whatever else the link carried (neighbour discovery) come on top.
    assert n < d.tx(0, "if") <= n + _overhead_bound(n) + 64 * 1024
    # A veth pair loses nothing; neighbour discovery may fall between the two nodes' reads.
    assert abs(d.rx(1, "if") - d.tx(0, "if")) < 4096
    assert d.tx(0, "if", link="o") < 64 * 1024


@pytest.mark.parametrize("ipv6", [False, True], ids=["ipv4", "ipv6"])
def test_zmq_pub_sub_across_nodes(nodes, ipv6):
    nodes.require_port_counters()
    port, count, size = 15560 + 2 * ipv6, 64, 256 * 1024
    nodes.watch(port)
    before = nodes.counters()
    addr = nodes.addr(0, ipv6=ipv6)
    pub = nodes.python(0, _ZMQ_PUB, addr, str(port), str(count), str(size))
    _wait_line(pub, "listening")
    sub = nodes.python(1, _ZMQ_SUB, addr, str(port), str(count))
    _finish(sub)
    assert _finish(pub).split() == ["acked", str(count * size)]
    d = nodes.counters() - before
    payload = count * size
    print(f"zmq {payload} payload bytes -> node 0 tx {d.tx(0, port)}, node 1 rx {d.rx(1, port)}")
    # ZeroMQ adds a 9-byte frame header per large message, and its greeting and handshake.
    assert payload < d.tx(0, port) <= payload + count * 9 + _overhead_bound(payload)
    assert d.rx(1, port) == pytest.approx(d.tx(0, port), rel=0.01)


def test_parse_counters_reads_the_script_format():
    c = parse_counters(
        "node=0 link=q port=5555 dir=tx bytes=10 packets=1\n"
        "node=1 link=o port=if dir=rx bytes=7 packets=2\n"
    )
    assert c.tx(0, 5555) == 10 and c.get_counter(1, "if", "rx", link="o").packets == 2
    c = parse_counters("node=s link=s port=5555 dir=rx bytes=3 packets=1\n")
    assert c.rx(STRANGER, 5555, link="s") == 3
    with pytest.raises(KeyError):
        c.rx(0, 5555)
    with pytest.raises(ValueError):
        parse_counters("node=0 link=q port=5555 bytes=1")


# Connects to (host, port) and says whether that worked.
_TCP_PROBE = """
import socket, sys
try:
    socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=1).close()
    print("reached")
except OSError as e:
    print("unreachable", type(e).__name__)
"""


def test_the_stranger_reaches_node_0_over_its_own_link():
    """The stranger's TCP to node 0's queue address goes over link "s" (counted there, in node 0
    and in the stranger, not on the queue link); node 1 is out of its reach; `down` removes
    it."""
    port, n = 15580, 4 * MiB
    with two_nodes_or_skip(stranger=True) as nodes:
        nodes.require_port_counters()
        nodes.watch(port)
        before = nodes.counters()
        recv = nodes.python(0, _TCP_RECV, nodes.addr(0), str(port))
        _wait_line(recv, "listening")
        _finish(nodes.python(STRANGER, _TCP_SEND, nodes.addr(0), str(port), str(n)))
        assert int(_finish(recv)) == n
        d = nodes.counters() - before
        probe = _finish(nodes.python(STRANGER, _TCP_PROBE, nodes.addr(1), str(port)))
        assert probe.split()[0] == "unreachable", probe
        p = nodes.popen(STRANGER, ["sh", "-c", "echo $VSA_NODE"], stdout=subprocess.PIPE, text=True)
        assert _finish(p).strip() == STRANGER
        prefix = nodes.prefix
    print(f"stranger -> node 0: {n} payload bytes, stranger tx {d.tx(STRANGER, port, link='s')}")
    assert n < d.tx(STRANGER, port, link="s") <= n + _overhead_bound(n)
    assert d.rx(0, port, link="s") == pytest.approx(d.tx(STRANGER, port, link="s"), rel=0.01)
    assert d.rx(0, port) == 0 and d.tx(0, port) == 0  # nothing on the queue link
    assert d.tx(0, "if", link="s") > 0 and d.rx(STRANGER, "if", link="s") > 0
    assert not os.path.exists(f"/run/netns/{prefix}-s")


def test_rate_limit_slows_the_queue_link():
    """Only a lower bound on the time: a slow machine makes a transfer slower, never faster."""
    n, rate_bytes_s = 8 * MiB, 100e6 / 8
    with two_nodes_or_skip(rate="100mbit") as nodes:
        recv = nodes.python(1, _TCP_RECV, nodes.addr(1), "15570")
        _wait_line(recv, "listening")
        t0 = time.monotonic()
        _finish(nodes.python(0, _TCP_SEND, nodes.addr(1), "15570", str(n)))
        assert int(_finish(recv)) == n
        took = time.monotonic() - t0
    # The bucket lets 256 KiB through at once; the rest waits for tokens.
    assert took >= 0.9 * (n - 256 * 1024) / rate_bytes_s, f"{n} bytes at 100mbit in {took:.2f}s"


def test_down_is_idempotent_and_ends_what_runs_on_the_nodes():
    why = unavailable_reason()
    if why is not None:
        pytest.skip(why)
    nodes = TwoNodes().up()
    sleeper = nodes.popen(1, ["sleep", "600"])
    try:
        assert os.path.exists(f"/run/netns/{nodes.prefix}-n1")
        # Runs on the node before `down` looks: `popen` returns before the exec has entered
        # the namespace, and a process `down` did not see there yet is not one of the node's.
        wait_until(
            lambda: subprocess.run(
                ["ip", "netns", "pids", f"{nodes.prefix}-n1"], capture_output=True, text=True
            ).stdout.strip(),
            30,
            "the sleeper to run on node 1",
        )
        nodes.down()
        assert sleeper.wait(10) != 0  # ended by down
        nodes.down()
        assert not os.path.exists(f"/run/netns/{nodes.prefix}-n0")
        assert not os.path.exists(f"/run/netns/{nodes.prefix}-n1")
        assert not os.path.exists(f"/run/{nodes.prefix}-nodes")
    finally:
        if sleeper.poll() is None:
            sleeper.kill()
        nodes.down()


def test_a_failed_up_leaves_nothing_behind():
    why = unavailable_reason()
    if why is not None:
        pytest.skip(why)
    nodes = TwoNodes(shm_size="not-a-size")  # the mount of /dev/shm fails after the links exist
    with pytest.raises(RuntimeError, match="up failed"):
        nodes.up()
    assert not os.path.exists(f"/run/netns/{nodes.prefix}-n0")
    assert not os.path.exists(f"/run/{nodes.prefix}-nodes")
    r = subprocess.run(
        ["bash", str(SCRIPT), "exec", "0", "true"], env=nodes._env(), capture_output=True
    )
    assert r.returncode != 0  # nothing to enter


# Our queue's writer on node 0 with remote readers only: prints the remote address and the
# pickled handle, sends on "go", shuts down on the next line.
_MQ_WRITER = """
import base64, pickle, sys, torch
from vllm_shm_arena import MessageQueue
n_remote, count, size, ip = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
mq = MessageQueue(n_remote, 0, connect_ip=ip)
h = mq.export_handle()
print(h.remote_subscribe_addr, base64.b64encode(pickle.dumps(h)).decode(), flush=True)
sys.stdin.readline()
mq.wait_until_ready(timeout=60)
t = torch.arange(size // 4, dtype=torch.int32)
for i in range(count):
    mq.enqueue({"i": i, "t": t})
print("sent", flush=True)
sys.stdin.readline()
mq.shutdown()
"""

# Every remote reader of the queue, in one process (one import of torch on a busy machine):
# ranks from argv, the handle from stdin once the imports are done.
_MQ_READERS = """
import base64, pickle, sys, torch
from vllm_shm_arena import MessageQueue
ranks, count, size = [int(r) for r in sys.argv[1].split(",")], int(sys.argv[2]), int(sys.argv[3])
handle = pickle.loads(base64.b64decode(sys.stdin.readline()))
mqs = [MessageQueue.create_from_handle(handle, r) for r in ranks]
for mq in mqs:
    assert mq._is_remote_reader
    mq.wait_until_ready(timeout=60)
want = torch.arange(size // 4, dtype=torch.int32)
for i in range(count):
    for mq in mqs:
        m = mq.dequeue(timeout=60)
        assert m["i"] == i and torch.equal(m["t"], want)
print("ok", flush=True)
for mq in mqs:
    mq.shutdown()
"""


def test_each_remote_reader_gets_its_own_copy_over_the_link(nodes):
    """The queue today: every remote reader subscribes to the writer's socket, so each message
    crosses the link once per remote reader on the other node."""
    nodes.require_port_counters()
    n_remote, count, size = 2, 8, 4 * MiB
    writer = nodes.python(
        0,
        _MQ_WRITER,
        str(n_remote),
        str(count),
        str(size),
        nodes.addr(0),
        stdin=subprocess.PIPE,
    )
    readers = nodes.python(
        1,
        _MQ_READERS,
        ",".join(str(i) for i in range(n_remote)),  # the ranks the writer expects
        str(count),
        str(size),
        stdin=subprocess.PIPE,
    )
    try:
        line = writer.stdout.readline().split()
        assert len(line) == 2, writer.communicate(timeout=30)[1]
        addr, handle = line
        assert addr.startswith(f"tcp://{nodes.addr(0)}:")
        port = int(addr.rsplit(":", 1)[1])
        nodes.watch(port)
        before = nodes.counters()
        readers.stdin.write(handle + "\n")
        readers.stdin.flush()
        writer.stdin.write("go\n")
        writer.stdin.flush()
        assert writer.stdout.readline().strip() == "sent"
        assert _finish(readers, timeout=120).strip() == "ok"
        writer.stdin.write("done\n")
        writer.stdin.flush()
        _finish(writer)
    finally:
        for p in (writer, readers):
            if p.poll() is None:
                p.kill()
                p.wait()
    d = nodes.counters() - before
    payload = count * size
    print(f"{n_remote} remote readers x {payload} bytes -> node 0 tx {d.tx(0, port)}")
    assert n_remote * payload < d.tx(0, port) <= n_remote * (payload + _overhead_bound(payload))
    assert d.rx(1, port) == pytest.approx(d.tx(0, port), rel=0.01)
