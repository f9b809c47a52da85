"""Readers of both kinds beside an arena: each message is pickled once, with arena stubs; the
remote socket sends the arena allocations the stubs name after the message's buffers, by
reference (csrc/core/arena.h's SendHold keeps such a slot from being recycled until ZeroMQ
lets go of it), and the remote reader's stubs resolve to those frames (arena.FrameStubs).
The hold's own rules are tests/cpp/arena_test.cpp's ("send holds")."""

from __future__ import annotations

import os
import signal

import pytest
import torch
from mq_helpers import check_pattern, pattern, ready_in_threads, wait_until

from vllm_shm_arena import MessageQueue
from vllm_shm_arena._ext import _C
from vllm_shm_arena.arena import FrameStubs
from vllm_shm_arena.mq import writer as mq_writer

MiB = 1 << 20


class _CountDumps:
    """Counts the writer's picklings (its dump_message calls)."""

    def __init__(self, monkeypatch):
        self.calls = 0
        dump = mq_writer.dump_message

        def counted(*args, **kw):
            self.calls += 1
            return dump(*args, **kw)

        monkeypatch.setattr(mq_writer, "dump_message", counted)


def _both_kinds(writers):
    mq = MessageQueue(2, 1, [0], connect_ip="127.0.0.1", enable_shm_tensor_arena=True)
    writers(mq)
    local = MessageQueue.create_from_handle(mq.export_handle(), 0)
    remote = MessageQueue.create_from_handle(mq.export_handle(), 1)
    writers(local)
    writers(remote)
    ready_in_threads(mq, [local, remote])
    return mq, local, remote


def test_one_pickling_and_no_socket_copy_for_arena_tensors(writers, monkeypatch, rng):
    """Tensors the arena takes (copied, lent, a Parameter, a view of a loan) reach the remote
    reader byte-exact with one pickling per message and no copy into the socket (the frame
    pool takes nothing); a declined tensor beside them still goes out of band."""
    mq, local, remote = _both_kinds(writers)
    dumps = _CountDumps(monkeypatch)
    for k in range(4):
        big = torch.randint(0, 256, (3 * MiB + k,), dtype=torch.uint8, generator=rng)
        loan = mq.empty((2 * MiB // 4,), torch.float32)
        assert loan is not None
        loan.copy_(torch.randn(loan.shape, generator=rng))
        param = torch.nn.Parameter(torch.randn(MiB // 2, generator=rng), requires_grad=False)
        small = torch.arange(100, dtype=torch.int64) + k  # below the arena's threshold
        strided = torch.randn(2048, 1024, generator=rng)[:, ::2]  # declined: not contiguous
        msg = {"big": big, "loan": loan[16:], "param": param, "small": small, "s": strided}
        takes = _C.frame_pool_stats()["takes"]
        mq.enqueue(msg, timeout=30)
        assert _C.frame_pool_stats()["takes"] - takes == 1  # the declined strided tensor only
        for r in (local, remote):
            got = r.dequeue(timeout=30)
            assert torch.equal(got["big"], big)
            assert torch.equal(got["loan"], loan[16:])
            assert type(got["param"]) is torch.nn.Parameter
            assert torch.equal(got["param"], param)
            assert torch.equal(got["small"], small)
            assert torch.equal(got["s"], strided)
            del got
    assert dumps.calls == 4
    hits = mq.stats()["arena"]["hits"]
    assert hits == 4 * 3, mq.stats()["arena"]  # big, the loan, the Parameter per message


def _stopped_remote_reader(handle, conn):
    torch.set_num_threads(1)
    r = MessageQueue.create_from_handle(handle, 1)
    r.wait_until_ready(timeout=60)
    conn.send("ready")
    out = []
    for _ in range(2):
        m = r.dequeue(timeout=120)
        out.append((m["k"], check_pattern(m["t"], m["nbytes"], m["k"])))
        del m
    conn.send(out)
    r.shutdown()


def test_a_slot_the_socket_still_sends_is_not_recycled(writers, kids, monkeypatch):
    """One 100 MiB arena slot; the remote reader is stopped (SIGSTOP), so its socket cannot
    take the 96 MiB message (more than the kernel's TCP buffers). The local reader reads and
    drops it, yet the next message cannot reuse the slot (declined: no free slot) while ZeroMQ
    still reads it; once the remote reader runs again it gets both messages byte-exact, and
    the slot comes back."""
    monkeypatch.setattr(mq_writer, "_ARENA_POLICY", "fixed")
    monkeypatch.setattr(mq_writer, "_ARENA_NUM_SLOTS", 1)
    monkeypatch.setattr(mq_writer, "_ARENA_SLOT_BYTES", 100 * MiB)
    nbytes = 96 * MiB
    mq = MessageQueue(2, 1, [0], connect_ip="127.0.0.1", enable_shm_tensor_arena=True)
    writers(mq)
    local = MessageQueue.create_from_handle(mq.export_handle(), 0)
    writers(local)
    a, b = kids.ctx.Pipe()
    child = kids.start(_stopped_remote_reader, mq.export_handle(), b)
    ready_in_threads(mq, [local], timeout=60)
    assert a.poll(60) and a.recv() == "ready"
    os.kill(child.pid, signal.SIGSTOP)
    try:
        for k in (1, 2):
            mq.enqueue({"k": k, "nbytes": nbytes, "t": pattern(nbytes, k)}, timeout=60)
            got = local.dequeue(timeout=60)
            assert check_pattern(got["t"], nbytes, k) is None
            del got  # a CPU tensor's slot is released as it dies
            holdings = mq.stats()["arena"]["holdings"]
            assert holdings[0]["slots_held"] == 0, holdings  # the local reader let go
        st = mq.stats()["arena"]
        assert st["hits"] == 1, st  # message 2 found the slot still held
        assert st["declined"]["no_free_slot"] >= 1, st
    finally:
        os.kill(child.pid, signal.SIGCONT)
    assert a.poll(120), "the remote reader did not report"
    assert a.recv() == [(1, None), (2, None)]
    kids.join_all(30)
    mq.enqueue({"k": 3, "nbytes": 0, "t": None}, timeout=30)  # reclaim runs at the next write
    wait_until(
        lambda: mq.arena.write(torch.zeros(MiB, dtype=torch.uint8)) is not None,
        30,
        "the slot given back once ZeroMQ let go of it",
    )


@pytest.mark.parametrize(
    "stub, match",
    [
        ((9, 1, 16, "uint8", (16,)), "not an allocation this message carries"),
        ((1, 2, 16, "uint8", (16,)), "not an allocation this message carries"),
        (("1", 1, 16, "uint8", (16,)), "not an allocation this message carries"),
        ((1, 1, 65, "uint8", (65,)), "65 bytes at offset 0 of a 64-byte allocation"),
        ((1, 1, 16, "uint8", (16,), 60), "16 bytes at offset 60"),
        ((1, 1, 16, "uint8", (16,), -1), "offset=-1"),
        ((1, 1, True, "uint8", (1,)), "nbytes=True"),
        ((1, 1, 16, "nope", (16,)), "unknown dtype"),
        ((1, 1, 16, "uint8", 16), "shape=16"),
        ((1, 1, 16, "int32", (5,)), "needs 20"),
    ],
)
def test_a_remote_stub_is_checked_before_use(stub, match):
    stubs = FrameStubs("arena", [(1, 1)], [bytearray(64)])
    with pytest.raises(ValueError, match=match):
        stubs.rebuild_stub(*stub)


def test_a_remote_stub_is_a_zero_copy_view_of_its_frame():
    frame = bytearray(range(64))
    t = FrameStubs("arena", [(1, 1)], [frame]).rebuild_stub(1, 1, 8, "uint8", (2, 4), 8)
    assert t.tolist() == [[8, 9, 10, 11], [12, 13, 14, 15]]
    frame[8] = 99
    assert int(t[0, 0]) == 99


def test_a_remote_message_without_its_arena_payloads_ends_the_stream(writers, monkeypatch):
    """A writer whose remote message names an arena allocation it does not carry (another
    version's): the remote reader raises a clear error, for this and every later dequeue,
    instead of a stub naming an arena it cannot map."""
    mq, local, remote = _both_kinds(writers)
    monkeypatch.setattr(type(mq.arena), "send_holds", lambda self, allocations: [])
    mq.enqueue({"t": torch.ones(2 * MiB, dtype=torch.uint8)}, timeout=30)
    assert int(local.dequeue(timeout=30)["t"].sum()) == 2 * MiB
    for _ in range(2):
        with pytest.raises(RuntimeError, match="names 1 arena allocation"):
            remote.dequeue(timeout=30)
