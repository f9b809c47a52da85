"""The frontend arena's primitives: a multimodal item's tensors go by reference from the API
server through the engine core to the workers.

A counted arena (``ShmTensorArena.create(counted=True)``, csrc/core/arena_layout.h) with reader
0 the engine core and readers 1..n the workers. Its three roles here, each knowing nothing of
vLLM (the vLLM rebinding uses them through vLLM's own out-of-band tensor hooks, whose stub
format, ``dict`` placeholders in a msgpack message, this module speaks):

* ``FrontendWriter`` (API server): ``fill(tensor)`` copies a large contiguous CPU tensor into
  a loan once (the item's only host copy); ``consumer()`` is an out-of-band tensor consumer
  that turns a loan into a stub dict, one counted send each, and only while reader 0 is
  attached (otherwise vLLM sends the bytes as it always does). ``sends_of_message`` and
  ``unsend`` take back the sends of a message that did not go.
* ``StubProvider`` (engine core, reader 0): turns a stub dict back into a zero-copy tensor
  over the arena, one counted stub each; the hold ends, and is acked, when the last view of
  it dies.
* ``handle_to_env`` / ``handle_from_env``: the handle in an environment variable, checked field
  by field (the environment is input).

Stubs carry only integers and the arena's name; each field is checked before use, and a stub
naming another arena, a bad slot, generation, offset or size raises ``ValueError`` without
touching memory outside the arena.
"""

from __future__ import annotations

import dataclasses
import gc
import json
import logging
import time
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from vllm_shm_arena.arena import (
    VARIABLE_MIN_BYTES,
    ArenaHandle,
    ShmTensorArena,
    ShmTensorArenaReader,
    ShmTensorArenaWriter,
    dtype_from_name,
)

logger = logging.getLogger(__name__)

#: The key that marks a stub dict as this arena's (its value: the arena's shm name).
STUB_KEY = "vsa_frontend"
#: The environment variable the API server passes the arena's handle in.
HANDLE_ENV = "VLLM_SHM_ARENA_FRONTEND_HANDLE"
_STUB_FIELDS = ("slot", "gen", "off", "nbytes")


def handle_to_env(handle: ArenaHandle) -> str:
    """The handle as an environment variable's value (JSON of its fields)."""
    return json.dumps(dataclasses.asdict(handle), sort_keys=True)


def handle_from_env(raw: str) -> ArenaHandle:
    """The handle ``handle_to_env`` wrote; ``ValueError`` naming the field that is wrong."""
    try:
        fields = json.loads(raw)
    except ValueError as e:
        raise ValueError(f"{HANDLE_ENV} is not JSON: {e}") from None
    if not isinstance(fields, dict):
        raise ValueError(f"{HANDLE_ENV} must be a JSON object")
    want: dict[str, type] = {
        "name": str,
        "n_readers": int,
        "num_slots": int,
        "slot_bytes": int,
        "dir": str,
        "policy": str,
        "counted": bool,
    }
    if set(fields) != set(want):
        raise ValueError(f"{HANDLE_ENV} must have exactly the fields {sorted(want)}")
    for key, typ in want.items():
        v = fields[key]
        if not isinstance(v, typ) or (typ is int and (isinstance(v, bool) or v < 1)):
            raise ValueError(f"{HANDLE_ENV}: field {key!r} is not a valid {typ.__name__}")
    if not fields["counted"]:
        raise ValueError(f"{HANDLE_ENV} names an arena that is not counted")
    return ArenaHandle(**fields)


def _warn_once(seen: set, cause: str, msg: str, *args) -> None:
    if cause not in seen:
        seen.add(cause)
        logger.warning("vllm_shm_arena frontend: " + msg + " (warned once)", *args)


#: A full frontend arena runs Python's cyclic garbage collector (at most this often, seconds)
#: and tries once more before it declines a tensor: vLLM's API server keeps an aborted
#: request's processed prompt, and with it the item's loans, in a reference cycle (the
#: cancelled ``AsyncLLM.generate`` frame and its ``CancelledError`` traceback) that only that
#: collector frees, seconds later on an idle server (docs/end_to_end_tests.md). The vLLM
#: rebinding also asks for a collection soon after it sends an abort (``collect_garbage``).
COLLECT_EVERY_S = 1.0


class FrontendWriter:
    """The API server's end: loans filled once, sent as stubs any number of times.

    ``n_workers`` readers besides the engine core (reader 0). The arena is variable-size,
    ``arena_bytes`` large, at most ``max_allocations`` items' tensors at once.
    """

    def __init__(
        self,
        n_workers: int,
        arena_bytes: int,
        *,
        max_allocations: int = 4096,
        min_bytes: int = VARIABLE_MIN_BYTES,
        shm_dir: str | None = None,
    ) -> None:
        if n_workers < 0:
            raise ValueError(f"n_workers must be >= 0, got {n_workers}")
        self.arena: ShmTensorArenaWriter = ShmTensorArena.create(
            1 + n_workers,
            policy="variable",
            arena_bytes=arena_bytes,
            max_allocations=max_allocations,
            shm_dir=shm_dir,
            counted=True,
        )
        self.min_bytes = int(min_bytes)
        self._warned: set[str] = set()
        # What fill did; the stubs sent are the arena's own count (stats()["sends"]).
        # "collections": garbage collections run (a full arena before declining, or after an
        # abort); "collection_s": the seconds they took.
        self.counters = {
            "filled": 0,
            "filled_bytes": 0,
            "declined": 0,
            "collections": 0,
            "collection_s": 0.0,
        }
        self._collected_at = -float("inf")

    def handle(self) -> ArenaHandle:
        return self.arena.handle()

    def holder_attached(self) -> bool:
        """Whether reader 0 (the engine core) is attached now: stubs go only then."""
        return self.arena.reader_state(0) == "attached"

    def everyone_joined(self) -> bool:
        """Whether every reader rank (the engine core and each worker) has attached at some
        point: nobody else will, so the arena's name may go."""
        n = self.arena.handle().n_readers
        return all(self.arena.reader_state(r) != "never_attached" for r in range(n))

    def fill(self, tensor: torch.Tensor) -> torch.Tensor | None:
        """A loan holding a copy of ``tensor`` (same dtype and shape), or ``None`` when it
        stays as it is: not a CPU tensor, not contiguous, smaller than ``min_bytes``, or the
        arena cannot lend that much now, even after a garbage collection (at most one per
        ``COLLECT_EVERY_S``; one warning per cause)."""
        if not isinstance(tensor, torch.Tensor):
            return None
        if tensor.device.type != "cpu" or tensor.is_sparse or tensor.is_quantized:
            _warn_once(self._warned, "device", "a %s tensor stays out of the arena", tensor.device)
            return None
        nbytes = tensor.numel() * tensor.element_size()
        if nbytes < self.min_bytes:
            return None
        if not tensor.is_contiguous():
            self.counters["declined"] += 1
            self.arena.count_decline("not_contiguous")
            _warn_once(self._warned, "contiguous", "a non-contiguous tensor stays out")
            return None
        loan = self.arena.empty(list(tensor.shape), tensor.dtype)
        if loan is None and self.collect_garbage() == 0.0:
            loan = self.arena.empty(list(tensor.shape), tensor.dtype)
        if loan is None:
            self.counters["declined"] += 1
            _warn_once(
                self._warned, "full", "the arena could not lend %d bytes: sent as usual", nbytes
            )
            return None
        loan.copy_(tensor)  # torch releases the GIL for a large copy
        self.counters["filled"] += 1
        self.counters["filled_bytes"] += nbytes
        return loan

    def collect_garbage(self) -> float:
        """Runs ``gc.collect()`` unless one ran in the last ``COLLECT_EVERY_S``: 0.0 when it
        ran (loans that only garbage cycles held are then back, for the next allocation),
        else the seconds until one may. ``fill`` calls it when the arena is full; the vLLM
        rebinding after an abort of a request that was sent stubs, so that its loans come back
        within a collection's time instead of whenever the collector next runs a full pass
        (seconds on an idle server)."""
        t0 = time.monotonic()
        wait = self._collected_at + COLLECT_EVERY_S - t0
        if wait > 0:
            return wait
        self._collected_at = t0
        gc.collect()
        self.counters["collections"] += 1
        self.counters["collection_s"] += time.monotonic() - t0
        return 0.0

    def consumer(self) -> LoanStubConsumer:
        """A new out-of-band tensor consumer over this arena (one per encoder)."""
        return LoanStubConsumer(self)


class LoanStubConsumer:
    """An out-of-band tensor consumer (vLLM's ``OOBTensorConsumer`` interface: ``__call__``
    and ``new_message``): a tensor lying in one of the writer's loans becomes a stub dict, one
    counted send; anything else, or any tensor while reader 0 is not attached, ``None`` (sent
    as usual). The sends of the message encoded last are ``sends_of_message()``; if that
    message does not go, ``unsend(sends)`` takes them back."""

    def __init__(self, writer: FrontendWriter) -> None:
        self._writer = writer
        self._sends: list[tuple[int, int]] = []
        self._attached = False

    def new_message(self) -> None:
        self._sends = []
        # Asked once per message: a holder that detaches mid-message still owes these sends
        # (a detached reader owes nothing, so nothing leaks).
        self._attached = self._writer.holder_attached()

    def __call__(self, tensor: torch.Tensor) -> dict | None:
        if not self._attached or tensor.device.type != "cpu" or not tensor.is_contiguous():
            return None
        ref = self._writer.arena.send_loan(tensor)
        if ref is None:
            return None
        slot, gen, off = ref
        self._sends.append((slot, gen))
        return {
            STUB_KEY: self._writer.arena.name,
            "slot": slot,
            "gen": gen,
            "off": off,
            "nbytes": tensor.numel() * tensor.element_size(),
        }

    def sends_of_message(self) -> list[tuple[int, int]]:
        """The (slot, generation) sends the message encoded last made (a copy)."""
        return list(self._sends)

    def new_sends(self) -> None:
        """Forgets the sends recorded so far (their message's fate is settled elsewhere)."""
        self._sends = []

    def unsend(self, sends: Sequence[tuple[int, int]]) -> None:
        """Takes back the sends of a message that did not go (reader 0 will never ack them)."""
        for slot, gen in sends:
            self._writer.arena.unsend(slot, gen)


def is_stub(data: Any) -> bool:
    """Whether an out-of-band placeholder is one of this module's stubs."""
    return isinstance(data, Mapping) and STUB_KEY in data


class StubProvider:
    """The engine core's end (reader 0): stub dicts back into zero-copy, unpinned tensors,
    each one counted stub, held until its last view dies. ``provider(dtype, shape, data)`` is vLLM's
    ``OOBTensorProvider`` signature; ``fallback`` (another provider) takes placeholders that
    are not this module's stubs."""

    def __init__(self, handle: ArenaHandle, *, fallback=None) -> None:
        self.reader: ShmTensorArenaReader = ShmTensorArena.attach(handle, 0)
        self._name = handle.name
        self._fallback = fallback

    def __call__(self, dtype: str, shape: Sequence[int], data: Any) -> torch.Tensor:
        if not is_stub(data):
            if self._fallback is None:
                raise ValueError("an out-of-band tensor placeholder this process cannot resolve")
            return self._fallback(dtype, shape, data)
        if data[STUB_KEY] != self._name:
            raise ValueError(f"a stub names arena {data[STUB_KEY]!r}, not {self._name!r}")
        fields = {}
        for key in _STUB_FIELDS:
            v = data.get(key)
            if not isinstance(v, int) or isinstance(v, bool) or v < 0:
                raise ValueError(f"stub field {key!r} is not a non-negative integer: {v!r}")
            fields[key] = v
        if fields["gen"] == 0:
            raise ValueError("stub field 'gen' is 0 (generations start at 1)")
        if not isinstance(dtype, str):
            raise ValueError(f"stub dtype is not a string: {dtype!r}")
        dims = list(shape)
        if not all(isinstance(d, int) and not isinstance(d, bool) for d in dims):
            raise ValueError(f"stub shape is not a list of integers: {shape!r}")
        return self.reader.get_tensor(
            fields["slot"],
            fields["nbytes"],
            dtype_from_name(dtype),
            dims,
            generation=fields["gen"],
            offset=fields["off"],
            stubs=1,
            # Unpinned: nothing in the engine core flushes this reader's gated releases (with
            # a CUDA context there, a pinned tensor's slot would never come back).
            pin=False,
        )

    def close(self) -> None:
        self.reader.close()
