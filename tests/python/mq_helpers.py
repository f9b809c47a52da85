"""Process entry points and message builders for the queue's tests (mq/).

Reader entry points live here, at module level in an importable module, because a
``spawn``-started child unpickles its target by module path. The file also runs as a script
(``python mq_helpers.py stress|killall ...``) for scenarios that need the arena geometry set
through the environment before ``vllm_shm_arena.message_queue`` is imported, or that must be
killed as a whole process group.

Every message is ``{"seq", "nbytes", "dtype", "t", "small"}``. Its tensor is
``arange(nbytes // 4, int32) ^ key(seed, seq)`` viewed as ``dtype``, so a reader checks it
from the seed alone, cheaply (sampled positions plus the sum of a strided subset), and a
message delivered out of order or twice fails the check.
"""

from __future__ import annotations

import gc
import json
import multiprocessing
import os
import random
import sys
import threading
import time
import zlib
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from vllm_shm_arena import MessageQueue  # noqa: E402
from vllm_shm_arena import arena as arena_mod  # noqa: E402
from vllm_shm_arena.frontend import FrontendWriter, StubProvider  # noqa: E402

MiB = 1 << 20
#: Dtypes a pattern tensor is sent as (a view of the same int32 bytes).
VIEW_DTYPES = ["int32", "float32", "bfloat16", "uint8", "int64", "float16"]
#: Stride of the checked subset (a prime, so it walks across every alignment).
_STRIDE = 4099


def wait_until(condition, timeout: float, what: str):
    """Polls ``condition()`` every 10 ms until it returns something truthy, and returns that;
    an AssertionError naming ``what`` after ``timeout`` seconds. For conditions nothing
    signals (kernel counters, another process's files)."""
    deadline = time.monotonic() + timeout
    while True:
        got = condition()
        if got:
            return got
        assert time.monotonic() < deadline, f"timed out after {timeout} s waiting for {what}"
        time.sleep(0.01)


# ------------------------------------------------------------------------ messages
def ready_in_threads(writer, readers, timeout=20.0) -> None:
    """wait_until_ready on a writer and same-process readers, concurrently."""
    errors = []

    def run(q):
        try:
            q.wait_until_ready(timeout=timeout)
        except BaseException as e:
            errors.append(e)

    ths = [threading.Thread(target=run, args=(q,), daemon=True) for q in [writer, *readers]]
    for t in ths:
        t.start()
    for t in ths:
        t.join(timeout + 5)
    assert not errors, errors
    assert not any(t.is_alive() for t in ths)


def key(seed: int, seq: int) -> int:
    """The per-message XOR key (non-negative int32)."""
    return zlib.crc32(f"{seed}:{seq}".encode()) & 0x7FFFFFFF


def pattern(nbytes: int, k: int, dtype: str = "int32", rows: int = 1) -> torch.Tensor:
    """``arange(nbytes // 4, int32) ^ k`` viewed as ``dtype``, ``rows`` rows."""
    assert nbytes % 16 == 0, nbytes
    t = torch.arange(nbytes // 4, dtype=torch.int32).bitwise_xor_(k)
    t = t.view(getattr(torch, dtype))
    return t.reshape(rows, -1) if rows > 1 else t


def check_pattern(t: torch.Tensor, nbytes: int, k: int, n_sample: int = 64) -> str | None:
    """None if ``t`` holds ``pattern(nbytes, k)`` at the sampled positions and its strided
    subset sums right; else what is wrong."""
    if not isinstance(t, torch.Tensor):
        return f"expected a tensor, got {type(t).__name__}"
    got_bytes = t.numel() * t.element_size()
    if got_bytes != nbytes:
        return f"tensor has {got_bytes} bytes, want {nbytes}"
    if not t.is_contiguous():
        return "tensor is not contiguous"
    flat = t.reshape(-1).view(torch.uint8).view(torch.int32)
    n = flat.numel()
    g = torch.Generator().manual_seed(k)
    idx = torch.cat(
        [torch.tensor([0, n - 1]), torch.randint(0, n, (n_sample,), generator=g)]
    ).unique()
    want = idx.to(torch.int32).bitwise_xor(k)
    got = flat[idx]
    if not torch.equal(got, want):
        bad = (got != want).nonzero()[0].item()
        return (
            f"pattern mismatch at element {idx[bad].item()}: got {got[bad].item()}, "
            f"want {want[bad].item()} (key {k})"
        )
    off = k % min(_STRIDE, n)
    got_sum = flat[off::_STRIDE].to(torch.int64).sum().item()
    want_sum = torch.arange(off, n, _STRIDE, dtype=torch.int64).bitwise_xor_(k).sum().item()
    if got_sum != want_sum:
        return f"strided sum mismatch: got {got_sum}, want {want_sum} (key {k})"
    return None


def small_payload(seed: int, seq: int) -> dict:
    """A deterministic tensor-free payload (strings, floats, bytes, nesting)."""
    rng = random.Random(f"{seed}/{seq}")
    return {
        "s": "x" * rng.randint(0, 200) + str(seq),
        "f": [rng.random() for _ in range(rng.randint(0, 8))],
        "b": rng.randbytes(rng.randint(0, 64)),
        "tup": (seq, None, True, -1.5),
    }


def make_msg(seed: int, seq: int, nbytes: int = 0, dtype: str = "int32", rows: int = 1):
    """The message ``seq``: a pattern tensor of ``nbytes`` (none if 0) plus a small payload."""
    t = pattern(nbytes, key(seed, seq), dtype, rows) if nbytes else None
    return {"seq": seq, "nbytes": nbytes, "dtype": dtype, "t": t, "small": small_payload(seed, seq)}


def check_msg(msg, seed: int, seq: int, full: bool = False) -> str | None:
    """None if ``msg`` is exactly message ``seq`` (``full``: every tensor byte compared; else
    sampled); else what is wrong."""
    if not isinstance(msg, dict) or msg.get("seq") != seq:
        got = msg.get("seq") if isinstance(msg, dict) else type(msg).__name__
        return f"expected message {seq}, got {got}"
    if msg["small"] != small_payload(seed, seq):
        return f"message {seq}: small payload differs"
    t = msg["t"]
    if msg["nbytes"] == 0:
        return None if t is None else f"message {seq}: unexpected tensor"
    if not isinstance(t, torch.Tensor) or str(t.dtype) != f"torch.{msg['dtype']}":
        return f"message {seq}: wrong dtype {getattr(t, 'dtype', t)}, want {msg['dtype']}"
    err = check_pattern(t, msg["nbytes"], key(seed, seq))
    if err is None and full:
        want = pattern(msg["nbytes"], key(seed, seq), msg["dtype"])
        if not torch.equal(t.reshape(-1).view(torch.uint8), want.view(torch.uint8)):
            err = "bytes differ (full compare)"
    return None if err is None else f"message {seq}: {err}"


# ------------------------------------------------------------------------ children
class Kids:
    """Child processes of one test; ``kill_all`` (always, in a finally) leaves none behind."""

    def __init__(self, method: str = "fork"):
        self.ctx = multiprocessing.get_context(method)
        self.procs: list = []

    def start(self, target, *args, ctx=None):
        p = (ctx or self.ctx).Process(target=target, args=args, daemon=True)
        p.start()
        self.procs.append(p)
        return p

    def join_all(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        for p in self.procs:
            p.join(max(0.0, deadline - time.monotonic()))
        alive = [p.pid for p in self.procs if p.is_alive()]
        assert not alive, f"children still running after {timeout} s: {alive}"

    def kill_all(self) -> None:
        for p in self.procs:
            if p.is_alive():
                p.kill()
        for p in self.procs:
            p.join(5)


def _reader_setup(handle, rank, ready_timeout=60.0):
    # Forked from a process whose OpenMP pool may have run: keep torch single-threaded here.
    torch.set_num_threads(1)
    r = MessageQueue.create_from_handle(handle, rank)
    r.wait_until_ready(timeout=ready_timeout)
    return r


def _report(q, rank, **kw):
    q.put({"rank": rank, **kw})


def checking_reader(handle, rank, seed, n, q, timeout=60.0, full=False):
    """Dequeues ``n`` messages, checks each against ``make_msg``; reports counts and the first
    errors."""
    errors, count = [], 0
    try:
        r = _reader_setup(handle, rank)
        for seq in range(n):
            msg = r.dequeue(timeout=timeout)
            count += 1
            err = check_msg(msg, seed, seq, full)
            if err and len(errors) < 10:
                errors.append(err)
            del msg
        _report(q, rank, count=count, errors=errors, stats=r.stats())
    except BaseException as e:  # report instead of dying silently
        _report(q, rank, count=count, errors=errors + [f"{type(e).__name__}: {e}"])


def full_checking_reader(handle, rank, seed, n, q):
    """checking_reader comparing every byte."""
    checking_reader(handle, rank, seed, n, q, 120.0, True)


# ------------------------------------------------------------------------ stress scenario
def stress_plan(seed: int, n: int, n_oversize: int, slot_bytes: int) -> dict[int, int]:
    """seq -> tensor bytes for the big messages: about one in 100, spaced 40..160 apart so the
    slots a reader holds never pile up; ``n_oversize`` of them larger than a slot."""
    rng = random.Random(seed)
    plan: dict[int, int] = {}
    seq = rng.randint(20, 100)
    while seq < n:
        plan[seq] = rng.randrange(8 * MiB, min(60 * MiB, slot_bytes - MiB), 64 * 1024)
        seq += rng.randint(40, 160)
    big = sorted(plan)
    for s in rng.sample(big, min(n_oversize, len(big))):
        plan[s] = rng.randrange(slot_bytes + 16 * MiB, slot_bytes + 36 * MiB, 64 * 1024)
    return plan


def stress_spec(seed: int, seq: int, plan: dict[int, int]) -> tuple[int, str, int]:
    """(nbytes, dtype, rows) of message ``seq``: a planned big tensor, a 1-4 MiB tensor (5%),
    a tiny tensor (10%), or none."""
    rng = random.Random(seed * 1_000_003 + seq)
    dtype = rng.choice(VIEW_DTYPES)
    rows = rng.choice([1, 1, 2, 4])
    if seq in plan:
        return plan[seq], dtype, rows
    u = rng.random()
    if u < 0.05:
        return rng.randrange(MiB, 4 * MiB, 4096), dtype, rows
    if u < 0.15:
        return rng.randrange(16, 64 * 1024, 16), dtype, 1
    return 0, "int32", 1


def stress_reader(handle, rank, seed, n, plan, q):
    """Reader of the stress scenario: every message in order, every tensor checked."""
    errors, count, t0 = [], 0, time.monotonic()
    try:
        r = _reader_setup(handle, rank)
        for seq in range(n):
            msg = r.dequeue(timeout=120)
            count += 1
            spec = stress_spec(seed, seq, plan)
            err = check_msg(msg, seed, seq)
            if err is None and (msg["nbytes"], msg["dtype"]) != spec[:2]:
                err = f"message {seq}: spec {msg['nbytes'], msg['dtype']} != {spec[:2]}"
            if err and len(errors) < 10:
                errors.append(err)
            del msg
        _report(q, rank, count=count, errors=errors, seconds=time.monotonic() - t0)
    except BaseException as e:
        _report(q, rank, count=count, errors=errors + [f"{type(e).__name__}: {e}"])


def stress_main(seed: int, n: int, n_readers: int, n_oversize: int) -> None:
    """Writer of the stress scenario (geometry from VLLM_SHM_ARENA_* in the environment).
    Prints one ``RESULT {json}`` line."""
    from vllm_shm_arena.mq import writer as mq_writer

    print(f"stress: VSA_SEED={seed} n={n} readers={n_readers}", flush=True)
    kids = Kids("fork")
    mq = MessageQueue(n_readers, n_readers, enable_shm_tensor_arena=True)
    try:
        plan = stress_plan(seed, n, n_oversize, mq_writer._ARENA_SLOT_BYTES)
        q = kids.ctx.Queue()
        for rank in range(n_readers):
            kids.start(stress_reader, mq.export_handle(), rank, seed, n, plan, q)
        mq.wait_until_ready(timeout=60)
        t0 = time.monotonic()
        for seq in range(n):
            mq.enqueue(make_msg(seed, seq, *stress_spec(seed, seq, plan)), timeout=120)
        write_s = time.monotonic() - t0
        results = sorted((q.get(timeout=180) for _ in range(n_readers)), key=lambda d: d["rank"])
        kids.join_all(30)
        stats = mq.stats()
        slot = stats["arena"]["slot_bytes"]
        out = {
            "seed": seed,
            "n": n,
            "write_s": write_s,
            "total_s": time.monotonic() - t0,
            "n_arena_sized": sum(1 for b in plan.values() if b <= slot),
            "n_oversize": sum(1 for b in plan.values() if b > slot),
            "readers": results,
            "stats": stats,
        }
        print("RESULT " + json.dumps(out), flush=True)
    finally:
        mq.shutdown()
        kids.kill_all()


# ------------------------------------------------------------------------ SIGKILL everything
def _killall_reader(handle, rank, seed, q):
    r = _reader_setup(handle, rank)
    held = r.dequeue(timeout=60)  # keeps its arena slot to the end
    q.put((rank, check_msg(held, seed, 0)))
    time.sleep(3600)


def killall_main(seed: int) -> None:
    """Writer + 2 forked readers, all holding an arena tensor, then waiting to be killed.
    Prints ``NAMES <ring> <arena>`` and ``READY`` once everyone is past wait_until_ready."""
    kids = Kids("fork")
    mq = MessageQueue(2, 2, enable_shm_tensor_arena=True)
    q = kids.ctx.Queue()
    for rank in range(2):
        kids.start(_killall_reader, mq.export_handle(), rank, seed, q)
    h = mq.handle
    print(f"NAMES {h.buffer_handle[0]} {h.tensor_arena_handle.name}", flush=True)
    print(f"ADDR {h.local_subscribe_addr}", flush=True)
    mq.wait_until_ready(timeout=60)
    mq.enqueue(make_msg(seed, 0, 16 * MiB), timeout=60)
    for _ in range(2):
        rank, err = q.get(timeout=60)
        assert err is None, err
    assert mq.stats()["arena"]["hits"] == 1
    print("READY", flush=True)
    time.sleep(3600)


# ------------------------------------------------------------------------ scenario readers
def retention_reader(handle, rank, seed, n_after, q, go):
    """Keeps message 0 (two arena tensors) and message 1 (a ring-chunk tensor) across
    ``n_after`` further messages, checking them before and after; then drops them, says so,
    and reads one last message."""
    errors = []
    try:
        r = _reader_setup(handle, rank)
        kept0 = r.dequeue(timeout=30)
        kept1 = r.dequeue(timeout=30)
        held_arena = r.stats()["arena"]["held"]
        snap = [kept0["t"].clone(), kept0["t2"].clone(), kept1["t"].clone()]
        for seq in range(2, 2 + n_after):
            err = check_msg(r.dequeue(timeout=30), seed, seq)
            if err:
                errors.append(err)
        for got, want, what in zip(
            (kept0["t"], kept0["t2"], kept1["t"]),
            snap,
            ("arena t", "arena t2", "ring t"),
            strict=True,
        ):
            if not torch.equal(got.view(torch.uint8), want.view(torch.uint8)):
                errors.append(f"retained {what} changed after {n_after} messages")
        for m, s in ((kept0, 0), (kept1, 1)):
            err = check_msg(m, seed, s)
            if err:
                errors.append("retained: " + err)
        del kept0, kept1, snap
        gc.collect()
        q.put({"phase": "dropped", "held_arena": held_arena, "errors": errors})
        go.wait(30)
        last = 2 + n_after
        err = check_msg(r.dequeue(timeout=30), seed, last)
        q.put({"phase": "done", "errors": [err] if err else []})
    except BaseException as e:
        q.put({"phase": "error", "errors": errors + [f"{type(e).__name__}: {e}"]})


def _raise_on_unpickle(what):
    raise ValueError(f"unpickling {what} fails on purpose")


class Boom:
    """Pickles fine; unpickling raises ValueError."""

    def __reduce__(self):
        return _raise_on_unpickle, ("Boom",)


def boom_reader(handle, rank, seed, rounds, q):
    """For each round: the first dequeue must raise ValueError (Boom), the next message must
    arrive intact. The writer sends it only after every reader reported the failure."""
    try:
        r = _reader_setup(handle, rank)
        seq = 0
        for _ in range(rounds):
            try:
                r.dequeue(timeout=30)
                q.put(("no_raise", None))
            except ValueError as e:
                q.put(("raised", str(e)))
            seq += 1
            q.put(("next", check_msg(r.dequeue(timeout=30), seed, seq)))
            seq += 1
    except BaseException as e:
        q.put(("error", f"{type(e).__name__}: {e}"))


def inside_a_call(q) -> bool:
    """Whether a thread is inside one of queue end ``q``'s calls now (it holds the end's call
    lock from the call's start to its return)."""
    return q._end.lifecycle.call_lock.locked()


def dequeue_in_thread(r, timeout: float = 10.0):
    """Starts ``r.dequeue()`` (no timeout) in a daemon thread and returns (thread, out) once
    the thread is inside the call; when the call ends, ``out["result"]`` is "returned" or the
    exception it raised."""
    out = {}

    def run():
        try:
            r.dequeue()
            out["result"] = "returned"
        except BaseException as e:
            out["result"] = e

    th = threading.Thread(target=run, daemon=True)
    th.start()
    wait_until(lambda: inside_a_call(r) or "result" in out, timeout, "dequeue() to start")
    return th, out


def blocked_reader(handle, rank, q):
    """Blocks in dequeue() (no timeout) in a thread; reports how the call ended."""
    try:
        r = _reader_setup(handle, rank)
        th, out = dequeue_in_thread(r)
        q.put({"phase": "blocked"})
        th.join(60)
        res = out.get("result")
        ended = {} if res is None else {"result": "returned"}
        if isinstance(res, BaseException):
            ended = {"result": type(res).__name__, "msg": str(res)}
        q.put({"phase": "woke", "alive": th.is_alive(), **ended})
    except BaseException as e:
        q.put({"phase": "error", "result": f"{type(e).__name__}: {e}"})


def holding_reader(handle, rank, seed, n, q, hold: bool):
    """Checks ``n`` messages; with ``hold`` keeps every one (and its arena slot) and reports
    after each, then sleeps until killed."""
    try:
        r = _reader_setup(handle, rank)
        kept = []
        for seq in range(n):
            msg = r.dequeue(timeout=60)
            err = check_msg(msg, seed, seq)
            if hold:
                kept.append(msg)
            del msg
            q.put({"rank": rank, "seq": seq, "err": err})
        if hold:
            time.sleep(3600)
    except BaseException as e:
        q.put({"rank": rank, "seq": -1, "err": f"{type(e).__name__}: {e}"})


def inplace_reader(handle, rank, q, seen, mutated):
    """Rank 1 looks at its arena tensor (``seen``); rank 0 then writes -7 into the first 100
    elements of its own (``mutated``); rank 1 looks again."""
    try:
        r = _reader_setup(handle, rank)
        t = r.dequeue(timeout=30)["t"]
        if rank == 0:
            if not seen.wait(30):
                raise TimeoutError("rank 1 never looked")
            t[:100] = -7
            mutated.set()
            q.put({"rank": 0, "ok": True})
        else:
            before = t[:3].tolist()
            seen.set()
            if not mutated.wait(30):
                raise TimeoutError("rank 0 never mutated")
            q.put({"rank": 1, "before": before, "after": t[:100].tolist()})
    except BaseException as e:
        q.put({"rank": rank, "error": f"{type(e).__name__}: {e}"})


def many_frames_msg(seq: int, n_parts: int = 25, part_bytes: int = 48 << 10) -> dict:
    """Message ``seq`` as ``n_parts`` distinct int32 tensors of ``part_bytes`` filled with
    ``seq``: each travels as its own out-of-band frame, small enough that ZeroMQ copies it
    (so ``enqueue`` returns while the frames may still sit in ZeroMQ's queue)."""
    return {
        "seq": seq,
        "parts": [torch.full((part_bytes // 4,), seq, dtype=torch.int32) for _ in range(n_parts)],
    }


def draining_reader(handle, rank, q):
    """Reports "ready", then dequeues (no timeout) until dequeue raises, reporting each
    message's seq (and whether its parts are intact) and finally the exception."""
    try:
        r = _reader_setup(handle, rank)
        q.put(("ready", None))
        while True:
            try:
                msg = r.dequeue()
            except BaseException as e:
                q.put(("end", f"{type(e).__name__}: {e}"))
                return
            ok = all(bool((p == msg["seq"]).all()) for p in msg["parts"])
            q.put(("msg", (msg["seq"], ok)))
    except BaseException as e:
        q.put(("error", f"{type(e).__name__}: {e}"))


def drop_inherited_writer(box):
    """A forked child drops its inherited copy of the writer, as if it were garbage."""
    box.clear()
    gc.collect()


# ------------------------------------------------------------------------ forwarding
FORWARD_N = 512 << 10  # int32 elements: 2 MiB, over the frontend and queue arenas' thresholds


class Frontend:
    """A frontend arena for ``n_workers`` and this process as its reader 0 (the engine
    core's part), named the forward source; ``held(k)`` is a tensor this process holds from it
    (filled with ``k``), as the engine core holds a multimodal item."""

    def __init__(self, n_workers: int) -> None:
        self.writer = FrontendWriter(n_workers, 64 * MiB, max_allocations=64)
        self.provider = StubProvider(self.writer.handle())
        arena_mod.set_forward_source(self.provider.reader)

    def held(self, k: int, n: int = FORWARD_N) -> torch.Tensor:
        loan = self.writer.fill(torch.full((n,), k, dtype=torch.int32))
        consumer = self.writer.consumer()
        consumer.new_message()
        return self.provider("int32", [n], consumer(loan))

    def in_use(self) -> int:
        gc.collect()
        self.writer.arena.reclaim(check_liveness=False)
        return self.writer.arena.stats(holdings=False)["in_use"]

    def owed(self, rank: int) -> int:
        return self.writer.arena.stats()["holdings"][rank]["owed"]

    def close(self) -> None:
        arena_mod.set_forward_source(None)
        self.provider.close()
        self.writer.arena.close()


def queue_with_readers(n: int = 2, **kw):
    """An arena queue with ``n`` same-process readers, ready."""
    w = MessageQueue(n, n, enable_shm_tensor_arena=True, **kw)
    rs = [MessageQueue.create_from_handle(w.export_handle(), i) for i in range(n)]
    ready_in_threads(w, rs)
    return w, rs


def shutdown_all(w, rs) -> None:
    for q in (w, *rs):
        q.shutdown()


def main(argv: list[str]) -> None:
    logging_level = os.environ.get("VSA_LOG")
    if logging_level:
        import logging

        logging.basicConfig(level=logging_level)
    cmd = argv[0]
    if cmd == "stress":
        seed, n, n_readers, n_oversize = (int(x) for x in argv[1:5])
        stress_main(seed, n, n_readers, n_oversize)
    elif cmd == "killall":
        killall_main(int(argv[1]))
    else:
        raise SystemExit(f"unknown command {cmd!r}")


if __name__ == "__main__":
    main(sys.argv[1:])


def bind_retrying(sock, addr: str, timeout: float = 10.0) -> None:
    """Binds ``sock`` to ``addr``, retrying while the address is still taken (a process that
    just died still holds it for a moment)."""
    import zmq

    deadline = time.monotonic() + timeout
    while True:
        try:
            sock.bind(addr)
            return
        except zmq.ZMQError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.02)


def reading_thread(q, n: int, key=None, timeout: float = 30.0):
    """A started daemon thread dequeuing ``n`` messages from ``q`` -> (thread, got, errors):
    ``got`` the messages (``m[key]`` when given), ``errors`` what ended it early."""
    got: list = []
    errors: list = []

    def read():
        try:
            for _ in range(n):
                m = q.dequeue(timeout=timeout)
                got.append(m if key is None else m[key])
        except BaseException as e:
            errors.append(e)

    t = threading.Thread(target=read, daemon=True)
    t.start()
    return t, got, errors


def squat(addr: str, payload: bytes, heads, stop, plain_server: bool = True, ready=None) -> None:
    """Binds a dead writer's address (an XPUB; with ``plain_server``, one that believes any
    PLAIN client, as no ZAP handler runs in its context) and publishes ``[head, payload]`` for
    each of ``heads`` every 10 ms until ``stop`` (an Event) is set. ``ready`` is set once
    bound."""
    import zmq

    ctx = zmq.Context()
    s = ctx.socket(zmq.XPUB)
    s.setsockopt(zmq.LINGER, 0)
    if plain_server:
        s.plain_server = True
    bind_retrying(s, addr)
    if ready is not None:
        ready.set()
    while not stop.is_set():
        for head in heads:
            try:
                s.send_multipart([head, payload], zmq.NOBLOCK)
            except zmq.Again:
                pass
        time.sleep(0.01)
    s.close()
    ctx.term()
