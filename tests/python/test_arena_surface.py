"""What the arena offers the pickler and a transport, and the pickler's pools: stub resolution
in a reader's context (``resolving_stubs``), giving back an unsent message's allocations,
blobs, ``stats(holdings=False)``, ``needs_flush``, and the idle picklers and C reducers
pickler.py keeps per writer arena (reused, capped, never keeping the arena alive)."""

from __future__ import annotations

import gc
import io
import pickle
import weakref

import pytest
import torch

from vllm_shm_arena import ShmTensorArena, dumps
from vllm_shm_arena import arena as arena_mod
from vllm_shm_arena import pickler as pickler_mod
from vllm_shm_arena.pickler import _ArenaPickler, _pools, dump_message

MiB = 1 << 20


def _current():
    return getattr(arena_mod._CURRENT_READER, "arena", None)


# ------------------------------------------------------------------ resolving_stubs
def test_stubs_resolve_to_the_reader_of_the_block(make_arena):
    a = make_arena(n_readers=2)  # two ranks of one arena in one process share its name
    r0, r1 = a.readers
    data, bufs = dumps(torch.ones(3 << 20), a.writer)  # 12 MiB: into the arena
    held = [r.stats()["held"] for r in (r0, r1)]
    with arena_mod.resolving_stubs(r0) as got:
        assert got is r0
        t0 = pickle.loads(data, buffers=bufs)
    with arena_mod.resolving_stubs(r1):
        t1 = pickle.loads(data, buffers=bufs)
    assert [r.stats()["held"] for r in (r0, r1)] == [held[0] + 1, held[1] + 1]
    assert torch.equal(t0, t1)
    del t0, t1


def test_blocks_nest_and_the_previous_reader_comes_back_even_on_an_exception(make_arena):
    a = make_arena(n_readers=2)
    r0, r1 = a.readers
    assert _current() is None
    with arena_mod.resolving_stubs(r0):
        with pytest.raises(KeyError):
            with arena_mod.resolving_stubs(r1):
                assert _current() is r1
                raise KeyError("inside")
        assert _current() is r0
    assert _current() is None


def test_only_a_reader_arena_can_resolve_stubs(arena):
    with pytest.raises(TypeError, match="reader ShmTensorArena"):
        arena_mod.resolving_stubs(arena.writer)
    with pytest.raises(TypeError, match="reader ShmTensorArena"):
        arena_mod.resolving_stubs("vsa_x")
    assert _current() is None


# ------------------------------------------------------------------ for a transport
def test_an_unsent_messages_allocations_go_back_even_after_close(arena, rand):
    t = rand((3 << 20,), torch.float32)
    slot, gen = arena.writer.write(t)
    assert arena.writer.stats()["in_use"] == 1
    arena.writer.close()
    arena.writer.give_back_unsent([(slot, gen)])
    s = arena.writer.stats()
    assert s["in_use"] == 0 and s["aborted"] == 1


def test_a_blob_carries_a_whole_message_and_is_released_once_read(tmp_path):
    w = ShmTensorArena.create(1, policy="variable", arena_bytes=16 * MiB, shm_dir=str(tmp_path))
    r = ShmTensorArena.attach(w.handle(), 0)
    try:
        frames = [b"", b"pickle", bytes(range(256)) * 100]
        slot, gen, nbytes = w.write_blob(frames, MiB)
        assert w.stats()["in_use"] == 1
        assert [bytes(f) for f in r.read_blob(slot, gen, nbytes)] == frames
        w.reclaim()
        assert w.stats()["in_use"] == 0
        assert w.write_blob([b"x" * (2 * MiB)], MiB) is None  # beyond the limit: declined
        with pytest.raises(RuntimeError, match="writer"):
            w.read_blob(slot, gen, nbytes)
        with pytest.raises(RuntimeError, match="reader"):
            r.write_blob(frames, MiB)
    finally:
        r.close()
        w.close()


def test_stats_can_leave_the_holdings_walk_out(arena):
    assert "holdings" in arena.writer.stats()
    light = arena.writer.stats(holdings=False)
    assert "holdings" not in light and "dead_readers" in light and "liveness_unknown" in light


def test_a_reader_needs_no_flush_before_anything_was_pinned(arena, monkeypatch):
    monkeypatch.setattr(arena_mod, "_PIN_ENABLED", False)
    assert arena.reader.needs_flush is False
    data, bufs = dumps(torch.ones(3 << 20), arena.writer)
    t = pickle.loads(data, buffers=bufs)
    assert arena.reader.needs_flush is False  # not pinned: released at free, no flush
    assert arena.reader.flush_releases() == 0
    del t


# ------------------------------------------------------------------ the pickler's pools
def test_a_pickler_is_reused_across_messages_and_holds_no_arena_while_idle(arena, rand):
    dump_message({"t": rand((3 << 20,), torch.float32)}, arena.writer)
    pools = _pools(arena.writer)
    (idle,) = pools._picklers
    assert idle[0].arena is None, "an idle pickler keeps its arena alive"
    dump_message({"t": 1}, arena.writer)
    assert pools._picklers[0][0] is idle[0]


def test_a_pickler_that_failed_mid_dump_is_not_reused(arena, rand):
    class Boom:
        def __reduce__(self):
            raise ValueError("unpicklable")

    dump_message({"t": 1}, arena.writer)
    (idle,) = _pools(arena.writer)._picklers
    with pytest.raises(ValueError, match="unpicklable"):
        dump_message({"t": rand((3 << 20,), torch.float32), "x": Boom()}, arena.writer)
    assert _pools(arena.writer)._picklers == []
    assert arena.writer.stats()["aborted"] == 1  # its slot went back
    dump_message({"t": 1}, arena.writer)
    assert _pools(arena.writer)._picklers[0][0] is not idle[0]


def test_c_reducers_are_pooled_per_arena_at_the_default_threshold_only(arena):
    f = io.BytesIO()
    p = _ArenaPickler(f, arena.writer)
    reducer = p.reducer_override
    p.release()
    p.release()  # once only
    assert len(_pools(arena.writer)._reducers) == 1
    q = _ArenaPickler(f, arena.writer)
    assert q.reducer_override is reducer  # the pooled one
    q.release()
    other = _ArenaPickler(f, arena.writer, min_bytes=1)
    assert other.reducer_override is not reducer
    other.release()  # another threshold: not pooled
    assert len(_pools(arena.writer)._reducers) == 1


def test_the_pools_are_capped(arena):
    f = io.BytesIO()
    ps = [_ArenaPickler(f, arena.writer) for _ in range(pickler_mod._POOL_SIZE + 3)]
    for p in ps:
        p.release()
    assert len(_pools(arena.writer)._reducers) == pickler_mod._POOL_SIZE


def test_the_pools_never_keep_their_arena_alive(tmp_path, rand):
    w = ShmTensorArena.create(1, 2, 16 * MiB, shm_dir=str(tmp_path))
    r = ShmTensorArena.attach(w.handle(), 0)
    dump_message({"t": rand((3 << 20,), torch.float32)}, w)
    assert w in pickler_mod._POOLS
    ref = weakref.ref(w)
    r.close()
    w.close()
    del w, r
    gc.collect()
    assert ref() is None, "the pickler's pools kept the arena alive"
