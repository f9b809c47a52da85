"""The queue across two real "nodes" (e2e/netns.py: network namespaces, each its own
/dev/shm, nftables byte counters per TCP port; root only, skipped elsewhere): the writer on
node 0 with its local readers, a relay and its relayed readers on node 1. Every message
arrives intact and in order on both nodes, both nodes' arenas are used, relayed readers hold
tensors of node 1's arena, and the queue's port carries about one copy of the payload per
remote node (not one per remote reader), over IPv4 and IPv6. A stranger on a third host
attacking the writer's port (junk, floods, stalls, 1,000 connections, a squatter on the port
once the writer is dead) gets nothing and costs the queue nothing."""

from __future__ import annotations

import queue
import subprocess
import threading
import time

import pytest

from e2e.netns import STRANGER, two_nodes_or_skip

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


# ---------------------------------------------------------------------------- the stranger
# A queue under attack from a host that is not one of its nodes (netns.py's stranger: its own
# link to node 0, from which it reaches the writer's address 10.77.0.1; routing, not a bind on
# 0.0.0.0, so the writer binds exactly as in production and the stranger's traffic, alone on
# its link, is counted there). Each child is driven by lines on its stdin and answers with
# lines on its stdout (``_Child``), so the test orders the phases and bounds every wait.

# Node 0: the writer (one local reader, ranks 1 and 2 remote: the relay and its relayed
# reader). Logs to stderr. Commands: "ready", "send A B" (messages A..B-1, enqueue without a
# timeout), "rss" (its VmRSS in KiB and its open file descriptors), "stats".
_ATTACKED_WRITER = """
import base64, logging, os, pickle, sys, time, torch
logging.basicConfig(level=logging.WARNING, format="%(name)s %(levelname)s %(message)s")
from vllm_shm_arena import MessageQueue
size, ip = int(sys.argv[1]), sys.argv[2]
mq = MessageQueue(3, 1, [0], connect_ip=ip, enable_shm_tensor_arena=True)
h = mq.export_handle()
def out(*a):
    print(*a, flush=True)
def rss_kib():
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))
out("handle", h.remote_subscribe_addr, base64.b64encode(pickle.dumps(h)).decode())
while line := sys.stdin.readline():
    cmd, *args = line.split()
    if cmd == "ready":
        t0 = time.monotonic()
        mq.wait_until_ready(timeout=60)
        out("ready", round(time.monotonic() - t0, 2))
    elif cmd == "send":
        a, b = int(args[0]), int(args[1])
        t0 = time.monotonic()
        for i in range(a, b):
            mq.enqueue({"i": i, "t": torch.arange(size // 4, dtype=torch.int32) ^ i})
        out("sent", b, round(time.monotonic() - t0, 2))
    elif cmd == "rss":
        out("rss", rss_kib(), len(os.listdir("/proc/self/fd")))
    elif cmd == "stats":
        out("stats", mq.stats()["tcp_refused"])
"""

# Every reader of the attacked queue checks each message (in order, byte-exact) and says
# "got NAME I" at the marked indices, "done NAME BAD" after the last, then dequeues once more
# and says how that ended: "end NAME KIND IS_RUNTIME_ERROR WALL_TIME | TEXT", KIND the
# exception's type, or "message" (then IS_RUNTIME_ERROR is False and TEXT the object's repr).
_CHECKING_READER = """
import sys, threading, time, torch
_lock = threading.Lock()
def out(*a):
    with _lock:
        print(*a, flush=True)
def read(name, r, count, size, marks):
    r.wait_until_ready(timeout=60)
    bad = 0
    for i in range(count):
        m = r.dequeue(timeout=60)
        if m["i"] != i or not torch.equal(m["t"], torch.arange(size // 4, dtype=torch.int32) ^ i):
            bad += 1
        del m
        if i in marks:
            out("got", name, i)
    out("done", name, bad)
    try:
        m = r.dequeue(timeout=60)
        out("end", name, "message", False, time.time(), "|", repr(m)[:200])
    except BaseException as e:
        text = str(e).replace(chr(10), " ")
        out("end", name, type(e).__name__, isinstance(e, RuntimeError), time.time(), "|", text)
"""

# Node 0: the local reader (a process of its own, so the writer's RSS is the writer's).
_ATTACKED_LOCAL = (
    _CHECKING_READER
    + """
import base64, pickle
from vllm_shm_arena import MessageQueue
count, size, marks = int(sys.argv[1]), int(sys.argv[2]), {int(m) for m in sys.argv[3].split(",")}
r = MessageQueue.create_from_handle(pickle.loads(base64.b64decode(sys.stdin.readline())), 0)
read("local", r, count, size, marks)
"""
)

# Node 1: the relay (rank 1) and its relayed reader (rank 2), threads; then why the relay's
# upstream ended ("relay-ended REASON").
_ATTACKED_RELAY = (
    _CHECKING_READER
    + """
import base64, pickle
from vllm_shm_arena import MessageQueue
count, size, marks = int(sys.argv[1]), int(sys.argv[2]), {int(m) for m in sys.argv[3].split(",")}
relay = MessageQueue.create_relay(pickle.loads(base64.b64decode(sys.stdin.readline())), 1, [2])
relayed = MessageQueue.create_from_handle(relay.downstream_handle, 1)
ths = [threading.Thread(target=read, args=(name, r, count, size, marks))
       for name, r in (("relay", relay), ("relayed", relayed))]
for t in ths:
    t.start()
for t in ths:
    t.join(120)
out("relay-ended", relay.stats().get("ended", "").replace(chr(10), " "))
relayed.shutdown()
relay.shutdown()
"""
)

# The stranger: pyzmq and plain sockets against HOST:PORT, knowing no handle and no secret,
# only the public wire formats (ZMTP 3.0, the queue's hello topic). Commands:
#   pre      subscribers (NULL; PLAIN as principals "2" and "1" with a guessed password),
#            subscription floods, a subscriber that never reads, raw junk, ZMTP greetings
#            followed by junk, a raw PLAIN peer that never reads
#   during   the same subscribers again, fresh ones (NULL, PLAIN "2") every 0.5 s until
#            release, and a thread of junk and data floods (bounded)
#   hold N   N raw TCP connections, held and never read (every tenth says a PLAIN hello)
#   release  closes everything and reports what the writer ever sent it: "released" with
#            zmq messages, handshakes that succeeded, raw bytes received, and the counts
# Every zmq socket of the stranger is polled (the stallers excepted) and monitored.
_STRANGER = r"""
import collections, os, random, resource, socket, struct, sys, threading, time
import zmq
from zmq.utils.monitor import recv_monitor_message

host, port = sys.argv[1], int(sys.argv[2])
addr = f"tcp://{host}:{port}"
soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, min(hard, 8192)), hard))
rnd = random.Random(int(sys.argv[3]))
ctx = zmq.Context()
ctx.setsockopt(zmq.BLOCKY, 0)
lock = threading.Lock()
stats = collections.Counter()
events = collections.Counter()
listening, stallers, monitors, held = [], [], [], []

def out(*a):
    print(*a, flush=True)

def junk_bytes(n):
    return rnd.randbytes(n)

# ZMTP 3.0 (rfc.zeromq.org/spec/23): the greeting, a command.
def greeting(mechanism):
    return b"\xff" + bytes(8) + b"\x7f" + b"\x03\x00" + mechanism.ljust(20, b"\0") + bytes(32)

def command(body):
    if len(body) < 256:
        return b"\x04" + bytes([len(body)]) + body
    return b"\x06" + struct.pack(">Q", len(body)) + body

def plain_hello(user, password):
    return command(b"\x05HELLO" + bytes([len(user)]) + user + bytes([len(password)]) + password)

# The queue's hello topic (protocol.py): magic, version 3, rank count, ranks.
def hello_topic(ranks):
    return b"VSA-HELLO\x00" + struct.pack("<BH", 3, len(ranks)) + b"".join(
        struct.pack("<I", r) for r in ranks)

def sub(user=None, topics=(b"",), stall=False):
    s = ctx.socket(zmq.SUB)
    s.setsockopt(zmq.LINGER, 0)
    # libzmq retries a connection that failed (twice a second here), not a peer that refused
    # its handshake: the stranger knocks again with fresh sockets.
    s.setsockopt(zmq.RECONNECT_IVL, 500)
    if user is not None:
        s.setsockopt(zmq.PLAIN_USERNAME, user)
        s.setsockopt(zmq.PLAIN_PASSWORD, b"guessed-" + user)
    if stall:
        s.setsockopt(zmq.RCVHWM, 1)
        s.setsockopt(zmq.RCVBUF, 4096)
    for t in topics:
        s.setsockopt(zmq.SUBSCRIBE, t)
    monitors.append(s.get_monitor_socket())
    s.connect(addr)
    (stallers if stall else listening).append(s)

def subscribers():
    sub()                                           # NULL, everything
    sub(b"2", (b"", hello_topic([2])))              # a guessed principal, its hello
    sub(b"1", (b"", hello_topic([1, 2])))           # the relay's principal, guessed
    flood = [bytes([i]) * 8192 for i in range(200)] + [b"x" * (1 << 20)]
    sub(None, flood)                                # subscription floods
    sub(b"2", flood + [str(i).encode() for i in range(1000)])
    sub(b"1", (b"",), stall=True)                   # subscribes, never reads

def connect(rcvbuf=None):
    c = socket.socket()
    if rcvbuf:
        c.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    c.settimeout(5)
    c.connect((host, port))
    with lock:
        stats["raw_connections"] += 1
    return c

def talk(payload, read_s=2.0):
    # Sends payload (as far as the writer lets it), then reads what the writer says until it
    # hangs up: counted as bytes received.
    c = connect()
    got = sent = 0
    try:
        view = memoryview(payload)
        while sent < len(view):
            sent += c.send(view[sent:sent + 65536])
    except OSError:
        pass
    c.settimeout(read_s)
    try:
        while b := c.recv(65536):
            got += len(b)
    except OSError:
        pass
    c.close()
    with lock:
        stats["raw_bytes_in"] += got
        stats["raw_bytes_out"] += sent

def junk():
    talk(junk_bytes(64 * 1024))                                 # raw garbage
    talk(b"\xff" + junk_bytes(64 * 1024))                       # a signature's first byte
    talk(greeting(b"PLAIN") + junk_bytes(16 * 1024))            # a greeting, then junk
    ready_sub = greeting(b"NULL") + command(b"\x05READY\x0bSocket-Type\x00\x00\x00\x03SUB")
    talk(ready_sub + b"\x00\x01\x01")                         # NULL, READY, subscribe ""
    talk(ready_sub + b"".join(b"\x00\x09\x01" + struct.pack("<Q", i) for i in range(20000))
         + b"\x02" + struct.pack(">Q", 1 << 20) + b"\x01" + bytes(1 << 20))  # subscription flood
    talk(greeting(b"CURVE") + junk_bytes(4096))
    talk(greeting(b"PLAIN") + plain_hello(b"2", b"guessed"))    # a wrong password
    talk(greeting(b"PLAIN") + command(b"\x05HELLO\xff" + b"9" * 300))  # a malformed hello

def floods(stop, rounds):
    # Data floods: a huge HELLO command (2 GiB declared), megabytes of it.
    for _ in range(rounds):
        if stop.is_set():
            return
        talk(greeting(b"PLAIN") + b"\x06" + struct.pack(">Q", 1 << 31) + junk_bytes(4 << 20),
             read_s=1.0)
        talk(junk_bytes(4 << 20), read_s=1.0)
        junk()
        stop.wait(0.3)

def stall_raw():
    # A PLAIN peer that says its hello and never reads (a tiny receive buffer).
    c = connect(rcvbuf=2048)
    c.sendall(greeting(b"PLAIN") + plain_hello(b"1", b"guessed"))
    held.append(c)

def hold(n):
    ok = failed = 0
    for k in range(n):
        try:
            c = connect(rcvbuf=4096)
            if k % 10 == 0:
                c.sendall(greeting(b"PLAIN") + plain_hello(str(k % 3).encode(), b"guessed"))
            held.append(c)
            ok += 1
        except OSError:
            failed += 1
    return ok, failed

def drain_raw(c):
    got = 0
    c.setblocking(False)
    try:
        while b := c.recv(65536):
            got += len(b)
    except OSError:
        pass
    c.close()
    return got

stop = threading.Event()
threads = []
knock_at = None
poller = zmq.Poller()
stdin = sys.stdin.fileno()
poller.register(stdin, zmq.POLLIN)
polled = set()
buf = b""
done = False
while not done:
    for s in listening + monitors:
        if s not in polled:
            poller.register(s, zmq.POLLIN)
            polled.add(s)
    ready = dict(poller.poll(100))
    for s in listening:
        while s.poll(0):
            frames = s.recv_multipart()
            stats["zmq_messages"] += 1
            stats["zmq_bytes"] += sum(len(f) for f in frames)
    for m in monitors:
        while m.poll(0):
            events[zmq.Event(recv_monitor_message(m)["event"]).name] += 1
    if knock_at is not None and time.monotonic() >= knock_at:
        sub()
        sub(b"2", (b"", hello_topic([2])))
        knock_at = time.monotonic() + 0.5
    if stdin not in ready:
        continue
    chunk = os.read(stdin, 4096)
    if not chunk:
        break
    buf += chunk
    while b"\n" in buf:
        line, buf = buf.split(b"\n", 1)
        cmd, *args = line.decode().split()
        if cmd == "pre":
            subscribers()
            junk()
            stall_raw()
            out("pre", stats["raw_connections"])
        elif cmd == "during":
            subscribers()
            t = threading.Thread(target=floods, args=(stop, int(args[0])), daemon=True)
            t.start()
            threads.append(t)
            knock_at = time.monotonic()
            out("during")
        elif cmd == "hold":
            t0 = time.monotonic()
            ok, failed = hold(int(args[0]))
            out("held", ok, failed, round(time.monotonic() - t0, 2))
        elif cmd == "release":
            knock_at = None
            stop.set()
            for t in threads:
                t.join(30)
            raw_in = sum(drain_raw(c) for c in held)
            stuck = 0
            for s in stallers:
                while s.poll(0):
                    s.recv_multipart()
                    stuck += 1
            for m in monitors:
                while m.poll(0):
                    events[zmq.Event(recv_monitor_message(m)["event"]).name] += 1
            out("released", stats["zmq_messages"] + stuck, stats["zmq_bytes"],
                events["HANDSHAKE_SUCCEEDED"], stats["raw_bytes_in"] + raw_in,
                stats["raw_connections"], stats["raw_bytes_out"],
                ",".join(f"{k}={v}" for k, v in sorted(events.items())))
            done = True
for s in listening + stallers + monitors:
    s.close(linger=0)
ctx.term()
"""

# The stranger's side of its link, read by a packet socket: the TCP payload bytes and the
# packets that came from the writer's port PORT (and what went to it), exactly, headers
# aside. "sniffing" once it reads; on "stop": "sniffed PAYLOAD_IN PACKETS_IN SYN_ACKS
# PAYLOAD_OUT DROPPED".
_SNIFFER = """
import os, select, socket, struct, sys
port = int(sys.argv[1])
s = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, socket.htons(0x0800))  # IPv4
s.setsockopt(socket.SOL_SOCKET, 33, 64 << 20)  # SO_RCVBUFFORCE: drop nothing
s.bind((sys.argv[2], 0))
print("sniffing", flush=True)
payload_in = packets_in = syn_acks = payload_out = 0
while True:
    ready, _, _ = select.select([s, sys.stdin], [], [])
    if sys.stdin in ready:
        break
    while True:
        try:
            data, where = s.recvfrom(128, socket.MSG_DONTWAIT)
        except BlockingIOError:
            break
        ihl = (data[14] & 15) * 4
        if data[23] != 6:  # not TCP
            continue
        total = struct.unpack_from(">H", data, 16)[0]
        tcp = 14 + ihl
        sport, dport = struct.unpack_from(">HH", data, tcp)
        payload = total - ihl - (data[tcp + 12] >> 4) * 4
        if where[2] != socket.PACKET_OUTGOING and sport == port:
            payload_in += payload
            packets_in += 1
            syn_acks += data[tcp + 13] & 0x12 == 0x12
        elif where[2] == socket.PACKET_OUTGOING and dport == port:
            payload_out += payload
dropped = struct.unpack("II", s.getsockopt(263, 6, 8))[1]  # SOL_PACKET, PACKET_STATISTICS
print("sniffed", payload_in, packets_in, syn_acks, payload_out, dropped, flush=True)
"""

# Node 0, after the writer's death: a squatter on the writer's address. Believes every PLAIN
# client (a ZAP handler that says 200, noting who came) and, once a subscriber is in, publishes
# pickles that make a marker directory when unpickled, in the shapes of the queue's frames:
# first the most plausible (a head of 24 or 40 bytes with a random MAC and the next sequence
# number, NEXT_SEQ: only the MAC can tell it from the writer's), then random heads of 40, 24 and
# 0 bytes and a lone pickle. "armed" once the pickle proved it works (one marker made here, by
# this process); on "go PORT", binds the port as soon as it is free and runs for RUN_S seconds;
# then "squatter SENT SUBSCRIPTIONS USERS".
_SQUATTER = """
import os, pickle, random, struct, sys, threading, time
import zmq
host, markers, next_seq, run_s = sys.argv[1], sys.argv[2], int(sys.argv[3]), float(sys.argv[4])
class Boom:
    def __init__(self, name):
        self.name = name
    def __reduce__(self):
        return (os.makedirs, (os.path.join(markers, self.name),))
def bomb(name):
    return pickle.dumps(Boom(name), protocol=5)
pickle.loads(bomb("armed-control"))
ctx = zmq.Context()
zap = ctx.socket(zmq.REP)
zap.bind("inproc://zeromq.zap.01")
users = []
def believe_everyone():
    while True:
        try:
            version, rid, _domain, _address, _identity, mechanism, *creds = zap.recv_multipart()
        except zmq.ZMQError:
            return
        users.append(mechanism.decode() + ":" + (creds[0].decode() if creds else ""))
        zap.send_multipart([version, rid, b"200", b"OK", b"squatter", b""])
threading.Thread(target=believe_everyone, daemon=True).start()
pub = ctx.socket(zmq.XPUB)
pub.setsockopt(zmq.XPUB_VERBOSE, 1)
pub.setsockopt(zmq.PLAIN_SERVER, 1)
pub.setsockopt(zmq.LINGER, 0)
rnd = random.Random(0)
seq = struct.pack("<Q", next_seq)
shapes = [
    [rnd.randbytes(16) + seq + struct.pack("<QQ", 0, 1), bomb("next-seq-40")],
    [rnd.randbytes(16) + seq, bomb("next-seq-24")],
    [rnd.randbytes(40), bomb("head-40")],
    [rnd.randbytes(40), bomb("head-40-oob"), rnd.randbytes(64)],
    [rnd.randbytes(24), bomb("head-24")],
    [b"", bomb("empty-head")],
    [bomb("one-frame")],
]
print("armed", flush=True)
port = int(sys.stdin.readline().split()[1])
t0 = time.monotonic()
while True:
    try:
        pub.bind(f"tcp://{host}:{port}")
        break
    except zmq.ZMQError:
        if time.monotonic() - t0 > 30:
            raise
        time.sleep(0.005)
print("bound", round(time.monotonic() - t0, 3), flush=True)
sent = subs = 0
end = time.monotonic() + run_s
while time.monotonic() < end:
    while pub.poll(0):
        subs += pub.recv()[:1] == b"\\x01"
    if subs:
        for frames in shapes:
            pub.send_multipart(frames)
            sent += 1
    time.sleep(0.01)
print("squatter", sent, subs, ",".join(users) or "-", flush=True)
pub.close(linger=0)
zap.close(linger=0)
ctx.term()
"""


class _Child:
    """A child on a node driven by lines: ``say`` writes one to its stdin, ``expect`` waits
    (bounded) for a stdout line starting with the given words, whatever other lines come
    first (they stay for later ``expect`` calls), and fails with the child's stderr when none
    comes. Threads read stdout and stderr, so neither pipe ever fills."""

    def __init__(self, name: str, popen: subprocess.Popen):
        self.name, self.p = name, popen
        self.lines: queue.Queue = queue.Queue()
        self.pending: list[str] = []
        self.err: list[str] = []
        threading.Thread(
            target=self._pump, args=(popen.stdout, self.lines.put), daemon=True
        ).start()
        threading.Thread(
            target=self._pump, args=(popen.stderr, self.err.append), daemon=True
        ).start()

    @staticmethod
    def _pump(f, put) -> None:
        for line in f:
            put(line.rstrip("\n"))
        put(None)

    def say(self, line: str) -> None:
        self.p.stdin.write(line + "\n")
        self.p.stdin.flush()

    def stderr(self, last: int = 60) -> str:
        return "\n".join(x for x in self.err[-last:] if x is not None)

    def expect(self, *words: str, timeout: float = 60) -> list[str]:
        def match(line: str) -> bool:
            return line.split()[: len(words)] == list(words)

        for line in self.pending:
            if match(line):
                self.pending.remove(line)
                return line.split()
        deadline = time.monotonic() + timeout
        while True:
            try:
                line = self.lines.get(timeout=max(deadline - time.monotonic(), 0.01))
            except queue.Empty:
                raise AssertionError(
                    f"{self.name}: no {' '.join(words)!r} line within {timeout} s (other "
                    f"lines: {self.pending[-5:]}); its stderr:\n{self.stderr()}"
                ) from None
            if line is None:
                self.p.wait(10)
                raise AssertionError(
                    f"{self.name} ended (rc {self.p.returncode}) before a {' '.join(words)!r} "
                    f"line; its stderr:\n{self.stderr()}"
                )
            if match(line):
                return line.split()
            self.pending.append(line)

    def stop(self) -> None:
        if self.p.poll() is None:
            self.p.kill()
        self.p.wait(10)


def _print_figures(f: dict) -> None:
    print(
        f"\nstranger test: {f['count']} messages of {f['size'] >> 20} MiB in {f['stream_s']:.1f} s"
        f" (queue link: node 0 sent {f['queue_tx']} bytes)\n"
        f"  the stranger made {f['raw_conns']} raw TCP connections ({f['held']} held at once, "
        f"in {f['hold_s']} s) and {f['zmq_conns']} zmq ones, sent {f['junk_out']} bytes of "
        f"junk; its zmq sockets' events: {f['events']}\n"
        f"  writer -> stranger: {f['payload_in']} TCP payload bytes in {f['packets_in']} packets"
        f" over {f['syn_acks']} connections (sniffed, {f['dropped']} dropped); on the port "
        f"(nft) {f['w_tx']} IP bytes, {f['w_tx'] / max(f['syn_acks'], 1):.0f} per connection; "
        f"interfaces: node 0 tx {f['if_tx0']}, stranger rx {f['if_rx_s']}\n"
        f"  stranger -> writer: {f['w_rx']} IP bytes on the port (interfaces: stranger tx "
        f"{f['if_tx_s']}, node 0 rx {f['if_rx0']})\n"
        f"  the stranger received {f['zmq_msgs']} zmq messages ({f['zmq_bytes']} bytes), "
        f"{f['handshakes']} successful handshakes, {f['raw_in']} bytes on raw sockets\n"
        f"  writer: tcp_refused {f['tcp_refused']}; VmRSS {f['rss_start']} KiB at start, "
        f"{f['rss_warm']} KiB warm, {f['rss_held']} KiB with the connections held: "
        f"{(f['rss_held'] - f['rss_warm']) / 1024:+.1f} MiB; open fds {f['fds_warm']} -> "
        f"{f['fds_held']}\n"
        f"  squatter: bound {f['bound_s']} s after 'go', sent {f['sq_sent']} forged messages, "
        f"saw {f['sq_subs']} subscriptions from {f['sq_users']}"
    )
    for name, (kind, _, after, text) in f["ends"].items():
        print(f"  {name} reader, {after:.2f} s after the kill: {kind}: {text[:160]}")


@pytest.mark.timeout(240)
def test_a_stranger_on_the_writers_port_gets_nothing_and_costs_nothing(tmp_path):
    """A stranger on its own link to node 0 (no handle, no secret) attacks the writer's TCP
    port while a real two-node queue runs: writer and a local reader on node 0, a relay and
    its relayed reader on node 1, ``count`` messages of ``size`` bytes. It subscribes (NULL;
    PLAIN with guessed principals) before the readers join and during the stream, floods
    subscriptions and data, sends junk and greetings followed by junk, stalls (subscribed,
    never reading), holds 1,000 TCP connections; after the writer's SIGKILL a squatter binds
    its port on node 0 (the writer's host: the address is node 0's), believes every PLAIN
    client and publishes pickles shaped like the queue's frames.

    Every reader gets every message intact and in order; the writer's enqueue (no timeout)
    never waits on the stranger; the writer sends the stranger handshake bytes only (sniffed
    and counted on the stranger's link) and refuses it (stats, a log line naming its address);
    its RSS barely grows with 1,000 connections held; after its death no reader unpickles the
    squatter's frames: each one's next dequeue raises a clear RuntimeError, soon."""
    count, size, first, n_hold = 300, 4 * MiB, 100, 1000
    n_silent = n_hold - n_hold // 10  # every tenth held connection says a (refused) hello
    marks = f"{first - 1},{count - 1}"
    markers = tmp_path / "markers"
    markers.mkdir()
    f: dict = {"count": count, "size": size}
    with two_nodes_or_skip(stranger=True) as nodes:
        nodes.require_port_counters()
        host = nodes.addr(0)
        kids: list[_Child] = []

        def child(name: str, node, code: str, *args: str) -> _Child:
            kids.append(_Child(name, nodes.python(node, code, *args, stdin=subprocess.PIPE)))
            return kids[-1]

        try:
            # The readers and the squatter import first, then wait on stdin.
            writer = child("writer", 0, _ATTACKED_WRITER, str(size), host)
            local = child("local reader", 0, _ATTACKED_LOCAL, str(count), str(size), marks)
            relay = child("relay node", 1, _ATTACKED_RELAY, str(count), str(size), marks)
            squatter = child("squatter", 0, _SQUATTER, host, str(markers), str(count + 1), "6")
            _, addr, handle = writer.expect("handle")
            assert addr.startswith(f"tcp://{host}:"), addr
            port = int(addr.rsplit(":", 1)[1])
            nodes.watch(port)
            sniffer = child("sniffer", STRANGER, _SNIFFER, str(port), "vsa-s")
            sniffer.expect("sniffing")
            before = nodes.counters()
            writer.say("rss")
            f["rss_start"] = int(writer.expect("rss")[1])
            stranger = child("stranger", STRANGER, _STRANGER, host, str(port), "7")

            # Before the readers join: subscribers, junk, a staller. The handshake completes.
            stranger.say("pre")
            stranger.expect("pre")
            for kid in (local, relay):
                kid.say(handle)
            writer.say("ready")
            writer.expect("ready")

            # During the stream: subscribers again, junk and floods (a thread).
            stranger.say("during 20")
            stranger.expect("during")
            t_stream = time.monotonic()
            writer.say(f"send 0 {first}")
            writer.expect("sent", timeout=90)
            local.expect("got", "local", str(first - 1))
            relay.expect("got", "relay", str(first - 1))
            relay.expect("got", "relayed", str(first - 1))

            # 1,000 connections held while the stream is quiet (every message so far read, so
            # the writer's RSS holds no backlog): its RSS and descriptors before and during.
            # (The RSS at start is before the stream's own buffers: not the baseline.)
            writer.say("rss")
            f["rss_warm"], f["fds_warm"] = map(int, writer.expect("rss")[1:3])
            stranger.say(f"hold {n_hold}")
            _, f["held"], failed, f["hold_s"] = stranger.expect("held", timeout=60)
            assert int(f["held"]) == n_hold, f"{failed} of the stranger's connections failed"
            deadline = time.monotonic() + 5
            while True:  # until the writer's ZeroMQ accepted them all
                writer.say("rss")
                f["rss_held"], f["fds_held"] = map(int, writer.expect("rss")[1:3])
                if f["fds_held"] - f["fds_warm"] >= n_silent or time.monotonic() > deadline:
                    break
                time.sleep(0.2)

            # The rest of the stream, the connections held, the stallers stalled.
            writer.say(f"send {first} {count}")
            writer.expect("sent", timeout=90)
            bad = {
                "local": local.expect("done", "local")[2],
                "relay": relay.expect("done", "relay")[2],
                "relayed": relay.expect("done", "relayed")[2],
            }
            f["stream_s"] = time.monotonic() - t_stream
            writer.say("stats")
            f["tcp_refused"] = int(writer.expect("stats")[1])
            stranger.say("release")
            released = stranger.expect("released", timeout=60)
            stranger.p.wait(30)
            sniffer.say("stop")
            sniffed = sniffer.expect("sniffed", timeout=30)
            d = nodes.counters() - before

            # The writer dies; the squatter takes its port at once.
            squatter.expect("armed")
            squatter.say(f"go {port}")
            writer.p.kill()
            t_kill = time.time()
            writer.p.wait(10)
            ends = {
                "local": local.expect("end", "local", timeout=30),
                "relay": relay.expect("end", "relay", timeout=30),
                "relayed": relay.expect("end", "relayed", timeout=30),
            }
            relay_ended = " ".join(relay.expect("relay-ended", timeout=30)[1:])
            f["bound_s"] = squatter.expect("bound", timeout=30)[1]
            _, f["sq_sent"], f["sq_subs"], f["sq_users"] = squatter.expect("squatter", timeout=30)
            writer_log = writer.stderr(last=100_000)
        finally:
            for kid in kids:
                kid.stop()

    (
        f["zmq_msgs"],
        f["zmq_bytes"],
        f["handshakes"],
        f["raw_in"],
        f["raw_conns"],
        f["junk_out"],
        f["events"],
    ) = released[1:8]
    events = dict(e.split("=") for e in f["events"].split(",") if e)
    f["zmq_conns"] = events.get("CONNECTED", "0")
    f["payload_in"], f["packets_in"], f["syn_acks"], _, f["dropped"] = map(int, sniffed[1:6])
    f["w_tx"], f["w_rx"] = d.tx(0, port, link="s"), d.rx(0, port, link="s")
    f["if_tx0"], f["if_rx0"] = d.tx(0, "if", link="s"), d.rx(0, "if", link="s")
    f["if_tx_s"], f["if_rx_s"] = d.tx(STRANGER, "if", link="s"), d.rx(STRANGER, "if", link="s")
    f["queue_tx"] = d.tx(0, port)
    # name -> (the exception's type or "message", a RuntimeError?, s after the kill, text)
    f["ends"] = {
        name: (end[2], end[3] == "True", float(end[4]) - t_kill, " ".join(end[6:]))
        for name, end in ends.items()
    }
    _print_figures(f)

    # Every reader got every message, in order, byte-exact (the writer's wait_until_ready and
    # enqueue calls came back within the bounded waits above).
    assert bad == {"local": "0", "relay": "0", "relayed": "0"}, bad
    assert f["queue_tx"] >= count * size  # the relay's one copy went over the queue link

    # The stranger got nothing of the queue: no handshake, no message, no message byte. What
    # the writer sent it is TCP handshakes and ZMTP greetings/errors: the payload well under
    # 64 KiB all told (each message is 4 MiB; measured: about 20 KB, mostly the 10-byte
    # signature per connection), the IP bytes a few hundred per connection (measured: about
    # 240: SYN-ACK, the signature or a greeting and ERROR, ACKs, FIN), a quarter message at most.
    assert int(f["handshakes"]) == 0 and int(f["zmq_msgs"]) == 0, f["events"]
    assert int(events.get("HANDSHAKE_FAILED_AUTH", 0)) > 0, f["events"]  # ZAP said no
    assert f["dropped"] == 0 and f["syn_acks"] >= n_hold, sniffed
    assert f["payload_in"] < 64 * 1024, f["payload_in"]
    assert int(f["raw_in"]) <= f["payload_in"]
    assert f["w_tx"] <= 512 * f["syn_acks"] and f["w_tx"] < size // 4, f["w_tx"]
    assert f["if_tx0"] < size // 4  # everything on the link, Ethernet headers included

    # Refused, counted and logged with the stranger's address.
    assert f["tcp_refused"] > 0
    stranger_addr = nodes.addr(STRANGER)
    assert f"refused a peer of the queue's TCP socket from {stranger_addr}" in writer_log, (
        writer_log[-3000:]
    )

    # 1,000 connections cost the writer little memory.
    assert f["fds_held"] - f["fds_warm"] >= 0.9 * n_silent, (f["fds_warm"], f["fds_held"])
    assert f["rss_held"] - f["rss_warm"] <= 20 * 1024, (f["rss_warm"], f["rss_held"])

    # After the writer's death: the squatter reached the relay (it presented its principal's
    # credentials and subscribed), and no reader unpickled anything of it.
    assert "PLAIN:1" in f["sq_users"].split(",") and int(f["sq_subs"]) > 0, f["sq_users"]
    assert sorted(p.name for p in markers.iterdir()) == ["armed-control"]
    clear = ("did not come from its writer", "was not re-established", "writer process died")
    for name, (kind, runtime_error, after, text) in f["ends"].items():
        assert runtime_error, (name, kind, text)  # not a message, not an error of another kind
        assert any(c in text for c in clear) and after < 10, (name, kind, after, text)
    assert "did not come from its writer" in relay_ended or "re-established" in relay_ended
