"""The frame pool (csrc/core/frame_pool.h) as the queue uses it: socket frames of 1 MiB and
more are copied into warm buffers that are reused, the caller's memory is never aliased after
enqueue returns, and frames a reader copies out of the ring are pool buffers the tensors keep
alive. The pool's own bounds and fork handling are tests/cpp/frame_pool_test.cpp's."""

from __future__ import annotations

import gc

import torch
from mq_helpers import ready_in_threads, wait_until

from vllm_shm_arena import MessageQueue
from vllm_shm_arena._ext import _C

MiB = 1 << 20


def _queue(writers, **kw):
    mq = MessageQueue(1, 1, enable_shm_tensor_arena=False, **kw)
    writers(mq)
    r = MessageQueue.create_from_handle(mq.export_handle(), 0)
    writers(r)
    ready_in_threads(mq, [r])
    return mq, r


def test_overflow_frames_reuse_warm_buffers_and_never_alias_the_caller(writers):
    """Arena off, 4 MiB tensors over the local socket: after the first message every frame
    comes from a warm buffer (no new mapping), and overwriting the tensor right after enqueue
    returns never reaches the reader."""
    mq, r = _queue(writers, max_chunk_bytes=1 * MiB)
    t = torch.empty(4 * MiB, dtype=torch.uint8)
    in_use = _C.frame_pool_stats()["in_use_bytes"]
    start = None
    for k in range(6):
        t.fill_(k)
        mq.enqueue({"t": t, "k": k}, timeout=10)
        t.fill_(255)  # after enqueue returned: must not be what the reader sees
        got = r.dequeue(timeout=10)
        assert got["k"] == k
        assert int(got["t"].min()) == k == int(got["t"].max())
        del got
        # ZeroMQ's I/O thread gives the frame back once written, maybe after the reader has
        # the message: wait for it, so the next take finds it idle.
        wait_until(
            lambda: _C.frame_pool_stats()["in_use_bytes"] == in_use, 10, "the frame given back"
        )
        if k == 1:
            start = _C.frame_pool_stats()
    end = _C.frame_pool_stats()
    assert end["mapped"] == start["mapped"], (start, end)  # warm from the third message on
    assert end["warm_takes"] - start["warm_takes"] == 4, (start, end)  # the writer's frames
    assert mq.stats()["overflow_messages"] == 6


def test_a_ring_frame_copied_out_lives_as_long_as_its_tensor(writers):
    """A 2 MiB frame read from the ring is a pool buffer: the tensor rebuilt on it keeps it
    (in use) until the tensor dies, then it is idle for the next frame."""
    mq, r = _queue(writers, max_chunk_bytes=8 * MiB)
    mq.enqueue({"t": torch.full((2 * MiB,), 7, dtype=torch.uint8)}, timeout=10)
    got = r.dequeue(timeout=10)
    assert mq.stats()["ring_messages"] == 1
    held = _C.frame_pool_stats()["in_use_bytes"]
    assert held >= 2 * MiB
    assert int(got["t"].sum()) == 7 * 2 * MiB
    del got
    gc.collect()
    assert _C.frame_pool_stats()["in_use_bytes"] <= held - 2 * MiB


def test_no_idle_buffers_are_kept_when_the_bound_is_zero(writers):
    before = _C.frame_pool_stats()["max_idle_bytes"]
    _C.set_frame_pool_max_idle_bytes(0)
    try:
        mq, r = _queue(writers, max_chunk_bytes=1 * MiB)
        mq.enqueue({"t": torch.ones(3 * MiB, dtype=torch.uint8)}, timeout=10)
        assert int(r.dequeue(timeout=10)["t"].sum()) == 3 * MiB
        gc.collect()
        assert _C.frame_pool_stats()["idle_bytes"] == 0
    finally:
        _C.set_frame_pool_max_idle_bytes(before)
