"""The frontend arena's rebinding into vLLM (vllm_shm_arena/vllm_frontend.py).

Without vLLM: when it applies (``wanted``), how big the arena is (``arena_bytes``), and an
item's tensors moved into loans (``_fill_item``) with everything else left as it was. With vLLM
(``make vllm-test``): ``install()`` rebinds the three names once; a multimodal item encoded by
the rebound encoder on the "API server" carries stubs, not payload frames, and the rebound
decoder in another process (the "engine core", reader 0) rebuilds it byte for byte; the slot
comes back once the engine core lets go.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import multiprocessing as mp
import os
from collections import UserDict
from types import SimpleNamespace

import pytest
import torch

from vllm_shm_arena import frontend, settings, vllm_frontend

MiB = 1 << 20


def _config(flag=True, dp=1, cache_gb=0.25, world=2):
    return SimpleNamespace(
        parallel_config=SimpleNamespace(
            enable_shm_tensor_arena=flag, data_parallel_size=dp, world_size=world
        ),
        model_config=SimpleNamespace(
            get_multimodal_config=lambda: SimpleNamespace(mm_processor_cache_gb=cache_gb)
        ),
    )


def test_it_applies_only_with_the_flag_one_engine_and_the_setting_on(monkeypatch):
    assert vllm_frontend.wanted(_config()) is None
    assert "enable-shm-tensor-arena" in vllm_frontend.wanted(_config(flag=False))
    assert "data parallel" in vllm_frontend.wanted(_config(dp=2))
    monkeypatch.setenv("VLLM_SHM_ARENA_FRONTEND", "0")
    assert "VLLM_SHM_ARENA_FRONTEND=0" in vllm_frontend.wanted(_config())


def test_the_arena_is_the_cache_plus_headroom_within_the_free_space(tmp_path):
    size = vllm_frontend.arena_bytes(0.25, str(tmp_path))
    want = int(0.25 * vllm_frontend.HEADROOM * (1 << 30)) // (2 << 20) * (2 << 20)
    room = vllm_frontend.sizing.measure(str(tmp_path)).room * settings.free_fraction()
    assert size == min(want, int(room) // (2 << 20) * (2 << 20)) or size == 0
    assert size % (2 << 20) == 0
    assert vllm_frontend.arena_bytes(0.0, str(tmp_path)) == 0  # under the floor: none


def test_the_smallest_frontend_arena_is_the_queues_floor(tmp_path, monkeypatch):
    # One decision for "the smallest arena worth creating": VLLM_SHM_ARENA_MIN_MB (default
    # 64 MiB) is the queue's floor and the frontend arena's, so a small multimodal cache gets
    # a frontend arena where the operator lowers it.
    assert vllm_frontend.arena_bytes(0.01, str(tmp_path)) == 0  # 12 MiB < 64 MiB
    monkeypatch.setenv("VLLM_SHM_ARENA_MIN_MB", "8")
    assert vllm_frontend.arena_bytes(0.01, str(tmp_path)) == 12 << 20  # 0.0125 GiB, in 2 MiB


@dataclasses.dataclass
class _Elem:  # the shape of vLLM's MultiModalFieldElem
    data: object
    field: str


class _Item(UserDict):  # the shape of vLLM's MultiModalKwargsItem
    pass


def test_an_items_large_tensors_move_into_loans_and_nothing_else_changes():
    w = frontend.FrontendWriter(1, 16 * MiB)
    big = torch.arange(MiB // 2, dtype=torch.float32)
    grid = torch.tensor([[1, 36, 36]])
    item = _Item({"pixel_values": _Elem(big, "batched"), "grid": _Elem(grid, "batched")})
    out = vllm_frontend._fill_item(w, item)
    assert type(out) is _Item and out is not item
    assert out["pixel_values"].field == "batched" and torch.equal(out["pixel_values"].data, big)
    assert out["pixel_values"].data.data_ptr() != big.data_ptr()  # a loan
    assert out["grid"] is item["grid"]  # small: as it was
    assert item["pixel_values"].data is big  # the original item is untouched
    small = _Item({"grid": _Elem(grid, "batched")})
    assert vllm_frontend._fill_item(w, small) is small
    del out
    gc.collect()
    w.arena.close()


def _engine_core(raw_handle, conn):
    """A stand-in engine core: the rebound decoder attaches reader 0 from the environment."""
    import os

    os.environ["VLLM_SHM_ARENA_FRONTEND_HANDLE"] = raw_handle
    import vllm.v1.engine.core as engine_core
    from vllm.multimodal.inputs import MultiModalKwargsItem

    vllm_frontend.install()
    dec = engine_core.MsgpackDecoder(MultiModalKwargsItem)
    conn.send("attached")
    frames = conn.recv()
    item = dec.decode(frames)
    t = item["pixel_values"].data
    conn.send((float(t.sum()), tuple(t.shape), str(t.dtype)))
    conn.recv()  # hold until told
    del item, t
    gc.collect()
    conn.send("released")
    conn.recv()


@contextlib.contextmanager
def _api_server_and_engine_core(engine_core_main):
    """This process as the API server (a frontend writer for 2 workers, installed as
    ``vllm_frontend``'s own) and ``engine_core_main(raw_handle, conn)`` spawned as the engine
    core, attached; yields ``(writer, conn)``. On the way out the child is told to exit (if a
    check failed first) and must exit 0."""
    w = frontend.FrontendWriter(2, 32 * MiB)
    saved = (vllm_frontend._writer, vllm_frontend._writer_pid)
    vllm_frontend._writer, vllm_frontend._writer_pid = w, os.getpid()
    ctx = mp.get_context("spawn")
    a, b = ctx.Pipe()
    p = ctx.Process(target=engine_core_main, args=(frontend.handle_to_env(w.handle()), b))
    p.start()
    try:
        assert a.recv() == "attached"
        yield w, a
    finally:
        if p.is_alive():
            a.send("exit")  # a failed check: the child ends rather than wait
        p.join(60)
        vllm_frontend._writer, vllm_frontend._writer_pid = saved
        w.arena.close()
    assert p.exitcode == 0


def _loaned_item(w):
    """A MultiModalKwargsItem whose 512 x 1024 pixel_values ``w`` filled into a loan, and the
    tensor it was filled from."""
    from vllm.multimodal.inputs import (
        MultiModalBatchedField,
        MultiModalFieldElem,
        MultiModalKwargsItem,
    )

    src = torch.randn(512, 1024)
    elem = MultiModalFieldElem(data=src, field=MultiModalBatchedField())
    return vllm_frontend._fill_item(w, MultiModalKwargsItem({"pixel_values": elem})), src


def _in_use(w) -> int:
    w.arena.reclaim(check_liveness=False)
    return w.arena.stats(holdings=False)["in_use"]


@pytest.mark.vllm
def test_through_vllms_rebound_encoder_and_decoder():
    core_client = pytest.importorskip("vllm.v1.engine.core_client")
    vllm_frontend.install()
    vllm_frontend.install()  # idempotent
    assert core_client.MsgpackEncoder.__name__ == "FrontendMsgpackEncoder"
    with _api_server_and_engine_core(_engine_core) as (w, a):
        item, src = _loaned_item(w)
        enc = core_client.MsgpackEncoder()
        frames = enc.encode(item)
        assert len(frames) == 1  # a stub, no payload frame
        sends = enc.vsa_take_sends()
        assert len(sends) == 1 and enc.vsa_take_sends() == []
        failed = enc.encode(item)  # a second message whose send fails: taken back
        enc.vsa_unsend(enc.vsa_take_sends())
        assert len(failed) == 1 and w.arena.stats(holdings=False)["sends"] == 1
        assert core_client.AsyncMPClient._send_input._vsa_frontend
        a.send([bytes(f) for f in frames])
        assert a.recv() == (float(src.sum()), (512, 1024), "torch.float32")
        del item
        gc.collect()
        assert _in_use(w) == 1  # the engine core holds it
        a.send("release")
        assert a.recv() == "released"
        assert _in_use(w) == 0
        a.send("exit")


def _engine_core_keeps_its_last_request(raw_handle, conn):
    """The "engine core": decodes an EngineCoreRequest and makes vLLM's Request of it as its
    input thread does, keeping the decoded request and what ``preprocess_add_request``
    returned (that thread's locals) to the end; the busy loop unpacks the latter once."""
    import os

    os.environ["VLLM_SHM_ARENA_FRONTEND_HANDLE"] = raw_handle
    import vllm.v1.engine.core as engine_core
    from vllm.v1.engine import EngineCoreRequest

    vllm_frontend.install()
    dec = engine_core.MsgpackDecoder(EngineCoreRequest)
    conn.send("attached")
    req = dec.decode(conn.recv())
    stand_in = SimpleNamespace(mm_receiver_cache=None, request_block_hasher=None)
    handed = engine_core.EngineCore.preprocess_add_request(stand_in, req)  # input thread's
    request, _ = handed  # the busy loop's unpacking (EngineCore._handle_client_request)
    t = request.mm_features[0].data["pixel_values"].data
    conn.send(float(t.sum()))
    conn.recv()
    del request, t  # the scheduler lets go of the request (finished or aborted)
    gc.collect()
    conn.send("released")
    conn.recv()
    conn.send((req.request_id, len(handed)))  # both lived until here


@pytest.mark.vllm
def test_the_engine_cores_last_decoded_request_holds_no_slot():
    # vLLM's input thread keeps the EngineCoreRequest it decoded last, and the (Request, wave)
    # it made of it, until the next message arrives; once the scheduler lets go of the
    # Request, the frontend slot must come back all the same (an aborted or finished image
    # nobody follows would otherwise hold its slot until then).
    core_client = pytest.importorskip("vllm.v1.engine.core_client")
    from vllm.multimodal.inputs import MultiModalFeatureSpec, PlaceholderRange
    from vllm.sampling_params import SamplingParams
    from vllm.v1.engine import EngineCoreRequest

    vllm_frontend.install()
    with _api_server_and_engine_core(_engine_core_keeps_its_last_request) as (w, a):
        item, src = _loaned_item(w)
        feature = MultiModalFeatureSpec(
            data=item, modality="image", identifier="img", mm_position=PlaceholderRange(0, 4)
        )
        req = EngineCoreRequest(
            "r1", [1, 2, 3, 4, 5], [feature], SamplingParams(max_tokens=1), None, 0.0, None,
            None, None,
        )  # fmt: skip
        frames = core_client.MsgpackEncoder().encode(req)
        assert len(frames) == 1  # a stub, no payload frame
        a.send([bytes(f) for f in frames])
        assert a.recv() == float(src.sum())
        del req, feature, item
        gc.collect()
        assert _in_use(w) == 1  # vLLM's Request holds it
        a.send("let go")
        assert a.recv() == "released"
        assert _in_use(w) == 0
        a.send("exit")
        assert a.recv() == ("r1", 0)  # unpacked once, the hand-off holds nothing


def test_the_busy_loops_unpacking_empties_what_the_input_thread_keeps(monkeypatch):
    # Without vLLM: the wrapped preprocess_add_request's result, as vLLM's input thread keeps
    # it in a local until its next message, lets go of the Request once the busy loop
    # unpacked it; in a process without a frontend reader vLLM's tuple comes back untouched.
    import weakref

    class Request:  # stands for vLLM's
        pass

    decoded = SimpleNamespace(mm_features=["item"])
    wrapped = vllm_frontend._drop_decoded_items(lambda self, r: (Request(), 7))
    assert type(wrapped(None, decoded)) is tuple and decoded.mm_features == ["item"]
    monkeypatch.setattr(vllm_frontend, "_provider", object())
    kept = wrapped(None, decoded)  # the input thread's local
    assert decoded.mm_features is None
    req, wave = kept  # EngineCore._handle_client_request
    gone = weakref.ref(req)
    assert wave == 7 and len(kept) == 0
    del req
    assert gone() is None
    with pytest.raises(ValueError, match="not enough values"):
        _, _ = kept


def test_a_changed_signature_is_named_and_refuses_the_rebinding():
    def cache_factory(vllm_config, extra):  # one parameter more than verified
        pass

    live = {name: None for name in vllm_frontend.FRONTEND_INTERFACE}

    def shaped(params):
        ns: dict = {}
        exec(f"def f({', '.join(params)}): pass", ns)  # noqa: S102  (a test's own text)
        return ns["f"]

    for name, params in vllm_frontend.FRONTEND_INTERFACE.items():
        live[name] = shaped(params)
    assert vllm_frontend.interface_changes(live) == []
    live["processor_cache_from_config"] = cache_factory
    (change,) = vllm_frontend.interface_changes(live)
    assert change.startswith("processor_cache_from_config(vllm_config, extra)")


class _Encoder:  # the rebound encoder's surface the wrapper uses
    def __init__(self, sends):
        self._sends, self.unsent = list(sends), []

    def vsa_take_sends(self):
        sends, self._sends = self._sends, []
        return sends

    def vsa_unsend(self, sends):
        self.unsent.extend(sends)


def test_a_message_that_does_not_go_has_its_sends_taken_back():
    from concurrent.futures import Future

    def raising(self, request_type, request):
        raise OSError("socket closed")

    client = SimpleNamespace(encoder=_Encoder([(3, 7)]))
    with pytest.raises(OSError):
        vllm_frontend._send_input_hooks(raising)(client, 0, None)
    assert client.encoder.unsent == [(3, 7)]

    outcomes = {}
    for outcome in ("sent", "failed", "cancelled"):
        fut = Future()
        client = SimpleNamespace(encoder=_Encoder([(1, 2), (4, 5)]))
        returned = vllm_frontend._send_input_hooks(lambda self, t, r, f=fut: f)(client, 0, None)
        assert returned is fut
        assert client.encoder.unsent == []  # not settled yet
        if outcome == "sent":
            fut.set_result(None)
        elif outcome == "failed":
            fut.set_exception(OSError("lost"))
        else:
            fut.cancel()
        outcomes[outcome] = client.encoder.unsent
    assert outcomes == {"sent": [], "failed": [(1, 2), (4, 5)], "cancelled": [(1, 2), (4, 5)]}

    plain = SimpleNamespace(encoder=object())  # vLLM's own encoder: nothing to take back
    assert vllm_frontend._send_input_hooks(lambda self, t, r: "ok")(plain, 0, None) == "ok"


class _RequestType:  # stands for vLLM's EngineCoreRequestType members (an enum)
    def __init__(self, name):
        self.name = name


def test_an_abort_of_a_request_sent_stubs_has_the_api_server_collect_soon(monkeypatch):
    # vLLM keeps an aborted request's processed prompt in a reference cycle: after an abort
    # naming a request whose ADD sent stubs, the API server collects (once for a burst), so
    # the item's slot comes back without waiting for the collector's next full pass; other
    # aborts (a request without images, one finished by a stop string) cost nothing.
    import asyncio

    w = frontend.FrontendWriter(1, 32 * MiB, max_allocations=16)
    monkeypatch.setattr(vllm_frontend, "_writer", w)
    monkeypatch.setattr(vllm_frontend, "_writer_pid", os.getpid())
    monkeypatch.setattr(vllm_frontend, "ABORT_COLLECT_DELAY_S", 0.01)
    monkeypatch.setattr(vllm_frontend, "_collect_scheduled", False)
    monkeypatch.setattr(vllm_frontend, "_loaned_ids", {})
    send = vllm_frontend._send_input_hooks(lambda self, t, r: None)
    add, abort = _RequestType("ADD"), _RequestType("ABORT")

    async def then_wait(*messages):
        for client, request_type, request in messages:
            send(client, request_type, request)
        await asyncio.sleep(0.2)

    def collections_after(*messages) -> int:
        asyncio.run(then_wait(*messages))
        return w.counters["collections"]

    plain = SimpleNamespace(encoder=_Encoder([]))  # a message that sent no stub
    gc.disable()
    try:
        cycle: list = [w.fill(torch.ones(8 * MiB, dtype=torch.uint8))]
        cycle.append(cycle)
        del cycle
        text, image = SimpleNamespace(request_id="text"), SimpleNamespace(request_id="image")
        assert collections_after((plain, add, text), (plain, abort, ["text"])) == 0
        assert collections_after((SimpleNamespace(encoder=_Encoder([(1, 1)])), add, image)) == 0
        w.arena.reclaim(check_liveness=False)
        assert w.arena.stats(holdings=False)["in_use"] == 1
        burst = [(plain, abort, ["text", "image"])] + [(plain, abort, ["image"])] * 2
        assert collections_after(*burst) == 1
        w.arena.reclaim(check_liveness=False)
        assert w.arena.stats(holdings=False)["in_use"] == 0
        assert vllm_frontend._loaned_ids == {}  # an abort forgets the id
        assert collections_after((plain, abort, ["image"])) == 1  # already aborted
        # No event loop (an offline LLM): nothing, even for a request sent stubs.
        send(SimpleNamespace(encoder=_Encoder([(2, 2)])), add, image)
        send(plain, abort, ["image"])
        assert w.counters["collections"] == 1 and not vllm_frontend._collect_scheduled
    finally:
        gc.enable()
        w.arena.close()


def test_the_ids_of_requests_sent_stubs_are_bounded(monkeypatch):
    monkeypatch.setattr(vllm_frontend, "_loaned_ids", {})
    monkeypatch.setattr(vllm_frontend, "LOANED_IDS_KEPT", 3)
    for i in range(5):
        vllm_frontend._note_loaned(f"r{i}")
    assert list(vllm_frontend._loaned_ids) == ["r2", "r3", "r4"]  # the oldest aged out


class _Built(Exception):
    """Raised by the stand-in executor with what it saw (ends EngineCore.__init__ there)."""


def _engine_core_builds_its_executor(raw_handle, installed_by, conn):
    import os

    os.environ["VLLM_SHM_ARENA_FRONTEND_HANDLE"] = raw_handle
    import vllm.plugins
    import vllm.v1.engine.core as engine_core

    from vllm_shm_arena import MessageQueue
    from vllm_shm_arena import arena as arena_mod

    if installed_by == "plugin loading":  # a spawned engine core: EngineCore.__init__ loads us
        vllm.plugins.load_general_plugins = vllm_frontend.install
    else:
        vllm_frontend.install()

    class Executor:  # builds the broadcast queue, as vLLM's MultiprocExecutor does
        def __init__(self, vllm_config):
            source = vllm_frontend._provider.reader if vllm_frontend._provider else None
            q = MessageQueue(2, 2, enable_shm_tensor_arena=True)
            forwards = q.export_handle().frontend_arena_handle is not None
            named = q.export_handle().frontend_arena_handle
            took = source is not None and named is not None and named.name == source.name
            q.shutdown()
            raise _Built((forwards, took, arena_mod.take_forward_source() is None))

    config = SimpleNamespace(parallel_config=SimpleNamespace(data_parallel_rank_local=0))
    try:
        engine_core.EngineCore(config, Executor, False)
        conn.send("built without the stand-in executor")
    except _Built as e:
        conn.send(e.args[0])
    except BaseException as e:
        conn.send(f"{type(e).__name__}: {e}")


@pytest.mark.vllm
@pytest.mark.parametrize("installed_by", ["the API server's fork", "plugin loading"])
def test_the_engine_core_attaches_before_its_executor_so_its_queue_forwards(installed_by):
    pytest.importorskip("vllm.v1.engine.core")
    w = frontend.FrontendWriter(2, 32 * MiB)
    ctx = mp.get_context("spawn")
    a, b = ctx.Pipe()
    raw = frontend.handle_to_env(w.handle())
    p = ctx.Process(target=_engine_core_builds_its_executor, args=(raw, installed_by, b))
    p.start()
    try:
        assert a.poll(120)
        # The queue named the frontend arena and forwards from the engine core's reader 0,
        # which it took (no later queue forwards too).
        assert a.recv() == (True, True, True)
    finally:
        p.join(60)
        w.arena.close()


def _reported(args: tuple) -> tuple:
    """A record_frontend_stats call -> (filled, bytes, stubs sent, in use, owed by rank)."""
    filled, nbytes, stats = args
    owed = [h["owed"] for h in sorted(stats["holdings"], key=lambda h: h["rank"])]
    return filled, nbytes, stats["sends"], stats["in_use"], owed


def test_the_api_server_reports_what_each_rank_owes(monkeypatch):
    # vllm:shm_arena_owed{arena="frontend",rank}: a stub sent to the engine core is owed by
    # rank 0
    # until the tensor it became there dies; then nothing is owed and the slot is free.
    got = []
    monkeypatch.setattr(vllm_frontend.metrics, "enabled", lambda: True)
    monkeypatch.setattr(vllm_frontend.metrics, "record_frontend_stats", lambda *a: got.append(a))
    w = frontend.FrontendWriter(1, 32 * MiB)
    core = frontend.StubProvider(w.handle())
    try:
        loan = w.fill(torch.ones(MiB // 2))
        consumer = w.consumer()
        consumer.new_message()
        stub = consumer(loan)
        assert stub is not None

        def report():
            monkeypatch.setattr(vllm_frontend, "_reported_at", 0.0)
            vllm_frontend._report(w)
            return _reported(got[-1])[3:]  # in use, owed by rank

        assert report() == (1, [1, 0])  # sent, not yet decoded by the engine core
        t = core("float32", [MiB // 2], stub)
        del loan
        assert report() == (1, [1, 0])  # the engine core holds it
        del t
        assert report() == (0, [0, 0])
    finally:
        core.close()
        w.arena.close()


def test_the_api_server_reports_the_frontend_arena_at_most_once_a_second(monkeypatch):
    got = []
    monkeypatch.setattr(vllm_frontend.metrics, "enabled", lambda: True)
    monkeypatch.setattr(vllm_frontend.metrics, "record_frontend_stats", lambda *a: got.append(a))
    monkeypatch.setattr(vllm_frontend, "_reported_at", 0.0)
    w = frontend.FrontendWriter(1, 32 * MiB)
    try:
        loan = w.fill(torch.ones(MiB // 2))  # 2 MiB: one copy
        vllm_frontend._report(w)
        vllm_frontend._report(w)  # within the second: not again
        assert [_reported(g) for g in got] == [(1, 2 * MiB, 0, 1, [0, 0])]
        del loan
        monkeypatch.setattr(vllm_frontend, "_reported_at", 0.0)
        vllm_frontend._report(w)
        assert _reported(got[-1]) == (1, 2 * MiB, 0, 0, [0, 0])  # recycled: not in use
        w.arena.close()
        monkeypatch.setattr(vllm_frontend, "_reported_at", 0.0)
        vllm_frontend._report(w)  # closed (the API server's exit): nothing, no error
        assert len(got) == 2
    finally:
        w.arena.close()
