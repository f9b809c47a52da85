"""The pickler layer: ``dumps``/``loads`` with and without an arena, and the C reducer's
divert decision against its Python oracle (tests/python/reducer_oracle.py)."""

from __future__ import annotations

import io
import pickle

import pytest
import torch

from vllm_shm_arena import MIN_BYTES, _ArenaPickler, dumps, loads

MiB = 1 << 20


class MyT(torch.Tensor):
    """A Tensor subclass (module level so pickle can find it)."""


def arena_dumps(obj, writer, min_bytes=MIN_BYTES):
    """dumps through an _ArenaPickler with a chosen threshold -> (data, buffers, diverted)."""
    buffers: list = []
    f = io.BytesIO()
    p = _ArenaPickler(f, writer, buffer_callback=buffers.append, min_bytes=min_bytes)
    p.dump(obj)
    return f.getvalue(), buffers, p.diverted


def big(rand, dtype, nbytes=8 * MiB):
    """A random 2-D tensor of exactly ``nbytes`` (MIN_BYTES by default: dumps diverts it)."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    return rand((nbytes // itemsize // 1024, 1024), dtype)


def test_the_installed_reducer_is_the_c_one(arena):
    p = _ArenaPickler(io.BytesIO(), arena.writer)
    assert type(p.reducer_override).__name__ == "builtin_function_or_method"


# ------------------------------------------------------------------------ out-of-band only
def test_oob_roundtrip_every_dtype(rand, same_bytes, dtype):
    t = rand((17, 129), dtype)
    data, bufs = dumps({"t": t, "n": 3})
    assert len(bufs) == 1 and len(data) < 512, "tensor bytes should travel out of band"
    got = loads(data, bufs)
    assert got["n"] == 3
    same_bytes(got["t"], t)


def test_oob_roundtrip_zero_dim_every_dtype(rand, same_bytes, dtype):
    t = rand((), dtype)
    got = loads(*dumps(t))
    assert got.dim() == 0
    same_bytes(got, t)


@pytest.mark.parametrize("shape", [(0,), (4, 0), (0, 3, 0)])
def test_oob_roundtrip_empty(same_bytes, shape, dtype):
    t = torch.empty(shape, dtype=dtype)
    same_bytes(loads(*dumps(t)), t)


def test_oob_non_contiguous_and_offset_views(rand, same_bytes):
    base = rand((64, 96), torch.float32)
    for v in (base.t(), base[3:9, ::5], base[10], base.unsqueeze(0).expand(3, 64, 96)):
        same_bytes(loads(*dumps(v)), v.contiguous())


# ------------------------------------------------------------------------ through the arena
def test_arena_roundtrip_every_dtype(arena, rand, same_bytes, dtype):
    t = big(rand, dtype)
    small = rand((7,), dtype)
    data, bufs = dumps([t, small, "x"], arena.writer)
    assert arena.writer.stats()["hits"] == 1
    assert len(bufs) == 1  # only the small tensor went out of band
    got = loads(data, bufs)
    same_bytes(got[0], t)
    same_bytes(got[1], small)
    assert got[2] == "x"
    del got
    assert arena.in_use() == 0


def test_arena_roundtrip_zero_dim_and_empty_at_min_bytes_zero(make_arena, rand, same_bytes):
    """With min_bytes=0 even 0-dim and empty tensors take slots (nbytes 0 is allowed)."""
    arena = make_arena(num_slots=3, slot_bytes=MiB)
    msg = [rand((), torch.float64), torch.empty(0, 5, dtype=torch.int16), rand((3,), torch.bool)]
    data, bufs, diverted = arena_dumps(msg, arena.writer, min_bytes=0)
    arena.writer.reclaim()
    assert bufs == [] and len(diverted) == 3 and arena.writer.stats()["hits"] == 3
    got = loads(data, bufs)
    for g, w in zip(got, msg, strict=True):
        same_bytes(g, w)
    del got, g
    assert arena.in_use() == 0


def test_same_tensor_twice_takes_one_slot(arena, rand, same_bytes):
    t = big(rand, torch.float32)
    got = loads(*dumps([t, t, {"again": t}], arena.writer))
    assert arena.writer.stats()["hits"] == 1
    assert got[0] is got[1] is got[2]["again"]
    same_bytes(got[0], t)


def test_message_with_many_tensors(make_arena, rand, same_bytes):
    a = make_arena(num_slots=3, slot_bytes=4 * MiB)
    ts = {f"w{i}": big(rand, torch.float16, 2 * MiB) for i in range(3)}
    msg = {"tensors": ts, "ints": list(range(100)), "small": rand((3, 3), torch.float32)}
    data, bufs, diverted = arena_dumps(msg, a.writer, min_bytes=MiB)
    assert len(diverted) == 3 and len(bufs) == 1
    got = loads(data, bufs)
    for k, t in ts.items():
        same_bytes(got["tensors"][k], t)
    same_bytes(got["small"], msg["small"])
    assert got["ints"] == msg["ints"]


# ------------------------------------------------------------------------ conj / neg views
@pytest.mark.parametrize("with_arena", [False, True], ids=["oob", "arena"])
@pytest.mark.parametrize("kind", ["conj", "neg"])
def test_conj_and_neg_views_keep_values(arena, rng, kind, with_arena):
    # Real values (no NaN from random bytes): the check compares values, not bytes.
    if kind == "conj":
        v = torch.randn(MiB, dtype=torch.complex64, generator=rng).conj()
        assert v.is_conj()
    else:
        v = torch._neg_view(torch.randn(2 * MiB, generator=rng))
        assert v.is_neg()
    want = v.resolve_conj().resolve_neg().clone()
    got = loads(*dumps(v, arena.writer if with_arena else None))
    assert torch.equal(got.resolve_conj().resolve_neg(), want)
    if with_arena:
        s = arena.writer.stats()
        assert s["declined"]["unsupported"] == 1
        assert s["hits"] == 0


# ------------------------------------------------------------------------ Parameter, subclass
def test_parameter_without_grad_goes_through_arena(arena, rand, same_bytes):
    t = big(rand, torch.bfloat16)
    got = loads(*dumps(torch.nn.Parameter(t, requires_grad=False), arena.writer))
    assert type(got) is torch.nn.Parameter
    assert got.requires_grad is False
    assert arena.writer.stats()["hits"] == 1
    same_bytes(got.data, t)


def test_parameter_with_grad_roundtrips(arena, rand, same_bytes):
    t = big(rand, torch.float32)
    p = torch.nn.Parameter(t.clone(), requires_grad=True)
    got = loads(*dumps(p, arena.writer))
    assert type(got) is torch.nn.Parameter
    assert got.requires_grad is True
    same_bytes(got.detach(), t)
    assert arena.writer.stats()["declined"]["unsupported"] >= 1


def test_parameter_with_grad_is_not_diverted(arena, rand):
    p = torch.nn.Parameter(big(rand, torch.float32), requires_grad=True)
    got = loads(*dumps(p, arena.writer))
    assert arena.writer.stats()["hits"] == 0, "the Parameter's bytes went into a slot"
    assert arena.reader.stats()["held"] == 0
    del got


def test_tensor_subclass_keeps_type_and_is_not_diverted(arena, rand, same_bytes):
    t = big(rand, torch.float32)
    m = t.clone().as_subclass(MyT)
    got = loads(*dumps(m, arena.writer))
    assert type(got) is MyT
    same_bytes(got.as_subclass(torch.Tensor), t)
    assert arena.writer.stats()["hits"] == 0
    assert arena.in_use() == 0


# ------------------------------------------------------------------------ declines
def test_decline_too_small(arena, rand, same_bytes):
    t = big(rand, torch.float32, MIN_BYTES - 4096)
    got = loads(*dumps(t, arena.writer))
    same_bytes(got, t)
    s = arena.writer.stats()
    assert s["declined"]["too_small"] == 1 and s["hits"] == 0


def test_decline_not_contiguous(arena, rand, same_bytes):
    t = big(rand, torch.float32).t()
    assert not t.is_contiguous()
    data, bufs = dumps(t, arena.writer)
    assert len(bufs) == 1
    same_bytes(loads(data, bufs), t.contiguous())
    s = arena.writer.stats()
    assert s["declined"]["not_contiguous"] == 1 and s["hits"] == 0


def test_decline_oversize(make_arena, rand, same_bytes):
    a = make_arena(num_slots=2, slot_bytes=4 * MiB)
    t = big(rand, torch.int32, 4 * MiB + 4096)
    data, bufs, diverted = arena_dumps(t, a.writer, min_bytes=MiB)
    assert diverted == [] and len(bufs) == 1
    same_bytes(loads(data, bufs), t)
    assert a.declined()["oversize"] == 1


def test_decline_no_free_slot(make_arena, rand, same_bytes):
    a = make_arena(num_slots=1, slot_bytes=4 * MiB)
    t1, t2 = big(rand, torch.uint8, 2 * MiB), big(rand, torch.uint8, 2 * MiB)
    held = loads(*arena_dumps(t1, a.writer, min_bytes=MiB)[:2])  # holds the only slot
    data, bufs, diverted = arena_dumps(t2, a.writer, min_bytes=MiB)
    assert diverted == [] and len(bufs) == 1
    same_bytes(loads(data, bufs), t2)
    assert a.declined()["no_free_slot"] == 1
    same_bytes(held, t1)
    del held
    data, bufs, diverted = arena_dumps(t2, a.writer, min_bytes=MiB)
    assert len(diverted) == 1 and bufs == []
    same_bytes(loads(data, bufs), t2)


class _Sub(torch.Tensor):
    """A tensor subclass: the arena must leave it to pickle (exact types only)."""


def _random_object(g: torch.Generator, min_bytes: int):
    """One object of a message: a tensor around the divert threshold in every shape the
    decision cares about (dtype, layout, contiguity, conj/neg bits, grad, subclass), or not a
    tensor at all."""

    def pick(seq):
        return seq[int(torch.randint(len(seq), (1,), generator=g))]

    kind = pick(["tensor", "tensor", "tensor", "parameter", "subclass", "other"])
    if kind == "other":
        return pick([None, 3, "text", [1, 2], {"k": 1.5}])
    dtype = pick([torch.float32, torch.float16, torch.bfloat16, torch.uint8, torch.complex64])
    itemsize = torch.empty((), dtype=dtype).element_size()
    nbytes = pick([min_bytes // 2, min_bytes - itemsize, min_bytes, 2 * min_bytes, 5 * min_bytes])
    n = max(1, nbytes // itemsize)
    t = torch.zeros(n, dtype=dtype)
    view = pick(["plain", "strided", "transposed", "conj", "neg", "grad"])
    if view == "strided" and n >= 2:
        t = t[::2]
    elif view == "transposed" and n >= 4:
        t = t[: n - n % 2].reshape(2, -1).t()
    elif view == "conj" and dtype.is_complex:
        t = t.conj()
    elif view == "neg" and dtype.is_complex:
        t = torch._neg_view(t)
    elif view == "grad" and dtype.is_floating_point:
        t = t.requires_grad_(True)
    if kind == "parameter":
        return torch.nn.Parameter(t.detach(), requires_grad=t.requires_grad)
    if kind == "subclass":
        return t.detach().as_subclass(_Sub)
    return t


def test_the_c_reducer_decides_as_the_oracle_on_random_objects(make_arena, seed):
    """The divert decision exists once, in C; tests/python/reducer_oracle.py writes it out in
    Python. On random objects (seeded) the two agree: every object is diverted, passed on, or
    declined with the reason the oracle names."""
    from reducer_oracle import expected_all

    g = torch.Generator().manual_seed(seed)
    a = make_arena(num_slots=64, slot_bytes=4 * MiB)
    min_bytes = MiB
    for i in range(400):
        obj = _random_object(g, min_bytes)
        want = expected_all(obj, min_bytes, a.writer.slot_bytes)
        before = a.declined()
        _, _, diverted = arena_dumps(obj, a.writer, min_bytes=min_bytes)
        after = a.declined()
        counted = {k: after[k] - before[k] for k in after if after[k] != before[k]}
        want_counted: dict = {}
        for d in want:
            if d not in ("divert", "pass"):
                want_counted[d] = want_counted.get(d, 0) + 1
        assert (len(diverted), counted) == (want.count("divert"), want_counted), (
            i,
            type(obj).__name__,
            getattr(obj, "shape", None),
            want,
            f"{diverted=} {counted=}",
        )
        a.writer.give_back_unsent(diverted)


# ------------------------------------------------------------------------ commit after dump
def test_failed_dump_gives_every_slot_back(make_arena, rand, same_bytes):
    a = make_arena(num_slots=2, slot_bytes=16 * MiB)
    t1, t2 = big(rand, torch.float32), big(rand, torch.int8)
    with pytest.raises((pickle.PicklingError, AttributeError, TypeError)):
        dumps([t1, t2, lambda: 0], a.writer)
    s = a.writer.stats()
    assert s["in_use"] == 0
    assert s["aborted"] == 2
    data, bufs = dumps([t1, t2], a.writer)  # both slots are usable again
    assert a.writer.stats()["hits"] == 2
    got = loads(data, bufs)
    same_bytes(got[0], t1)
    same_bytes(got[1], t2)


def test_failed_dump_leaves_counters_consistent(make_arena, rand):
    a = make_arena(num_slots=2, slot_bytes=16 * MiB)
    with pytest.raises((pickle.PicklingError, AttributeError, TypeError)):
        dumps([big(rand, torch.float32), big(rand, torch.float32), lambda: 0], a.writer)
    s = a.writer.stats()
    assert s["hits"] == 0
    got = {k: s[k] for k in ("bytes", "cold_copies", "warm_copies", "cold_bytes", "warm_bytes")}
    assert got == dict.fromkeys(got, 0)


def test_failed_loads_releases_acquired_stub(arena, rand):
    """A loads that fails after rebuilding the arena tensor drops it, releasing the slot."""
    t = big(rand, torch.float32)
    data, bufs = dumps([t, rand((5,), torch.float32)], arena.writer)
    assert len(bufs) == 1
    with pytest.raises(pickle.UnpicklingError):
        loads(data, [])  # the stub is rebuilt first, then the missing buffer fails
    assert arena.in_use() == 0


def test_unacquired_stub_released_by_release_unacquired(arena, rand):
    """A loads that fails before reaching the stub never acquires it: the transport gives
    it back with release_unacquired (and a second call is a no-op)."""
    t = big(rand, torch.float32)
    data, bufs, diverted = arena_dumps([rand((5,), torch.float32), t], arena.writer)
    with pytest.raises(pickle.UnpicklingError):
        loads(data, [])
    assert arena.in_use() == 1
    (slot, gen) = diverted[0]
    arena.reader.release_unacquired(slot, gen)
    arena.reader.release_unacquired(slot, gen)
    assert arena.in_use() == 0


# ------------------------------------------------------------------------ per-layout threshold
def test_divert_threshold_is_per_layout(make_arena, rand, same_bytes, tmp_path):
    """A tensor between the variable layout's threshold and the fixed layout's 8 MiB is
    diverted by a variable arena and sent out of band by a fixed one."""
    from vllm_shm_arena import ShmTensorArena
    from vllm_shm_arena.arena import VARIABLE_MIN_BYTES

    fixed = make_arena(num_slots=2, slot_bytes=16 * MiB)
    var = ShmTensorArena.create(1, policy="variable", arena_bytes=32 * MiB, shm_dir=str(tmp_path))
    var_reader = ShmTensorArena.attach(var.handle(), 0)
    try:
        assert fixed.writer.min_bytes == MIN_BYTES == 8 * MiB
        assert var.min_bytes == VARIABLE_MIN_BYTES < MIN_BYTES
        between = big(rand, torch.float32, VARIABLE_MIN_BYTES)  # the smallest size diverted
        below = big(rand, torch.float32, VARIABLE_MIN_BYTES - 4096)

        got = loads(*dumps(between, var))
        same_bytes(got, between)
        assert var.stats()["hits"] == 1
        del got
        got = loads(*dumps(below, var))
        same_bytes(got, below)
        assert var.stats()["hits"] == 1 and var.stats()["declined"]["too_small"] == 1

        got = loads(*dumps(between, fixed.writer))
        same_bytes(got, between)
        assert fixed.writer.stats()["hits"] == 0
        assert fixed.declined()["too_small"] == 1
    finally:
        var_reader.close()
        var.close()
