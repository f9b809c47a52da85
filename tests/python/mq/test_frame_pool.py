"""Large frames: the frame pool (csrc/core/frame_pool.h) as the queue uses it (socket frames
of 1 MiB and more are copied into warm buffers that are reused, the caller's memory is never
aliased after enqueue returns, frames a reader copies out of the ring are pool buffers the
tensors keep alive), and buffers above protocol.SOCKET_SPLIT_ABOVE sent in parts and joined.
The pool's own bounds and fork handling are tests/cpp/frame_pool_test.cpp's."""

from __future__ import annotations

import gc
import struct

import pytest
import torch
from mq_helpers import ready_in_threads, wait_until

from vllm_shm_arena import MessageQueue
from vllm_shm_arena._ext import _C
from vllm_shm_arena.mq import protocol

MiB = 1 << 20


def _queue(writers, **kw):
    mq = MessageQueue(1, 1, enable_shm_tensor_arena=False, **kw)
    writers(mq)
    r = MessageQueue.create_from_handle(mq.export_handle(), 0)
    writers(r)
    ready_in_threads(mq, [r])
    return mq, r


def test_overflow_frames_reuse_warm_buffers_and_never_alias_the_caller(writers, socket_overflow):
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


def test_no_idle_buffers_are_kept_when_the_bound_is_zero(writers, socket_overflow):
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


# ------------------------------------------------------------------ buffers split on the wire
def _wire(frames: list) -> list:
    """``frames`` (frame 0 sealed) as send_frames puts them on a socket."""
    out = list(frames[:2])
    for f in frames[2:]:
        n = memoryview(f).nbytes
        if protocol.parts_of(n) == 1:
            out.append(f)
            continue
        mv = memoryview(f)
        out += [
            mv[o : o + protocol.SOCKET_PART_BYTES] for o in range(0, n, protocol.SOCKET_PART_BYTES)
        ]
    return out


def test_a_buffer_above_the_split_size_is_sent_in_parts_and_joined():
    keys = protocol.Keys(b"s" * protocol.SECRET_BYTES)
    big = bytes(range(256)) * ((protocol.SOCKET_SPLIT_ABOVE + 5 * MiB) // 256)
    small = b"x" * MiB
    frames = [b"", b"pickle", small, big, small]
    sealed = [protocol.seal(keys.mac_key, 9, frames), *frames[1:]]
    wire = _wire(sealed)
    assert len(wire) == len(frames) + protocol.parts_of(len(big)) - 1
    seq, got = protocol.unseal(keys.mac_key, wire)
    assert seq == 9
    assert [bytes(g) for g in got] == [b"", b"pickle", small, big, small]


def test_a_split_table_that_does_not_match_the_frames_is_refused_not_trusted():
    """Sealed with the right key (only the writer could), but naming more parts than came:
    Forged, never an IndexError or a short buffer."""
    keys = protocol.Keys(b"s" * protocol.SECRET_BYTES)
    table = struct.pack("<I", 1) + struct.pack("<II", 2, 9)  # frame 2 in 9 parts
    head = protocol.SEQ.pack(1) + table
    wire = [b"", b"pickle", b"a" * 10, b"b" * 10]
    mac = protocol._mac(keys.mac_key, b"vsa-message", head, struct.pack("<I", 4), wire[1])
    wire[0] = mac + head
    with pytest.raises(protocol.Forged, match="split table"):
        protocol.unseal(keys.mac_key, wire)


@pytest.mark.parametrize("remote", [False, True], ids=["local socket", "tcp"])
def test_a_tensor_above_the_split_size_arrives_whole(writers, remote, socket_overflow):
    """Arena off, 40 MiB: split on the wire, joined by the reader, every byte checked."""
    n_local = 0 if remote else 1
    mq = MessageQueue(
        1, n_local, list(range(n_local)), connect_ip="127.0.0.1", enable_shm_tensor_arena=False
    )
    writers(mq)
    r = MessageQueue.create_from_handle(mq.export_handle(), 0)
    writers(r)
    ready_in_threads(mq, [r])
    t = torch.arange(10 * MiB, dtype=torch.int32)  # 40 MiB, every word distinct
    for k in range(3):
        mq.enqueue({"t": t + k, "k": k}, timeout=30)
        got = r.dequeue(timeout=30)
        assert got["k"] == k
        assert torch.equal(got["t"], t + k)
