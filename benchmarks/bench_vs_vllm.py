"""Ours vs vLLM's own queue and arena, in one run (`make bench-vs-vllm`).

Drives this project's ``MessageQueue`` (modes ``oob``: arena off; ``arena``; ``loan``: the
producer builds its tensor in the arena) and vLLM's own ``MessageQueue`` from
``vllm.distributed.device_communicators.shm_broadcast`` (``vllm-oob``: stock;
``vllm-arena``: its pure-Python ``ShmTensorArena``, 8 round-robin slots of 256 MiB, tensors
>= 8 MiB) through ``harness.run_cell``: one writer, TP forked readers that copy each
tensor into host memory, lock-step messages. Needs vLLM importable: run it in the venv
``make vllm-test`` builds (``.venv-vllm``).

Workloads, each at TP {1, 2, 4}:

* one bf16 tensor of 1, 8, 64 and 200 MiB;
* the burst: one message with 25 tensors of 16 MiB;
* uint8 ``pixel_values`` shaped like vLLM's for one image (n_patches x 1176) at 448^2,
  1024^2 and 2048^2 (1.2, 6.4 and 25 MB);
* a tensor-free message shaped like a scheduler step: a few hundred request ids, nested
  token and block lists, and small tensors (all below both arenas' thresholds).

Every cell runs ``--repeats`` times (default 3); the repetitions are interleaved (the whole
sweep once, then again), and inside each sweep the order of the modes rotates. Per cell the
median over the repetitions of the per-message p50 is reported with the repetitions' min and
max. Ratios (vLLM's / ours, > 1: ours faster) are paired per repetition (the two cells ran
next to each other), reported as the median with the min-max of the repetitions.

Writes benchmarks/results/vs_vllm/vs_vllm.{md,json,png}. Prints, never asserts.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import random
import signal
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import harness as ab  # noqa: E402  (benchmarks/, beside this file)

from vllm_shm_arena._ext import _C  # noqa: E402

OUT = os.path.join(ab.RESULTS, "vs_vllm")
TPS = [1, 2, 4]
SIZES_MB = [1, 8, 64, 200]
MODES = ["oob", "arena", "loan", "vllm-oob", "vllm-arena"]
#: Modes for the tensor-free message: there is nothing to lend, so no ``loan``.
TENSOR_FREE_MODES = ["oob", "arena", "vllm-oob", "vllm-arena"]
BURST = [16] * 25
#: Warm-up messages: vLLM's arena hands out its 8 slots round-robin and each slot's first use
#: pays page faults, so a one-tensor workload needs more than 8 messages before it is warm;
#: a burst message uses all 8 slots at once.
WARMUP = {"tensor": 10, "burst": 3, "tensor_free": 20}
#: vLLM's own arena constants (shm_tensor_arena.py, 0.33.0): for reading the results.
VLLM_ARENA_MIN_BYTES = 8 << 20
VLLM_ARENA_SLOTS = 8


def scheduler_step(seed: int, n_running: int = 256, n_new: int = 8) -> dict:
    """A tensor-free message shaped like a decode step's ``SchedulerOutput``: ``n_running``
    cached requests (one new token each) and ``n_new`` new ones with their prompts, as plain
    dicts/lists, plus the small tensors a step carries (all well below 1 MiB)."""
    rnd = random.Random(seed)
    ids = [f"chatcmpl-{rnd.getrandbits(64):016x}-{i}" for i in range(n_running + n_new)]
    new_reqs = []
    for k in range(n_new):
        prompt = [rnd.randrange(151_000) for _ in range(rnd.randrange(64, 512))]
        new_reqs.append(
            {
                "req_id": ids[n_running + k],
                "prompt_token_ids": prompt,
                "sampling_params": {
                    "temperature": 0.7,
                    "top_p": 0.95,
                    "max_tokens": 512,
                    "seed": None,
                    "stop_token_ids": [151_643, 151_645],
                },
                "block_ids": ([rnd.randrange(20_000) for _ in range(len(prompt) // 16 + 1)],),
                "num_computed_tokens": 0,
                "lora_request": None,
            }
        )
    cached = {
        "req_ids": ids[:n_running],
        "resumed_req_ids": set(),
        "new_token_ids": [[rnd.randrange(151_000)] for _ in range(n_running)],
        "new_block_ids": [
            ([rnd.randrange(20_000)],) if rnd.random() < 0.06 else None for _ in range(n_running)
        ],
        "num_computed_tokens": [rnd.randrange(1, 8192) for _ in range(n_running)],
        "num_output_tokens": [rnd.randrange(1, 512) for _ in range(n_running)],
    }
    num_scheduled = {r: 1 for r in ids[:n_running]}
    num_scheduled.update({r["req_id"]: len(r["prompt_token_ids"]) for r in new_reqs})
    n_tokens = sum(num_scheduled.values())
    g = torch.Generator().manual_seed(seed)
    return {
        "scheduled_new_reqs": new_reqs,
        "scheduled_cached_reqs": cached,
        "num_scheduled_tokens": num_scheduled,
        "total_num_scheduled_tokens": n_tokens,
        "scheduled_spec_decode_tokens": {},
        "finished_req_ids": set(rnd.sample(ids[:n_running], 3)),
        "free_encoder_mm_hashes": [],
        "positions": torch.arange(n_tokens, dtype=torch.int64),
        "temperature": torch.full((n_running + n_new,), 0.7),
        "block_table": torch.randint(0, 20_000, (n_running + n_new, 64), generator=g).to(
            torch.int32
        ),
    }


class _Interrupted(Exception):
    """SIGTERM during the sweep."""


def workloads(seed: int, sides: list[int]) -> list[dict]:
    """The workload specs: name, kind (warm-up class), modes, the message's tensors
    (``sources``) and its other items (``extra``)."""
    out = []
    # Tensors are built once here: random bytes for 25 x 16 MiB take seconds per cell.
    for mb in SIZES_MB:
        out.append(
            {
                "name": f"{mb} MiB",
                "kind": "tensor",
                "size_mb": mb,
                "sources": [ab.make_tensor(mb, seed)],
                "modes": MODES,
            }
        )
    out.append(
        {
            "name": "burst 25x16 MiB",
            "kind": "burst",
            "size_mb": 16,
            "sources": [ab.make_tensor(mb, seed + k) for k, mb in enumerate(BURST)],
            "modes": MODES,
        }
    )
    for side in sides:
        pv = ab.pixel_values(side, seed)
        out.append(
            {
                "name": f"pixel_values {side}^2",
                "kind": "tensor",
                "size_mb": pv.numel() / (1 << 20),
                "sources": [pv],
                "modes": MODES,
            }
        )
    out.append(
        {
            "name": "scheduler step (no large tensor)",
            "kind": "tensor_free",
            "size_mb": 0,
            "sources": [],
            "extra": {"sched": scheduler_step(seed)},
            "modes": TENSOR_FREE_MODES,
        }
    )
    return out


def _spread(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def _fmt(s: dict, unit: str = "", digits: int = 2) -> str:
    return f"{s['median']:.{digits}f}{unit} [{s['min']:.{digits}f}-{s['max']:.{digits}f}]"


def summarize(raw: list[dict]) -> tuple[list[dict], list[dict]]:
    """Per (workload, TP, mode): median and min-max over repetitions of each metric; per
    (workload, TP): vLLM's / ours ratios, paired per repetition."""
    cells: dict = {}
    for c in raw:
        cells.setdefault((c["wl_index"], c["tp"], c["mode"]), []).append(c)
    summary = []
    for (wi, tp, mode), reps in sorted(cells.items(), key=lambda kv: kv[0][:2]):
        row = {
            "workload": reps[0]["workload_name"],
            "wl_index": wi,
            "tp": tp,
            "mode": mode,
            "tensor_bytes": reps[0]["tensor_bytes"],
            "repeats": len(reps),
            "messages": reps[0]["messages"],
        }
        for k in ("enqueue_ms", "delivery_ms", "consume_ms", "dequeue_us"):
            row[k] = _spread([r[f"{k}_p50"] for r in reps])
        row["arena_hits_per_message"] = statistics.median(
            r["arena_hits"] / r["messages"] for r in reps
        )
        row["fallbacks_per_message"] = max(r["fallbacks_per_message"] for r in reps)
        summary.append(row)
    ratios = []
    pairs: dict = {}
    for c in raw:
        pairs.setdefault((c["wl_index"], c["tp"], c["repeat"]), {})[c["mode"]] = c
    by_cell: dict = {}
    for (wi, tp, _rep), modes in pairs.items():
        by_cell.setdefault((wi, tp), []).append(modes)
    for (wi, tp), reps in sorted(by_cell.items()):
        row = {"workload": reps[0][next(iter(reps[0]))]["workload_name"], "wl_index": wi, "tp": tp}
        for theirs, ours in (("vllm-arena", "arena"), ("vllm-oob", "oob"), ("vllm-arena", "loan")):
            for metric in ("delivery", "consume"):
                vals = [
                    m[theirs][f"{metric}_ms_p50"] / m[ours][f"{metric}_ms_p50"]
                    for m in reps
                    if theirs in m and ours in m
                ]
                if vals:
                    row[f"{metric} {theirs}/{ours}"] = _spread(vals)
        ratios.append(row)
    return summary, ratios


def targets(ratios: list[dict], summary: list[dict]) -> dict:
    """Issue 13's targets, read off this run (reported, never asserted)."""
    key_d, key_c = "delivery vllm-arena/arena", "consume vllm-arena/arena"
    with_tensor = [r for r in ratios if key_d in r and not r["workload"].startswith("scheduler")]
    deliv = [r[key_d]["median"] for r in with_tensor]
    cons = [r[key_c]["median"] for r in with_tensor]
    burst = [r[key_d]["median"] for r in with_tensor if r["workload"].startswith("burst")]
    tf = {}
    for r in summary:
        if r["workload"].startswith("scheduler"):
            tf.setdefault(r["tp"], {})[r["mode"]] = r["delivery_ms"]["median"] * 1e3
    return {
        "cells": len(with_tensor),
        "cells_delivery_ge_0.95": sum(v >= 0.95 for v in deliv),
        "cells_consume_ge_0.95": sum(v >= 0.95 for v in cons),
        "min_delivery_ratio": min(deliv) if deliv else None,
        "min_consume_ratio": min(cons) if cons else None,
        "geomean_delivery_ratio": math.exp(statistics.fmean(math.log(v) for v in deliv))
        if deliv
        else None,
        "geomean_consume_ratio": math.exp(statistics.fmean(math.log(v) for v in cons))
        if cons
        else None,
        "burst_delivery_ratio": burst,
        "tensor_free_delivery_us": tf,
        "tensor_free_ours_le_vllm": {
            tp: {
                "flag off (oob vs vllm-oob)": m["oob"] <= m["vllm-oob"]
                if "oob" in m and "vllm-oob" in m
                else None,
                "flag on (arena vs vllm-arena)": m["arena"] <= m["vllm-arena"]
                if "arena" in m and "vllm-arena" in m
                else None,
            }
            for tp, m in tf.items()
        },
    }


def write_outputs(result: dict, out_dir: str) -> None:
    """vs_vllm.json, vs_vllm.md and vs_vllm.png (one panel per workload: delivery vs TP per
    mode, bars: the repetitions' min-max)."""
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "vs_vllm.json"), "w") as f:
        json.dump(result, f, indent=2, default=str)
    la = result["loadavg"]
    lines = [
        f"# Ours vs vLLM {result['vllm_version']}'s own queue and arena "
        f"({result['machine']['summary']})",
        "",
        f"Run: `{result['command']}` on {result['date']}, {result['elapsed_s'] / 60:.1f} min"
        + (
            " (**interrupted**: only the cells below were measured)"
            if result.get("interrupted")
            else ""
        )
        + "; "
        f"torch {result['machine']['torch']}, copy threads {result['copy_threads']}"
        + _wide_note(result.get("copy_pool"))
        + ". "
        f"Load average (1 min) during the run: median {la['median']:.2f}, "
        f"min {la['min']:.2f}, max {la['max']:.2f} (the benchmark's own writer and readers count: "
        "at TP=4 that is five processes). "
        "Lock-step messages, "
        + (
            "spawned readers (CUDA refuses a forked child) that copy each tensor to GPU 0 (H2D). "
            if result.get("consume") == "cuda"
            else "forked readers that copy each tensor into host memory. "
        )
        + "Per cell: "
        "the per-message p50 over the measured messages, then the median over "
        f"{result['repeats']} interleaved repetitions, [min-max] of the repetitions. Messages "
        "per cell (measured after warm-up): "
        + ", ".join(f"{k} {v['messages']} after {v['warmup']}" for k, v in result["counts"].items())
        + ". vLLM's arena diverts tensors >= 8 MiB into 8 round-robin 256 MiB slots; "
        "ours (variable layout) tensors >= 1 MiB into a 2 GiB region.",
        "",
        "## vLLM's / ours (> 1: ours faster), paired per repetition",
        "",
        "| workload | TP | delivery vLLM arena / our arena | consume vLLM arena / our arena "
        "| delivery vLLM stock / our oob | delivery vLLM arena / our loan |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for r in result["ratios"]:

        def g(key, r=r):
            return _fmt(r[key]) if key in r else "—"

        lines.append(
            f"| {r['workload']} | {r['tp']} | **{g('delivery vllm-arena/arena')}** "
            f"| {g('consume vllm-arena/arena')} | {g('delivery vllm-oob/oob')} "
            f"| {g('delivery vllm-arena/loan')} |"
        )
    t = result["targets"]

    def num(v):  # a ratio, or "—" when this run had no cell for it (--only)
        return "—" if v is None else f"{v:.2f}"

    lines += [
        "",
        "## Against issue 13's targets",
        "",
        f"- cells with delivery ratio >= 0.95: {t['cells_delivery_ge_0.95']} of {t['cells']} "
        f"(lowest {num(t['min_delivery_ratio'])}); consume: {t['cells_consume_ge_0.95']} of "
        f"{t['cells']} (lowest {num(t['min_consume_ratio'])})",
        f"- geometric mean over those cells: delivery {num(t['geomean_delivery_ratio'])}, "
        f"consume {num(t['geomean_consume_ratio'])} (target >= 1.3)",
        "- burst delivery ratio by TP: "
        + ", ".join(f"{v:.2f}" for v in t["burst_delivery_ratio"])
        + " (target >= 5)",
        "- tensor-free message delivery p50 (µs) by TP: "
        + "; ".join(
            f"TP={tp}: " + ", ".join(f"{m} {v:.0f}" for m, v in sorted(ms.items()))
            for tp, ms in t["tensor_free_delivery_us"].items()
        ),
        "",
        "## Arena delivery at 200 MiB as a multiple of one warm memcpy",
        "",
        f"One warm 200 MiB memcpy (torch `copy_`, median of 7): "
        f"{result['warm_memcpy_ms']['200']:.1f} ms.",
        "",
        "| TP | our arena | our loan | vLLM's arena |",
        "|---:|---:|---:|---:|",
    ]
    for tp, m in result["memcpy_multiples"].items():
        lines.append(
            f"| {tp} | {m.get('arena', float('nan')):.2f} | {m.get('loan', float('nan')):.2f} "
            f"| {m.get('vllm-arena', float('nan')):.2f} |"
        )
    lines += [
        "",
        "## Every cell",
        "",
        "| workload | TP | mode | enqueue ms | delivery ms | consume ms | our reader dequeue µs "
        "| arena hits/msg |",
        "|---|---:|---|---:|---:|---:|---:|---:|",
    ]
    for r in result["summary"]:
        deq = _fmt(r["dequeue_us"], digits=0) if not r["mode"].startswith("vllm") else "—"
        digits = 3 if r["delivery_ms"]["median"] < 1 else 2
        lines.append(
            f"| {r['workload']} | {r['tp']} | {ab.MODE_LABEL[r['mode']]} "
            f"| {_fmt(r['enqueue_ms'], digits=digits)} | {_fmt(r['delivery_ms'], digits=digits)} "
            f"| {_fmt(r['consume_ms'], digits=digits)} | {deq} "
            f"| {r['arena_hits_per_message']:g} |"
        )
    lines += [
        "",
        "vLLM's arena hits are counted by wrapping its writer arena's `write_tensor` in the "
        "benchmark; its queue has no dequeue timer (—). `our reader dequeue` is "
        "`MessageQueue.last_dequeue_s` (ring chunk seen -> object in hand), the slowest "
        "reader's.",
    ]
    with open(os.path.join(out_dir, "vs_vllm.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no vs_vllm.png")
        return
    names = [w["name"] for w in result["workloads"]]
    ncol = 3
    nrow = (len(names) + ncol - 1) // ncol
    fig, axes = plt.subplots(nrow, ncol, figsize=(5 * ncol, 3.8 * nrow), squeeze=False)
    for ax in axes.flat[len(names) :]:
        ax.set_visible(False)
    for ax, name in zip(axes.flat, names, strict=False):
        for mode in MODES:
            rows = sorted(
                (r for r in result["summary"] if r["workload"] == name and r["mode"] == mode),
                key=lambda r: r["tp"],
            )
            if not rows:
                continue
            med = [r["delivery_ms"]["median"] for r in rows]
            lo = [m - r["delivery_ms"]["min"] for m, r in zip(med, rows, strict=True)]
            hi = [r["delivery_ms"]["max"] - m for m, r in zip(med, rows, strict=True)]
            ax.errorbar(
                [r["tp"] for r in rows],
                med,
                yerr=[lo, hi],
                marker="o",
                capsize=3,
                label=ab.MODE_LABEL[mode],
                color=f"C{MODES.index(mode)}",  # one colour per mode in every panel
                linestyle="--" if mode.startswith("vllm") else "-",
            )
        ax.set_title(f"{name}: delivery (p50)")
        ax.set_xlabel("TP (reader processes)")
        ax.set_xticks(TPS)
        ax.set_ylabel("ms")
        ax.set_yscale("log")
        ax.grid(True, alpha=0.3)
    axes.flat[0].legend(fontsize=7)
    fig.suptitle(
        f"ours vs vLLM {result['vllm_version']} — {result['machine']['summary']} "
        f"(load avg median {la['median']:.1f})"
    )
    fig.tight_layout()
    fig.savefig(os.path.join(out_dir, "vs_vllm.png"), dpi=100)


def _wide_note(pool: dict | None) -> str:
    """How many of the writer's parallel copies also used the readers' CPUs (the copy pool's
    ThreadCountChooser, csrc/core/copy_pool.h)."""
    if not pool or "wide_copies" not in pool:
        return ""
    return (
        f" (automatic: the CPUs the readers leave; {pool['wide_copies']} of the writer's "
        f"{pool['copies']} copies through the copy pool used the readers' CPUs too, where that "
        "measured faster)"
    )


def main(argv=None) -> int:
    """Runs the sweep, prints the ratios, writes the results."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tp", type=int, nargs="+", default=TPS)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--messages", type=int, default=8, help="measured messages per cell, >= 64 MiB")
    ap.add_argument("--small-messages", type=int, default=16, help="... for tensors < 64 MiB")
    ap.add_argument("--burst-messages", type=int, default=4, help="... for the burst")
    ap.add_argument(
        "--tensor-free-messages", type=int, default=200, help="... for the scheduler step"
    )
    ap.add_argument("--pixel-sides", type=int, nargs="*", default=ab.PIXEL_SIDES)
    ap.add_argument("--only", nargs="*", help="run only workloads whose name starts so")
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument(
        "--consume",
        choices=("cpu", "cuda"),
        default="cpu",
        help="what readers do with each tensor: copy into host memory, or H2D to GPU 0",
    )
    ap.add_argument(
        "--copy-threads",
        type=int,
        default=None,
        help="force the copy pool's thread count (default: automatic sizing)",
    )
    ap.add_argument("--out", default=OUT)
    args = ap.parse_args(argv)
    if args.copy_threads is not None:
        _C.set_copy_threads(args.copy_threads)  # forked readers inherit it
    try:
        import vllm
    except ImportError:
        print(
            "bench_vs_vllm: vLLM is not importable here; run `make bench-vs-vllm` (it builds "
            ".venv-vllm with vLLM 0.33.0)",
            file=sys.stderr,
        )
        return 2
    print(f"seed={args.seed}  vllm {vllm.__version__}  torch {torch.__version__}", flush=True)
    specs = workloads(args.seed, args.pixel_sides)
    if args.only:
        specs = [w for w in specs if any(w["name"].startswith(p) for p in args.only)]

    def n_msgs(w):
        if w["kind"] == "burst":
            return args.burst_messages
        if w["kind"] == "tensor_free":
            return args.tensor_free_messages
        return args.messages if w["size_mb"] >= 64 else args.small_messages

    counts = {}
    for w in specs:
        counts[w["name"]] = {"messages": n_msgs(w), "warmup": WARMUP[w["kind"]]}
    memcpy = {"200": ab.warm_memcpy_ms(200)}
    started = time.monotonic()
    loads = [os.getloadavg()[0]]
    raw = []
    total = sum(len(w["modes"]) for w in specs) * len(args.tp) * args.repeats
    done = 0
    k = 0
    # A timeout's SIGTERM (scripts/gpu_check.sh runs this under one) ends the sweep early and
    # still writes what was measured, marked as interrupted.
    interrupted = False
    stop_requested = False
    main_pid = os.getpid()

    def _stop(signum, frame):
        nonlocal stop_requested
        if os.getpid() != main_pid:
            # A forked reader (timeout signals the whole process group): die as SIGTERM would.
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
            return
        stop_requested = True
        raise _Interrupted()

    previous = signal.signal(signal.SIGTERM, _stop)
    try:
        for rep in range(args.repeats):
            for wi, w in enumerate(specs):
                for tp in args.tp:
                    # Rotate which mode goes first, so no mode always runs after the same one.
                    modes = w["modes"][k % len(w["modes"]) :] + w["modes"][: k % len(w["modes"])]
                    k += 1
                    for mode in modes:
                        c = ab.run_cell(
                            mode,
                            tp,
                            w["size_mb"],
                            n_msgs(w),
                            WARMUP[w["kind"]],
                            args.seed,
                            consume=args.consume,
                            sources=w.get("sources"),
                            workload=w["name"],
                            extra=w.get("extra"),
                        )
                        c.update({"workload_name": w["name"], "wl_index": wi, "repeat": rep})
                        # Collect the cell's queue now: readers forked for the next cell would
                        # inherit it as garbage, and vLLM's ShmTensorArena.__del__ (no fork check)
                        # unlinks its creator's shm name from whichever process collects it.
                        gc.collect()
                        raw.append(c)
                        loads.append(os.getloadavg()[0])
                        done += 1
                        print(
                            f"[{done}/{total} {time.monotonic() - started:6.0f}s] rep {rep} "
                            f"{w['name']:>32} TP={tp} {mode:<10} delivery "
                            f"{c['delivery_ms_p50']:9.3f} ms  consume "
                            f"{c['consume_ms_p50']:9.3f} ms",
                            flush=True,
                        )
    except Exception:
        # _Interrupted, or what the cell's cleanup raised once its readers died of the same
        # signal (a closed pipe).
        if not stop_requested:
            raise
        interrupted = True
        print(f"interrupted after {done} of {total} cells; writing those", flush=True)
    finally:
        signal.signal(signal.SIGTERM, previous)
    elapsed = time.monotonic() - started
    summary, ratios = summarize(raw)
    multiples: dict = {}
    for r in summary:
        if r["workload"] == "200 MiB" and r["mode"] in ("arena", "loan", "vllm-arena"):
            multiples.setdefault(str(r["tp"]), {})[r["mode"]] = (
                r["delivery_ms"]["median"] / memcpy["200"]
            )
    result = {
        **ab.run_record("bench_vs_vllm.py", argv),
        "elapsed_s": elapsed,
        "interrupted": interrupted,
        "seed": args.seed,
        "consume": args.consume,
        "repeats": args.repeats,
        "vllm_version": vllm.__version__,
        "machine": ab.machine_info(),
        "copy_threads": _C.copy_threads(),
        "copy_pool": _C.copy_pool_stats(),  # the writer's: wide_copies used the readers' CPUs
        "loadavg": {**_spread(loads), "samples": loads},
        "counts": counts,
        "warm_memcpy_ms": memcpy,
        "workloads": [{"name": w["name"], "modes": w["modes"]} for w in specs],
        "summary": summary,
        "ratios": ratios,
        "memcpy_multiples": multiples,
        "cells": raw,
    }
    result["targets"] = targets(ratios, summary)
    print(
        f"\n{'workload':>32} {'TP':>3} {'delivery vLLM arena/ours':>26} "
        f"{'consume vLLM arena/ours':>26} {'delivery vLLM stock/our oob':>28}"
    )
    for r in ratios:

        def g(key, r=r):
            return _fmt(r[key]) if key in r else "-"

        print(
            f"{r['workload']:>32} {r['tp']:>3} {g('delivery vllm-arena/arena'):>26} "
            f"{g('consume vllm-arena/arena'):>26} {g('delivery vllm-oob/oob'):>28}"
        )
    print(f"\n200 MiB delivery / one warm memcpy ({memcpy['200']:.1f} ms):")
    for tp, m in multiples.items():
        print(f"  TP={tp}: " + ", ".join(f"{k} {v:.2f}x" for k, v in sorted(m.items())))
    print("\ntargets:", json.dumps(result["targets"], indent=1, default=str))
    la = result["loadavg"]
    print(
        f"load average during the run: median {la['median']:.2f} "
        f"(min {la['min']:.2f}, max {la['max']:.2f}); {elapsed / 60:.1f} min"
    )
    write_outputs(result, args.out)
    print(f"wrote {args.out}/vs_vllm.{{md,json,png}}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
