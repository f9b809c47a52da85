"""The queue across nodes, alone: a writer with 2 local readers and one remote node of 2 or 3
readers, relay off (every remote reader its own TCP subscription, the pre-relay queue) vs on
(one relay for the node, the others relayed).

Two placements (``--mode``):

* ``netns`` (default where root may make namespaces): two "nodes" of
  ``e2e/netns_nodes.sh`` (e2e/netns.py) joined by a veth pair rate-limited to
  ``RATE`` (default 10gbit; ``RATE=`` for none): the writer in node 0's network namespace, its
  local readers beside it, the remote node's readers in node 1's network, mount and IPC
  namespaces (its own /dev/shm, so the relay's arena is node 1's own). Link bytes: nftables
  counters of the writer's TCP port on the link, both directions, IP bytes.
* ``loopback``: everything on 127.0.0.1 in the host's namespaces; link bytes at the socket
  level (the kernel's ``bytes_acked`` of the connections from the writer's port, ``ss -ti``;
  "n/a" where ss does not say).

Per configuration and message size: link bytes per message divided by the payload, the p50
delivery latency (enqueue start -> dequeue returned) and consume latency (-> the reader has
summed every byte of the tensor) of the remote node's readers and of the writer's local
readers, and the writer process's CPU time per message (all its threads: the copy into the
arena, ZeroMQ's I/O thread pushing the TCP copies, the ZAP handler).
``--security authenticated|encrypted`` sets VLLM_SHM_ARENA_TCP_SECURITY for the writer (the
readers follow its handle); ``--stem`` names the result files (default by mode), so runs of
another checkout or setting can sit beside each other.

Both nodes share this machine's memory and CPUs (and clock), so the latencies are the queue's
costs plus the link's rate, not a real network's.

Writes benchmarks/results/multinode/bench_multinode[_loopback].{md,json} (or ``--stem``).
Usage: python benchmarks/bench_multinode.py [--mode auto|netns|loopback] [--messages N]
       [--sizes-mib 8,64] [--security authenticated|encrypted] [--stem NAME]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import torch  # noqa: E402

from e2e import netns  # noqa: E402
from vllm_shm_arena import MessageQueue  # noqa: E402

OUT = REPO / "benchmarks" / "results" / "multinode"
MiB = 1 << 20


def _consume(r, n, q, name):
    """Dequeues ``n`` messages; per message (delivery_s, consume_s) from the enqueue stamp."""
    torch.set_num_threads(1)
    lat = []
    for _ in range(n):
        m = r.dequeue(timeout=120)
        got = time.monotonic_ns()
        int(m["t"].view(torch.int32).sum())  # every byte read
        done = time.monotonic_ns()
        lat.append(((got - m["ts"]) / 1e9, (done - m["ts"]) / 1e9))
        del m
    q.put({"name": name, "lat": lat})


def _reader(handle, rank, n, q, name):
    torch.set_num_threads(1)
    r = MessageQueue.create_from_handle(handle, rank)
    r.wait_until_ready(timeout=120)
    _consume(r, n, q, name)
    try:
        r.dequeue(timeout=60)
    except RuntimeError:
        pass


def _relay(handle, rank, relayed, n, q, hq, go):
    torch.set_num_threads(1)
    relay = MessageQueue.create_relay(handle, rank, relayed)
    for _ in relayed:
        hq.put(relay.downstream_handle)
    relay.wait_until_ready(timeout=120)
    _consume(relay, n, q, f"remote{rank}")
    go.wait(120)
    relay.shutdown()


def _relayed(hq, index, n, q):
    torch.set_num_threads(1)
    r = MessageQueue.create_from_handle(hq.get(timeout=120), index)
    r.wait_until_ready(timeout=120)
    _consume(r, n, q, f"relayed{index}")
    try:
        r.dequeue(timeout=60)
    except RuntimeError:
        pass


def gap_s(size: int) -> float:
    """The pause between two messages: 0.1 s per 8 MiB (at least 0.1 s), so that on two CPUs
    a message has reached and been summed everywhere before the next (latency, not
    queueing)."""
    return max(0.1, 0.1 * size / (8 * MiB))


def _on_node(nodes, node, target, *args):
    """A child's first step on the remote node: its namespaces (a forked child is
    single-threaded, so it may change its mount namespace), then ``target``."""
    nodes.enter(node)
    target(*args)


def run(n_remote: int, relay: bool, size: int, n: int, nodes=None) -> dict:
    """One configuration: 2 local readers, a remote node of ``n_remote`` readers; on
    ``nodes`` (this process in node 0's network namespace) or over loopback (None)."""
    ctx = mp.get_context("fork")
    n_local = 2
    ip = "127.0.0.1" if nodes is None else nodes.addr(0)
    mq = MessageQueue(
        n_local + n_remote, n_local, [0, 1], connect_ip=ip, enable_shm_tensor_arena=True
    )
    h = mq.export_handle()
    q, hq, go = ctx.Queue(), ctx.Queue(), ctx.Event()
    procs = []

    def start(target, *args, remote=False):
        if remote and nodes is not None:
            target, args = _on_node, (nodes, 1, target, *args)
        p = ctx.Process(target=target, args=args, daemon=True)
        p.start()
        procs.append(p)

    for rank in (0, 1):
        start(_reader, h, rank, n, q, f"local{rank}")
    remote = list(range(n_local, n_local + n_remote))
    if relay:
        start(_relay, h, remote[0], remote[1:], n, q, hq, go, remote=True)
        for i in range(1, n_remote):
            start(_relayed, hq, i, n, q, remote=True)
    else:
        for rank in remote:
            start(_reader, h, rank, n, q, f"remote{rank}", remote=True)
    mq.wait_until_ready(timeout=120)
    port = netns.port_of(h.remote_subscribe_addr)

    def link_bytes():
        if nodes is None:
            return netns.tcp_bytes_from_port(port)
        c = nodes.counters()
        return c.tx(0, port) + c.rx(0, port)

    if nodes is not None:
        nodes.watch(port)
    t = torch.arange(size // 4, dtype=torch.int32)
    base = link_bytes() or 0
    cpu0 = time.process_time()
    for _ in range(n):
        mq.enqueue({"t": t, "ts": time.monotonic_ns()}, timeout=120)
        time.sleep(gap_s(size))  # one message at a time: latency, not throughput
    reps = [q.get(timeout=300) for _ in range(n_local + n_remote)]
    time.sleep(0.3)
    writer_cpu = time.process_time() - cpu0
    link = link_bytes()
    mq.shutdown()
    go.set()
    for p in procs:
        p.join(30)
        if p.is_alive():
            p.kill()

    def p50(names, i):
        vals = [x[i] for r in reps if r["name"].startswith(names) for x in r["lat"]]
        return statistics.median(vals) * 1e3

    remote_names = ("remote", "relayed")
    return {
        "remote_node_readers": n_remote,
        "relay": relay,
        "size_mib": size / MiB,
        "messages": n,
        "link_bytes_per_payload": None if link is None else (link - base) / (n * size),
        "remote_delivery_p50_ms": p50(remote_names, 0),
        "remote_consume_p50_ms": p50(remote_names, 1),
        "local_delivery_p50_ms": p50(("local",), 0),
        "local_consume_p50_ms": p50(("local",), 1),
        "writer_cpu_ms_per_message": writer_cpu / n * 1e3,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--mode", choices=("auto", "netns", "loopback"), default="auto")
    ap.add_argument("--messages", type=int, default=20)
    ap.add_argument("--sizes-mib", default="8,64")
    ap.add_argument("--security", choices=("authenticated", "encrypted"), default=None)
    ap.add_argument("--stem", default=None)
    args = ap.parse_args()
    if args.security:
        os.environ["VLLM_SHM_ARENA_TCP_SECURITY"] = args.security

    why = netns.unavailable_reason()
    mode = args.mode
    if mode == "auto":
        mode = "loopback" if why else "netns"
        if why:
            print(f"bench-multinode: two nodes cannot be made here ({why}): loopback")
    elif mode == "netns" and why:
        sys.exit(f"bench-multinode: --mode netns: {why}")
    rate = os.environ.get("RATE", "10gbit") if mode == "netns" else None
    if mode == "loopback" and os.environ.get("RATE"):
        print("RATE is honoured by the two-node placement only; this run is loopback, unlimited")
    nodes = None
    if mode == "netns":
        nodes = netns.TwoNodes(prefix="vsabench", rate=rate or None, shm_size="4g").up()
        # Before any queue exists: the zmq context's threads start in this namespace.
        nodes.enter(0, mount=False)
    rows = []
    try:
        for size in [int(x) * MiB for x in args.sizes_mib.split(",")]:
            for n_remote in (2, 3):
                for relay in (False, True):
                    row = run(n_remote, relay, size, args.messages, nodes)
                    row["mode"] = mode
                    row["rate"] = rate
                    row["security"] = args.security or "default"
                    rows.append(row)
                    print(json.dumps(row), flush=True)
    finally:
        if nodes is not None:
            nodes.down()
    OUT.mkdir(parents=True, exist_ok=True)
    stem = args.stem or ("bench_multinode" if mode == "netns" else "bench_multinode_loopback")
    (OUT / f"{stem}.json").write_text(json.dumps(rows, indent=2) + "\n")
    if mode == "netns":
        where = [
            "# The queue across two nodes (network namespaces): relay off vs on",
            "",
            "Writer and 2 local readers on node 0, a remote node of 2 or 3 readers on node 1 (its",
            "own network, mount and IPC namespaces: its own /dev/shm), joined by a veth pair",
            f"limited to {rate or 'no rate limit'} (tc tbf). Link bytes: nftables counters of",
            "the writer's TCP port, both directions, IP bytes, per message / payload;",
        ]
    else:
        where = [
            "# The queue across nodes (loopback): relay off vs on",
            "",
            "2 local readers + a remote node of 2 or 3 readers on 127.0.0.1; link bytes counted",
            "at the socket level (kernel bytes_acked on the writer's port, `ss -ti`) per message",
            "/ payload;",
        ]
    lines = where + [
        f"{args.messages} messages per cell, 0.1 s apart per 8 MiB (`gap_s`); p50 latencies in",
        f"ms. With fewer CPUs ({os.cpu_count()} here) than readers, a message that takes longer",
        "than that to reach and sum everywhere makes the next ones wait: latencies then include",
        "queueing.",
        f"TCP security: {args.security or 'the default'}; writer CPU: the writer process's, all",
        "threads, per message (ms).",
        f"Written by `benchmarks/bench_multinode.py --mode {mode}` ({time.strftime('%Y-%m-%d')}).",
        "",
        "| size MiB | remote node | relay | link bytes / payload | remote delivery | remote "
        "consume | local delivery | local consume | writer CPU |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lb = r["link_bytes_per_payload"]
        lines.append(
            f"| {r['size_mib']:.0f} | {r['remote_node_readers']} | {'on' if r['relay'] else 'off'} "
            f"| {'n/a' if lb is None else f'{lb:.3f}'} | {r['remote_delivery_p50_ms']:.2f} "
            f"| {r['remote_consume_p50_ms']:.2f} | {r['local_delivery_p50_ms']:.2f} "
            f"| {r['local_consume_p50_ms']:.2f} | {r['writer_cpu_ms_per_message']:.2f} |"
        )
    (OUT / f"{stem}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
