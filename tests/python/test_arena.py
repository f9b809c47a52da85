"""The arena layer: ``ShmTensorArena.write_tensor`` / ``get_tensor``, slot release, the
reader registry, the GIL, and a reader in another process. No pickling here except where a
stub has to cross a process boundary (see test_pickler.py for the pickler itself)."""

from __future__ import annotations

import gc
import hashlib
import multiprocessing
import os
import sys
import threading
import time

import pytest
import torch

from vllm_shm_arena import _TENSOR_ARENAS, ShmTensorArena, dumps, loads


def _write_read(a, t: torch.Tensor) -> torch.Tensor:
    res = a.writer.write(t)
    assert res is not None, a.writer.stats()
    slot, gen = res
    return a.reader.get_tensor(slot, t.numel() * t.element_size(), t.dtype, t.shape, gen)


# ------------------------------------------------------------------------ round trips
def test_write_get_roundtrip_every_dtype(arena, rand, same_bytes, dtype):
    t = rand((33, 257), dtype)
    got = _write_read(arena, t)
    same_bytes(got, t)
    assert arena.writer.stats()["hits"] == 1


def test_write_get_zero_dim_every_dtype(arena, rand, same_bytes, dtype):
    t = rand((), dtype)
    got = _write_read(arena, t)
    assert got.dim() == 0
    same_bytes(got, t)


@pytest.mark.parametrize("shape", [(0,), (3, 0, 5), (0, 0)])
def test_write_get_empty(arena, same_bytes, shape):
    t = torch.empty(shape, dtype=torch.float32)
    got = _write_read(arena, t)
    same_bytes(got, t)
    del got
    assert arena.in_use() == 0


def test_get_tensor_is_zero_copy(arena, rand):
    """Two readers' views of one stub share the slot's memory: no copy on the read side."""
    t = rand((1 << 20,), torch.float32)
    slot, gen = arena.writer.write(t)
    a = arena.reader.get_tensor(slot, t.nbytes, t.dtype, t.shape, gen)
    b = arena.reader.get_tensor(slot, t.nbytes, t.dtype, t.shape, gen)
    assert a.data_ptr() == b.data_ptr()
    assert a.data_ptr() != t.data_ptr()
    assert arena.reader.stats()["held"] == 1  # one slot, acquired twice


def test_write_tensor_returns_slot_index(arena, rand):
    slot = arena.writer.write_tensor(rand((1024,), torch.float32))
    assert isinstance(slot, int) and 0 <= slot < arena.writer.num_slots


def test_two_readers_both_must_release(make_arena, rand, same_bytes):
    a = make_arena(n_readers=2, num_slots=1, slot_bytes=4 << 20)
    t = rand((1 << 18,), torch.float32)
    slot, gen = a.writer.write(t)
    views = [r.get_tensor(slot, t.nbytes, t.dtype, t.shape, gen) for r in a.readers]
    for v in views:
        same_bytes(v, t)
    del v, views[0]
    assert a.in_use() == 1  # reader 1 still holds it
    del views[0]
    assert a.in_use() == 0


# ------------------------------------------------------------------------ declines
def test_write_tensor_declines_are_counted(make_arena, rand):
    a = make_arena(num_slots=1, slot_bytes=4 << 20)
    w = a.writer
    big = rand((1024, 1024), torch.float32)  # exactly one slot (4 MiB)
    assert w.write_tensor(big.t()) is None
    assert w.write_tensor(rand((1024 * 1024 + 1,), torch.float32)) is None
    assert w.write_tensor(torch.randn(64, dtype=torch.complex64).conj()) is None
    assert w.write_tensor(torch._neg_view(torch.randn(64))) is None
    d = a.declined()
    assert d["not_contiguous"] == 1
    assert d["oversize"] == 1
    assert d["unsupported"] == 2
    assert w.stats()["hits"] == 0
    assert w.write_tensor(big) == 0  # an exactly-slot-sized tensor fits
    with pytest.raises(TypeError, match="torch.Tensor"):
        w.write_tensor([1, 2, 3])


def test_exhausted_arena_declines_then_recovers(make_arena, rand, same_bytes):
    a = make_arena(num_slots=2, slot_bytes=4 << 20)
    ts = [rand((1 << 18,), torch.float32) for _ in range(3)]
    held = [_write_read(a, t) for t in ts[:2]]
    assert a.writer.write_tensor(ts[2]) is None
    assert a.declined()["no_free_slot"] == 1
    for h, t in zip(held, ts[:2], strict=True):
        same_bytes(h, t)  # the declined write did not disturb held slots
    del h, held[0]
    got = _write_read(a, ts[2])  # the write recycles the released slot itself
    same_bytes(got, ts[2])
    same_bytes(held[0], ts[1])


# ------------------------------------------------------------------------ release
def test_slot_released_only_after_tensor_slice_and_parameter_die(make_arena, rand, same_bytes):
    a = make_arena(num_slots=1, slot_bytes=4 << 20)
    t = rand((1024, 256), torch.float32)
    x = _write_read(a, t)
    s = x[100:200, 3:7]
    p = torch.nn.Parameter(x, requires_grad=False)
    del x
    assert a.writer.write_tensor(t) is None, "slot recycled while a slice and a Parameter live"
    assert a.in_use() == 1
    same_bytes(s, t[100:200, 3:7])
    del s
    assert a.writer.write_tensor(t) is None, "slot recycled while a Parameter lives"
    assert a.in_use() == 1
    same_bytes(p.data, t)
    del p
    assert a.in_use() == 0
    assert a.reader.stats()["held"] == 0
    assert a.writer.write_tensor(t) == 0
    assert a.declined()["no_free_slot"] == 2


def test_pickled_parameter_and_slice_keep_slot(make_arena, rand, same_bytes):
    """The same through loads: _rebuild_arena_parameter's Parameter keeps the slot alive."""
    a = make_arena(num_slots=1, slot_bytes=16 << 20)
    t = rand((2048, 1024), torch.float32)  # 8 MiB: diverted by dumps
    p = loads(*dumps(torch.nn.Parameter(t, requires_grad=False), a.writer))
    assert a.writer.stats()["hits"] == 1
    assert isinstance(p, torch.nn.Parameter)
    s = p[5]
    del p
    assert a.in_use() == 1
    same_bytes(s, t[5])
    del s
    assert a.in_use() == 0


def test_reader_close_keeps_tensors_valid(arena, rand, same_bytes):
    t = rand((4096,), torch.int64)
    got = _write_read(arena, t)
    arena.reader.close()
    assert arena.reader.name not in _TENSOR_ARENAS
    same_bytes(got, t)


def test_writer_unlink_keeps_attached_reader_working(arena, rand, same_bytes):
    arena.writer.unlink()
    t = rand((4096,), torch.float16)
    same_bytes(_write_read(arena, t), t)
    with pytest.raises(OSError):
        ShmTensorArena.attach(arena.writer.handle(), 0)


def test_dropped_writer_does_not_leak_shm_name():
    w = ShmTensorArena.create(1, 1, 1 << 20)
    path = os.path.join(w.handle().dir, w.name)
    assert os.path.exists(path)
    del w
    gc.collect()
    try:
        assert not os.path.exists(path), f"{path} left behind"
    finally:
        if os.path.exists(path):
            os.unlink(path)  # do not leave the leak behind on this machine


# ------------------------------------------------------------------------ GIL
def test_write_tensor_releases_gil(make_arena):
    """Another thread runs while a 256 MiB write_tensor copies.

    With a huge switch interval the interpreter never forces a GIL hand-off, so the counter
    thread (which yields in time.sleep(0)) can only run while the main thread has released
    the GIL itself: any progress between the two samples happened inside write_tensor.
    """
    a = make_arena(num_slots=1, slot_bytes=256 << 20, attach=False)
    big = torch.full((256 << 20,), 7, dtype=torch.uint8)
    count = [0]
    stop = threading.Event()

    def spin():
        while not stop.is_set():
            count[0] += 1
            time.sleep(0)  # releases the GIL, so the main thread gets it back promptly

    old = sys.getswitchinterval()
    th = threading.Thread(target=spin, daemon=True)
    try:
        th.start()
        deadline = time.monotonic() + 30
        while count[0] == 0 and time.monotonic() < deadline:
            time.sleep(0.001)
        sys.setswitchinterval(1000.0)
        before = count[0]
        slot = a.writer.write_tensor(big)
        after = count[0]
    finally:
        sys.setswitchinterval(old)
        stop.set()
        th.join(timeout=30)
    assert slot == 0
    assert after - before > 5, f"counter thread advanced {after - before} during the write"


# ------------------------------------------------------------------------ registry
def in_use_now(a) -> int:
    """Slots in use after a reclaim, without flushing readers (they may be gone)."""
    gc.collect()
    a.writer.reclaim()
    return a.writer.stats()["in_use"]


def test_registry_drops_unheld_reader_tensor_stays_valid(make_arena, rand, same_bytes):
    a = make_arena(num_slots=1, slot_bytes=4 << 20, attach=False)
    r = ShmTensorArena.attach(a.writer.handle(), 0)
    assert _TENSOR_ARENAS.get(a.writer.name) is r
    t = rand((1 << 18,), torch.bfloat16)
    slot, gen = a.writer.write(t)
    got = r.get_tensor(slot, t.nbytes, t.dtype, t.shape, gen)
    del r
    gc.collect()
    assert a.writer.name not in _TENSOR_ARENAS
    same_bytes(got, t)
    assert in_use_now(a) == 1
    del got
    assert in_use_now(a) == 0  # the last tensor took the reader (and its holds) with it


def test_attach_replaces_registry_entry(make_arena):
    a = make_arena(n_readers=2, attach=False)
    r0 = ShmTensorArena.attach(a.writer.handle(), 0)
    r1 = ShmTensorArena.attach(a.writer.handle(), 1)
    assert _TENSOR_ARENAS[a.writer.name] is r1
    r0.close()  # closing a reader that is not the registered one leaves the entry alone
    assert _TENSOR_ARENAS[a.writer.name] is r1
    r1.close()
    assert a.writer.name not in _TENSOR_ARENAS


# ------------------------------------------------------------------------ multi-process
def _spawned_reader(conn) -> None:
    """Child: attach by handle, unpickle the parent's stub, report a digest, drop, report."""
    handle, data = conn.recv()
    r = ShmTensorArena.attach(handle, 0)
    msg = loads(data)
    t = msg["t"]
    raw = t.reshape(-1).view(torch.uint8).numpy().tobytes()
    conn.send((hashlib.sha256(raw).hexdigest(), str(t.dtype), tuple(t.shape), msg["tag"]))
    assert conn.poll(120) and conn.recv() == "drop"
    del t, msg
    gc.collect()
    r.flush_releases()
    conn.send(r.stats()["held"])
    assert conn.poll(120) and conn.recv() == "exit"
    r.close()
    conn.close()


def test_spawned_reader_reads_and_releases(make_arena, rand):
    a = make_arena(num_slots=2, slot_bytes=16 << 20, attach=False)
    t = rand((2048, 2048), torch.bfloat16)  # 8 MiB: MIN_BYTES, so dumps diverts it
    data, bufs = dumps({"t": t, "tag": "hello"}, a.writer)
    assert bufs == [] and len(data) < 1024, "the tensor should travel as an arena stub"
    want = hashlib.sha256(t.reshape(-1).view(torch.uint8).numpy().tobytes()).hexdigest()

    ctx = multiprocessing.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_spawned_reader, args=(child,), daemon=True)
    proc.start()
    try:
        parent.send((a.writer.handle(), data))
        assert parent.poll(180), "child never answered"
        digest, dtype, shape, tag = parent.recv()
        assert (digest, dtype, shape, tag) == (want, "torch.bfloat16", (2048, 2048), "hello")
        assert in_use_now(a) == 1, "slot recycled while the child holds it"
        parent.send("drop")
        assert parent.poll(60)
        assert parent.recv() == 0
        assert in_use_now(a) == 0, "slot not returned after the child dropped it"
        parent.send("exit")
        proc.join(60)
        assert proc.exitcode == 0
    finally:
        if proc.is_alive():
            proc.kill()
            proc.join(10)
    # The arena keeps working for the next message.
    assert a.writer.write_tensor(t) is not None


def test_debug_checksum_counts_in_place_writes(monkeypatch):
    """VLLM_SHM_ARENA_DEBUG_CHECKSUM=1: a reader's in-place write shows up at release."""
    monkeypatch.setenv("VLLM_SHM_ARENA_DEBUG_CHECKSUM", "1")
    w = ShmTensorArena.create(2, num_slots=2, slot_bytes=1 << 20)
    r0, r1 = ShmTensorArena.attach(w.handle(), 0), ShmTensorArena.attach(w.handle(), 1)
    try:
        slot, gen = w.write(torch.zeros(1 << 18, dtype=torch.float32))
        a = r0.get_tensor(slot, 1 << 20, torch.float32, (1 << 18,), generation=gen)
        b = r1.get_tensor(slot, 1 << 20, torch.float32, (1 << 18,), generation=gen)
        b[7] = 1.0  # documented: visible to every reader; debug mode counts it
        assert float(a[7]) == 1.0
        del a
        del b
        assert r0.stats()["checksum_mismatches"] == 1
        assert r1.stats()["checksum_mismatches"] == 1
    finally:
        w.close()
        r0.close()
        r1.close()


@pytest.mark.parametrize("policy", ["fixed", "variable"])
def test_handle_aliases_name_the_allocation_limits(policy):
    """``max_allocations``/``max_allocation_bytes`` are ``num_slots``/``slot_bytes`` in both
    layouts; in the variable one the largest allocation is the whole data region."""
    if policy == "fixed":
        a = ShmTensorArena.create(1, num_slots=4, slot_bytes=4 << 20)
    else:
        a = ShmTensorArena.create(1, policy="variable", arena_bytes=8 << 20, max_allocations=4)
    try:
        h = a.handle()
        assert (h.max_allocations, h.max_allocation_bytes) == (h.num_slots, h.slot_bytes)
        assert h.max_allocations == 4
        big = torch.zeros(h.max_allocation_bytes, dtype=torch.uint8)
        assert a.write_tensor(big) is not None
    finally:
        a.unlink()
