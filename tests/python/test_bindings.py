"""The bindings' handling of Python buffers, and the copy pool's knobs (csrc/torch_bindings.cpp,
csrc/bindings/message_bindings.cpp).

* ``MessageRingWriter.write`` takes only C-contiguous frames: a strided view's ``buf``/``len`` name
  other bytes than the frame's (a reversed view's ``buf`` is its last element).
* ``tensor_from_buffer`` aliases writable buffers (ZeroMQ frames, bytearrays) and copies
  read-only ones (``bytes``) once, so an in-place op never mutates an immutable object.
* ``set_copy_readers``: the queue's writer tells the copy pool its local readers' CPUs, which a
  copy uses only where that measures faster (``wide_copies``).
* ``TensorArenaReader`` offers no early detach: a live tensor's record is never recycled.

Every shared-memory name lives in the test's private directory.
"""

from __future__ import annotations

import gc
import os

import numpy as np
import pytest
import torch
import zmq

from vllm_shm_arena import MessageQueue, ShmTensorArena
from vllm_shm_arena._ext import _C
from vllm_shm_arena.pickler import dumps, loads


@pytest.fixture
def ring(tmp_path):
    """A ring writer with one attached reader, in a private shm directory."""
    w = _C.MessageRingWriter(1, 4, 1 << 16, str(tmp_path))
    r = _C.MessageRingReader(w.name, 0, str(tmp_path))
    yield w, r
    w.unlink()


def _read_frames(reader) -> list[bytes]:
    status, _, frames = reader.read(5.0)
    assert status == "ok"
    return [bytes(f) for f in frames]


@pytest.mark.parametrize(
    "view",
    [
        memoryview(b"0123456789")[::2],  # strided: was received as b"01234"
        memoryview(b"0123456789")[::-1],  # reversed: was read past the buffer's end
        np.arange(10, dtype=np.uint8).reshape(2, 5)[:, ::2],  # 2-D, strided
        np.asfortranarray(np.arange(6, dtype=np.uint8).reshape(2, 3)),  # column-major
    ],
    ids=["strided", "reversed", "2d_strided", "fortran_order"],
)
def test_ring_write_rejects_non_contiguous_frame_naming_its_index(ring, view):
    w, r = ring
    with pytest.raises(ValueError, match="frame 1 is not a C-contiguous buffer"):
        w.write([b"head", view], 0, 5.0)
    # Nothing was published: the next message is the next one read.
    assert w.write([b"ok"], 0, 5.0) == "ok"
    assert _read_frames(r) == [b"ok"]


def test_ring_write_carries_contiguous_views_exactly(ring):
    w, r = ring
    base = memoryview(b"0123456789")
    frames = [base[2:7], base[::1], memoryview(bytearray(b"ab")).cast("B", (1, 2)), b""]
    assert w.write(frames, 0, 5.0) == "ok"
    assert _read_frames(r) == [b"23456", b"0123456789", b"ab", b""]


def test_ring_write_rejects_a_non_buffer_frame_naming_its_index(ring):
    w, _ = ring
    with pytest.raises(TypeError, match="frame 2 is not a buffer"):
        w.write([b"a", b"b", 42], 0, 5.0)


def test_tensor_from_read_only_buffer_is_a_copy():
    data = bytes(range(16))
    t = _C.tensor_from_buffer(data, torch.uint8, [16])
    t.add_(1)  # must not write into the bytes object
    assert data == bytes(range(16))
    assert t.tolist() == [x + 1 for x in range(16)]
    # Same for a read-only memoryview, and for a multi-byte dtype.
    f = torch.arange(4, dtype=torch.float32)
    raw = bytes(f.numpy().tobytes())
    t2 = _C.tensor_from_buffer(memoryview(raw), torch.float32, [2, 2])
    t2.mul_(10)
    assert raw == f.numpy().tobytes()
    assert t2.reshape(-1).tolist() == [0.0, 10.0, 20.0, 30.0]


def test_tensor_from_writable_buffer_stays_zero_copy():
    ba = bytearray(range(8))
    t = _C.tensor_from_buffer(ba, torch.uint8, [8])
    t[0] = 200
    assert ba[0] == 200  # the tensor aliases the bytearray

    ctx = zmq.Context()
    a, b = ctx.socket(zmq.PAIR), ctx.socket(zmq.PAIR)
    try:
        a.bind("inproc://test-bindings")
        b.connect("inproc://test-bindings")
        a.send(bytes(range(64)) * 2048, copy=False)
        frame = b.recv(copy=False)
        buf = frame.buffer  # what MessageQueue hands to loads
        t = _C.tensor_from_buffer(buf, torch.uint8, [len(buf)])
        t[1] = 77
        assert buf[1] == 77  # no copy of a received ZeroMQ frame
    finally:
        a.close(0)
        b.close(0)
        ctx.term()


def test_loads_over_bytes_works_and_leaves_the_bytes_unchanged(rand, same_bytes):
    x = rand((256, 64), torch.float32)
    data, buffers = dumps({"x": x})
    frozen = [bytes(memoryview(b).cast("B")) for b in buffers]  # as direct_arena.py sends them
    snapshot = list(frozen)
    out = loads(data, frozen)["x"]
    same_bytes(out, x)
    out.zero_()
    assert frozen == snapshot


def test_tensor_from_buffer_length_mismatch_is_a_value_error():
    with pytest.raises(ValueError, match="needs 8"):
        _C.tensor_from_buffer(bytes(4), torch.uint8, [8])
    with pytest.raises(ValueError, match="needs 8"):
        _C.tensor_from_buffer(bytearray(4), torch.uint8, [8])


def test_queue_writer_tells_the_copy_pool_its_local_readers(tmp_path, monkeypatch):
    monkeypatch.setenv("VLLM_SHM_ARENA_SHM_DIR", str(tmp_path))
    _C.set_copy_threads(0)
    _C.set_copy_readers(0)
    alone = _C.copy_threads()
    assert 1 <= alone <= 8
    n = os.cpu_count() or 1
    mq = MessageQueue(n, n, max_chunk_bytes=1 << 16, max_chunks=2)
    try:
        assert _C.copy_threads() == 1  # a local reader on every CPU: no spare for the copy
        if alone >= 2:  # two usable CPUs or more
            # ... but a large copy still tries the readers' CPUs (and keeps them if faster):
            # at least two in 2 x 8 copies (trials, or one exploration in 8).
            src = torch.arange(8 << 20, dtype=torch.uint8)
            dst = torch.empty_like(src)
            wide = _C.copy_pool_stats()["wide_copies"]
            for _ in range(16):
                dst.zero_()
                _C.parallel_copy(dst, src)
                assert torch.equal(dst, src)
            assert _C.copy_pool_stats()["wide_copies"] - wide >= 2
    finally:
        mq.shutdown()
        _C.set_copy_readers(0)
    assert _C.copy_threads() == alone


def test_a_message_streams_its_copies_once_they_pass_the_working_set_threshold(tmp_path):
    """A message's arena copies use streaming stores once the message has written
    stream_min_bytes (a burst of tensors no cache holds), and the count restarts with each
    message: here 3 x 1 MiB with a 2 MiB threshold streams the second and third copy of every
    message, never the first."""
    from vllm_shm_arena.arena import ShmTensorArena

    arena = ShmTensorArena.create(1, policy="variable", arena_bytes=64 << 20, shm_dir=str(tmp_path))
    reader = ShmTensorArena.attach(arena.handle(), 0)
    saved = _C.stream_min_bytes()
    _C.set_stream_min_bytes(2 << 20)
    try:
        ts = [torch.arange(1 << 18, dtype=torch.int32) * (k + 3) for k in range(3)]
        want = 2 if _C.stream_copy_supported() else 0
        for _ in range(3):
            before = _C.copy_pool_stats()["stream_copies"]
            data, bufs = dumps({"t": ts}, arena)
            assert arena.stats()["hits"] >= 3 and not bufs  # all three went into the arena
            assert _C.copy_pool_stats()["stream_copies"] - before == want
            got = loads(data, bufs)["t"]
            assert all(torch.equal(a, b) for a, b in zip(got, ts, strict=True))
            del got
        # Streaming off: nothing streams, whatever the message writes.
        _C.set_stream_min_bytes(0)
        before = _C.copy_pool_stats()["stream_copies"]
        got = loads(*dumps({"t": ts}, arena))["t"]
        assert all(torch.equal(a, b) for a, b in zip(got, ts, strict=True))
        assert _C.copy_pool_stats()["stream_copies"] == before
        del got
    finally:
        _C.set_stream_min_bytes(saved)
        reader.close()
        arena.close()


def test_stream_threshold_from_the_environment_is_checked(tmp_path):
    """VLLM_SHM_ARENA_STREAM_MIN_MB sets the threshold at import; a bad value is a clear
    error naming the variable, not a silent default."""
    import subprocess
    import sys

    code = "import vllm_shm_arena.arena as a; print(a._C.stream_min_bytes())"
    env = {**os.environ, "VLLM_SHM_ARENA_STREAM_MIN_MB": "7"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert int(out.stdout) == 7 << 20
    env["VLLM_SHM_ARENA_STREAM_MIN_MB"] = "lots"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert out.returncode != 0
    assert "VLLM_SHM_ARENA_STREAM_MIN_MB" in out.stderr and "'lots'" in out.stderr


def test_no_python_call_lets_the_writer_recycle_a_live_tensors_slot(make_arena, rand, same_bytes):
    # The rank is given up only when the reader object dies, and every tensor it handed out
    # keeps it alive: nothing reachable from Python detaches it earlier.
    a = make_arena(num_slots=1, slot_bytes=1 << 20, attach=False)
    r = ShmTensorArena.attach(a.writer.handle(), 0)
    t = rand((1 << 18,), torch.int32)
    slot, gen = a.writer.write(t)
    got = r.get_tensor(slot, t.nbytes, t.dtype, t.shape, gen)
    detach = getattr(r._reader, "detach", None)
    if detach is not None:
        detach()
    r.close()
    del r, detach
    gc.collect()
    a.writer.reclaim(check_liveness=True)
    assert a.writer.write_tensor(torch.zeros_like(t)) is None, "the live tensor's slot was reused"
    same_bytes(got, t)
    del got
    gc.collect()
    a.writer.reclaim(check_liveness=True)
    assert a.writer.write_tensor(torch.zeros_like(t)) is not None  # back once the tensor died


def test_decline_reasons_are_the_writer_stats_keys_in_enum_order(tmp_path):
    # One list, the core's: the writer's stats()["declined"] keys, what count_decline accepts.
    names = _C.DECLINE_REASONS
    assert isinstance(names, tuple) and len(names) == len(set(names))
    assert names[:3] == ("too_small", "not_contiguous", "oversize") and "no_record" in names
    w = _C.TensorArenaWriter(1, 2, 1 << 16, str(tmp_path))
    try:
        assert list(w.stats()["declined"]) == list(names)
        for i, name in enumerate(names):
            for _ in range(i + 1):
                w.count_decline(name)
        assert w.stats()["declined"] == {name: i + 1 for i, name in enumerate(names)}
        with pytest.raises(ValueError, match="unknown decline reason 'no_such_reason'"):
            w.count_decline("no_such_reason")
    finally:
        w.unlink()
