"""Counted arenas from Python (ShmTensorArena.create(..., counted=True)).

What these pin down: a loan sent many times to reader 0 and forwarded by it comes back exactly
when every tensor built from those sends is gone in every process; a failed send or forward is
taken back; the counts are kept by stub, not by view (a queue message's frame-0 hold counts its
stub once, its tensors are views under it); a handle that says counted attaches only to a
counted arena; the C++ rules surface as Python errors.
"""

from __future__ import annotations

import gc
import multiprocessing as mp

import pytest
import torch

from vllm_shm_arena import ShmTensorArena
from vllm_shm_arena.arena import ArenaHandle

MiB = 1 << 20


def _arena(n_readers: int):
    return ShmTensorArena.create(
        n_readers, policy="variable", arena_bytes=16 * MiB, max_allocations=16, counted=True
    )


def _in_use(w) -> int:
    w.reclaim(check_liveness=False)
    return w.stats(holdings=False)["in_use"]


def _loan(w, n=1 << 20, value=7):
    t = w.empty([n], torch.uint8)
    assert t is not None
    t.fill_(value)
    return t


def test_sent_three_times_forwarded_twice_freed_when_every_view_is_gone():
    w = _arena(3)
    r0, r1, r2 = (ShmTensorArena.attach(w.handle(), k) for k in range(3))
    assert w.handle().counted and r0.handle().counted
    t = _loan(w)
    sends = [w.send_loan(t) for _ in range(3)]
    assert all(s is not None for s in sends)
    slot, gen, off = sends[0]
    assert off == 0 and all(s[:2] == (slot, gen) for s in sends)
    del t
    gc.collect()
    assert w.stats(holdings=False)["sends"] == 3
    held = [r0.get_tensor(slot, 1 << 20, torch.uint8, [1 << 20], generation=gen) for _ in range(3)]
    assert all(int(x[-1]) == 7 for x in held)
    assert r0.find_hold(held[0][4096:]) == (slot, gen, 4096, 1 << 20)
    r0.forward(slot, gen)
    r0.forward(slot, gen)
    views = [r.get_tensor(slot, 1 << 20, torch.uint8, [1 << 20], generation=gen) for r in (r1, r2)]
    views += [r.get_tensor(slot, 1 << 20, torch.uint8, [1 << 20], generation=gen) for r in (r1, r2)]
    holdings = w.stats()["holdings"]
    assert [h["owed"] for h in holdings] == [3, 2, 2]
    del views
    gc.collect()
    assert _in_use(w) == 1  # reader 0 still holds its three
    held.pop()
    gc.collect()
    assert _in_use(w) == 1
    del held
    gc.collect()
    assert _in_use(w) == 0
    for r in (r0, r1, r2):
        r.close()
    w.close()


def test_failed_send_and_failed_forward_are_taken_back():
    w = _arena(2)
    r0 = ShmTensorArena.attach(w.handle(), 0)
    r1 = ShmTensorArena.attach(w.handle(), 1)
    t = _loan(w)
    slot, gen, _ = w.send_loan(t)
    w.send_loan(t)
    w.unsend(slot, gen)  # the second message did not go
    x = r0.get_tensor(slot, 1 << 20, torch.uint8, [1 << 20], generation=gen)
    r0.forward(slot, gen)
    r0.unforward(slot, gen)  # nor did the forward
    with pytest.raises(ValueError):
        r0.unforward(slot, gen)
    with pytest.raises(ValueError):
        r1.forward(slot, gen)  # only reader 0 forwards
    del t, x
    gc.collect()
    assert _in_use(w) == 0  # nothing owed by reader 1: no forward went
    with pytest.raises(ValueError):
        w.unsend(slot, gen)
    for r in (r0, r1):
        r.close()
    w.close()


def test_views_under_a_hold_count_its_stub_once():
    w = _arena(1)
    r0 = ShmTensorArena.attach(w.handle(), 0)
    t = _loan(w)
    slot, gen, _ = w.send_loan(t)
    del t
    with pytest.raises(ValueError):  # a view counting no stub needs a hold that counted one
        r0.get_tensor(slot, 4096, torch.uint8, [4096], generation=gen, stubs=0)
    holds = r0.hold_slots([(slot, gen)])  # a queue message's frame 0
    a = r0.rebuild_stub(slot, gen, 4096, "uint8", [4096])
    b = r0.rebuild_stub(slot, gen, 4096, "uint8", [4096], 4096)
    del holds, a
    gc.collect()
    assert _in_use(w) == 1
    del b
    gc.collect()
    assert _in_use(w) == 0  # one stub sent, one acked
    r0.close()
    w.close()


def test_a_handle_must_say_counted_for_a_counted_arena():
    w = _arena(2)
    h = w.handle()
    wrong = ArenaHandle(h.name, h.n_readers, h.num_slots, h.slot_bytes, h.dir, h.policy)
    with pytest.raises(ValueError, match="counted"):
        ShmTensorArena.attach(wrong, 0)
    r = ShmTensorArena.attach(h, 0)  # the refused attach left the rank free
    r.close()
    del r
    gc.collect()
    with pytest.raises(ValueError, match="attach once"):
        ShmTensorArena.attach(h, 0)
    w.close()


def test_an_accept_once_arena_sends_a_loan_once():
    w = ShmTensorArena.create(1, policy="variable", arena_bytes=16 * MiB, max_allocations=16)
    t = _loan(w)
    slot, gen, _ = w.send_loan(t)
    assert w.send_loan(t) is None
    with pytest.raises(ValueError):
        w.unsend(slot, gen)
    del t
    w.close()


def _worker(handle, rank, slot, gen, conn):
    r = ShmTensorArena.attach(handle, rank)
    x = r.get_tensor(slot, 1 << 20, torch.uint8, [1 << 20], generation=gen)
    conn.send(int(x.sum()))
    conn.recv()  # hold until told
    del x
    conn.send("released")
    conn.recv()
    r.close()


def test_a_worker_process_holds_the_slot_until_its_tensor_dies():
    w = _arena(2)
    r0 = ShmTensorArena.attach(w.handle(), 0)
    t = _loan(w, value=3)
    slot, gen, _ = w.send_loan(t)
    del t
    x = r0.get_tensor(slot, 1 << 20, torch.uint8, [1 << 20], generation=gen)
    r0.forward(slot, gen)
    ctx = mp.get_context("spawn")
    a, b = ctx.Pipe()
    p = ctx.Process(target=_worker, args=(w.handle(), 1, slot, gen, b))
    p.start()
    try:
        assert a.recv() == 3 * (1 << 20)
        del x
        gc.collect()
        assert _in_use(w) == 1  # the worker, alive and attached, still holds it
        a.send("go")
        assert a.recv() == "released"
        assert _in_use(w) == 0
        a.send("exit")
    finally:
        p.join(30)
    assert p.exitcode == 0
    r0.close()
    w.close()
