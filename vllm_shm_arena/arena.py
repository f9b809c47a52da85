"""The arena's Python face: ``ShmTensorArena`` (its roles ``ShmTensorArenaWriter``, from
``create``, and ``ShmTensorArenaReader``, from ``attach``) and the reader-side rebuild hooks.

Knows no transport: a writer hands out ``(slot, generation)`` pairs, something else carries
them, and a reader with the same arena attached turns them back into tensors.

Imports nothing of this package but the extension and ``settings``; the pickler and the queue
use each role's documented surface (the class docstrings say which calls), plus
``call_resolving_stubs(reader, fn, ...)`` around each message a reader unpickles and the
module's ``_NAME_BY_DTYPE`` (the dtypes a stub can carry). The rebuild hooks stubs name
(``_rebuild_arena_tensor``, ``_rebuild_arena_parameter``) stay where pickles find them.
"""

from __future__ import annotations

import dataclasses
import os
import threading
import weakref
from collections.abc import Sequence

import torch

from vllm_shm_arena import settings
from vllm_shm_arena._ext import _C

#: Default geometry of the fixed-slot layout: vLLM's own arena's (8 x 256 MiB), so that a
#: deployment moving between the two sees the same slots.
DEFAULT_NUM_SLOTS = 8
DEFAULT_SLOT_BYTES = 256 << 20
#: Default geometry of the variable-size layout: one region any tensor up to its size fits.
DEFAULT_ARENA_BYTES = 2 << 30
DEFAULT_MAX_ALLOCATIONS = 1024
#: Fixed-slot layout: tensors smaller than this take the out-of-band path (vLLM's own arena's
#: threshold): a whole 256 MiB slot per small tensor would run the 8 slots dry.
MIN_BYTES = 8 << 20
#: Variable-size layout: the divert threshold. Below the crossover of arena and out-of-band
#: delivery a copy into shared memory costs more than the transport it saves; the value sits
#: above that crossover by a margin over run-to-run noise (measured by `broadcast_ab.py
#: --threshold`, figures in benchmarks/results/threshold/). A small tensor takes only its own
#: bytes of the region, unlike a 256 MiB fixed slot, so the threshold can be this low.
VARIABLE_MIN_BYTES = 1 << 20

# Name <-> dtype for every dtype a stub may carry. Built from torch's own attributes so new
# dtypes (fp8 variants, unsigned ints) are picked up without a list to maintain. Quantized
# dtypes are left out: their bytes alone don't describe the tensor. _NAME_BY_DTYPE is part of
# the pickler's surface (the dtypes a stub, or an out-of-band buffer, can carry).
_NAME_BY_DTYPE: dict[torch.dtype, str] = {}
for _obj in vars(torch).values():
    if isinstance(_obj, torch.dtype) and not str(_obj).startswith("torch.q"):
        _NAME_BY_DTYPE[_obj] = str(_obj).removeprefix("torch.")
_DTYPE_BY_NAME: dict[str, torch.dtype] = {n: d for d, n in _NAME_BY_DTYPE.items()}
_C.register_stub_dtypes(_DTYPE_BY_NAME)  # what a reader's stub rebuild accepts
del _obj


def dtype_from_name(name: str) -> torch.dtype:
    """The torch dtype for a stub's dtype string; ``ValueError`` if there is none."""
    dt = _DTYPE_BY_NAME.get(name) if isinstance(name, str) else None
    if dt is None:
        raise ValueError(f"unknown dtype string {name!r} in an arena stub")
    return dt


def dtype_name(dtype: torch.dtype) -> str:
    """The stub string for a dtype (``torch.bfloat16`` -> ``"bfloat16"``)."""
    return _NAME_BY_DTYPE[dtype]


@dataclasses.dataclass(frozen=True)
class ArenaHandle:
    """What a reader needs to attach: small and picklable (it rides in the queue Handle).

    ``num_slots`` is the number of slots of the arena's slot table, so the most allocations it
    holds at once, in either layout; ``slot_bytes`` is the largest allocation: a slot's size in
    the fixed layout, the whole data region in the variable one. The fields keep their names
    (handles are pickled inside vLLM's ``Handle``); ``max_allocations`` and
    ``max_allocation_bytes`` say the same with names that fit both layouts.
    """

    name: str
    n_readers: int
    num_slots: int
    slot_bytes: int
    dir: str
    policy: str = "fixed"
    #: A counted arena: its payloads are sent to reader 0 any number of times and forwarded
    #: by it to the other readers (csrc/core/arena_layout.h); False: each reader takes a
    #: payload once.
    counted: bool = False

    @property
    def max_allocations(self) -> int:
        """The most allocations the arena holds at once (``num_slots``)."""
        return self.num_slots

    @property
    def max_allocation_bytes(self) -> int:
        """The largest allocation (``slot_bytes``: the whole data region when variable)."""
        return self.slot_bytes


#: This process's attached reader arenas by shm name. Weak values: an entry disappears when
#: nothing else holds the arena, so the registry never keeps a mapping (or its pinning) alive.
_TENSOR_ARENAS: weakref.WeakValueDictionary[str, ShmTensorArena] = weakref.WeakValueDictionary()
#: Per thread, the reader arena stubs resolve to first (set only by ``resolving_stubs`` and
#: ``call_resolving_stubs``, around each message a queue's reader unpickles): two ranks of one
#: arena attached in one process share its name, so the name registry alone would hand one
#: rank's stubs to the other's reader.
_CURRENT_READER = threading.local()

_cuda_seen = False


def _forget_cuda_in_child() -> None:
    """A forked child has none of its parent's CUDA context (torch refuses CUDA there), so the
    sticky "this process has a context" must not survive the fork: a reader attached in the
    child would pin, and gate releases on events it cannot record."""
    global _cuda_seen
    _cuda_seen = False


os.register_at_fork(after_in_child=_forget_cuda_in_child)
#: VLLM_SHM_ARENA_PIN=0 turns page-locking off (the slot then releases as soon as its tensor
#: dies, and H2D copies from it are pageable). Read once at import.
_PIN_ENABLED = settings.pin_enabled()


def _stream_min_from_env() -> None:
    """VLLM_SHM_ARENA_STREAM_MIN_MB: a message's copies into the arena and the ring use
    streaming stores once they have written this many MiB (default 32; 0 turns them off).
    Read once at import; a bad value is a ``ValueError`` naming the variable."""
    nbytes = settings.stream_min_bytes()
    if nbytes is not None:
        _C.set_stream_min_bytes(nbytes)
    pool = settings.frame_pool_bytes()  # VLLM_SHM_ARENA_FRAME_POOL_MB, likewise
    if pool is not None:
        _C.set_frame_pool_max_idle_bytes(pool)


_stream_min_from_env()


def _cuda_context() -> bool:
    """Whether this process already has a CUDA context (never creates one). Sticky once true."""
    global _cuda_seen
    # is_initialized() alone: it is cheap and false without CUDA, unlike is_available().
    if not _cuda_seen and torch.cuda.is_initialized():
        _cuda_seen = True
    return _cuda_seen


def _other_roles_call(name: str, role: str):
    """A method of the other role, on this one: the error says whose call it is."""

    def call(self, *args, **kwargs):
        mine = "the writer" if self.is_writer else "a reader"
        raise RuntimeError(f"{name}() is a {role} call; this ShmTensorArena is {mine}")

    call.__name__ = name
    call.__doc__ = f"The {role}'s call (``RuntimeError`` on the other role)."
    return call


#: Each role's calls, which the other role answers with a clear RuntimeError.
_WRITER_CALLS = (
    "write write_tensor new_reducer empty give_back_unsent send_holds reclaim unlink write_blob "
    "send_loan unsend forward_from take_back_forwards count_decline"
)
_READER_CALLS = (
    "get_tensor rebuild_stub flush_releases needs_flush release_unacquired read_blob forward "
    "unforward find_hold"
)


class ShmTensorArena:
    """A shared-memory region of ``num_slots`` x ``slot_bytes`` for one writer and N readers.

    The writer (``create``, a ``ShmTensorArenaWriter``) copies a tensor into a free slot once;
    every reader (``attach``, a ``ShmTensorArenaReader``) gets a zero-copy tensor over the same
    slot. The slot comes back when every reader's last view of it has died (and, when the
    reader pinned the memory for CUDA, the DMA reading it has completed). The writer never
    blocks: no free slot, too big, unsupported -> ``None``. This class holds what both roles
    share; each role's calls are its own class's.
    """

    #: ``True`` for the writer's class.
    is_writer = False

    def __init__(self, *args, **kwargs):
        # vLLM's own arena class is called as ShmTensorArena(n_reader, slot_bytes, n_slots,
        # name, reader_rank): such a call must fail here, at the mistake.
        raise TypeError(
            "build a ShmTensorArena with ShmTensorArena.create(n_readers, num_slots, "
            "slot_bytes, ...) (the writer) or ShmTensorArena.attach(handle, reader_rank) (a "
            "reader) (vLLM's ShmTensorArena(n_reader, slot_bytes, n_slots) is not this "
            f"signature), got {args!r}" + (f", keywords {sorted(kwargs)}" if kwargs else "")
        )

    def _init_role(self, handle: ArenaHandle) -> None:
        self._handle = handle
        self._closed = False
        self._lock = threading.Lock()

    # ----------------------------------------------------------------- construction
    @staticmethod
    def create(
        n_readers: int,
        num_slots: int = DEFAULT_NUM_SLOTS,
        slot_bytes: int = DEFAULT_SLOT_BYTES,
        *,
        policy: str = "fixed",
        arena_bytes: int = DEFAULT_ARENA_BYTES,
        max_allocations: int = DEFAULT_MAX_ALLOCATIONS,
        shm_dir: str | None = None,
        counted: bool = False,
    ) -> ShmTensorArenaWriter:
        """Creates a new arena as its writer. Raises ``OSError`` if ``/dev/shm`` is too small.

        ``policy="fixed"``: ``num_slots`` slots of ``slot_bytes`` (vLLM's own arena's
        layout). ``policy="variable"``: one region of ``arena_bytes`` into which tensors of any
        size up to the whole region are packed, at most ``max_allocations`` at a time.
        ``counted=True``: a counted arena (``ArenaHandle.counted``): a loan may be sent any
        number of times (``send_loan`` counts each send, ``unsend`` takes one back); reader 0
        forwards what it holds to the other readers (``forward``); a payload comes back once
        every send and every forward is acked. Ranks attach once.
        """
        if n_readers < 1:
            raise ValueError(f"n_readers must be >= 1, got {n_readers}")
        if policy not in ("fixed", "variable"):
            raise ValueError(f"policy must be 'fixed' or 'variable', got {policy!r}")
        variable = policy == "variable"
        w = _C.TensorArenaWriter(
            n_readers,
            num_slots,
            slot_bytes,
            shm_dir or "",
            arena_bytes if variable else 0,
            max_allocations,
            bool(counted),
        )
        if settings.debug_checksum():
            w.set_debug_checksum(True)
        handle = ArenaHandle(
            w.name,
            n_readers,
            max_allocations if variable else num_slots,
            w.slot_bytes,
            w.dir,
            policy,
            bool(counted),
        )
        return ShmTensorArenaWriter._wrap(w, handle)

    @staticmethod
    def attach(handle: ArenaHandle, reader_rank: int) -> ShmTensorArenaReader:
        """Attaches as reader ``reader_rank`` and registers the arena in ``_TENSOR_ARENAS``."""
        if not isinstance(handle, ArenaHandle):
            raise TypeError(f"expected an ArenaHandle, got {type(handle).__name__}")
        pin_chunk = settings.pin_chunk_bytes()
        # The handle must describe the arena it names (a handle of another arena would attach
        # silently and resolve stubs against the wrong geometry); checked before the rank is
        # claimed, so a refused attach leaves the rank as it was.
        expect = (
            handle.n_readers,
            handle.num_slots,
            handle.slot_bytes,
            handle.policy,
            bool(handle.counted),
        )
        r = _C.TensorArenaReader(handle.name, reader_rank, handle.dir, pin_chunk, expect)
        arena = ShmTensorArenaReader._wrap(r, handle)
        _TENSOR_ARENAS[handle.name] = arena
        return arena

    # ----------------------------------------------------------------- properties
    @property
    def name(self) -> str:
        """The shared-memory name (also the registry key stubs carry)."""
        return self._handle.name

    @property
    def slot_bytes(self) -> int:
        """Bytes per slot: the largest tensor the arena accepts."""
        return self._handle.slot_bytes

    @property
    def num_slots(self) -> int:
        """Number of slots."""
        return self._handle.num_slots

    @property
    def min_bytes(self) -> int:
        """The divert threshold of this arena's layout: tensors smaller than this go out of
        band (``MIN_BYTES`` for fixed slots, ``VARIABLE_MIN_BYTES`` for variable-size)."""
        return VARIABLE_MIN_BYTES if self._handle.policy == "variable" else MIN_BYTES

    @property
    def layout(self) -> str:
        """The geometry in words, e.g. "8 x 256 MiB slots" or "2048 MiB variable-size"."""
        h = self._handle
        if h.policy == "variable":
            return f"{h.slot_bytes >> 20} MiB variable-size, <= {h.num_slots} allocations"
        return f"{h.num_slots} x {h.slot_bytes >> 20} MiB slots"

    def handle(self) -> ArenaHandle:
        """A small picklable handle readers attach with."""
        return self._handle

    def stats(self, *, holdings: bool = True) -> dict:
        """Counters. Writer: hits, bytes, declined{too_small, not_contiguous, oversize,
        no_free_slot, no_space, unsupported, no_record}, cold/warm copies and bytes,
        reclaimed, dead_readers, aborted, loans/loans_sent/loans_returned, in_use,
        free_bytes/largest_free (variable layout), holdings (per reader: state, slots held,
        age of the oldest; ``holdings=False`` leaves that walk out). Reader: rank, held,
        acked (counted arenas: the stubs this reader acked so far), pinned_bytes,
        pending_releases, pin statistics, checksum_mismatches (with
        VLLM_SHM_ARENA_DEBUG_CHECKSUM=1 on the writer: releases whose slot bytes had changed
        since the write, e.g. an in-place write by a reader)."""
        raise NotImplementedError

    def reader_state(self, rank: int) -> str:
        """Reader ``rank``'s state (either role): "never_attached", "attached", "detached" or
        "dead"."""
        return self._checked().reader_state(int(rank))

    def close(self) -> None:
        """Writer: unlinks the name; writes are refused from now on. Reader: stubs naming it
        no longer resolve, and the mapping goes (and the writer stops waiting for this rank)
        once the tensors handed out are gone. Tensors already handed out stay valid either
        way."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._close()

    def _close(self) -> None:
        raise NotImplementedError


for _name in _WRITER_CALLS.split():
    setattr(ShmTensorArena, _name, _other_roles_call(_name, "writer"))
for _name in [*_READER_CALLS.split(), "hold_slots"]:
    setattr(ShmTensorArena, _name, _other_roles_call(_name, "reader"))
del _name


class ShmTensorArenaWriter(ShmTensorArena):
    """The arena's writer (``ShmTensorArena.create``).

    The surface the pickler and the queue use (documented, public): ``new_reducer`` (the
    C-level divert decision over this arena), ``give_back_unsent`` (allocations no reader can
    ever see), ``send_holds`` (allocations' bytes for a socket to send by reference),
    ``write_blob`` (a whole message in one allocation; the extension's own call, so a
    caller can store its result in the C call that made it: ``_C.call_store``), ``min_bytes``
    and ``name``; with forwarding (``forward_from``), ``take_back_forwards``.
    """

    is_writer = True

    @classmethod
    def _wrap(cls, writer, handle: ArenaHandle) -> ShmTensorArenaWriter:
        self = cls.__new__(cls)
        self._init_role(handle)
        self._writer = writer
        #: ``write_blob(frames, max_bytes)``: packs a whole message's ``frames`` into one
        #: allocation of at most ``max_bytes`` -> ``(slot, generation, nbytes)``, or ``None``
        #: if declined (never waits). The GIL is released during the copy.
        self.write_blob = writer.write_frames
        #: ``(reader, ranks)`` set by ``forward_from``, or None.
        self._forward: tuple[ShmTensorArenaReader, int] | None = None
        self._forwards_sent = 0  # forward stubs in messages that went (count_forwards)
        return self

    def _checked(self):
        if self._closed:
            raise RuntimeError(f"arena {self.name} is closed")
        return self._writer

    def write(self, tensor: torch.Tensor) -> tuple[int, int] | None:
        """Copies ``tensor`` into a slot -> ``(slot, generation)`` (what a stub names), or
        ``None`` if declined (see ``write_tensor``)."""
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"write_tensor takes a torch.Tensor, got {type(tensor).__name__}")
        return self._checked().write_tensor(tensor)

    def write_tensor(self, tensor: torch.Tensor) -> int | None:
        """Copies a contiguous CPU tensor into a free slot once; returns the slot or ``None``.

        Declines (and counts why in ``stats()``) non-contiguous, non-CPU, sparse, quantized and
        conj/neg-bit tensors, tensors larger than a slot, and any write while every slot is
        held. Never blocks. The GIL is released during the copy.
        """
        res = self.write(tensor)
        return None if res is None else res[0]

    def forward_from(self, reader: ShmTensorArenaReader, ranks: int) -> None:
        """Stubs of tensors lying in one of ``reader``'s holds (reader 0 of a counted arena, in
        this process) are forwarded instead of copied: the reducer counts one
        ``reader.forward`` per stub, while every one of ``reader``'s ranks 1..``ranks`` (this
        arena's readers, each attached to ``reader``'s arena as rank 1 + its own) is attached.
        Call it before the first message is pickled; reducers made earlier do not forward."""
        if (
            not isinstance(reader, ShmTensorArenaReader)
            or not reader.handle().counted
            or reader._rank
        ):
            raise ValueError("forward_from takes reader 0 of a counted arena")
        if not 1 <= ranks < reader.handle().n_readers:
            raise ValueError(
                f"forward_from: {ranks} ranks, the arena has {reader.handle().n_readers} readers"
            )
        self._forward = (reader, int(ranks))

    def count_forwards(self, n: int) -> None:
        """``n`` forward stubs went out in a message (``stats()["forwarded"]``)."""
        self._forwards_sent += n

    def take_back_forwards(self, forwarded: list) -> None:
        """Takes back the forwards of a message that did not go: the ``forwarded`` list its
        reducer filled, emptied as each is taken back (the list is the record of what is
        still counted, so a second call takes back nothing twice). Works after this arena's
        ``close()``; a closed forwarding reader has nothing to take back (its holds went)."""
        if self._forward is None or not forwarded:
            return
        reader = self._forward[0]._reader
        if reader is not None:
            reader.unforward_all(forwarded)

    def new_reducer(self, min_bytes: int, diverted: list, forwarded: list | None = None):
        """A C-level ``reducer_override`` that diverts tensors of at least ``min_bytes`` into
        this arena and appends each ``(slot, generation)`` it wrote to ``diverted`` (the
        pickler pools them: building one costs about as much as pickling a small message);
        with ``forward_from`` set, it forwards and appends each forward to ``forwarded``."""
        forward = None
        if self._forward is not None and forwarded is not None:
            reader, ranks = self._forward
            forward = (reader._checked(), ranks, reader.name, _rebuild_forwarded, forwarded)
        return _C.make_reducer(
            self._checked(),
            torch.Tensor,
            torch.nn.Parameter,
            _rebuild_arena_tensor,
            _rebuild_arena_parameter,
            _NAME_BY_DTYPE,
            min_bytes,
            diverted,
            forward,
        )

    def empty(self, shape: Sequence[int], dtype: torch.dtype = torch.float32):
        """A tensor that already lives in the arena (a loan), or ``None`` if the arena cannot
        lend that much now.

        Fill it in place and send it: the pickler sends its stub without copying (a
        contiguous view of it works too). Rules: the first send costs no copy; a later send
        of the same tensor is copied like any other tensor (readers may already have let go
        of the first); writing into it after sending changes what readers that still hold it
        see; dropping it unsent gives its space back at once; after sending, its space comes
        back once every reader and this tensor are gone.
        """
        w = self._checked()
        if not isinstance(dtype, torch.dtype):
            raise TypeError(f"dtype must be a torch.dtype, got {dtype!r}")
        return w.empty([int(d) for d in shape], dtype)

    def send_loan(self, tensor: torch.Tensor) -> tuple[int, int, int] | None:
        """Publishes the loan ``tensor`` lies in for one send -> ``(slot, generation,
        offset)``, or ``None`` when it lies in no live loan (or, in an accept-once arena, one
        sent already). In a counted arena every call is one more send to reader 0, owed until
        reader 0 acks it; a send whose message did not go is taken back with ``unsend``."""
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"send_loan takes a torch.Tensor, got {type(tensor).__name__}")
        return self._checked().send_loan(tensor)

    def unsend(self, slot: int, generation: int) -> None:
        """Counted arenas: takes back one send of ``(slot, generation)`` whose message did not
        go (``ValueError`` when there is none to take back, or the arena is not counted)."""
        self._checked().unsend(int(slot), int(generation))

    def give_back_unsent(self, allocations: Sequence[tuple[int, int]]) -> None:
        """Gives back the ``(slot, generation)`` allocations of a message no reader can ever
        see (its pickling or its send failed before anything was published, or a blob no ring
        marker names). Works after ``close()`` too (a send that close() interrupted must still
        give its slots back); giving one back twice is harmless."""
        w = self._writer
        for slot, gen in allocations:
            w.abort(slot, gen)

    def send_holds(self, allocations: Sequence[tuple[int, int]]) -> list:
        """The bytes of each published ``(slot, generation)`` allocation, held for a send by
        reference -> ``[_C.SendHold, ...]`` (read-only buffers; ``_C.send_frames`` hands them to
        ZeroMQ without a copy). While a hold lives (the object, or ZeroMQ's reference to the
        frame until the socket has sent it), the slot is not recycled, whatever its readers
        do; the mapping stays valid even after ``close()``."""
        w = self._checked()
        return [w.hold_for_send(slot, gen) for slot, gen in allocations]

    def reclaim(self, check_liveness: bool = True) -> int:
        """Recycles slots every reader released (and those held by dead readers)."""
        return self._checked().reclaim(check_liveness)

    def unlink(self) -> None:
        """Removes the shm name; attached readers keep working, new ones can't attach."""
        self._checked().unlink()

    def count_decline(self, reason: str) -> None:
        """Counts a tensor declined for ``reason`` (a ``stats()["declined"]`` key) by a caller
        that decided it without asking the arena (e.g. not contiguous)."""
        self._checked().count_decline(reason)

    def stats(self, *, holdings: bool = True) -> dict:
        s = self._writer.stats()
        if holdings:
            s["holdings"] = self._writer.holdings()
        if self._forward is not None:
            s["forwarded"] = self._forwards_sent  # tensors sent by reference, not in ``hits``
        return s

    def _close(self) -> None:
        self._writer.unlink()

    def __repr__(self) -> str:
        return f"ShmTensorArena(writer, name={self.name!r}, {self.layout})"


class ShmTensorArenaReader(ShmTensorArena):
    """One reader rank of an arena (``ShmTensorArena.attach``).

    The surface the queue uses (documented, public): ``needs_flush``/``flush_releases``,
    ``hold_slots`` and ``read_blob`` (the extension's own calls, so a caller can store their
    results in the C call that made them: ``_C.call_store``), ``release_unacquired``, and
    ``call_resolving_stubs(reader, ...)`` around each message it unpickles.
    """

    @classmethod
    def _wrap(cls, reader, handle: ArenaHandle) -> ShmTensorArenaReader:
        self = cls.__new__(cls)
        self._init_role(handle)
        self._reader = reader
        self._rank = reader.rank
        self._may_gate = False  # a pinned tensor was handed out: releases are gated
        #: ``read_blob(slot, generation, nbytes)``: the frames of a blob ``write_blob`` packed,
        #: copied out; the blob is released at once.
        self.read_blob = reader.read_frames
        #: ``hold_slots(pairs)``: holds a message's (slot, generation) pairs until the returned
        #: object dies (so an unpickling cut short can run again).
        self.hold_slots = reader.hold_slots
        return self

    def _checked(self):
        if self._reader is None:
            raise RuntimeError(
                f"arena {self.name} is closed (its queue was shut down): stubs naming it can "
                "no longer be resolved"
            )
        return self._reader

    def get_tensor(
        self,
        slot_idx: int,
        nbytes: int,
        dtype: torch.dtype,
        shape: Sequence[int],
        generation: int | None = None,
        offset: int = 0,
        stubs: int = 1,
        pin: bool = True,
    ) -> torch.Tensor:
        """A tensor whose storage *is* the slot (zero bytes copied).

        The slot is released when the storage is freed, so views, slices and ``Parameter``
        wrappers keep it alive; with pinned memory, only after the next ``flush_releases``
        finds the DMA done. ``generation`` (from the stub) guards against stale stubs; without
        it the slot's current generation is used. ``stubs`` (counted arenas): how many stubs
        this reader was sent that the tensor stands for, acked when the slot's last view here
        dies; 0 only under a view that counted its stub. ``pin=False``: never pinned, so its
        release never waits for a ``flush_releases`` (for a reader that nothing flushes).
        """
        r = self._checked()
        if not isinstance(dtype, torch.dtype):
            raise TypeError(f"dtype must be a torch.dtype, got {dtype!r}")
        return r.get_tensor(
            int(slot_idx),
            int(generation or 0),
            int(nbytes),
            dtype,
            list(shape),
            pin and self._pin_next(),
            int(offset),
            int(stubs),
        )

    def forward(self, slot: int, generation: int) -> None:
        """Counted arenas, reader 0, while it holds ``(slot, generation)``: one more stub of it
        passed on to the other readers, each of which owes one more ack (``ValueError``
        otherwise). Count it before the message goes; ``unforward`` if it did not go."""
        self._checked().forward(int(slot), int(generation))

    def unforward(self, slot: int, generation: int) -> None:
        """Takes back one ``forward`` whose message did not go."""
        self._checked().unforward(int(slot), int(generation))

    def find_hold(self, tensor: torch.Tensor) -> tuple[int, int, int, int] | None:
        """The allocation this reader holds that a contiguous CPU ``tensor``'s bytes lie in ->
        ``(slot, generation, offset, nbytes)``, or ``None``."""
        return self._checked().find_hold(tensor)

    def rebuild_stub(self, slot_idx, generation, nbytes, dtype_str, shape, offset=0):
        """The tensor a stub names (its fields come from a message: the extension checks each
        one, ``ValueError``/``IndexError`` naming it, before use)."""
        return self._checked().rebuild(
            slot_idx, generation, nbytes, dtype_str, shape, offset, self._pin_next()
        )

    def _pin_next(self) -> bool:
        """Whether the tensor handed out next is pinned (pinning on, and a CUDA context in this
        process); once one is, releases go through the CUDA-event gate."""
        pin = _PIN_ENABLED and _cuda_context()
        if pin:
            self._may_gate = True
        return pin

    def flush_releases(self, stream=None) -> int:
        """Releases slots whose tensors died and whose H2D (if pinned) has completed.

        Records a CUDA event on ``stream`` (default: the current stream) for slots freed since
        the last call; non-blocking. Returns how many slots went back to the writer.
        """
        r = self._checked()
        if not self._may_gate:
            return 0  # nothing was ever pinned: every release already happened at free
        handle = 0
        if _cuda_context():
            if stream is None:
                stream = torch.cuda.current_stream()
            handle = int(getattr(stream, "cuda_stream", stream))
        return r.flush_releases(handle)

    @property
    def needs_flush(self) -> bool:
        """Whether ``flush_releases`` has anything to do (a pinned tensor was handed out, so
        releases wait for their CUDA events); a transport calls it before each read."""
        return self._may_gate

    def release_unacquired(self, slot: int, generation: int) -> None:
        """Releases a slot a message named but this reader never turned into a tensor (the
        message failed to unpickle), so the writer is not kept waiting for it."""
        self._checked().release_unacquired(slot, generation)

    def stats(self, *, holdings: bool = True) -> dict:
        if self._reader is None:  # closed: the totals at close
            return dict(self._final_stats)
        return self._reader.stats()

    def _close(self) -> None:
        if _TENSOR_ARENAS.get(self.name) is self:
            del _TENSOR_ARENAS[self.name]
        self._last_flush()
        # Tensors handed out hold the mapping (and its pinning) themselves; without this
        # reference it goes as soon as the last of them does.
        self._final_stats = self._reader.stats()
        self._reader = None
        # The bound calls hold the extension's reader too: without them the methods below
        # answer (closed), and the rank is detached as soon as the last tensor is gone.
        for name in ("read_blob", "hold_slots"):
            self.__dict__.pop(name, None)

    def _last_flush(self) -> None:
        """Releases the pinned tensors that died since the last ``flush_releases``: their
        event recorded on the current stream (the copies' stream, as for every flush), that
        stream waited for, then released. Nothing would flush them after the close, so the
        rank would stay attached, owing its acks, until the process exits. (A pinned tensor
        that outlives the close has that fate still: when it dies no stream is known to
        record its event on.) Never raises: a close does not fail on CUDA's account (at exit
        it may be gone)."""
        if not self._may_gate or not _cuda_context():
            return
        try:
            stream = torch.cuda.current_stream()
            self.flush_releases(stream)
            stream.synchronize()
            self.flush_releases(stream)
        except Exception:  # noqa: BLE001
            pass

    def read_blob(self, slot: int, generation: int, nbytes: int) -> list:
        """(Closed: refused.) See ``_wrap``."""
        return self._checked().read_frames(slot, generation, nbytes)

    def hold_slots(self, pairs):
        """(Closed: refused.) See ``_wrap``."""
        return self._checked().hold_slots(pairs)

    def __repr__(self) -> str:
        return f"ShmTensorArena(reader{self._rank}, name={self.name!r}, {self.layout})"


class resolving_stubs:
    """``with resolving_stubs(reader):`` stubs unpickled in this thread inside the block
    resolve to ``reader`` first (a reader ``ShmTensorArena``, closed or not), then to the
    registry of attached arenas. Two ranks of one arena attached in one process share its name:
    a queue's reader unpickles each message inside this block so that its stubs resolve to its
    own rank. Nests; the previous reader is restored on leaving, exception or not."""

    __slots__ = ("_reader", "_prev")

    def __init__(self, reader: ShmTensorArena) -> None:
        if not isinstance(reader, ShmTensorArena) or reader.is_writer:
            raise TypeError(f"resolving_stubs takes a reader ShmTensorArena, got {reader!r}")
        self._reader = reader

    def __enter__(self) -> ShmTensorArena:
        self._prev = getattr(_CURRENT_READER, "arena", None)
        _CURRENT_READER.arena = self._reader
        return self._reader

    def __exit__(self, *exc) -> None:
        _CURRENT_READER.arena = self._prev


def call_resolving_stubs(reader: ShmTensorArena, fn, *args):
    """``fn(*args)`` with stubs unpickled in this thread resolving to ``reader`` first, like
    ``with resolving_stubs(reader):``, but the previous reader is restored in C whatever
    happens (a with-block's ``__exit__`` can be cut short by a signal handler's exception): a
    queue's reader unpickles each message through this."""
    return _C.call_with(_CURRENT_READER, "arena", reader, fn, args)


def call_resolving_forwards(reader: ShmTensorArena, fn, *args):
    """``fn(*args)`` with forward stubs (``ShmTensorArenaWriter.forward_from``) unpickled in
    this thread resolving to ``reader`` (this process's rank of the forwarding arena), set
    and restored in C like ``call_resolving_stubs``."""
    return _C.call_with(_CURRENT_READER, "forwarded", reader, fn, args)


#: This process's forward source: (reader 0 of a counted arena, the pid that set it).
_FORWARD_SOURCE: tuple[ShmTensorArenaReader, int] | None = None


def set_forward_source(reader: ShmTensorArenaReader | None) -> None:
    """Names the reader the next queue writer created in this process forwards from (reader
    0 of a counted arena: see ``ShmTensorArenaWriter.forward_from``); None: none."""
    global _FORWARD_SOURCE
    _FORWARD_SOURCE = None if reader is None else (reader, os.getpid())


def take_forward_source() -> ShmTensorArenaReader | None:
    """The reader ``set_forward_source`` named in this process, handed to one caller (the
    first queue writer that can forward from it: each worker rank of that arena is one
    queue's reader) and cleared; None if none (a forked child inherits none: the holds are
    its parent's)."""
    global _FORWARD_SOURCE
    src = _FORWARD_SOURCE
    if src is None or src[1] != os.getpid():
        return None
    _FORWARD_SOURCE = None
    return src[0]


def _lookup(arena_name: str) -> ShmTensorArena:
    current = getattr(_CURRENT_READER, "arena", None)
    if current is not None and current.name == arena_name:
        return current
    arena = _TENSOR_ARENAS.get(arena_name) if isinstance(arena_name, str) else None
    if arena is None:
        raise RuntimeError(
            f"arena stub names tensor arena {arena_name!r}, which is not attached in this "
            "process (never attached, or closed/garbage-collected since); attach it with "
            "ShmTensorArena.attach(handle, rank) and keep a reference while unpickling"
        )
    return arena


class FrameStubs:
    """Resolves the arena stubs of a message that came over TCP: a remote node cannot map the
    writer's arena, so the writer's socket sends each allocation the message names after its
    out-of-band buffers (protocol.py), and a stub rebuilds a zero-copy tensor over its
    allocation's frame. Stands in for a reader arena in ``call_resolving_stubs`` (``name``,
    ``rebuild_stub``)."""

    __slots__ = ("name", "_frames")

    def __init__(self, name: str, allocations: Sequence[tuple[int, int]], frames: Sequence):
        self.name = name
        #: (slot, generation) -> the frame holding that allocation's bytes.
        self._frames = dict(zip(allocations, frames, strict=True))

    def rebuild_stub(self, slot_idx, generation, nbytes, dtype_str, shape, offset=0):
        """A tensor over ``nbytes`` at ``offset`` of the named allocation's frame. The fields
        come from the message: each is checked (``ValueError``) before use."""
        key = (slot_idx, generation)
        frame = self._frames.get(key) if all(type(x) is int for x in key) else None
        if frame is None:
            raise ValueError(
                f"malformed arena stub: (slot {slot_idx!r}, generation {generation!r}) is not "
                "an allocation this message carries"
            )
        for what, v in (("nbytes", nbytes), ("offset", offset)):
            if type(v) is not int or v < 0:
                raise ValueError(f"malformed arena stub: {what}={v!r}")
        mv = memoryview(frame).cast("B")
        if offset > len(mv) or nbytes > len(mv) - offset:
            raise ValueError(
                f"malformed arena stub: {nbytes} bytes at offset {offset} of a "
                f"{len(mv)}-byte allocation"
            )
        if not isinstance(shape, tuple | list):
            raise ValueError(f"malformed arena stub: shape={shape!r}")
        return _C.tensor_from_buffer(
            mv[offset : offset + nbytes], dtype_from_name(dtype_str), list(shape)
        )


def _rebuild_arena_tensor(arena_name, slot_idx, generation, nbytes, dtype_str, shape, offset=0):
    """Unpickles an arena stub into a zero-copy tensor over the slot (``offset`` bytes into
    it, for a view of a loaned tensor). The stub's fields come from the message: the reader's
    ``rebuild`` (C++) checks each one (``ValueError``/``IndexError`` naming it) before use."""
    return _lookup(arena_name).rebuild_stub(slot_idx, generation, nbytes, dtype_str, shape, offset)


def _rebuild_forwarded(arena_name, slot_idx, generation, nbytes, dtype_str, shape, offset):
    """Unpickles a forward stub (``ShmTensorArenaWriter.forward_from``): a zero-copy tensor
    over this process's rank of the forwarding arena, under the hold its message's frame 0
    took (checked like any stub)."""
    reader = getattr(_CURRENT_READER, "forwarded", None)
    if reader is None or reader.name != arena_name:
        raise RuntimeError(
            f"a forward stub names arena {arena_name!r}, which this reader has not attached"
        )
    return reader.rebuild_stub(slot_idx, generation, nbytes, dtype_str, shape, offset)


def _rebuild_arena_parameter(arena_name, slot_idx, generation, nbytes, dtype_str, shape, offset=0):
    """Like _rebuild_arena_tensor, wrapped in a Parameter sharing its storage."""
    t = _rebuild_arena_tensor(arena_name, slot_idx, generation, nbytes, dtype_str, shape, offset)
    return torch.nn.Parameter(t, requires_grad=False)
