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

from vllm_shm_arena import metrics, sizing
from vllm_shm_arena._ext import _C
from vllm_shm_arena.arena import _CURRENT_READER, ArenaHandle, ShmTensorArena
from vllm_shm_arena.pickler import Dumped, dump_message, dumps_inband, loads

logger = logging.getLogger("vllm_shm_arena")

#: How long a blocking wait sleeps in C++ before Python checks for shutdown/timeouts.
_WAIT_SLICE_S = 0.1
#: Frames at least this big are sent over ZeroMQ without a copy (and tracked until sent).
_ZERO_COPY_MIN = 64 << 10
#: A reader holding slots this long is reported as starving the arena.
_STARVING_AGE_S = 30.0
#: Warn about a long wait every this many seconds (vLLM's VLLM_RINGBUFFER_WARNING_INTERVAL).
_WAIT_WARN_S = float(os.environ.get("VLLM_RINGBUFFER_WARNING_INTERVAL", "60"))
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
#: The writer's last frame on every socket: no message follows. Never a real message, which
#: has at least two frames (header, pickle).
_SHUTDOWN_FRAME = b"VSA-SHUTDOWN"

#: Arena geometry of the queues this process creates (read once, at import).
#: "variable": one region of _ARENA_BYTES packing any tensor up to its size (the default);
#: "fixed": _ARENA_NUM_SLOTS slots of _ARENA_SLOT_BYTES (the design document's layout).
_ARENA_POLICY = os.environ.get("VLLM_SHM_ARENA_POLICY", "variable")
_ARENA_BYTES = int(os.environ.get("VLLM_SHM_ARENA_MB", "2048")) << 20
_ARENA_MAX_ALLOCATIONS = int(os.environ.get("VLLM_SHM_ARENA_MAX_ALLOCATIONS", "1024"))
_ARENA_NUM_SLOTS = int(os.environ.get("VLLM_SHM_ARENA_NUM_SLOTS", "8"))
_ARENA_SLOT_BYTES = int(os.environ.get("VLLM_SHM_ARENA_SLOT_MB", "256")) << 20


def _check_arena_policy() -> None:
    if _ARENA_POLICY not in ("variable", "fixed"):
        raise ValueError(
            f"VLLM_SHM_ARENA_POLICY must be 'variable' or 'fixed', got {_ARENA_POLICY!r}"
        )


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

    A daemon thread still inside such a call when Python finalizes is ended by CPython with
    ``pthread_exit`` as it takes the GIL back; the forced unwind runs into pybind11's
    ``noexcept`` ``~gil_scoped_release`` and the process aborts ("terminate called without
    an active exception"). The exit hook closes this gate, so no new call starts, and waits
    until no thread is inside one.
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
    tensor_arena_handle: ArenaHandle | None = None


class WriterDiedError(RuntimeError):
    """The queue's writer process is gone (the kernel released its liveness token): no more
    messages will come. Messages it published before dying were delivered first."""


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
        self.socket_dir: str | None = None  # the local socket's 0700 directory

    def remove_socket_dir(self) -> None:
        """Unlinks the local socket's path and its directory (idempotent): connected
        readers keep their connections, nobody can connect any more."""
        d, self.socket_dir = self.socket_dir, None
        if d is None:
            return
        for path, rm in ((os.path.join(d, "s"), os.unlink), (d, os.rmdir)):
            try:
                rm(path)
            except FileNotFoundError:
                pass

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
        try:
            local_addr = remote_addr = None
            if n_local_reader > 0:
                self._ring = _C.RingWriter(n_local_reader, max_chunks, max_chunk_bytes)
                self._res.ring_writer = self._ring
                _C.set_copy_readers(n_local_reader)  # the copy pool leaves the readers CPUs
                self.local_socket = self._xpub()
                # A path, not an abstract socket (which any uid in the network namespace can
                # reach): the fresh 0700 directory is the access check, as ZeroMQ has no
                # portable peer-credential check.
                # Named after the ring (vsa_sock_<the ring's 128 random bits>), so the stale-name
                # cleaner removes it together with a crashed writer's ring.
                sock_dir = os.path.join(
                    self._ring.dir, "vsa_sock_" + self._ring.name.removeprefix("vsa_ring_")
                )
                os.mkdir(sock_dir, 0o700)
                self._res.socket_dir = sock_dir
                local_addr = f"ipc://{self._res.socket_dir}/s"
                self.local_socket.bind(local_addr)
            if self.n_remote_reader > 0:
                self.remote_socket = self._xpub()
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
        self._pid = os.getpid()
        self._ctx = zmq.Context()
        self._res = _Resources(self._pid, self._ctx)
        self._finalizer = weakref.finalize(self, _Resources.release, self._res)
        # Not at exit on its own: the exit hook runs it after waking blocked threads.
        self._finalizer.atexit = False
        self._log = _RateLimitedLog()
        self._counters = {"messages": 0, "ring_messages": 0, "overflow_messages": 0, "bytes": 0}
        self._last_report = 0.0
        self._mismatches = 0
        self._liveness_logged: dict[str, int] = {}  # verdict counts already logged
        self._report_timer: threading.Timer | None = None  # a report owed (see _maybe_report)
        #: Ring reads taken ahead while waiting on the socket for an overflow message.
        self._peeked: deque = deque()
        _LIVE_QUEUES.add(self)

    def _xpub(self):
        s = self._ctx.socket(zmq.XPUB)
        self._res.sockets.append(s)
        s.setsockopt(zmq.XPUB_VERBOSE, 1)
        s.setsockopt(zmq.SNDHWM, 0)  # never drop a message for a slow subscriber
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
                self.local_socket = self._sub(handle.local_subscribe_addr)
            else:
                self._is_local_reader = False
                self._is_remote_reader = True
                self.local_reader_rank = -1
                self.remote_socket = self._sub(handle.remote_subscribe_addr)
        except BaseException:
            self._closed = True
            self._finalizer()  # half built: release now (see __init__)
            raise
        return self

    def _sub(self, addr: str):
        s = self._ctx.socket(zmq.SUB)
        self._res.sockets.append(s)
        s.setsockopt(zmq.RCVHWM, 0)
        s.setsockopt(zmq.LINGER, 0)
        s.setsockopt_string(zmq.SUBSCRIBE, "")
        s.connect(addr)
        return s

    def wait_until_ready(self, timeout: float | None = None) -> None:
        """Writer: waits for every reader to subscribe, then tells them to start. Readers:
        wait for that. Afterwards the shm names are unlinked, so nothing is left in
        ``/dev/shm`` even if every process is killed."""
        deadline = None if timeout is None else time.monotonic() + timeout
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
                    if sock is self.local_socket:
                        # Every expected reader is connected: nobody else may connect now.
                        self._res.remove_socket_dir()
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
                if msg == _SHUTDOWN_FRAME:
                    raise RuntimeError("MessageQueue was shut down by the writer")
                if msg != b"READY":
                    raise RuntimeError(
                        f"unexpected first message on the queue socket: {msg[:32]!r}"
                    )
        self._ready = True

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

    def _writer_is_dead(self) -> bool:
        """Local readers: the writer's liveness token in the ring is free (positive evidence;
        a probe the kernel cannot answer counts as alive). Remote readers cannot tell."""
        return self._ring is not None and self._ring.writer_liveness() == "dead"

    # ------------------------------------------------------------------ writer
    def enqueue(self, obj: Any, timeout: float | None = None) -> None:
        """Sends ``obj`` to every reader. Returns only when the caller may mutate or free
        everything it passed (nothing sent aliases the caller's memory any more)."""
        if not self._is_writer:
            raise RuntimeError("only the writer can enqueue")
        if self._shutdown.is_set():
            raise RuntimeError("MessageQueue was shut down")
        if self._broken:
            raise RuntimeError(f"MessageQueue is broken ({self._broken}); recreate it")
        deadline = None if timeout is None else time.monotonic() + timeout
        if self.serialize_inband:
            dumped = Dumped(dumps_inband(obj), [], [])
        else:
            with _NOGIL:  # the arena copy releases the GIL
                dumped = dump_message(obj, self.arena)
        frames = [_diverted_header(dumped.diverted), dumped.data, *dumped.buffers]
        try:
            self._send(frames, deadline)
        except BaseException:
            if self.arena is not None and dumped.diverted:
                # Nothing was published: readers never saw the stubs. A failure here must not
                # replace the error that stopped the send.
                try:
                    self.arena._abort(dumped.diverted)
                except Exception:
                    logger.exception("vllm_shm_arena: giving back a failed message's slots")
            raise
        self._counters["messages"] += 1
        self._maybe_report()

    def _send(self, frames: list, deadline: float | None) -> None:
        sizes = [memoryview(f).nbytes for f in frames]
        self._counters["bytes"] += sum(sizes)
        if self._ring is not None:
            fits = _C.RingWriter.packed_bytes(sizes) <= self.max_chunk_bytes
            while True:
                left = self._time_left(deadline, "a free ring chunk (readers are slow or stuck)")
                slice_s = _WAIT_SLICE_S if left is None else min(_WAIT_SLICE_S, left)
                with _NOGIL:
                    if fits:
                        status = self._ring.write(frames, 0, slice_s)
                    else:
                        status = (
                            "ok"
                            if self._ring.write_marker(_C.RING_FLAG_OVERFLOW, slice_s)
                            else "timeout"
                        )
                status = "overflow" if not fits and status == "ok" else status
                if status != "timeout":
                    break
            if status == "ok":
                self._counters["ring_messages"] += 1
            else:  # "overflow" or "no_space": the ring holds a marker, the socket the message
                if status == "no_space":
                    self._log(
                        "no_space_ring",
                        logging.WARNING,
                        "ring chunk could not be backed (/dev/shm full); "
                        "message sent over the socket",
                    )
                self._counters["overflow_messages"] += 1
                self._send_socket(self.local_socket, frames, deadline)
        if self.remote_socket is not None:
            self._send_socket(self.remote_socket, frames, deadline)

    def _send_socket(self, sock, frames: list, deadline: float | None) -> None:
        with self._io_lock:
            if self._shutdown.is_set():  # the socket is closed (or about to be)
                raise RuntimeError("MessageQueue was shut down")
            self._send_socket_locked(sock, frames, deadline)

    def _send_socket_locked(self, sock, frames: list, deadline: float | None) -> None:
        trackers = []
        for i, f in enumerate(frames):
            more = zmq.SNDMORE if i + 1 < len(frames) else 0
            if memoryview(f).nbytes >= _ZERO_COPY_MIN:
                # Zero-copy, tracked per frame (send_multipart's tracker covers only the last
                # frame): we wait below until ZeroMQ no longer reads the caller's memory.
                trackers.append(sock.send(f, more, copy=False, track=True))
            else:
                sock.send(f, more, copy=True)
        # Every frame is queued. Waiting for ZeroMQ to let go of the caller's memory still
        # honours the deadline whatever a subscriber does (one that stopped reading would hold
        # it for good): past it the queue breaks (see _break_after_send_timeout).
        started = time.monotonic()
        for t in trackers:
            while not t.done:
                self._time_left(None, "ZeroMQ to finish sending")
                if deadline is not None and time.monotonic() >= deadline:
                    self._break_after_send_timeout(sock, trackers)
                try:
                    t.wait(_WAIT_SLICE_S)
                except zmq.NotDone:
                    if time.monotonic() - started > _WAIT_WARN_S:
                        self._log(
                            "slow_send",
                            logging.WARNING,
                            "ZeroMQ has not finished sending a message for %.0f s "
                            "(a reader is not reading)",
                            time.monotonic() - started,
                        )

    def _break_after_send_timeout(self, sock, trackers) -> None:
        """A subscriber did not take a sent message in time. Some readers may have it, others
        never will: the queue cannot go on in order. Closes the socket (ZeroMQ drops its
        references to the caller's memory), waits for that, shuts the ring down (readers
        waiting for this message get a clear error instead of hanging) and raises; the
        caller's enqueue then gives the message's arena allocations back, which is safe only
        because a broken queue never writes again."""
        self._broken = "an enqueue timed out while a subscriber was not reading"
        sock.close(linger=0)
        end = time.monotonic() + 5.0
        for t in trackers:
            while not t.done and time.monotonic() < end:
                try:
                    t.wait(_WAIT_SLICE_S)
                except zmq.NotDone:
                    pass
        if self._ring is not None:
            self._ring.shutdown()
        raise TimeoutError(
            "timed out waiting for a subscriber to take the message (it is not reading); "
            "the MessageQueue is broken and must be recreated"
        )

    def _time_left(self, deadline, what):
        if self._shutdown.is_set():
            raise RuntimeError("MessageQueue was shut down")
        if deadline is None:
            return None
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError(f"timed out waiting for {what}")
        return left

    def empty(self, shape, dtype=None):
        """Writer: a tensor to fill in place that ``enqueue`` then sends without copying (a
        loan from the arena; see ``ShmTensorArena.empty`` for the rules). Without an arena, or
        when the arena cannot lend that much now, a plain ``torch.empty``."""
        import torch

        dtype = torch.float32 if dtype is None else dtype
        if not self._is_writer:
            raise RuntimeError("only the writer can lend tensors")
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
            t = threading.Timer(1.0 - (now - self._last_report), self._report_from_timer)
            t.daemon = True
            self._report_timer = t
            t.start()

    def _report_from_timer(self) -> None:
        self._report_timer = None
        # Threads do not survive fork, but a child could still call this by hand.
        if os.getpid() != self._pid or self._closed:
            return
        self._last_report = time.monotonic()
        try:
            self._report()
        except Exception:  # a report must never take the process down from a timer thread
            logger.debug("vllm_shm_arena: a timed stats report failed", exc_info=True)

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
            s = self.arena._require_writer().stats()
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
        """Receives the next message. Raises ``TimeoutError`` after ``timeout`` seconds and
        ``RuntimeError`` once the queue is shut down. ``indefinite`` silences the periodic
        "still waiting" log line."""
        if self._is_writer:
            raise RuntimeError("the writer cannot dequeue")
        arena = self.arena
        if arena is not None:
            if arena._may_gate:  # something was pinned: releases wait for their events
                with _NOGIL:
                    arena.flush_releases()
            self._maybe_report()
        deadline = None if timeout is None else time.monotonic() + timeout
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
                if self._peeked:
                    status, flags, frames = self._peeked.popleft()
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
            if flags & _C.RING_FLAG_OVERFLOW:
                frames = self._recv_socket(self.local_socket, deadline, watch_ring=True)
                self._counters["overflow_messages"] += 1
            else:
                self._counters["ring_messages"] += 1
        else:
            frames = self._recv_socket(self.remote_socket, deadline)
            arrived = time.perf_counter()
        self._counters["messages"] += 1
        obj = self._unpickle(frames)
        #: Seconds from the message's arrival (ring chunk seen) to the object in hand.
        self.last_dequeue_s = time.perf_counter() - arrived
        return obj

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
                if watch_ring and self._writer_is_dead():
                    if sock.poll(0):  # sent before it died: still delivered
                        break
                    raise _writer_died("its ring announced a message it never sent")
                if watch_ring and writer_gone_at is None and self._ring_shut_down():
                    writer_gone_at = time.monotonic()
                if writer_gone_at is not None:
                    if time.monotonic() - writer_gone_at > _SHUTDOWN_GRACE_S:
                        raise RuntimeError(
                            "MessageQueue was shut down by the writer before it sent the "
                            "message its ring announced"
                        )
            # Zero-copy frames: each belongs to this reader for good, so tensors may alias them.
            frames = sock.recv_multipart(copy=False)
        if len(frames) == 1 and frames[0].bytes == _SHUTDOWN_FRAME:
            raise RuntimeError("MessageQueue was shut down by the writer")
        return [f.buffer for f in frames]

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
            # This rank's reader, not whichever rank of the arena attached last here: stubs
            # resolve to the thread's current reader arena first (arena._lookup).
            prev = getattr(_CURRENT_READER, "arena", None)
            _CURRENT_READER.arena = arena
            try:
                return loads(frames[1], frames[2:])
            finally:
                _CURRENT_READER.arena = prev
        except BaseException:
            # Frame 0 lists the message's arena records: parsed only on this failure path.
            if arena is not None and len(frames[0]):
                for slot, gen in _parse_diverted(frames[0]):
                    arena._release_unacquired(slot, gen)
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
        if os.getpid() == self._pid:
            self._res.remove_socket_dir()
        # A call blocked on a socket in another thread sees the flag within one wait slice and
        # lets go of the lock; only then are the sockets closed.
        locked = self._io_lock.acquire(timeout=10 * _WAIT_SLICE_S)
        try:
            socks = [s for s in (self.local_socket, self.remote_socket) if s is not None]
            linger_ms = int(drain_s * 1000) if locked else 0
            for s in socks:
                if self._is_writer and linger_ms:
                    # Queued after every message sent: a reader waiting on the socket for an
                    # overflow message that never went out learns that none is coming.
                    try:
                        s.send(_SHUTDOWN_FRAME, zmq.NOBLOCK)
                    except zmq.ZMQError:
                        pass  # readers still see the ring's shutdown flag below
                s.close(linger=linger_ms)
            # Returns once every frame queued on those sockets went out (to the kernel, which
            # then delivers it to the reader's ZeroMQ) or the linger ran out.
            if os.getpid() == self._pid:
                self._ctx.term()
        finally:
            if locked:
                self._io_lock.release()
        # Only now: the ring's shutdown flag tells readers that nothing follows.
        if self._is_writer and self._ring is not None:
            self._ring.shutdown()
            # Idempotent; covers a queue shut down before wait_until_ready unlinked the name.
            self._ring.unlink()
        timer = self._report_timer
        if timer is not None:
            timer.cancel()
        if self.arena is not None and self._is_writer:
            metrics.record_writer_stats(self.arena.stats(), key=self.arena.name)  # final totals
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
    ip = os.environ.get("VLLM_HOST_IP")
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
