"""The frontend arena's primitives (vllm_shm_arena.frontend): an item's tensor is copied into
a loan once on the API server's side, goes as a ~100-byte stub (one counted send) while the
engine core is attached, and comes back as a zero-copy tensor there; sends of a message that
did not go are taken back; every stub field is checked; the handle survives the environment.
With vLLM importable, the same round trip through vLLM's own MsgpackEncoder/MsgpackDecoder.
"""

from __future__ import annotations

import gc
import json

import pytest
import torch

from vllm_shm_arena import frontend
from vllm_shm_arena.frontend import FrontendWriter, StubProvider

MiB = 1 << 20


@pytest.fixture
def ends():
    w = FrontendWriter(2, 32 * MiB, max_allocations=64)
    p = StubProvider(w.handle())
    yield w, p
    p.close()
    w.arena.close()


def _in_use(w) -> int:
    w.arena.reclaim(check_liveness=False)
    return w.arena.stats(holdings=False)["in_use"]


def test_one_copy_then_stubs_then_zero_copy(ends):
    w, p = ends
    assert w.holder_attached() and w.arena.reader_state(1) == "never_attached"
    src = torch.arange(3 * MiB // 4, dtype=torch.int32).reshape(3, -1)
    small = torch.ones(16)
    loan = w.fill(src)
    assert loan is not src and torch.equal(loan, src)
    assert w.fill(small) is None and w.fill(3) is None  # too small / not a tensor: left as is
    assert w.counters["filled"] == 1 and w.counters["filled_bytes"] == src.nbytes
    # Not contiguous: left as is, and a decline the arena counts (its metrics' reason).
    assert w.fill(torch.ones(2 * MiB, dtype=torch.uint8)[::2]) is None
    assert w.arena.stats(holdings=False)["declined"]["not_contiguous"] == 1
    assert w.counters["declined"] == 1
    c = w.consumer()
    c.new_message()
    stub = c(loan)
    assert stub is not None and frontend.is_stub(stub)
    assert len(json.dumps(stub)) < 120
    assert c(small) is None and c(src) is None  # not loans: sent as usual
    assert c.sends_of_message() == [(stub["slot"], stub["gen"])]
    got = p("int32", [3, MiB // 4], stub)
    assert torch.equal(got, src)
    loan[0, 0] = -7  # the same pages: zero-copy
    assert int(got[0, 0]) == -7
    del loan
    gc.collect()
    assert _in_use(w) == 1  # the engine core's tensor holds it
    del got
    gc.collect()
    assert _in_use(w) == 0


def test_the_name_may_go_only_once_every_rank_joined(ends):
    from vllm_shm_arena.arena import ShmTensorArena

    w, _p = ends  # the engine core (reader 0) is attached; the workers not yet
    assert not w.everyone_joined()
    workers = [ShmTensorArena.attach(w.handle(), rank) for rank in (1, 2)]
    assert w.everyone_joined()
    workers[0].close()
    assert w.everyone_joined()  # a worker that left does not bring the name back
    workers[1].close()


def test_a_hit_sends_the_same_loan_again_and_both_are_owed(ends):
    w, p = ends
    loan = w.fill(torch.full((2 * MiB,), 5, dtype=torch.uint8))
    c = w.consumer()
    stubs = []
    for _ in range(2):
        c.new_message()
        stubs.append(c(loan))
    assert stubs[0] == stubs[1]
    a = p("uint8", [2 * MiB], stubs[0])
    b = p("uint8", [2 * MiB], stubs[1])
    del loan, a
    gc.collect()
    assert _in_use(w) == 1
    del b
    gc.collect()
    assert _in_use(w) == 0


def test_a_full_arena_collects_garbage_cycles_before_it_declines(ends, monkeypatch):
    # vLLM's API server keeps an aborted request's item in a reference cycle (a cancelled
    # coroutine's traceback) that only the cyclic collector frees: a loan sent to the engine
    # core, acked, then held by such a cycle alone must not make the next image decline.
    w, p = ends
    big = torch.ones(24 * MiB, dtype=torch.uint8)
    gc.disable()  # the cycle stays until someone collects
    try:
        loan = w.fill(big)
        c = w.consumer()
        c.new_message()
        held = p("uint8", [24 * MiB], c(loan))
        del held  # the engine core let go (acked)
        cycle: list = [loan]
        cycle.append(cycle)
        del loan, cycle
        assert _in_use(w) == 1  # only garbage holds it
        again = w.fill(big)
        c = dict(w.counters)
        assert again is not None and c.pop("collection_s") > 0
        assert c == {"filled": 2, "filled_bytes": 2 * big.nbytes, "declined": 0, "collections": 1}
        # At most once per COLLECT_EVERY_S: a full arena right after declines at once.
        monkeypatch.setattr(frontend, "COLLECT_EVERY_S", 3600.0)
        assert w.fill(big) is None and w.counters["collections"] == 1
        del again
    finally:
        gc.enable()


def _garbage_loan(w, nbytes: int) -> None:
    """A loan filled, sent once, acked by the engine core, then held by a reference cycle
    alone (what vLLM's API server leaves of an aborted request's item)."""
    loan = w.fill(torch.ones(nbytes, dtype=torch.uint8))
    cycle: list = [loan]
    cycle.append(cycle)


def test_after_an_abort_a_collection_frees_garbage_loans_at_most_once_a_period(ends, monkeypatch):
    w, _ = ends
    gc.disable()  # the cycles stay until someone collects
    try:
        _garbage_loan(w, 8 * MiB)
        assert _in_use(w) == 1
        assert w.collect_garbage() == 0.0
        assert _in_use(w) == 0 and w.counters["collections"] == 1
        # A collection ran less than COLLECT_EVERY_S ago: the caller is told how long to
        # wait, and nothing runs now.
        monkeypatch.setattr(frontend, "COLLECT_EVERY_S", 3600.0)
        _garbage_loan(w, 8 * MiB)
        wait = w.collect_garbage()
        assert 3500 < wait <= 3600 and w.counters["collections"] == 1 and _in_use(w) == 1
        monkeypatch.setattr(frontend, "COLLECT_EVERY_S", 0.0)
        assert w.collect_garbage() == 0.0 and _in_use(w) == 0
        assert w.counters["collections"] == 2
    finally:
        gc.enable()


def test_no_stub_while_the_engine_core_is_not_attached():
    w = FrontendWriter(1, 16 * MiB)
    loan = w.fill(torch.zeros(MiB, dtype=torch.uint8))
    assert w.arena.reader_state(0) == "never_attached" and not w.holder_attached()
    c = w.consumer()
    c.new_message()
    assert c(loan) is None  # vLLM sends the bytes as usual
    assert w.arena.stats(holdings=False)["sends"] == 0
    del loan
    w.arena.close()


def test_a_message_that_did_not_go_is_unsent(ends):
    w, p = ends
    loan = w.fill(torch.zeros(MiB, dtype=torch.uint8))
    c = w.consumer()
    c.new_message()
    c(loan)
    c.unsend(c.sends_of_message())
    assert w.arena.stats(holdings=False)["sends"] == 0
    del loan
    gc.collect()
    assert _in_use(w) == 0  # nobody owes anything


@pytest.mark.parametrize(
    "bad, match",
    [
        ({"slot": -1}, "slot"),
        ({"gen": True}, "gen"),
        ({"gen": 0}, "gen"),
        ({"off": 1.5}, "off"),
        ({"nbytes": 7}, "nbytes"),
        ({"slot": 10**6}, "slot"),
        ({"gen": 2**50}, "generation"),
        ({frontend.STUB_KEY: "vsa_other"}, "names arena"),
    ],
)
def test_every_stub_field_is_checked(ends, bad, match):
    w, p = ends
    loan = w.fill(torch.zeros(MiB, dtype=torch.uint8))
    c = w.consumer()
    c.new_message()
    stub = {**c(loan), **bad}
    with pytest.raises((ValueError, IndexError), match=match):
        p("uint8", [MiB], stub)
    with pytest.raises(ValueError):
        p("no_such_dtype", [MiB], c(loan))
    with pytest.raises(ValueError, match="cannot resolve"):
        p("uint8", [MiB], {"other": 1})


def test_placeholders_of_another_hook_go_to_the_fallback():
    w = FrontendWriter(1, 16 * MiB)
    seen = []
    p = StubProvider(w.handle(), fallback=lambda *a: seen.append(a) or torch.zeros(1))
    assert p("float32", [1], {"ipc": 3}).shape == (1,)
    assert seen == [("float32", [1], {"ipc": 3})]
    p.close()
    w.arena.close()


def test_the_handle_survives_the_environment_and_bad_values_are_refused():
    w = FrontendWriter(1, 16 * MiB)
    raw = frontend.handle_to_env(w.handle())
    assert frontend.handle_from_env(raw) == w.handle()
    fields = json.loads(raw)
    for bad in (
        "not json",
        "[]",
        json.dumps({**fields, "extra": 1}),
        json.dumps({**fields, "n_readers": 0}),
        json.dumps({**fields, "num_slots": True}),
        json.dumps({**fields, "counted": False}),
        json.dumps({**fields, "name": 3}),
    ):
        with pytest.raises(ValueError):
            frontend.handle_from_env(bad)
    w.arena.close()


@pytest.mark.vllm
def test_through_vllms_own_msgpack_hooks(ends):
    serial_utils = pytest.importorskip("vllm.v1.serial_utils")
    w, p = ends

    class Consumer(frontend.LoanStubConsumer, serial_utils.OOBTensorConsumer):
        pass

    consumer = Consumer(w)
    enc = serial_utils.MsgpackEncoder(oob_tensor_consumer=consumer)
    dec = serial_utils.MsgpackDecoder(torch.Tensor, oob_tensor_provider=p)
    src = torch.randn(512, 1024)
    loan = w.fill(src)
    bufs = enc.encode(loan)
    assert len(bufs) == 1 and len(bufs[0]) < 300  # no payload frame
    out = dec.decode(bufs)
    assert torch.equal(out, src)
    plain = enc.encode(src)  # not a loan: vLLM's own out-of-band frame
    assert len(plain) == 2 and torch.equal(dec.decode(plain), src)
    del loan, out
    gc.collect()
    assert _in_use(w) == 0
