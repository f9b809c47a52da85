"""The readers' ends of a queue: a node-local reader (the ring, its overflow markers, arena
blobs, the local socket, the writer's liveness) and a remote reader (the TCP socket).

Both unpickle a message with stubs resolving to their own arena reader
(``arena.call_resolving_stubs``), a remote reader to the allocations' bytes its message carries
(``arena.FrameStubs``); a message that fails to unpickle is consumed with its error, and
the arena slots it named go back, so the writer is never kept waiting for them.

Interruptions. A signal handler runs between two bytecodes of whatever Python code is running
and what it raises (KeyboardInterrupt) lands there, in the middle of a dequeue. A message is
never lost to it: each one goes through the end's ``inbox`` (a deque, oldest first), and every
step that consumes something (a ring chunk read and released, a socket message taken, an arena
blob copied out and released, the unpickling) stores its result into the inbox entry in the
same C call that produced it (``read_into``, ``_C.call_store``, ``_C.call_append``). So an
exception at any point leaves the message in the inbox, as far as it got, and the next dequeue
goes on from there:

    raw entry      the ring's {"seq", "flags", "frames"} (+ "fetched": the frames of an
                   overflow message, from the socket or a blob; + "holds": its arena slots,
                   held by this reader while it is unpickled, so an unpickling cut short can
                   run again), or a remote reader's list of socket frames
    (_DECODED, obj)  unpickled; dequeue moves it to a list of its own under the call lock
                   and returns ``obj``, putting it back if anything is raised before the
                   return

A remote reader's sequence check is one store too: ``checked`` names the last entry that passed
it, with its number.
"""

from __future__ import annotations

import logging
import signal
import sys
import time
from collections import deque
from typing import Any

from vllm_shm_arena import metrics, settings
from vllm_shm_arena._ext import _C
from vllm_shm_arena.arena import (
    FrameStubs,
    ShmTensorArena,
    call_resolving_forwards,
    call_resolving_stubs,
)
from vllm_shm_arena.mq.end import End
from vllm_shm_arena.mq.lifecycle import WAIT_SLICE_S
from vllm_shm_arena.mq.protocol import (
    BLOB_MARKER,
    FLAG_BLOB,
    FLAG_OVERFLOW,
    Forged,
    Handle,
    Keys,
    SequenceError,
    ShutDownByWriter,
    StreamEnd,
    parse_diverted,
    parse_header,
    writer_died,
)
from vllm_shm_arena.mq.transport import ReaderSocket
from vllm_shm_arena.pickler import loads

logger = logging.getLogger("vllm_shm_arena")

#: Warn about a long wait every this many seconds (vLLM's VLLM_RINGBUFFER_WARNING_INTERVAL;
#: read once, at import).
_WAIT_WARN_S = settings.ringbuffer_warning_interval()
#: vLLM's wording, so operators' log searches and alerts keep working.
_LONG_WAIT_MSG = (
    "No available shared memory broadcast block found in %d seconds. This typically happens "
    "when some processes are hanging or doing some time-consuming work (e.g. compilation)"
)
#: Most ring chunks a reader waiting on the socket takes ahead (to see the ring's shutdown
#: flag); beyond that it stops peeking, so the ring's back-pressure still holds.
_MAX_PEEKED = 64
#: Marks an inbox entry whose message is unpickled: (_DECODED, obj).
_DECODED = object()


def _warn_interval() -> float:
    """The long-wait warning interval: vLLM's module constant when vLLM is loaded (tests and
    operators patch it there), else VLLM_RINGBUFFER_WARNING_INTERVAL."""
    mod = sys.modules.get("vllm.distributed.device_communicators.shm_broadcast")
    v = getattr(mod, "VLLM_RINGBUFFER_WARNING_INTERVAL", None) if mod is not None else None
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else _WAIT_WARN_S


def _from_signal_handler(exc: BaseException) -> bool:
    """Whether ``exc`` is an interruption rather than the message's own failure: not an
    ``Exception`` (KeyboardInterrupt, SystemExit), or raised inside a Python signal handler
    installed now."""
    if not isinstance(exc, Exception):
        return True
    handlers = set()
    for sig in signal.valid_signals():
        try:
            h = signal.getsignal(sig)
        except (ValueError, OSError):
            continue
        code = getattr(h, "__code__", None)
        if code is not None:
            handlers.add(code)
    tb = exc.__traceback__
    while tb is not None:
        if tb.tb_frame.f_code in handlers:
            return True
        tb = tb.tb_next
    return False


def unpickle(frames: list, arena: ShmTensorArena | None, frontend=None) -> Any:
    """The object of a message's ``frames`` (see protocol.py); stubs resolve to ``arena``,
    this reader's, and forward stubs to ``frontend``, its rank of the frontend arena."""
    if frontend is not None:
        return call_resolving_forwards(frontend, unpickle, frames, arena)
    if arena is None:
        return loads(frames[1], frames[2:])
    # This rank's reader, not whichever rank of the arena attached last here.
    return call_resolving_stubs(arena, loads, frames[1], frames[2:])


class _ReaderEnd(End):
    """What both readers share: ``dequeue`` under the call lock over the ``inbox`` (module
    docstring), a terminal error once the stream cannot go on, ``last_dequeue_s``."""

    #: This reader's rank of the frontend arena (``Handle.frontend_arena_handle``), whose
    #: allocations forward stubs name: a local reader's, when its queue forwards.
    frontend: ShmTensorArena | None = None

    def __init__(self, handle: Handle) -> None:
        super().__init__()
        self.handle = handle
        self.keys = Keys(handle.secret)
        #: Seconds from the last message's arrival (ring chunk seen) to the object in hand.
        self.last_dequeue_s = 0.0
        #: Messages received and not yet returned, oldest first (module docstring).
        self.inbox: deque = deque()
        #: Why the stream ended for good (a forged frame, a gap, the writer's last frame...):
        #: every later dequeue raises it again.
        self.broken: BaseException | None = None

    def dequeue(self, timeout: float | None = None, indefinite: bool = False) -> Any:
        """See ``MessageQueue.dequeue``. The next message is returned now, or, if anything is
        raised first (a signal handler's exception included), by the next call: under the
        call lock the message moves from the inbox to this call's ``claimed`` list in one C
        call, and whatever is raised before it is returned puts it back."""
        deadline = None if timeout is None else time.monotonic() + timeout
        claimed: list = []
        try:
            self.lifecycle.call(timeout, "dequeue", self._claim, deadline, indefinite, claimed)
            return claimed[0][1]
        except BaseException:
            if claimed:
                self.inbox.appendleft(claimed[0])  # claimed, not returned: the next call's
            raise

    def _claim(self, deadline: float | None, indefinite: bool, claimed: list) -> None:
        """Under the call lock: the next message decoded, then moved to ``claimed``."""
        inbox = self.inbox
        self._next(deadline, indefinite)  # inbox[0] is (_DECODED, obj) now
        _C.call_append(inbox.popleft, (), claimed)

    def _next(self, deadline: float | None, indefinite: bool) -> None:
        raise NotImplementedError

    def _end_stream(self, error: BaseException) -> BaseException:
        """The stream cannot go on: ``error`` is raised now and by every later dequeue."""
        if self.broken is None:
            self.broken = error
        return error

    def _raise_if_broken(self) -> None:
        b = self.broken
        if b is not None:
            e = type(b).__new__(type(b))
            e.args = b.args
            e.__dict__.update(getattr(b, "__dict__", {}))
            raise e

    def _decode(self, entry, frames: list, arena, stubs=None) -> None:
        """Unpickles the message at the front of the inbox (``entry``, a dict for a local
        reader, whose ``frames`` are given) and puts ``(_DECODED, obj)`` in its place, in the
        C call that unpickled it. Its arena slots are held first (``entry["holds"]``), and
        the frontend allocations it forwards (``entry["forwards"]``, one hold per pair, each
        appended in the C call that took it), so an unpickling cut short can run again. A
        message that fails to unpickle is consumed with its error (its held arena slots go
        back with it, and each forward not yet held is acked); an interruption leaves it for
        the next call."""
        inbox = self.inbox
        head = frames[0]
        try:
            if arena is not None and len(head) and "holds" not in entry:
                pairs = parse_diverted(head)
                _C.call_store(entry, "holds", arena.hold_slots, (pairs,))
            if len(head) % 16:  # forwards (protocol.diverted_header)
                self._hold_forwards(entry, head)
            stub_arena = arena if stubs is None else stubs
            _C.call_store(inbox, 0, _decoded, (frames, stub_arena, self.frontend))
        except BaseException as e:
            if not _from_signal_handler(e) and inbox and inbox[0] is entry:
                inbox.popleft()
                if arena is not None and len(head):
                    for slot, gen in parse_diverted(head):
                        arena.release_unacquired(slot, gen)
                if len(head) % 16 and self.frontend is not None:
                    held = len(entry.get("forwards", ())) if type(entry) is dict else 0
                    for slot, gen in parse_header(head)[1][held:]:
                        self.frontend.release_unacquired(slot, gen)  # acks it
            raise

    def _hold_forwards(self, entry, head) -> None:
        """Holds, one pair at a time, the frontend allocations frame 0 ``head`` forwards
        (``entry["forwards"]``), going on from where an interrupted call stopped."""
        forwarded = parse_header(head)[1]
        if self.frontend is None or type(entry) is not dict:
            raise RuntimeError(
                f"MessageQueue: a message forwards {len(forwarded)} tensor(s) of a frontend "
                "arena this reader has not attached (only a local reader of a queue whose "
                "handle names one can resolve them)"
            )
        if not forwarded:
            raise RuntimeError("MessageQueue: a message's frame 0 is malformed (forwards)")
        held = entry.get("forwards")
        if held is None:
            entry["forwards"] = held = []
        hold = self.frontend.hold_slots
        while len(held) < len(forwarded):
            _C.call_append(hold, ([forwarded[len(held)]],), held)

    def broadcast_object(self, obj: Any = None) -> Any:
        return self.dequeue()


def _decoded(frames: list, arena, frontend) -> tuple:
    return (_DECODED, unpickle(frames, arena, frontend))


class RemoteReaderEnd(_ReaderEnd):
    """A reader on another node: every message comes over the writer's TCP socket."""

    ROLE = "remote_reader"

    def __init__(self, handle: Handle, ranks: list[int]) -> None:
        """Subscribes at once, declaring the reader ``ranks`` it covers (its own; a relay's
        node's, its own first)."""
        super().__init__(handle)
        self.ranks = list(ranks)
        #: (the last inbox entry that passed the sequence check, its sequence number).
        self.checked: tuple = (None, 0)
        try:
            self.socket = ReaderSocket(
                self.lifecycle,
                self.keys,
                handle.remote_subscribe_addr,
                False,
                declare=self.ranks,
                ipv6=bool(handle.remote_addr_ipv6),
                security=handle.tcp_security,
            )
        except BaseException:
            self.lifecycle.abandon()  # half built: release now
            raise

    @property
    def remote_socket(self):
        return self.socket.sock

    @remote_socket.setter
    def remote_socket(self, sock) -> None:
        self.socket.sock = sock

    @property
    def last_seq(self) -> int:
        """The sequence number of the last message that passed the check."""
        return self.checked[1]

    def _handshake(self, deadline: float | None) -> None:
        self.socket.await_ready(deadline, lambda: False)

    def _next(self, deadline: float | None, indefinite: bool) -> None:
        inbox = self.inbox
        if inbox and type(inbox[0]) is tuple:  # (_DECODED, obj)
            return
        self._raise_if_broken()
        if not inbox:
            self.socket.receive(deadline, lambda f, args: _C.call_append(f, args, inbox))
        entry = inbox[0]
        arrived = time.perf_counter()
        try:
            seq, frames = self.socket.open(entry)
        except ShutDownByWriter as e:
            if e.last_seq != self.checked[1]:
                raise self._end_stream(SequenceError(self.checked[1], e.last_seq)) from None
            raise self._end_stream(e) from None
        except Forged as e:
            raise self._end_stream(e) from None
        last_entry, last = self.checked
        if last_entry is not entry:
            if seq != last + 1:
                raise self._end_stream(SequenceError(last, seq))
            self.checked = (entry, seq)
            self.counters["messages"] += 1
        frames, stubs = self._arena_payloads(seq, frames)
        self._decode(entry, frames, None, stubs)
        self.last_dequeue_s = time.perf_counter() - arrived

    def _arena_payloads(self, seq: int, frames: list) -> tuple[list, FrameStubs | None]:
        """A message's frames -> (its frames without the arena allocations' bytes that follow
        its out-of-band buffers, what its arena stubs resolve to: ``None`` if it has none)."""
        if not len(frames[0]):
            return frames, None
        if len(frames[0]) % 16:
            # Forwards never go on the remote socket (sealed: never seen from this version).
            raise self._end_stream(
                RuntimeError(
                    f"MessageQueue: message {seq} forwards frontend tensors to a remote reader"
                )
            )
        pairs = parse_diverted(frames[0])
        k = len(pairs)
        arena = self.handle.tensor_arena_handle
        if not k or arena is None or len(frames) < 2 + k:
            # Sealed by the writer, so never seen from this version's writer.
            raise self._end_stream(
                RuntimeError(
                    f"MessageQueue: message {seq} names {k} arena allocation(s) but carries "
                    f"{len(frames) - 2} frame(s) after its pickle, from a writer "
                    f"{'without' if arena is None else 'with'} an arena (another version of "
                    "vllm_shm_arena?); recreate the queue"
                )
            )
        return frames[:-k], FrameStubs(arena.name, pairs, frames[-k:])

    def _close_locked(self, drain_s: float) -> None:
        self.socket.close()
        self.reporter.cancel()


class LocalReaderEnd(_ReaderEnd):
    """A reader on the writer's node, local reader ``index`` of the handle: the ring, the
    local socket for overflow messages, and the arena when the queue has one."""

    ROLE = "local_reader"

    def __init__(self, handle: Handle, index: int) -> None:
        super().__init__(handle)
        self.index = index
        self.ring = None
        self.arena: ShmTensorArena | None = None
        #: The queue's blob region (a queue without a tensor arena), attached.
        self.blob_region: ShmTensorArena | None = None
        #: A relay's last message (its upstream ended): raised by every later dequeue.
        self.ended: StreamEnd | None = None
        try:
            name, shm_dir = handle.buffer_handle
            # The arena first: a ring rank is claimed once for good, an arena rank that
            # failed to attach is untouched, so a join that fails here can be retried.
            if handle.tensor_arena_handle is not None:
                self.arena = ShmTensorArena.attach(handle.tensor_arena_handle, index)
            if handle.blob_arena_handle is not None:
                self.blob_region = ShmTensorArena.attach(handle.blob_arena_handle, index)
            self.ring = _C.MessageRingReader(name, index, shm_dir, cede_cpu=handle.readers_cede_cpu)
            # Readers copy ring frames out too: the others' CPUs only where that measures faster.
            _C.set_copy_readers(len(handle.local_reader_ranks))
            self.socket = ReaderSocket(self.lifecycle, self.keys, handle.local_subscribe_addr, True)
            # Last, and never failing the join: a counted arena's rank attaches once for good.
            self.frontend = self._attach_frontend(handle, index)
        except BaseException:
            self.lifecycle.abandon()  # half built: release now
            raise

    @staticmethod
    def _attach_frontend(handle: Handle, index: int) -> ShmTensorArena | None:
        """The frontend arena the handle names, attached as rank ``1 + index``; None (with a
        warning) if it cannot be: the writer then forwards nothing (it forwards only while
        every worker rank is attached), and tensors come copied, as without it."""
        fh = getattr(handle, "frontend_arena_handle", None)
        if fh is None:
            return None
        try:
            return ShmTensorArena.attach(fh, 1 + index)
        except Exception as e:  # noqa: BLE001  (any failure only means: tensors are copied)
            logger.warning(
                "vllm_shm_arena: could not attach the frontend arena as rank %d (%s: %s); "
                "tensors from vLLM's API server are copied to the workers instead",
                1 + index,
                type(e).__name__,
                e,
            )
            return None

    @property
    def local_socket(self):
        return self.socket.sock

    @local_socket.setter
    def local_socket(self, sock) -> None:
        self.socket.sock = sock

    # ------------------------------------------------------------------ the ring watch
    def writer_is_dead(self) -> bool:
        """The writer's liveness token in the ring is free (positive evidence; a probe the
        kernel cannot answer counts as alive)."""
        return self.ring is not None and self.ring.writer_liveness() == "dead"

    def shut_down(self) -> bool:
        """Whether the writer shut the ring down after publishing everything in it. Reads
        the ring without waiting; chunks it takes join the inbox, in order."""
        while len(self.inbox) < _MAX_PEEKED:
            status = self.ring.read_into(0.0, self.inbox)
            if status != "ok":
                return status == "shutdown"
        return False

    # ------------------------------------------------------------------ receiving
    def _handshake(self, deadline: float | None) -> None:
        self.socket.await_ready(deadline, self.writer_is_dead)

    def _next(self, deadline: float | None, indefinite: bool) -> None:
        inbox = self.inbox
        if inbox and type(inbox[0]) is tuple:  # (_DECODED, obj)
            return
        if self.ended is not None:
            raise self.ended.error()
        self._raise_if_broken()
        arena = self.arena
        if arena is not None and arena.needs_flush:  # pinned: releases wait for their events
            arena.flush_releases()
        frontend = self.frontend
        if frontend is not None and frontend.needs_flush:
            frontend.flush_releases()
        if arena is not None or frontend is not None:
            self.reporter.maybe_report(self)
        if not inbox:
            self._wait_ring(deadline, indefinite)
        arrived = time.perf_counter()
        entry = inbox[0]
        if entry["flags"] & FLAG_OVERFLOW:
            if "fetched" not in entry:
                self._fetch(entry, deadline)
            frames = entry["fetched"]
        else:
            frames = entry["frames"]
        if "counted" not in entry:
            entry["counted"] = True
            self._count(entry["flags"])
        self._decode(entry, frames, arena)
        self.last_dequeue_s = time.perf_counter() - arrived
        obj = inbox[0][1]
        if type(obj) is StreamEnd:  # only a relay sends one (protocol.py)
            self.ended = obj
            inbox.popleft()
            raise obj.error()

    def _wait_ring(self, deadline: float | None, indefinite: bool) -> None:
        """Waits for the ring's next message and puts it in the inbox."""
        started = time.monotonic()
        warned_at = started
        warn_every = _warn_interval()
        life = self.lifecycle
        read_into, inbox = self.ring.read_into, self.inbox
        while True:
            life.check_running()
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                raise TimeoutError("timed out waiting for a message")
            status = read_into(WAIT_SLICE_S if left is None else min(WAIT_SLICE_S, left), inbox)
            if status == "ok":
                return
            if status == "shutdown":
                raise RuntimeError("MessageQueue was shut down by the writer")
            if status == "writer_dead":
                raise writer_died("noticed while waiting for a message")
            if not indefinite and time.monotonic() - warned_at >= warn_every:
                warned_at = time.monotonic()
                logger.warning(_LONG_WAIT_MSG, warned_at - started)

    def _count(self, flags: int) -> None:
        c = self.counters
        c["messages"] += 1
        if not flags & FLAG_OVERFLOW:
            c["ring_messages"] += 1
            return
        c["overflow_messages"] += 1
        if flags & FLAG_BLOB:
            c["blob_messages"] += 1

    def _fetch(self, entry: dict, deadline: float | None) -> None:
        """An overflow message's frames, from the arena blob or the socket its ring marker
        announced, into ``entry["fetched"]`` (checked: the socket's must be sealed by the
        writer and carry the marker's sequence number)."""
        if entry["flags"] & FLAG_BLOB:
            marker = entry["frames"]
            if self.blob_arena is None:
                raise RuntimeError(
                    "the ring announced a message in an arena blob, but this reader has no "
                    "arena attached (a queue handle without its arena handle?)"
                )
            if len(marker) != 1 or len(marker[0]) != BLOB_MARKER.size:
                raise RuntimeError("corrupt blob marker in the message ring")
            slot, gen, nbytes = BLOB_MARKER.unpack(marker[0])
            # Copied out and released at once, stored in the same C call.
            read = self.blob_arena.read_blob
            _C.call_store(entry, "fetched", read, (slot, gen, nbytes))
            return
        if "socket" not in entry:
            self.socket.receive(
                deadline, lambda f, args: _C.call_store(entry, "socket", f, args), ring=self
            )
        try:
            seq, frames = self.socket.open(entry["socket"])
        except (Forged, ShutDownByWriter) as e:
            if isinstance(e, ShutDownByWriter):
                e = RuntimeError(
                    "MessageQueue was shut down by the writer before it sent the message its "
                    "ring announced"
                )
            raise self._end_stream(e) from None
        if seq != entry["seq"]:
            raise self._end_stream(
                Forged(f"message {seq}, where the ring announced message {entry['seq']},")
            )
        entry["fetched"] = frames

    # ------------------------------------------------------------------ reports and ending
    def report(self) -> None:
        if self.arena is not None:
            self.reporter.report_reader_arena(self.arena)
        if self.frontend is not None:
            self.reporter.report_reader_arena(self.frontend, metrics.FRONTEND)

    def _close_locked(self, drain_s: float) -> None:
        self.socket.close()
        self.reporter.cancel()
        if self.arena is not None:
            # Stubs can no longer resolve to it; tensors handed out keep their mapping (and
            # pinning) alive on their own.
            self.arena.close()
        if self.blob_region is not None:
            self.blob_region.close()
        if self.frontend is not None:
            self.frontend.close()
