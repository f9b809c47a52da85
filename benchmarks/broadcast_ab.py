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
import multiprocessing as mp
import os
import platform
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from vllm_shm_arena import MessageQueue  # noqa: E402
from vllm_shm_arena import arena as arena_mod  # noqa: E402
from vllm_shm_arena._ext import _C  # noqa: E402
from vllm_shm_arena.mq import writer as mq_writer  # noqa: E402

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

#: The threshold cells (see the module docstring).
THRESHOLD_SIZES_MB = [0.25, 0.5, 1, 2, 4, 8]
THRESHOLD_TPS = [2, 4]
#: Ring chunk size -> what it means for a 0.25-8 MiB out-of-band message.
THRESHOLD_CHUNKS = {16 << 20: "ring", 128 << 10: "socket"}
#: Image sides for the pixel_values workload: 448^2 ~ 1.2 MB, 1024^2 ~ 6.4 MB, 2048^2 ~ 25 MB.
PIXEL_SIDES = [448, 1024, 2048]
#: A threshold must leave the arena this much faster (median delivery ratio) at every size
#: above it: on the shared 2-core machine a single cell's ratio moves by +-0.3 between runs.
THRESHOLD_MARGIN = 1.25
#: Bytes per patch of Qwen2-VL's uint8 pixel_values: 14 x 14 pixels x 3 channels x 2 frames.
PATCH_BYTES = 1176


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
            del t, flat  # the loop's names must not keep the last tensor (its slot) alive
        if consume == "cuda":
            torch.cuda.current_stream().synchronize()
        t_cons = time.perf_counter()
        del msg, ts
        conn.send((t_recv, t_cons, getattr(mq, "last_dequeue_s", 0.0), ok))
    conn.send(mq.stats() if hasattr(mq, "stats") else {})
    mq.shutdown()


def start_readers(mq, tp, target, *extra, method="fork"):
    """``tp`` reader processes running ``target(handle, rank, conn, *extra)``, each with a
    pipe back; returns ``(conns, procs)`` once the queue is ready."""
    ctx = mp.get_context(method)
    conns, procs = [], []
    for rank in range(tp):
        parent, child = ctx.Pipe()
        p = ctx.Process(target=target, args=(mq.export_handle(), rank, child, *extra), daemon=True)
        p.start()
        conns.append(parent)
        procs.append(p)
    mq.wait_until_ready()
    return conns, procs


def _start_readers(mq, tp, consume_bytes, consume="cpu"):
    # CUDA cannot be used in a forked child of a process that touched it: spawn then.
    method = "spawn" if consume == "cuda" else "fork"
    return start_readers(mq, tp, _reader_main, consume_bytes, consume, method=method)


def _stop_readers(mq, conns, procs):
    mq.enqueue(None)
    stats = [c.recv() for c in conns]
    for p in procs:
        p.join(timeout=30)
    mq.shutdown()
    return stats


def _make_tensor(size_mb: float, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    n = int(size_mb * (1 << 20)) // 2
    return torch.randint(-(2**15), 2**15 - 1, (n,), generator=g, dtype=torch.int16).view(
        torch.bfloat16
    )


def pixel_patches(side: int) -> int:
    """Patches of a side x side image after Qwen2-VL's resize (sides rounded to a multiple
    of 28, then 14 x 14 patches): 1024 -> 74 x 74 = 5476 patches, 6.4 MB as uint8."""
    per_side = max(1, round(side / 28)) * 2
    return per_side * per_side


def pixel_values(side: int, seed: int) -> torch.Tensor:
    """Random uint8 pixel_values shaped like vLLM's for one image: (n_patches, 1176)."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (pixel_patches(side), PATCH_BYTES), generator=g).to(torch.uint8)


def _queue(mode: str, tp: int, chunk_bytes: int = 16 << 20) -> MessageQueue:
    if mode.startswith("vllm-"):
        return _queue_class(mode)(
            tp,
            tp,
            max_chunk_bytes=chunk_bytes,
            max_chunks=10,
            enable_shm_tensor_arena=mode == "vllm-arena",
        )
    arena = mode in ("arena", "arena-fixed", "loan")
    mq_writer._ARENA_POLICY = "fixed" if mode == "arena-fixed" else "variable"
    mq = MessageQueue(
        tp, tp, max_chunk_bytes=chunk_bytes, max_chunks=10, enable_shm_tensor_arena=arena
    )
    mq.serialize_inband = mode == "inband"
    return mq


class _VllmArenaHits:
    """Counts the tensors vLLM's own arena took (its queue keeps no such counter): wraps the
    writer arena's ``write_tensor`` on this instance only."""

    def __init__(self, arena):
        self.hits = 0
        self._write = arena.write_tensor
        arena.write_tensor = self

    def __call__(self, t):
        slot = self._write(t)
        self.hits += slot is not None
        return slot


def _writer_stats(mq, vllm_hits: _VllmArenaHits | None) -> dict:
    """Our queue's stats(); for vLLM's queue, the arena hits counted by _VllmArenaHits."""
    if hasattr(mq, "stats"):
        return mq.stats()
    out = {"overflow_messages": -1}
    if vllm_hits is not None:
        out["arena"] = {"hits": vllm_hits.hits, "declined": {}}
    return out


def _lend(mq: MessageQueue, sources: list[torch.Tensor]) -> list[torch.Tensor]:
    """Loan mode: the producer builds its tensors directly in the arena (the fill stands in
    for the preprocessor writing its output, and is not part of the broadcast)."""
    out = []
    for src in sources:
        t = mq.empty(src.shape, src.dtype)
        t.copy_(src)
        out.append(t)
    return out


def run_cell(
    mode,
    tp,
    size_mb,
    n_msgs,
    warmup,
    seed,
    bar=None,
    consume="cpu",
    sizes=None,
    chunk_bytes=16 << 20,
    sources=None,
    workload=None,
    tag_fn=None,
    extra=None,
):
    """One (mode, TP, workload) cell: fresh queue and readers, warm-up, then measured
    messages. A message carries one tensor of size_mb, or one per entry of ``sizes``, or
    the given ``sources`` (named ``workload``; ``[]``: no large tensor), plus the ``extra``
    items (e.g. a scheduler step's metadata); the ring's chunks are ``chunk_bytes``.
    ``tag_fn(i)``, called before message i, returns a tag; medians per tag go in ``by_tag``
    (an A/B interleaved inside one cell)."""
    if sources is None:
        sources = [_make_tensor(mb, seed + k) for k, mb in enumerate(sizes or [size_mb])]
    check = [
        (int(t.reshape(-1).view(torch.uint8)[0]), int(t.reshape(-1).view(torch.uint8)[-1]))
        for t in sources
    ]
    nbytes = sum(t.numel() * t.element_size() for t in sources)
    mq = _queue(mode, tp, chunk_bytes)
    vllm_hits = None
    if mode == "vllm-arena" and getattr(mq, "tensor_arena", None) is not None:
        vllm_hits = _VllmArenaHits(mq.tensor_arena)
    conns, procs = _start_readers(mq, tp, nbytes, consume)
    rows = []
    try:
        before = {}
        for i in range(warmup + n_msgs):
            if i == warmup:
                before = _writer_stats(mq, vllm_hits).get("arena", {})
            tag = tag_fn(i) if tag_fn is not None else None
            ts = _lend(mq, sources) if mode == "loan" else sources
            msg = {"pixel_values": ts, "step": i, "check": check, **(extra or {})}
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
                        "tag": tag,
                    }
                )
            if bar is not None:
                bar.update(1)
        writer_stats = _writer_stats(mq, vllm_hits)
    finally:
        reader_stats = _stop_readers(mq, conns, procs)
    metrics = [k for k in rows[0] if k != "tag"]
    med = {k: statistics.median(r[k] for r in rows) for k in metrics}
    by_tag = {}
    for tag in sorted({r["tag"] for r in rows if r["tag"] is not None}, key=str):
        sel = [r for r in rows if r["tag"] == tag]
        by_tag[str(tag)] = {f"{k}_p50": statistics.median(r[k] for r in sel) for k in metrics}
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
        "workload": workload or ("single" if sizes is None else f"{len(sizes)}x{sizes[0]}MB"),
        "tensor_bytes": nbytes,
        "chunk_bytes": chunk_bytes,
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
    if by_tag:
        cell["by_tag"] = by_tag
    return cell


def _mib(nbytes: int) -> str:
    """Bytes as MiB for tables: whole MiB plain, fractions to two places."""
    mib = nbytes / (1 << 20)
    return f"{mib:.0f}" if mib >= 10 or mib == int(mib) else f"{mib:.2f}"


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
            f"| {r['workload']} | {_mib(r['tensor_bytes'])} | {r['tp']} | {r['transport']} "
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
            f"- {k}: {'never at <= 8 MiB' if v is None else _mib(v) + ' MiB'} / "
            f"{'never at <= 8 MiB' if w is None else _mib(w) + ' MiB'}"
        )
    lines += [
        "",
        f"Suggested variable-layout threshold: **{_mib(summ['suggested_min_bytes'])} MiB** "
        f"(in force: VARIABLE_MIN_BYTES = {_mib(result['variable_min_bytes'])} MiB; fixed "
        f"layout MIN_BYTES = {_mib(result['fixed_min_bytes'])} MiB).",
    ]
    with open(os.path.join(out_dir, "threshold.md"), "w") as f:
        f.write("\n".join(lines) + "\n")


def warm_memcpy_ms(size_mb: float, reps: int = 7) -> float:
    """Median time of one warm memcpy of size_mb MiB (torch copy_ between touched buffers)."""
    n = int(size_mb * (1 << 20))
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
            f"| {c['workload']} | {_mib(c['tensor_bytes'])} | {c['tp']} | {MODE_LABEL[c['mode']]} "
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


def run_record(script: str, argv) -> dict:
    """The fields every results file starts with: the command that reruns it and when."""
    return {
        "command": " ".join(["python", f"benchmarks/{script}", *(argv or sys.argv[1:])]),
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
    }


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
            f"{r['workload']:>22} {_mib(r['tensor_bytes']):>5} {r['tp']:>3} {r['transport']:>9} "
            f"{r['oob_delivery_ms']:>8.3f} {r['arena_delivery_ms']:>8.3f} "
            f"{r['delivery_oob_over_arena']:>15.2f} {r['consume_oob_over_arena']:>17.2f}"
        )
    for k, v in result["threshold"]["crossover_bytes"].items():
        w = result["threshold"]["crossover_margin_bytes"][k]
        print(
            f"crossover {k}: {'never' if v is None else _mib(v) + ' MiB'} (median), "
            f"{'never' if w is None else _mib(w) + ' MiB'} (with the margin)"
        )
    print(f"suggested threshold: {_mib(result['threshold']['suggested_min_bytes'])} MiB")
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
            f"{c['workload']:>9} {_mib(c['tensor_bytes']):>5} {c['tp']:>3} "
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
