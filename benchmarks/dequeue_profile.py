"""Where a reader's ``MessageQueue.dequeue`` of an arena message spends its time.

Part A (the CPU cost of one dequeue, message already in the ring): one writer, TP forked
readers, lock-step. The writer enqueues a message like ``broadcast_ab``'s (``pixel_values``:
a list of arena tensors, ``step``, ``check``), then tells each reader over a pipe to dequeue
it, so no reader waits for the message or for the writer. Every other message the reader
times ``dequeue`` with its pieces wrapped, in this process only (``vllm_shm_arena`` itself is
not modified; ``time.perf_counter_ns`` around each):

* ring read: ``RingReader.read`` (acquire the chunk, copy its frames into bytearrays,
  release it), through a proxy standing in for the reader's ring (``mq._end.ring``);
* frame handling: ``_parse_diverted`` (the frame listing the message's arena records);
* unpickle: ``loads``, split into pickle's own work, ``_rebuild_arena_tensor``'s Python
  (registry lookup, pin decision) and the reader's C++ ``rebuild`` (the stub's checks, the
  dtype lookup, acquiring the record, ``at::from_blob``);
* ``flush_releases``;
* stats/metrics reporting (``arena.stats()`` and ``metrics.record_reader_stats``): gated to
  once a second, so reported per call and per message;
* Python overhead: the instrumented total minus the pieces (the loop, shutdown/timeout
  checks, clocks, counters, the calls themselves).

The other messages are timed with nothing wrapped (the clean total; the difference is the
instrumentation's own cost). Also timed, outside ``dequeue``: dropping the message (the
tensors' deleters release their records).

Part B (a loaned 200 MiB tensor, TP 1/2/4, real wake-ups): readers block in ``dequeue``
before the writer sends; per message each reader records when its ring read returned and
when ``dequeue`` returned; ``/proc/<pid>/schedstat``, read by the writer just before
``enqueue`` and by each reader when its ``dequeue`` returned, gives each reader's time on a
CPU and its time runnable but waiting for one (run-queue delay) in that window. Delivery
(enqueue start -> last reader holds the tensor) is split for the last reader into: until its
ring read returned, the rest of its dequeue, and how much of the whole was run-queue delay.

    python benchmarks/dequeue_profile.py   # -> benchmarks/results/dequeue_profile.{txt,json}
"""

from __future__ import annotations

import argparse
import io
import json
import os
import statistics
import sys
import time
from contextlib import redirect_stdout

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import harness as ab  # noqa: E402  (benchmarks/, beside this file)

from vllm_shm_arena import MessageQueue, metrics  # noqa: E402
from vllm_shm_arena import arena as arena_mod  # noqa: E402
from vllm_shm_arena._ext import _C  # noqa: E402
from vllm_shm_arena.mq import reader as reader_mod  # noqa: E402
from vllm_shm_arena.mq import writer as writer_mod  # noqa: E402

RESULTS = ab.RESULTS
PIECES = [
    "ring_read",
    "frame_handling",
    "unpickle_pickle",
    "unpickle_rebuild_py",
    "unpickle_rebuild_cxx",
    "flush_releases",
    "stats_metrics",
    "python_overhead",
]

_now = time.perf_counter_ns


class _Rec:
    """Nanoseconds per piece for the message being dequeued."""

    def __init__(self):
        self.t = {}

    def add(self, key, ns):
        self.t[key] = self.t.get(key, 0) + ns


class _RingProxy:
    """Stands in for ``mq._end.ring``: times ``read`` and notes when it returned."""

    def __init__(self, ring, rec):
        self._ring, self._rec = ring, rec
        self.returned_at = 0.0

    def read(self, timeout_s):
        t0 = _now()
        r = self._ring.read(timeout_s)
        t1 = _now()
        self.returned_at = time.perf_counter()
        self._rec.add("ring_read", t1 - t0)
        return r

    def __getattr__(self, name):
        return getattr(self._ring, name)


class _ReaderProxy:
    """Stands in for ``arena._reader`` (the C++ ``ArenaReader``): times ``rebuild``."""

    def __init__(self, reader, rec):
        self._r, self._rec = reader, rec

    def rebuild(self, *a):
        t0 = _now()
        t = self._r.rebuild(*a)
        self._rec.add("rebuild_cxx", _now() - t0)
        return t

    def __getattr__(self, name):
        return getattr(self._r, name)


def _timed(fn, rec, key):
    def wrapper(*a, **k):
        t0 = _now()
        try:
            return fn(*a, **k)
        finally:
            rec.add(key, _now() - t0)
            rec.add(key + "_calls", 1)

    return wrapper


class Instrument:
    """Wraps the pieces of one reader queue's ``dequeue``; ``on()``/``off()`` between
    messages (attribute swaps, outside the timed region)."""

    def __init__(self, mq, rec):
        self.mq, self.rec = mq, rec
        arena = mq.arena
        self.orig = {
            "ring": mq._end.ring,
            "reader": arena._reader,
            "parse": reader_mod.parse_diverted,
            "loads": reader_mod.loads,
            "rebuild": arena_mod._rebuild_arena_tensor,
            "record": metrics.record_reader_stats,
        }
        self.ring = _RingProxy(mq._end.ring, rec)
        self.reader = _ReaderProxy(arena._reader, rec)
        self.flush = _timed(arena.flush_releases, rec, "flush_releases")
        self.stats = _timed(arena.stats, rec, "stats")
        self.parse = _timed(reader_mod.parse_diverted, rec, "frame_handling")
        self.loads = _timed(reader_mod.loads, rec, "unpickle")
        # Pickle finds the stub's rebuild function by module attribute at load time.
        self.rebuild = _timed(arena_mod._rebuild_arena_tensor, rec, "rebuild")
        self.record = _timed(metrics.record_reader_stats, rec, "metrics")

    def on(self):
        mq, arena = self.mq, self.mq.arena
        mq._end.ring = self.ring
        arena._reader = self.reader
        arena.flush_releases = self.flush
        arena.stats = self.stats
        reader_mod.parse_diverted = self.parse
        reader_mod.loads = self.loads
        arena_mod._rebuild_arena_tensor = self.rebuild
        metrics.record_reader_stats = self.record

    def off(self):
        mq, arena = self.mq, self.mq.arena
        mq._end.ring = self.orig["ring"]
        arena._reader = self.orig["reader"]
        for name in ("flush_releases", "stats"):
            arena.__dict__.pop(name, None)
        reader_mod.parse_diverted = self.orig["parse"]
        reader_mod.loads = self.orig["loads"]
        arena_mod._rebuild_arena_tensor = self.orig["rebuild"]
        metrics.record_reader_stats = self.orig["record"]


def _schedstat(fd) -> tuple[int, int]:
    """(ns on a CPU, ns runnable waiting for a CPU) of this process so far."""
    on_cpu, waiting, _ = os.pread(fd, 128, 0).split()
    return int(on_cpu), int(waiting)


def _reader_a(handle, rank, conn):
    """Part A reader: on ("go", instrumented) dequeue the waiting message and report."""
    torch.set_num_threads(1)
    mq = MessageQueue.create_from_handle(handle, rank)
    mq.wait_until_ready()
    rec = _Rec()
    ins = Instrument(mq, rec)
    while True:
        cmd = conn.recv()
        if cmd[0] == "stop":
            break
        instrumented = cmd[1]
        rec.t = {}
        if instrumented:
            ins.on()
        t0 = _now()
        msg = mq.dequeue()
        t1 = _now()
        if instrumented:
            ins.off()
        n = len(msg["pixel_values"])
        t2 = _now()
        del msg
        t3 = _now()
        conn.send(
            {
                "total": t1 - t0,
                "last_dequeue_ns": int(mq.last_dequeue_s * 1e9),
                "release_on_free": t3 - t2,
                "tensors": n,
                **rec.t,
            }
        )
    # The once-a-second stats/metrics block, timed by calling its two calls directly.
    per_call = []
    for _ in range(50):
        t0 = _now()
        rs = mq.arena.stats()
        metrics.record_reader_stats(rs)
        per_call.append(_now() - t0)
    conn.send({"stats_metrics_per_call": statistics.median(per_call)})
    mq.shutdown()


def _reader_b(handle, rank, conn):
    """Part B reader: blocks in dequeue before each message; reports times and schedstat."""
    torch.set_num_threads(1)
    mq = MessageQueue.create_from_handle(handle, rank)
    mq.wait_until_ready()
    rec = _Rec()
    ring = _RingProxy(mq._end.ring, rec)
    mq._end.ring = ring  # only notes when read returned: one perf_counter per message
    fd = os.open(f"/proc/{os.getpid()}/schedstat", os.O_RDONLY)
    while True:
        # CPU time from a clock that accounts the running slice too (schedstat's on-CPU sum
        # is only brought up to date at scheduling events).
        c0 = time.thread_time_ns()
        msg = mq.dequeue()
        t_end = time.perf_counter()
        c1 = time.thread_time_ns()
        s1 = _schedstat(fd)
        if msg is None:
            break
        # The writer read this process's schedstat just before enqueue: the difference is
        # the run-queue delay of the delivery window only.
        conn.send({"t_read": ring.returned_at, "t_end": t_end, "sched": s1, "cpu": c1 - c0})
        del msg
    os.close(fd)
    mq.shutdown()


def _med(xs):
    return statistics.median(xs) if xs else 0.0


def part_a(name, tp, sizes_mb, n_msgs, seed):
    """One part-A case -> per-piece medians (µs) over the instrumented messages."""
    g = torch.Generator().manual_seed(seed)
    sources = [
        torch.randint(0, 256, (int(mb * (1 << 20)),), generator=g, dtype=torch.uint8)
        for mb in sizes_mb
    ]
    check = [(int(t[0]), int(t[-1])) for t in sources]
    mq = MessageQueue(tp, tp, enable_shm_tensor_arena=True)
    conns, procs = ab.start_readers(mq, tp, _reader_a)
    inst, plain = [], []
    try:
        for i in range(n_msgs):
            mq.enqueue({"pixel_values": sources, "step": i, "check": check})
            instrumented = i % 2 == 1
            for c in conns:
                c.send(("go", instrumented))
            res = [c.recv() for c in conns]
            if i < 4:
                continue  # warm-up: first records, first pickles
            (inst if instrumented else plain).append(res)
        hits = mq.stats()["arena"]["hits"]
        for c in conns:
            c.send(("stop",))
        per_call = [c.recv()["stats_metrics_per_call"] for c in conns]
    finally:
        for p in procs:
            p.join(timeout=30)
        mq.shutdown()
    # Per reader per message: the pieces; medians over messages of every reader's values.
    rows = []
    for res in inst:
        for r in res:
            rebuild, cxx = r.get("rebuild", 0), r.get("rebuild_cxx", 0)
            stats_metrics = r.get("stats", 0) + r.get("metrics", 0)
            piece = {
                "ring_read": r.get("ring_read", 0),
                "frame_handling": r.get("frame_handling", 0),
                "unpickle_pickle": r.get("unpickle", 0) - rebuild,
                "unpickle_rebuild_py": rebuild - cxx,
                "unpickle_rebuild_cxx": cxx,
                "flush_releases": r.get("flush_releases", 0),
                "stats_metrics": stats_metrics,
            }
            piece["python_overhead"] = r["total"] - sum(piece.values())
            piece["total"] = r["total"]
            piece["stats_calls"] = r.get("stats_calls", 0)
            rows.append(piece)
    out = {
        "name": name,
        "tp": tp,
        "tensors": len(sources),
        "messages_instrumented": len(inst),
        "messages_plain": len(plain),
        "arena_hits": hits,
        "pieces_us": {k: _med([r[k] for r in rows]) / 1e3 for k in PIECES},
        "pieces_mean_us": {k: statistics.fmean(r[k] for r in rows) / 1e3 for k in PIECES},
        "instrumented_total_us": _med([r["total"] for r in rows]) / 1e3,
        "plain_total_us": _med([r["total"] for res in plain for r in res]) / 1e3,
        "plain_total_p90_us": statistics.quantiles(
            [r["total"] for res in plain for r in res], n=10
        )[-1]
        / 1e3,
        "plain_last_dequeue_us": _med([r["last_dequeue_ns"] for res in plain for r in res]) / 1e3,
        "release_on_free_us": _med([r["release_on_free"] for res in plain for r in res]) / 1e3,
        "stats_metrics_per_call_us": _med(per_call) / 1e3,
        "stats_metrics_share": sum(r["stats_calls"] for r in rows) / max(1, len(rows)),
    }
    return out


def part_b(tp, n_msgs, pause_s, fill_threads=None, size_mb=200):
    """Loaned tensor, real wake-ups -> per-message medians (ms) for the last reader. The
    producer fills the loan before each send (``fill_threads``: torch threads for it; None:
    torch's default), then waits ``pause_s``."""
    mq = MessageQueue(tp, tp, enable_shm_tensor_arena=True)
    conns, procs = ab.start_readers(mq, tp, _reader_b)
    rows = []
    wfd = os.open(f"/proc/{os.getpid()}/schedstat", os.O_RDONLY)
    rfds = [os.open(f"/proc/{p.pid}/schedstat", os.O_RDONLY) for p in procs]
    nbytes = int(size_mb * (1 << 20))
    # The writer's two steps: pickling (the loan's stub) and the ring write with its wake-up.
    marks = {}
    dump, send = writer_mod.dump_message, mq._end.send

    def timed_dump(*a):
        marks["dump_start"] = time.perf_counter()
        return dump(*a)

    def timed_send(*a):
        marks["send_start"] = time.perf_counter()
        try:
            return send(*a)
        finally:
            marks["send_end"] = time.perf_counter()

    writer_mod.dump_message, mq._end.send = timed_dump, timed_send
    try:
        for i in range(n_msgs):
            t = mq.empty((nbytes,), torch.uint8)
            threads = torch.get_num_threads()
            if fill_threads:
                torch.set_num_threads(fill_threads)
            t.fill_(i & 0xFF)  # the producer writing its output: not part of the broadcast
            torch.set_num_threads(threads)
            if pause_s:
                # Readers reach their futex wait and the fill's OpenMP threads stop spinning.
                time.sleep(pause_s)
            r0 = [_schedstat(fd) for fd in rfds]
            w0 = _schedstat(wfd)
            t0 = time.perf_counter()
            mq.enqueue({"pixel_values": [t], "step": i})
            t1 = time.perf_counter()
            w1 = _schedstat(wfd)
            del t
            res = [c.recv() for c in conns]
            for r, s0 in zip(res, r0, strict=True):
                r["run_delay_ns"] = r["sched"][1] - s0[1]
            if i < 3:
                continue
            last = max(res, key=lambda r: r["t_end"])
            rows.append(
                {
                    "delivery": last["t_end"] - t0,
                    "enqueue": t1 - t0,
                    "writer_pickle": marks["send_start"] - marks["dump_start"],
                    "writer_send": marks["send_end"] - marks["send_start"],
                    "writer_run_delay": (w1[1] - w0[1]) / 1e9,
                    "until_ring_read_returned": last["t_read"] - t0,
                    "send_start_to_ring_read": last["t_read"] - marks["send_start"],
                    "rest_of_dequeue": last["t_end"] - last["t_read"],
                    "last_run_delay": last["run_delay_ns"] / 1e9,
                    "last_on_cpu": last["cpu"] / 1e9,
                    "max_run_delay": max(r["run_delay_ns"] for r in res) / 1e9,
                    "sum_run_delay": sum(r["run_delay_ns"] for r in res) / 1e9,
                    "first_reader_done": min(r["t_end"] for r in res) - t0,
                }
            )
        hits = mq.stats()["arena"]
        if hits.get("loans_sent", 0) < n_msgs:
            # mq.empty falls back to torch.empty when the arena cannot lend: not a loan then.
            raise RuntimeError(f"only {hits.get('loans_sent')} of {n_msgs} tensors were loans")
    finally:
        writer_mod.dump_message = dump
        for fd in (wfd, *rfds):
            os.close(fd)
        mq.enqueue(None)
        for p in procs:
            p.join(timeout=30)
        mq.shutdown()
    keys = list(rows[0])
    med = {k: _med([r[k] for r in rows]) * 1e3 for k in keys}
    med["delivery_minus_last_run_delay"] = (
        _med([r["delivery"] - r["last_run_delay"] for r in rows]) * 1e3
    )
    med["share_run_delay"] = _med([r["last_run_delay"] / r["delivery"] for r in rows])
    return {
        "tp": tp,
        "messages": len(rows),
        "loans_sent": hits.get("loans_sent"),
        "medians_ms": med,
    }


def report(result) -> str:
    """The text report."""
    buf = io.StringIO()
    with redirect_stdout(buf):
        m = result["machine"]
        print(f"dequeue_profile ({m['cores']} cores, {m['cpu']}, torch {m['torch']})")
        print(f"run: {result['command']} on {result['date']}")
        la = result["loadavg"]
        print(f"load average (1 min): start {la[0]:.2f}, end {la[-1]:.2f}")
        print(
            f"copy threads: {result['copy_threads']}; ring spin: only when the CPU count "
            "exceeds readers + 1 (here: never at TP >= 1 on 2 cores)"
        )
        print()
        print(
            "Part A: one reader's dequeue of an arena message already in the ring (µs, "
            "median over messages x readers; mean in brackets)"
        )
        print()
        cases = result["part_a"]
        w = 26
        print(f"{'piece':<{w}}" + "".join(f"{c['name']:>22}" for c in cases))
        for k in PIECES:
            print(
                f"{k:<{w}}"
                + "".join(
                    f"{c['pieces_us'][k]:>13.1f} [{c['pieces_mean_us'][k]:>6.1f}]" for c in cases
                )
            )
        rows = [
            ("= instrumented total", "instrumented_total_us"),
            ("plain dequeue (p50)", "plain_total_us"),
            ("plain dequeue (p90)", "plain_total_p90_us"),
            ("last_dequeue_s (p50)", "plain_last_dequeue_us"),
            ("dropping the message", "release_on_free_us"),
            ("stats+metrics, one call", "stats_metrics_per_call_us"),
        ]
        for label, key in rows:
            print(f"{label:<{w}}" + "".join(f"{c[key]:>22.1f}" for c in cases))
        print(
            f"{'stats+metrics calls/msg':<{w}}"
            + "".join(f"{c['stats_metrics_share']:>22.3f}" for c in cases)
        )
        print(
            f"{'messages (instr/plain)':<{w}}"
            + "".join(
                f"{str(c['messages_instrumented']) + '/' + str(c['messages_plain']):>22}"
                for c in cases
            )
        )
        if len(cases) >= 2:
            one = [c for c in cases if c["tensors"] == 1]
            many = [c for c in cases if c["tensors"] > 1]
            for b in many:
                same = [c for c in one if c["tp"] == b["tp"]]
                if same:
                    per = (b["plain_total_us"] - same[0]["plain_total_us"]) / (b["tensors"] - 1)
                    print(
                        f"per extra tensor at TP={b['tp']}: {per:.1f} µs (plain dequeue, "
                        f"{b['tensors']} vs 1 tensor)"
                    )
        keys = [
            ("delivery (enqueue start -> last reader holds it)", "delivery"),
            ("  first reader holds it", "first_reader_done"),
            ("  writer enqueue (whole call)", "enqueue"),
            ("    of which pickling (the loan's stub)", "writer_pickle"),
            ("    of which ring write + futex wake", "writer_send"),
            ("  writer run-queue delay during enqueue", "writer_run_delay"),
            ("  last reader: until its ring read returned", "until_ring_read_returned"),
            ("    from the writer's ring write start", "send_start_to_ring_read"),
            ("  last reader: rest of its dequeue", "rest_of_dequeue"),
            ("  last reader: run-queue delay (waiting for a core)", "last_run_delay"),
            ("  last reader: on a CPU in its dequeue call", "last_on_cpu"),
            ("  max run-queue delay over readers", "max_run_delay"),
            ("  sum of run-queue delay over readers", "sum_run_delay"),
            ("delivery minus the last reader's run-queue delay", "delivery_minus_last_run_delay"),
        ]
        for v in result["part_b"]:
            print()
            print(
                f"Part B: a loaned {result['part_b_size_mb']} MiB tensor, {v['label']}; ms, "
                "medians over messages; 'last' = the reader that finished last"
            )
            print()
            bs = v["cells"]
            print(f"{'':<52}" + "".join(f"{'TP=' + str(b['tp']):>10}" for b in bs))
            for label, k in keys:
                print(f"{label:<52}" + "".join(f"{b['medians_ms'][k]:>10.3f}" for b in bs))
            print(
                f"{'run-queue delay / delivery (last reader)':<52}"
                + "".join(f"{b['medians_ms']['share_run_delay']:>10.2f}" for b in bs)
            )
            print(f"{'messages':<52}" + "".join(f"{b['messages']:>10}" for b in bs))
    return buf.getvalue()


def main(argv=None) -> int:
    """Runs parts A and B, prints the report and writes it."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--messages", type=int, default=404, help="part A, one-tensor cases")
    ap.add_argument("--burst-messages", type=int, default=44, help="part A, the burst")
    ap.add_argument("--loan-messages", type=int, default=103, help="part B, per TP")
    ap.add_argument("--pause-ms", type=float, default=2.0, help="part B: the pause variant")
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--out", default=RESULTS)
    args = ap.parse_args(argv)
    print(f"seed={args.seed}", flush=True)
    loads = [os.getloadavg()[0]]
    cases = []
    for name, tp, sizes, n in (
        ("1 x 8 MiB TP=1", 1, [8], args.messages),
        ("1 x 8 MiB TP=2", 2, [8], args.messages),
        ("25 x 16 MiB TP=1", 1, [16] * 25, args.burst_messages),
        ("25 x 16 MiB TP=2", 2, [16] * 25, args.burst_messages),
        # The writer's 200 MiB copy streams through the caches just before the reader runs.
        ("1 x 200 MiB TP=1", 1, [200], args.burst_messages),
    ):
        print(f"part A: {name}", flush=True)
        cases.append(part_a(name, tp, sizes, n, args.seed))
        loads.append(os.getloadavg()[0])
    variants = [
        (
            f"fill, then a {args.pause_ms:g} ms pause: readers asleep in their futex wait",
            args.pause_ms,
            None,
        ),
        ("fill, no pause (broadcast_ab's loan mode)", 0.0, None),
        ("fill on one torch thread, no pause", 0.0, 1),
    ]
    bs = []
    for label, pause_ms, fill_threads in variants:
        cells = []
        for tp in (1, 2, 4):
            print(f"part B: {label}, TP={tp}", flush=True)
            cells.append(part_b(tp, args.loan_messages, pause_ms / 1e3, fill_threads))
            loads.append(os.getloadavg()[0])
        bs.append(
            {"label": label, "pause_ms": pause_ms, "fill_threads": fill_threads, "cells": cells}
        )
    result = {
        **ab.run_record("dequeue_profile.py", argv),
        "seed": args.seed,
        "machine": ab.machine_info(),
        "copy_threads": _C.copy_threads(),
        "loadavg": loads,
        "part_b_size_mb": 200,
        "part_a": cases,
        "part_b": bs,
    }
    text = report(result)
    print(text)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "dequeue_profile.txt"), "w") as f:
        f.write(text)
    with open(os.path.join(args.out, "dequeue_profile.json"), "w") as f:
        json.dump(result, f, indent=2)
    print(f"wrote {args.out}/dequeue_profile.{{txt,json}}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
