"""The readers' ends of a queue: a node-local reader (the ring, its overflow markers, arena
blobs, the local socket, the writer's liveness) and a remote reader (the TCP socket).

Both unpickle a message with stubs resolving to their own arena reader
(``arena.resolving_stubs``); a message that fails to unpickle releases the arena slots it
named, so the writer is never kept waiting for them.
"""

from __future__ import annotations

import logging
import sys
import time
from collections import deque
from typing import Any

from vllm_shm_arena import settings
from vllm_shm_arena._ext import _C
from vllm_shm_arena.arena import ShmTensorArena, resolving_stubs
from vllm_shm_arena.mq.end import End
from vllm_shm_arena.mq.lifecycle import NOGIL, WAIT_SLICE_S
from vllm_shm_arena.mq.protocol import (
    BLOB_MARKER,
    FLAG_BLOB,
    FLAG_OVERFLOW,
    Handle,
    StreamEnd,
    parse_diverted,
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


def _warn_interval() -> float:
    """The long-wait warning interval: vLLM's module constant when vLLM is loaded (tests and
    operators patch it there), else VLLM_RINGBUFFER_WARNING_INTERVAL."""
    mod = sys.modules.get("vllm.distributed.device_communicators.shm_broadcast")
    v = getattr(mod, "VLLM_RINGBUFFER_WARNING_INTERVAL", None) if mod is not None else None
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else _WAIT_WARN_S


def unpickle(frames: list, arena: ShmTensorArena | None) -> Any:
    """The object of a message's ``frames`` (see protocol.py); stubs resolve to ``arena``, this
    reader's. On failure, the arena slots frame 0 lists are released, then it raises."""
    try:
        if arena is None:
            return loads(frames[1], frames[2:])
        # This rank's reader, not whichever rank of the arena attached last here.
        with resolving_stubs(arena):
            return loads(frames[1], frames[2:])
    except BaseException:
        # Frame 0 lists the message's arena slots: parsed only on this failure path.
        if arena is not None and len(frames[0]):
            for slot, gen in parse_diverted(frames[0]):
                arena.release_unacquired(slot, gen)
        raise


class _ReaderEnd(End):
    """What both readers share: ``dequeue`` under the call lock, ``last_dequeue_s``."""

    def __init__(self, handle: Handle) -> None:
        super().__init__()
        self.handle = handle
        #: Seconds from the last message's arrival (ring chunk seen) to the object in hand.
        self.last_dequeue_s = 0.0

    def dequeue(self, timeout: float | None = None, indefinite: bool = False) -> Any:
        """See ``MessageQueue.dequeue``."""
        deadline = None if timeout is None else time.monotonic() + timeout
        self.lifecycle.take(timeout, "dequeue")
        try:
            return self._dequeue_locked(deadline, indefinite)
        finally:
            self.lifecycle.side_lock.release()

    def _dequeue_locked(self, deadline: float | None, indefinite: bool) -> Any:
        raise NotImplementedError

    def broadcast_object(self, obj: Any = None) -> Any:
        return self.dequeue()


class RemoteReaderEnd(_ReaderEnd):
    """A reader on another node: every message comes over the writer's TCP socket."""

    ROLE = "remote_reader"

    def __init__(self, handle: Handle, ranks: list[int]) -> None:
        """Subscribes at once, declaring the reader ``ranks`` it covers (its own; a relay's
        node's)."""
        super().__init__(handle)
        self.ranks = list(ranks)
        try:
            self.socket = ReaderSocket(
                self.lifecycle,
                bytes(handle.socket_token),
                handle.remote_subscribe_addr,
                False,
                declare=self.ranks,
                ipv6=bool(handle.remote_addr_ipv6),
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

    def _handshake(self, deadline: float | None) -> None:
        self.socket.await_ready(deadline, lambda: False)

    def _dequeue_locked(self, deadline: float | None, indefinite: bool) -> Any:
        frames = self.socket.recv(deadline)
        arrived = time.perf_counter()
        self.counters["messages"] += 1
        obj = unpickle(frames, None)
        self.last_dequeue_s = time.perf_counter() - arrived
        return obj

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
        #: Ring reads taken ahead while waiting on the socket for an overflow message.
        self.peeked: deque = deque()
        #: A relay's last message (its upstream ended): raised by every later dequeue.
        self.ended: StreamEnd | None = None
        try:
            name, shm_dir = handle.buffer_handle
            # The arena first: a ring rank is claimed once for good, an arena rank that
            # failed to attach is untouched, so a join that fails here can be retried.
            if handle.tensor_arena_handle is not None:
                self.arena = ShmTensorArena.attach(handle.tensor_arena_handle, index)
            self.ring = _C.RingReader(name, index, shm_dir)
            # Readers copy ring frames out too: leave the others (and the writer) a CPU.
            _C.set_copy_readers(len(handle.local_reader_ranks))
            self.socket = ReaderSocket(
                self.lifecycle, bytes(handle.socket_token), handle.local_subscribe_addr, True
            )
        except BaseException:
            self.lifecycle.abandon()  # half built: release now
            raise

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
        the ring without waiting; chunks it takes are kept for the next dequeues, in order."""
        while len(self.peeked) < _MAX_PEEKED:
            with NOGIL:
                got = self.ring.read(0.0)
            if got[0] != "ok":
                return got[0] == "shutdown"
            self.peeked.append(got)
        return False

    # ------------------------------------------------------------------ receiving
    def _handshake(self, deadline: float | None) -> None:
        self.socket.await_ready(deadline, self.writer_is_dead)

    def _dequeue_locked(self, deadline: float | None, indefinite: bool) -> Any:
        if self.ended is not None:
            raise self.ended.error()
        arena = self.arena
        if arena is not None:
            if arena.needs_flush:  # something was pinned: releases wait for their events
                with NOGIL:
                    arena.flush_releases()
            self.reporter.maybe_report(self)
        started = time.monotonic()
        warned_at = started
        warn_every = _warn_interval()
        life = self.lifecycle
        peeked = self.peeked
        while True:
            life.check_running()
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                raise TimeoutError("timed out waiting for a message")
            if peeked:
                status, flags, frames = peeked[0]
            else:
                with NOGIL:
                    status, flags, frames = self.ring.read(
                        WAIT_SLICE_S if left is None else min(WAIT_SLICE_S, left)
                    )
            if status == "ok":
                arrived = time.perf_counter()
                break
            if status == "shutdown":
                raise RuntimeError("MessageQueue was shut down by the writer")
            if status == "writer_dead":
                raise writer_died("noticed while waiting for a message")
            if not indefinite and time.monotonic() - warned_at >= warn_every:
                warned_at = time.monotonic()
                logger.warning(_LONG_WAIT_MSG, warned_at - started)
        if not flags & FLAG_OVERFLOW:
            if peeked:
                peeked.popleft()
            self.counters["ring_messages"] += 1
        else:
            # The marker stays at the front of ``peeked`` until its message is in hand: a
            # wait below that times out leaves it there for the next call, in order.
            if not peeked:
                peeked.append(("ok", flags, frames))
            if flags & FLAG_BLOB:
                peeked.popleft()
                frames = self.read_blob(frames)
                self.counters["blob_messages"] += 1
            else:
                frames = self.socket.recv(deadline, ring=self)
                peeked.popleft()
            self.counters["overflow_messages"] += 1
        self.counters["messages"] += 1
        obj = unpickle(frames, arena)
        self.last_dequeue_s = time.perf_counter() - arrived
        if type(obj) is StreamEnd:  # only a relay sends one (protocol.py)
            self.ended = obj
            raise obj.error()
        return obj

    def read_blob(self, marker_frames) -> list:
        """The frames of a message the writer packed into an arena blob (named by the ring
        marker's one frame: slot, generation, bytes), copied out; the blob is released at
        once, whatever happens to the message afterwards."""
        if self.arena is None:
            raise RuntimeError(
                "the ring announced a message in the tensor arena, but this reader has no "
                "arena attached (a queue handle without its arena handle?)"
            )
        if len(marker_frames) != 1 or len(marker_frames[0]) != BLOB_MARKER.size:
            raise RuntimeError("corrupt blob marker in the message ring")
        slot, gen, nbytes = BLOB_MARKER.unpack(marker_frames[0])
        return self.arena.read_blob(slot, gen, nbytes)

    # ------------------------------------------------------------------ reports and ending
    def report(self) -> None:
        if self.arena is not None:
            self.reporter.report_reader_arena(self.arena)

    def _close_locked(self, drain_s: float) -> None:
        self.socket.close()
        self.reporter.cancel()
        if self.arena is not None:
            # Stubs can no longer resolve to it; tensors handed out keep their mapping (and
            # pinning) alive on their own.
            self.arena.close()
