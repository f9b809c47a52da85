"""Broadcast A/B: in-band pickle vs out-of-band ``_reduce_tensor`` vs the shm tensor arena.

One writer process broadcasts a seeded sequence of messages, each carrying one large CPU
tensor (a ``pixel_values`` stand-in) plus small metadata, to TP reader processes through
``vllm_shm_arena.MessageQueue``. Per message it records:

* enqueue: the writer's ``enqueue`` call;
* delivery: enqueue start -> the last reader holds the tensor;
* consume: enqueue start -> the last reader has copied it into a preallocated buffer (the
  CPU stand-in for the worker's H2D copy);
* dequeue: reader time from the message's arrival to the object in hand;
* host bytes moved (modelled: payload copies per mode, plus the consume copies).

Messages are sent in lock-step (the next one after every reader acknowledged the previous
one), so latencies are per message, not queueing effects. Prints ratios, never asserts.
Results go to benchmarks/results/broadcast_ab.{json,md,png}.

    python benchmarks/broadcast_ab.py              # default: TP {1,4} x {8,200} MiB
    python benchmarks/broadcast_ab.py --full       # TP {1,2,4,8} x {8,64,200} MiB, plus
                                                   # the threshold cells below
    python benchmarks/broadcast_ab.py --threshold  # only the threshold cells (a few minutes)

The threshold cells choose the variable layout's divert threshold: out-of-band vs arena at
0.25-8 MiB and for uint8 pixel_values shaped like vLLM's (n_patches x 1176), TP {2,4}, with a
16 MiB ring chunk (every message fits the ring) and a 128 KiB one (every out-of-band message
overflows to the socket). The arena diverts every tensor there (threshold 0), so each pair of
cells compares the two paths; the crossover is the smallest size from which the arena
delivers faster at that size and every larger one. Results: benchmarks/results/threshold/.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from harness import (  # noqa: E402  (benchmarks/, beside this file)
    MODE_LABEL,
    MODES,
    PIXEL_SIDES,
    RESULTS,
    machine_info,
    mib,
    pixel_values,
    run_cell,
    run_record,
    start_readers,
    warm_memcpy_ms,
)

from vllm_shm_arena import MessageQueue  # noqa: E402
from vllm_shm_arena import arena as arena_mod  # noqa: E402
from vllm_shm_arena._ext import _C  # noqa: E402

#: Extra workloads (one message each, several tensors): name -> list of tensor sizes in MB.
WORKLOADS = {
    "burst": [16] * 25,  # a request with 25 images of 16 MB
    "huge": [1024],  # one 1 GiB tensor
}

#: The threshold cells (see the module docstring).
THRESHOLD_SIZES_MB = [0.25, 0.5, 1, 2, 4, 8]
THRESHOLD_TPS = [2, 4]
#: Ring chunk size -> what it means for a 0.25-8 MiB out-of-band message.
THRESHOLD_CHUNKS = {16 << 20: "ring", 128 << 10: "socket"}
#: A threshold must leave the arena this much faster (median delivery ratio) at every size
#: above it: on the shared 2-core machine a single cell's ratio moves by +-0.3 between runs.
THRESHOLD_MARGIN = 1.25


def threshold_cells(n_msgs, warmup, seed, consume="cpu", tps=None, repeats=1, bar=None):
    """The threshold cells: per (workload, TP, ring chunk) one out-of-band and one arena cell,
    back to back, alternating which goes first; the whole sweep ``repeats`` times. The arena
    diverts every tensor here (variable layout, threshold 0): the question is which path is
    faster at each size, not what today's threshold does."""
    # Every one of the ring's 10 chunks written once before measuring: a chunk's first use
    # pays its page faults, which steady state never sees.
    warmup = max(warmup, 12)
    specs = [("small", mb, None) for mb in THRESHOLD_SIZES_MB]
    specs += [(f"pixel_values {side}x{side}", None, side) for side in PIXEL_SIDES]
    saved = arena_mod.VARIABLE_MIN_BYTES
    arena_mod.VARIABLE_MIN_BYTES = 0
    out, k = [], 0
    try:
        for rep in range(repeats):
            for name, mb, side in specs:
                sources = [pixel_values(side, seed)] if side else None
                size_mb = mb if mb else sources[0].numel() / (1 << 20)
                for tp in tps or THRESHOLD_TPS:
                    for chunk, transport in THRESHOLD_CHUNKS.items():
                        modes = ("oob", "arena") if k % 2 == 0 else ("arena", "oob")
                        k += 1
                        for mode in modes:
                            if bar is not None:
                                bar.set_description(f"{name} {size_mb:g}MB TP={tp} {mode}")
                            c = run_cell(
                                mode,
                                tp,
                                size_mb,
                                n_msgs,
                                warmup,
                                seed,
                                bar,
                                consume,
                                chunk_bytes=chunk,
                                sources=sources,
                                workload=name,
                            )
                            c["transport"] = transport
                            c["repeat"] = rep
                            out.append(c)
    finally:
        arena_mod.VARIABLE_MIN_BYTES = saved
    return out


def threshold_summary(cells) -> dict:
    """Per (workload, size, TP, chunk): out-of-band / arena for delivery and consume (median
    over repeats); per (TP, chunk): the crossover, the smallest of the 0.25-8 MiB sizes from
    which the arena delivers faster at that size and every larger one (None: never)."""
    rows = {}
    for c in cells:
        if c.get("transport") is None:
            continue
        key = (c["workload"], c["tensor_bytes"], c["tp"], c["transport"])
        rows.setdefault(key, {}).setdefault(c["repeat"], {})[c["mode"]] = c
    table = []
    for (wl, nbytes, tp, transport), reps in sorted(rows.items(), key=lambda kv: kv[0]):
        pairs = [r for r in reps.values() if "oob" in r and "arena" in r]
        if not pairs:
            continue

        def ratio(metric, pairs=pairs):
            return statistics.median(
                p["oob"][f"{metric}_ms_p50"] / p["arena"][f"{metric}_ms_p50"] for p in pairs
            )

        table.append(
            {
                "workload": wl,
                "tensor_bytes": nbytes,
                "tp": tp,
                "transport": transport,
                "oob_delivery_ms": statistics.median(p["oob"]["delivery_ms_p50"] for p in pairs),
                "arena_delivery_ms": statistics.median(
                    p["arena"]["delivery_ms_p50"] for p in pairs
                ),
                "delivery_oob_over_arena": ratio("delivery"),
                # The worst repetition: the arena must win this too to count as a win.
                "delivery_oob_over_arena_min": min(
                    p["oob"]["delivery_ms_p50"] / p["arena"]["delivery_ms_p50"] for p in pairs
                ),
                "consume_oob_over_arena": ratio("consume"),
                "oob_overflow_messages": max(p["oob"]["overflow_messages"] for p in pairs),
                "arena_fallbacks_per_message": max(
                    p["arena"]["fallbacks_per_message"] for p in pairs
                ),
                "repeats": len(pairs),
            }
        )

    def first_win(rows, margin):
        # The smallest size from which the median delivery ratio >= margin at that size and
        # every larger one.
        at = None
        for r in sorted(rows, key=lambda r: r["tensor_bytes"], reverse=True):
            if r["delivery_oob_over_arena"] < margin:
                break
            at = r["tensor_bytes"]
        return at

    crossover, robust = {}, {}
    for tp in sorted({r["tp"] for r in table}):
        for transport in THRESHOLD_CHUNKS.values():
            small = [
                r
                for r in table
                if (r["workload"], r["tp"], r["transport"]) == ("small", tp, transport)
            ]
            crossover[f"TP={tp} {transport}"] = first_win(small, 1.0)
            robust[f"TP={tp} {transport}"] = first_win(small, THRESHOLD_MARGIN)
    # The threshold that leaves the arena THRESHOLD_MARGIN faster above it in every measured
    # (TP, transport): the largest such crossover; 8 MiB (the fixed layout's) if no size
    # up to 8 MiB qualifies somewhere.
    found = list(robust.values())
    fallback = int(THRESHOLD_SIZES_MB[-1] * (1 << 20))
    suggested = max(found) if found and None not in found else fallback
    return {
        "rows": table,
        "crossover_bytes": crossover,
        "crossover_margin_bytes": robust,
        "margin": THRESHOLD_MARGIN,
        "suggested_min_bytes": int(suggested),
    }


def write_threshold_outputs(result: dict, out_dir: str) -> None:
    """benchmarks/results/threshold/threshold.{json,md}."""
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "threshold.json"), "w") as f:
        json.dump(result, f, indent=2)
    summ = result["threshold"]
    lines = [
        f"# Divert threshold: out-of-band vs arena ({result['machine']['summary']})",
        "",
        f"Run: `{result['command']}` on {result['date']}. Per cell: medians over "
        f"{result['messages']} lock-step messages after {result['warmup']} warm-up, "
        f"{result['repeats']} interleaved repetition(s) (median of the ratios). The arena "
        "diverts every tensor in these cells (variable layout, threshold 0). `ring`: 16 MiB "
        "chunks, every message fits the ring; `socket`: 128 KiB chunks, every out-of-band "
        "message overflows to the ZeroMQ socket (the arena's stub still rides the ring). "
        "The machine is shared and noisy: compare within this run, read the ratios.",
        "",
        "| workload | MiB | TP | transport | out-of-band delivery ms | arena delivery ms "
        "| delivery oob/arena | worst repetition | consume oob/arena |",
        "|---|---:|---:|---|---:|---:|---:|---:|---:|",
    ]
    for r in summ["rows"]:
        lines.append(
            f"| {r['workload']} | {mib(r['tensor_bytes'])} | {r['tp']} | {r['transport']} "
            f"| {r['oob_delivery_ms']:.3f} | {r['arena_delivery_ms']:.3f} "
            f"| **{r['delivery_oob_over_arena']:.2f}** | {r['delivery_oob_over_arena_min']:.2f} "
            f"| {r['consume_oob_over_arena']:.2f} |"
        )
    lines += [
        "",
        "## Crossover",
        "",
        "The smallest size from which the arena delivers faster (median ratio > 1) at that "
        f"size and every larger one / {summ['margin']}x faster (the margin the suggested "
        "threshold asks for, above this machine's run-to-run noise).",
        "",
    ]
    for k, v in summ["crossover_bytes"].items():
        w = summ["crossover_margin_bytes"][k]
        lines.append(
            f"- {k}: {'never at <= 8 MiB' if v is None else mib(v) + ' MiB'} / "
            f"{'never at <= 8 MiB' if w is None else mib(w) + ' MiB'}"
        )
    lines += [
        "",
        f"Suggested variable-layout threshold: **{mib(summ['suggested_min_bytes'])} MiB** "
        f"(in force: VARIABLE_MIN_BYTES = {mib(result['variable_min_bytes'])} MiB; fixed "
        f"layout MIN_BYTES = {mib(result['fixed_min_bytes'])} MiB).",
    ]
    with open(os.path.join(out_dir, "threshold.md"), "w") as f:
        f.write("\n".join(lines) + "\n")


def small_message_overhead(tp: int, n: int, seed: int) -> dict:
    """p50 enqueue + dequeue of tensor-free messages, arena on vs off, interleaved."""
    import random

    rnd = random.Random(seed)
    msg = {
        "req_ids": [f"req-{rnd.randrange(10**9)}" for _ in range(64)],
        "num_tokens": [rnd.randrange(4096) for _ in range(64)],
        "step": 0,
    }
    queues = {}
    for on in (False, True):
        mq = MessageQueue(tp, tp, enable_shm_tensor_arena=on)
        queues[on] = (mq, *start_readers(mq, tp, _small_reader))
    samples = {False: [], True: []}
    for i in range(n):
        for on in (False, True) if i % 2 == 0 else (True, False):
            mq, conns, _ = queues[on]
            t0 = time.perf_counter()
            mq.enqueue(msg)
            enq = time.perf_counter() - t0
            deq = max(c.recv() for c in conns)
            samples[on].append((enq + deq) * 1e6)
    for on in (False, True):
        mq, conns, procs = queues[on]
        mq.enqueue(None)
        for p in procs:
            p.join(timeout=30)
        mq.shutdown()
    off = statistics.median(samples[False])
    on = statistics.median(samples[True])
    return {"tp": tp, "messages": n, "off_p50_us": off, "on_p50_us": on, "ratio": on / off}


def _small_reader(handle, rank, conn):
    mq = MessageQueue.create_from_handle(handle, rank)
    mq.wait_until_ready()
    while True:
        msg = mq.dequeue()
        if msg is None:
            break
        conn.send(mq.last_dequeue_s)
    mq.shutdown()


def write_outputs(result: dict, out_dir: str) -> None:
    os.makedirs(out_dir, exist_ok=True)
    stem = "broadcast_ab" if result["consume"] == "cpu" else f"broadcast_ab_{result['consume']}"
    with open(os.path.join(out_dir, f"{stem}.json"), "w") as f:
        json.dump(result, f, indent=2)
    lines = [
        f"# Broadcast A/B ({result['machine']['summary']})",
        "",
        f"Run: `{result['command']}` on {result['date']}. Medians over {result['messages']} "
        "measured messages per cell after warm-up; lock-step (one message in flight); "
        f"readers consume into {result['consume']} memory.",
        "",
        "| workload | MiB | TP | mode | enqueue ms | delivery ms | consume ms "
        "| reader dequeue µs | host GB moved | arena hits | fallbacks/msg |",
        "|---|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for c in result["cells"]:
        lines.append(
            f"| {c['workload']} | {mib(c['tensor_bytes'])} | {c['tp']} | {MODE_LABEL[c['mode']]} "
            f"| {c['enqueue_ms_p50']:.2f} | {c['delivery_ms_p50']:.2f} | {c['consume_ms_p50']:.1f} "
            f"| {c['dequeue_us_p50']:.0f} | {c['host_bytes_moved'] / 1e9:.2f} | {c['arena_hits']} "
            f"| {c['fallbacks_per_message']:g} |"
        )
    lines += ["", "## Ratios", ""]
    for k, v in result["ratios"].items():
        lines.append(f"- {k}: **{v:.2f}**" if isinstance(v, float) else f"- {k}: {v}")
    with open(os.path.join(out_dir, f"{stem}.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    singles = [c for c in result["cells"] if c["workload"] == "single"]
    sizes = sorted({c["size_mb"] for c in singles})
    fig, axes = plt.subplots(1, len(sizes), figsize=(5 * len(sizes), 4), squeeze=False)
    for ax, size in zip(axes[0], sizes, strict=True):
        for mode in MODES:
            cs = sorted(
                (c for c in singles if c["size_mb"] == size and c["mode"] == mode),
                key=lambda c: c["tp"],
            )
            if cs:
                ax.plot(
                    [c["tp"] for c in cs],
                    [c["delivery_ms_p50"] for c in cs],
                    marker="o",
                    label=MODE_LABEL[mode],
                )
        ax.set_title(f"{size} MiB tensor: delivery latency (p50)")
        ax.set_xlabel("TP (reader processes)")
        ax.set_ylabel("ms")
        ax.set_yscale("log")
        ax.grid(True, alpha=0.3)
        ax.legend()
    fig.suptitle(result["machine"]["summary"])
    fig.tight_layout()
    fig.savefig(os.path.join(out_dir, f"{stem}.png"), dpi=110)


def alternating_ab(args, argv, *, arms, reset, stem, what, default_sizes, burst=False) -> int:
    """Arena cells in which a writer-side setting alternates message by message (ABBA)
    between ``arms`` ``[(label, apply)]``: the same readers, queue and minute of this shared
    machine for both. ``burst`` adds the 25 x 16 MiB message. Ratio ``first / second`` per
    metric (> 1: the second arm faster). Writes results/``stem``.{json,md}."""
    (la, set_a), (lb, set_b) = arms
    tps = args.tp or [1, 2]
    sizes = args.sizes or default_sizes
    workloads = [(f"{size:g} MiB", size, None) for size in sizes]
    if burst:
        workloads.append(("burst 25x16 MiB", 16, WORKLOADS["burst"]))
    cells = []
    for name, size, many in workloads:
        for tp in tps:

            def tag_fn(i):
                if i % 4 in (0, 3):
                    set_a()
                    return la
                set_b()
                return lb

            c = run_cell(
                "arena",
                tp,
                size,
                max(4, args.messages // 2) if many else args.messages,
                max(2, args.warmup // 2) if many else args.warmup,
                args.seed,
                None,
                args.consume,
                sizes=many,
                tag_fn=tag_fn,
            )
            reset()
            a, b = c["by_tag"][la], c["by_tag"][lb]
            c["name"] = name
            c["a_over_b"] = {
                k: a[f"{k}_p50"] / b[f"{k}_p50"]
                for k in ("enqueue_ms", "delivery_ms", "consume_ms")
            }
            cells.append(c)
            r = c["a_over_b"]
            print(
                f"{name:>16} TP={tp}: {la} / {lb} = enqueue {r['enqueue_ms']:.2f}, delivery "
                f"{r['delivery_ms']:.2f}, consume {r['consume_ms']:.2f} (delivery ms: "
                f"{a['delivery_ms_p50']:.2f} vs {b['delivery_ms_p50']:.2f})",
                flush=True,
            )
    result = {
        **run_record("broadcast_ab.py", argv),
        "seed": args.seed,
        "messages": args.messages,
        "warmup": args.warmup,
        "machine": machine_info(),
        "copy_threads": _C.copy_threads(),
        "arms": [la, lb],
        "cells": cells,
    }
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, f"{stem}.json"), "w") as f:
        json.dump(result, f, indent=2)
    lines = [
        f"# {what} A/B ({result['machine']['summary']})",
        "",
        f"Run: `{result['command']}` on {result['date']}. Arena cells; the writer's copy uses "
        f"{la} or {lb}, alternating per message (ABBA) inside each cell; medians over half of "
        f"each cell's messages ({args.messages} per cell, half that for the burst) after the "
        f"warm-up. Ratio > 1: {lb} faster. Shared, noisy machine: read the ratios.",
        "",
        f"| workload | TP | delivery ms, {la} | delivery ms, {lb} | enqueue {la}/{lb} "
        f"| delivery {la}/{lb} | consume {la}/{lb} |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for c in cells:
        a, b = c["by_tag"][la], c["by_tag"][lb]
        r = c["a_over_b"]
        lines.append(
            f"| {c['name']} | {c['tp']} | {a['delivery_ms_p50']:.2f} | {b['delivery_ms_p50']:.2f} "
            f"| {r['enqueue_ms']:.2f} | **{r['delivery_ms']:.2f}** | {r['consume_ms']:.2f} |"
        )
    with open(os.path.join(args.out, f"{stem}.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print(f"wrote {args.out}/{stem}.{{json,md}}")
    return 0


def copy_threads_main(args, argv) -> int:
    """--copy-threads-ab N: the writer's copy on 1 thread or N threads."""
    n = args.copy_threads_ab
    return alternating_ab(
        args,
        argv,
        arms=[
            ("1 thread", lambda: _C.set_copy_threads(1)),
            (f"{n} threads", lambda: _C.set_copy_threads(n)),
        ],
        reset=lambda: _C.set_copy_threads(0),
        stem="copy_threads_ab",
        what="Copy threads",
        default_sizes=[16, 64, 200],
    )


def stream_main(args, argv) -> int:
    """--stream-ab: the writer's copy with ordinary stores (streaming off) or with streaming
    stores from the default working set (copy_pool.h), at the automatic thread count."""
    saved = _C.stream_min_bytes()
    default = saved or (32 << 20)  # 0 (off, from the environment): compare with the default
    return alternating_ab(
        args,
        argv,
        arms=[
            ("ordinary stores", lambda: _C.set_stream_min_bytes(0)),
            (f"streaming from {default >> 20} MiB", lambda: _C.set_stream_min_bytes(default)),
        ],
        reset=lambda: _C.set_stream_min_bytes(saved),
        stem="stream_ab",
        what="Streaming stores",
        default_sizes=[8, 16, 32, 64, 200],
        burst=True,
    )


def threshold_main(args, argv) -> int:
    """--threshold: the threshold cells alone -> results/threshold/threshold.{json,md}."""
    tps = args.tp or THRESHOLD_TPS
    n_cells = (len(THRESHOLD_SIZES_MB) + len(PIXEL_SIDES)) * len(tps) * len(THRESHOLD_CHUNKS) * 2
    print(f"seed={args.seed}  threshold cells: {n_cells} x {args.repeats}  TP={tps}", flush=True)
    try:
        from tqdm import tqdm

        bar = tqdm(total=n_cells * args.repeats * (args.messages + args.warmup))
    except ImportError:
        bar = None
    cells = threshold_cells(
        args.messages, args.warmup, args.seed, args.consume, tps, args.repeats, bar
    )
    if bar is not None:
        bar.close()
    result = {
        **run_record("broadcast_ab.py", argv),
        "seed": args.seed,
        "consume": args.consume,
        "messages": args.messages,
        "warmup": args.warmup,
        "repeats": args.repeats,
        "machine": machine_info(),
        "copy_threads": _C.copy_threads(),
        "variable_min_bytes": arena_mod.VARIABLE_MIN_BYTES,
        "fixed_min_bytes": arena_mod.MIN_BYTES,
        "cells": cells,
        "threshold": threshold_summary(cells),
    }
    print(
        f"\n{'workload':>22} {'MiB':>5} {'TP':>3} {'transport':>9} {'oob ms':>8} "
        f"{'arena ms':>8} {'deliv oob/arena':>15} {'consume oob/arena':>17}"
    )
    for r in result["threshold"]["rows"]:
        print(
            f"{r['workload']:>22} {mib(r['tensor_bytes']):>5} {r['tp']:>3} {r['transport']:>9} "
            f"{r['oob_delivery_ms']:>8.3f} {r['arena_delivery_ms']:>8.3f} "
            f"{r['delivery_oob_over_arena']:>15.2f} {r['consume_oob_over_arena']:>17.2f}"
        )
    for k, v in result["threshold"]["crossover_bytes"].items():
        w = result["threshold"]["crossover_margin_bytes"][k]
        print(
            f"crossover {k}: {'never' if v is None else mib(v) + ' MiB'} (median), "
            f"{'never' if w is None else mib(w) + ' MiB'} (with the margin)"
        )
    print(f"suggested threshold: {mib(result['threshold']['suggested_min_bytes'])} MiB")
    out = os.path.join(args.out, "threshold")
    write_threshold_outputs(result, out)
    print(f"\nwrote {out}/threshold.{{json,md}}")
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument(
        "--full", action="store_true", help="TP {1,2,4,8} x {8,64,200} MiB + threshold cells"
    )
    ap.add_argument(
        "--threshold",
        action="store_true",
        help="only the threshold cells (0.25-8 MiB and uint8 pixel_values, TP {2,4}, ring and "
        "socket): writes results/threshold/",
    )
    ap.add_argument("--repeats", type=int, default=1, help="threshold sweeps, interleaved")
    ap.add_argument(
        "--copy-threads",
        type=int,
        default=None,
        help="force the copy pool's thread count (default: automatic sizing)",
    )
    ap.add_argument(
        "--copy-threads-ab",
        type=int,
        default=None,
        metavar="N",
        help="arena cells alternating the writer's copy between 1 and N threads per message",
    )
    ap.add_argument(
        "--stream-ab",
        action="store_true",
        help="arena cells alternating the writer's copy between ordinary and streaming stores",
    )
    ap.add_argument("--tp", type=int, nargs="+")
    ap.add_argument("--sizes", type=float, nargs="+", help="tensor sizes in MiB")
    ap.add_argument("--modes", nargs="+", default=list(MODES), choices=list(MODE_LABEL))
    ap.add_argument("--messages", type=int, default=10, help="measured messages per cell")
    ap.add_argument("--warmup", type=int, default=8, help="warm-up messages (>= slots)")
    ap.add_argument("--small-messages", type=int, default=400)
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument(
        "--workloads",
        nargs="*",
        default=list(WORKLOADS),
        choices=list(WORKLOADS),
        help="extra one-message workloads at the highest TP (burst: 25 x 16 MiB; huge: 1 GiB)",
    )
    ap.add_argument("--out", default=RESULTS)
    ap.add_argument(
        "--consume",
        choices=("cpu", "cuda"),
        default="cpu",
        help="what readers do with the tensor: copy into host memory, or H2D to GPU 0",
    )
    args = ap.parse_args(argv)
    if args.copy_threads is not None:
        _C.set_copy_threads(args.copy_threads)  # forked readers inherit it
    if args.threshold:
        return threshold_main(args, argv)
    if args.copy_threads_ab:
        return copy_threads_main(args, argv)
    if args.stream_ab:
        return stream_main(args, argv)
    tps = args.tp or ([1, 2, 4, 8] if args.full else [1, 4])
    sizes = args.sizes or ([8, 64, 200] if args.full else [8, 200])
    print(f"seed={args.seed}  TP={tps}  sizes MiB={sizes}  modes={args.modes}", flush=True)

    try:
        from tqdm import tqdm

        bar = tqdm(total=len(tps) * len(sizes) * len(args.modes) * (args.messages + args.warmup))
    except ImportError:
        bar = None
    memcpy = {s: warm_memcpy_ms(s) for s in sizes}
    cells = []
    for size in sizes:
        for tp in tps:
            for mode in args.modes:
                if bar is not None:
                    bar.set_description(f"{size}MB TP={tp} {mode}")
                cells.append(
                    run_cell(
                        mode, tp, size, args.messages, args.warmup, args.seed, bar, args.consume
                    )
                )
    # Extra workloads at the highest TP: fewer messages (each is large).
    wl_modes = {"burst": ["oob", "arena-fixed", "arena", "loan"], "huge": ["oob", "arena", "loan"]}
    for wl in args.workloads:
        for mode in wl_modes[wl]:
            if bar is not None:
                bar.set_description(f"{wl} TP={max(tps)} {mode}")
            cells.append(
                run_cell(
                    mode,
                    max(tps),
                    WORKLOADS[wl][0],
                    3,
                    1,
                    args.seed,
                    None,
                    args.consume,
                    sizes=WORKLOADS[wl],
                )
            )
    if args.full:
        cells += threshold_cells(
            args.messages, args.warmup, args.seed, args.consume, repeats=args.repeats, bar=bar
        )
    if bar is not None:
        bar.close()
    small = [
        small_message_overhead(tp, args.small_messages, args.seed) for tp in sorted({1, max(tps)})
    ]

    def cell(mode, tp, size, workload="single"):
        for c in cells:
            if (c["mode"], c["tp"], c["size_mb"], c["workload"]) == (mode, tp, size, workload):
                return c
        return None

    ratios = {}
    big = max(sizes)
    tp_hi = max(tps)
    a, o = cell("arena", tp_hi, big), cell("oob", tp_hi, big)
    if a:
        ratios[f"arena delivery / warm memcpy ({big} MiB, TP={tp_hi})"] = (
            a["delivery_ms_p50"] / memcpy[big]
        )
    if a and o:
        ratios[f"out-of-band / arena delivery ({big} MiB, TP={tp_hi})"] = (
            o["delivery_ms_p50"] / a["delivery_ms_p50"]
        )
    a1 = cell("arena", min(tps), big)
    if a and a1:
        ratios[f"arena delivery TP={tp_hi} / TP={min(tps)} ({big} MiB)"] = (
            a["delivery_ms_p50"] / a1["delivery_ms_p50"]
        )
    ar = [c["dequeue_us_p50"] for c in cells if c["mode"] == "arena"]
    if ar:
        ratios["arena reader dequeue p50, max over cells (us)"] = max(ar)
    for sm in small:
        ratios[f"tensor-free messages p50 enqueue+dequeue, arena on / off (TP={sm['tp']})"] = sm[
            "ratio"
        ]
    ib = cell("inband", tp_hi, big)
    if ib and a:
        ratios[f"in-band / arena delivery ({big} MiB, TP={tp_hi})"] = (
            ib["delivery_ms_p50"] / a["delivery_ms_p50"]
        )
    lo, ls = cell("loan", tp_hi, big), cell("loan", tp_hi, min(sizes))
    if lo:
        ratios[f"loaned {big} MiB delivery, TP={tp_hi} (ms)"] = lo["delivery_ms_p50"]
    if lo and ls:
        ratios[f"loaned delivery {big} MiB / {min(sizes)} MiB (TP={tp_hi})"] = (
            lo["delivery_ms_p50"] / ls["delivery_ms_p50"]
        )
    if lo and a:
        ratios[f"copying arena / loaned delivery ({big} MiB, TP={tp_hi})"] = (
            a["delivery_ms_p50"] / lo["delivery_ms_p50"]
        )
    for c in cells:
        if c["workload"] == "single":
            continue
        key = f"{c['workload']} TP={c['tp']} {c['mode']}"
        ratios[f"{key}: fallbacks per message"] = float(c["fallbacks_per_message"])
        if c["mode"] in ("arena", "arena-fixed"):
            once = warm_memcpy_ms(c["tensor_bytes"] / (1 << 20), reps=3)
            ratios[f"{key}: delivery / one warm copy of its bytes"] = c["delivery_ms_p50"] / once

    result = {
        **run_record("broadcast_ab.py", argv),
        "seed": args.seed,
        "consume": args.consume,
        "messages": args.messages,
        "warmup": args.warmup,
        "machine": machine_info(),
        "warm_memcpy_ms": memcpy,
        "cells": cells,
        "small_messages": small,
        "ratios": ratios,
        "copy_threads": _C.copy_threads(),
    }
    if args.full:
        result["threshold"] = threshold_summary(cells)
        for k, v in result["threshold"]["crossover_bytes"].items():
            ratios[f"threshold crossover {k} (MiB)"] = -1.0 if v is None else v / (1 << 20)
    hdr = (
        f"{'workload':>9} {'MiB':>5} {'TP':>3} {'mode':<28} {'enqueue':>9} {'delivery':>9} "
        f"{'consume':>9} {'dequeue':>9} {'GB moved':>9}"
    )
    print()
    print(hdr)
    for c in cells:
        print(
            f"{c['workload']:>9} {mib(c['tensor_bytes']):>5} {c['tp']:>3} "
            f"{MODE_LABEL[c['mode']]:<28} "
            f"{c['enqueue_ms_p50']:>7.2f}ms {c['delivery_ms_p50']:>7.2f}ms "
            f"{c['consume_ms_p50']:>7.1f}ms {c['dequeue_us_p50']:>7.0f}us "
            f"{c['host_bytes_moved'] / 1e9:>9.2f}"
        )
    print("\nwarm memcpy ms:", {k: round(v, 1) for k, v in memcpy.items()})
    print("ratios:")
    for k, v in ratios.items():
        print(f"  {k}: {v:.3f}")
    write_outputs(result, args.out)
    print(f"\nwrote {args.out}/broadcast_ab.{{json,md,png}}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
