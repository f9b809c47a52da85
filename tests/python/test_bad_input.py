"""Malformed stubs and bad arguments raise typed errors; nothing crashes the process.

Every case runs in one fresh interpreter (importing torch costs seconds here, so the cases
share it): the child prints ``START <case>`` before each case and one JSON result line after
it, so a crash (a negative return code) still names the case that caused it.
"""

from __future__ import annotations

import gc
import json

import pytest
import torch

_CHILD = r"""
import gc, json, pickle, sys
import torch
from vllm_shm_arena import (
    ShmTensorArena, ArenaHandle, _TENSOR_ARENAS, _rebuild_arena_tensor, dumps, loads,
)

w = ShmTensorArena.create(1, 2, 4 << 20)
r = ShmTensorArena.attach(w.handle(), 0)
slot, gen = w.write(torch.arange(1024, dtype=torch.float32))
N = w.name
OK = (N, slot, gen, 4096, "float32", (1024,))

def stub(**kw):
    names = ("name", "slot", "gen", "nbytes", "dtype", "shape")
    args = dict(zip(names, OK))
    args.update(kw)
    return lambda: _rebuild_arena_tensor(*(args[n] for n in names))

def never_attached():
    # This process is the writer of a second arena but never attached it as a reader.
    w2 = ShmTensorArena.create(1, 1, 16 << 20)
    try:
        data, bufs = dumps(torch.zeros(8 << 20, dtype=torch.uint8), w2)
        assert bufs == []  # an arena stub, not bytes
        print("NAME", w2.name, flush=True)
        loads(data, bufs)
    finally:
        w2.close()

def gced():
    w3 = ShmTensorArena.create(1, 1, 1 << 20)
    try:
        r3 = ShmTensorArena.attach(w3.handle(), 0)
        s3, g3 = w3.write(torch.ones(4))
        name = w3.name
        del r3
        gc.collect()
        assert name not in _TENSOR_ARENAS
        print("NAME", name, flush=True)
        _rebuild_arena_tensor(name, s3, g3, 16, "float32", (4,))
    finally:
        w3.close()

def attach_missing():
    ShmTensorArena.attach(ArenaHandle("vsa_no_such_arena_0", 1, 2, 4 << 20, w.handle().dir), 0)

CASES = {
    "unknown_arena_name": stub(name="vsa_never_attached_here"),
    "never_attached_pickled_stub": never_attached,
    "garbage_collected_arena": gced,
    "slot_out_of_range": stub(slot=7),
    "slot_beyond_uint32": stub(slot=1 << 32),
    "stale_generation": stub(gen=gen + 1000),
    "generation_zero": stub(gen=0),
    "free_slot": stub(slot=1 - slot),
    "nbytes_larger_than_slot": stub(nbytes=8 << 20, shape=(2 << 20,)),
    "nbytes_not_prod_shape": stub(nbytes=4000),
    "shape_not_matching_nbytes": stub(shape=(1000,)),
    "unknown_dtype": stub(dtype="float99"),
    "dtype_not_a_string": stub(dtype=7),
    "negative_dimension": stub(shape=(-1024,)),
    "overflowing_shape": stub(shape=(1 << 40, 1 << 40)),
    "slot_as_string": stub(slot="0"),
    "generation_as_string": stub(gen="1"),
    "nbytes_as_string": stub(nbytes="4096"),
    "shape_as_string": stub(shape="1024"),
    "dimension_as_string": stub(shape=("1024",)),
    "slot_as_float": stub(slot=0.0),
    "slot_huge_negative": stub(slot=-(1 << 70)),
    "generation_beyond_int63": stub(gen=1 << 63),
    "generation_beyond_uint64": stub(gen=1 << 70),
    "nbytes_beyond_2_62": stub(nbytes=1 << 62),
    "dimension_beyond_int64": stub(shape=(1 << 64,)),
    "dimension_as_bool": stub(shape=(True,)),
    "shape_as_dict": stub(shape={1024: 1}),
    "offset_negative": lambda: _rebuild_arena_tensor(*OK, -1),
    "offset_as_string": lambda: _rebuild_arena_tensor(*OK, "0"),
    "offset_beyond_slot": lambda: _rebuild_arena_tensor(*OK, 1 << 40),
    "dtype_not_utf8": stub(dtype="\udcff"),
    "attach_nonexistent_name": attach_missing,
    "attach_rank_out_of_range": lambda: ShmTensorArena.attach(w.handle(), 5),
    "attach_not_a_handle": lambda: ShmTensorArena.attach("vsa_x", 0),
    "create_absurd_size": lambda: ShmTensorArena.create(1, 1 << 16, 1 << 36),
    "create_zero_readers": lambda: ShmTensorArena.create(0, 1, 1 << 20),
    "reader_writes": lambda: r.write_tensor(torch.zeros(4)),
    "writer_reads": lambda: w.get_tensor(slot, 4096, torch.float32, (1024,), gen),
    "get_tensor_dtype_not_dtype": lambda: r.get_tensor(slot, 4096, "float32", (1024,), gen),
}

for name, fn in CASES.items():
    print("START", name, flush=True)
    try:
        out = fn()
        res = {"case": name, "type": None, "msg": f"returned {type(out).__name__}"}
    except BaseException as e:
        res = {"case": name, "type": type(e).__name__, "msg": str(e)}
    print("RESULT " + json.dumps(res), flush=True)

# The arena still works after all of that.
t = _rebuild_arena_tensor(*OK)
assert torch.equal(t, torch.arange(1024, dtype=torch.float32))
r.close()
w.close()  # unlinks the name (a writer that is only dropped leaves it in /dev/shm)
print("DONE", flush=True)
"""

#: case -> (exception type, substrings the message must contain).
EXPECTED = {
    "unknown_arena_name": ("RuntimeError", ["vsa_never_attached_here", "attach"]),
    "never_attached_pickled_stub": ("RuntimeError", ["<NAME>", "not attached"]),
    "garbage_collected_arena": ("RuntimeError", ["<NAME>"]),
    "slot_out_of_range": ("IndexError", ["slot_idx 7", "out of range"]),
    "slot_beyond_uint32": ("IndexError", ["4294967296"]),
    "stale_generation": ("ValueError", ["stale", "generation"]),
    "generation_zero": ("ValueError", ["generation"]),
    "free_slot": ("ValueError", ["stale"]),
    "nbytes_larger_than_slot": ("ValueError", ["8388608", "larger than a slot"]),
    "nbytes_not_prod_shape": ("ValueError", ["nbytes 4000", "does not match"]),
    "shape_not_matching_nbytes": ("ValueError", ["does not match", "1000"]),
    "unknown_dtype": ("ValueError", ["float99"]),
    "dtype_not_a_string": ("ValueError", ["dtype", "7"]),
    "negative_dimension": ("ValueError", ["-1024"]),
    "overflowing_shape": ("ValueError", ["too large"]),
    "slot_as_string": ("ValueError", ["slot_idx", "'0'"]),
    "generation_as_string": ("ValueError", ["generation", "'1'"]),
    "nbytes_as_string": ("ValueError", ["nbytes", "'4096'"]),
    "shape_as_string": ("ValueError", ["shape", "'1024'"]),
    "dimension_as_string": ("ValueError", ["shape", "'1024'"]),
    "slot_as_float": ("ValueError", ["slot_idx", "0.0"]),
    "slot_huge_negative": ("ValueError", ["slot_idx", str(-(1 << 70))]),
    "generation_beyond_int63": ("ValueError", ["generation", str(1 << 63)]),
    "generation_beyond_uint64": ("ValueError", ["generation", str(1 << 70)]),
    "nbytes_beyond_2_62": ("ValueError", ["nbytes", "too large"]),
    "dimension_beyond_int64": ("ValueError", [str(1 << 64), "too large"]),
    "dimension_as_bool": ("ValueError", ["shape", "True"]),
    "shape_as_dict": ("ValueError", ["shape", "1024"]),
    "offset_negative": ("ValueError", ["offset", "-1"]),
    "offset_as_string": ("ValueError", ["offset", "'0'"]),
    "offset_beyond_slot": ("ValueError", ["offset", "beyond a slot"]),
    "dtype_not_utf8": ("ValueError", ["unknown dtype string"]),
    "attach_nonexistent_name": ("OSError", ["vsa_no_such_arena_0"]),
    "attach_rank_out_of_range": ("IndexError", ["5"]),
    "attach_not_a_handle": ("TypeError", ["ArenaHandle"]),
    "create_absurd_size": ("OSError", ["--shm-size", "/dev/shm"]),
    "create_zero_readers": ("ValueError", ["n_readers", "0"]),
    "reader_writes": ("RuntimeError", ["reader"]),
    "writer_reads": ("RuntimeError", ["writer"]),
    "get_tensor_dtype_not_dtype": ("TypeError", ["dtype"]),
}

KNOWN_BUGS: dict[str, str] = {}


@pytest.fixture(scope="module")
def child_results(run_py):
    """Runs every case once in a fresh interpreter -> (rc, results, stdout, stderr, last)."""
    rc, out, err = run_py(_CHILD, timeout=240)
    results, names = {}, {}
    last = None
    for line in out.splitlines():
        if line.startswith("START "):
            last = line.split(" ", 1)[1]
        elif line.startswith("NAME "):
            names[last] = line.split(" ", 1)[1]
        elif line.startswith("RESULT "):
            res = json.loads(line[len("RESULT ") :])
            res["name"] = names.get(res["case"])
            results[res["case"]] = res
    return rc, results, out, err, last


def test_child_exits_cleanly(child_results):
    rc, results, out, err, last = child_results
    assert rc == 0, f"child died with rc={rc} during case {last!r}\n{out[-2000:]}\n{err[-4000:]}"
    assert "DONE" in out
    assert set(results) == set(EXPECTED)


@pytest.mark.parametrize(
    "case",
    [
        pytest.param(c, marks=pytest.mark.xfail(strict=True, reason=KNOWN_BUGS[c]))
        if c in KNOWN_BUGS
        else c
        for c in EXPECTED
    ],
)
def test_bad_input_raises_typed_error(child_results, case):
    rc, results, out, err, last = child_results
    assert case in results, f"case {case} never reported (child rc={rc}, last={last!r})\n{err}"
    res = results[case]
    want_type, want_parts = EXPECTED[case]
    assert res["type"] == want_type, res
    for part in want_parts:
        part = part.replace("<NAME>", res["name"] or "<missing NAME line>")
        assert part in res["msg"], (part, res)


def test_a_handle_is_checked_against_the_arena_it_names(tmp_path):
    """A handle whose geometry differs from the arena's header is refused, naming the field,
    and the refused attach leaves the rank free for the right handle."""
    import dataclasses

    import torch

    from vllm_shm_arena import ShmTensorArena

    w = ShmTensorArena.create(2, num_slots=2, slot_bytes=1 << 20, shm_dir=str(tmp_path))
    good = w.handle()
    queued = torch.arange(1024, dtype=torch.int32)
    slot = w.write_tensor(queued)  # already sent to rank 0, which has not attached yet
    for field, value in (
        ("n_readers", 3),
        ("num_slots", 8),
        ("slot_bytes", 4096),
        ("policy", "variable"),
    ):
        bad = dataclasses.replace(good, **{field: value})
        with pytest.raises(ValueError, match=field):
            ShmTensorArena.attach(bad, 0)
    assert w.stats()["holdings"][0]["state"] == "never_attached"  # the rank is untouched
    r = ShmTensorArena.attach(good, 0)
    assert r.num_slots == 2
    assert torch.equal(r.get_tensor(slot, queued.nbytes, torch.int32, queued.shape), queued)
    r.close()
    w.close()


@pytest.mark.parametrize(
    "corrupt",
    ["count", "length", "short"],
)
def test_a_corrupt_blob_gives_a_typed_error_and_is_released(make_arena, corrupt):
    """A message packed into an arena blob is shared memory another process may rewrite: a
    count or a frame length that overruns what was written is refused with ValueError, nothing
    outside the allocation is read, and the allocation is released either way."""
    import struct

    a = make_arena(n_readers=2, num_slots=2, slot_bytes=1 << 20)
    w, r, other = a.writer, a.readers[0], a.readers[1]
    frames = [b"head", b"x" * 1000]
    slot, gen, nbytes = w.write_blob(frames, 1 << 20)
    assert [bytes(f) for f in r.read_blob(slot, gen, nbytes)] == frames
    slot, gen, nbytes = w.write_blob(frames, 1 << 20)
    view = other.get_tensor(slot, nbytes, torch.uint8, [nbytes], generation=gen)
    raw = view.numpy()
    if corrupt == "count":
        raw[:4] = list(struct.pack("<I", 1 << 30))
    elif corrupt == "length":
        raw[4 + 8 : 4 + 16] = list(struct.pack("<Q", 1 << 62))
    del view, raw  # the other reader rewrote the blob (any process mapping it can)
    gc.collect()
    with pytest.raises(ValueError, match="corrupt|overruns|short"):
        # "short": the stub claims fewer bytes than the framing needs.
        r.read_blob(slot, gen, 3 if corrupt == "short" else nbytes)
    assert r.stats()["held"] == 0
    assert w.write_blob([b"too big"], 4) is None  # over max_bytes: declined
