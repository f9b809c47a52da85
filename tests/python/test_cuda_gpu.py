"""The arena on a real GPU: pinned slots, and event-gated release under a live async H2D, for
the queue's arena and for tensors forwarded from a frontend arena.

Skipped without CUDA. On the lent GPU machine, scripts/gpu_check.sh runs these.
"""

from __future__ import annotations

import time

import pytest
import torch
from mq_helpers import Frontend, queue_with_readers, shutdown_all

from vllm_shm_arena import ShmTensorArena

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

SIZE = 64 << 20
# GPU cycles to stall the stream before the H2D, so the DMA starts long after it is issued.
STALL_CYCLES = int(2e9)


@pytest.fixture(scope="module", autouse=True)
def cuda_context():
    torch.zeros(1, device="cuda")  # the arena pins only in a process that has a context
    yield


def _pair(num_slots=1):
    w = ShmTensorArena.create(1, num_slots=num_slots, slot_bytes=SIZE)
    r = ShmTensorArena.attach(w.handle(), 0)
    w.unlink()
    return w, r


def test_arena_tensors_are_pinned():
    w, r = _pair(num_slots=2)
    slot, gen = w.write(torch.ones(SIZE, dtype=torch.uint8))
    t = r.get_tensor(slot, SIZE, torch.uint8, (SIZE,), generation=gen)
    assert t.is_pinned()
    assert r.stats()["pinned_bytes"] >= SIZE
    g = t.to("cuda", non_blocking=True)
    torch.cuda.synchronize()
    assert int(g.sum()) == SIZE


def _expected_a():
    return torch.full((SIZE,), 0xA5, dtype=torch.uint8)


def test_overwrite_before_dma_is_detectable():
    # Control: with plain pinned memory and no gate, overwriting right after issuing the
    # async copy corrupts what the GPU receives. This is what the test below must catch.
    p = _expected_a().pin_memory()
    torch.cuda._sleep(STALL_CYCLES)
    g = p.to("cuda", non_blocking=True)
    p.fill_(0x5A)
    torch.cuda.synchronize()
    assert not torch.equal(g, _expected_a().cuda())


def test_slot_is_not_reused_while_its_dma_runs():
    w, r = _pair(num_slots=1)
    slot, gen = w.write(_expected_a())
    t = r.get_tensor(slot, SIZE, torch.uint8, (SIZE,), generation=gen)
    torch.cuda._sleep(STALL_CYCLES)  # the H2D below starts only after this kernel
    g = t.to("cuda", non_blocking=True)
    del t  # storage freed while the DMA has not even started
    declined = 0
    overwrite = torch.full((SIZE,), 0x5A, dtype=torch.uint8)
    deadline = time.monotonic() + 30
    while True:
        r.flush_releases()  # records the event on the current stream, then polls
        if w.write_tensor(overwrite) is not None:
            break
        declined += 1
        assert time.monotonic() < deadline, "slot never came back"
        time.sleep(0.001)
    torch.cuda.synchronize()
    assert declined > 0, "the writer got the slot back before the DMA could have finished"
    assert torch.equal(g, _expected_a().cuda()), "GPU received overwritten bytes"
    assert w.stats()["declined"]["no_free_slot"] == declined


def test_forwarded_tensors_are_pinned_and_their_slot_waits_for_every_workers_dma():
    fe = Frontend(2)
    w, rs = queue_with_readers()
    try:
        n = SIZE // 4
        t = fe.held(0x5A5A5A5A, n)
        assert not t.is_pinned()  # the engine core's view: nothing there flushes releases
        w.enqueue(t)
        got = [r.dequeue(timeout=10) for r in rs]
        assert all(g.is_pinned() for g in got)
        assert w.stats()["arena"]["hits"] == 0  # by reference, not copied
        torch.cuda._sleep(STALL_CYCLES)  # the H2Ds below start only after this kernel
        on_gpu = [g.to("cuda", non_blocking=True) for g in got]
        del t, got

        def tick():  # one message: each worker's dequeue records its event, then polls
            w.enqueue("tick")
            assert [r.dequeue(timeout=10) for r in rs] == ["tick", "tick"]

        tick()
        assert fe.in_use() == 1, "the frontend slot came back while the DMA had not started"
        torch.cuda.synchronize()
        tick()
        assert fe.in_use() == 0
        want = torch.full((n,), 0x5A5A5A5A, dtype=torch.int32, device="cuda")
        assert all(torch.equal(g, want) for g in on_gpu)
    finally:
        shutdown_all(w, rs)
        fe.close()
