"""Forwarding: a tensor the queue's writer holds from a frontend arena (its reader 0, named by
``arena.set_forward_source``: vLLM's engine core resolving the API server's stubs) goes to the
queue's readers as a forward stub, by reference, never copied into the queue's arena; each
reader resolves it in the frontend arena (rank 1 + its index). The frontend slot is free only
once the writer's hold and every reader's tensors are gone; a reader that fails to unpickle
acks what the message forwarded; a message that did not go takes its forwards back; a queue
whose readers are not the frontend arena's workers, or a worker that is not attached, gets
the tensor copied as before. Interrupts at every bytecode: test_interrupts.py (kind
"forward"). Multi-process tests print their seed.
"""

from __future__ import annotations

import ctypes
import multiprocessing
import random
import types

import pytest
import torch
from mq_helpers import (
    FORWARD_N,
    Boom,
    Frontend,
    Kids,
    queue_with_readers,
    ready_in_threads,
    shutdown_all,
    wait_until,
)

from vllm_shm_arena import MessageQueue
from vllm_shm_arena import arena as arena_mod
from vllm_shm_arena.mq import protocol

N = FORWARD_N


@pytest.fixture
def fe():
    f = Frontend(2)
    yield f
    f.close()


@pytest.fixture(params=["unpinned", "pinned"])
def workers(request, monkeypatch):
    """The readers as CPU workers, and as workers with a CUDA context (the fake runtime
    standing in), whose tensors are pinned and whose slots come back at a flush after their
    CUDA event (``freed``): on a GPU host the first kind is the second too."""
    if request.param == "pinned":
        request.getfixturevalue("fake")
        request.getfixturevalue("context")
        # The fake only records the stream; its events complete at once.
        stream = types.SimpleNamespace(cuda_stream=0x5EED, synchronize=lambda: None)
        monkeypatch.setattr(torch.cuda, "current_stream", lambda: stream)
    return request.param


def test_a_held_tensor_goes_by_reference_and_frees_once_everyone_let_go(workers, fe):
    w, rs = queue_with_readers()
    try:
        assert w.export_handle().frontend_arena_handle is not None
        assert arena_mod.take_forward_source() is None  # the queue took it
        t = fe.held(5)
        w.enqueue({"t": t, "small": torch.ones(4)})
        got = [r.dequeue(timeout=10)["t"] for r in rs]
        assert all(torch.equal(g, torch.full((N,), 5, dtype=torch.int32)) for g in got)
        assert w.stats()["arena"]["hits"] == 0  # not copied into the queue's arena
        t[0] = -1  # the same pages everywhere: zero-copy
        assert [int(g[0]) for g in got] == [-1, -1]
        assert fe.owed(1) == 1 and fe.owed(2) == 1
        del t
        assert fe.in_use() == 1  # the workers still hold it
        got.pop()
        assert fe.in_use() == 1
        del got
        assert freed(fe, rs) == 0
        # A slice of a held tensor goes by reference too, at its offset.
        t = fe.held(8)
        t[N // 2 :] = 9
        w.enqueue(t[N // 2 + 3 :])
        got = [r.dequeue(timeout=10) for r in rs]
        assert all(g.numel() == N // 2 - 3 and bool((g == 9).all()) for g in got)
        assert w.stats()["arena"]["hits"] == 0
        del t, got
        assert freed(fe, rs) == 0
        # A repeat of the same item: one more forward, owed and acked again.
        t = fe.held(6)
        for _ in range(3):
            w.enqueue(t)
        outs = [r.dequeue(timeout=10) for r in rs for _ in range(3)]
        assert fe.owed(1) == 3 and fe.owed(2) == 3
        assert w.stats()["arena"]["forwarded"] == 5  # messages that went, one tensor each
        del t, outs
        assert freed(fe, rs) == 0
    finally:
        shutdown_all(w, rs)


def freed(fe: Frontend, rs, want: int = 0) -> int:
    """``fe.in_use()`` once the readers' gated releases have had their flushes: in a process
    with a CUDA context (on a GPU host test_cuda_gpu.py makes one first) their tensors are
    pinned, so a slot comes back only at a flush after its CUDA event, as each ``dequeue``
    does; without one, releases happen at free and this is ``fe.in_use()`` at once."""
    if torch.cuda.is_initialized():
        torch.cuda.synchronize()

    def flushed() -> bool:
        for r in rs:
            front = r._end.frontend
            if front is not None and front.needs_flush:
                front.flush_releases()
        return fe.in_use() == want

    wait_until(flushed, 10, f"{want} frontend slots in use")
    return fe.in_use()


def _registered(fake, t: torch.Tensor) -> bool:
    return fake.fake_cudart_is_registered(ctypes.c_void_p(t.data_ptr()), t.nbytes) == 1


def test_a_pinned_worker_frees_a_forwarded_slot_only_after_its_copy_to_the_gpu(
    fake, context, fe, monkeypatch
):
    # Workers with a CUDA context (forced; the fake runtime stands in for CUDA, and
    # test_cuda_gpu.py does the same on a real GPU): a forwarded tensor is a pinned view of
    # the frontend arena's pages, and its slot comes back only once the event each worker
    # recorded after its H2D has completed, the record and the poll done by dequeue.
    fake.fake_cudart_hold_events(1)
    stream = types.SimpleNamespace(cuda_stream=0x5EED)  # the fake only records it
    monkeypatch.setattr(torch.cuda, "current_stream", lambda: stream)
    w, rs = queue_with_readers()
    try:
        t = fe.held(4)
        w.enqueue(t)
        got = [r.dequeue(timeout=10) for r in rs]
        assert all(_registered(fake, g) and int(g[7]) == 4 for g in got)
        assert w.stats()["arena"]["hits"] == 0
        del t, got

        def tick() -> None:  # one message: each worker's dequeue flushes its releases
            w.enqueue("tick")
            assert [r.dequeue(timeout=10) for r in rs] == ["tick", "tick"]

        tick()
        assert fe.in_use() == 1, "a forwarded slot came back before its copy to the GPU ended"
        fake.fake_cudart_complete_all()
        tick()
        assert fe.in_use() == 0
    finally:
        shutdown_all(w, rs)


def test_the_engine_cores_tensors_are_unpinned_even_with_a_cuda_context(fake, context, fe):
    # Nothing in the engine core flushes its frontend reader's gated releases: a pinned
    # tensor there (a CUDA context in the engine core: an in-process executor) would keep
    # its slot for good.
    t = fe.held(3)
    assert not _registered(fake, t)
    del t
    assert fe.in_use() == 0


def test_a_worker_whose_last_tensor_died_after_its_last_dequeue_owes_nothing_once_closed(
    workers, fe
):
    # Pinned, a dead tensor's slot comes back at the next flush, which each dequeue does; a
    # queue shut down before another dequeue makes that flush itself (waiting for the copy),
    # or the worker's rank would stay attached, owing, until its process exits.
    w, rs = queue_with_readers()
    try:
        t = fe.held(3)
        w.enqueue({"t": t})
        got = [r.dequeue(timeout=10)["t"] for r in rs]
        del t, got  # after the last dequeue
    finally:
        shutdown_all(w, rs)
    assert fe.in_use() == 0


def test_a_message_that_fails_to_unpickle_acks_its_forwards(workers, fe):
    w, rs = queue_with_readers()
    try:
        t = fe.held(1)
        w.enqueue([t, Boom()])
        for r in rs:
            with pytest.raises(ValueError, match="on purpose"):
                r.dequeue(timeout=10)
        del t
        assert freed(fe, rs) == 0  # acked by both readers: nothing owed
        t = fe.held(2)
        w.enqueue({"t": t})  # the queue goes on
        assert all(int(r.dequeue(timeout=10)["t"][0]) == 2 for r in rs)
    finally:
        shutdown_all(w, rs)


def test_a_message_that_did_not_go_takes_its_forwards_back(fe):
    w, rs = queue_with_readers(max_chunks=1)
    try:
        w.enqueue("fills the only chunk")
        t = fe.held(3)
        with pytest.raises(TimeoutError):
            w.enqueue({"t": t}, timeout=0.2)  # not sent: no worker owes its forward
        assert fe.owed(1) == 0 and fe.owed(2) == 0
        assert w.stats()["arena"]["forwarded"] == 0  # counted only when a message went
        del t
        assert fe.in_use() == 0
        assert [r.dequeue(timeout=10) for r in rs] == ["fills the only chunk"] * 2
    finally:
        shutdown_all(w, rs)


def test_a_worker_not_attached_gets_the_tensor_copied(fe):
    w, rs = queue_with_readers()
    try:
        rs[1]._end.frontend.close()  # detached: the writer forwards no more
        t = fe.held(4)
        w.enqueue({"t": t})
        outs = [r.dequeue(timeout=10)["t"] for r in rs]
        assert all(torch.equal(o, t) for o in outs)
        assert w.stats()["arena"]["hits"] == 1  # copied into the queue's arena, as before
        t[0] = -1
        assert [int(o[0]) for o in outs] == [4, 4]  # copies
        del t, outs
        assert fe.in_use() == 0
    finally:
        shutdown_all(w, rs)


def test_only_a_queue_of_the_frontend_arenas_workers_forwards(fe):
    # Another shape first (one reader, not the arena's two workers): copies, leaves the source.
    other = MessageQueue(1, 1, enable_shm_tensor_arena=True)
    no_arena = MessageQueue(2, 2)
    try:
        assert other.export_handle().frontend_arena_handle is None
        assert no_arena.export_handle().frontend_arena_handle is None
        w, rs = queue_with_readers()
        try:
            assert w.export_handle().frontend_arena_handle is not None
            # Taken once: a second queue of the same shape does not forward.
            again = MessageQueue(2, 2, enable_shm_tensor_arena=True)
            assert again.export_handle().frontend_arena_handle is None
            again.shutdown()
        finally:
            shutdown_all(w, rs)
    finally:
        other.shutdown()
        no_arena.shutdown()


def test_a_reader_without_the_frontend_arena_refuses_a_forward_clearly(workers, fe):
    w, rs = queue_with_readers()
    try:
        front = rs[0]._end.frontend
        rs[0]._end.frontend = None  # as if its attach had failed, while the writer forwards
        t = fe.held(7)
        w.enqueue({"t": t})
        with pytest.raises(RuntimeError, match="frontend arena this reader has not attached"):
            rs[0].dequeue(timeout=10)
        assert int(rs[1].dequeue(timeout=10)["t"][0]) == 7
        rs[0]._end.frontend = front
        front.release_unacquired(*t_pair(fe, t))  # what the reader owed (it could not ack)
        del t
        assert freed(fe, rs) == 0
    finally:
        shutdown_all(w, rs)


def t_pair(fe: Frontend, t: torch.Tensor) -> tuple[int, int]:
    slot, gen, _off, _n = fe.provider.reader._reader.find_hold(t)
    return slot, gen


# ------------------------------------------------------------------ workers in processes
def _worker(handle, rank, seed, n, boom_at, q):
    """Dequeues ``n`` messages: message k is ``{"k", "v", "t"}`` with ``t`` filled with v, or
    ``[t, Boom()]`` at ``boom_at`` (must raise). Keeps a random few tensors a while."""
    torch.set_num_threads(1)
    rng = random.Random(seed * 31 + rank)
    kept, errors = [], []
    try:
        r = MessageQueue.create_from_handle(handle, rank)
        r.wait_until_ready(timeout=60)
        for k in range(n):
            if k in boom_at:
                try:
                    r.dequeue(timeout=60)
                    errors.append(f"message {k} unpickled")
                except ValueError:
                    pass
                continue
            m = r.dequeue(timeout=60)
            v = m["v"]
            if m["k"] != k or int(m["t"][0]) != v or int(m["t"][-1]) != v:
                errors.append(f"message {k}: got {m['k']}, {int(m['t'][0])} for {v}")
            if rng.random() < 0.3:
                kept.append(m["t"])
            if len(kept) > 4:
                kept.pop(0)
        st = r.stats()
        q.put({"rank": rank, "errors": errors, "fe": "frontend" in st})
        kept.clear()
        r.shutdown()
    except BaseException as e:  # report instead of dying silently
        q.put({"rank": rank, "errors": errors + [f"{type(e).__name__}: {e}"]})


def test_workers_in_their_own_processes_resolve_forwards_and_free_every_slot(seed):
    print(f"seed={seed}")
    rng = random.Random(seed)
    n = 40
    boom_at = set(rng.sample(range(n), 4))
    fe = Frontend(2)
    w = MessageQueue(2, 2, enable_shm_tensor_arena=True)
    kids = Kids("fork")
    q = multiprocessing.get_context("fork").Queue()
    try:
        for rank in range(2):
            kids.start(_worker, w.export_handle(), rank, seed, n, boom_at, q)
        w.wait_until_ready(timeout=60)
        items = [fe.held(v) for v in range(8)]  # a cache of 8 items: hits forward again
        for k in range(n):
            v = k % 8 if rng.random() < 0.5 else 100 + k
            t = items[v] if v < 8 else fe.held(v)
            w.enqueue([t, Boom()] if k in boom_at else {"k": k, "v": v, "t": t}, timeout=60)
            del t
        reports = sorted((q.get(timeout=120) for _ in range(2)), key=lambda d: d["rank"])
        kids.join_all(60)
        for rep in reports:
            assert not rep["errors"], rep
            assert rep["fe"]  # the worker attached the frontend arena
        assert w.stats()["arena"]["hits"] == 0  # every tensor was forwarded
        del items
        wait_until(lambda: fe.in_use() == 0, 10, "every frontend slot to come back")
    finally:
        kids.kill_all()
        w.shutdown()
        fe.close()


def test_a_forward_stub_is_listed_in_frame_0():
    fe = Frontend(1)
    w, rs = queue_with_readers(1)
    try:
        t = fe.held(9)
        d = arena_mod  # the pickler with the queue's arena and its forward source
        from vllm_shm_arena.pickler import dump_message

        fwd: list = []
        out = dump_message({"t": t}, w.arena, [], fwd)
        assert out.forwarded == fwd == [t_pair(fe, t)] and out.diverted == []
        assert len(out.data) < 400  # a stub, not the 2 MiB
        head = protocol.diverted_header(out.diverted, out.forwarded)
        assert protocol.parse_header(head) == ([], fwd)
        w.arena.take_back_forwards(fwd)  # never sent
        assert fwd == [] and d is arena_mod
        w.arena.take_back_forwards(fwd)  # nothing twice
        del t
        assert fe.in_use() == 0
    finally:
        shutdown_all(w, rs)
        fe.close()


def test_a_join_that_fails_leaves_the_frontend_rank_for_its_retry(fe):
    import dataclasses

    w = MessageQueue(2, 2, enable_shm_tensor_arena=True)
    rs = []
    try:
        h = w.export_handle()
        name, shm_dir = h.buffer_handle
        bad = dataclasses.replace(h, buffer_handle=(name + "x", shm_dir))  # no such ring
        with pytest.raises(Exception):  # noqa: B017  (whatever the ring's attach raises)
            MessageQueue.create_from_handle(bad, 0)
        # A counted arena's rank attaches once for good: the failed join never took it.
        assert fe.writer.arena.reader_state(1) == "never_attached"
        rs = [MessageQueue.create_from_handle(h, i) for i in range(2)]
        ready_in_threads(w, rs)
        t = fe.held(3)
        w.enqueue({"t": t})
        assert all(int(r.dequeue(timeout=10)["t"][0]) == 3 for r in rs)
        assert w.stats()["arena"]["forwarded"] == 1
    finally:
        shutdown_all(w, rs)


def test_each_rank_reports_the_frontend_arena_under_its_own_label(fe, monkeypatch):
    """A worker's report covers both arenas it reads: the queue's as ``arena="queue"``, the
    frontend arena's (what it holds of the forwarded tensors, the stubs it acked) as
    ``arena="frontend"``; the writer's covers its rank 0 of the frontend arena (the engine
    core's holds and acks)."""
    from vllm_shm_arena.mq import reporting

    got = []
    monkeypatch.setattr(
        reporting.metrics, "record_reader_stats", lambda s, key, arena: got.append((arena, s))
    )
    monkeypatch.setattr(reporting.metrics, "record_writer_stats", lambda *a, **k: None)

    def report(end) -> dict:
        got.clear()
        end.report()
        return {(arena, s["rank"]): (s["held"], s["acked"]) for arena, s in got}

    w, rs = queue_with_readers()
    try:
        t = fe.held(5)
        w.enqueue({"t": t})
        kept = rs[0].dequeue(timeout=10)["t"]
        rs[1].dequeue(timeout=10)
        assert report(rs[0]._end) == {("queue", 0): (0, 0), ("frontend", 1): (1, 0)}
        del kept
        freed(fe, rs, want=1)  # rank 0 (this process, ``t``) still holds it
        assert report(rs[0]._end)[("frontend", 1)] == (0, 1)
        assert report(w._end) == {("frontend", 0): (1, 0)}
        del t
        freed(fe, rs)
        assert report(w._end) == {("frontend", 0): (0, 1)}
    finally:
        shutdown_all(w, rs)
