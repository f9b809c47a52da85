"""The writer's end of a queue: the send path (ring reserve -> arena blob -> remote socket ->
ring publish / local socket), what an interrupted send has committed (``Sending``,
``settle``), and the broken state a half-sent message leaves.

Exactly once, in order: every wait of a send comes before anything is committed, and an
exception at any point is settled from what the ring and the sockets actually took, never
from where Python was. A message no reader can ever see gives its arena allocations back; a
message any reader can see is finished; a half-sent socket message breaks the queue (it
cannot go on in order), and readers get a clear error after the messages before it.

With readers of both kinds and an arena, a message is pickled once, with arena stubs; the
remote socket's message adds, after the out-of-band buffers, the bytes of each arena allocation
the stubs name (a remote node cannot map the arena), sent by reference: ZeroMQ reads the arena
copy itself, which a send hold keeps from being recycled until ZeroMQ lets go of it. Each
socket's frames are settled against that socket's own message.
"""

from __future__ import annotations

import logging
import os
import secrets
import time
from typing import Any

from vllm_shm_arena import metrics, settings, sizing
from vllm_shm_arena._ext import _C
from vllm_shm_arena.arena import ShmTensorArena, set_forward_source, take_forward_source
from vllm_shm_arena.mq.end import End
from vllm_shm_arena.mq.lifecycle import DRAIN_S, WAIT_SLICE_S
from vllm_shm_arena.mq.protocol import (
    BLOB_FLAGS,
    BLOB_MARKER,
    FLAG_OVERFLOW,
    SECRET_BYTES,
    Handle,
    Keys,
    diverted_header,
    seal,
)
from vllm_shm_arena.mq.transport import Roster, WriterSockets, local_ip
from vllm_shm_arena.pickler import Dumped, dump_message, dumps_inband

logger = logging.getLogger("vllm_shm_arena")

#: Blobs may hold at most this share of the arena (a slow reader's backlog of overflow
#: messages must not starve tensors): 1/_BLOB_SHARE of it, split over the most blobs that can
#: be in flight at once (one per ring chunk, plus one per reader copying one out).
_BLOB_SHARE = 4

#: Arena geometry of the queues this process creates (read once, at import; settings.py).
#: "variable": one region of _ARENA_BYTES packing any tensor up to its size (the default);
#: "fixed": _ARENA_NUM_SLOTS slots of _ARENA_SLOT_BYTES (vLLM's own arena's layout). The
#: policy is checked when a queue asks for an arena, so a bad one never fails a queue without.
_ARENA_POLICY = settings.arena_policy_unchecked()
_ARENA_BYTES = settings.arena_bytes()
_ARENA_MAX_ALLOCATIONS = settings.arena_max_allocations()
_ARENA_NUM_SLOTS = settings.arena_num_slots()
_ARENA_SLOT_BYTES = settings.arena_slot_bytes()
#: A queue without a tensor arena packs a message too big for a ring chunk into a blob region
#: of at most this many bytes (0: none; such messages go over the local socket). Why: the
#: socket costs a copy into ZeroMQ, then two kernel copies per reader; a blob costs one copy
#: in and one copy out per reader (measured, 2048^2 image at TP 1/2/4: delivery 2.6 / 2.1 /
#: 2.2x faster than over the socket, docs/benchmarks.md).
_BLOB_REGION_BYTES = settings.blob_region_bytes()
#: A smaller region than this is not made (it would decline most messages it is meant for).
_BLOB_REGION_MIN = 64 << 20
#: Most blobs a region holds at once (one per ring chunk and per reader copying one out is
#: what can be in flight; the rest is slack for readers' releases still on their way).
_BLOB_REGION_ALLOCATIONS = 256


def _create_arena(n_readers: int, ring) -> tuple[ShmTensorArena | None, sizing.ArenaSize]:
    """The arena for a new queue beside its ``ring``: shaped by the settings above, smaller
    (or none) where the shm directory cannot hold it (sizing.py, which logs why).
    -> (arena or None, the size chosen)."""
    layout = sizing.Layout(
        settings.check_arena_policy(_ARENA_POLICY),
        _ARENA_BYTES,
        _ARENA_MAX_ALLOCATIONS,
        _ARENA_NUM_SLOTS,
        _ARENA_SLOT_BYTES,
    )
    return sizing.create_arena(n_readers, layout, ring.dir, os.path.join(ring.dir, ring.name))


def _create_blob_region(n_readers: int, ring) -> ShmTensorArena | None:
    """The blob region of a queue without a tensor arena, beside its ``ring``: at most
    ``_BLOB_REGION_BYTES``, and at most the share of the free space (what the ring has not
    backed yet set aside) an arena may take; ``None`` (the local socket carries such
    messages) when that is under ``_BLOB_REGION_MIN`` or it cannot be made."""
    if _BLOB_REGION_BYTES <= 0:
        return None
    why = ""
    try:
        size = sizing.region_share(_BLOB_REGION_BYTES, ring.dir, os.path.join(ring.dir, ring.name))
        if size >= _BLOB_REGION_MIN:
            return ShmTensorArena.create(
                n_readers,
                policy="variable",
                arena_bytes=size,
                max_allocations=_BLOB_REGION_ALLOCATIONS,
                shm_dir=ring.dir,
            )
        why = f"{size >> 20} MiB of {ring.dir} may be taken, under {_BLOB_REGION_MIN >> 20} MiB"
    except Exception as e:  # noqa: BLE001  (any failure here only means: no region)
        why = f"{type(e).__name__}: {e}"
    logger.warning(
        "vllm_shm_arena: no blob region for this queue (%s); messages too big for a ring chunk "
        "go over the local socket",
        why,
    )
    return None


def check_int(name: str, value, minimum: int) -> None:
    """``ValueError`` naming the argument unless ``value`` is an int (not a bool) >=
    ``minimum``."""
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}")


_SENT_NOTE = "vllm_shm_arena: this message was sent before the exception; do not send it again"


def note_sent(exc: BaseException) -> None:
    """Tells the caller of an enqueue that raised ``exc`` that its message went out (once)."""
    if hasattr(exc, "add_note") and _SENT_NOTE not in getattr(exc, "__notes__", ()):
        exc.add_note(_SENT_NOTE)


class Sending:
    """What one enqueue has committed so far, recorded step by step (see ``settle``). Each
    record is one store, or made in the C call that commits (``sent``'s counts), so that an
    exception raised anywhere (a signal handler's) finds them true."""

    __slots__ = (
        "diverted",
        "forwarded",
        "frames",
        "remote_frames",
        "seq",
        "fits",
        "ring_seq",
        "sent",
        "ring",
        "done",
    )

    def __init__(self) -> None:
        #: Arena slots the pickling took (appended as it takes them: dump_message's ``into``).
        self.diverted: list = []
        #: Forwards the pickling counted (``ShmTensorArenaWriter.forward_from``), moved here
        #: whole once the dump succeeded (dump_message's ``forwarded_into``).
        self.forwarded: list = []
        self.frames: list | None = None  # the message (ring and local socket encoding)
        self.remote_frames: list | None = None  # the remote socket's encoding
        self.seq = 0  # the message's sequence number
        self.fits = False
        self.ring_seq: int | None = None  # ring.published() just before the publish
        self.sent: dict[int, list] = {}  # id(socket) -> [frames queued on it]
        #: What C calls committed, stored in the call: "blob", the arena blob (slot, generation,
        #: nbytes) or None; "status", what the ring's last write returned: "ok" (a message or
        #: a blob marker), "no_space" or True (an overflow marker: the socket owes it).
        self.ring: dict = {}
        self.done = False  # every step finished and counted

    @property
    def blob(self) -> tuple[int, int, int] | None:
        return self.ring.get("blob")

    def taken(self, sock) -> int:
        """Frames of this message ``sock`` took."""
        progress = self.sent.get(id(sock))
        return progress[0] if progress else 0


class WriterEnd(End):
    """The writer: a ring for node-local readers (with the local socket for messages too big
    for a chunk, and an arena when asked for), a TCP socket for remote readers."""

    ROLE = "writer"
    CLOSE_DRAIN_S = DRAIN_S

    @staticmethod
    def check_args(
        n_reader: int,
        n_local_reader: int,
        local_reader_ranks: list[int] | None,
        max_chunk_bytes: int,
        max_chunks: int,
        connect_ip: str | None,
        enable_arena: bool,
        remote_reader_ranks: list[int] | None = None,
    ) -> tuple[list[int], str | None, Roster]:
        """Every argument, checked before anything (ring, socket, arena) is created ->
        (local_reader_ranks, connect_ip, the remote ranks' roster) with their defaults
        filled in. The remote ranks, unless given: ``range(n_reader)`` without the local
        ones when that makes ``n_reader - n_local_reader`` (vLLM's executor), else any that
        many distinct ranks that are not local."""
        check_int("n_reader", n_reader, 0)
        check_int("n_local_reader", n_local_reader, 0)
        if n_local_reader > n_reader:
            raise ValueError(
                f"need 0 <= n_local_reader ({n_local_reader}) <= n_reader ({n_reader})"
            )
        check_int("max_chunk_bytes", max_chunk_bytes, 1)
        check_int("max_chunks", max_chunks, 1)
        if local_reader_ranks is None:
            local_reader_ranks = list(range(n_local_reader))
        if len(local_reader_ranks) != n_local_reader:
            raise ValueError(
                f"local_reader_ranks has {len(local_reader_ranks)} entries, "
                f"n_local_reader is {n_local_reader}"
            )
        if len(set(local_reader_ranks)) != len(local_reader_ranks):
            raise ValueError(f"local_reader_ranks has duplicates: {local_reader_ranks}")
        if n_reader > n_local_reader and connect_ip is None:
            connect_ip = local_ip()  # vLLM's default: this node's address
        if n_reader > n_local_reader and not (isinstance(connect_ip, str) and connect_ip):
            raise ValueError(
                f"remote readers need connect_ip (an address they can reach), got {connect_ip!r}"
            )
        if enable_arena:
            settings.check_arena_policy(_ARENA_POLICY)
        n_remote = n_reader - n_local_reader
        local = set(local_reader_ranks)
        if remote_reader_ranks is not None:
            remote = list(remote_reader_ranks)
            for r in remote:
                check_int("remote_reader_ranks[i]", r, 0)
            if len(remote) != n_remote or len(set(remote)) != n_remote or local & set(remote):
                raise ValueError(
                    f"remote_reader_ranks must be {n_remote} distinct ranks not in "
                    f"local_reader_ranks, got {remote}"
                )
            expected = set(remote)
        else:
            default = set(range(n_reader)) - local
            expected = default if len(default) == n_remote else None
        return list(local_reader_ranks), connect_ip, Roster(n_remote, local, expected)

    def __init__(
        self,
        n_reader: int,
        n_local_reader: int,
        local_reader_ranks: list[int],
        max_chunk_bytes: int,
        max_chunks: int,
        connect_ip: str | None,
        enable_arena: bool,
        roster: Roster | None = None,
    ) -> None:
        """Builds the writer from arguments ``check_args`` returned."""
        super().__init__()
        self.roster = roster if roster is not None else Roster(n_reader - n_local_reader)
        self.n_local_reader = n_local_reader
        self.n_remote_reader = n_reader - n_local_reader
        self.max_chunk_bytes = max_chunk_bytes
        #: Pickle tensor bytes inside the stream (the pre-out-of-band baseline; benchmarks).
        self.serialize_inband = False
        self.broken = ""  # why the queue can no longer send (an enqueue was cut mid-send)
        self.ring = None
        self.arena: ShmTensorArena | None = None
        self.arena_size: sizing.ArenaSize | None = None  # when an arena was asked for
        #: A queue without a tensor arena: its own region for messages too big for a ring
        #: chunk (``_create_blob_region``; None once closed). ``blob_arena`` is where they go.
        self.blob_region: ShmTensorArena | None = None
        self.blob_max = 0  # largest message packed into an arena blob (0: none)
        #: The frontend arena's reader 0 this queue forwards from (``_forward_from``), or None.
        self.forward_source: ShmTensorArena | None = None
        #: The sequence number of the last message sent (protocol.py; the first is 1).
        self.seq = 0
        #: The last enqueue's record, until the next call under the lock checks it was settled
        #: (``finish_pending``).
        self.pending: Sending | None = None
        security = "authenticated"
        if self.n_remote_reader > 0:
            security = settings.tcp_security()
            if security == "encrypted" and self.roster.expected is None:
                raise ValueError(
                    "VLLM_SHM_ARENA_TCP_SECURITY=encrypted needs the remote reader ranks: pass "
                    "remote_reader_ranks (each rank's CurveZMQ key is derived from it)"
                )
        self.keys = Keys(secrets.token_bytes(SECRET_BYTES))
        self.sockets = WriterSockets(self.lifecycle, self.keys, self.reporter.log)
        try:
            local_addr = remote_addr = None
            if n_local_reader > 0:
                self.ring = _C.MessageRingWriter(n_local_reader, max_chunks, max_chunk_bytes)
                self.lifecycle.resources.ring_writer = self.ring
                _C.set_copy_readers(n_local_reader)  # copies measured with and without their CPUs
                local_addr = self.sockets.bind_local(self.ring.dir)
            if self.n_remote_reader > 0:
                remote_addr = self.sockets.bind_remote(connect_ip, self.roster, security)
            if enable_arena:
                if n_local_reader == 0:
                    logger.warning(
                        "shm tensor arena disabled for this queue: all %d readers are remote "
                        "(the arena serves readers on this node); using the out-of-band path",
                        n_reader,
                    )
                else:
                    self.arena, self.arena_size = _create_arena(n_local_reader, self.ring)
            elif n_local_reader > 0:
                self.blob_region = _create_blob_region(n_local_reader, self.ring)
            self.forward_source = frontend = self._forward_from(take_forward_source())
            if self.blob_region is not None:
                # A region of its own: any message up to half of it (two fit at once; when it
                # is full, a message goes over the socket).
                self.blob_max = self.blob_region.slot_bytes // 2
            elif self.arena is not None and self.arena.handle().policy == "variable":
                self.blob_max = (self.arena.slot_bytes // _BLOB_SHARE) // (
                    max_chunks + n_local_reader
                )
        except BaseException:
            self.lifecycle.abandon()
            if self.ring is not None:
                self.ring.unlink()
            for arena in self._arenas():
                arena.close()
            raise
        self.handle = Handle(
            secret=self.keys._secret,
            tcp_security=security,
            local_reader_ranks=list(local_reader_ranks),
            buffer_handle=(self.ring.name, self.ring.dir) if self.ring else None,
            local_subscribe_addr=local_addr,
            remote_subscribe_addr=remote_addr,
            remote_addr_ipv6=self.sockets.remote_ipv6,
            tensor_arena_handle=self.arena.handle() if self.arena else None,
            blob_arena_handle=self.blob_region.handle() if self.blob_region else None,
            frontend_arena_handle=frontend.handle() if frontend is not None else None,
        )

    def _forward_from(self, source) -> ShmTensorArena | None:
        """Tensors this process holds from a frontend arena (``arena.set_forward_source``: the
        engine core's rank 0) go to this queue's readers as forward stubs, never copied, when
        the queue has an arena, no remote readers, and exactly that arena's other ranks as its
        local readers (vLLM's broadcast queue: one per worker); -> the frontend arena, or None
        (every tensor goes as before, and the source stays for the next queue)."""
        if source is None:
            return None
        ranks = source.handle().n_readers - 1
        if self.arena is None or self.n_remote_reader or ranks != self.n_local_reader:
            set_forward_source(source)  # not this queue's: left for the next one
            return None
        self.arena.forward_from(source, ranks)
        return source

    # vLLM's attribute names for the sockets (tests stand proxies in for them).
    @property
    def local_socket(self):
        return self.sockets.local

    @local_socket.setter
    def local_socket(self, sock) -> None:
        self.sockets.local = sock

    @property
    def remote_socket(self):
        return self.sockets.remote

    @remote_socket.setter
    def remote_socket(self, sock) -> None:
        self.sockets.remote = sock

    # ------------------------------------------------------------------ joining
    def _handshake(self, deadline: float | None) -> None:
        self.sockets.await_subscribers(self.n_local_reader, deadline)
        # Every local reader has mapped the ring and the arena: drop the names.
        if self.ring is not None:
            self.ring.unlink()
        for arena in self._arenas():
            arena.unlink()

    def _arenas(self) -> list[ShmTensorArena]:
        """The tensor arena and the blob region (at most one of them exists)."""
        return [a for a in (self.arena, self.blob_region) if a is not None]

    # ------------------------------------------------------------------ sending
    def enqueue(self, obj: Any, timeout: float | None = None) -> None:
        """See ``MessageQueue.enqueue``. Whatever is raised (a signal handler's exception
        included) after the message went out carries a note saying it was sent."""
        return self._enqueue(obj, timeout, None)

    def _enqueue(self, obj: Any, timeout: float | None, result: Any) -> Any:
        deadline = None if timeout is None else time.monotonic() + timeout
        self.check_can_send()
        sending = Sending()
        try:
            self.lifecycle.call(timeout, "enqueue", self._send_locked, obj, deadline, sending)
            return result
        except BaseException as e:
            # Decided from what was committed, not from how far settle got: a second
            # interruption inside settle (before it marked the message done) must not tell
            # the caller "not sent" about a message readers can see.
            if sending.done or self.committed(sending):
                note_sent(e)
            raise

    def _send_locked(self, obj: Any, deadline: float | None, sending: Sending) -> None:
        """Under the call lock: the message sent, or settled (see ``settle``). A previous
        message whose settling a second interruption cut short is settled first."""
        if self.pending is not None:
            self.finish_pending()
        self.check_can_send()
        self.pending = sending
        try:
            self._send_message(obj, deadline, sending)
        except BaseException as e:
            self.settle(sending, e)
            self.pending = None  # settled (an interruption in settle leaves it pending)
            raise
        self.pending = None  # done: its frames need not stay referenced

    def finish_pending(self) -> None:
        """Under the call lock: settles the last enqueue's message if it is not done (an
        interruption inside ``settle`` left it half-settled: sent but not counted, so the next
        sequence number would repeat; or not sent with its allocations still taken). Settling
        is idempotent: each step is done once, whoever calls."""
        prev = self.pending
        if prev is not None and not prev.done and not self.broken:
            self.settle(prev, None)
        self.pending = None

    def _send_message(self, obj: Any, deadline: float | None, sending: Sending) -> None:
        if self.serialize_inband:
            dumped = Dumped(dumps_inband(obj), [], [])
        else:
            # The arena copy releases the GIL; the slots taken go into sending.diverted as
            # they are taken.
            dumped = dump_message(obj, self.arena, sending.diverted, sending.forwarded)
        frames = [diverted_header(dumped.diverted, dumped.forwarded), dumped.data, *dumped.buffers]
        sending.frames = frames
        if dumped.diverted and self.sockets.remote is not None:
            # Remote readers: the same message, then the bytes of the allocations its stubs
            # name, in frame 0's order (protocol.py), held for a send by reference.
            sending.remote_frames = [*frames, *self.arena.send_holds(dumped.diverted)]
        self.send(frames, deadline, sending)
        self._mark_sent(sending)
        self.reporter.maybe_report(self)

    def _mark_sent(self, sending: Sending) -> None:
        """Counts a message that went (every step finished)."""
        self.seq = sending.seq
        self.counters["messages"] += 1
        if sending.forwarded:
            self.arena.count_forwards(len(sending.forwarded))
        sending.done = True

    def check_can_send(self) -> None:
        """``RuntimeError`` once shut down or broken."""
        self.lifecycle.check_running()
        if self.broken:
            raise RuntimeError(f"MessageQueue is broken ({self.broken}); recreate it")

    def sealed(self, frames: list, seq: int) -> list:
        """``frames`` as a socket sends them: frame 0 sealed with ``seq`` (protocol.py)."""
        return [seal(self.keys.mac_key, seq, frames), *frames[1:]]

    def send(self, frames: list, deadline: float | None, sending: Sending) -> None:
        """One message, in an order where every wait comes before anything is committed:
        (1) a ring chunk is reserved (the ring's back-pressure), (2) a message too big for a
        chunk is packed into an arena blob (never waits, may decline), (3) remote readers'
        socket (waits while a reader's backlog is at its cap), then (4) the ring publishes
        (and, for an overflow message without a blob, the local socket takes it; it never
        waits: the ring bounds its backlog). Each step records what it committed in
        ``sending``, for ``settle``. ``sending.remote_frames``: the remote socket's encoding
        (default: ``frames``)."""
        sending.seq = self.seq + 1
        sizes = [memoryview(f).nbytes for f in frames]
        self.counters["bytes"] += sum(sizes)
        ring = self.ring
        fits = ring is not None and _C.MessageRingWriter.packed_bytes(sizes) <= self.max_chunk_bytes
        sending.fits = fits
        if ring is not None:
            while True:
                left = self.lifecycle.time_left(
                    deadline, "a free ring chunk (readers are slow or stuck)"
                )
                if ring.reserve(WAIT_SLICE_S if left is None else min(WAIT_SLICE_S, left)):
                    break
            blobs = self.blob_arena if not fits else None  # None once closed (_close_locked)
            if blobs is not None and self.blob_max:
                # Stored in the C call that allocated and published it: settle gives it back.
                write = blobs.write_blob
                _C.call_store(sending.ring, "blob", write, (frames, self.blob_max))
        remote = self.sockets.remote
        if remote is not None:
            remote_frames = sending.remote_frames
            if remote_frames is None:
                sending.remote_frames = remote_frames = frames
            nbytes = sum(memoryview(f).nbytes for f in remote_frames)
            self.counters["remote_bytes"] = self.counters.get("remote_bytes", 0) + nbytes
            sealed = self.sealed(remote_frames, sending.seq)
            self.sockets.send(remote, sealed, deadline, sending, may_wait=True, nbytes=nbytes)
        if ring is not None:
            self.publish_local(frames, fits, sending)

    def publish_local(self, frames: list, fits: bool, sending: Sending) -> None:
        """Step (4) of ``send``: the reserved chunk is published; it never waits. What the
        ring published is recorded in the C call that published it (``sending.ring``), so that
        ``settle`` knows whether the local socket owes the message."""
        ring = self.ring
        rec = sending.ring
        sending.ring_seq = ring.published()
        if fits:
            _C.call_store(rec, "status", ring.write, (frames, 0, 0.0))
        elif sending.blob is not None:
            _C.call_store(
                rec, "status", ring.write, ([BLOB_MARKER.pack(*sending.blob)], BLOB_FLAGS, 0.0)
            )
        if rec.get("status") == "ok":
            if sending.blob is not None:
                self.counters["overflow_messages"] += 1
                self.counters["blob_messages"] += 1
            else:
                self.counters["ring_messages"] += 1
            return
        if rec.get("status") == "no_space":  # the ring published an overflow marker instead
            self.reporter.log(
                "no_space_ring",
                logging.WARNING,
                "ring chunk could not be backed (/dev/shm full); message sent over the socket",
            )
        else:
            _C.call_store(rec, "status", ring.write_marker, (FLAG_OVERFLOW, 0.0))
        self.counters["overflow_messages"] += 1
        self.finish_overflow(frames, sending)

    def finish_overflow(self, frames: list, sending: Sending) -> None:
        """The ring announced an overflow marker: a blob it does not name goes back, and the
        local socket takes the message (never waits). Each step is done once, whoever calls
        (``publish_local``, or ``settle`` after an interruption)."""
        blobs = self.blob_arena  # None once closed: a closed region is never reused anyway
        if sending.blob is not None and blobs is not None:
            # Published in the arena but named by no marker: no reader will ever see it.
            blobs.give_back_unsent([sending.blob[:2]])  # twice is harmless
        if sending.taken(self.sockets.local) == 0:
            local = self.sockets.local
            sealed = self.sealed(frames, sending.seq)
            nbytes = sum(memoryview(f).nbytes for f in frames)
            self.sockets.send(local, sealed, None, sending, may_wait=False, nbytes=nbytes)

    def settle(self, sending: Sending, exc: BaseException | None) -> None:
        """An exception left ``send`` (a timeout or shutdown before anything was committed,
        or an asynchronous exception such as ``KeyboardInterrupt`` at any point). Decides from
        what the ring and the sockets actually took, not from where Python was: nothing taken
        -> the message's arena allocations go back (not sent); taken -> whatever readers are
        still owed is finished, and the exception carries a note that the message was sent; a
        half-sent socket message -> the queue is broken (it cannot go on in order)."""
        frames = sending.frames
        ring = self.ring
        ring_committed = self._ring_committed(sending)
        remote, local = self.sockets.remote, self.sockets.local
        n_remote = len(sending.remote_frames or frames or ())
        if 0 < sending.taken(remote) < n_remote or (
            frames is not None and 0 < sending.taken(local) < len(frames)
        ):
            self.break_off("an enqueue was interrupted half-way through a socket send")
            return
        remote_done = remote is not None and sending.taken(remote) > 0
        if not ring_committed and not remote_done:
            # Nothing was published: readers never saw the stubs or the blob. A failure here
            # must not replace the error that stopped the send.
            for arena, unsent in (
                (self.arena, sending.diverted),
                (self.blob_arena, [sending.blob[:2]] if sending.blob is not None else []),
            ):
                if arena is not None and unsent:
                    try:
                        arena.give_back_unsent(unsent)
                    except Exception:
                        logger.exception("vllm_shm_arena: giving back an unsent message's slots")
            if sending.forwarded:
                try:  # empties the list as it goes: a forward is never taken back twice
                    self.arena.take_back_forwards(sending.forwarded)
                except Exception:
                    logger.exception("vllm_shm_arena: taking back an unsent message's forwards")
            return
        # Sent: finish what readers are owed (neither step waits).
        if not sending.done:
            try:
                if ring is not None and not ring_committed:
                    self.publish_local(frames, sending.fits, sending)
                elif ring is not None and sending.ring.get("status") != "ok":
                    self.finish_overflow(frames, sending)  # an overflow marker was published
            except Exception:
                self.break_off("an enqueue failed after its message was announced")
                raise
            # An asynchronous exception (a second KeyboardInterrupt) propagates with the
            # message still pending: each step above is done once whoever calls, so the next
            # call under the lock (finish_pending, or close) finishes what readers are owed.
            self._mark_sent(sending)
        if exc is not None:
            note_sent(exc)

    def _ring_committed(self, sending: Sending) -> bool:
        """Whether the ring published this message (or its marker)."""
        seq = sending.ring_seq
        return self.ring is not None and seq is not None and self.ring.published() > seq

    def committed(self, sending: Sending) -> bool:
        """Whether a reader can see the message: the ring published it, or the remote socket
        took any of it (what ``settle`` decides "sent" by)."""
        remote = self.sockets.remote
        return self._ring_committed(sending) or (remote is not None and sending.taken(remote) > 0)

    def break_off(self, why: str) -> None:
        """The queue cannot go on in order: no more sends, the ring shut down (readers get a
        clear error after the messages before), the sockets closed (ZeroMQ drops the half
        message), and the arena closed for writes (a reader may hold this message's
        slots: they are never reused)."""
        self.broken = why
        self.sockets.break_off()
        if self.ring is not None:
            self.ring.shutdown()
        for arena in self._arenas():
            arena.close()

    def empty(self, shape, dtype=None):
        """See ``MessageQueue.empty``."""
        import torch

        dtype = torch.float32 if dtype is None else dtype
        self.check_can_send()  # a broken queue's arena lends nothing: readers may hold it
        t = self.arena.empty(shape, dtype) if self.arena is not None else None
        return t if t is not None else torch.empty(tuple(shape), dtype=dtype)

    def broadcast_object(self, obj: Any = None) -> Any:
        return self._enqueue(obj, None, obj)

    # ------------------------------------------------------------------ reports
    def report(self) -> None:
        self.report_liveness()
        if self.arena is not None:
            self.reporter.report_writer_arena(self.arena)
        source = self.forward_source
        if source is not None:
            # This process's rank 0 of the frontend arena (vLLM's engine core: what its
            # multimodal cache holds, the stubs it acked; the totals at close once closed).
            self.reporter.report_reader_arena(source, metrics.FRONTEND)

    def report_liveness(self) -> None:
        """Logs liveness verdicts other than alive, once per new count (see ``Reporter``)."""
        self.reporter.report_liveness(self.ring, self.arena)

    def stats(self) -> dict:
        out = dict(self.counters)
        out["role"] = self.ROLE
        if self.sockets.remote is not None:
            out["tcp_refused"] = self.sockets.refused()
        if self.ring is not None:
            out["dropped_readers"] = self.ring.dropped_readers()
            out["liveness_unknown"] = self.ring.liveness_unknown()
        if self.arena is not None:
            out["arena"] = self.arena.stats()
        if self.blob_region is not None:
            out["blob_region"] = self.blob_region.stats(holdings=False)
        if self.arena_size is not None:
            out["arena_size"] = self.arena_size.as_dict()
        return out

    # ------------------------------------------------------------------ ending
    def _close_locked(self, drain_s: float) -> None:
        try:  # the last message counted before the last sequence number is announced
            self.finish_pending()
        except Exception:
            logger.exception("vllm_shm_arena: settling the last message at shutdown")
        self.sockets.close(drain_s, self.seq)
        # Only now: the ring's shutdown flag tells readers that nothing follows.
        if self.ring is not None:
            self.ring.shutdown()
            # Idempotent; covers a queue shut down before wait_until_ready unlinked the name.
            self.ring.unlink()
        self.reporter.cancel()
        if self.arena is not None:
            metrics.record_writer_stats(self.arena.stats(), key=self.arena.name)  # totals
        for arena in self._arenas():
            arena.close()
        # Nothing outside this end holds the blob region (readers copy blobs out): its
        # mapping, and the shared memory of its tables, go now rather than with this end.
        self.blob_region = None
