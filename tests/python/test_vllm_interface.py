"""vLLM's public queue interface beyond the basics: process groups of either kind,
``external_writer_handle`` / ``blocking``, the single-reader setup, ``connect_ip=None`` with
remote readers, and the long-wait warning interval (VLLM_RINGBUFFER_WARNING_INTERVAL)."""

from __future__ import annotations

import logging
import threading

import pytest
from mq_helpers import ready_in_threads

import vllm_shm_arena.mq.reader as mq_mod
from vllm_shm_arena import MessageQueue


class FakeStatelessGroup:
    """vLLM's StatelessProcessGroup interface (rank, world_size, broadcast_obj,
    all_gather_obj) for ranks run as threads of this process."""

    def __init__(self, rank: int, world: int, shared: dict):
        self.rank, self.world_size, self._s = rank, world, shared

    def _sync(self):
        self._s["barrier"].wait(30)

    def broadcast_obj(self, obj, src: int):
        if self.rank == src:
            self._s["bcast"] = obj
        self._sync()
        out = self._s["bcast"]
        self._sync()
        return out

    def all_gather_obj(self, obj):
        self._s.setdefault("gather", {})[self.rank] = obj
        self._sync()
        out = [self._s["gather"][r] for r in range(self.world_size)]
        self._sync()
        return out


def _run_ranks(world: int, body):
    shared = {"barrier": threading.Barrier(world)}
    results, errors = {}, {}

    def run(rank):
        try:
            results[rank] = body(FakeStatelessGroup(rank, world, shared))
        except BaseException as e:
            errors[rank] = e
            shared["barrier"].abort()

    ths = [threading.Thread(target=run, args=(r,), daemon=True) for r in range(world)]
    for t in ths:
        t.start()
    for t in ths:
        t.join(60)
    assert not any(t.is_alive() for t in ths), "a rank hung"
    assert not errors, errors
    return results


def test_create_from_process_group_with_a_stateless_group():
    def body(pg):
        mq = MessageQueue.create_from_process_group(pg, 1 << 20, 4, writer_rank=0)
        try:
            if pg.rank == 0:
                for i in range(3):
                    mq.enqueue({"i": i})
                return "writer"
            return [mq.dequeue(timeout=30)["i"] for _ in range(3)]
        finally:
            pg._sync()
            mq.shutdown()

    out = _run_ranks(3, body)
    assert out == {0: "writer", 1: [0, 1, 2], 2: [0, 1, 2]}


def test_external_writer_handle_and_non_blocking():
    """With external_writer_handle the writer rank joins that queue as a reader (vLLM's use:
    a queue created elsewhere); blocking=False returns before wait_until_ready."""
    ext = MessageQueue(2, 2)

    def body(pg):
        mq = MessageQueue.create_from_process_group(
            pg,
            1 << 20,
            4,
            writer_rank=0,
            external_writer_handle=ext.export_handle(),
            blocking=False,
        )
        assert not mq._is_writer
        return mq

    queues = _run_ranks(2, body)
    ths = [threading.Thread(target=q.wait_until_ready, args=(30,)) for q in queues.values()]
    for t in ths:
        t.start()
    ext.wait_until_ready(timeout=30)
    for t in ths:
        t.join(30)
    try:
        ext.enqueue("hello")
        assert [q.dequeue(timeout=30) for q in queues.values()] == ["hello", "hello"]
    finally:
        ext.shutdown()
        for q in queues.values():
            q.shutdown()


def test_create_from_process_group_single_reader():
    def body(pg):
        mq, handles = MessageQueue.create_from_process_group_single_reader(
            pg, 1 << 20, 4, reader_rank=0
        )
        return pg.rank, mq, handles

    out = _run_ranks(3, body)
    handles = out[0][2]
    assert len(handles) == 3 and out[1][2] == [] and out[2][2] == []
    readers = [MessageQueue.create_from_handle(h, 0) for h in handles]
    writers = [out[r][1] for r in range(3)]
    ths = [threading.Thread(target=q.wait_until_ready, args=(30,)) for q in readers + writers]
    for t in ths:
        t.start()
    for t in ths:
        t.join(30)
    try:
        for r, w in enumerate(writers):
            w.enqueue({"from": r})
        assert [q.dequeue(timeout=30) for q in readers] == [{"from": r} for r in range(3)]
    finally:
        for q in readers + writers:
            q.shutdown()


def test_connect_ip_defaults_to_this_nodes_address(monkeypatch):
    monkeypatch.setenv("VLLM_HOST_IP", "127.0.0.1")
    mq = MessageQueue(2, 1)  # one remote reader, no connect_ip: vLLM binds to get_ip()
    try:
        assert mq.export_handle().remote_subscribe_addr.startswith("tcp://127.0.0.1:")
    finally:
        mq.shutdown()


def test_long_waits_are_logged_at_the_ringbuffer_warning_interval(monkeypatch, caplog):
    monkeypatch.setattr(mq_mod, "_WAIT_WARN_S", 0.001)
    mq = MessageQueue(1, 1)
    r = MessageQueue.create_from_handle(mq.export_handle(), 0)
    ready_in_threads(mq, [r])
    try:
        with caplog.at_level(logging.WARNING, logger="vllm_shm_arena"):
            with pytest.raises(TimeoutError):
                r.dequeue(timeout=0.05, indefinite=False)
            assert any("No available shared memory broadcast block" in m for m in caplog.messages)
            caplog.clear()
            with pytest.raises(TimeoutError):
                r.dequeue(timeout=0.05, indefinite=True)
            assert not any("No available shared memory" in m for m in caplog.messages)
    finally:
        mq.shutdown()
        r.shutdown()
