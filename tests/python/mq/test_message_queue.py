"""``MessageQueue`` end to end, with real processes: ordering and byte-exactness under load,
retention, unpickle failures, timeouts, shutdown, a remote reader over loopback TCP, killed
readers and writers, fork vs spawn, and the arena's shared-memory semantics.

Every multi-process test prints its seed (``VSA_SEED``, see conftest.py); replay a failure
with ``VSA_SEED=<n> pytest tests/python/mq/test_message_queue.py -k <name>``. Every wait has a
timeout and every child is killed in a ``finally``, so a broken queue fails, never hangs.
Reader entry points live in ``mq_helpers.py`` (spawn imports them by module path).
"""

from __future__ import annotations

import gc
import json
import multiprocessing
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import mq_helpers as H  # noqa: E402
import pytest
import torch
from mq_helpers import ready_in_threads  # noqa: E402

from vllm_shm_arena import MessageQueue  # noqa: E402
from vllm_shm_arena.mq import writer as mq_writer  # noqa: E402

MiB = H.MiB
SHM = Path(os.environ["VLLM_SHM_ARENA_SHM_DIR"])  # the session's private dir (conftest.py)


# ------------------------------------------------------------------------ fixtures / helpers
@pytest.fixture
def geometry(monkeypatch):
    """``geometry(num_slots, slot_mb)``: the arena shape of writers made afterwards in this
    process (readers take it from the handle). The env variables only act at import."""

    def set_(num_slots: int, slot_mb: int) -> None:
        monkeypatch.setattr(mq_writer, "_ARENA_POLICY", "fixed")
        monkeypatch.setattr(mq_writer, "_ARENA_NUM_SLOTS", num_slots)
        monkeypatch.setattr(mq_writer, "_ARENA_SLOT_BYTES", slot_mb << 20)

    return set_


def get(q, timeout=60.0):
    """Next report from a child (fails instead of hanging)."""
    try:
        return q.get(timeout=timeout)
    except queue.Empty:
        pytest.fail(f"no report from a child within {timeout} s")


def arena_stats(mq) -> dict:
    return mq.stats()["arena"]


# ------------------------------------------------------------------------ 1. stress
def _run_stress(seed: int, n: int, timeout: float) -> dict:
    """Runs mq_helpers.stress_main in a fresh interpreter with 8 x 64 MiB slots (the env is
    read when the queue is imported) as its own process group -> the RESULT dict."""
    env = dict(os.environ)
    env.update(
        VLLM_SHM_ARENA_POLICY="fixed", VLLM_SHM_ARENA_SLOT_MB="64", VLLM_SHM_ARENA_NUM_SLOTS="8"
    )
    env["PYTHONPATH"] = os.pathsep.join([str(H.REPO), env.get("PYTHONPATH", "")])
    p = subprocess.Popen(
        [sys.executable, str(Path(H.__file__)), "stress", str(seed), str(n), "4", "4"],
        cwd=H.REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        out, err = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        out, err = p.communicate()
        pytest.fail(
            f"stress run exceeded {timeout} s\nstdout:\n{out[-3000:]}\nstderr:\n{err[-3000:]}"
        )
    finally:
        try:
            os.killpg(p.pid, signal.SIGKILL)  # readers left behind by a crashed writer
        except ProcessLookupError:
            pass
    lines = [ln for ln in out.splitlines() if ln.startswith("RESULT ")]
    assert p.returncode == 0 and lines, f"rc={p.returncode}\n{out[-3000:]}\n{err[-3000:]}"
    return json.loads(lines[-1][len("RESULT ") :])


def _check_stress(res: dict) -> None:
    st = res["stats"]
    ar = st["arena"]
    print(
        f"\nstress: {res['n']} messages x 4 readers in {res['total_s']:.1f} s; "
        f"ring {st['ring_messages']}, overflow {st['overflow_messages']}, "
        f"dropped_readers {st['dropped_readers']}\n"
        f"arena: hits {ar['hits']} ({ar['bytes'] >> 20} MiB), declined {ar['declined']}, "
        f"in_use {ar['in_use']}, reclaimed {ar['reclaimed']}, "
        f"planned arena-sized {res['n_arena_sized']}, oversize {res['n_oversize']}"
    )
    for r in res["readers"]:
        assert r["errors"] == [] and r["count"] == res["n"], r
    assert st["messages"] == res["n"]
    assert st["dropped_readers"] == 0
    assert ar["hits"] >= res["n_arena_sized"], ar
    assert res["n_oversize"] >= 3
    assert ar["declined"]["oversize"] == res["n_oversize"], ar["declined"]
    assert ar["declined"]["no_free_slot"] == 0, ar["declined"]
    assert ar["declined"]["no_space"] == 0, ar["declined"]


@pytest.mark.timeout(300)  # above the run's own 240 s bound
def test_stress_4_forked_readers_10k_messages(seed):
    """10,000 messages to 4 forked readers, arena on (8 x 64 MiB): ~1% carry 8-60 MiB
    tensors (arena), 4 carry tensors larger than a slot (declined "oversize", sent over the
    socket), 5% carry 1-4 MiB tensors (ring chunks), 10% tiny tensors, the rest none. Every
    tensor is checked at sampled positions plus a strided checksum, in order, nothing lost."""
    _check_stress(_run_stress(seed, 10_000, timeout=240))


@pytest.mark.slow
@pytest.mark.timeout(2000)  # above the run's own 1800 s bound
def test_stress_soak_100k_messages(seed):
    """The stress scenario at 100,000 messages (``make stress``)."""
    _check_stress(_run_stress(seed, 100_000, timeout=1800))


# ------------------------------------------------------------------------ 2. retention
def test_retention_arena_and_ring_tensors_across_50_messages(seed, kids, writers, geometry):
    """A reader keeps two arena tensors (8 MiB, filling a 2-slot arena) and a 2 MiB tensor
    that came through a ring chunk across 50 further messages, each with another 8 MiB
    tensor. The ring chunks lap five times (the ring-path tensor was copied out); the writer
    never blocks on the full arena: those 50 tensors fall back (no_free_slot) and arrive
    intact. Once the reader lets go, the next big tensor goes through the arena again."""
    geometry(2, 16)
    n_after = 50
    mq = MessageQueue(1, 1, enable_shm_tensor_arena=True)
    writers(mq)
    q, go = kids.ctx.Queue(), kids.ctx.Event()
    kids.start(H.retention_reader, mq.export_handle(), 0, seed, n_after, q, go)
    mq.wait_until_ready(timeout=30)

    msg0 = H.make_msg(seed, 0, 8 * MiB, "float32")
    msg0["t2"] = H.pattern(8 * MiB, 12345, "bfloat16")
    msg1 = H.make_msg(seed, 1, 2 * MiB, "int64")
    t0 = time.monotonic()
    for m in (msg0, msg1):
        mq.enqueue(m, timeout=30)
    assert arena_stats(mq)["hits"] == 2
    # enqueue returned: the sent bytes no longer alias ours, so scribbling on them is fine.
    for t in (msg0["t"], msg0["t2"], msg1["t"]):
        t.view(torch.uint8).fill_(0xAB)
    for seq in range(2, 2 + n_after):
        mq.enqueue(H.make_msg(seed, seq, 8 * MiB, "int32"), timeout=30)
    writer_s = time.monotonic() - t0
    ar = arena_stats(mq)
    assert ar["hits"] == 2, ar
    assert ar["declined"]["no_free_slot"] == n_after, ar["declined"]

    rep = get(q)
    assert rep["phase"] == "dropped" and rep["errors"] == [], rep
    assert rep["held_arena"] == 2
    go.set()
    mq.enqueue(H.make_msg(seed, 2 + n_after, 8 * MiB), timeout=30)
    assert arena_stats(mq)["hits"] == 3, "slots did not come back after the reader let go"
    rep = get(q)
    assert rep == {"phase": "done", "errors": []}, rep
    kids.join_all(10)
    print(f"retention: writer sent {n_after + 2} messages in {writer_s:.2f} s with a full arena")


# ------------------------------------------------------------------------ 3. unpickle error
def test_unpickle_error_releases_arena_slot(seed, kids, writers, geometry):
    """A message with an arena tensor and an object whose unpickling raises: every reader's
    dequeue raises, and the slot comes back (1-slot arena: the next big tensor is a hit).
    Both orders: the tensor rebuilt before the failure, and never rebuilt."""
    geometry(1, 16)
    mq = MessageQueue(2, 2, enable_shm_tensor_arena=True)
    writers(mq)
    q = kids.ctx.Queue()
    for rank in range(2):
        kids.start(H.boom_reader, mq.export_handle(), rank, seed, 2, q)
    mq.wait_until_ready(timeout=30)
    seq = 0
    for order in ("tensor_first", "boom_first"):
        t = H.pattern(8 * MiB, H.key(seed, seq))
        bad = {"t": t, "boom": H.Boom()} if order == "tensor_first" else {"boom": H.Boom(), "t": t}
        hits = arena_stats(mq)["hits"]
        mq.enqueue(bad, timeout=30)
        assert arena_stats(mq)["hits"] == hits + 1
        for _ in range(2):
            what, detail = get(q)
            assert what == "raised", (order, what, detail)
            assert "fails on purpose" in detail
        seq += 1
        mq.enqueue(H.make_msg(seed, seq, 8 * MiB), timeout=30)
        ar = arena_stats(mq)
        assert ar["hits"] == hits + 2, (order, ar)
        assert ar["declined"]["no_free_slot"] == 0, (order, ar["declined"])
        for _ in range(2):
            assert get(q) == ("next", None), order
        seq += 1
    kids.join_all(10)


# ------------------------------------------------------------------------ 4. timeouts
@pytest.mark.parametrize("where", ["local", "remote"])
def test_dequeue_timeout_when_nothing_sent(where, writers):
    """Over the ring (local) or the TCP socket (remote)."""
    if where == "local":
        mq = MessageQueue(1, 1)
    else:
        mq = MessageQueue(1, 0, connect_ip="127.0.0.1")
    writers(mq)
    r = MessageQueue.create_from_handle(mq.export_handle(), 0)
    writers(r)
    ready_in_threads(mq, [r])
    t0 = time.monotonic()
    with pytest.raises(TimeoutError):
        r.dequeue(timeout=0.2)
    took = time.monotonic() - t0
    assert 0.19 <= took < 1.0, took


def test_enqueue_timeout_when_ring_full(seed, writers, geometry):
    """max_chunks=2 and a reader that does not read: the third enqueue times out, gives its
    arena slot back (aborted), and is never delivered; the queue works on afterwards."""
    geometry(2, 16)
    mq = MessageQueue(1, 1, max_chunk_bytes=1 * MiB, max_chunks=2, enable_shm_tensor_arena=True)
    writers(mq)
    r = MessageQueue.create_from_handle(mq.export_handle(), 0)
    writers(r)
    ready_in_threads(mq, [r])
    mq.enqueue(H.make_msg(seed, 0), timeout=5)
    mq.enqueue(H.make_msg(seed, 1), timeout=5)
    t0 = time.monotonic()
    with pytest.raises(TimeoutError):
        mq.enqueue(H.make_msg(seed, 99, 8 * MiB), timeout=0.3)
    took = time.monotonic() - t0
    assert 0.29 <= took < 1.5, took
    ar = arena_stats(mq)
    assert ar["aborted"] == 1 and ar["in_use"] == 0, ar
    for seq in (0, 1):
        assert H.check_msg(r.dequeue(timeout=5), seed, seq) is None
    mq.enqueue(H.make_msg(seed, 2, 8 * MiB), timeout=5)
    assert H.check_msg(r.dequeue(timeout=5), seed, 2) is None  # not the timed-out 99
    with pytest.raises(TimeoutError):
        r.dequeue(timeout=0.2)


def test_enqueue_timeout_never_fires_after_the_message_is_committed(seed, writers, geometry):
    """Copying a 600 MiB frame to the socket may take longer than ``timeout``, but a timeout
    only ever fires while nothing of the message is committed (waiting for a ring chunk or a
    remote backlog): here the ring has room, so enqueue returns and the message arrives
    intact; the queue goes on."""
    geometry(1, 16)
    mq = MessageQueue(1, 1, enable_shm_tensor_arena=True)
    writers(mq)
    r = MessageQueue.create_from_handle(mq.export_handle(), 0)
    writers(r)
    ready_in_threads(mq, [r])
    msg = H.make_msg(seed, 0, 8 * MiB)  # into the arena
    msg["big"] = torch.zeros(600 * MiB, dtype=torch.uint8)  # oversize: over the socket
    t0 = time.monotonic()
    mq.enqueue(msg, timeout=0.1)
    print(f"\nenqueue took {time.monotonic() - t0:.2f} s")
    ar = arena_stats(mq)
    assert ar["aborted"] == 0 and ar["hits"] == 1, ar
    got = r.dequeue(timeout=10)
    assert H.check_msg({k: v for k, v in got.items() if k != "big"}, seed, 0) is None
    assert got["big"].numel() == 600 * MiB
    del got, msg
    mq.enqueue({"after": 1}, timeout=5)
    assert r.dequeue(timeout=5) == {"after": 1}


# ------------------------------------------------------------------------ 5. shutdown
def _blocked_dequeue(r):
    th, out = H.dequeue_in_thread(r)
    assert th.is_alive(), out
    return th, out


@pytest.mark.parametrize("where", ["local", "remote"])
def test_reader_shutdown_wakes_its_blocked_dequeue(where, writers):
    """shutdown() from another thread wakes a dequeue() blocked on the ring (local) or on the
    TCP socket (remote) with RuntimeError, not a ZeroMQ error."""
    if where == "local":
        mq = MessageQueue(1, 1)
    else:
        mq = MessageQueue(1, 0, connect_ip="127.0.0.1")
    writers(mq)
    r = MessageQueue.create_from_handle(mq.export_handle(), 0)
    ready_in_threads(mq, [r])
    th, out = _blocked_dequeue(r)
    t0 = time.monotonic()
    r.shutdown()
    th.join(5)
    assert not th.is_alive(), "dequeue still blocked after shutdown()"
    assert isinstance(out["result"], RuntimeError), repr(out["result"])
    assert time.monotonic() - t0 < 2.0


def test_writer_shutdown_wakes_reader_in_other_process(kids, writers):
    mq = MessageQueue(1, 1)
    writers(mq)
    q = kids.ctx.Queue()
    kids.start(H.blocked_reader, mq.export_handle(), 0, q)
    mq.wait_until_ready(timeout=30)
    assert get(q) == {"phase": "blocked"}  # its thread is inside dequeue()
    t0 = time.monotonic()
    mq.shutdown()
    rep = get(q, 10)
    assert rep["phase"] == "woke" and not rep["alive"], rep
    assert rep["result"] == "RuntimeError", rep
    assert time.monotonic() - t0 < 3.0
    kids.join_all(10)


def test_writer_shutdown_before_ready_leaves_no_shm(geometry):
    """A queue shut down before wait_until_ready (which unlinks the names) unlinks them."""
    geometry(1, 16)
    mq = MessageQueue(1, 1, enable_shm_tensor_arena=True)
    names = [mq.handle.buffer_handle[0], mq.handle.tensor_arena_handle.name]
    assert all((SHM / n).exists() for n in names)
    mq.shutdown()
    assert not [n for n in names if (SHM / n).exists()]


def test_forked_child_dropping_writer_copy_keeps_ring_up(seed, kids, writers):
    """A forked child that garbage-collects its inherited copy of the writer must not shut
    the ring down for its parent (MessageQueue.__del__)."""
    # Only `box` refers to the writer (no fixture list, no local), so the child's gc frees it.
    box = {"mq": MessageQueue(1, 1)}
    r = MessageQueue.create_from_handle(box["mq"].export_handle(), 0)
    writers(r)
    try:
        ready_in_threads(box["mq"], [r])
        kids.start(H.drop_inherited_writer, box)
        kids.join_all(30)
        assert kids.procs[0].exitcode == 0
        box["mq"].enqueue(H.make_msg(seed, 0), timeout=5)
        assert H.check_msg(r.dequeue(timeout=5), seed, 0) is None
    finally:
        box["mq"].shutdown()


# ------------------------------------------------------------------------ 6. remote reader
def test_remote_reader_over_loopback_tcp(seed, kids, writers):
    """One local and one remote reader (TCP on 127.0.0.1 only). Every message reaches both,
    tensors byte-exact; the arena serves the local reader (the remote one gets the bytes of
    the arena allocations after the message, test_one_pickling.py)."""
    mq = MessageQueue(
        2, 1, local_reader_ranks=[0], connect_ip="127.0.0.1", enable_shm_tensor_arena=True
    )
    writers(mq)
    h = mq.export_handle()
    assert h.tensor_arena_handle is not None and mq.arena is not None
    assert h.remote_subscribe_addr.startswith("tcp://127.0.0.1:") and not h.remote_addr_ipv6
    sizes = [0, 2 * MiB, 0, 8 * MiB, 24 * MiB, 0, 40 * MiB, 1024]
    q = kids.ctx.Queue()
    for rank in (0, 1):
        kids.start(H.checking_reader, h, rank, seed, len(sizes), q)
    mq.wait_until_ready(timeout=30)
    for seq, nbytes in enumerate(sizes):
        mq.enqueue(H.make_msg(seed, seq, nbytes, H.VIEW_DTYPES[seq % 6]), timeout=30)
    reps = sorted((get(q) for _ in range(2)), key=lambda d: d["rank"])
    for rep in reps:
        assert rep["errors"] == [] and rep["count"] == len(sizes), rep
    assert reps[0]["stats"]["role"] == "local_reader"
    assert reps[1]["stats"]["role"] == "remote_reader"
    st = mq.stats()
    assert st["arena"]["hits"] >= 4, st["arena"]  # the 2, 8, 24 and 40 MiB tensors
    # The remote socket carried the tensor bytes themselves, not stubs alone.
    assert st["remote_bytes"] >= sum(sizes), st
    kids.join_all(10)


# ------------------------------------------------------------------------ 7. SIGKILL a reader
def test_sigkill_reader_holding_arena_tensors(seed, kids, writers, geometry):
    """Reader 2 keeps three arena tensors (3 of 4 slots) and is SIGKILLed. The writer and the
    other readers go on; the dead reader is dropped from the ring and its slots come back:
    later big tensors keep going through the arena."""
    geometry(4, 16)
    n_before, n_after = 3, 25
    n = n_before + n_after
    mq = MessageQueue(3, 3, enable_shm_tensor_arena=True)
    writers(mq)
    # The victim reports on its own queue: killed just after a put, it may still hold the
    # queue's write lock, which would block every other writer of a shared queue for good.
    q, q_victim = kids.ctx.Queue(), kids.ctx.Queue()
    procs = [
        kids.start(
            H.holding_reader,
            mq.export_handle(),
            rank,
            seed,
            n,
            q_victim if rank == 2 else q,
            rank == 2,
        )
        for rank in range(3)
    ]
    mq.wait_until_ready(timeout=30)
    for seq in range(n_before):
        mq.enqueue(H.make_msg(seed, seq, 12 * MiB), timeout=30)
    reps = [get(q) for _ in range(2 * n_before)] + [get(q_victim) for _ in range(n_before)]
    assert all(r["err"] is None for r in reps), reps
    mq.arena.reclaim()
    ar = arena_stats(mq)
    assert ar["hits"] == n_before and ar["holdings"][2]["slots_held"] == n_before, ar

    os.kill(procs[2].pid, signal.SIGKILL)
    procs[2].join(10)
    assert procs[2].exitcode == -signal.SIGKILL
    hits = [arena_stats(mq)["hits"]]
    t0 = time.monotonic()
    reps = []
    for seq in range(n_before, n):
        mq.enqueue(H.make_msg(seed, seq, 12 * MiB), timeout=30)
        hits.append(arena_stats(mq)["hits"])
        # In step with the live readers: one that lags holds slots of its own (a slow reader
        # is not a fault, and its arena would decline), which is not what this checks.
        reps += [get(q) for _ in range(2)]
    took = time.monotonic() - t0
    assert all(r["err"] is None for r in reps), [r for r in reps if r["err"]][:3]
    st = mq.stats()
    ar = st["arena"]
    print(
        f"\nafter SIGKILL: {n_after} messages in {took:.2f} s, dropped_readers "
        f"{st['dropped_readers']}, dead_readers {ar['dead_readers']}, hits {hits}, "
        f"declined {ar['declined']}"
    )
    assert st["dropped_readers"] >= 1 or ar["dead_readers"] >= 1, st
    assert ar["holdings"][2]["state"] == "dead", ar["holdings"]
    assert hits[-1] - hits[-11] == 10, f"the last 10 big tensors were not all arena hits: {hits}"
    kids.join_all(10)


# ------------------------------------------------------------------------ 8. SIGKILL all
@pytest.mark.parametrize("shm_dir", ["default", "private"])
def test_sigkill_everything_leaves_no_shm(seed, shm_dir, tmp_path):
    """Writer and two readers, all holding an arena tensor, SIGKILLed together after
    wait_until_ready: no shared-memory file is left, and nothing for the stale-name cleaner
    either (the names were unlinked at ready; the local ZeroMQ socket's path and its directory
    were removed then too). "private" runs in a fresh
    VLLM_SHM_ARENA_SHM_DIR so the before/after comparison is exact even while other tests use
    the session's dir; "default" checks the directory the package uses by default (the
    session's private one, set by conftest.py)."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(H.REPO), env.get("PYTHONPATH", "")])
    if shm_dir == "private":
        d = SHM / f"vsatest-mq-{os.getpid()}-{seed}"
        d.mkdir()
        env["VLLM_SHM_ARENA_SHM_DIR"] = str(d)
    else:
        d = SHM
    before = {p.name for p in d.iterdir() if p.name.startswith("vsa_")}
    p = subprocess.Popen(
        [sys.executable, str(Path(H.__file__)), "killall", str(seed)],
        cwd=H.REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    lines: list[str] = []
    ready = threading.Event()

    def pump():
        for ln in p.stdout:
            lines.append(ln.rstrip())
            if ln.startswith("READY"):
                ready.set()

    threading.Thread(target=pump, daemon=True).start()
    try:
        assert ready.wait(90), "scenario never got ready:\n" + "\n".join(lines)
        names = next(ln for ln in lines if ln.startswith("NAMES")).split()[1:]
        addr = next(ln for ln in lines if ln.startswith("ADDR")).split()[1]
        assert addr.startswith("ipc:///"), addr
        sock_path = Path(addr[len("ipc://") :])
        # The socket's name and its private directory went once the readers subscribed
        # (wait_until_ready): nothing is left for the cleaner. Whoever takes the name later
        # cannot feed a reader (every socket frame is sealed: tests/python/test_integrity.py).
        assert not sock_path.exists(), f"socket name left: {sock_path}"
        assert not sock_path.parent.exists(), f"socket directory left: {sock_path.parent}"
        os.killpg(p.pid, signal.SIGKILL)
        p.wait(10)
    finally:
        try:
            os.killpg(p.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        p.wait(10)

    def group_gone():
        try:
            os.killpg(p.pid, 0)
        except ProcessLookupError:
            return True
        return False

    H.wait_until(group_gone, 30, "every process of the group to be gone")  # then nothing more
    assert not sock_path.parent.exists(), "the socket directory was left for the cleaner"
    after = {p.name for p in d.iterdir() if p.name.startswith("vsa_")}
    try:
        assert len(names) == 2 and not [n for n in names if (d / n).exists()], names
        if shm_dir == "private":
            assert sorted(x.name for x in d.iterdir()) == [], "left in the shm dir"
        else:
            # Other processes may use /dev/shm too: only ours must be gone, and nothing of
            # ours (ring or arena of this run) may have appeared.
            assert not (after - before) & set(names)
    finally:
        if shm_dir == "private":
            for x in d.iterdir():
                x.unlink()
            d.rmdir()


# ------------------------------------------------------------------------ 9. fork + spawn
def test_spawn_and_fork_readers_byte_exact(seed, kids, writers, geometry):
    """Two forked and two spawned readers receive every tensor byte-exactly (full compare)
    through the arena."""
    geometry(4, 32)
    sizes = [(8 * MiB, "float32"), (20 * MiB, "bfloat16"), (2 * MiB, "int64"), (0, "int32")]
    sizes += [(12 * MiB, "uint8"), (31 * MiB, "float16")]
    mq = MessageQueue(4, 4, enable_shm_tensor_arena=True)
    writers(mq)
    h = mq.export_handle()
    q_fork = kids.ctx.Queue()
    spawn = multiprocessing.get_context("spawn")
    q_spawn = spawn.Queue()
    for rank in (0, 1):
        kids.start(H.full_checking_reader, h, rank, seed, len(sizes), q_fork)
    for rank in (2, 3):
        kids.start(H.full_checking_reader, h, rank, seed, len(sizes), q_spawn, ctx=spawn)
    mq.wait_until_ready(timeout=120)
    for seq, (nbytes, dt) in enumerate(sizes):
        mq.enqueue(H.make_msg(seed, seq, nbytes, dt, rows=2), timeout=60)
    reps = [get(q_fork, 120) for _ in range(2)] + [get(q_spawn, 120) for _ in range(2)]
    for rep in reps:
        assert rep["errors"] == [] and rep["count"] == len(sizes), rep
    assert arena_stats(mq)["hits"] == sum(1 for b, _ in sizes if b >= 8 * MiB)
    kids.join_all(30)


# ------------------------------------------------------------------------ 10. tensor-free
def _objects():
    return [
        None,
        0,
        -(2**70),
        3.25,
        float("inf"),
        "héllo" * 100,
        b"\x00\xff" * 1000,
        bytearray(b"abc"),
        (1, (2, (3,))),
        [1, [2, [3, {"k": {4, 5}}]]],
        {"a": 1, 2: "b", (3, 4): frozenset({5})},
        complex(1, -2),
        list(range(10_000)),
        {"big": b"z" * (3 * MiB)},  # larger than the 1 MiB chunk: overflow path
        H.small_payload(7, 7),
    ]


@pytest.mark.parametrize("arena", [False, True], ids=["arena_off", "arena_on"])
def test_tensor_free_messages_identical_with_and_without_arena(arena, writers, geometry):
    """Tensor-free messages come out equal to what went in, whether the arena is on or off,
    through enqueue/dequeue and broadcast_object; the arena is never touched."""
    geometry(1, 16)
    mq = MessageQueue(1, 1, max_chunk_bytes=1 * MiB, enable_shm_tensor_arena=arena)
    writers(mq)
    r = MessageQueue.create_from_handle(mq.export_handle(), 0)
    writers(r)
    ready_in_threads(mq, [r])
    got = []
    for obj in _objects():
        mq.enqueue(obj, timeout=10)
        got.append(r.dequeue(timeout=10))
    for obj, g in zip(_objects(), got, strict=True):
        assert type(g) is type(obj) and g == obj, (obj, g)
    for obj in _objects()[:5]:
        assert mq.broadcast_object(obj) is obj
        assert r.broadcast_object() == obj
    st = mq.stats()
    assert st["overflow_messages"] == 1
    if arena:
        ar = st["arena"]
        assert ar["hits"] == 0 and sum(ar["declined"].values()) == 0, ar
    else:
        assert "arena" not in st


# ------------------------------------------------------------------------ 11. in-place writes
def test_inplace_write_to_arena_tensor_is_visible_to_other_readers(seed, kids, writers, geometry):
    """Documented behaviour, asserted so a change is noticed: arena tensors are zero-copy
    views of one shared slot, so a reader that writes into one in place changes what every
    other reader sees (treat received tensors as read-only, or clone before mutating)."""
    geometry(2, 16)
    mq = MessageQueue(2, 2, enable_shm_tensor_arena=True)
    writers(mq)
    q, seen, mutated = kids.ctx.Queue(), kids.ctx.Event(), kids.ctx.Event()
    for rank in (0, 1):
        kids.start(H.inplace_reader, mq.export_handle(), rank, q, seen, mutated)
    mq.wait_until_ready(timeout=30)
    t = torch.arange(4 * MiB, dtype=torch.int32)  # 16 MiB
    mq.enqueue({"t": t}, timeout=30)
    assert arena_stats(mq)["hits"] == 1
    reps = {r["rank"]: r for r in (get(q), get(q))}
    assert "error" not in reps[0] and "error" not in reps[1], reps
    assert reps[1]["before"] == [0, 1, 2]
    assert reps[1]["after"] == [-7] * 100, "rank 0's in-place write is not visible to rank 1"
    assert torch.equal(t[:100], torch.arange(100, dtype=torch.int32)), "writer's copy changed"
    kids.join_all(10)
    gc.collect()


def test_a_join_with_a_bad_arena_handle_does_not_burn_the_rank():
    """create_from_handle with a handle naming a missing arena fails clearly; the same rank
    then joins with the right handle and receives messages."""
    import dataclasses

    mq = MessageQueue(1, 1, enable_shm_tensor_arena=True)
    good = mq.export_handle()
    bad_arena = dataclasses.replace(good.tensor_arena_handle, name="vsa_" + "0" * 32)
    with pytest.raises(OSError):
        MessageQueue.create_from_handle(dataclasses.replace(good, tensor_arena_handle=bad_arena), 0)
    r = MessageQueue.create_from_handle(good, 0)
    ready_in_threads(mq, [r])
    try:
        mq.enqueue({"t": torch.ones(4 << 20, dtype=torch.uint8)}, timeout=10)
        assert int(r.dequeue(timeout=10)["t"].sum()) == 4 << 20
    finally:
        mq.shutdown()
        r.shutdown()


@pytest.mark.parametrize("cede", [False, True])
def test_readers_cede_cpu_reaches_every_local_readers_ring(cede, writers):
    """``readers_cede_cpu`` travels in the handle to each local reader's ring wait (the wait
    itself: ring_test.cpp); off by default. Messages flow the same either way."""
    kwargs = {"readers_cede_cpu": True} if cede else {}
    mq = MessageQueue(2, 2, **kwargs)
    writers(mq)
    assert mq.export_handle().readers_cede_cpu is cede
    readers = [MessageQueue.create_from_handle(mq.export_handle(), r) for r in range(2)]
    for r in readers:
        writers(r)
    ready_in_threads(mq, readers)
    assert [r._end.ring.cede_cpu for r in readers] == [cede, cede]
    for i in range(3):
        mq.enqueue({"i": i}, timeout=10)
        assert [r.dequeue(timeout=10)["i"] for r in readers] == [i, i]
    assert all("ceded" in r._end.ring.wait_stats() for r in readers)
