"""The workers' response queues: this project's vs vLLM's, in the loop vLLM's executor runs
(`make bench-response-queue`; needs vLLM importable: .venv-vllm).

One engine process and ``tp`` forked workers. Per step the engine enqueues a tensor-free
message shaped like a decode step's ``SchedulerOutput`` on a broadcast queue (ours, the
arena on, as with ``--enable-shm-tensor-arena``); every worker dequeues it and keeps its CPU
busy for the step's work (a loop on the clock, as a CPU forward does); worker 0 replies on its
response queue with ``(status, output)``, the output shaped like a ``ModelRunnerOutput`` (a
sampled token per request, small lists); the engine waits for that reply, as vLLM's
``collective_rpc`` does with a unique reply rank. The response queues are ``ours``
(``vllm_shm_arena.MessageQueue(1, 1, readers_cede_cpu=True)``, what the plugin builds with the
flag on) or ``vllm``
(``shm_broadcast.MessageQueue(1, 1)``, vLLM's), built by each worker and joined by the engine
with ``create_from_handle(handle, 0)``.

Measured per step, in the engine: the step's time (enqueue to the reply in hand) and the
engine thread's CPU time over it (the enqueue, the wait, the unpickling: ``thread_time``).
Cells: TP 1 and 2 x the work per step (0: the queues alone; a decode step's few ms; an
encoder's or a prefill's tens to hundreds of ms); the two kinds alternate within each
repetition, the order rotating. Per cell: the median over the repetitions of the step time's
p50 and of the mean CPU per step. Writes benchmarks/results/response_queue/response_queue.
{md,json}. Prints, never asserts.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import harness as ab  # noqa: E402  (benchmarks/, beside this file)

from vllm_shm_arena import MessageQueue  # noqa: E402

OUT = os.path.join(ab.RESULTS, "response_queue")
KINDS = ["ours", "vllm"]
#: (work per step in ms, steps measured, warm-up steps).
WORK = [(0.0, 400, 40), (4.0, 200, 20), (40.0, 40, 5), (200.0, 12, 2)]
TPS = [1, 2]


def _vllm_mq():
    from vllm.distributed.device_communicators.shm_broadcast import MessageQueue as VllmMQ

    return VllmMQ


def step_output(step: int, n_req: int = 64) -> tuple:
    """A reply shaped like a decode step's ``(SUCCESS, ModelRunnerOutput)``: one sampled
    token per request, the request ids, small lists."""
    ids = [f"chatcmpl-{i:016x}" for i in range(n_req)]
    out = {
        "req_ids": ids,
        "req_id_to_index": {r: i for i, r in enumerate(ids)},
        "sampled_token_ids": [[(step * 7919 + i) % 151_000] for i in range(n_req)],
        "logprobs": None,
        "prompt_logprobs_dict": {},
        "num_nans_in_logits": None,
    }
    return (1, out)


def worker_main(handle, rank: int, conn, kind: str, work_s: float) -> None:
    """Joins the broadcast, builds its response queue (the kind asked), sends its handle
    back, then per message computes for ``work_s`` and (rank 0) replies."""
    bcast = MessageQueue.create_from_handle(handle, rank)
    resp = MessageQueue(1, 1, readers_cede_cpu=True) if kind == "ours" else _vllm_mq()(1, 1)
    conn.send(resp.export_handle())
    bcast.wait_until_ready()
    resp.wait_until_ready()
    while True:
        msg = bcast.dequeue()
        if msg is None:
            break
        end = time.perf_counter() + work_s
        while time.perf_counter() < end:
            pass
        if rank == 0:
            resp.enqueue(step_output(msg["step"]))
    conn.send("done")
    bcast.shutdown()
    resp.shutdown()


def run_cell(kind: str, tp: int, work_ms: float, steps: int, warmup: int, seed: int) -> dict:
    """One cell: ``warmup`` + ``steps`` steps; per measured step its time and engine CPU."""
    bcast = MessageQueue(tp, tp, enable_shm_tensor_arena=True)
    # The broadcast is ready once this returns; then, as vLLM's executor does, every worker's
    # response queue is joined and waited for (a step with a unique reply rank reads rank 0's).
    conns, procs = ab.start_readers(bcast, tp, worker_main, kind, work_ms / 1e3)
    cls = MessageQueue if kind == "ours" else _vllm_mq()
    resps = [cls.create_from_handle(c.recv(), 0) for c in conns]
    resp = resps[0]
    for r in resps:
        r.wait_until_ready()
    from bench_vs_vllm import scheduler_step

    base = scheduler_step(seed)
    wall, cpu = [], []
    try:
        for i in range(warmup + steps):
            msg = dict(base, step=i)
            t0, c0 = time.perf_counter(), time.thread_time()
            bcast.enqueue(msg)
            status, out = resp.dequeue()
            t1, c1 = time.perf_counter(), time.thread_time()
            if status != 1 or out["sampled_token_ids"][0][0] != (i * 7919) % 151_000:
                raise RuntimeError(f"step {i}: wrong reply")
            if i >= warmup:
                wall.append(t1 - t0)
                cpu.append(c1 - c0)
        ab.stop_readers(bcast, conns, procs)  # None ends each worker, which says "done"
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
        for r in resps:
            r.shutdown()
        bcast.shutdown()
    return {
        "kind": kind,
        "tp": tp,
        "work_ms": work_ms,
        "steps": steps,
        "step_p50_ms": statistics.median(wall) * 1e3,
        "step_mean_ms": statistics.fmean(wall) * 1e3,
        "overhead_p50_ms": statistics.median(wall) * 1e3 - work_ms,
        "engine_cpu_per_step_ms": statistics.fmean(cpu) * 1e3,
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--seed", type=int, default=int(os.environ.get("BENCH_SEED", "20261205")))
    ap.add_argument("--out", default=OUT)
    args = ap.parse_args(argv)
    print(f"bench_response_queue: seed {args.seed} (BENCH_SEED replays it)", flush=True)
    _vllm_mq()  # fail early without vLLM
    t_start = time.time()
    raw = []
    for rep in range(args.repeats):
        for tp in TPS:
            for work_ms, steps, warmup in WORK:
                kinds = KINDS if (rep + tp) % 2 == 0 else KINDS[::-1]
                for kind in kinds:
                    r = run_cell(kind, tp, work_ms, steps, warmup, args.seed + rep)
                    r["repeat"] = rep
                    raw.append(r)
                    print(json.dumps(r), flush=True)
    rows = []
    for tp in TPS:
        for work_ms, steps, _ in WORK:
            row = {"tp": tp, "work_ms": work_ms, "steps": steps}
            for kind in KINDS:
                cells = [
                    r for r in raw if (r["kind"], r["tp"], r["work_ms"]) == (kind, tp, work_ms)
                ]
                for key in ("step_p50_ms", "overhead_p50_ms", "engine_cpu_per_step_ms"):
                    vals = [c[key] for c in cells]
                    row[f"{kind}_{key}"] = statistics.median(vals)
                    row[f"{kind}_{key}_range"] = [min(vals), max(vals)]
            rows.append(row)
    rec = {
        **ab.run_record("bench_response_queue.py", argv),
        "machine": ab.machine_info(),
        "load_1min": os.getloadavg()[0],
        "minutes": (time.time() - t_start) / 60,
        "seed": args.seed,
        "repeats": args.repeats,
        "rows": rows,
        "raw": raw,
    }
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "response_queue.json"), "w") as f:
        json.dump(rec, f, indent=1)
    md = [
        "# The workers' response queues: this project's vs vLLM's",
        "",
        f"Run: `{rec['command']}` on {rec['date']}, {rec['minutes']:.1f} min, "
        f"{rec['machine']['summary']}; load average (1 min) at the end {rec['load_1min']:.2f}. "
        f"{args.repeats} repetitions, each cell's kinds side by side (order rotating); medians "
        "over the repetitions, [min-max].",
        "",
        "Per step: the engine broadcasts a tensor-free step message (our queue, arena on), "
        "every worker computes for the step's work (a busy loop), worker 0 replies on its "
        "response queue and the engine waits for the reply. Step time: enqueue to reply in "
        "hand (p50); overhead: that minus the work; engine CPU: the engine thread's CPU per "
        "step (enqueue, wait, unpickling), mean.",
        "",
        "| TP | work per step, ms | steps | step p50, ms: ours | vLLM's | overhead p50, ms: ours "
        "| vLLM's | engine CPU per step, ms: ours | vLLM's |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]

    def cell(row, key, digits=3):
        lo, hi = row[f"{key}_range"]
        return f"{row[key]:.{digits}f} [{lo:.{digits}f}-{hi:.{digits}f}]"

    for row in rows:
        md.append(
            f"| {row['tp']} | {row['work_ms']:g} | {row['steps']} | "
            + " | ".join(
                cell(row, f"{k}_{key}")
                for key in ("step_p50_ms", "overhead_p50_ms", "engine_cpu_per_step_ms")
                for k in KINDS
            )
            + " |"
        )
    md += [
        "",
        "vLLM's reader spins (`sched_yield` between checks) for a second after each message; "
        "ours spins (pause with a CPU to spare, else `sched_yield`) within 50 ms of its last "
        "message, then sleeps on a futex until the writer wakes it; it stops spinning sooner "
        "once a `sched_yield` comes back late (`readers_cede_cpu`, as the plugin builds it: "
        "200 us, another thread computed on its CPU meanwhile, as the workers do on 2 CPUs "
        "at TP=2).",
    ]
    with open(os.path.join(args.out, "response_queue.md"), "w") as f:
        f.write("\n".join(md) + "\n")
    print("\n".join(md))
    return 0


if __name__ == "__main__":
    sys.exit(main())
