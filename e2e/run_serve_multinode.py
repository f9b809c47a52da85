"""The two-node serve test's driver: a real `vllm serve` across two "nodes" on one machine,
flag on and flag off, checked end to end.

Run by ``e2e/serve_test.sh multinode`` (``make serve-multinode-test``) as root with
.venv-serve's python, after the venv and the tiny model exist. The nodes are
``e2e/netns_nodes.sh``'s (through e2e/netns.py): two network namespaces, each with
its own mount namespace and private tmpfs ``/dev/shm`` (vLLM's ``in_the_same_node_as`` probes
shared memory by name, so a shared /dev/shm would make every rank look local), joined by the
queue link (10.77.0.x, where ``VLLM_HOST_IP`` and so the broadcast queue's TCP socket live) and
a second link (10.78.0.x) for everything else: ``--master-addr`` and ``GLOO_SOCKET_IFNAME`` put
torch.distributed's store and the TP collectives there.

For each configuration (``--enable-shm-tensor-arena``, then ``--no-enable-shm-tensor-arena``)
it starts node 0 (``vllm serve ... --tensor-parallel-size 4 --nnodes 2 --node-rank 0``, the
API server, the engine and local ranks 0 and 1) and node 1 (the same with ``--headless
--node-rank 1``: ranks 2 and 3), waits for ``/health``, finds the broadcast queue's TCP port
(the one port node 0 listens on with connections from node 1), counts that port's bytes on the
queue link with nftables, sends image requests, stops both nodes with SIGINT, and checks:

* per image, the bytes on the queue's port (both directions, IP bytes) over the image's
  pixel_values bytes: with the flag on at most ``--max-link-ratio`` (1.2) per remote node (one
  relay per node receives each message once), with the flag off recorded (vLLM sends one copy
  per remote worker: about 2 here);
* the arena is used on both nodes: per image, node 0's writer and node 1's relay each wrote
  exactly the image's pixel_values into their node's arena (``vllm:shm_arena_hits_total`` +1
  and ``vllm:shm_arena_bytes_total`` + pixel_values bytes, read from each node's own
  ``PROMETHEUS_MULTIPROC_DIR``), and both logs name the arena (node 0: the queue's line, node 1:
  the relay's);
* ``VLLM_SHM_ARENA_DEBUG_CHECKSUM=1`` on both nodes: no mismatch metric or log line;
* with the flag off no arena line or hit on either node (stock vLLM);
* temperature 0, a fixed seed: identical token ids and logprobs per request, flag on vs off, and
  a different output per image (so the comparison can see a wrong image);
* no ``vsa_`` name left in either node's /dev/shm once both stopped; both stop on SIGINT.

Writes ``serve_multinode.json`` and ``serve_multinode.md`` to ``--results`` (also when a check
fails, marked FAIL) and exits 1 if any check failed. Every wait is bounded; the nodes (and
anything left on them) are removed at the end, whatever happened.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import asdict
from typing import Any

import serve_lib as st  # e2e/, beside this file
from netns import TwoNodes  # e2e/, beside this file

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)

PREFIX = "vsaserve"
API_PORT = 8000
MASTER_PORT = 29501
TP = 4
LOCAL = 2
#: The relay's line in node 1's log (vllm_shm_arena/vllm_multinode.py).
RELAY_LINE = "relays the broadcast queue to ranks"
#: Node 0's line when our queue serves readers on several nodes (vllm_plugin.py).
MULTINODE_ARENA_LINE = "the C++ shm tensor arena"
STANDS_ASIDE_LINE = "using vLLM's own MessageQueue"


# ---------------------------------------------------------------------------------------------
# metrics of one node's processes


def node_metrics(prom_dir: str) -> dict[str, float]:
    """The ``vllm:shm_arena_*`` samples the processes of one node wrote into their
    ``PROMETHEUS_MULTIPROC_DIR`` (summed over the processes as a /metrics endpoint would)."""
    from prometheus_client import CollectorRegistry, generate_latest, multiprocess

    reg = CollectorRegistry()
    multiprocess.MultiProcessCollector(reg, path=prom_dir)
    out = {}
    for line in generate_latest(reg).decode().splitlines():
        if not line.startswith("vllm:shm_arena_"):
            continue
        m = st.SAMPLE.match(line.strip())
        if m:
            out[m.group("name") + (m.group("labels") or "")] = float(m.group("v"))
    return out


class Node(st.ProcessGroup):
    """One node's ``vllm serve`` (node 0: the API server and engine; node 1: headless)."""

    def __init__(
        self,
        nodes: TwoNodes,
        n: int,
        args,
        config: str,
        flag: str,
        log_path: str,
        extra_env: dict[str, str] | None = None,
    ):
        self.nodes, self.n, self.args, self.config = nodes, n, args, config
        self.log_path = log_path
        self.prom_dir = tempfile.mkdtemp(prefix=f"vsa-mn-prom-{config}-n{n}-")
        self.proc: subprocess.Popen | None = None
        self.stop: dict[str, Any] = {}
        master = TwoNodes.addr(0, link="o")
        self.cmd = [
            os.path.join(os.path.dirname(sys.executable), "vllm"),
            "serve",
            args.model,
            "--tensor-parallel-size",
            str(TP),
            "--distributed-executor-backend",
            "mp",
            "--nnodes",
            "2",
            "--node-rank",
            str(n),
            "--master-addr",
            master,
            "--master-port",
            str(MASTER_PORT),
            # On CPU the platform reports one device: without naming two, the workers' response
            # queue takes local worker 1 for a remote one.
            "--device-ids",
            "0,1",
            "--enforce-eager",
            flag,
            *st.model_args(args.shutdown_timeout),
        ]
        if n == 0:
            self.cmd += ["--host", "127.0.0.1", "--port", str(API_PORT)]
        else:
            self.cmd += ["--headless"]
        self.cmd += args.extra_vllm_args
        self.env = dict(os.environ)
        self.env.update(
            {
                "VLLM_CPU_OMP_THREADS_BIND": args.omp_bind,
                "VLLM_CPU_KVCACHE_SPACE": str(args.kv_cache_gib),
                "PROMETHEUS_MULTIPROC_DIR": self.prom_dir,
                "VLLM_SHM_ARENA_DEBUG_CHECKSUM": "1",
                "VLLM_NO_USAGE_STATS": "1",
                "DO_NOT_TRACK": "1",
                "HF_HUB_OFFLINE": "1",
                "TRANSFORMERS_OFFLINE": "1",
            }
        )
        self.env.update(extra_env or {})

    def start(self) -> None:
        log = open(self.log_path, "w")
        log.write("$ " + " ".join(self.cmd) + "\n")
        log.flush()
        self.proc = self.nodes.popen(
            self.n,
            self.cmd,
            env=self.env,
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
        log.close()

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def shutdown(self, timeout: float, follow_s: float = 0.0) -> dict[str, Any]:
        """Waits up to ``follow_s`` for the process to end by itself (a headless node follows
        its head), else SIGINT; then waits (bounded) for the process and its whole group."""
        out: dict[str, Any] = {"signal": "SIGINT"}
        if self.proc is not None and follow_s > 0:
            t0 = time.monotonic()
            try:
                self.proc.wait(timeout=follow_s)
                out.update(signal=None, ended_by_itself_s=round(time.monotonic() - t0, 2))
            except subprocess.TimeoutExpired:
                pass
        if out["signal"] is None:
            out["rc"] = self.proc.returncode
        elif self.proc is None or self.proc.poll() is not None:
            out.update(rc=None if self.proc is None else self.proc.returncode, already_exited=True)
        else:
            t0 = time.monotonic()
            self.proc.send_signal(signal.SIGINT)
            try:
                out["rc"] = self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                out["rc"] = None
            out["stop_s"] = round(time.monotonic() - t0, 2)
        deadline = time.monotonic() + 15
        while self.proc is not None and self._group_alive() and time.monotonic() < deadline:
            time.sleep(0.2)
        out["group_left_running"] = self.proc is not None and self._group_alive()
        if out.get("rc") is None or out["group_left_running"]:
            self.kill()
        self.stop = out
        return out

    def shm_names(self) -> list[str]:
        """``vsa_`` names in this node's private /dev/shm."""
        r = subprocess.run(
            ["bash", str(ROOT + "/e2e/netns_nodes.sh"), "exec", str(self.n), "ls", "/dev/shm"],
            env=self.nodes.node_env(),
            capture_output=True,
            text=True,
            timeout=30,
        )
        return sorted(x for x in r.stdout.split() if x.startswith("vsa_"))


# ---------------------------------------------------------------------------------------------
# the queue's port


def tcp_retransmits() -> int:
    """TCP segments retransmitted so far in this process's network namespace (node 0's)."""
    with open("/proc/self/net/snmp") as f:
        rows = [ln.split() for ln in f if ln.startswith("Tcp:")]
    return int(rows[1][rows[0].index("RetransSegs")])


def _ss(*args: str) -> list[str]:
    r = subprocess.run(["ss", "-Htnp", *args], capture_output=True, text=True, timeout=30)
    return [ln for ln in r.stdout.splitlines() if ln.strip()]


def _port(addr: str) -> int:
    return int(addr.rsplit(":", 1)[1])


def ports_from(peer: str) -> dict[int, str]:
    """Node 0's listening TCP ports that have an established connection from ``peer`` (node
    1), each with the name of the process listening there. torch.distributed's store and
    gloo are on the other link; what is left is the broadcast queue's socket (vLLM's XPUB or
    ours, in the engine core, which runs the executor) and the workers' response queues. Run
    in node 0's netns."""
    # With a state filter ss prints no State column: Recv-Q Send-Q Local Peer [Process].
    owner = {}
    for ln in _ss("state", "listening"):
        f = ln.split()
        m = re.search(r'\(\("([^"]*)"', ln)
        owner[_port(f[2])] = m.group(1) if m else "?"
    est = set()
    for ln in _ss("state", "established"):
        f = ln.split()
        if f[3].rsplit(":", 1)[0].strip("[]") == peer:
            est.add(_port(f[2]))
    return {p: owner[p] for p in sorted(est & owner.keys())}


def queue_port(ports: dict[int, str]) -> int:
    """The broadcast queue's port: the one the engine core listens on."""
    engine = [p for p, name in ports.items() if "EngineCor" in name]
    if len(engine) != 1:
        raise st.CheckFailed(
            f"expected one port of the engine core with connections from node 1: {ports}"
        )
    return engine[0]


# ---------------------------------------------------------------------------------------------
# one configuration


def wait_healthy(base: str, nodes: list[Node], timeout: float) -> float:
    t0 = time.monotonic()
    while True:
        for nd in nodes:
            if not nd.alive():
                raise RuntimeError(
                    f"node {nd.n} ({nd.config}) exited with {nd.proc.returncode} during start-up"
                )
        try:
            with urllib.request.urlopen(f"{base}/health", timeout=5) as r:
                if r.status == 200:
                    return time.monotonic() - t0
        except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
            pass
        if time.monotonic() - t0 > timeout:
            raise TimeoutError(f"node 0 not healthy after {timeout:.0f} s")
        time.sleep(0.5)


def _totals(m: dict[str, float]) -> tuple[int, int]:
    """The queue arena's hits and bytes."""
    return (
        int(st.metric(m, "vllm:shm_arena_hits_total", arena="queue")),
        int(st.metric(m, "vllm:shm_arena_bytes_total", arena="queue")),
    )


def settle(base: str, nodes: list[Node], args) -> list[dict[str, float]]:
    """Both nodes' arena metrics once they stopped moving: the writer and the relay report at
    most once a second and only from an enqueue, so a one-token text request after 1.1 s
    carries the last report; until two reads in a row agree on both nodes."""
    prev = None
    for _ in range(args.settle_rounds):
        time.sleep(1.1)
        st.chat_stream(base, [{"type": "text", "text": "ping"}], 0, 1, args.request_timeout)
        cur = [node_metrics(nd.prom_dir) for nd in nodes]
        if prev is not None and cur == prev:
            return cur
        prev = cur
    raise st.CheckFailed(f"arena metrics still changing after {args.settle_rounds} rounds")


#: The mismatch configuration: node 1 loads no vLLM plugin (VLLM_PLUGINS names none), node 0
#: runs ours. Start-up must fail on both nodes, each log naming the mismatch.
MISMATCH_ENV = {"VLLM_PLUGINS": ""}
MISMATCH_LINE = "PluginMismatchError:"


def run_mismatch(nodes: TwoNodes, args) -> dict[str, Any]:
    """Node 0 with the plugin, node 1 without, flag on: both must exit during start-up
    (bounded), each log naming ``PluginMismatchError``; never a healthy server, never a
    hang."""
    config, flag = "mismatch", "--enable-shm-tensor-arena"
    ns = [
        Node(
            nodes,
            n,
            args,
            config,
            flag,
            os.path.join(args.log_dir, f"node{n}_{config}.log"),
            MISMATCH_ENV if n == 1 else None,
        )
        for n in (0, 1)
    ]
    rec: dict[str, Any] = {
        "config": config,
        "flag": flag,
        "node1_env": MISMATCH_ENV,
        "logs": [os.path.relpath(nd.log_path, ROOT) for nd in ns],
    }
    print(f"serve-multinode [{config}]: node 0 with the plugin, node 1 without", flush=True)
    t0 = time.monotonic()
    for nd in ns:
        nd.start()
    base = f"http://127.0.0.1:{API_PORT}"
    healthy = False
    exited: dict[int, float] = {}
    while time.monotonic() - t0 < args.startup_timeout and len(exited) < 2:
        for nd in ns:
            if nd.n not in exited and not nd.alive():
                exited[nd.n] = round(time.monotonic() - t0, 1)
        try:
            with urllib.request.urlopen(f"{base}/health", timeout=2) as r:
                healthy = healthy or r.status == 200
        except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
            pass
        time.sleep(0.5)
    rec["exited_after_s"] = {str(k): v for k, v in sorted(exited.items())}
    rec["healthy"] = healthy
    rec["rc"] = [nd.proc.returncode for nd in ns]
    rec["stop"] = [nd.shutdown(args.stop_timeout) for nd in ns]
    logs = [nd.log_text() for nd in ns]
    rec["mismatch_lines"] = [
        [ln[-300:] for ln in t.splitlines() if MISMATCH_LINE in ln][:3] for t in logs
    ]
    rec["shm_names_left"] = [nd.shm_names() for nd in ns]
    for nd in ns:
        shutil.rmtree(nd.prom_dir, ignore_errors=True)
    print(
        f"serve-multinode [{config}]: exited after {rec['exited_after_s']} s, rc {rec['rc']}",
        flush=True,
    )
    return rec


def mismatch_checks(rec: dict[str, Any]) -> list[tuple[str, bool, str]]:
    both = set(rec["exited_after_s"]) == {"0", "1"}
    return [
        (
            "node 1 without the plugin: both nodes exit during start-up (no server, no hang)",
            both and not rec["healthy"] and all(rc not in (None, 0) for rc in rec["rc"]),
            json.dumps({k: rec[k] for k in ("exited_after_s", "healthy", "rc")}),
        ),
        (
            "each node's log names PluginMismatchError",
            all(rec["mismatch_lines"]),
            json.dumps(rec["mismatch_lines"])[:600],
        ),
        (
            "no vsa_ name left in either node's /dev/shm",
            not any(rec["shm_names_left"]),
            json.dumps(rec["shm_names_left"]),
        ),
    ]


def run_config(nodes: TwoNodes, args, config: str, flag: str, plan: list[st.ImageRequest]):
    arena_on = config == "arena"
    base = f"http://127.0.0.1:{API_PORT}"
    ns = [
        Node(nodes, n, args, config, flag, os.path.join(args.log_dir, f"node{n}_{config}.log"))
        for n in (0, 1)
    ]
    rec: dict[str, Any] = {
        "config": config,
        "flag": flag,
        "logs": [os.path.relpath(nd.log_path, ROOT) for nd in ns],
    }
    reqs = [
        st.ImageRequest(**{k: getattr(r, k) for k in ("kind", "index", "side", "seed", "warmup")})
        for r in plan
    ]
    per_image: list[dict[str, Any]] = []
    errors: list[str] = []
    try:
        print(f"serve-multinode [{config}]: starting node 0 and node 1 ({flag})", flush=True)
        t0 = time.monotonic()
        for nd in ns:
            nd.start()
        rec["startup_s"] = wait_healthy(base, ns, args.startup_timeout)
        print(f"serve-multinode [{config}]: healthy after {rec['startup_s']:.1f} s", flush=True)
        ports = ports_from(TwoNodes.addr(1))
        rec["ports_from_node1"] = {str(p): name for p, name in ports.items()}
        port = queue_port(ports)
        rec["queue_port"] = port
        others = [p for p in ports if p != port]
        nodes.watch(*ports)
        prev = [_totals(m) for m in ([node_metrics(nd.prom_dir) for nd in ns])]
        for r in reqs:
            png = st.prepare(r, args)
            before, retrans = nodes.counters(), tcp_retransmits()
            res = st.chat_stream(
                base, st.image_content(png), args.seed, args.max_tokens, args.request_timeout
            )
            sent = nodes.counters() - before
            retrans = tcp_retransmits() - retrans
            r.ttft_s, r.e2e_s = res["ttft_s"], res["e2e_s"]
            r.token_ids, r.logprobs, r.text = res["token_ids"], res["logprobs"], res["text"]
            link = sent.tx(0, port) + sent.rx(0, port)
            row: dict[str, Any] = {
                "key": r.key,
                "queue_port_bytes": link,
                "queue_port_bytes_per_payload": link / r.pixel_values_bytes,
                "other_ports_bytes_per_payload": {
                    str(p): (sent.tx(0, p) + sent.rx(0, p)) / r.pixel_values_bytes for p in others
                },
                "node0_tcp_retransmitted_segments": retrans,
                "link_tcp_bytes_per_payload": (sent.tx(0, "tcp") + sent.rx(0, "tcp"))
                / r.pixel_values_bytes,
                "other_link_bytes_per_payload": (
                    sent.tx(0, "if", link="o") + sent.rx(0, "if", link="o")
                )
                / r.pixel_values_bytes,
            }
            if arena_on:
                cur = [_totals(m) for m in settle(base, ns, args)]
                row["arena"] = [
                    {"node": i, "hits": c[0] - p[0], "bytes": c[1] - p[1]}
                    for i, (c, p) in enumerate(zip(cur, prev, strict=True))
                ]
                prev = cur
            per_image.append(row)
            print(
                f"serve-multinode [{config}]: {r.key}: {r.pixel_values_bytes / 2**20:.2f} MiB "
                f"pixel_values, TTFT {r.ttft_s:.2f} s, e2e {r.e2e_s:.2f} s, queue port "
                f"{row['queue_port_bytes_per_payload']:.3f} x payload"
                + (
                    "".join(
                        f", node {a['node']} arena +{a['hits']} / +{a['bytes']} B"
                        for a in row["arena"]
                    )
                    if arena_on
                    else ""
                ),
                flush=True,
            )
        rec["metrics_final"] = [node_metrics(nd.prom_dir) for nd in ns]
    except Exception as e:
        errors.append(f"{type(e).__name__}: {e}")
        for nd in ns:
            print(
                f"serve-multinode [{config}]: FAILED: {e}\n--- node {nd.n} log tail "
                f"({nd.log_path}) ---\n{nd.log_tail()}\n---",
                flush=True,
            )
    finally:
        stop0 = ns[0].shutdown(args.stop_timeout)
        # Node 1 is headless: it has no API to stop; its workers see the queue's end.
        follow = args.follow_timeout if stop0.get("rc") == 0 else 0.0
        rec["stop"] = [stop0, ns[1].shutdown(args.stop_timeout, follow_s=follow)]
        rec["total_s"] = round(time.monotonic() - t0, 1)
    logs = [nd.log_text() for nd in ns]
    rec["requests"] = [asdict(r) | {"key": r.key} for r in reqs]
    rec["per_image"] = per_image
    rec["errors"] = errors
    rec["shm_names_left"] = [nd.shm_names() for nd in ns]
    rec["arena_line_in_log"] = [
        st.ARENA_LINE in logs[0] or MULTINODE_ARENA_LINE + " (" in logs[0],
        RELAY_LINE in logs[1],
    ]
    rec["stands_aside_lines"] = [
        sum(STANDS_ASIDE_LINE in ln for ln in t.splitlines()) for t in logs
    ]
    rec["mismatch_lines_in_log"] = [
        sum(st.MISMATCH_LINE in ln for ln in t.splitlines()) for t in logs
    ]
    for nd in ns:
        shutil.rmtree(nd.prom_dir, ignore_errors=True)
    return rec


def checks_for(rec: dict[str, Any], args) -> list[tuple[str, bool, str]]:
    out: list[tuple[str, bool, str]] = []
    arena_on = rec["config"] == "arena"
    out.append(
        ("both nodes started, requests answered", not rec["errors"], "; ".join(rec["errors"]))
    )
    s0, s1 = rec["stop"]
    out.append(
        (
            "node 0 stopped on SIGINT with exit 0, nothing left",
            s0.get("rc") == 0 and not s0.get("group_left_running") and not s0.get("already_exited"),
            json.dumps(s0),
        )
    )
    out.append(
        (
            "node 1 (headless) ended after node 0 stopped, nothing left",
            s1.get("rc") is not None and not s1.get("group_left_running"),
            json.dumps(s1),
        )
    )
    left = rec["shm_names_left"]
    out.append(("no vsa_ name left in either node's /dev/shm", not any(left), json.dumps(left)))
    m = rec.get("metrics_final", [{}, {}])
    if arena_on:
        out.append(
            (
                "arena named in both logs (node 0: the queue's line; node 1: the relay's)",
                all(rec["arena_line_in_log"]),
                json.dumps(rec["arena_line_in_log"]),
            )
        )
        reqs = {r["key"]: r for r in rec["requests"]}
        for row in rec["per_image"]:
            want = reqs[row["key"]]["pixel_values_bytes"]
            got = [(a["hits"], a["bytes"]) for a in row["arena"]]
            out.append(
                (
                    f"{row['key']}: both nodes' arenas took its pixel_values (1 hit, {want} B)",
                    got == [(1, want), (1, want)],
                    json.dumps(got),
                )
            )
            out.append(
                (
                    f"{row['key']}: queue's link bytes <= {args.max_link_ratio} x payload per "
                    "remote node",
                    row["queue_port_bytes_per_payload"] <= args.max_link_ratio,
                    f"{row['queue_port_bytes_per_payload']:.4f}",
                )
            )
        # Every series of it (it has an arena label); None where no process exported it.
        name = "vllm:shm_arena_checksum_mismatches_total"
        mm = [st.metric(x, name) if st.series(x, name) else None for x in m]
        out.append(
            (
                "0 checksum mismatches on both nodes (metric exported, no log line)",
                all(v == 0 for v in mm) and not any(rec["mismatch_lines_in_log"]),
                f"metrics {mm}, log lines {rec['mismatch_lines_in_log']}",
            )
        )
    else:
        hits = [_totals(x)[0] for x in m]
        out.append(
            (
                "flag off: no arena line or hit on either node (stock vLLM queue)",
                not any(rec["arena_line_in_log"]) and not any(hits),
                f"lines {rec['arena_line_in_log']}, hits {hits}",
            )
        )
    return out


# ---------------------------------------------------------------------------------------------
# results


def _median(xs: list[float]) -> float:
    xs = [x for x in xs if not math.isnan(x)]
    return sorted(xs)[len(xs) // 2] if xs else math.nan


def summarize(rec: dict[str, Any]) -> dict[str, Any]:
    timed = [r for r in rec["requests"] if not r["warmup"]]
    rows = {x["key"]: x for x in rec["per_image"]}
    ratios = [rows[r["key"]]["queue_port_bytes_per_payload"] for r in timed if r["key"] in rows]
    out = {
        "startup_s": rec.get("startup_s", math.nan),
        "total_s": rec.get("total_s"),
        "queue_port_bytes_per_payload_median": _median(ratios),
        "queue_port_bytes_per_payload_max": max(ratios) if ratios else math.nan,
    }
    for kind in st.IMAGE_KINDS:
        rs = [r for r in timed if r["kind"] == kind]
        out[kind] = {
            "n": len(rs),
            "ttft_median_s": _median([r["ttft_s"] for r in rs]),
            "e2e_median_s": _median([r["e2e_s"] for r in rs]),
        }
    return out


def write_results(path_dir: str, result: dict[str, Any]) -> None:
    os.makedirs(path_dir, exist_ok=True)
    with open(os.path.join(path_dir, "serve_multinode.json"), "w") as f:
        json.dump(result, f, indent=2, default=str)
        f.write("\n")
    s = result["settings"]
    md = [
        "# `make serve-multinode-test`: real `vllm serve` on two nodes, TP=4 as 2 + 2",
        "",
        f"Result: **{'PASS' if result['passed'] else 'FAIL'}** ({result['when']}, "
        f"{result['host']}). Written by `e2e/run_serve_multinode.py`; the full "
        "record is `serve_multinode.json`.",
        "",
        f"vllm-cpu {result['versions']['vllm']}, torch {result['versions']['torch']}. Two "
        "network namespaces on this machine (`e2e/netns_nodes.sh`), each with its own "
        "mount namespace and tmpfs /dev/shm; the queue link (veth, 10.77.0.x, "
        f"{s['rate'] or 'no rate limit'}) carries `VLLM_HOST_IP`, so the broadcast queue's "
        "TCP socket; a second veth pair (10.78.0.x) carries `--master-addr` and "
        "`GLOO_SOCKET_IFNAME` (the TP collectives). Node 0: `vllm serve <tiny-qwen2vl> "
        "--tensor-parallel-size 4 --distributed-executor-backend mp --nnodes 2 --node-rank 0 "
        "--master-addr 10.78.0.1`; node 1: the same with `--headless --node-rank 1`; both "
        f"`--enforce-eager --dtype float32 --seed 0`, `VLLM_CPU_OMP_THREADS_BIND={s['omp_bind']}`"
        ", `VLLM_SHM_ARENA_DEBUG_CHECKSUM=1`, with `--enable-shm-tensor-arena` (arena) or "
        "`--no-enable-shm-tensor-arena` (stock) on both nodes. Requests: streamed chat "
        f"completions, one base64 PNG each, temperature 0, {s['max_tokens']} tokens, "
        f"{s['per_kind']} per image kind after one warm-up.",
        "",
        "Queue port bytes: nftables counters of node 0 on the queue link for the TCP port "
        "node 0's engine core listens on with connections from node 1 (the broadcast queue's "
        "socket; the executor runs in the engine core), both directions, IP bytes, counted "
        "from just before each request to its last token. The other ports node 0 listens on "
        "with connections from node 1 (the workers' response queues) are counted apart.",
        "",
        "## Per configuration",
        "",
        "| configuration | start-up | queue port bytes / payload per image (median, max) | "
        "large: TTFT / e2e | typical: TTFT / e2e | whole run |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for name, x in result["summary"].items():
        md.append(
            f"| {name} | {x['startup_s']:.1f} s | {x['queue_port_bytes_per_payload_median']:.3f}, "
            f"{x['queue_port_bytes_per_payload_max']:.3f} | {x['large']['ttft_median_s']:.3f} / "
            f"{x['large']['e2e_median_s']:.3f} s | {x['typical']['ttft_median_s']:.3f} / "
            f"{x['typical']['e2e_median_s']:.3f} s | {x['total_s']} s |"
        )
    md += [
        "",
        "## Per image",
        "",
        "| configuration | request | pixel_values | queue port bytes | / payload | all TCP on "
        "the queue link / payload | other link / payload | node 0 TCP retransmits | arena "
        "node 0 | arena node 1 |",
        "|---|---|---:|---:|---:|---:|---:|---:|---|---|",
    ]
    for c in result["configs"]:
        reqs = {r["key"]: r for r in c["requests"]}
        for row in c["per_image"]:
            pv = reqs[row["key"]]["pixel_values_bytes"]
            ar = row.get("arena") or []
            cells = [f"+{a['hits']} / +{a['bytes']:,} B" for a in ar] or ["-", "-"]
            md.append(
                f"| {c['config']} | {row['key']} | {pv:,} B | {row['queue_port_bytes']:,} | "
                f"{row['queue_port_bytes_per_payload']:.4f} | "
                f"{row['link_tcp_bytes_per_payload']:.4f} | "
                f"{row['other_link_bytes_per_payload']:.3f} | "
                f"{row.get('node0_tcp_retransmitted_segments', '-')} | {cells[0]} | {cells[1]} |"
            )
    tok = result["identical_tokens"]
    mm = result.get("mismatch")
    if mm:
        md += [
            "",
            "## Node 1 without the plugin (`VLLM_PLUGINS=` there), flag on",
            "",
            f"Both nodes exited during start-up after {mm['exited_after_s']} s (node: seconds "
            f"from the start), exit statuses {mm['rc']}, healthy: {mm['healthy']}. First "
            "`PluginMismatchError` line of each node's log:",
            "",
        ]
        for n, lines in enumerate(mm["mismatch_lines"]):
            md.append(f"* node {n}: `{(lines[0] if lines else '(none)')[-260:]}`")
    md += [
        "",
        "## Identical outputs, flag on vs flag off",
        "",
        f"{tok['identical']} of {tok['total']} requests returned identical token ids and "
        f"logprobs (distinct outputs per configuration: {tok['distinct_outputs_per_config']})"
        + (f"; differing: {', '.join(tok['differing'])}" if tok["differing"] else "")
        + ".",
        "",
        "## Checks",
        "",
        "| configuration | check | result | detail |",
        "|---|---|---|---|",
    ]
    for name, check, ok, detail in result["checks"]:
        md.append(f"| {name} | {check} | {'pass' if ok else '**FAIL**'} | {detail[:300]} |")
    with open(os.path.join(path_dir, "serve_multinode.md"), "w") as f:
        f.write("\n".join(md) + "\n")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True, help="the tiny Qwen2-VL directory")
    ap.add_argument("--results", default=os.path.join(ROOT, "benchmarks/results/serve_multinode"))
    ap.add_argument("--log-dir", default=os.path.join(ROOT, "build/serve_multinode"))
    st.add_common_arguments(ap, per_kind=3, startup_timeout=900)
    ap.add_argument("--rate", default="", help="tc rate limit of the queue link, e.g. 10gbit")
    ap.add_argument("--shm-size", default="4g", help="each node's /dev/shm")
    ap.add_argument("--max-link-ratio", type=float, default=1.2)
    ap.add_argument(
        "--follow-timeout",
        type=float,
        default=60,
        help="how long node 1 may take to end by itself once node 0 stopped (then SIGINT)",
    )
    ap.add_argument(
        "--configs",
        default="arena,stock,mismatch",
        help="which configurations, in order: arena, stock, mismatch (node 1 without the plugin)",
    )
    ap.add_argument("extra_vllm_args", nargs="*", help="after --: more vllm serve arguments")
    args = ap.parse_args()
    if os.geteuid() != 0:
        print("serve-multinode: needs root (network and mount namespaces)", file=sys.stderr)
        return 2
    plan, seed_base = st.plan_requests(args, "serve-multinode")

    flags = {"arena": "--enable-shm-tensor-arena", "stock": "--no-enable-shm-tensor-arena"}
    wanted = [c for c in args.configs.split(",") if c]
    unknown = sorted(set(wanted) - {*flags, "mismatch"})
    if unknown:
        ap.error(f"unknown configuration(s): {unknown}")
    nodes = TwoNodes(prefix=PREFIX, rate=args.rate or None, other_link=True, shm_size=args.shm_size)
    configs = []
    mismatch = None
    t_all = time.monotonic()
    try:
        nodes.up()
        # The driver's own network namespace only (its HTTP requests reach node 0's API server
        # on 127.0.0.1); its mount namespace stays the host's, where /run/netns is.
        nodes.enter(0, mount=False)
        for config in wanted:
            if config == "mismatch":
                mismatch = run_mismatch(nodes, args)
            else:
                configs.append(run_config(nodes, args, config, flags[config], plan))
    finally:
        nodes.down()

    checks = []
    for rec in configs:
        for name, ok, detail in checks_for(rec, args):
            checks.append((rec["config"], name, ok, detail))
    if mismatch is not None:
        for name, ok, detail in mismatch_checks(mismatch):
            checks.append(("mismatch", name, ok, detail))
    identical, same = st.compare_outputs(configs, [r.key for r in plan], args.max_tokens)
    checks += same
    passed = all(ok for _, _, ok, _ in checks)
    import importlib.metadata as md

    result = {
        "passed": passed,
        "when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "host": f"{platform.machine()}, {os.cpu_count()} CPUs",
        "versions": {"vllm": md.version("vllm-cpu"), "torch": md.version("torch")},
        "settings": {
            "per_kind": args.per_kind,
            "max_tokens": args.max_tokens,
            "seed": args.seed,
            "image_seed": seed_base,
            "omp_bind": args.omp_bind,
            "rate": args.rate,
            "max_link_ratio": args.max_link_ratio,
        },
        "duration_s": round(time.monotonic() - t_all, 1),
        "summary": {c["config"]: summarize(c) for c in configs},
        "identical_tokens": identical,
        "checks": checks,
        "configs": configs,
        "mismatch": mismatch,
    }
    write_results(args.results, result)
    st.print_checks("serve-multinode", checks)
    print(
        f"serve-multinode: {'PASSED' if passed else 'FAILED'} in {result['duration_s']:.0f} s; "
        f"results in {os.path.relpath(args.results, ROOT)}/serve_multinode.{{md,json}}",
        flush=True,
    )
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
