"""The queue across two real "nodes" (tests/python/netns.py: network namespaces, each its own
/dev/shm, nftables byte counters per TCP port; root only, skipped elsewhere): the writer on
node 0 with its local readers, a relay and its relayed readers on node 1. Every message
arrives intact and in order on both nodes, both nodes' arenas are used, relayed readers hold
tensors of node 1's arena, and the queue's port carries about one copy of the payload per
remote node (not one per remote reader), over IPv4 and IPv6."""

from __future__ import annotations

import subprocess

import pytest
from netns import two_nodes_or_skip

MiB = 1 << 20

# Node 0: the writer and its local readers (threads). Prints the address and the handle,
# sends on "go", prints its arena hits and how many messages its readers found wrong, shuts
# down.
_WRITER = """
import base64, pickle, sys, threading, torch
from vllm_shm_arena import MessageQueue
n_local, n_remote, count, size, ip = (int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]),
                                      int(sys.argv[4]), sys.argv[5])
mq = MessageQueue(n_local + n_remote, n_local, list(range(n_local)), connect_ip=ip,
                  enable_shm_tensor_arena=True)
h = mq.export_handle()
print(h.remote_subscribe_addr, base64.b64encode(pickle.dumps(h)).decode(), flush=True)
locals_ = [MessageQueue.create_from_handle(h, r) for r in range(n_local)]
bad = []
def read(r):
    r.wait_until_ready(timeout=60)
    for i in range(count):
        m = r.dequeue(timeout=60)
        want = torch.arange(size // 4, dtype=torch.int32) ^ i
        if m["i"] != i or not torch.equal(m["t"], want):
            bad.append(i)
ths = [threading.Thread(target=read, args=(r,)) for r in locals_]
for t in ths:
    t.start()
sys.stdin.readline()
mq.wait_until_ready(timeout=60)
for i in range(count):
    mq.enqueue({"i": i, "t": torch.arange(size // 4, dtype=torch.int32) ^ i}, timeout=60)
for t in ths:
    t.join(60)
print("sent", mq.stats()["arena"]["hits"], len(bad), flush=True)
mq.shutdown()
"""

# Node 1: the relay (rank argv[1]) and its relayed readers (threads). Prints its downstream
# arena hits, the fewest arena tensors any reader held with one in hand, how many messages
# were wrong, and how each reader's queue ended.
_RELAY_NODE = """
import sys, threading, torch
import base64, pickle
from vllm_shm_arena import MessageQueue
rank, relayed = int(sys.argv[1]), [int(r) for r in sys.argv[2].split(",") if r]
count, size = int(sys.argv[3]), int(sys.argv[4])
h = pickle.loads(base64.b64decode(sys.stdin.readline()))
relay = MessageQueue.create_relay(h, rank, relayed)
readers = [relay] + [MessageQueue.create_from_handle(relay.downstream_handle, i)
                     for i in range(1, len(relayed) + 1)]
held, bad, ends = [], [], []
def read(r):
    r.wait_until_ready(timeout=60)
    most = 0
    for i in range(count):
        m = r.dequeue(timeout=60)
        want = torch.arange(size // 4, dtype=torch.int32) ^ i
        if m["i"] != i or not torch.equal(m["t"], want):
            bad.append(i)
        most = max(most, r.arena.stats()["held"])
        del m
    held.append(most)
    try:
        r.dequeue(timeout=60)
        ends.append("message")
    except RuntimeError as e:
        ends.append("shutdown" if "shut down by the writer" in str(e) else repr(e))
ths = [threading.Thread(target=read, args=(r,)) for r in readers]
for t in ths:
    t.start()
for t in ths:
    t.join(120)
hits = relay.stats()["downstream"]["arena"]["hits"]
print("ok", hits, min(held), len(bad), ",".join(ends), flush=True)
relay.shutdown()
"""


def _finish(p, timeout=60):
    out, err = p.communicate(timeout=timeout)
    assert p.returncode == 0, err
    return out


@pytest.mark.parametrize(
    "relayed, ipv6",
    [([3], False), ([3, 4], False), ([3], True)],
    ids=["tp4_2+2", "2+3", "tp4_2+2_ipv6"],
)
def test_a_relay_carries_one_copy_per_node_over_the_link(relayed, ipv6):
    count, size, n_local = 6, 4 * MiB, 2
    n_remote = 1 + len(relayed)
    with two_nodes_or_skip(other_link=True) as nodes:
        nodes.require_port_counters()
        writer = nodes.python(
            0,
            _WRITER,
            str(n_local),
            str(n_remote),
            str(count),
            str(size),
            nodes.addr(0, ipv6=ipv6),
            stdin=subprocess.PIPE,
        )
        relay = nodes.python(
            1,
            _RELAY_NODE,
            "2",
            ",".join(map(str, relayed)),
            str(count),
            str(size),
            stdin=subprocess.PIPE,
        )
        try:
            line = writer.stdout.readline().split()
            assert len(line) == 2, writer.communicate(timeout=30)[1]
            addr, handle = line
            port = int(addr.rsplit(":", 1)[1])
            if ipv6:
                assert addr.startswith(f"tcp://[{nodes.addr(0, ipv6=True)}]:"), addr
            nodes.watch(port)
            before = nodes.counters()
            relay.stdin.write(handle + "\n")
            relay.stdin.flush()
            writer.stdin.write("go\n")
            writer.stdin.flush()
            sent = writer.stdout.readline().split()
            assert sent[:1] == ["sent"], writer.communicate(timeout=30)[1]
            out = relay.stdout.readline().split()
            assert out[:1] == ["ok"], relay.communicate(timeout=30)[1]
            d = nodes.counters() - before
            _finish(writer)
            _finish(relay)
        finally:
            for p in (writer, relay):
                if p.poll() is None:
                    p.kill()
                    p.wait()
    payload = count * size
    tx = d.tx(0, port)
    print(f"relay with {len(relayed)} relayed: node 0 tx {tx} for {payload} -> {tx / payload:.4f}")
    assert int(sent[1]) >= count and int(sent[2]) == 0, sent  # node 0's arena, intact
    hits, held, bad, ends = int(out[1]), int(out[2]), int(out[3]), out[4].split(",")
    assert hits >= count and held >= 1 and bad == 0, out  # node 1's arena
    assert ends == ["shutdown"] * n_remote, ends
    assert payload < tx <= 1.2 * payload, tx / payload


# Node 0: a writer with one remote reader; one message, then it stays alive (unreachable once
# the link is cut) until its stdin closes.
_PARTITION_WRITER = """
import base64, pickle, sys
from vllm_shm_arena import MessageQueue
mq = MessageQueue(1, 0, connect_ip=sys.argv[1])
print(base64.b64encode(pickle.dumps(mq.export_handle())).decode(), flush=True)
mq.wait_until_ready(timeout=60)
mq.enqueue({"i": 0}, timeout=60)
sys.stdin.read()
"""

# Node 1: the remote reader; after the first message, waits for "go" (the link is cut), then
# dequeues once more and says how that ended and after how long.
_PARTITION_READER = """
import base64, pickle, sys, time
from vllm_shm_arena import MessageQueue, WriterDiedError
r = MessageQueue.create_from_handle(pickle.loads(base64.b64decode(sys.stdin.readline())), 0)
r.wait_until_ready(timeout=60)
assert r.dequeue(timeout=60) == {"i": 0}
print("got", flush=True)
sys.stdin.readline()
t0 = time.monotonic()
try:
    r.dequeue(timeout=float(sys.argv[1]))
    print("message", flush=True)
except WriterDiedError as e:
    print("died", round(time.monotonic() - t0, 1), flush=True)
except TimeoutError:
    print("timeout", round(time.monotonic() - t0, 1), flush=True)
"""


def test_a_silent_partition_is_the_writers_death_for_a_remote_reader():
    """The link between the nodes drops every packet (no reset, nothing the sockets see): a
    remote reader waiting for its next message must not wait forever for a writer it can no
    longer hear. With VLLM_SHM_ARENA_TCP_TIMEOUT_S=3 its TCP keepalive gives up after about
    3 s and the reader raises WriterDiedError (without keepalive: its 30 s timeout)."""
    wait_s = 30
    with two_nodes_or_skip() as nodes:
        nodes.require_port_counters()  # partition() uses nft
        writer = nodes.python(0, _PARTITION_WRITER, nodes.addr(0), stdin=subprocess.PIPE)
        env = dict(nodes.node_env(), VLLM_SHM_ARENA_TCP_TIMEOUT_S="3")
        reader = nodes.python(1, _PARTITION_READER, str(wait_s), stdin=subprocess.PIPE, env=env)
        try:
            handle = writer.stdout.readline().strip()
            assert handle, writer.communicate(timeout=30)[1]
            reader.stdin.write(handle + "\n")
            reader.stdin.flush()
            assert reader.stdout.readline().split() == ["got"], reader.communicate(timeout=30)[1]
            nodes.partition()
            reader.stdin.write("go\n")
            reader.stdin.flush()
            out = reader.stdout.readline().split()
            print(f"after the partition the reader's dequeue ended with {out}")
            assert out[:1] == ["died"], (out, reader.communicate(timeout=30)[1])
            assert float(out[1]) < wait_s
        finally:
            for p in (writer, reader):
                if p.poll() is None:
                    p.kill()
                    p.wait()
