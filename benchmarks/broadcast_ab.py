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

    python benchmarks/broadcast_ab.py            # default: TP {1,4} x {8,200} MiB
    python benchmarks/broadcast_ab.py --full     # TP {1,2,4,8} x {8,64,200} MiB
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import platform
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from vllm_shm_arena import MessageQueue, message_queue  # noqa: E402

MODES = ("inband", "oob", "arena", "loan")
MODE_LABEL = {
    "inband": "in-band pickle",
    "oob": "out-of-band _reduce_tensor",
    "arena": "shm tensor arena",
    "arena-fixed": "arena, fixed 8x256MiB slots",
    "loan": "arena, loaned tensor",
    # vLLM's own queue (needs vLLM installed, e.g. `make vllm-test`'s .venv-vllm):
    "vllm-oob": "vLLM MessageQueue, stock",
    "vllm-arena": "vLLM MessageQueue, its own arena",
}
#: Extra workloads (one message each, several tensors): name -> list of tensor sizes in MB.
WORKLOADS = {
    "burst": [16] * 25,  # a request with 25 images of 16 MB
    "huge": [1024],  # one 1 GiB tensor
}
RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")


def copies_per_message(mode: str, tp: int) -> int:
    """Payload copies on the host per message, by construction of each path (not counting
    the readers' consume copy). in-band: serialize 1 + per reader transport 1 + unpickle 1;
    out-of-band: per reader transport 1 (zero-copy send and rebuild); arena: 1 writer copy."""
    return {
        "inband": 1 + 2 * tp,
        "oob": tp,
        "arena": 1,
        "arena-fixed": 1,
        "loan": 0,
        "vllm-oob": tp,
        "vllm-arena": 1,
    }[mode]


def _queue_class(handle_or_mode):
    """Our MessageQueue, or vLLM's for the vllm-* modes (and for vLLM's handles)."""
    name = handle_or_mode if isinstance(handle_or_mode, str) else type(handle_or_mode).__module__
    if name.startswith("vllm-") or name.startswith("vllm."):
        from vllm.distributed.device_communicators.shm_broadcast import MessageQueue as VllmMQ

        return VllmMQ
    return MessageQueue


def _reader_main(handle, rank, conn, consume_bytes, consume="cpu"):
    torch.set_num_threads(1)
    if consume == "cuda":
        torch.zeros(1, device="cuda")  # a context before the first tensor: the arena pins
    mq = _queue_class(handle).create_from_handle(handle, rank)
    mq.wait_until_ready()
    dst = torch.zeros(consume_bytes, dtype=torch.uint8, device=consume)  # pre-touched
    while True:
        msg = mq.dequeue()
        t_recv = time.perf_counter()
        if msg is None:
            break
        ts = msg["pixel_values"]
        off, ok = 0, True
        for t, (first, last) in zip(ts, msg["check"], strict=True):
            flat = t.reshape(-1).view(torch.uint8)
            dst[off : off + flat.numel()].copy_(flat, non_blocking=consume == "cuda")
            off += flat.numel()
            ok = ok and int(flat[0]) == first and int(flat[-1]) == last
        if consume == "cuda":
            torch.cuda.current_stream().synchronize()
        t_cons = time.perf_counter()
        del msg, ts, t, flat
        conn.send((t_recv, t_cons, getattr(mq, "last_dequeue_s", 0.0), ok))
    conn.send(mq.stats() if hasattr(mq, "stats") else {})
    mq.shutdown()


def _start_readers(mq, tp, consume_bytes, consume="cpu"):
    # CUDA cannot be used in a forked child of a process that touched it: spawn then.
    ctx = mp.get_context("spawn" if consume == "cuda" else "fork")
    conns, procs = [], []
    for rank in range(tp):
        parent, child = ctx.Pipe()
        p = ctx.Process(
            target=_reader_main,
            args=(mq.export_handle(), rank, child, consume_bytes, consume),
            daemon=True,
        )
        p.start()
        conns.append(parent)
        procs.append(p)
    mq.wait_until_ready()
    return conns, procs


def _stop_readers(mq, conns, procs):
    mq.enqueue(None)
    stats = [c.recv() for c in conns]
    for p in procs:
        p.join(timeout=30)
    mq.shutdown()
    return stats


def _make_tensor(size_mb: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    n = (size_mb << 20) // 2
    return torch.randint(-(2**15), 2**15 - 1, (n,), generator=g, dtype=torch.int16).view(
        torch.bfloat16
    )


def _queue(mode: str, tp: int) -> MessageQueue:
    if mode.startswith("vllm-"):
        return _queue_class(mode)(
            tp,
            tp,
            max_chunk_bytes=16 << 20,
            max_chunks=10,
            enable_shm_tensor_arena=mode == "vllm-arena",
        )
    arena = mode in ("arena", "arena-fixed", "loan")
    message_queue._ARENA_POLICY = "fixed" if mode == "arena-fixed" else "variable"
    mq = MessageQueue(
        tp, tp, max_chunk_bytes=16 << 20, max_chunks=10, enable_shm_tensor_arena=arena
    )
    mq.serialize_inband = mode == "inband"
    return mq


def _lend(mq: MessageQueue, sources: list[torch.Tensor]) -> list[torch.Tensor]:
    """Loan mode: the producer builds its tensors directly in the arena (the fill stands in
    for the preprocessor writing its output, and is not part of the broadcast)."""
    out = []
    for src in sources:
        t = mq.empty(src.shape, src.dtype)
        t.copy_(src)
        out.append(t)
    return out


def run_cell(mode, tp, size_mb, n_msgs, warmup, seed, bar=None, consume="cpu", sizes=None):
    """One (mode, TP, workload) cell: fresh queue and readers, warm-up, then measured
    messages. A message carries one tensor of size_mb, or one per entry of ``sizes``."""
    sources = [_make_tensor(mb, seed + k) for k, mb in enumerate(sizes or [size_mb])]
    check = [(int(t.view(torch.uint8)[0]), int(t.view(torch.uint8)[-1])) for t in sources]
    nbytes = sum(t.numel() * t.element_size() for t in sources)
    mq = _queue(mode, tp)
    conns, procs = _start_readers(mq, tp, nbytes, consume)
    rows = []
    try:
        before = {}
        for i in range(warmup + n_msgs):
            if i == warmup:
                before = mq.stats().get("arena", {}) if hasattr(mq, "stats") else {}
            ts = _lend(mq, sources) if mode == "loan" else sources
            msg = {"pixel_values": ts, "step": i, "check": check}
            t0 = time.perf_counter()
            mq.enqueue(msg)
            t1 = time.perf_counter()
            del ts, msg
            acks = [c.recv() for c in conns]
            if not all(a[3] for a in acks):
                raise RuntimeError(f"{mode} TP={tp} {size_mb} MiB: a reader saw wrong bytes")
            if i >= warmup:
                rows.append(
                    {
                        "enqueue_ms": (t1 - t0) * 1e3,
                        "delivery_ms": (max(a[0] for a in acks) - t0) * 1e3,
                        "consume_ms": (max(a[1] for a in acks) - t0) * 1e3,
                        "dequeue_us": max(a[2] for a in acks) * 1e6,
                    }
                )
            if bar is not None:
                bar.update(1)
        writer_stats = mq.stats() if hasattr(mq, "stats") else {"overflow_messages": -1}
    finally:
        reader_stats = _stop_readers(mq, conns, procs)
    med = {k: statistics.median(r[k] for r in rows) for k in rows[0]}
    arena = writer_stats.get("arena", {})
    # Where the measured messages' tensors went: hits minus those of the warm-up.
    hits = arena.get("hits", 0) - before.get("hits", 0) if arena else 0
    fallbacks = len(sources) * n_msgs - hits if arena else 0
    cell = {
        "mode": mode,
        "tp": tp,
        "size_mb": size_mb,
        "messages": n_msgs,
        **{f"{k}_p50": v for k, v in med.items()},
        "delivery_ms_min": min(r["delivery_ms"] for r in rows),
        # A declined tensor (e.g. below the 8 MiB threshold) took the out-of-band path.
        "workload": "single" if sizes is None else f"{len(sizes)}x{sizes[0]}MB",
        "tensor_bytes": nbytes,
        "fallbacks_per_message": fallbacks / n_msgs,
        "host_bytes_moved": (
            copies_per_message(mode if hits else ("oob" if arena else mode), tp) + tp
        )
        * nbytes,
        "arena_hits": hits,
        "arena_declined": arena.get("declined", {}),
        "overflow_messages": writer_stats["overflow_messages"],
        "reader_overflow": sum(s.get("overflow_messages", 0) for s in reader_stats),
    }
    return cell


def warm_memcpy_ms(size_mb: int, reps: int = 7) -> float:
    """Median time of one warm memcpy of size_mb MiB (torch copy_ between touched buffers)."""
    n = size_mb << 20
    src = torch.ones(n, dtype=torch.uint8)
    dst = torch.zeros(n, dtype=torch.uint8)
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        dst.copy_(src)
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


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
        queues[on] = (mq, *_start_readers_small(mq, tp))
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


def _start_readers_small(mq, tp):
    ctx = mp.get_context("fork")
    conns, procs = [], []
    for rank in range(tp):
        parent, child = ctx.Pipe()
        p = ctx.Process(target=_small_reader, args=(mq.export_handle(), rank, child), daemon=True)
        p.start()
        conns.append(parent)
        procs.append(p)
    mq.wait_until_ready()
    return conns, procs


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
            f"| {c['workload']} | {c['tensor_bytes'] >> 20} | {c['tp']} | {MODE_LABEL[c['mode']]} "
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


def machine_info() -> dict:
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    mem_gb = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "mem_gib": round(mem_gb, 1),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "summary": f"{os.cpu_count()} cores, {mem_gb:.0f} GiB, {cpu}",
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--full", action="store_true", help="TP {1,2,4,8} x {8,64,200} MiB")
    ap.add_argument("--tp", type=int, nargs="+")
    ap.add_argument("--sizes", type=int, nargs="+", help="tensor sizes in MiB")
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
            once = warm_memcpy_ms(c["tensor_bytes"] >> 20, reps=3)
            ratios[f"{key}: delivery / one warm copy of its bytes"] = c["delivery_ms_p50"] / once

    result = {
        "command": " ".join(["python", "benchmarks/broadcast_ab.py", *(argv or sys.argv[1:])]),
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        "seed": args.seed,
        "consume": args.consume,
        "messages": args.messages,
        "warmup": args.warmup,
        "machine": machine_info(),
        "warm_memcpy_ms": memcpy,
        "cells": cells,
        "small_messages": small,
        "ratios": ratios,
    }
    hdr = (
        f"{'workload':>9} {'MiB':>5} {'TP':>3} {'mode':<28} {'enqueue':>9} {'delivery':>9} "
        f"{'consume':>9} {'dequeue':>9} {'GB moved':>9}"
    )
    print()
    print(hdr)
    for c in cells:
        print(
            f"{c['workload']:>9} {c['tensor_bytes'] >> 20:>5} {c['tp']:>3} "
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
