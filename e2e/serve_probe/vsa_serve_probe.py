"""A test-only vLLM general plugin for ``make serve-frontend-ab`` (e2e/frontend_cpu_ab.py) and
``make serve-test``'s too-big run (e2e/run_serve_test.py, ``seconds_until_freed``): in every
process of a ``vllm serve`` it wraps the calls that move a multimodal item's bytes
and writes what it counted to ``$VSA_SERVE_PROBE_DIR/<pid>.json`` four times a second.
Inactive (it wraps nothing) unless that variable is set. Never part of the package.

What it counts, per process (``counts``; bytes of tensors or frames of at least 1 MiB, "big"):
* ``send_input_big_bytes``: frames the API server's client sends to the engine core
  (``AsyncMPClient._send_input_message``); each byte is copied twice on the way (the socket
  send and the engine core's receive).
* ``decode_big_bytes``: frames the engine core's ``MsgpackDecoder.decode`` takes in.
* ``shm_store_put_bytes``: bytes vLLM's shm multimodal cache writes
  (``SingleWriterShmObjectStorage.copy_to_buffer`` in ``put``, the serialized item: one
  copy).
* ``decode_tensor_copied_bytes``: tensors ``MsgpackDecoder._decode_tensor`` builds as a copy
  of the bytes it was given (vLLM clones or pins them unless it shares an aux buffer's memory;
  a tensor from an out-of-band provider, such as this project's frontend stubs, is not a
  copy): the engine core's decode of a request, the workers' reads from vLLM's shm cache.
* ``reduce_copied_bytes``: bytes ``BaseMultiModalField.reduce_data`` returns outside its
  inputs' storage (a copy made when a batch is built).
* ``enqueue_big_bytes``: big tensors in the objects the broadcast queue's ``enqueue`` sends
  (vLLM's ``MessageQueue`` or this project's); how many bytes each config then copies is the
  queue's own business (its stats), this says only what it was handed.
* ``read_wait_cpu_ns``: CPU time (the calling thread's, nanoseconds) a reader spends waiting:
  in vLLM's own ``MessageQueue``, ``acquire_read`` until the message is there (its wait loop
  spins, ``sched_yield`` in ``SpinCondition.wait`` between checks of the ring, for a second
  after each read); in this project's, the whole ``dequeue`` (its wait spins within 50 ms of
  the last message, then sleeps; the unpickling is included). In the engine core that is the
  wait for the workers' output of each step (the response queues), so it grows with how long
  the workers compute and how much CPU the spinner gets beside them, not with what the engine
  core does to a payload.
``enqueue``: one ``[seconds, big_bytes, new_requests]`` per call of either queue's
``enqueue`` (the engine core's broadcast of each step; ``new_requests``: the scheduler
output's ``scheduled_new_reqs`` in it, each with its whole prompt), so a harness compares the
steps carrying an image with the others, and with the text steps that add a request too.

``watch`` (only with ``VSA_SERVE_PROBE_WATCH=1``: its threads wake every 5 ms, CPU that
``make serve-frontend-ab`` would count): ``[time.monotonic(), what, value]`` each time a watched
value changes, sampled every ``WATCH_EVERY_S`` by a thread (CLOCK_MONOTONIC is one
clock for every process on the machine, so a harness compares these times with its own):
* ``in_use`` (the API server): the allocations the frontend writer holds once every one that
  could be recycled was (``reclaim``, what an allocation short of space does anyway, so the
  figure is when the slot came free, not when the next metrics report noticed);
* ``acked`` (the engine core): the stubs reader 0 acked (``stats()["acked"]``), each when the
  last view of what it stood for died there;
* ``requests`` (the engine core): ``[running, waiting, ids of the running requests, ids of
  every request the scheduler holds]``, its own counts (``Scheduler.get_request_counts``), its
  running list and its ``requests`` dict (a request is there from ``add_request`` until its
  blocks are freed, whatever queue it sits in). A harness follows one request by its id: the
  waiting count is no substitute (samples of it showed 0 while a request still waited, and
  1 for 27-30 s after it left; likely because ``schedule`` pops waiting requests into a local
  deque and puts them back, and deferred ones are not counted), nor is vLLM's
  ``num_requests_waiting`` gauge (it moves only when the engine core's stats reach the API
  server).
"""

from __future__ import annotations

import contextlib
import json
import os
import threading
import time

_BIG = 1 << 20
_counts: dict[str, int] = {}
_enqueue: list[list[float]] = []
_watched: list[list] = []
#: How often the frontend watcher samples (seconds).
WATCH_EVERY_S = 0.005
_lock = threading.Lock()


def _add(key: str, n: int) -> None:
    if n:
        with _lock:
            _counts[key] = _counts.get(key, 0) + n


def _frame_bytes(frames) -> int:
    total = 0
    for f in frames:
        try:
            n = memoryview(f).nbytes
        except TypeError:
            n = len(getattr(f, "buffer", b""))
        if n >= _BIG:
            total += n
    return total


def _tensors(obj, out: list, seen: set, depth: int = 0) -> None:
    """Every torch tensor reachable from ``obj`` (dicts, sequences, object attributes), at
    most 12 levels down and 20,000 objects in all."""
    import torch

    if depth > 12 or len(seen) > 20000 or id(obj) in seen:
        return
    seen.add(id(obj))
    if isinstance(obj, torch.Tensor):
        out.append(obj)
        return
    if isinstance(obj, (str, bytes, bytearray, int, float, bool, type(None))):
        return
    if isinstance(obj, dict):
        for v in obj.values():
            _tensors(v, out, seen, depth + 1)
        return
    if isinstance(obj, (list, tuple, set, frozenset)):
        for v in obj:
            _tensors(v, out, seen, depth + 1)
        return
    fields = getattr(obj, "__dict__", None)
    if fields is not None:
        for v in fields.values():
            _tensors(v, out, seen, depth + 1)
    for name in getattr(type(obj), "__slots__", ()):
        v = getattr(obj, name, None)
        if v is not None:
            _tensors(v, out, seen, depth + 1)


def _big_tensor_bytes(obj) -> int:
    found: list = []
    _tensors(obj, found, set())
    total = 0
    for t in found:
        n = t.numel() * t.element_size()
        if n >= _BIG:
            total += n
    return total


def _storages(obj) -> set:
    found: list = []
    _tensors(obj, found, set())
    out = set()
    for t in found:
        try:
            out.add(t.untyped_storage().data_ptr())
        except RuntimeError:
            pass
    return out


def _wrap(cls, name: str, make) -> None:
    orig = cls.__dict__.get(name)
    if orig is None or getattr(orig, "_vsa_probe", False):
        return
    wrapped = make(orig)
    wrapped._vsa_probe = True
    setattr(cls, name, wrapped)


def _send_input(orig):
    def wrapped(self, message, *a, **kw):
        _add("send_input_big_bytes", _frame_bytes(message))
        return orig(self, message, *a, **kw)

    return wrapped


def _decode(orig):
    def wrapped(self, bufs):
        if not isinstance(bufs, (bytes, bytearray, memoryview)):
            _add("decode_big_bytes", _frame_bytes(bufs))
        return orig(self, bufs)

    return wrapped


def _copy_to_buffer(orig):
    def wrapped(self, data, data_bytes, *a, **kw):
        _add("shm_store_put_bytes", int(data_bytes))
        return orig(self, data, data_bytes, *a, **kw)

    return wrapped


def _counting(key: str, measure):
    """A wrapper factory: calls the original, then adds ``measure(self, args, out)`` bytes to
    ``key`` (a probe never breaks the server: a failure counts in ``<key>_errors``)."""

    def make(orig):
        def wrapped(self, *a, **kw):
            out = orig(self, *a, **kw)
            try:
                _add(key, measure(self, a, out))
            except Exception:
                _add(f"{key}_errors", 1)
            return out

        return wrapped

    return make


def _decode_tensor_copy(self, a, out) -> int:
    """The bytes of a tensor ``_decode_tensor`` cloned or pinned rather than shared."""
    data = a[0][2]
    shared = isinstance(data, int) and getattr(self, "share_mem", False)
    n = out.numel() * out.element_size()
    return n if not isinstance(data, dict) and not shared and n >= _BIG else 0


def _reduce_copy(self, a, out) -> int:
    """The bytes ``reduce_data`` returns outside its inputs' storage."""
    inputs = _storages([e.data for e in a[0]])
    found: list = []
    _tensors(out, found, set())
    return sum(
        t.numel() * t.element_size()
        for t in found
        if t.device.type == "cpu" and t.untyped_storage().data_ptr() not in inputs
    )


def _new_requests(obj, depth: int = 0) -> int:
    """The ``scheduled_new_reqs`` of the scheduler output in a broadcast message (vLLM's
    executor sends ``(method, args, kwargs, ...)``); 0 when there is none."""
    new = getattr(obj, "scheduled_new_reqs", None)
    if new is not None:
        return len(new)
    if depth < 3 and isinstance(obj, (tuple, list)):
        return sum(_new_requests(o, depth + 1) for o in obj)
    return 0


def _enqueue_timed(orig):
    def wrapped(self, obj, *a, **kw):
        t0 = time.perf_counter()
        out = orig(self, obj, *a, **kw)
        dt = time.perf_counter() - t0
        big = _big_tensor_bytes(obj)
        _add("enqueue_big_bytes", big)
        record = [dt, big, _new_requests(obj)]
        with _lock:
            if len(_enqueue) < 200000:
                _enqueue.append(record)
        return out

    return wrapped


def _read_wait_cpu(orig):
    @contextlib.contextmanager
    def wrapped(self, *a, **kw):
        t0 = time.thread_time_ns()
        with orig(self, *a, **kw) as buf:
            _add("read_wait_cpu_ns", time.thread_time_ns() - t0)
            yield buf

    return wrapped


def _dequeue_wait_cpu(orig):
    def wrapped(self, *a, **kw):
        t0 = time.thread_time_ns()
        try:
            return orig(self, *a, **kw)
        finally:
            _add("read_wait_cpu_ns", time.thread_time_ns() - t0)

    return wrapped


def _watch(what: str, sample) -> None:
    """Appends ``[time.monotonic(), what, value]`` to ``_watched`` whenever ``sample()``
    changes (``None``: nothing to sample yet); stops when it raises (the arena closed)."""
    last = None
    while True:
        try:
            v = sample()
        except Exception:
            return
        if v is not None and v != last:
            last = v
            with _lock:
                if len(_watched) < 100000:
                    _watched.append(
                        [time.monotonic(), what, list(v) if isinstance(v, tuple) else v]
                    )
        time.sleep(WATCH_EVERY_S)


def _start_watch(what: str, sample) -> None:
    threading.Thread(
        target=_watch, args=(what, sample), daemon=True, name="vsa-probe-watch"
    ).start()


def _frontend_in_use() -> int | None:
    """The API server's frontend writer's allocations after a ``reclaim`` (None elsewhere, or
    before the writer exists). Looked up each time: the plugin makes it when it likes."""
    from vllm_shm_arena import vllm_frontend

    writer = vllm_frontend._own_writer()
    if writer is None:
        return None
    writer.arena.reclaim(check_liveness=False)
    return int(writer.arena.stats(holdings=False)["in_use"])


def _frontend_acked() -> int | None:
    """The stubs the engine core's reader 0 acked (None elsewhere, or before it attached)."""
    from vllm_shm_arena import vllm_frontend

    provider = vllm_frontend._provider
    return None if provider is None else int(provider.reader.stats()["acked"])


def _watch_scheduler(orig):
    def wrapped(self, *a, **kw):
        orig(self, *a, **kw)

        def requests() -> tuple | None:
            try:
                running, waiting = self.get_request_counts()
                ids = sorted(r.request_id for r in list(self.running))
                return running, waiting, ids, sorted(list(self.requests))
            except RuntimeError:  # a container changed size meanwhile: the next sample
                return None

        _start_watch("requests", requests)

    return wrapped


def _flush_forever(path: str) -> None:
    while True:
        time.sleep(0.25)
        with _lock:
            rec = {
                "pid": os.getpid(),
                "counts": dict(_counts),
                "enqueue": list(_enqueue),
                "watch": list(_watched),
            }
        tmp = f"{path}.tmp"
        with open(tmp, "w") as f:
            json.dump(rec, f)
        os.replace(tmp, path)


def register() -> None:
    out_dir = os.environ.get("VSA_SERVE_PROBE_DIR")
    if not out_dir or getattr(register, "_done", 0) == os.getpid():
        return
    register._done = os.getpid()
    from vllm.distributed.device_communicators import shm_broadcast, shm_object_storage
    from vllm.multimodal import inputs
    from vllm.v1 import serial_utils
    from vllm.v1.core.sched import scheduler
    from vllm.v1.engine import core_client

    _wrap(core_client.AsyncMPClient, "_send_input_message", _send_input)
    _wrap(serial_utils.MsgpackDecoder, "decode", _decode)
    _wrap(
        serial_utils.MsgpackDecoder,
        "_decode_tensor",
        _counting("decode_tensor_copied_bytes", _decode_tensor_copy),
    )
    _wrap(shm_object_storage.SingleWriterShmObjectStorage, "copy_to_buffer", _copy_to_buffer)
    _wrap(inputs.BaseMultiModalField, "reduce_data", _counting("reduce_copied_bytes", _reduce_copy))
    _wrap(shm_broadcast.MessageQueue, "enqueue", _enqueue_timed)
    _wrap(shm_broadcast.MessageQueue, "acquire_read", _read_wait_cpu)
    watch = os.environ.get("VSA_SERVE_PROBE_WATCH") == "1"
    if watch:
        _wrap(scheduler.Scheduler, "__init__", _watch_scheduler)
    try:
        from vllm_shm_arena.message_queue import MessageQueue as Ours

        _wrap(Ours, "enqueue", _enqueue_timed)
        _wrap(Ours, "dequeue", _dequeue_wait_cpu)
        if watch:
            _start_watch("in_use", _frontend_in_use)
            _start_watch("acked", _frontend_acked)
    except ImportError:
        pass
    path = os.path.join(out_dir, f"{os.getpid()}.json")
    threading.Thread(target=_flush_forever, args=(path,), daemon=True, name="vsa-probe").start()
