"""The serve test's driver: real `vllm serve` runs, flag on and flag off, checked end to end.

Run by ``e2e/serve_test.sh`` (``make serve-test``) with .venv-serve's python, after the
venv and the tiny model exist. For each configuration (``--enable-shm-tensor-arena``, then
``--no-enable-shm-tensor-arena``) it starts ``vllm serve`` with TP=2 and the mp executor on
127.0.0.1, sends OpenAI chat requests carrying base64 PNG images through ``urllib``, reads
``/metrics``, stops the server with SIGINT, and checks:

* every image went through an arena: with the frontend arena (the default), per image
  ``vllm:shm_arena_forwarded_total{arena="frontend"}`` grew by one and the queue's arena took
  nothing (the engine core copied none of it: it forwarded the tensor it holds); with
  ``VLLM_SHM_ARENA_FRONTEND=0``, ``vllm:shm_arena_hits_total{arena="queue"}`` grew by one and
  ``vllm:shm_arena_bytes_total{arena="queue"}`` by exactly that image's pixel_values bytes
  (uint8, 1176 bytes per 14x14 patch of the resized image: vLLM 0.32 sends Qwen2-VL
  pixel_values as uint8);
* ``VLLM_SHM_ARENA_DEBUG_CHECKSUM=1``: ``vllm:shm_arena_checksum_mismatches_total`` is exported
  by the workers (both arenas' series) and is 0, and no worker logged a mismatch;
* with the flag off, no arena hit and no "uses the C++ shm tensor arena" line (stock vLLM);
* a repeated image (the first large one again, last): vLLM's multimodal cache hit, which the
  API server sends no payload or stub for, and the engine core forwards again (one forward,
  no queue-arena copy, no new loan); its output is the original's;
* two new images in one request, text between them, n = 2 (the last request): each image
  copied once, one stub per image per choice (vLLM sends each choice as a request of its own),
  forwarded at least once per image, no queue-arena copy;
* temperature 0 (1 for the n = 2 request: vLLM refuses n > 1 with greedy sampling), a fixed
  seed: both configurations return identical token ids per request (and per choice);
* eviction (a third server, flag on, ``--mm-processor-cache-gb 0.05``: vLLM's multimodal cache
  holds 4 large images; ``--no-eviction`` skips it): 8 new images, each copied once into the
  frontend arena and forwarded once; once they are done, at most 4 frontend slots in use (an
  evicted item's slot is free); the first image again is a miss, one new copy, the same
  output; a clean stop. Before those, on the same server (``--max-num-seqs 1``), abort while
  waiting: a new image's request waits behind a long text request and its client goes away;
  the request leaves the waiting queue while the text request still runs, its item was copied
  once and forwarded to no worker (none owes it), vLLM's cache keeps it (one more slot in use),
  and the eviction that follows frees its slot with the others; once each request finished the
  workers owe the frontend arena no ack and the engine core only for what vLLM's cache holds;
* too big for the cache (a fourth server, run with the eviction one, ``--mm-processor-cache-gb
  0.01`` and ``VLLM_SHM_ARENA_MIN_MB=8``: a 12 MiB frontend arena, one large image more than
  vLLM's cache holds): a new image's request aborted while it waits is copied once, forwarded
  to no worker, and its slot is free within 1 s of the client's close (the serve probe's
  watch, ``seconds_until_freed``); the same image again is one more copy and one forward, and
  nothing holds its slot or owes an ack once it finished;
* preemption (two more servers, flag on and off, ``--num-gpu-blocks-override 40``: a KV cache
  that holds two large images' prompts but not their decodes; ``--no-preemption`` skips them):
  the second of two image requests is preempted and recomputed on both; identical token ids;
  with the flag on each image copied once, never into the queue's arena, forwarded at least
  once, and afterwards only the 2 slots vLLM's cache holds in use;
* no ``vsa_`` name is left in the private shm directory (or new in /dev/shm) after the stop;
* the server stops cleanly: SIGINT, exit status 0 within ``--stop-timeout``, no process of
  its group left, no force-kill of the engine or a worker (``--shutdown-timeout`` gives them
  time to close their queues).

Writes ``serve_test.json`` and ``serve_test.md`` (start-up time, TTFT and end-to-end medians,
arena hits/bytes per image, the identical-tokens check) to ``--results``, also when a check
fails (marked FAIL), and exits 1 if any check failed. Every wait is bounded; on any failure
the server's whole process group is killed and the log's tail printed.
"""

from __future__ import annotations

import argparse
import http.client
import json
import math
import os
import platform
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from dataclasses import asdict
from typing import Any

from serve_lib import (  # e2e/, beside this file
    ARENA_LINE,
    IMAGE_KINDS,
    MISMATCH_LINE,
    RESPONSE_QUEUE_LINE,
    SAMPLE,
    CheckFailed,
    ImageRequest,
    ProcessGroup,
    add_common_arguments,
    chat_body,
    chat_stream,
    compare_outputs,
    image_content,
    metric,
    model_args,
    plan_requests,
    prepare,
    print_checks,
    read_probe,
    series,
)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
#: Tensor-parallel workers of every server (the frontend arena has 1 + SERVE_TP ranks).
SERVE_TP = 2
FORCE_KILL_LINE = "force killing"
#: vLLM's executor SIGTERMs workers that have not exited 5 s after it asked them to; on this
#: CPU build that happens with the flag off as well, so it is recorded, not failed.
GRACE_SIGTERM_LINE = "workers still running after grace period"


# ---------------------------------------------------------------------------------------------
# images


# ---------------------------------------------------------------------------------------------
# HTTP


def read_metrics(
    base: str, timeout: float = 30.0, prefix: str = "vllm:shm_arena_"
) -> dict[str, float]:
    """``/metrics``' samples whose name starts with ``prefix`` (by default this project's),
    ``name{labels}`` -> value."""
    with urllib.request.urlopen(f"{base}/metrics", timeout=timeout) as r:
        text = r.read().decode()
    out = {}
    for line in text.splitlines():
        if not line.startswith(prefix):
            continue
        m = SAMPLE.match(line.strip())
        if m:
            out[m.group("name") + (m.group("labels") or "")] = float(m.group("v"))
    return out


# ---------------------------------------------------------------------------------------------
# the server


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def vsa_names(d: str) -> set[str]:
    """Our shared-memory names in ``d`` (arena and ring segments start with ``vsa_``)."""
    try:
        return {n for n in os.listdir(d) if n.startswith("vsa_")}
    except FileNotFoundError:
        return set()


def new_dev_shm_names(before: set[str]) -> tuple[list[str], list[str]]:
    """``vsa_`` names in /dev/shm that appeared since ``before``, split into those that may be
    ours and those another, live process writes (the machine is shared: other users' queues
    come and go there). Called once every process of the server is gone, so a name whose
    writer's kernel-held token is still taken cannot be the server's."""
    new = vsa_names("/dev/shm") - before
    if not new:
        return [], []
    from vllm_shm_arena.cleanup import remove_stale_resources

    alive = {
        r.name for r in remove_stale_resources("/dev/shm", dry_run=True) if r.writer == "alive"
    }
    still = vsa_names("/dev/shm")
    return sorted((new & still) - alive), sorted(new & alive)


class Server(ProcessGroup):
    """One ``vllm serve`` in its own process group, with its private directories."""

    def __init__(self, args: argparse.Namespace, config: str, flag: str, log_path: str):
        self.args = args
        self.config = config
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        # tmpfs for the shm directory (the arena's region must be memory), private to this run.
        self.shm_dir = tempfile.mkdtemp(prefix=f"vsa-serve-{config}-", dir=args.shm_parent)
        self.prom_dir = tempfile.mkdtemp(prefix=f"vsa-serve-prom-{config}-")
        #: Where the serve probe (e2e/serve_probe) writes, once ``probe()`` turned it on.
        self.probe_dir: str | None = None
        self.log_path = log_path
        env = dict(os.environ)
        env.update(
            {
                # One core per TP rank: "auto" needs as many NUMA nodes as ranks.
                "VLLM_CPU_OMP_THREADS_BIND": args.omp_bind,
                "VLLM_CPU_KVCACHE_SPACE": str(args.kv_cache_gib),
                "PROMETHEUS_MULTIPROC_DIR": self.prom_dir,
                "VLLM_SHM_ARENA_DEBUG_CHECKSUM": "1",
                "VLLM_SHM_ARENA_SHM_DIR": self.shm_dir,
                # Everything stays on this machine: loopback for vLLM's own sockets, no usage
                # reports, no hub look-ups.
                "VLLM_HOST_IP": "127.0.0.1",
                "VLLM_NO_USAGE_STATS": "1",
                "DO_NOT_TRACK": "1",
                "HF_HUB_OFFLINE": "1",
                "TRANSFORMERS_OFFLINE": "1",
            }
        )
        self.cmd = [
            os.path.join(os.path.dirname(sys.executable), "vllm"),
            "serve",
            args.model,
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--tensor-parallel-size",
            str(SERVE_TP),
            "--distributed-executor-backend",
            "mp",
            "--enforce-eager",
            flag,
            *model_args(args.shutdown_timeout),
        ]
        self.env = env
        self.proc: subprocess.Popen | None = None
        self.startup_s = math.nan
        self.stop: dict[str, Any] = {}
        #: vsa_ names seen in the private shm directory while starting: the queue unlinks them
        #: once every worker attached, so this is the evidence that the plugin's queue honours
        #: VLLM_SHM_ARENA_SHM_DIR.
        self.names_seen_starting: set[str] = set()

    def start(self) -> None:
        """Starts the server and waits (bounded) until ``/health`` answers 200."""
        shutil.rmtree(self.prom_dir, ignore_errors=True)
        os.makedirs(self.prom_dir)
        log = open(self.log_path, "w")
        log.write("$ " + " ".join(self.cmd) + "\n")
        log.flush()
        t0 = time.monotonic()
        self.proc = subprocess.Popen(
            self.cmd,
            env=self.env,
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,  # its own process group: one signal reaches every child
            cwd=ROOT,
        )
        log.close()
        deadline = t0 + self.args.startup_timeout
        while True:
            self.names_seen_starting |= vsa_names(self.shm_dir)
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"vllm serve ({self.config}) exited with {self.proc.returncode} during start-up"
                )
            try:
                with urllib.request.urlopen(f"{self.base}/health", timeout=5) as r:
                    if r.status == 200:
                        break
            except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"vllm serve ({self.config}) not healthy after {self.args.startup_timeout} s"
                )
            time.sleep(0.2)
        self.startup_s = time.monotonic() - t0

    def shutdown(self) -> dict[str, Any]:
        """SIGINT, then waits (bounded) for the server and every process of its group."""
        out: dict[str, Any] = {"signal": "SIGINT"}
        if self.proc is None or self.proc.poll() is not None:
            out.update(rc=None if self.proc is None else self.proc.returncode, already_exited=True)
            self.stop = out
            return out
        t0 = time.monotonic()
        self.proc.send_signal(signal.SIGINT)
        try:
            out["rc"] = self.proc.wait(timeout=self.args.stop_timeout)
        except subprocess.TimeoutExpired:
            out["rc"] = None
        deadline = time.monotonic() + 15
        while self._group_alive() and time.monotonic() < deadline:
            time.sleep(0.2)
        out["group_left_running"] = self._group_alive()
        out["stop_s"] = round(time.monotonic() - t0, 2)
        if out["rc"] is None or out["group_left_running"]:
            self.kill()
        self.stop = out
        return out

    def probe(self) -> None:
        """Turns the serve probe and its watch on in every process of this server (before
        ``start``)."""
        self.probe_dir = tempfile.mkdtemp(prefix=f"vsa-serve-probe-{self.config}-")
        self.env["VSA_SERVE_PROBE_DIR"] = self.probe_dir
        self.env["VSA_SERVE_PROBE_WATCH"] = "1"

    def cleanup_dirs(self) -> None:
        """Removes the private directories (after their contents were checked)."""
        for d in (self.prom_dir, self.shm_dir, self.probe_dir):
            if d is not None:
                shutil.rmtree(d, ignore_errors=True)


# ---------------------------------------------------------------------------------------------
# one configuration


def _arena_totals(m: dict[str, float]) -> tuple[int, int]:
    """The queue arena's hits and bytes."""
    return (
        int(metric(m, "vllm:shm_arena_hits_total", arena="queue")),
        int(metric(m, "vllm:shm_arena_bytes_total", arena="queue")),
    )


def _forwarded_total(m: dict[str, float]) -> int:
    return int(metric(m, "vllm:shm_arena_forwarded_total", arena="frontend"))


def went_through_an_arena(r: dict[str, Any], forwarding: bool) -> bool:
    """Request ``r``'s image: forwarded (the frontend arena on: one forward, no queue-arena
    copy) or copied once into the queue's arena (one hit of exactly its bytes)."""
    if forwarding and r["pixel_values_bytes"] >= _frontend_min_bytes():
        # Each image at least once; n > 1 choices are requests of their own (each forwarded
        # when scheduled alone, once when scheduled in the same step: pickle's memo).
        fwd, images = r["arena_forwarded"], r["images"]
        ok_fwd = fwd == images if r["n"] == 1 else images <= fwd <= images * r["n"]
        return ok_fwd and r["arena_hits"] == 0 and r["arena_bytes"] == 0
    return r["arena_hits"] == 1 and r["arena_bytes"] == r["pixel_values_bytes"]


def settle_metrics(srv: Server, args: argparse.Namespace) -> dict[str, float]:
    """``/metrics`` once the arena's counters stopped moving.

    The writer reports at most once a second and only from ``enqueue``, the readers only from
    ``dequeue``: after a request the last hit shows only once another message went through more
    than a second later. So: wait 1.1 s, send a one-token text request (its messages carry the
    report), read; until two reads in a row agree (bounded by ``--settle-rounds``)."""
    prev = None
    for _ in range(args.settle_rounds):
        time.sleep(1.1)
        chat_stream(srv.base, [{"type": "text", "text": "ping"}], 0, 1, args.request_timeout)
        cur = read_metrics(srv.base)
        if prev is not None and cur == prev:
            return cur
        prev = cur
    raise CheckFailed(f"arena metrics still changing after {args.settle_rounds} rounds: {prev}")


def run_config(args: argparse.Namespace, config: str, flag: str, plan: list[ImageRequest]):
    """Starts one server, sends ``plan``, stops it; returns the configuration's record."""
    arena_on = config == "arena"
    log_path = os.path.join(args.log_dir, f"serve_{config}.log")
    dev_shm_before = vsa_names("/dev/shm")
    srv = Server(args, config, flag, log_path)
    if any(r.images > 1 for r in plan):  # (the later option wins)
        most = max(r.images for r in plan)
        srv.cmd += ["--limit-mm-per-prompt", json.dumps({"image": most, "video": 0})]
    rec: dict[str, Any] = {"config": config, "flag": flag, "log": os.path.relpath(log_path, ROOT)}
    reqs = [
        ImageRequest(
            **{k: getattr(r, k) for k in ("kind", "index", "side", "seed", "warmup", "images", "n")}
        )
        for r in plan
    ]
    errors: list[str] = []
    try:
        print(f"serve-test [{config}]: starting vllm serve on {srv.base} ({flag})", flush=True)
        srv.start()
        print(f"serve-test [{config}]: healthy after {srv.startup_s:.1f} s", flush=True)
        base_metrics = read_metrics(srv.base)
        prev_hits, prev_bytes = _arena_totals(base_metrics)
        prev_fwd = _forwarded_total(base_metrics)
        for r in reqs:
            pngs = [prepare(r, args)]
            for i in range(1, r.images):  # more images of the same size: their bytes add up
                more = ImageRequest(r.kind, r.index, r.side, r.seed + i, False)
                pngs.append(prepare(more, args))
                r.pixel_values_bytes += more.pixel_values_bytes
            h, w = r.resized
            res = chat_stream(
                srv.base,
                image_content(*pngs),
                args.seed,
                args.max_tokens,
                args.request_timeout,
                n=r.n,
            )
            r.ttft_s, r.e2e_s = res["ttft_s"], res["e2e_s"]
            r.token_ids, r.logprobs, r.text = res["token_ids"], res["logprobs"], res["text"]
            if arena_on:
                m = settle_metrics(srv, args)
                hits, nbytes = _arena_totals(m)
                r.arena_hits, r.arena_bytes = hits - prev_hits, nbytes - prev_bytes
                r.arena_forwarded = _forwarded_total(m) - prev_fwd
                prev_hits, prev_bytes, prev_fwd = hits, nbytes, _forwarded_total(m)
            print(
                f"serve-test [{config}]: {r.key}: {r.side}x{r.side} -> {h}x{w}, "
                f"{r.pixel_values_bytes / 2**20:.2f} MiB pixel_values, TTFT {r.ttft_s:.2f} s, "
                f"e2e {r.e2e_s:.2f} s"
                + (
                    f", arena +{r.arena_hits} hit(s) / +{r.arena_bytes} B, "
                    f"+{r.arena_forwarded} forwarded"
                    if arena_on
                    else ""
                ),
                flush=True,
            )
        final = settle_metrics(srv, args) if arena_on else read_metrics(srv.base)
        rec["metrics_final"] = final
    except Exception as e:  # any failure: kill the server, print its log, record it
        errors.append(f"{type(e).__name__}: {e}")
        print(
            f"serve-test [{config}]: FAILED: {e}\n--- log tail ({log_path}) ---\n"
            f"{srv.log_tail()}\n---",
            flush=True,
        )
        srv.kill()
    finally:
        stop = srv.shutdown()
    log = srv.log_text()
    rec["startup_s"] = srv.startup_s
    rec["stop"] = stop
    rec["requests"] = [asdict(r) | {"key": r.key} for r in reqs]
    rec["errors"] = errors
    left = sorted(vsa_names(srv.shm_dir))
    new_dev_shm, others = new_dev_shm_names(dev_shm_before)
    rec["vsa_names_left"] = {"private_shm_dir": left, "dev_shm_new": new_dev_shm}
    rec["dev_shm_new_with_live_writer"] = others
    rec["private_shm_names_seen_starting"] = sorted(srv.names_seen_starting)
    rec["arena_line_in_log"] = ARENA_LINE in log
    lines = log.splitlines()
    rec["response_queue_lines_in_log"] = sum(RESPONSE_QUEUE_LINE in ln for ln in lines)
    rec["frontend"] = frontend_report(log)
    rec["mismatch_lines_in_log"] = sum(MISMATCH_LINE in ln for ln in lines)
    rec["force_kill_lines_in_log"] = [ln[-160:] for ln in lines if FORCE_KILL_LINE in ln]
    rec["grace_sigterm_lines_in_log"] = sum(GRACE_SIGTERM_LINE in ln for ln in lines)
    srv.cleanup_dirs()
    return rec


#: The eviction run: vLLM's multimodal cache (``--mm-processor-cache-gb``) holds 4 of the large
#: images (10.8 MB each: 4 are 43 MB, 5 are 54 MB of its 53.7 MB), and it sends this many.
EVICTION_CACHE_GB = 0.05
EVICTION_CACHED = 4
EVICTION_IMAGES = 8


def frontend_in_use(m: dict[str, float]) -> int:
    """From one ``/metrics`` read: the frontend arena's allocations in use (-1: no report)."""
    found = series(m, "vllm:shm_arena_slots_in_use", arena="frontend")
    return int(sum(v for _, v in found)) if found else -1


def frontend_filled(m: dict[str, float]) -> int:
    return int(metric(m, "vllm:shm_arena_hits_total", arena="frontend"))


def frontend_stubs(m: dict[str, float]) -> int:
    return int(metric(m, "vllm:shm_arena_stubs_total", arena="frontend"))


def frontend_owed(m: dict[str, float]) -> tuple[int, int]:
    """From one ``/metrics`` read: the acks the engine core (rank 0) and the workers (ranks
    1 and up, summed) owe the frontend arena."""
    name = "vllm:shm_arena_owed"
    every = metric(m, name, arena="frontend")
    core = metric(m, name, arena="frontend", rank="0")
    return int(core), int(every - core)


#: The too-big run: vLLM's multimodal cache (0.01 GiB: 10,737,418 B) is smaller than one
#: large image (10,838,016 B of pixel_values), so vLLM serves it uncached; the frontend arena
#: (1.25 x that: 12 MiB, under the 64 MiB default floor, hence VLLM_SHM_ARENA_MIN_MB) still
#: carries it.
TOO_BIG_CACHE_GB = 0.01
TOO_BIG_MIN_MB = "8"
#: The too-big item's slot is free this soon after its client went away (seconds).
TOO_BIG_FREED_S = 1.0

#: The abort run's long text request: tokens it generates (it keeps the only sequence slot,
#: ``--max-num-seqs 1``, while the image request waits behind it). The harness stops it once it
#: measured, so it may be long: the servers with an abort run allow ``ABORT_MODEL_LEN`` tokens
#: (the tiny model's positions), ~40 s of decoding here, however slowly the image request
#: reaches the queue beside it.
ABORT_LONG_TOKENS = 8000
ABORT_MODEL_LEN = "8192"


def ack_balance(m: dict[str, float]) -> list[list[int]]:
    """From one ``/metrics`` read: per rank of the frontend arena, ``[rank, acked + owed,
    sent]``: the stubs it acked (``vllm:shm_arena_acked_total``, exported by that rank's own
    process) plus those it owes now, against what it was sent: the API server's stubs for
    rank 0 (the engine core), the engine core's forwards for each worker rank."""
    ranks = {
        int(labels["rank"])
        for name in ("vllm:shm_arena_acked_total", "vllm:shm_arena_owed")
        for labels, _ in series(m, name, arena="frontend")
        if "rank" in labels
    }
    out = []
    for r in sorted(ranks):
        acked = metric(m, "vllm:shm_arena_acked_total", arena="frontend", rank=str(r))
        owed = metric(m, "vllm:shm_arena_owed", arena="frontend", rank=str(r))
        sent = frontend_stubs(m) if r == 0 else _forwarded_total(m)
        out.append([r, int(acked + owed), int(sent)])
    return out


def frontend_deltas(before: dict[str, float], after: dict[str, float]) -> dict[str, int]:
    """Between two ``settle_metrics`` reads: the frontend arena's fills, the forwards, the
    queue-arena hits, and at the second the frontend slots in use, the acks owed and each
    rank's ack balance (``ack_balance``)."""
    core_owed, workers_owed = frontend_owed(after)
    return {
        "core_owed": core_owed,
        "workers_owed": workers_owed,
        "ack_balance": ack_balance(after),
        "filled": frontend_filled(after) - frontend_filled(before),
        "forwarded": _forwarded_total(after) - _forwarded_total(before),
        "hits": _arena_totals(after)[0] - _arena_totals(before)[0],
        "in_use": frontend_in_use(after),
    }


def serve_and_record(srv: Server, rec: dict[str, Any], body) -> dict[str, Any]:
    """Starts ``srv``, runs ``body()``; any failure is recorded in ``rec["errors"]`` (the
    server killed, its log's tail printed); then the stop (``rec["stop"]``) and the ``vsa_``
    names left in its shm directory (``rec["vsa_names_left"]``). Returns ``rec``."""
    name = rec["config"]
    try:
        srv.start()
        body()
    except Exception as e:  # any failure: kill the server, print its log, record it
        rec["errors"].append(f"{type(e).__name__}: {e}")
        print(f"serve-test [{name}]: FAILED: {e}\n{srv.log_tail()}", flush=True)
        srv.kill()
    finally:
        rec["stop"] = srv.shutdown()
    rec["vsa_names_left"] = sorted(vsa_names(srv.shm_dir))
    srv.cleanup_dirs()
    return rec


def vllm_gauge(base: str, name: str) -> float:
    """The sum of ``name``'s samples (every label set) in vLLM's ``/metrics``."""
    return metric(read_metrics(base, prefix=name), name)


#: How often a wait on the serve probe reads its files (it writes them every 0.25 s).
PROBE_POLL_S = 0.1


def wait_for(what: str, cond, timeout: float, every: float = 0.02):
    """Polls ``cond()`` every ``every`` seconds; its first true result, or CheckFailed after
    ``timeout``."""
    t0 = time.monotonic()
    while not (got := cond()):
        if time.monotonic() - t0 > timeout:
            raise CheckFailed(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(every)
    return got


def probe_watch(probe_dir: str) -> dict[str, list[tuple[float, Any]]]:
    """The serve probe's samples (e2e/serve_probe), one read of its files: per watched value
    (``in_use`` from the API server, ``acked`` and ``requests`` from the engine core),
    ``(time.monotonic(), value)`` at each change, in time order."""
    out: dict[str, list[tuple[float, Any]]] = {}
    for rec in read_probe(probe_dir).values():
        for t, what, v in rec.get("watch", []):
            out.setdefault(what, []).append((t, v))
    for samples in out.values():
        samples.sort(key=lambda e: e[0])
    return out


def new_waiting_request(probe_dir: str, t_post: float) -> tuple[float, str, list] | None:
    """The request the engine core's scheduler got after ``t_post``, once it waits: ``(the
    sample's time, its id, the ids running then)``, or None. From the serve probe's
    ``requests`` watch (``[running, waiting, running ids, every id the scheduler holds]``):
    an id it did not hold before ``t_post``, held and not running. Times are the probe's, not
    when the harness read the file (written every 0.25 s, by a thread of a busy process)."""
    samples = probe_watch(probe_dir).get("requests", [])
    before = next((v for t, v in reversed(samples) if t < t_post), None)
    if before is None:
        return None
    for t, v in samples:
        new = [i for i in v[3] if i not in before[3] and i not in v[2]]
        if t >= t_post and new:
            return t, new[0], v[2]
    return None


def request_left(probe_dir: str, t0: float, request_id: str) -> tuple[float, list] | None:
    """The scheduler's first sample after ``t0`` that no longer holds ``request_id`` (the
    serve probe's ``requests`` watch), as ``(its time, the sample)``, or None."""
    samples = probe_watch(probe_dir).get("requests", [])
    return next(((t, v) for t, v in samples if t >= t0 and request_id not in v[3]), None)


def seconds_until_freed(
    probe_dir: str, t_post: float, t_end: float, *, acked: bool = True
) -> dict[str, float]:
    """When a request's item's slot came free, from the serve probe's watch of the frontend
    arena (every 5 ms, each process's own clock readings: CLOCK_MONOTONIC is one clock on a
    machine): ``freed_s``, seconds from ``t_end`` (the client's close, or its last token)
    until the API server's writer held again as many allocations as before the request was
    posted (``t_post``), after holding one more; with ``acked``, ``acked_s``, until the
    engine core acked the stub after ``t_end`` (its last view died). Waits up to 60 s."""

    def found() -> dict[str, float] | None:
        watch = probe_watch(probe_dir)
        in_use, acks = watch.get("in_use", []), watch.get("acked", [])
        before = [v for t, v in in_use if t < t_post]
        acks_before = [v for t, v in acks if t < t_end]
        if not before or (acked and not acks_before):
            return None
        rose = next((t for t, v in in_use if t >= t_post and v > before[-1]), None)
        freed = next(
            (t for t, v in in_use if rose is not None and t > rose and v <= before[-1]), None
        )
        if freed is None:
            return None
        out = {"freed_s": freed - t_end, "filled_s": rose - t_post}
        if acked:
            ack = next((t for t, v in acks if t >= t_end and v > acks_before[-1]), None)
            if ack is None:
                return None
            out["acked_s"] = ack - t_end
        return out

    return wait_for("the item's slot to be free (the serve probe)", found, 60, PROBE_POLL_S)


def abort_while_waiting(
    srv: Server, args: argparse.Namespace, r: ImageRequest, *, too_big: bool = False
) -> dict[str, Any]:
    """A long text request takes the only sequence slot; a request with the new image ``r``
    then waits behind it until its client closes the connection (vLLM aborts it). What the
    frontend arena did with its item, from ``/metrics`` settled before and after; with
    ``too_big`` (an item vLLM's cache cannot hold), also how soon its slot was free."""
    before = settle_metrics(srv, args)
    # Made first: beside the running request this process gets little CPU (one PNG took 38 s
    # there, and the request it was for missed the window).
    body = json.dumps(chat_body(image_content(prepare(r, args)), args.seed, 4))
    long_req: dict[str, Any] = {}
    # Its first token, not vLLM's running gauge: the gauge keeps the last step's count after
    # the settle pings, so it can say "running" before this request even arrived.
    generating = threading.Event()
    stop = threading.Event()

    def long_text() -> None:
        try:
            res = chat_stream(
                srv.base,
                [{"type": "text", "text": "Count."}],
                args.seed,
                ABORT_LONG_TOKENS,
                args.request_timeout,
                first_token=generating,
                stop=stop,
            )
            long_req["stopped"] = res["stopped"]
        except Exception as e:  # noqa: BLE001  (recorded, checked below)
            long_req["error"] = f"{type(e).__name__}: {e}"

    t = threading.Thread(target=long_text, daemon=True)
    t.start()
    probe = srv.probe_dir
    try:
        wait_for("the long text request to run", generating.is_set, 60)
        conn = http.client.HTTPConnection("127.0.0.1", srv.port, timeout=60)
        t_post = time.monotonic()
        conn.request("POST", "/v1/chat/completions", body, {"Content-Type": "application/json"})
        # Followed by its own id: the scheduler's waiting count misled (new_waiting_request).
        t_queued, image_id, running_then = wait_for(
            "the image request to wait",
            lambda: new_waiting_request(probe, t_post),
            90,
            PROBE_POLL_S,
        )
        queued_s = t_queued - t_post
        conn.close()  # the client goes away: vLLM aborts the request
        t_close = time.monotonic()
        t_gone, sample = wait_for(
            "the image request to leave the scheduler",
            lambda: request_left(probe, t_close, image_id),
            60,
            PROBE_POLL_S,
        )
        gone_s = t_gone - t_close
        # Aborted, not started: the long request still the one running when it left, and the
        # image request never among the running ones.
        long_running = bool(running_then) and sample[2] == running_then
        samples = probe_watch(probe).get("requests", [])
        started = any(image_id in v[2] for t, v in samples if t_post <= t <= t_gone)
        freed = seconds_until_freed(probe, t_post, t_close) if too_big else {}
        # What the engine core's scheduler did meanwhile, times from the close (the record).
        watched = [
            [round(t - t_close, 3), v[:3]] for t, v in samples if t_post - 1 <= t <= t_gone + 1
        ]
    finally:
        stop.set()  # the long request's client goes too (vLLM aborts it)
        t.join(args.request_timeout)
    after = settle_metrics(srv, args)
    d = frontend_deltas(before, after)
    return {
        "queued_s": queued_s,
        "left_scheduler_s": gone_s,
        "image_request_id": image_id,
        "image_request_started": started,
        "long_request_still_running": long_running,
        "long_request_error": long_req.get("error"),
        "long_request_stopped": long_req.get("stopped"),
        "scheduler": watched,
        "filled": d["filled"],
        "forwarded": d["forwarded"],
        "in_use_before": frontend_in_use(before),
        "in_use_after": d["in_use"],
        "freed_s": freed.get("freed_s"),
        "acked_s": freed.get("acked_s"),
        "filled_s": freed.get("filled_s"),
    }


def run_too_big(args: argparse.Namespace, seed_base: int) -> dict[str, Any]:
    """A server whose multimodal cache cannot hold one large image: a request with a new one
    aborted while it waits (its slot must be free soon after, nothing else holds it), then the
    same image sent again (vLLM serves it uncached: one more copy, one forward, nothing held
    once it finished)."""
    log_path = os.path.join(args.log_dir, "serve_too_big.log")
    srv = Server(args, "too-big", "--enable-shm-tensor-arena", log_path)
    srv.cmd += ["--mm-processor-cache-gb", str(TOO_BIG_CACHE_GB), "--max-num-seqs", "1"]
    srv.cmd += ["--max-model-len", ABORT_MODEL_LEN]
    srv.env["VLLM_SHM_ARENA_MIN_MB"] = TOO_BIG_MIN_MB
    srv.probe()  # when the request waited and left, its slot came free (abort_while_waiting)
    r = ImageRequest("too-big", 0, IMAGE_KINDS["large"], seed_base + 700, False)
    rec: dict[str, Any] = {"config": "too-big", "errors": []}
    print(f"serve-test [too-big]: starting vllm serve (cache {TOO_BIG_CACHE_GB} GB)")

    def body() -> None:
        rec["abort"] = abort_while_waiting(srv, args, r, too_big=True)
        print(f"serve-test [too-big]: abort while waiting: {json.dumps(rec['abort'])}")
        before = settle_metrics(srv, args)
        content = image_content(prepare(r, args))
        t_post = time.monotonic()
        res = chat_stream(srv.base, content, args.seed, 4, args.request_timeout)
        # Before any other request (the settle's pings): nothing else may release it.
        freed = seconds_until_freed(srv.probe_dir, t_post, time.monotonic(), acked=False)
        rec["again"] = {"token_ids": res["token_ids"]} | frontend_deltas(
            before, settle_metrics(srv, args)
        )
        rec["again"]["freed_after_last_token_s"] = freed["freed_s"]
        rec["again"]["in_use_before"] = frontend_in_use(before)
        print(f"serve-test [too-big]: sent again: {json.dumps(rec['again'] | {'token_ids': None})}")

    serve_and_record(srv, rec, body)
    return rec


def aborted_unforwarded(ab: dict[str, Any]) -> bool:
    """An ``abort_while_waiting`` result: the image request left the scheduler, never having
    run, while the long text request still ran; its item copied once into the frontend arena,
    forwarded to no worker."""
    return (
        ab["long_request_still_running"]
        and not ab["image_request_started"]
        and ab["long_request_error"] is None
        and ab["filled"] == 1
        and ab["forwarded"] == 0
    )


def too_big_checks(rec: dict[str, Any]) -> list[tuple[str, str, bool, str]]:
    """What the too-big run must show (``run_too_big``)."""
    out = [("too-big", "server started, requests answered", not rec["errors"], str(rec["errors"]))]
    ab, again = rec.get("abort"), rec.get("again")
    if ab is not None:
        out.append(
            (
                "too-big",
                "abort while waiting, an item larger than vLLM's cache: copied once into the "
                "frontend arena, forwarded to no worker, its slot free within "
                f"{TOO_BIG_FREED_S:g} s of the client's close (the serve probe's watch; nothing "
                "else holds it) and still free at the next report",
                aborted_unforwarded(ab)
                and ab["in_use_after"] == ab["in_use_before"]
                and ab["freed_s"] is not None
                and 0 <= ab["freed_s"] <= TOO_BIG_FREED_S,
                json.dumps(ab),
            )
        )
    if again is not None:
        out.append(
            (
                "too-big",
                "the same image again: vLLM serves it uncached, so one more copy and one "
                "forward; once finished nothing holds its slot (free within "
                f"{TOO_BIG_FREED_S:g} s of the client's last token, before any other request) "
                "and no rank owes an ack; a clean stop, no vsa_ name left",
                again["filled"] == 1
                and again["freed_after_last_token_s"] <= TOO_BIG_FREED_S
                and again["forwarded"] == 1
                and again["hits"] == 0
                and again["in_use"] == again["in_use_before"]
                and again["core_owed"] == 0
                and again["workers_owed"] == 0
                and rec["stop"].get("rc") == 0
                and not rec["vsa_names_left"],
                json.dumps({k: v for k, v in again.items() if k != "token_ids"}),
            )
        )
    return out


def run_eviction(args: argparse.Namespace, seed_base: int) -> dict[str, Any]:
    """A server whose multimodal cache holds ``EVICTION_CACHED`` large images gets
    ``EVICTION_IMAGES`` new ones, then the first again; per request, the frontend arena's
    copies, the forwards, the queue-arena hits and its slots in use (``/metrics``, settled)."""
    log_path = os.path.join(args.log_dir, "serve_eviction.log")
    srv = Server(args, "eviction", "--enable-shm-tensor-arena", log_path)
    # One sequence at a time (the last --max-num-seqs given wins): the abort run's image
    # request waits behind its long text request.
    srv.cmd += ["--mm-processor-cache-gb", str(EVICTION_CACHE_GB), "--max-num-seqs", "1"]
    srv.cmd += ["--max-model-len", ABORT_MODEL_LEN]
    srv.probe()  # when the aborted request waited and left (abort_while_waiting)
    side = IMAGE_KINDS["large"]
    plan = [
        ImageRequest("evict", i, side, seed_base + 500 + i, False) for i in range(EVICTION_IMAGES)
    ]
    plan.append(ImageRequest("evict", len(plan), side, plan[0].seed, False))  # the first again
    rec: dict[str, Any] = {"config": "eviction", "requests": [], "errors": []}
    print(f"serve-test [eviction]: starting vllm serve (cache {EVICTION_CACHE_GB} GB)")

    def body() -> None:
        aborted = ImageRequest("abort", 0, side, seed_base + 600, False)
        rec["abort"] = abort_while_waiting(srv, args, aborted)
        print(f"serve-test [eviction]: abort while waiting: {json.dumps(rec['abort'])}")
        prev = settle_metrics(srv, args)
        for r in plan:
            res = chat_stream(
                srv.base, image_content(prepare(r, args)), args.seed, 4, args.request_timeout
            )
            m = settle_metrics(srv, args)
            row = {"key": r.key, "token_ids": res["token_ids"]} | frontend_deltas(prev, m)
            rec["requests"].append(row)
            print(f"serve-test [eviction]: {json.dumps(row | {'token_ids': None})}", flush=True)
            prev = m

    serve_and_record(srv, rec, body)
    return rec


#: The preemption runs: a KV cache of this many blocks (128 tokens each, the CPU backend's
#: block size) holds both large images' prompts (about 2,330 tokens, 19 blocks each) with 2
#: blocks to spare, so two requests decoding PREEMPT_TOKENS tokens each run out of blocks and
#: vLLM preempts the later one and recomputes it (its image is sent again only if the workers'
#: encoder cache no longer holds its output). They run out only while both decode: with 300
#: tokens, a run under load once let the first finish before the second (slowed in its
#: prefill) needed its 20th block, and there was no preemption; 800 (25 blocks each, 3,130
#: tokens of the 4,096 allowed) leaves the second ~600 of the first's tokens to get there.
PREEMPT_BLOCKS = 40
PREEMPT_TOKENS = 800


def run_preemption(args: argparse.Namespace, flag: str, seed_base: int) -> dict[str, Any]:
    """Two new large images' requests, the second sent once the first runs, on a server whose
    KV cache cannot hold both to the end: token ids, preemptions and (flag on) the frontend
    arena's fills, forwards and slots in use afterwards (``/metrics``, settled)."""
    config = "preempt-" + ("arena" if flag == "--enable-shm-tensor-arena" else "stock")
    log_path = os.path.join(args.log_dir, f"serve_{config}.log")
    srv = Server(args, config, flag, log_path)
    srv.cmd += ["--num-gpu-blocks-override", str(PREEMPT_BLOCKS), "--max-num-seqs", "2"]
    side = IMAGE_KINDS["large"]
    plan = [ImageRequest("preempt", i, side, seed_base + 700 + i, False) for i in range(2)]
    rec: dict[str, Any] = {"config": config, "requests": [], "errors": []}
    print(f"serve-test [{config}]: starting vllm serve ({PREEMPT_BLOCKS} KV blocks)")

    def body() -> None:
        before = settle_metrics(srv, args)
        pngs = [prepare(r, args) for r in plan]
        out: dict[int, Any] = {}
        # The second is sent once the first streams (the same order in both servers).
        generating = threading.Event()

        def one(i: int) -> None:
            try:
                out[i] = chat_stream(
                    srv.base,
                    image_content(pngs[i]),
                    args.seed,
                    PREEMPT_TOKENS,
                    600,
                    first_token=generating if i == 0 else None,
                )
            except Exception as e:  # noqa: BLE001  (recorded below)
                out[i] = e

        first = threading.Thread(target=one, args=(0,), daemon=True)
        first.start()
        wait_for("the first request to run", generating.is_set, 120)
        one(1)
        first.join(600)
        for i, r in enumerate(plan):
            res = out.get(i)
            if not isinstance(res, dict):
                raise CheckFailed(f"request {r.key}: {res!r}")
            rec["requests"].append({"key": r.key, "token_ids": res["token_ids"]})
        after = settle_metrics(srv, args)
        rec["preemptions"] = int(vllm_gauge(srv.base, "vllm:num_preemptions_total"))
        rec.update(frontend_deltas(before, after))
        summary = {k: v for k, v in rec.items() if k != "requests"}
        print(f"serve-test [{config}]: {json.dumps(summary)}", flush=True)

    serve_and_record(srv, rec, body)
    return rec


def preemption_checks(on: dict[str, Any], off: dict[str, Any]) -> list[tuple[str, str, bool, str]]:
    """What the two preemption runs must show (``run_preemption``, flag on and off)."""
    out = [
        (
            "preemption",
            "both servers answered both requests",
            not on["errors"] and not off["errors"],
            json.dumps(on["errors"] + off["errors"]),
        )
    ]
    if on["errors"] or off["errors"]:
        return out
    tokens = lambda rec: [r["token_ids"] for r in rec["requests"]]  # noqa: E731
    out += [
        (
            "preemption",
            "vLLM preempted a request on both servers (the KV cache ran out)",
            on["preemptions"] >= 1 and off["preemptions"] >= 1,
            json.dumps([on["preemptions"], off["preemptions"]]),
        ),
        (
            "preemption",
            f"identical token ids with the flag on and off ({PREEMPT_TOKENS} each)",
            tokens(on) == tokens(off) and all(len(t) == PREEMPT_TOKENS for t in tokens(on)),
            json.dumps([len(t) for t in tokens(on)]),
        ),
        (
            "preemption",
            "each image copied once into the frontend arena, never into the queue's arena, "
            "forwarded at least once (the recomputed request sends its image again only if "
            "the workers' encoder cache let it go); afterwards the 2 slots vLLM's cache "
            "holds, nothing more; a clean stop, no vsa_ name left",
            on["filled"] == 2
            and on["hits"] == 0
            and on["forwarded"] >= 2
            and on["in_use"] == 2
            and on["stop"].get("rc") == 0
            and not on["vsa_names_left"],
            json.dumps({k: on[k] for k in ("filled", "forwarded", "hits", "in_use")}),
        ),
    ]
    return out


def eviction_checks(rec: dict[str, Any]) -> list[tuple[str, str, bool, str]]:
    """What the eviction run must show (``run_eviction``)."""
    rows = rec["requests"]
    out = [("eviction", "server started, requests answered", not rec["errors"], str(rec["errors"]))]
    ab = rec.get("abort")
    if ab is not None:
        out.append(
            (
                "eviction",
                "abort while waiting: the image request waited behind the long text request "
                "and left the scheduler, never run, while that one still ran; its item was "
                "copied once into the frontend arena, forwarded to no worker, and is held by "
                "vLLM's cache alone (one more slot in use)",
                aborted_unforwarded(ab) and ab["in_use_after"] == ab["in_use_before"] + 1,
                json.dumps(ab),
            )
        )
    if len(rows) != EVICTION_IMAGES + 1:
        return out
    new, again = rows[:-1], rows[-1]
    out += [
        (
            "eviction",
            f"{EVICTION_IMAGES} new images: each copied once into the frontend arena and "
            "forwarded once, no queue-arena copy",
            all(r["filled"] == 1 and r["forwarded"] == 1 and r["hits"] == 0 for r in new),
            json.dumps([(r["filled"], r["forwarded"], r["hits"]) for r in new]),
        ),
        (
            "eviction",
            f"frontend slots in use once finished <= {EVICTION_CACHED} (vLLM's cache holds "
            f"{EVICTION_CACHED}; an evicted item's slot is free, the aborted request's "
            "included)",
            0 <= new[-1]["in_use"] <= EVICTION_CACHED,
            json.dumps([r["in_use"] for r in rows]),
        ),
        (
            "eviction",
            "once each request finished the workers owe the frontend arena nothing "
            '(vllm:shm_arena_owed{arena="frontend"}, ranks >= 1) and the engine core owes only for '
            "what vLLM's cache holds (rank 0 at most the slots in use)",
            all(r["workers_owed"] == 0 and 0 <= r["core_owed"] <= r["in_use"] for r in rows)
            and any(r["core_owed"] > 0 for r in rows),
            json.dumps([(r["core_owed"], r["workers_owed"]) for r in rows]),
        ),
        (
            "eviction",
            "every rank's acks account for what it was sent, after each request: acked "
            '(vllm:shm_arena_acked_total{arena="frontend",rank}, from its own process) plus '
            "owed = the stubs sent (the engine core) or the forwards (each worker)",
            all(
                len(r["ack_balance"]) == 1 + SERVE_TP
                and all(total == sent for _, total, sent in r["ack_balance"])
                for r in rows
            ),
            json.dumps([r["ack_balance"] for r in rows]),
        ),
        (
            "eviction",
            "the first image again is a miss (evicted): one new copy, one forward, the same "
            "output as the first time",
            again["filled"] == 1
            and again["forwarded"] == 1
            and again["token_ids"] == rows[0]["token_ids"],
            json.dumps({k: again[k] for k in ("filled", "forwarded", "hits", "in_use")}),
        ),
        (
            "eviction",
            "stopped cleanly, no vsa_ name left",
            rec["stop"].get("rc") == 0 and not rec["vsa_names_left"],
            json.dumps({"rc": rec["stop"].get("rc"), "left": rec["vsa_names_left"]}),
        ),
    ]
    return out


def _median(xs: list[float]) -> float:
    xs = [x for x in xs if not math.isnan(x)]
    return statistics.median(xs) if xs else math.nan


FRONTEND_REPORT = re.compile(
    r"frontend arena at exit: (\d+) items' tensors filled \((\d+) B\), (\d+) stubs sent, "
    r"(\d+) declined"
)
FRONTEND_ENGINE_LINE = "the engine core resolves multimodal items by reference"


def frontend_report(log: str) -> dict[str, Any]:
    """What the API server said of its frontend arena at exit (vllm_frontend.py), and whether
    the engine core attached it."""
    m = FRONTEND_REPORT.search(log)
    out: dict[str, Any] = {"engine_attached": FRONTEND_ENGINE_LINE in log, "report": m is not None}
    if m:
        keys = ("filled", "filled_bytes", "stubs", "declined")
        out.update(zip(keys, map(int, m.groups()), strict=True))
    return out


def checks_for(rec: dict[str, Any], min_bytes: int) -> list[tuple[str, bool, str]]:
    """The per-configuration checks: (name, passed, detail). ``min_bytes`` is the package's
    divert threshold, named in the detail of an image below it."""
    out: list[tuple[str, bool, str]] = []
    arena_on = rec["config"] == "arena"
    out.append(("server started, requests answered", not rec["errors"], "; ".join(rec["errors"])))
    stop = rec["stop"]
    clean = (
        stop.get("rc") == 0
        and not stop.get("group_left_running")
        and not stop.get("already_exited")
        and not rec["force_kill_lines_in_log"]
    )
    out.append(
        (
            "stopped cleanly (SIGINT -> exit 0, no process left, no force-kill)",
            clean,
            json.dumps(stop)
            + (
                f"; force-kill lines: {rec['force_kill_lines_in_log']}"
                if rec["force_kill_lines_in_log"]
                else ""
            ),
        )
    )
    left = rec["vsa_names_left"]
    # Only the private directory decides: /dev/shm is shared with everything else on this
    # machine (other users' queues, and their crashed tests' stale segments, come and go
    # there), so names new there are recorded, not held against this server, whose queue
    # lives in the private directory (checked below from what start-up showed there).
    out.append(
        (
            "no vsa_ name left in the private shm directory",
            not left["private_shm_dir"],
            f"{json.dumps(left['private_shm_dir'])}; new in /dev/shm during the run (other "
            f"processes'): stale {left['dev_shm_new']}, live writer "
            f"{rec['dev_shm_new_with_live_writer']}",
        )
    )
    m = rec.get("metrics_final", {})
    if arena_on:
        out.append(("plugin active (engine log names the C++ arena)", rec["arena_line_in_log"], ""))
        out.append(
            (
                "each worker's response queue is ours (one log line per worker)",
                rec["response_queue_lines_in_log"] == SERVE_TP,
                f"{rec['response_queue_lines_in_log']} lines, {SERVE_TP} workers",
            )
        )
        seen = rec["private_shm_names_seen_starting"]
        out.append(
            (
                "the queue's ring and arena were made in the private VLLM_SHM_ARENA_SHM_DIR",
                any(n.startswith("vsa_ring_") for n in seen)
                and any(not n.startswith("vsa_ring_") for n in seen),
                f"seen there during start-up: {seen}",
            )
        )
        forwarding = rec["frontend"]["engine_attached"]
        for r in rec["requests"]:
            ok = went_through_an_arena(r, forwarding)
            by_reference = forwarding and r["pixel_values_bytes"] >= _frontend_min_bytes()
            detail = (
                f"hits +{r['arena_hits']}, bytes +{r['arena_bytes']}, "
                f"forwarded +{r['arena_forwarded']}"
            )
            if not ok and r["pixel_values_bytes"] < min_bytes:
                detail += (
                    f"; its pixel_values ({r['pixel_values_bytes']} B) are below the divert "
                    f"threshold of the queue's arena ({min_bytes} B), so they took the "
                    "out-of-band path"
                )
            how = (
                "forwarded by reference ("
                + (
                    "1 forward"
                    if r["images"] * r["n"] == 1
                    else f"{r['images']} to {r['images'] * r['n']} forwards"
                )
                + ", 0 queue-arena hits)"
                if by_reference
                else f"copied into the queue's arena (1 hit, {r['pixel_values_bytes']} B)"
            )
            out.append((f"{r['key']} {how}", ok, detail))
        fe = rec["frontend"]
        # A repeated image is a vLLM cache hit: no loan, no stub (its forward is checked above).
        new = [r for r in rec["requests"] if r["kind"] != "repeat"]
        new_bytes = sum(r["pixel_values_bytes"] for r in new)
        # n > 1: vLLM sends each choice as a request of its own, the same loan as one stub each.
        stubs = sum(r["images"] * r["n"] for r in new)
        out.append(
            (
                "frontend arena: each image's pixel_values filled once (1.00 x its bytes) and "
                f"sent as a stub per request ({stubs}), the engine core resolving them",
                fe["engine_attached"]
                and fe.get("filled") == sum(r["images"] for r in new)
                and fe.get("stubs") == stubs
                and fe.get("filled_bytes") == new_bytes
                and fe.get("declined") == 0,
                f"{json.dumps(fe)}; pixel_values bytes of the timed requests {new_bytes}",
            )
        )
        # Both arenas' series (the workers read both); None when no worker reported.
        mm_name = "vllm:shm_arena_checksum_mismatches_total"
        mm = metric(m, mm_name) if series(m, mm_name) else None
        out.append(
            (
                "0 checksum mismatches (metric exported by the workers, no log line)",
                mm == 0 and rec["mismatch_lines_in_log"] == 0,
                f"metric {mm}, log lines {rec['mismatch_lines_in_log']}",
            )
        )
    else:
        hits, _ = _arena_totals(m)
        out.append(
            (
                "flag off: no arena line, no arena hit, no response queue of ours (stock vLLM)",
                not rec["arena_line_in_log"]
                and hits == 0
                and not rec["response_queue_lines_in_log"],
                f"arena line {rec['arena_line_in_log']}, hits {hits}, response queue lines "
                f"{rec['response_queue_lines_in_log']}",
            )
        )
    return out


# ---------------------------------------------------------------------------------------------
# results


def summarize(rec: dict[str, Any]) -> dict[str, Any]:
    """Start-up, TTFT and end-to-end medians per image kind (warm-up excluded)."""
    out = {
        "startup_s": rec["startup_s"],
        "stop_s": rec["stop"].get("stop_s"),
        "workers_sigtermed_after_grace": rec["grace_sigterm_lines_in_log"] > 0,
    }
    for kind in IMAGE_KINDS:
        rs = [r for r in rec["requests"] if r["kind"] == kind and not r["warmup"]]
        out[kind] = {
            "n": len(rs),
            "ttft_median_s": _median([r["ttft_s"] for r in rs]),
            "e2e_median_s": _median([r["e2e_s"] for r in rs]),
        }
    warm = [r for r in rec["requests"] if r["warmup"]]
    if warm:
        out["warmup"] = {"ttft_s": warm[0]["ttft_s"], "e2e_s": warm[0]["e2e_s"]}
    return out


def write_results(path_dir: str, result: dict[str, Any]) -> None:
    """serve_test.json (everything) and serve_test.md (the tables)."""
    os.makedirs(path_dir, exist_ok=True)
    with open(os.path.join(path_dir, "serve_test.json"), "w") as f:
        json.dump(result, f, indent=2, default=str)
        f.write("\n")
    md = [
        "# `make serve-test`: real `vllm serve`, TP=2, tiny random-weight Qwen2-VL",
        "",
        f"Result: **{'PASS' if result['passed'] else 'FAIL'}** ({result['when']}, "
        f"{result['host']}). Written by `e2e/run_serve_test.py`; the full record "
        "is `serve_test.json`.",
        "",
        f"vllm-cpu {result['versions']['vllm']}, torch {result['versions']['torch']}, "
        f"transformers {result['versions']['transformers']}; `vllm serve <tiny-qwen2vl> "
        "--tensor-parallel-size 2 --distributed-executor-backend mp --enforce-eager "
        "--dtype float32 --max-model-len 4096 --seed 0 --shutdown-timeout "
        f"{result['settings']['shutdown_timeout']}` with `--enable-shm-tensor-arena` (arena) or "
        "`--no-enable-shm-tensor-arena` (stock); `VLLM_CPU_OMP_THREADS_BIND="
        f"{result['settings']['omp_bind']}`, `VLLM_CPU_KVCACHE_SPACE="
        f"{result['settings']['kv_cache_gib']}`, `VLLM_SHM_ARENA_DEBUG_CHECKSUM=1`, private "
        "`PROMETHEUS_MULTIPROC_DIR` and `VLLM_SHM_ARENA_SHM_DIR`. Requests: streamed chat "
        f"completions, one base64 PNG each (the last: two, n = 2, temperature 1), temperature 0, "
        f"seed {result['settings']['seed']}, "
        f"{result['settings']['max_tokens']} tokens (`ignore_eos`). Medians over "
        f"{result['settings']['per_kind']} requests per image kind, each with a different image; "
        "one warm-up image request first (timed apart). The arena divert threshold was "
        f"{result['settings']['min_bytes']} bytes (the queue's arena layout: "
        "`vllm_shm_arena.arena.VARIABLE_MIN_BYTES` for the default variable-size layout).",
        "",
        "## Timings",
        "",
        "| configuration | start-up | warm-up request e2e | large: TTFT / e2e (median) | "
        "typical: TTFT / e2e (median) | stop |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for name, s in result["summary"].items():
        md.append(
            f"| {name} | {s['startup_s']:.1f} s | {s.get('warmup', {}).get('e2e_s', math.nan):.2f}"
            f" s | {s['large']['ttft_median_s']:.3f} / {s['large']['e2e_median_s']:.3f} s | "
            f"{s['typical']['ttft_median_s']:.3f} / {s['typical']['e2e_median_s']:.3f} s | "
            f"{s['stop_s']} s |"
        )
    md += [
        "",
        "## Queue-arena hits, bytes and forwards per image (arena configuration)",
        "",
        "| request | image | resized to | patches | pixel_values (uint8) | arena hits "
        "| arena bytes | forwarded | match |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    arena = next((c for c in result["configs"] if c["config"] == "arena"), None)
    for r in arena["requests"] if arena else []:
        ok = went_through_an_arena(r, arena["frontend"]["engine_attached"])
        md.append(
            f"| {r['key']} | {r['side']}² | {r['resized'][0]}×{r['resized'][1]} | {r['patches']} |"
            f" {r['pixel_values_bytes']:,} B ({r['pixel_values_bytes'] / 2**20:.2f} MiB) | "
            f"{r['arena_hits']} | {r['arena_bytes']:,} | {r['arena_forwarded']} | "
            f"{'yes' if ok else '**no**'} |"
        )
    md += [
        "",
        "Stop: SIGINT to `vllm serve`; vLLM drains (`--shutdown-timeout`), and its executor "
        "SIGTERMs workers still running 5 s after it asked them to exit ("
        + ", ".join(
            f"{n}: {'yes' if s['workers_sigtermed_after_grace'] else 'no'}"
            for n, s in result["summary"].items()
        )
        + ").",
    ]
    md += ["", "## Identical outputs, flag on vs flag off", ""]
    tok = result["identical_tokens"]
    md.append(
        f"{tok['identical']} of {tok['total']} requests returned identical token ids and "
        "logprobs (each request a different image; distinct outputs per configuration: "
        f"{tok['distinct_outputs_per_config']})"
        + (f"; differing: {', '.join(tok['differing'])}" if tok["differing"] else "")
        + "."
    )
    md += ["", "## Checks", "", "| configuration | check | result | detail |", "|---|---|---|---|"]
    for name, check, ok, detail in result["checks"]:
        md.append(f"| {name} | {check} | {'pass' if ok else '**FAIL**'} | {detail[:300]} |")
    with open(os.path.join(path_dir, "serve_test.md"), "w") as f:
        f.write("\n".join(md) + "\n")


def _versions() -> dict[str, str]:
    import importlib.metadata as md

    return {
        d: md.version(n)
        for d, n in (("vllm", "vllm-cpu"), ("torch", "torch"), ("transformers", "transformers"))
    }


def _frontend_min_bytes() -> int:
    """The smallest tensor the frontend arena takes (``FrontendWriter``'s default)."""
    from vllm_shm_arena import arena

    return arena.VARIABLE_MIN_BYTES


def _queue_min_bytes() -> int:
    """The divert threshold of the arena the plugin's queue builds (its layout's)."""
    from vllm_shm_arena import arena, settings

    if settings.arena_policy() == "fixed":
        return arena.MIN_BYTES
    return arena.VARIABLE_MIN_BYTES


def main() -> int:
    """Runs both configurations, compares them, writes the results; exit 1 on any failure."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True, help="the tiny Qwen2-VL directory")
    ap.add_argument("--results", default=os.path.join(ROOT, "benchmarks/results/serve_test"))
    ap.add_argument("--log-dir", default=os.path.join(ROOT, "build/serve_test"))
    ap.add_argument(
        "--shm-parent",
        default="/dev/shm",
        help="tmpfs under which each run's private shm directory is made",
    )
    ap.add_argument(
        "--no-eviction",
        action="store_true",
        help="skip the third and fourth servers (the eviction and too-big runs)",
    )
    ap.add_argument(
        "--no-preemption",
        action="store_true",
        help="skip the preemption runs (two more servers, flag on and off)",
    )
    add_common_arguments(ap, per_kind=5, startup_timeout=600)
    args = ap.parse_args()
    plan, seed_base = plan_requests(args, "serve-test")
    # The first large image once more: vLLM's multimodal cache hit (no payload from the API
    # server; the engine core forwards the tensor its cache holds again).
    first = next(r for r in plan if r.kind == "large" and not r.warmup)
    plan.append(ImageRequest("repeat", 0, first.side, first.seed, warmup=False))
    repeats = {plan[-1].key: first.key}
    # Two new images in one request, text between them, two choices (n = 2).
    pair_seed = seed_base + 900
    plan.append(ImageRequest("pair", 0, IMAGE_KINDS["typical"], pair_seed, False, images=2, n=2))

    configs = []
    for config, flag in (
        ("arena", "--enable-shm-tensor-arena"),
        ("stock", "--no-enable-shm-tensor-arena"),
    ):
        configs.append(run_config(args, config, flag, plan))

    checks = []
    for rec in configs:
        for name, ok, detail in checks_for(rec, _queue_min_bytes()):
            checks.append((rec["config"], name, ok, detail))
    identical, same = compare_outputs(
        configs, [r.key for r in plan], args.max_tokens, repeats, {r.key: r.n for r in plan}
    )
    checks += same
    eviction = too_big = None
    if not args.no_eviction:
        eviction = run_eviction(args, seed_base)
        checks += eviction_checks(eviction)
        too_big = run_too_big(args, seed_base)
        checks += too_big_checks(too_big)
    preemption = None
    if not args.no_preemption:
        preemption = [
            run_preemption(args, flag, seed_base)
            for flag in ("--enable-shm-tensor-arena", "--no-enable-shm-tensor-arena")
        ]
        checks += preemption_checks(*preemption)
    passed = all(ok for _, _, ok, _ in checks)
    result = {
        "passed": passed,
        "when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "host": f"{platform.machine()}, {os.cpu_count()} CPUs",
        "versions": _versions(),
        "settings": {
            "per_kind": args.per_kind,
            "max_tokens": args.max_tokens,
            "seed": args.seed,
            "image_seed": seed_base,
            "omp_bind": args.omp_bind,
            "kv_cache_gib": args.kv_cache_gib,
            "shutdown_timeout": args.shutdown_timeout,
            "min_bytes": _queue_min_bytes(),
            "max_pixels": args.max_pixels,
        },
        "summary": {c["config"]: summarize(c) for c in configs},
        "identical_tokens": identical,
        "checks": checks,
        "configs": configs,
        "eviction": eviction,
        "too_big": too_big,
        "preemption": preemption,
    }
    write_results(args.results, result)
    print_checks("serve-test", checks)
    print(
        f"serve-test: {'PASSED' if passed else 'FAILED'}; results in "
        f"{os.path.relpath(args.results, ROOT)}/serve_test.{{md,json}}",
        flush=True,
    )
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
