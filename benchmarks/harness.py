"""The broadcast benchmarks' harness: queues for each mode (ours, vLLM's), reader processes
that receive, check and consume each message, one measured cell (``run_cell``), seeded
workloads, and the record every results file starts with. broadcast_ab.py, bench_vs_vllm.py and
dequeue_profile.py are built on it.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import platform
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from vllm_shm_arena import MessageQueue  # noqa: E402
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


RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")


#: Image sides for the pixel_values workload: 448^2 ~ 1.2 MB, 1024^2 ~ 6.4 MB, 2048^2 ~ 25 MB.
PIXEL_SIDES = [448, 1024, 2048]


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


def queue_class(handle_or_mode):
    """Our MessageQueue, or vLLM's for the vllm-* modes (and for vLLM's handles)."""
    name = handle_or_mode if isinstance(handle_or_mode, str) else type(handle_or_mode).__module__
    if name.startswith("vllm-") or name.startswith("vllm."):
        from vllm.distributed.device_communicators.shm_broadcast import MessageQueue as VllmMQ

        return VllmMQ
    return MessageQueue


def broadcast_reader(handle, rank, conn, consume_bytes, consume="cpu"):
    torch.set_num_threads(1)
    if consume == "cuda":
        torch.zeros(1, device="cuda")  # a context before the first tensor: the arena pins
    mq = queue_class(handle).create_from_handle(handle, rank)
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


def start_broadcast_readers(mq, tp, consume_bytes, consume="cpu"):
    # CUDA cannot be used in a forked child of a process that touched it: spawn then.
    method = "spawn" if consume == "cuda" else "fork"
    return start_readers(mq, tp, broadcast_reader, consume_bytes, consume, method=method)


def stop_readers(mq, conns, procs):
    mq.enqueue(None)
    stats = [c.recv() for c in conns]
    for p in procs:
        p.join(timeout=30)
    mq.shutdown()
    return stats


def make_tensor(size_mb: float, seed: int) -> torch.Tensor:
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


def make_queue(mode: str, tp: int, chunk_bytes: int = 16 << 20) -> MessageQueue:
    if mode.startswith("vllm-"):
        return queue_class(mode)(
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


class VllmArenaHits:
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


def writer_stats(mq, vllm_hits: VllmArenaHits | None) -> dict:
    """Our queue's stats(); for vLLM's queue, the arena hits counted by VllmArenaHits."""
    if hasattr(mq, "stats"):
        return mq.stats()
    out = {"overflow_messages": -1}
    if vllm_hits is not None:
        out["arena"] = {"hits": vllm_hits.hits, "declined": {}}
    return out


def lend(mq: MessageQueue, sources: list[torch.Tensor]) -> list[torch.Tensor]:
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
        sources = [make_tensor(mb, seed + k) for k, mb in enumerate(sizes or [size_mb])]
    check = [
        (int(t.reshape(-1).view(torch.uint8)[0]), int(t.reshape(-1).view(torch.uint8)[-1]))
        for t in sources
    ]
    nbytes = sum(t.numel() * t.element_size() for t in sources)
    mq = make_queue(mode, tp, chunk_bytes)
    vllm_hits = None
    if mode == "vllm-arena" and getattr(mq, "tensor_arena", None) is not None:
        vllm_hits = VllmArenaHits(mq.tensor_arena)
    conns, procs = start_broadcast_readers(mq, tp, nbytes, consume)
    rows = []
    try:
        before = {}
        for i in range(warmup + n_msgs):
            if i == warmup:
                before = writer_stats(mq, vllm_hits).get("arena", {})
            tag = tag_fn(i) if tag_fn is not None else None
            ts = lend(mq, sources) if mode == "loan" else sources
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
        w_stats = writer_stats(mq, vllm_hits)
    finally:
        reader_stats = stop_readers(mq, conns, procs)
    metrics = [k for k in rows[0] if k != "tag"]
    med = {k: statistics.median(r[k] for r in rows) for k in metrics}
    by_tag = {}
    for tag in sorted({r["tag"] for r in rows if r["tag"] is not None}, key=str):
        sel = [r for r in rows if r["tag"] == tag]
        by_tag[str(tag)] = {f"{k}_p50": statistics.median(r[k] for r in sel) for k in metrics}
    arena = w_stats.get("arena", {})
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
        "overflow_messages": w_stats["overflow_messages"],
        "reader_overflow": sum(s.get("overflow_messages", 0) for s in reader_stats),
    }
    if by_tag:
        cell["by_tag"] = by_tag
    return cell


def mib(nbytes: int) -> str:
    """Bytes as MiB for tables: whole MiB plain, fractions to two places."""
    mib = nbytes / (1 << 20)
    return f"{mib:.0f}" if mib >= 10 or mib == int(mib) else f"{mib:.2f}"


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
