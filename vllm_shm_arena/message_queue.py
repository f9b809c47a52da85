"""``MessageQueue``: vLLM's broadcast queue interface with the tensor arena wired in.

One writer (the engine) sends every message to ``n_reader`` readers (the workers):

* node-local readers read a shared-memory ring of ``max_chunks`` chunks, in order; a message
  too big for a chunk leaves an "overflow" marker in the ring and travels over a local
  ZeroMQ XPUB socket bound to a path in a fresh 0700 directory inside the shm directory
  (no other user can connect), unlinked once the readers have subscribed;
* remote readers receive everything over a TCP XPUB socket;
* with ``enable_shm_tensor_arena=True`` and every reader node-local, large CPU tensors go into
  a ``ShmTensorArena`` instead: one copy, read zero-copy by all readers.

Works without vLLM; the vLLM plugin swaps it in for vLLM's own queue.
"""

from __future__ import annotations

import atexit
import logging
import os
import secrets
import socket
import struct
import sys
import threading
import time
import weakref
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import zmq

from vllm_shm_arena import metrics, settings, sizing
from vllm_shm_arena._ext import _C
from vllm_shm_arena.arena import ArenaHandle, ShmTensorArena, resolving_stubs
from vllm_shm_arena.pickler import Dumped, dump_message, dumps_inband, loads

logger = logging.getLogger("vllm_shm_arena")

#: How long a blocking wait sleeps in C++ before Python checks for shutdown/timeouts.
_WAIT_SLICE_S = 0.1
#: A reader holding slots this long is reported as starving the arena.
_STARVING_AGE_S = 30.0
#: Warn about a long wait every this many seconds (vLLM's VLLM_RINGBUFFER_WARNING_INTERVAL).
_WAIT_WARN_S = settings.ringbuffer_warning_interval()
#: vLLM's wording, so operators' log searches and alerts keep working.
_LONG_WAIT_MSG = (
    "No available shared memory broadcast block found in %d seconds. This typically happens "
    "when some processes are hanging or doing some time-consuming work (e.g. compilation)"
)


def _warn_interval() -> float:
    """The long-wait warning interval: vLLM's module constant when vLLM is loaded (tests and
    operators patch it there), else VLLM_RINGBUFFER_WARNING_INTERVAL."""
    mod = sys.modules.get("vllm.distributed.device_communicators.shm_broadcast")
    v = getattr(mod, "VLLM_RINGBUFFER_WARNING_INTERVAL", None) if mod is not None else None
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else _WAIT_WARN_S


#: At interpreter exit, how long to wait for threads to leave GIL-released calls.
_EXIT_WAIT_S = 2.0
#: How long the writer's shutdown() waits for queued socket frames to reach the readers.
_DRAIN_S = 5.0
#: A reader waiting for an overflow message after the writer shut the ring down gives the
#: socket this long to deliver what the writer's drain already handed to the kernel.
_SHUTDOWN_GRACE_S = 2.0
#: Most ring chunks a reader waiting on the socket takes ahead (to see the ring's shutdown
#: flag); beyond that it stops peeking, so the ring's back-pressure still holds.
_MAX_PEEKED = 64
#: Flags of a ring marker naming an arena blob that holds the whole message.
_FLAG_OVERFLOW = _C.RING_FLAG_OVERFLOW
_FLAG_BLOB = _C.RING_FLAG_BLOB
_BLOB_FLAGS = _FLAG_OVERFLOW | _FLAG_BLOB
#: The one frame of such a marker: the blob's slot, generation and bytes.
_BLOB_MARKER = struct.Struct("<QQQ")
#: Blobs may hold at most this share of the arena (a slow reader's backlog of overflow
#: messages must not starve tensors): 1/_BLOB_SHARE of it, split over the most blobs that can
#: be in flight at once (one per ring chunk, plus one per reader copying one out).
_BLOB_SHARE = 4
#: Most messages a remote reader's socket backlog holds before enqueue waits (and, with a
#: timeout, raises TimeoutError with nothing sent). The local socket needs no cap: it carries
#: only overflow messages, each announced by a ring marker, so the ring bounds its backlog.
_SOCKET_HWM = 64
#: After a local reader's connection dropped, how long it still waits for frames the writer
#: sent before (ZeroMQ may report the drop before the last frames are readable).
_LOST_GRACE_MS = 200
#: Bytes of the random token that starts every socket message (see Handle.socket_token).
_TOKEN_BYTES = 16
#: The writer's last frame on every socket: no message follows. Never a real message, which
#: has at least two frames (header, pickle).
_SHUTDOWN_FRAME = b"VSA-SHUTDOWN"

#: Arena geometry of the queues this process creates (read once, at import; settings.py).
#: "variable": one region of _ARENA_BYTES packing any tensor up to its size (the default);
#: "fixed": _ARENA_NUM_SLOTS slots of _ARENA_SLOT_BYTES (the design document's layout). The
#: policy is checked when a queue asks for an arena, so a bad one never fails a queue without.
_ARENA_POLICY = settings.arena_policy_unchecked()
_ARENA_BYTES = settings.arena_bytes()
_ARENA_MAX_ALLOCATIONS = settings.arena_max_allocations()
_ARENA_NUM_SLOTS = settings.arena_num_slots()
_ARENA_SLOT_BYTES = settings.arena_slot_bytes()


def _check_arena_policy() -> None:
    settings.check_arena_policy(_ARENA_POLICY)


def _create_arena(n_readers: int, ring) -> tuple[ShmTensorArena | None, sizing.ArenaSize]:
    """The arena for a new queue beside its ``ring``: shaped by the VLLM_SHM_ARENA_* settings
    above, smaller (or none) where the shm directory cannot hold it (sizing.py, which logs why).
    -> (arena or None, the size chosen)."""
    _check_arena_policy()
    layout = sizing.Layout(
        _ARENA_POLICY, _ARENA_BYTES, _ARENA_MAX_ALLOCATIONS, _ARENA_NUM_SLOTS, _ARENA_SLOT_BYTES
    )
    return sizing.create_arena(n_readers, layout, ring.dir, os.path.join(ring.dir, ring.name))


class _NoGilCalls:
    """Counts threads inside the ``_C`` calls that release the GIL (ring waits, copies).

    The bindings already make such a call safe at interpreter exit (a thread coming back
    after finalization began parks instead of taking the GIL; see ``with_nogil`` in
    csrc/torch_bindings.cpp). This gate is about the queue: the exit hook closes it, so no
    new call starts, and waits a bounded time until no thread is inside one, so queues are
    shut down cleanly (their sockets drained) rather than abandoned mid-call.
    """

    def __init__(self) -> None:
        self._cond = threading.Condition(threading.Lock())
        self._inside = 0
        self._closed = False

    def __enter__(self) -> None:
        with self._cond:
            if self._closed:
                raise RuntimeError("MessageQueue was shut down (the interpreter is exiting)")
            self._inside += 1

    def __exit__(self, *exc) -> None:
        with self._cond:
            self._inside -= 1
            if self._inside == 0:
                self._cond.notify_all()

    def close_and_wait(self, timeout: float) -> int:
        """Lets no new call start; waits up to ``timeout`` s -> threads still inside."""
        with self._cond:
            self._closed = True
            self._cond.wait_for(lambda: self._inside == 0, timeout)
            return self._inside


_NOGIL = _NoGilCalls()
#: Every queue end this process built, for the exit hook (weak: never keeps one alive).
_LIVE_QUEUES: weakref.WeakSet[MessageQueue] = weakref.WeakSet()


def _shutdown_at_exit() -> None:
    """Shuts down this process's live queue ends before Python finalizes: wakes blocked
    waits, lets no new GIL-released call start, and waits a bounded time for threads to
    leave the ones they are in."""
    pid = os.getpid()
    # A forked child's inherited queues belong to its parent: leave them alone.
    queues = [q for q in list(_LIVE_QUEUES) if q._pid == pid]
    for q in queues:
        q._shutdown.set()  # every wait loop checks it at least once per _WAIT_SLICE_S
    left = _NOGIL.close_and_wait(_EXIT_WAIT_S)
    if left:
        logger.warning(
            "vllm_shm_arena: %d thread(s) still inside a queue call at exit after %.0f s",
            left,
            _EXIT_WAIT_S,
        )
    for q in queues:
        try:
            q._close(_DRAIN_S if q._is_writer else 0.0)
        except Exception:
            logger.debug("vllm_shm_arena: closing a queue at exit failed", exc_info=True)


atexit.register(_shutdown_at_exit)


@dataclass
class Handle:
    """What a reader needs to join a queue (picklable; works with fork and spawn)."""

    local_reader_ranks: list[int] = field(default_factory=list)
    buffer_handle: tuple | None = None  # (ring shm name, shm dir)
    local_subscribe_addr: str | None = None
    remote_subscribe_addr: str | None = None
    remote_addr_ipv6: bool = False
    #: Starts every message on the queue's sockets: a reader takes a socket message only
    #: from the writer that made its handle (protect the handle like the queue itself).
    socket_token: bytes = b""
    tensor_arena_handle: ArenaHandle | None = None


class WriterDiedError(RuntimeError):
    """The queue's writer process is gone (the kernel released its liveness token): no more
    messages will come. Messages it published before dying were delivered first."""


def _connection_lost_error() -> RuntimeError:
    return RuntimeError(
        "MessageQueue: this reader's connection to the writer's local socket dropped (it is "
        "never re-established: the socket's name is gone); recreate the queue"
    )


def _writer_died(what: str) -> WriterDiedError:
    return WriterDiedError(
        f"MessageQueue: the writer process died ({what}); no more messages will come"
    )


class _RateLimitedLog:
    """One log line per key per interval."""

    def __init__(self, interval_s: float = 10.0):
        self.interval_s = interval_s
        self._last: dict[str, float] = {}

    def __call__(self, key: str, level: int, msg: str, *args) -> None:
        now = time.monotonic()
        if now - self._last.get(key, -1e9) >= self.interval_s:
            self._last[key] = now
            logger.log(level, msg, *args)


def _check_int(name: str, value, minimum: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}")


class _Resources:
    """What a queue end must close even when nobody calls ``shutdown()``: its ZeroMQ sockets
    and context (an open socket makes the context's ``term()``, run when pyzmq collects it,
    wait for good: a queue in a reference cycle hung ``gc.collect()``) and, on the writer,
    the ring (shut down so blocked readers wake).

    A ``weakref.finalize`` holds this object, never the queue, so the queue can still be
    collected; ``release`` runs once, when the queue dies or is shut down, or when its
    constructor fails.
    """

    def __init__(self, pid: int, ctx) -> None:
        self.pid = pid
        self.ctx = ctx
        self.sockets: list = []
        self.ring_writer = None
        self.socket_dir = None  # the local socket's _C.SocketDir (0700, with its token)

    def remove_socket_dir(self) -> None:
        """Removes the local socket's directory, its token and the socket's name (idempotent;
        connected readers keep their connections)."""
        d, self.socket_dir = self.socket_dir, None
        if d is not None:
            d.remove()

    def release(self) -> None:
        """Closes the sockets (dropping unsent frames: ``shutdown()`` is the path that
        drains), terminates the context, shuts the writer's ring down."""
        if os.getpid() != self.pid:
            return  # a forked child's inherited copy: these belong to the parent
        self.remove_socket_dir()
        for s in self.sockets:
            s.close(linger=0)
        self.ctx.term()
        if self.ring_writer is not None:
            self.ring_writer.shutdown()


def _report_from_timer(ref: weakref.ref) -> None:
    """A report a queue owed (see ``MessageQueue._maybe_report``), made from the timer thread
    under the queue end's lock; skipped if the queue is gone or closed, and left to the next
    call if that end is busy now (the busy call reports itself)."""
    q = ref()
    if q is None:
        return
    q._report_timer = None
    # Threads do not survive fork, but a child could still call this by hand.
    if os.getpid() != q._pid or q._closed:
        return
    if not q._side_lock.acquire(blocking=False):
        return
    try:
        if q._closed:
            return
        q._last_report = time.monotonic()
        q._report()
    except Exception:  # a report must never take the process down from a timer thread
        logger.debug("vllm_shm_arena: a timed stats report failed", exc_info=True)
    finally:
        q._side_lock.release()


class _Sending:
    """What one enqueue has committed so far, recorded step by step (see ``_settle``)."""

    __slots__ = ("diverted", "fits", "blob", "ring_seq", "sent", "socket_owed")

    def __init__(self, diverted: list) -> None:
        self.diverted = diverted
        self.fits = False
        self.blob: tuple[int, int, int] | None = None  # (slot, generation, nbytes)
        self.ring_seq: int | None = None  # ring.published() just before the publish
        self.sent: dict[int, int] = {}  # id(socket) -> frames queued on it
        self.socket_owed = False  # the ring announced it; the local socket has not taken it


def _diverted_header(diverted: list[tuple[int, int]]) -> bytes:
    """Frame 0 of every message: the arena slots it references (released by a reader that
    fails to unpickle it)."""
    if not diverted:
        return b""
    flat = [x for pair in diverted for x in pair]
    return struct.pack(f"<{len(flat)}Q", *flat)


def _parse_diverted(frame) -> list[tuple[int, int]]:
    mv = memoryview(frame).cast("B")
    if len(mv) % 16:
        return []
    flat = struct.unpack(f"<{len(mv) // 8}Q", mv)
    return list(zip(flat[0::2], flat[1::2], strict=True))


class MessageQueue:
    """A broadcast queue from one writer to ``n_reader`` readers (vLLM's interface).

    The writer constructs it; readers join with ``create_from_handle(writer.export_handle(),
    rank)``; everyone calls ``wait_until_ready()``. Then the writer ``enqueue``s and every
    reader ``dequeue``s every message, in order.
    """

    def __init__(
        self,
        n_reader: int,
        n_local_reader: int,
        local_reader_ranks: list[int] | None = None,
        max_chunk_bytes: int = 16 << 20,
        max_chunks: int = 10,
        connect_ip: str | None = None,
        *,
        enable_shm_tensor_arena: bool = False,
    ):
        # Every argument is checked before anything (ring, socket, arena) is created.
        _check_int("n_reader", n_reader, 0)
        _check_int("n_local_reader", n_local_reader, 0)
        if n_local_reader > n_reader:
            raise ValueError(
                f"need 0 <= n_local_reader ({n_local_reader}) <= n_reader ({n_reader})"
            )
        _check_int("max_chunk_bytes", max_chunk_bytes, 1)
        _check_int("max_chunks", max_chunks, 1)
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
            connect_ip = _local_ip()  # vLLM's default: this node's address
        if n_reader > n_local_reader and not (isinstance(connect_ip, str) and connect_ip):
            raise ValueError(
                f"remote readers need connect_ip (an address they can reach), got {connect_ip!r}"
            )
        if enable_shm_tensor_arena:
            _check_arena_policy()
        self.n_reader = n_reader
        self.n_local_reader = n_local_reader
        self.n_remote_reader = n_reader - n_local_reader
        self.max_chunk_bytes = max_chunk_bytes
        self._is_writer = True
        self._is_local_reader = False
        self._is_remote_reader = False
        self.local_reader_rank = -1
        self._ready = False
        #: Pickle tensor bytes inside the stream (the pre-out-of-band baseline; benchmarks).
        self.serialize_inband = False
        self._ring = None
        self.local_socket = None
        self.remote_socket = None
        self.arena: ShmTensorArena | None = None
        self._init_process_state()
        self._token = secrets.token_bytes(_TOKEN_BYTES)
        try:
            local_addr = remote_addr = None
            if n_local_reader > 0:
                self._ring = _C.RingWriter(n_local_reader, max_chunks, max_chunk_bytes)
                self._res.ring_writer = self._ring
                _C.set_copy_readers(n_local_reader)  # the copy pool leaves the readers CPUs
                self.local_socket = self._xpub(0)
                # A path, not an abstract socket (which any uid in the network namespace can
                # reach), in a fresh 0700 directory of fresh random name: the directory is the
                # access check, as ZeroMQ has no portable peer-credential check. It stays for
                # the queue's life (only the socket's name goes once the readers connected),
                # so its name is never free for another user to take, and its liveness token
                # tells the stale-name cleaner it is in use.
                self._res.socket_dir = _C.SocketDir(self._ring.dir)
                local_addr = f"ipc://{self._res.socket_dir.socket_path}"
                self.local_socket.bind(local_addr)
            if self.n_remote_reader > 0:
                self.remote_socket = self._xpub(_SOCKET_HWM)
                port = self.remote_socket.bind_to_random_port(f"tcp://{connect_ip}")
                remote_addr = f"tcp://{connect_ip}:{port}"
            if enable_shm_tensor_arena:
                if self.n_remote_reader > 0 or n_local_reader == 0:
                    logger.warning(
                        "shm tensor arena disabled for this queue: %d of %d readers are "
                        "remote (the arena needs every reader on this node); using the "
                        "out-of-band path",
                        self.n_remote_reader,
                        n_reader,
                    )
                else:
                    self.arena, self._arena_size = _create_arena(n_local_reader, self._ring)
            self._blob_max = 0
            if self.arena is not None and self.arena.handle().policy == "variable":
                self._blob_max = (self.arena.slot_bytes // _BLOB_SHARE) // (
                    max_chunks + n_local_reader
                )
        except BaseException:
            # Half built: release now, not whenever a reference cycle through the traceback
            # is collected.
            self._closed = True
            self._finalizer()
            if self._ring is not None:
                self._ring.unlink()
            raise
        self._last_decline = {}
        self.handle = Handle(
            socket_token=self._token,
            local_reader_ranks=list(local_reader_ranks),
            buffer_handle=(self._ring.name, self._ring.dir) if self._ring else None,
            local_subscribe_addr=local_addr,
            remote_subscribe_addr=remote_addr,
            tensor_arena_handle=self.arena.handle() if self.arena else None,
        )

    def _init_process_state(self) -> None:
        """State every queue end has, writer or reader."""
        self._shutdown = threading.Event()
        self._closed = False
        self._broken = ""  # why the queue can no longer send (an enqueue timed out mid-send)
        # Held while a call uses the ZeroMQ sockets, so shutdown() from another thread does not
        # close a socket under it (ZeroMQ sockets are not thread-safe).
        self._io_lock = threading.RLock()
        self._monitor = None  # local readers: events of the connection to the writer's socket
        self._lost = False  # that connection dropped (it is never re-established)
        # Serialises this end's calls (enqueue and wait_until_ready on the writer, dequeue on a
        # reader) and the timed report: the C++ ring ends are single-threaded.
        self._side_lock = threading.Lock()
        self._pid = os.getpid()
        self._ctx = zmq.Context()
        self._res = _Resources(self._pid, self._ctx)
        self._finalizer = weakref.finalize(self, _Resources.release, self._res)
        # Not at exit on its own: the exit hook runs it after waking blocked threads.
        self._finalizer.atexit = False
        self._log = _RateLimitedLog()
        # overflow_messages: too big for a ring chunk; blob_messages: those of them that went
        # through the arena (the rest went over the local socket).
        self._counters = {
            "messages": 0,
            "ring_messages": 0,
            "overflow_messages": 0,
            "blob_messages": 0,
            "bytes": 0,
        }
        self._last_report = 0.0
        self._mismatches = 0
        self._liveness_logged: dict[str, int] = {}  # verdict counts already logged
        self._report_timer: threading.Timer | None = None  # a report owed (see _maybe_report)
        #: Ring reads taken ahead while waiting on the socket for an overflow message.
        self._peeked: deque = deque()
        _LIVE_QUEUES.add(self)

    def _xpub(self, hwm: int):
        s = self._ctx.socket(zmq.XPUB)
        self._res.sockets.append(s)
        s.setsockopt(zmq.XPUB_VERBOSE, 1)
        # Never drop a message for a slow subscriber: at the cap a send fails instead (EAGAIN
        # on a message's first frame), and enqueue waits.
        s.setsockopt(zmq.XPUB_NODROP, 1)
        s.setsockopt(zmq.SNDHWM, hwm)
        s.setsockopt(zmq.LINGER, 0)
        return s

    @property
    def tensor_arena(self) -> ShmTensorArena | None:
        """vLLM's name for ``arena`` (its ``MessageQueue.tensor_arena``); read-only."""
        return self.arena

    # ------------------------------------------------------------------ joining
    def export_handle(self) -> Handle:
        """The handle readers pass to ``create_from_handle``."""
        return self.handle

    @staticmethod
    def create_from_handle(handle: Handle, rank: int) -> MessageQueue:
        """Joins the queue described by ``handle`` as reader ``rank``."""
        # Checked before anything (context, ring, socket) is created.
        if not isinstance(handle, Handle):
            raise TypeError(f"expected a MessageQueue Handle, got {type(handle).__name__}")
        _check_int("rank", rank, 0)
        local = rank in handle.local_reader_ranks
        if not local and handle.remote_subscribe_addr is None:
            raise ValueError(
                f"rank {rank} is not a local reader and the queue has no remote socket"
            )
        self = MessageQueue.__new__(MessageQueue)
        self.handle = handle
        self._token = bytes(handle.socket_token)
        self._is_writer = False
        self._ring = None
        self.local_socket = self.remote_socket = None
        self.arena = None
        self._ready = False
        self.last_dequeue_s = 0.0
        self.n_local_reader = len(handle.local_reader_ranks)
        self._init_process_state()
        try:
            if local:
                self._is_local_reader = True
                self._is_remote_reader = False
                self.local_reader_rank = handle.local_reader_ranks.index(rank)
                name, shm_dir = handle.buffer_handle
                # The arena first: a ring rank is claimed once for good, an arena rank that
                # failed to attach is untouched, so a join that fails here can be retried.
                if handle.tensor_arena_handle is not None:
                    self.arena = ShmTensorArena.attach(
                        handle.tensor_arena_handle, self.local_reader_rank
                    )
                self._ring = _C.RingReader(name, self.local_reader_rank, shm_dir)
                # Readers copy ring frames out too: leave the others (and the writer) a CPU.
                _C.set_copy_readers(self.n_local_reader)
                self.local_socket = self._sub(handle.local_subscribe_addr, local=True)
            else:
                self._is_local_reader = False
                self._is_remote_reader = True
                self.local_reader_rank = -1
                self.remote_socket = self._sub(handle.remote_subscribe_addr, local=False)
        except BaseException:
            self._closed = True
            self._finalizer()  # half built: release now (see __init__)
            raise
        return self

    def _sub(self, addr: str, local: bool):
        s = self._ctx.socket(zmq.SUB)
        self._res.sockets.append(s)
        s.setsockopt(zmq.RCVHWM, 0)
        s.setsockopt(zmq.LINGER, 0)
        if local:
            # The socket's name is gone once every reader connected, so a dropped connection is
            # never re-established by the writer: it is an error (seen through this monitor)
            # once what came before is read. ZeroMQ still retries the name (disabling that,
            # ZMQ_RECONNECT_IVL=-1, makes it drop messages received but not yet read when the
            # writer closes); whatever answers there later is not the writer and its messages
            # fail the token check (_recv_socket).
            mon = s.get_monitor_socket(zmq.EVENT_DISCONNECTED)
            self._res.sockets.append(mon)
            self._monitor = mon
        s.setsockopt_string(zmq.SUBSCRIBE, "")
        s.connect(addr)
        return s

    def _take_side_lock(self, timeout: float | None, what: str) -> None:
        """Takes this end's lock within ``timeout`` (None: no limit), or raises TimeoutError
        naming the ``what`` another thread is in."""
        if not self._side_lock.acquire(timeout=-1 if timeout is None else max(timeout, 0.0)):
            raise TimeoutError(f"timed out waiting for another thread's {what} on this queue")

    def _connection_lost(self) -> bool:
        """Local readers: whether the connection to the writer's socket dropped (it is never
        re-established)."""
        mon = self._monitor
        if mon is None or not mon.poll(0):
            return False
        while mon.poll(0):
            mon.recv_multipart()
        self._lost = True
        return True

    def wait_until_ready(self, timeout: float | None = None) -> None:
        """Writer: waits for every reader to subscribe, then tells them to start. Readers:
        wait for that. Afterwards the shm names are unlinked, so nothing is left in
        ``/dev/shm`` even if every process is killed."""
        deadline = None if timeout is None else time.monotonic() + timeout
        self._take_side_lock(timeout, "call")
        try:
            self._wait_until_ready_locked(deadline)
        finally:
            self._side_lock.release()
        self._ready = True

    def _wait_until_ready_locked(self, deadline: float | None) -> None:
        with self._io_lock:
            if self._is_writer:
                for sock, n in (
                    (self.local_socket, self.n_local_reader),
                    (self.remote_socket, self.n_remote_reader),
                ):
                    if sock is None:
                        continue
                    for _ in range(n):
                        self._poll(sock, deadline, "readers to subscribe")
                        sock.recv()
                    if sock is self.local_socket and self._res.socket_dir is not None:
                        # Every expected reader is connected: nobody else may connect now. The
                        # directory stays until shutdown, so its name never becomes free.
                        self._res.socket_dir.unlink_socket()
                    if sock.poll(0):
                        raise RuntimeError(
                            f"more than the {n} expected readers subscribed to the queue "
                            "socket; refusing to start"
                        )
                    sock.send(b"READY")
                # Every local reader has mapped the ring and the arena: drop the names.
                if self._ring is not None:
                    self._ring.unlink()
                if self.arena is not None:
                    self.arena.unlink()
            else:
                sock = self.local_socket if self._is_local_reader else self.remote_socket
                self._poll(sock, deadline, "the writer's READY", watch_writer=self._is_local_reader)
                msg = sock.recv()
                if msg == _SHUTDOWN_FRAME + self._token:
                    raise RuntimeError("MessageQueue was shut down by the writer")
                if msg != b"READY":
                    raise RuntimeError(
                        f"unexpected first message on the queue socket: {msg[:32]!r}"
                    )

    def _poll(self, sock, deadline, what, watch_writer: bool = False):
        while True:
            if self._shutdown.is_set():
                raise RuntimeError("MessageQueue was shut down")
            wait = (
                _WAIT_SLICE_S
                if deadline is None
                else min(_WAIT_SLICE_S, deadline - time.monotonic())
            )
            if wait <= 0:
                raise TimeoutError(f"timed out waiting for {what}")
            if sock.poll(int(wait * 1000)):
                return
            if watch_writer and self._writer_is_dead() and not sock.poll(0):
                raise _writer_died(f"while waiting for {what}")
            if self._connection_lost() and not sock.poll(0):
                raise _connection_lost_error()

    def _writer_is_dead(self) -> bool:
        """Local readers: the writer's liveness token in the ring is free (positive evidence;
        a probe the kernel cannot answer counts as alive). Remote readers cannot tell."""
        return self._ring is not None and self._ring.writer_liveness() == "dead"

    # ------------------------------------------------------------------ writer
    def enqueue(self, obj: Any, timeout: float | None = None) -> None:
        """Sends ``obj`` to every reader. Returns only when the caller may mutate or free
        everything it passed (nothing sent aliases the caller's memory).

        Exactly once: a ``TimeoutError`` (no free ring chunk, or a remote reader's socket
        backlog at its cap, within ``timeout``) or a shutdown means the message was not sent
        and its arena allocations went back (the caller may retry); once any reader can see
        the message it is sent, and every reader gets it once, in order. Thread-safe: calls
        from several threads are serialised (a call waiting for another honours its own
        ``timeout``)."""
        if not self._is_writer:
            raise RuntimeError("only the writer can enqueue")
        deadline = None if timeout is None else time.monotonic() + timeout
        self._check_can_send()
        self._take_side_lock(timeout, "enqueue")
        try:
            self._check_can_send()
            if self.serialize_inband:
                dumped = Dumped(dumps_inband(obj), [], [])
            else:
                with _NOGIL:  # the arena copy releases the GIL
                    dumped = dump_message(obj, self.arena)
            frames = [_diverted_header(dumped.diverted), dumped.data, *dumped.buffers]
            sending = _Sending(dumped.diverted)
            try:
                self._send(frames, deadline, sending)
            except BaseException as e:
                self._settle(frames, sending, e)
                raise
            self._counters["messages"] += 1
            self._maybe_report()
        finally:
            self._side_lock.release()

    def _check_can_send(self) -> None:
        if self._shutdown.is_set():
            raise RuntimeError("MessageQueue was shut down")
        if self._broken:
            raise RuntimeError(f"MessageQueue is broken ({self._broken}); recreate it")

    def _send(self, frames: list, deadline: float | None, sending: _Sending) -> None:
        """One message, in an order where every wait comes before anything is committed:
        (1) a ring chunk is reserved (the ring's back-pressure), (2) a message too big for a
        chunk is packed into an arena blob (never waits, may decline), (3) remote readers'
        socket (waits while a reader's backlog is at its cap), then (4) the ring publishes
        (and, for an overflow message without a blob, the local socket takes it; it never
        waits: the ring bounds its backlog). Each step records what it committed in
        ``sending``, for ``_settle``."""
        sizes = [memoryview(f).nbytes for f in frames]
        self._counters["bytes"] += sum(sizes)
        ring = self._ring
        fits = ring is not None and _C.RingWriter.packed_bytes(sizes) <= self.max_chunk_bytes
        sending.fits = fits
        if ring is not None:
            while True:
                left = self._time_left(deadline, "a free ring chunk (readers are slow or stuck)")
                with _NOGIL:
                    if ring.reserve(_WAIT_SLICE_S if left is None else min(_WAIT_SLICE_S, left)):
                        break
            if not fits and self.arena is not None and self._blob_max:
                with _NOGIL:
                    sending.blob = self.arena.write_blob(frames, self._blob_max)
        if self.remote_socket is not None:
            self._send_socket(self.remote_socket, frames, deadline, sending, may_wait=True)
        if ring is not None:
            self._publish_local(frames, fits, sending)

    def _publish_local(self, frames: list, fits: bool, sending: _Sending) -> None:
        """Step (4) of ``_send``: the reserved chunk is published; it never waits."""
        ring = self._ring
        sending.ring_seq = ring.published()
        status = "overflow"
        if fits:
            with _NOGIL:
                status = ring.write(frames, 0, 0.0)
        elif sending.blob is not None:
            with _NOGIL:
                status = ring.write([_BLOB_MARKER.pack(*sending.blob)], _BLOB_FLAGS, 0.0)
            if status == "ok":
                self._counters["overflow_messages"] += 1
                self._counters["blob_messages"] += 1
                return
        if status == "ok":
            self._counters["ring_messages"] += 1
            return
        if status == "no_space":  # the ring published an overflow marker instead
            self._log(
                "no_space_ring",
                logging.WARNING,
                "ring chunk could not be backed (/dev/shm full); message sent over the socket",
            )
        else:
            ring.write_marker(_C.RING_FLAG_OVERFLOW, 0.0)
        if sending.blob is not None:
            # Published in the arena but named by no marker: no reader will ever see it.
            self.arena.give_back_unsent([sending.blob[:2]])
            sending.blob = None
        self._counters["overflow_messages"] += 1
        sending.socket_owed = True
        self._send_socket(self.local_socket, frames, None, sending, may_wait=False)
        sending.socket_owed = False

    def _send_socket(
        self, sock, frames: list, deadline: float | None, sending: _Sending, may_wait: bool
    ) -> None:
        """Queues ``frames`` on ``sock`` as one message, copied (ZeroMQ owns the copy, so
        nothing aliases the caller's memory once this returns). Only the first frame can meet
        the backlog cap (``ZMQ_XPUB_NODROP``: a full subscriber makes the send fail, never
        drop); waiting for it honours ``deadline``, and nothing of the message has been sent
        then. ``may_wait=False``: a socket without a cap, which never waits."""
        with self._io_lock:
            if self._shutdown.is_set():  # the socket is closed (or about to be)
                raise RuntimeError("MessageQueue was shut down")
            n = len(frames)
            first = self._token + bytes(frames[0])  # the token, then the arena records
            while True:
                try:
                    sock.send(first, (zmq.SNDMORE if n > 1 else 0) | zmq.NOBLOCK, copy=True)
                    break
                except zmq.Again:
                    if not may_wait:
                        raise
                self._time_left(deadline, "a remote reader's socket backlog to drain")
                self._log(
                    "socket_full",
                    logging.WARNING,
                    "a remote reader's socket backlog is at its cap (%d messages): it is not "
                    "reading; enqueue waits",
                    _SOCKET_HWM,
                )
                time.sleep(0.001)
            sending.sent[id(sock)] = 1
            # The rest cannot fail for a full subscriber (that is decided on a message's first
            # frame) and is not interrupted by our own checks: a half-sent message would be
            # completed by the next message's frames.
            for i in range(1, n):
                sock.send(frames[i], zmq.SNDMORE if i + 1 < n else 0, copy=True)
                sending.sent[id(sock)] = i + 1

    def _settle(self, frames: list, sending: _Sending, exc: BaseException) -> None:
        """An exception left ``_send`` (a timeout or shutdown before anything was committed,
        or an asynchronous exception such as ``KeyboardInterrupt`` at any point). Decides from
        what the ring and the sockets actually took, not from where Python was: nothing taken
        -> the message's arena allocations go back (not sent); taken -> whatever readers are
        still owed is finished, and the exception carries a note that the message was sent; a
        half-sent socket message -> the queue is broken (it cannot go on in order)."""
        n = len(frames)
        ring = self._ring
        seq = sending.ring_seq
        ring_committed = ring is not None and seq is not None and ring.published() > seq
        counts = list(sending.sent.values())
        if any(0 < k < n for k in counts):
            self._break("an enqueue was interrupted half-way through a socket send")
            return
        remote_done = self.remote_socket is not None and sending.sent.get(id(self.remote_socket))
        if not ring_committed and not remote_done:
            blob = [sending.blob[:2]] if sending.blob is not None else []
            if self.arena is not None and (sending.diverted or blob):
                # Nothing was published: readers never saw the stubs. A failure here must
                # not replace the error that stopped the send.
                try:
                    self.arena.give_back_unsent([*sending.diverted, *blob])
                except Exception:
                    logger.exception("vllm_shm_arena: giving back an unsent message's slots")
            return
        # Sent: finish what readers are owed (neither step waits).
        try:
            if ring is not None and not ring_committed:
                self._publish_local(frames, sending.fits, sending)
            elif sending.socket_owed:
                self._send_socket(self.local_socket, frames, None, sending, may_wait=False)
        except BaseException:
            self._break("an enqueue was interrupted after its message was announced")
            raise
        self._counters["messages"] += 1
        if hasattr(exc, "add_note"):
            exc.add_note(
                "vllm_shm_arena: this message was sent before the exception; do not send it again"
            )

    def _break(self, why: str) -> None:
        """The queue cannot go on in order: no more sends, the ring shut down (readers get a
        clear error after the messages before), the sockets closed (ZeroMQ drops the half
        message), and the arena closed for writes (a reader may hold this message's
        records: they are never reused)."""
        self._broken = why
        for s in (self.local_socket, self.remote_socket):
            if s is not None:
                s.close(linger=0)
        if self._ring is not None:
            self._ring.shutdown()
        if self.arena is not None:
            self.arena.close()

    def _time_left(self, deadline, what):
        if self._shutdown.is_set():
            raise RuntimeError("MessageQueue was shut down")
        if deadline is None:
            return None
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError(f"timed out waiting for {what}; the message was not sent")
        return left

    def empty(self, shape, dtype=None):
        """Writer: a tensor to fill in place that ``enqueue`` then sends without copying (a
        loan from the arena; see ``ShmTensorArena.empty`` for the rules). Without an arena, or
        when the arena cannot lend that much now, a plain ``torch.empty``."""
        import torch

        dtype = torch.float32 if dtype is None else dtype
        if not self._is_writer:
            raise RuntimeError("only the writer can lend tensors")
        self._check_can_send()  # a broken queue's arena lends nothing: readers may hold it
        t = self.arena.empty(shape, dtype) if self.arena is not None else None
        return t if t is not None else torch.empty(tuple(shape), dtype=dtype)

    def _maybe_report(self) -> None:
        """Counters, logs and metrics at most once a second (stats() walks every allocation
        and reader: too much for every message). A report skipped for that reason is made by
        a one-shot timer instead, so totals settle within about a second of the last message
        even when the queue then goes idle."""
        now = time.monotonic()
        if now - self._last_report >= 1.0:
            self._last_report = now
            self._report()
        elif self._report_timer is None:
            # The timer holds the queue weakly: a queue dropped without shutdown() is never
            # kept alive by a report it owes.
            t = threading.Timer(
                1.0 - (now - self._last_report), _report_from_timer, (weakref.ref(self),)
            )
            t.daemon = True
            self._report_timer = t
            t.start()

    def _report(self) -> None:
        if self._is_writer:
            self._report_liveness()
            if self.arena is not None:
                self._report_arena()
        elif self.arena is not None:
            rs = self.arena.stats()
            metrics.record_reader_stats(rs)
            if rs["checksum_mismatches"] > self._mismatches:
                self._mismatches = rs["checksum_mismatches"]
                logger.warning(
                    "vllm_shm_arena: %d arena tensor(s) changed between write and release "
                    "(an in-place write by a reader? other readers saw it too)",
                    self._mismatches,
                )

    def _report_liveness(self) -> None:
        """Logs every liveness verdict other than alive, once per new count: readers found
        dead (their holdings reclaimed, their ring rank dropped) and probes the kernel did not
        answer (those readers were kept as alive)."""
        counts = {}
        if self._ring is not None:
            counts["ring_dropped"] = self._ring.dropped_readers()
            counts["ring_unknown"] = self._ring.liveness_unknown()
        if self.arena is not None:
            s = self.arena.stats(holdings=False)
            counts["arena_dead"] = s["dead_readers"]
            counts["arena_unknown"] = s["liveness_unknown"]
        for key, n in counts.items():
            if n <= self._liveness_logged.get(key, 0):
                continue
            self._liveness_logged[key] = n
            if key.endswith("unknown"):
                logger.warning(
                    "vllm_shm_arena: %d liveness probe(s) of a lagging reader got no answer from "
                    "the kernel (%s); those readers are kept as alive",
                    n,
                    "ring" if key.startswith("ring") else "arena",
                )
            else:
                logger.warning(
                    "vllm_shm_arena: %d reader(s) found dead (%s); what they held was reclaimed",
                    n,
                    "ring rank dropped" if key.startswith("ring") else "arena allocations",
                )

    def _report_arena(self) -> None:
        s = self.arena.stats()
        metrics.record_writer_stats(s, key=self.arena.name)
        d = s["declined"]
        for key, what in (
            (
                "no_free_slot",
                "arena exhausted (every slot held by readers); "
                "tensors fell back to the out-of-band path",
            ),
            (
                "oversize",
                f"tensor larger than an arena slot ({self.arena.slot_bytes >> 20} MiB) "
                "fell back to the out-of-band path",
            ),
            ("no_space", "/dev/shm is full: arena writes fall back to the out-of-band path"),
        ):
            if d[key] != self._last_decline.get(key, 0):
                self._last_decline[key] = d[key]
                self._log(key, logging.WARNING, "vllm_shm_arena: %s (%d so far)", what, d[key])
        for h in s["holdings"]:
            if h["slots_held"] and h["oldest_age_s"] > _STARVING_AGE_S:
                self._log(
                    f"starve{h['rank']}",
                    logging.WARNING,
                    "vllm_shm_arena: reader %d has held %d arena slot(s) for %.0f s; "
                    "tensors kept alive this long starve the arena",
                    h["rank"],
                    h["slots_held"],
                    h["oldest_age_s"],
                )

    # ------------------------------------------------------------------ reader
    def dequeue(self, timeout: float | None = None, indefinite: bool = False) -> Any:
        """Receives the next message. Raises ``TimeoutError`` after ``timeout`` seconds (the
        queue is then exactly as it was: the message comes with a later call) and
        ``RuntimeError`` once the queue is shut down. ``indefinite`` silences the periodic
        "still waiting" log line. Thread-safe: calls from several threads are serialised, each
        message goes to one of them."""
        if self._is_writer:
            raise RuntimeError("the writer cannot dequeue")
        deadline = None if timeout is None else time.monotonic() + timeout
        self._take_side_lock(timeout, "dequeue")
        try:
            return self._dequeue_locked(deadline, indefinite)
        finally:
            self._side_lock.release()

    def _dequeue_locked(self, deadline: float | None, indefinite: bool) -> Any:
        arena = self.arena
        if arena is not None:
            if arena.needs_flush:  # something was pinned: releases wait for their events
                with _NOGIL:
                    arena.flush_releases()
            self._maybe_report()
        started = time.monotonic()
        warned_at = started
        warn_every = _warn_interval()
        if self._is_local_reader:
            while True:
                if self._shutdown.is_set():
                    raise RuntimeError("MessageQueue was shut down")
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    raise TimeoutError("timed out waiting for a message")
                peeked = self._peeked
                if peeked:
                    status, flags, frames = peeked[0]
                else:
                    with _NOGIL:
                        status, flags, frames = self._ring.read(
                            _WAIT_SLICE_S if left is None else min(_WAIT_SLICE_S, left)
                        )
                if status == "ok":
                    arrived = time.perf_counter()
                    break
                if status == "shutdown":
                    raise RuntimeError("MessageQueue was shut down by the writer")
                if status == "writer_dead":
                    raise _writer_died("noticed while waiting for a message")
                if not indefinite and time.monotonic() - warned_at >= warn_every:
                    warned_at = time.monotonic()
                    logger.warning(_LONG_WAIT_MSG, warned_at - started)
            if not flags & _FLAG_OVERFLOW:
                if peeked:
                    peeked.popleft()
                self._counters["ring_messages"] += 1
            else:
                # The marker stays at the front of _peeked until its message is in hand: a
                # wait below that times out leaves it there for the next call, in order.
                if not peeked:
                    peeked.append(("ok", flags, frames))
                if flags & _FLAG_BLOB:
                    peeked.popleft()
                    frames = self._read_blob(frames)
                    self._counters["blob_messages"] += 1
                else:
                    frames = self._recv_socket(self.local_socket, deadline, watch_ring=True)
                    peeked.popleft()
                self._counters["overflow_messages"] += 1
        else:
            frames = self._recv_socket(self.remote_socket, deadline)
            arrived = time.perf_counter()
        self._counters["messages"] += 1
        obj = self._unpickle(frames)
        #: Seconds from the message's arrival (ring chunk seen) to the object in hand.
        self.last_dequeue_s = time.perf_counter() - arrived
        return obj

    def _read_blob(self, marker_frames) -> list:
        """The frames of a message the writer packed into an arena blob (named by the ring
        marker's one frame: slot, generation, bytes), copied out; the blob is released at
        once, whatever happens to the message afterwards."""
        if self.arena is None:
            raise RuntimeError(
                "the ring announced a message in the tensor arena, but this reader has no "
                "arena attached (a queue handle without its arena handle?)"
            )
        if len(marker_frames) != 1 or len(marker_frames[0]) != _BLOB_MARKER.size:
            raise RuntimeError("corrupt blob marker in the message ring")
        slot, gen, nbytes = _BLOB_MARKER.unpack(marker_frames[0])
        return self.arena.read_blob(slot, gen, nbytes)

    def _recv_socket(self, sock, deadline, watch_ring: bool = False):
        """The next message on ``sock``. ``watch_ring``: the ring announced it (an overflow
        marker), so also watch the ring's shutdown flag: if the writer shut down without
        sending it (its enqueue was interrupted, or a finalizer closed the socket), give up
        after _SHUTDOWN_GRACE_S instead of waiting for good."""
        writer_gone_at = None
        with self._io_lock:
            while True:
                if self._shutdown.is_set():
                    raise RuntimeError("MessageQueue was shut down")
                now = time.monotonic()
                wait = _WAIT_SLICE_S if deadline is None else min(_WAIT_SLICE_S, deadline - now)
                if wait <= 0:
                    raise TimeoutError("timed out waiting for a message on the socket")
                if sock.poll(int(wait * 1000)):
                    break
                lost = self._lost or self._connection_lost()
                if watch_ring and self._writer_is_dead():
                    if sock.poll(0):  # sent before it died: still delivered
                        break
                    raise _writer_died("its ring announced a message it never sent")
                if watch_ring and writer_gone_at is None and self._ring_shut_down():
                    writer_gone_at = time.monotonic()
                if writer_gone_at is not None:
                    # The writer ended the ring: what it sent before comes within the grace.
                    if time.monotonic() - writer_gone_at > _SHUTDOWN_GRACE_S:
                        raise RuntimeError(
                            "MessageQueue was shut down by the writer before it sent the "
                            "message its ring announced"
                        )
                elif lost:
                    # Never re-established: what the writer sent before it went is delivered
                    # first (ZeroMQ may report the drop before the last frames are readable).
                    if sock.poll(_LOST_GRACE_MS):
                        break
                    raise _connection_lost_error()
            # Zero-copy frames: each belongs to this reader for good, so tensors may alias them.
            frames = sock.recv_multipart(copy=False)
        head = frames[0].buffer
        if len(frames) == 1 and head == _SHUTDOWN_FRAME + self._token:
            raise RuntimeError("MessageQueue was shut down by the writer")
        if len(frames) < 2 or head[: len(self._token)] != self._token:
            # Not the writer's (it always sends the token, then the pickle): whoever answers at
            # the socket's address now. Nothing of it is unpickled.
            self._lost = True
            raise RuntimeError(
                "MessageQueue: a message on the queue's socket did not come from its writer "
                "(wrong token); nothing of it was used. Recreate the queue"
            )
        return [head[len(self._token) :], *(f.buffer for f in frames[1:])]

    def _ring_shut_down(self) -> bool:
        """Whether the writer shut the ring down after publishing everything in it. Reads
        the ring without waiting; chunks it takes are kept for the next dequeues, in order."""
        while len(self._peeked) < _MAX_PEEKED:
            with _NOGIL:
                got = self._ring.read(0.0)
            if got[0] != "ok":
                return got[0] == "shutdown"
            self._peeked.append(got)
        return False

    def _unpickle(self, frames):
        arena = self.arena
        try:
            if arena is None:
                return loads(frames[1], frames[2:])
            # This rank's reader, not whichever rank of the arena attached last here.
            with resolving_stubs(arena):
                return loads(frames[1], frames[2:])
        except BaseException:
            # Frame 0 lists the message's arena records: parsed only on this failure path.
            if arena is not None and len(frames[0]):
                for slot, gen in _parse_diverted(frames[0]):
                    arena.release_unacquired(slot, gen)
            raise

    # ------------------------------------------------------------------ both
    def broadcast_object(self, obj: Any = None) -> Any:
        """Writer: enqueue ``obj`` and return it. Reader: return the next message."""
        if self._is_writer:
            self.enqueue(obj)
            return obj
        return self.dequeue()

    def stats(self) -> dict:
        """Queue counters, plus the arena's (hits, bytes, declined{...}, per-reader holdings)
        when it has one, and on a writer asked for an arena the size it got under
        ``"arena_size"`` (arena_bytes, requested_bytes, sized_by, ...: ``sizing.ArenaSize``)."""
        out = dict(self._counters)
        out["role"] = (
            "writer"
            if self._is_writer
            else ("local_reader" if self._is_local_reader else "remote_reader")
        )
        if self._is_writer and self._ring is not None:
            out["dropped_readers"] = self._ring.dropped_readers()
            out["liveness_unknown"] = self._ring.liveness_unknown()
        if self.arena is not None:
            out["arena"] = self.arena.stats()
        size = getattr(self, "_arena_size", None)  # a writer that sized an arena
        if size is not None:
            out["arena_size"] = size.as_dict()
        return out

    def shutdown(self) -> None:
        """Stops the queue. A reader blocked in ``dequeue`` (in this process, or every reader
        when called on the writer) wakes and raises ``RuntimeError``.

        On the writer, every message an ``enqueue`` returned for is delivered first: queued
        socket frames get up to _DRAIN_S (5 s) to reach the readers, then the ring is shut
        down; readers see the shutdown only after the messages before it."""
        self._shutdown.set()
        if os.getpid() != self._pid:
            # A forked child's inherited copy: the ring, the sockets, the arena and their names
            # are the parent's; shutting them down here would stop the parent's queue.
            return
        self._close(_DRAIN_S if self._is_writer else 0.0)

    def _close(self, drain_s: float) -> None:
        """Releases what shutdown() releases, draining the writer's sockets for at most
        ``drain_s``; idempotent. Never in a forked child (see shutdown)."""
        if self._closed or os.getpid() != self._pid:
            return
        self._closed = True
        # A call of this end in another thread sees the shutdown flag within one wait slice and
        # returns; waiting for it (bounded) means the ring and sockets are not closed under it.
        side_locked = self._side_lock.acquire(timeout=10 * _WAIT_SLICE_S)
        try:
            self._close_locked(drain_s)
        finally:
            if side_locked:
                self._side_lock.release()

    def _close_locked(self, drain_s: float) -> None:
        self._res.remove_socket_dir()
        locked = self._io_lock.acquire(timeout=10 * _WAIT_SLICE_S)
        try:
            socks = [s for s in (self.local_socket, self.remote_socket) if s is not None]
            linger_ms = int(drain_s * 1000) if locked else 0
            for s in socks:
                if self._is_writer and linger_ms and not s.closed:
                    # Queued after every message sent: a reader waiting on the socket for an
                    # overflow message that never went out learns that none is coming.
                    try:
                        s.send(_SHUTDOWN_FRAME + self._token, zmq.NOBLOCK)
                    except zmq.ZMQError:
                        pass  # readers still see the ring's shutdown flag below
                s.close(linger=linger_ms)
            if self._monitor is not None:
                self._monitor.close(linger=0)
            # Returns once every frame queued on those sockets went out (to the kernel, which
            # then delivers it to the reader's ZeroMQ) or the linger ran out.
            self._ctx.term()
        finally:
            if locked:
                self._io_lock.release()
        # Only now: the ring's shutdown flag tells readers that nothing follows.
        if self._is_writer and self._ring is not None:
            self._ring.shutdown()
            # Idempotent; covers a queue shut down before wait_until_ready unlinked the name.
            self._ring.unlink()
        timer, self._report_timer = self._report_timer, None
        if timer is not None:
            timer.cancel()
        if self.arena is not None:
            if self._is_writer:
                metrics.record_writer_stats(self.arena.stats(), key=self.arena.name)  # totals
            # A reader's arena: stubs can no longer resolve to it; tensors handed out keep
            # their mapping (and pinning) alive on their own.
            self.arena.close()
        self._finalizer()  # everything is closed already; marks it done

    # ------------------------------------------------------------------ process groups
    @staticmethod
    def create_from_process_group(
        pg,
        max_chunk_bytes: int,
        max_chunks: int,
        writer_rank: int = 0,
        external_writer_handle: Handle | None = None,
        blocking: bool = True,
        *,
        enable_shm_tensor_arena: bool = False,
    ) -> MessageQueue:
        """Builds a queue over a process group: ``writer_rank`` writes, every other rank reads;
        readers on the writer's host use shared memory. ``pg`` is a ``torch.distributed``
        group (e.g. gloo) or anything with vLLM's ``StatelessProcessGroup`` interface
        (``rank``, ``world_size``, ``broadcast_obj``, ``all_gather_obj``). With
        ``external_writer_handle`` the writer rank joins that queue instead of creating one
        (vLLM's meaning); with ``blocking`` every rank waits until the queue is ready."""
        g = _Group(pg)
        hosts = g.all_gather(socket.gethostname())
        local = [r for r in range(g.world) if r != writer_rank and hosts[r] == hosts[writer_rank]]
        n_reader = g.world - 1
        if g.rank == writer_rank:
            if external_writer_handle is not None:
                mq = MessageQueue.create_from_handle(external_writer_handle, g.rank)
            else:
                mq = MessageQueue(
                    n_reader,
                    len(local),
                    local,
                    max_chunk_bytes=max_chunk_bytes,
                    max_chunks=max_chunks,
                    connect_ip=None if len(local) == n_reader else _local_ip(),
                    enable_shm_tensor_arena=enable_shm_tensor_arena,
                )
            g.broadcast(mq.export_handle(), writer_rank)
        else:
            mq = MessageQueue.create_from_handle(g.broadcast(None, writer_rank), g.rank)
        if blocking:
            mq.wait_until_ready()
        return mq

    @staticmethod
    def create_from_process_group_single_reader(
        pg,
        max_chunk_bytes: int,
        max_chunks: int,
        reader_rank: int = 0,
        blocking: bool = False,
    ) -> tuple[MessageQueue, list[Handle]]:
        """vLLM's many-writers-one-reader setup: every rank creates a queue with one reader
        (local when it shares ``reader_rank``'s host) and the handles are gathered to
        ``reader_rank``, which joins each with ``create_from_handle``. Returns this rank's
        queue and, on the reader rank, every rank's handle (empty elsewhere)."""
        g = _Group(pg)
        hosts = g.all_gather(socket.gethostname())
        same_node = hosts[g.rank] == hosts[reader_rank]
        mq = MessageQueue(
            n_reader=1,
            n_local_reader=1 if same_node else 0,
            max_chunk_bytes=max_chunk_bytes,
            max_chunks=max_chunks,
            connect_ip=None if same_node else _local_ip(),
        )
        handles = g.gather(mq.export_handle(), reader_rank)
        if blocking:
            mq.wait_until_ready()
        return mq, handles if g.rank == reader_rank else []


def _local_ip() -> str:
    """The address remote readers connect to when the caller gives none: VLLM_HOST_IP, else
    vLLM's own choice (``get_ip``) when vLLM is importable, else this host name's address."""
    ip = settings.host_ip()
    if ip:
        return ip
    try:
        from vllm.utils.network_utils import get_ip
    except Exception:
        get_ip = None
    if get_ip is not None:
        return get_ip()
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return "127.0.0.1"


class _Group:
    """One view of a torch.distributed group or a vLLM ``StatelessProcessGroup``."""

    def __init__(self, pg):
        self.pg = pg
        self.stateless = hasattr(pg, "broadcast_obj") and hasattr(pg, "world_size")
        if self.stateless:
            self.rank, self.world = int(pg.rank), int(pg.world_size)
        else:
            import torch.distributed as dist

            self.dist = dist
            self.rank = dist.get_rank(pg)
            self.world = dist.get_world_size(pg)
            self.ranks = dist.get_process_group_ranks(pg)

    def all_gather(self, obj) -> list:
        if self.stateless:
            return list(self.pg.all_gather_obj(obj))
        out = [None] * self.world
        self.dist.all_gather_object(out, obj, group=self.pg)
        return out

    def broadcast(self, obj, src: int):
        if self.stateless:
            return self.pg.broadcast_obj(obj, src)
        box = [obj]
        self.dist.broadcast_object_list(box, src=self.ranks[src], group=self.pg)
        return box[0]

    def gather(self, obj, dst: int) -> list:
        # all_gather: StatelessProcessGroup has no gather, and the handles are small.
        return self.all_gather(obj)
