"""Pickling with tensors kept out of the pickle stream.

Two layers, bottom to top:

* ``_reduce_tensor`` / ``_rebuild_tensor``: the protocol-5 out-of-band channel. A CPU
  tensor becomes a ``PickleBuffer`` over its bytes, which the transport ships as its own
  frame; the reader rebuilds a tensor over the received buffer. This is the fallback for
  everything the arena declines, and the baseline the arena is measured against.
* ``_ArenaPickler``: additionally diverts large contiguous CPU tensors (and ``Parameter``)
  into a ``ShmTensorArena`` and pickles a ~100-byte stub in their place.

Knows the arena (through the surface arena.py documents for it), not the queue; the arena
knows nothing of the pickler. The pickler's reusable state (idle picklers and C reducers, per
writer arena) lives here, in ``_Pools``.
"""

from __future__ import annotations

import copyreg
import io
import pickle
import weakref
from collections.abc import Sequence
from typing import Any

import torch

from vllm_shm_arena._ext import _C
from vllm_shm_arena.arena import (
    _NAME_BY_DTYPE,
    ShmTensorArena,
    dtype_from_name,
)

PROTOCOL = 5
#: Most idle picklers, and most idle C reducers, kept per arena.
_POOL_SIZE = 4


def _rebuild_tensor(buffer, dtype_str: str, shape: tuple) -> torch.Tensor:
    """Rebuilds a tensor over ``buffer`` without copying.

    Aliasing is only safe when the buffer belongs to the reader for good (a received ZeroMQ
    frame). A caller whose buffers will be reused (a ring chunk) passes copies to ``loads``.
    """
    return _C.tensor_from_buffer(buffer, dtype_from_name(dtype_str), list(shape))


def _reduce_tensor(t: torch.Tensor):
    """Reduces a CPU tensor to ``(_rebuild_tensor, (PickleBuffer, dtype, shape))``.

    Anything the raw bytes can't express (autograd state, conj/neg bits, sparse, quantized,
    non-CPU, a dtype without a stub name) goes through torch's own reduction instead.
    """
    if not _oob_expressible(t):
        return t.__reduce_ex__(PROTOCOL)
    if not t.is_contiguous():
        t = t.contiguous()
    # A uint8 view makes every dtype (bf16, fp8, bool, complex) a plain byte buffer.
    raw = t.reshape(-1).view(torch.uint8).numpy()
    return _rebuild_tensor, (pickle.PickleBuffer(raw), _NAME_BY_DTYPE[t.dtype], tuple(t.shape))


def _rebuild_parameter(buffer, dtype_str: str, shape: tuple, requires_grad: bool):
    """Rebuilds a Parameter sent out of band by _reduce_parameter."""
    return torch.nn.Parameter(_rebuild_tensor(buffer, dtype_str, shape), requires_grad)


def _reduce_parameter(p: torch.nn.Parameter):
    """A Parameter out of band, keeping ``requires_grad``. Without this, pickle would reduce
    ``p.data`` as a plain tensor, which the arena diverts: a trainable Parameter would come
    back living in shared memory that other readers see."""
    data = p.detach()
    if type(p) is not torch.nn.Parameter or not _oob_expressible(data):
        return p.__reduce_ex__(PROTOCOL)
    _, (buf, dtype_str, shape) = _reduce_tensor(data)
    return _rebuild_parameter, (buf, dtype_str, shape, p.requires_grad)


def _oob_expressible(t: torch.Tensor) -> bool:
    return (
        t.device.type == "cpu"
        and t.layout is torch.strided
        and not t.requires_grad
        and not t.is_conj()
        and not t.is_neg()
        and not t.is_quantized
        and t.dtype in _NAME_BY_DTYPE
    )


def _dispatch_table() -> dict:
    table = copyreg.dispatch_table.copy()
    table[torch.Tensor] = _reduce_tensor
    table[torch.nn.Parameter] = _reduce_parameter
    return table


class _OOBPickler(pickle.Pickler):
    """Protocol-5 pickler that sends CPU tensors out of band (the baseline path)."""

    dispatch_table = _dispatch_table()

    def __init__(self, file, buffer_callback):
        super().__init__(file, protocol=PROTOCOL, buffer_callback=buffer_callback)


class _Pools:
    """Idle picklers and C reducers of one writer arena, reused across messages: building
    either costs about as much as pickling a small message.

    Held in ``_POOLS`` by the arena, weakly: nothing here keeps the arena alive (an idle
    pickler's ``arena`` is cleared while it waits), so the pools go with their arena. No lock:
    a list's pop and append are atomic under the GIL, and the caps are soft (two threads may
    both give one back past a cap; the next take evens it out). A lock held in a with-block
    could be left held by a signal handler's exception raised between the block's last
    bytecode and its exit.
    """

    __slots__ = ("_reducers", "_picklers", "__weakref__")

    def __init__(self) -> None:
        self._reducers: list = []  # idle (C reducer, diverted list, min_bytes, forwarded list)
        self._picklers: list = []  # idle (pickler, BytesIO, buffers)

    def take_reducer(self, arena: ShmTensorArena, min_bytes: int | None = None):
        """A (C-level reducer_override, diverted list, min_bytes, forwarded list) for one dump
        (threshold: the layout's ``min_bytes`` unless given). Only default-threshold ones are
        pooled."""
        if min_bytes is None:
            min_bytes = arena.min_bytes
        if min_bytes == arena.min_bytes:
            try:
                entry = self._reducers.pop()
            except IndexError:
                pass
            else:
                entry[1].clear()
                entry[3].clear()
                return entry
        diverted: list = []
        forwarded: list = []
        return (arena.new_reducer(min_bytes, diverted, forwarded), diverted, min_bytes, forwarded)

    def give_back_reducer(self, arena: ShmTensorArena, entry) -> None:
        if entry[2] == arena.min_bytes and len(self._reducers) < _POOL_SIZE:
            self._reducers.append(entry)

    def take_pickler(self, arena: ShmTensorArena):
        """An idle (pickler, BytesIO, buffers) of ``dump_message``'s, made ``arena``'s again,
        or None."""
        try:
            cached = self._picklers.pop()
        except IndexError:
            return None
        cached[0].arena = arena
        return cached

    def give_back_pickler(self, cached) -> None:
        if len(self._picklers) < _POOL_SIZE:
            cached[0].arena = None  # an idle pickler must not keep its arena alive
            self._picklers.append(cached)
            return
        cached[0].release()


#: Each writer arena's pools (weak keys: they go with the arena).
_POOLS: weakref.WeakKeyDictionary[ShmTensorArena, _Pools] = weakref.WeakKeyDictionary()


def _pools(arena: ShmTensorArena) -> _Pools:
    pools = _POOLS.get(arena)
    if pools is None:
        # Two threads may both make one: one of them is kept, the other used once.
        pools = _POOLS.setdefault(arena, _Pools())
    return pools


class _ArenaPickler(pickle.Pickler):
    """Out-of-band pickler that also diverts large tensors into a ``ShmTensorArena``.

    The divert decision is the C-level ``reducer_override`` each instance installs
    (``make_reducer`` in csrc/bindings/stubs.cpp, the only one): pickle calls it for nearly
    every object of every message, and one pointer comparison in C keeps tensor-free messages
    at full speed. tests/python/reducer_oracle.py writes the same decision out in Python, as
    the oracle the C one is checked against.

    Slots used during a ``dump`` are listed in ``diverted``, forwards (the arena's
    ``forward_from``) in ``forwarded``; if the dump fails, give them back with
    ``arena.give_back_unsent(pickler.diverted)`` and ``arena.take_back_forwards(
    pickler.forwarded)`` (``dump_message`` does).
    """

    dispatch_table = _dispatch_table()

    def __init__(self, file, arena: ShmTensorArena, buffer_callback=None, min_bytes=None):
        self.arena = arena
        # Default: the arena layout's threshold (8 MiB fixed slots, lower for variable-size).
        self.min_bytes = arena.min_bytes if min_bytes is None else min_bytes
        # An instance attribute: pickle looks it up at __init__.
        self._cached = _pools(arena).take_reducer(arena, min_bytes)
        self.reducer_override, self.diverted, _, self.forwarded = self._cached
        super().__init__(file, protocol=PROTOCOL, buffer_callback=buffer_callback)

    def release(self) -> None:
        """Hands the arena's pooled C reducer back for the next message (optional: a pickler
        that never releases it only makes the next one build its own)."""
        if self._cached is not None:
            _pools(self.arena).give_back_reducer(self.arena, self._cached)
            self._cached = None


class Dumped:
    """A pickled message: the stream, its out-of-band buffers, the arena slots it uses, and
    the allocations of the arena's ``forward_from`` reader it forwards."""

    __slots__ = ("data", "buffers", "diverted", "forwarded")

    def __init__(
        self,
        data: bytes,
        buffers: list,
        diverted: list[tuple[int, int]],
        forwarded: list[tuple[int, int]] | None = None,
    ):
        self.data = data
        self.buffers = buffers
        self.diverted = diverted
        self.forwarded = forwarded if forwarded is not None else []


def dump_message(
    obj: Any,
    arena: ShmTensorArena | None = None,
    into: list | None = None,
    forwarded_into: list | None = None,
) -> Dumped:
    """Pickles ``obj``; with an arena, large tensors go into it (or are forwarded: the
    arena's ``forward_from``). Commit after dump: if pickling fails part-way, every slot it
    had taken goes back to the arena and every forward is taken back. ``into`` and
    ``forwarded_into``: the caller's lists, which get the slots taken and the forwards before
    this returns (inside the part whose failure gives them back), so that an exception raised
    as this returns (a signal handler's) leaves the caller knowing them. Giving a slot back
    twice is harmless; a forward is taken back once, from whichever list holds it (moved to
    ``forwarded_into`` in one C call, and ``take_back_forwards`` empties the list it takes
    back from)."""
    buffers: list = []
    f = io.BytesIO()
    if arena is None:
        _OOBPickler(f, buffers.append).dump(obj)
        return Dumped(f.getvalue(), buffers, [])
    # A pickler (with its BytesIO and buffer list) is reused across messages: building one
    # costs about as much as pickling a small message.
    pools = _pools(arena)
    cached = pools.take_pickler(arena)
    if cached is None:
        bufs: list = []
        bio = io.BytesIO()
        cached = (_ArenaPickler(bio, arena, buffer_callback=bufs.append), bio, bufs)
    p, bio, bufs = cached
    try:
        p.dump(obj)
        if into is not None:
            into.extend(p.diverted)
        fwd = p.forwarded
        out = Dumped(bio.getvalue(), list(bufs), list(p.diverted), list(fwd) if fwd else None)
        if fwd and forwarded_into is not None:
            _C.move_items(fwd, forwarded_into)  # the caller's to take back from now
    except BaseException:
        arena.give_back_unsent(p.diverted)
        arena.take_back_forwards(p.forwarded)  # those not handed to the caller
        p.release()  # a pickler that raised mid-dump is not reused
        raise
    bio.seek(0)
    bio.truncate()
    bufs.clear()
    p.diverted.clear()
    p.forwarded.clear()
    p.clear_memo()
    pools.give_back_pickler(cached)
    return out


def dumps(obj: Any, arena: ShmTensorArena | None = None) -> tuple[bytes, list]:
    """Pickles ``obj`` -> ``(bytes, out-of-band buffers)``; large tensors into ``arena``."""
    d = dump_message(obj, arena)
    return d.data, d.buffers


def loads(data, buffers: Sequence = ()) -> Any:
    """Unpickles what ``dumps`` produced. Tensors alias ``buffers``: pass buffers the caller
    owns for good, or copies."""
    return pickle.loads(data, buffers=buffers)


def dumps_inband(obj: Any) -> bytes:
    """Plain protocol-5 pickle with tensor bytes inside the stream (the pre-out-of-band
    baseline, for benchmarks)."""
    return pickle.dumps(obj, protocol=PROTOCOL)
