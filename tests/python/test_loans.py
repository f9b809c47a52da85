"""Variable-size packing and loaned tensors (writer builds the tensor in the arena).

What these pin down: any size up to the whole region fits; a burst of many images needs no
fallback; a loaned tensor (or a contiguous view of it) is sent without a copy; the lifetime
rules documented on ShmTensorArena.empty hold.
"""

from __future__ import annotations

import gc
import pickle
import time

import pytest
import torch

from vllm_shm_arena import ShmTensorArena, dumps, loads
from vllm_shm_arena.pickler import dump_message

MiB = 1 << 20


@pytest.fixture
def varena():
    """A 64 MiB variable-size arena with one attached reader."""
    w = ShmTensorArena.create(1, policy="variable", arena_bytes=64 * MiB, max_allocations=64)
    r = ShmTensorArena.attach(w.handle(), 0)
    w.unlink()
    yield w, r
    w.close()
    r.close()


def _bytes(t):
    return t.detach().reshape(-1).view(torch.uint8)


def _settle(w, r, timeout=10.0):
    """Lets freed slots go back: in a process with a CUDA context the reader pins, and a slot
    is released only by a flush_releases() that finds its event complete."""
    deadline = time.monotonic() + timeout
    r.flush_releases()
    while r.stats()["pending_releases"] and time.monotonic() < deadline:
        time.sleep(0.001)
        r.flush_releases()
    w.reclaim()


def test_burst_of_many_tensors_needs_no_fallback(varena):
    w, _ = varena
    ts = [torch.full((2 * MiB,), i, dtype=torch.float32) for i in range(7)]  # 7 x 8 MiB
    out = loads(*dumps(ts, w))
    assert [int(t[0]) for t in out] == list(range(7))
    s = w.stats()
    assert s["hits"] == 7
    assert sum(s["declined"].values()) == 0


def test_a_tensor_as_large_as_the_region_fits(varena):
    w, r = varena
    t = torch.arange(16 * MiB, dtype=torch.int32)  # 64 MiB
    got = loads(*dumps({"x": t}, w))["x"]
    assert torch.equal(got, t)
    assert w.stats()["hits"] == 1
    assert w.stats()["free_bytes"] == 0
    del got
    _settle(w, r)
    assert w.stats()["largest_free"] == 64 * MiB


def test_record_bound_is_a_counted_decline():
    w = ShmTensorArena.create(1, policy="variable", arena_bytes=64 * MiB, max_allocations=2)
    r = ShmTensorArena.attach(w.handle(), 0)
    try:
        out = loads(*dumps([torch.ones(2 * MiB) for _ in range(3)], w))
        assert all(int(t.sum()) == 2 * MiB for t in out)
        assert w.stats()["hits"] == 2
        assert w.stats()["declined"]["no_record"] == 1
    finally:
        w.close()
        r.close()


def test_loaned_tensor_is_sent_without_a_copy(varena):
    w, r = varena
    t = w.empty((4, MiB), torch.float32)
    assert t is not None
    t.copy_(torch.arange(4 * MiB, dtype=torch.float32).view(4, MiB))
    data, bufs = dumps({"pixels": t}, w)
    assert bufs == []
    assert len(data) < 300  # a stub, not 16 MiB
    s = w.stats()
    assert (s["loans"], s["loans_sent"], s["hits"]) == (1, 1, 1)
    assert s["cold_bytes"] + s["warm_bytes"] == 16 * MiB  # counted, but nothing was copied
    got = loads(data, bufs)["pixels"]
    assert torch.equal(got, t)


def test_small_loaned_tensor_is_still_sent_as_a_loan(varena):
    w, _ = varena
    t = w.empty((16,), torch.int64)  # far below the 8 MiB divert threshold
    t.fill_(3)
    got = loads(*dumps(t, w))
    assert torch.equal(got, t)
    assert w.stats()["loans_sent"] == 1


def test_contiguous_view_of_a_loan_is_sent_with_its_offset(varena):
    w, _ = varena
    t = w.empty((8, MiB), torch.uint8)
    for i in range(8):
        t[i].fill_(i)
    view = t[3:6]  # contiguous, starts 3 MiB in
    got = loads(*dumps(view, w))
    assert got.shape == (3, MiB)
    assert [int(row[0]) for row in got] == [3, 4, 5]
    assert w.stats()["loans_sent"] == 1


def test_sending_a_loan_twice_copies_the_second_time(varena):
    w, _ = varena
    t = w.empty((2 * MiB,), torch.float32)
    t.fill_(1.0)
    first = loads(*dumps(t, w))
    second = loads(*dumps(t, w))
    s = w.stats()
    assert s["loans_sent"] == 1
    assert s["hits"] == 2  # the second send went through a copy into a new allocation
    assert torch.equal(first, second)
    # The copy is independent of the loan: writing the loan changes only the first.
    t.fill_(2.0)
    assert float(first[0]) == 2.0
    assert float(second[0]) == 1.0


def test_writing_a_loan_after_sending_is_seen_by_readers_that_hold_it(varena):
    w, _ = varena
    t = w.empty((MiB,), torch.int32)
    t.zero_()
    got = loads(*dumps(t, w))
    t[0] = 42  # documented: the send shares memory; later writes are visible
    assert int(got[0]) == 42


def test_dropping_an_unsent_loan_gives_its_space_back(varena):
    w, _ = varena
    t = w.empty((16 * MiB,), torch.int32)  # the whole region
    assert w.empty((1,), torch.int32) is None  # nothing left to lend
    del t
    gc.collect()
    assert w.stats()["loans_returned"] == 1
    again = w.empty((16 * MiB,), torch.int32)
    assert again is not None


def test_sent_loan_space_returns_after_readers_and_writer_let_go(varena):
    w, r = varena
    t = w.empty((16 * MiB,), torch.int32)
    got = loads(*dumps(t, w))
    del got
    _settle(w, r)
    assert w.stats()["in_use"] == 1  # readers let go, the writer's view is still alive
    del t
    _settle(w, r)
    assert w.stats()["in_use"] == 0
    assert w.stats()["largest_free"] == 64 * MiB


def test_failed_dump_keeps_the_loan_sendable(varena):
    w, _ = varena
    t = w.empty((MiB,), torch.float32)
    t.fill_(5.0)
    with pytest.raises((pickle.PicklingError, AttributeError, TypeError)):
        dump_message([t, lambda: 0], w)
    assert w.stats()["loans_sent"] == 0
    got = loads(*dumps(t, w))
    assert float(got[0]) == 5.0
    assert w.stats()["loans_sent"] == 1


def test_empty_declines_when_the_arena_cannot_lend(varena):
    w, _ = varena
    assert w.empty((65 * MiB,), torch.uint8) is None
    with pytest.raises(ValueError):
        w.empty((-1,), torch.uint8)


def test_reader_cannot_lend(varena):
    _, r = varena
    with pytest.raises(RuntimeError):
        r.empty((4,), torch.uint8)
