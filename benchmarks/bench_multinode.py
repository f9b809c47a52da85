"""The queue across nodes, alone: a writer with 2 local readers and one remote "node" of 2 or 3
readers, over loopback TCP (127.0.0.1), relay off (every remote reader its own TCP
subscription, the pre-relay queue) vs on (one relay for the node, the others relayed).

Per configuration and message size: bytes the queue's TCP connections carried per message
divided by the payload (counted at the socket level: the kernel's ``bytes_acked`` of the
established connections from the writer's port, ``ss -ti``; "n/a" where ss does not say),
and the p50 delivery latency (enqueue start -> dequeue returned) and consume latency
(-> the reader has summed every byte of the tensor) of the remote node's readers and of the
writer's local readers.

Every "node" here shares the host's memory and CPUs, so the latencies show the queue's own
costs, not a network's. Writes benchmarks/results/multinode/bench_multinode.{md,json}.
Usage: python benchmarks/bench_multinode.py [--messages N] [--sizes-mib 8,64]
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
sys.path.insert(0, str(REPO / "tests" / "python"))

import multinode_helpers as M  # noqa: E402
import torch  # noqa: E402

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


def run(n_remote: int, relay: bool, size: int, n: int) -> dict:
    """One configuration: 2 local readers, a remote node of ``n_remote`` readers."""
    ctx = mp.get_context("fork")
    n_local = 2
    mq = MessageQueue(
        n_local + n_remote, n_local, [0, 1], connect_ip="127.0.0.1", enable_shm_tensor_arena=True
    )
    h = mq.export_handle()
    q, hq, go = ctx.Queue(), ctx.Queue(), ctx.Event()
    procs = []

    def start(target, *args):
        p = ctx.Process(target=target, args=args, daemon=True)
        p.start()
        procs.append(p)

    for rank in (0, 1):
        start(_reader, h, rank, n, q, f"local{rank}")
    remote = list(range(n_local, n_local + n_remote))
    if relay:
        start(_relay, h, remote[0], remote[1:], n, q, hq, go)
        for i in range(1, n_remote):
            start(_relayed, hq, i, n, q)
    else:
        for rank in remote:
            start(_reader, h, rank, n, q, f"remote{rank}")
    mq.wait_until_ready(timeout=120)
    port = M.port_of(h.remote_subscribe_addr)
    t = torch.arange(size // 4, dtype=torch.int32)
    base = M.tcp_bytes_from_port(port) or 0
    for _ in range(n):
        mq.enqueue({"t": t, "ts": time.monotonic_ns()}, timeout=120)
        time.sleep(0.1)  # one message at a time: latency, not throughput
    reps = [q.get(timeout=300) for _ in range(n_local + n_remote)]
    time.sleep(0.3)
    link = M.tcp_bytes_from_port(port)
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
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--messages", type=int, default=20)
    ap.add_argument("--sizes-mib", default="8,64")
    args = ap.parse_args()
    if os.environ.get("RATE"):
        print("RATE is honoured by the two-node harness only; this run is loopback, unlimited")
    rows = []
    for size in [int(x) * MiB for x in args.sizes_mib.split(",")]:
        for n_remote in (2, 3):
            for relay in (False, True):
                row = run(n_remote, relay, size, args.messages)
                rows.append(row)
                print(json.dumps(row), flush=True)
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "bench_multinode.json").write_text(json.dumps(rows, indent=2) + "\n")
    lines = [
        "# The queue across nodes (loopback): relay off vs on",
        "",
        "2 local readers + a remote node of 2 or 3 readers on 127.0.0.1; link bytes counted at",
        "the socket level (kernel bytes_acked on the writer's port, `ss -ti`) per message /",
        f"payload; {args.messages} messages per cell, 0.1 s apart; p50 latencies in ms. With",
        f"fewer CPUs ({os.cpu_count()} here) than readers, a message that takes longer than 0.1 s",
        "to reach and sum everywhere makes the next ones wait: latencies then include queueing.",
        "",
        "| size MiB | remote node | relay | link bytes / payload | remote delivery | remote "
        "consume | local delivery | local consume |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lb = r["link_bytes_per_payload"]
        lines.append(
            f"| {r['size_mib']:.0f} | {r['remote_node_readers']} | {'on' if r['relay'] else 'off'} "
            f"| {'n/a' if lb is None else f'{lb:.3f}'} | {r['remote_delivery_p50_ms']:.2f} "
            f"| {r['remote_consume_p50_ms']:.2f} | {r['local_delivery_p50_ms']:.2f} "
            f"| {r['local_consume_p50_ms']:.2f} |"
        )
    (OUT / "bench_multinode.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
