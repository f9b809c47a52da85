"""A queue without a tensor arena packs each message too big for a ring chunk into its blob
region (mq/writer.py's ``_create_blob_region``, VLLM_SHM_ARENA_BLOB_MB) instead of sending it
over the local socket; what the region cannot take (more than half of it, or while it is
full) still goes over the socket, in order."""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import pytest
import torch
from mq_helpers import ready_in_threads

from vllm_shm_arena import MessageQueue
from vllm_shm_arena.mq import writer as mq_writer

MiB = 1 << 20


@pytest.fixture
def region(monkeypatch):
    """``region(mib)``: queues made afterwards get a blob region of ``mib`` MiB."""

    def set_(mib: int) -> None:
        monkeypatch.setattr(mq_writer, "_BLOB_REGION_BYTES", mib * MiB)

    return set_


def _queue(writers, n_local=1, **kw):
    mq = MessageQueue(n_local, n_local, max_chunk_bytes=MiB, enable_shm_tensor_arena=False, **kw)
    writers(mq)
    readers = [MessageQueue.create_from_handle(mq.export_handle(), i) for i in range(n_local)]
    for r in readers:
        writers(r)
    ready_in_threads(mq, readers)
    return mq, readers


def test_a_message_too_big_for_a_chunk_goes_through_the_region(writers, region):
    """Arena off, 8 MiB tensors: every message is a blob (nothing on the socket), byte-exact
    for each reader, and overwriting the tensor once enqueue returned never reaches them; the
    queue has no tensor arena (nothing is sent as a stub)."""
    region(64)
    mq, readers = _queue(writers, n_local=2)
    h = mq.export_handle()
    assert h.tensor_arena_handle is None and h.blob_arena_handle is not None
    assert mq.arena is None
    t = torch.empty(8 * MiB, dtype=torch.uint8)
    for k in range(5):
        t.fill_(k)
        mq.enqueue({"t": t, "k": k}, timeout=10)
        t.fill_(255)  # after enqueue returned: must not be what readers see
        for r in readers:
            got = r.dequeue(timeout=10)
            assert got["k"] == k
            assert int(got["t"].min()) == k == int(got["t"].max())
    st = mq.stats()
    assert st["blob_messages"] == 5 and st["overflow_messages"] == 5, st
    assert "arena" not in st and st["blob_region"]["hits"] == 5, st
    for r in readers:
        assert r.stats()["blob_messages"] == 5


def test_what_the_region_cannot_take_goes_over_the_socket_in_order(writers, region):
    """A 64 MiB region takes messages up to 32 MiB, two of 24 MiB at once: with the reader not
    reading, the third goes over the socket, and so does one of 40 MiB; the reader gets all
    of them in order, byte-exact, and the region's slots all come back."""
    region(64)
    mq, (r,) = _queue(writers)
    sizes = [24, 24, 24, 40, 2]
    for k, mib in enumerate(sizes):
        mq.enqueue({"t": torch.full((mib * MiB,), k, dtype=torch.uint8), "k": k}, timeout=10)
    st = mq.stats()
    assert st["blob_messages"] == 3, st  # 24, 24, then 2 (the 24 and 40 did not fit)
    assert st["overflow_messages"] == 5, st
    for k, mib in enumerate(sizes):
        got = r.dequeue(timeout=10)
        assert got["k"] == k and got["t"].numel() == mib * MiB
        assert int(got["t"].min()) == k == int(got["t"].max())
        del got
    blobs = mq._end.blob_arena
    blobs.reclaim()
    assert blobs.stats()["in_use"] == 0


def test_no_region_when_turned_off(writers, region):
    region(0)
    mq, (r,) = _queue(writers)
    assert mq.export_handle().blob_arena_handle is None
    mq.enqueue({"t": torch.ones(4 * MiB, dtype=torch.uint8)}, timeout=10)
    assert int(r.dequeue(timeout=10)["t"].sum()) == 4 * MiB
    st = mq.stats()
    assert st["overflow_messages"] == 1 and st["blob_messages"] == 0, st


def test_the_region_leaves_no_name_behind(writers, region, monkeypatch):
    """Once every reader joined, the region's name is gone like the ring's; at shutdown the
    region's mapping goes with it."""
    # A short path: the local socket's path inside it must fit sockaddr_un.
    shm_dir = Path(tempfile.mkdtemp(prefix="vsa-blob-", dir="/dev/shm"))
    try:
        monkeypatch.setenv("VLLM_SHM_ARENA_SHM_DIR", str(shm_dir))
        region(64)
        mq, (r,) = _queue(writers)
        assert mq.export_handle().blob_arena_handle.dir == str(shm_dir)
        names = [n for n in os.listdir(shm_dir) if not os.path.isdir(shm_dir / n)]
        assert names == [], names
        mq.shutdown()
        r.shutdown()
        assert mq._end.blob_arena is None
    finally:
        shutil.rmtree(shm_dir, ignore_errors=True)
