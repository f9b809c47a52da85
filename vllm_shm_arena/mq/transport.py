"""The sockets beside the ring: ZeroMQ publish/subscribe between the writer and its readers.

::

    writer                                   readers
    local XPUB  ipc://<0700 dir>/s  ------>  SUB (+ a monitor of its connection)   node-local
                (overflow messages only; no cap: each is announced by a ring marker)
    remote XPUB tcp://<connect_ip>:<port> -> SUB                                    remote
                (every message; at most SOCKET_HWM queued per reader, then enqueue waits)

The handshake (``wait_until_ready``): each reader subscribes; the writer waits for exactly the
expected number of subscriptions per socket, removes the local socket's name (nobody else may
connect now; its directory stays, so the name is never free for another user), and sends
``READY``. Every later message on a socket starts with the handle's random token; the writer's
last frame is ``SHUTDOWN_FRAME`` + token. A reader takes nothing without the token: whatever
answers at the socket's address after the writer is gone is not the writer.

``WriterSockets`` and ``ReaderSocket`` own their context, sockets and ``io_lock`` (held while
a call uses a socket, so shutdown() from another thread does not close one under it: ZeroMQ
sockets are not thread-safe); they register them in the end's ``Resources``.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from collections.abc import Callable

import zmq

from vllm_shm_arena import settings
from vllm_shm_arena._ext import _C
from vllm_shm_arena.mq.lifecycle import WAIT_SLICE_S, Lifecycle
from vllm_shm_arena.mq.protocol import (
    READY_FRAME,
    SHUTDOWN_FRAME,
    connection_lost_error,
    writer_died,
)
from vllm_shm_arena.mq.reporting import RateLimitedLog

#: Most messages a remote reader's socket backlog holds before enqueue waits (and, with a
#: timeout, raises TimeoutError with nothing sent). The local socket needs no cap: it carries
#: only overflow messages, each announced by a ring marker, so the ring bounds its backlog.
SOCKET_HWM = 64
#: After a local reader's connection dropped, how long it still waits for frames the writer
#: sent before (ZeroMQ may report the drop before the last frames are readable).
LOST_GRACE_MS = 200
#: A reader waiting for an overflow message after the writer shut the ring down gives the
#: socket this long to deliver what the writer's drain already handed to the kernel.
SHUTDOWN_GRACE_S = 2.0


def local_ip() -> str:
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


def _poll(
    life: Lifecycle, sock, deadline: float | None, what: str, idle: Callable[[], None] | None
):
    """Waits until ``sock`` has a frame; ``RuntimeError`` once shut down, ``TimeoutError``
    past ``deadline``. ``idle`` runs after each empty wait slice (it raises to give up)."""
    while True:
        life.check_running()
        wait = WAIT_SLICE_S if deadline is None else min(WAIT_SLICE_S, deadline - time.monotonic())
        if wait <= 0:
            raise TimeoutError(f"timed out waiting for {what}")
        if sock.poll(int(wait * 1000)):
            return
        if idle is not None:
            idle()


class WriterSockets:
    """The writer's XPUB sockets: ``local`` (overflow messages to node-local readers) and
    ``remote`` (every message to remote readers); either may be None."""

    def __init__(self, life: Lifecycle, token: bytes, log: RateLimitedLog) -> None:
        self._life = life
        self.token = token
        self._log = log
        self.ctx = zmq.Context()
        life.resources.ctx = self.ctx
        self.io_lock = threading.RLock()
        self.local = None
        self.remote = None

    def _xpub(self, hwm: int):
        s = self.ctx.socket(zmq.XPUB)
        self._life.resources.sockets.append(s)
        s.setsockopt(zmq.XPUB_VERBOSE, 1)
        # Never drop a message for a slow subscriber: at the cap a send fails instead (EAGAIN
        # on a message's first frame), and enqueue waits.
        s.setsockopt(zmq.XPUB_NODROP, 1)
        s.setsockopt(zmq.SNDHWM, hwm)
        s.setsockopt(zmq.LINGER, 0)
        return s

    def bind_local(self, shm_dir: str) -> str:
        """The local socket, bound in a fresh 0700 directory inside ``shm_dir`` -> its
        address."""
        self.local = self._xpub(0)
        # A path, not an abstract socket (which any uid in the network namespace can reach),
        # in a fresh 0700 directory of fresh random name: the directory is the access check,
        # as ZeroMQ has no portable peer-credential check. It stays for the queue's life (only
        # the socket's name goes once the readers connected), so its name is never free for
        # another user to take, and its liveness token tells the stale-name cleaner it is in
        # use.
        res = self._life.resources
        res.socket_dir = _C.SocketDir(shm_dir)
        addr = f"ipc://{res.socket_dir.socket_path}"
        self.local.bind(addr)
        return addr

    def bind_remote(self, connect_ip: str) -> str:
        """The remote (TCP) socket on ``connect_ip``, a free port -> its address."""
        self.remote = self._xpub(SOCKET_HWM)
        port = self.remote.bind_to_random_port(f"tcp://{connect_ip}")
        return f"tcp://{connect_ip}:{port}"

    def await_subscribers(self, n_local: int, n_remote: int, deadline: float | None) -> None:
        """The writer's half of the handshake (see the module docstring)."""
        with self.io_lock:
            for sock, n in ((self.local, n_local), (self.remote, n_remote)):
                if sock is None:
                    continue
                for _ in range(n):
                    _poll(self._life, sock, deadline, "readers to subscribe", None)
                    sock.recv()
                res = self._life.resources
                if sock is self.local and res.socket_dir is not None:
                    # Every expected reader is connected: nobody else may connect now. The
                    # directory stays until shutdown, so its name never becomes free.
                    res.socket_dir.unlink_socket()
                if sock.poll(0):
                    raise RuntimeError(
                        f"more than the {n} expected readers subscribed to the queue "
                        "socket; refusing to start"
                    )
                sock.send(READY_FRAME)

    def send(self, sock, frames: list, deadline: float | None, sending, may_wait: bool) -> None:
        """Queues ``frames`` on ``sock`` as one message, copied (ZeroMQ owns the copy, so
        nothing aliases the caller's memory once this returns). Only the first frame can meet
        the backlog cap (``ZMQ_XPUB_NODROP``: a full subscriber makes the send fail, never
        drop); waiting for it honours ``deadline``, and nothing of the message has been sent
        then. ``may_wait=False``: a socket without a cap, which never waits. Records in
        ``sending.sent`` how many frames ``sock`` took."""
        with self.io_lock:
            self._life.check_running()  # the socket is closed (or about to be)
            n = len(frames)
            first = self.token + bytes(frames[0])  # the token, then the arena slots
            while True:
                try:
                    sock.send(first, (zmq.SNDMORE if n > 1 else 0) | zmq.NOBLOCK, copy=True)
                    break
                except zmq.Again:
                    if not may_wait:
                        raise
                self._life.time_left(deadline, "a remote reader's socket backlog to drain")
                self._log(
                    "socket_full",
                    logging.WARNING,
                    "a remote reader's socket backlog is at its cap (%d messages): it is not "
                    "reading; enqueue waits",
                    SOCKET_HWM,
                )
                time.sleep(0.001)
            sending.sent[id(sock)] = 1
            # The rest cannot fail for a full subscriber (that is decided on a message's first
            # frame) and is not interrupted by our own checks: a half-sent message would be
            # completed by the next message's frames.
            for i in range(1, n):
                sock.send(frames[i], zmq.SNDMORE if i + 1 < n else 0, copy=True)
                sending.sent[id(sock)] = i + 1

    def break_off(self) -> None:
        """Closes both sockets at once (ZeroMQ drops a half-sent message)."""
        for s in (self.local, self.remote):
            if s is not None:
                s.close(linger=0)

    def close(self, drain_s: float) -> None:
        """Queues the last frame on each socket, then closes them, giving queued frames up to
        ``drain_s`` to go out, and terminates the context (bounded waits throughout)."""
        self._life.resources.remove_socket_dir()
        locked = self.io_lock.acquire(timeout=10 * WAIT_SLICE_S)
        try:
            linger_ms = int(drain_s * 1000) if locked else 0
            for s in (self.local, self.remote):
                if s is None:
                    continue
                if linger_ms and not s.closed:
                    # Queued after every message sent: a reader waiting on the socket for an
                    # overflow message that never went out learns that none is coming.
                    try:
                        s.send(SHUTDOWN_FRAME + self.token, zmq.NOBLOCK)
                    except zmq.ZMQError:
                        pass  # readers still see the ring's shutdown flag
                s.close(linger=linger_ms)
            # Returns once every frame queued on those sockets went out (to the kernel, which
            # then delivers it to the reader's ZeroMQ) or the linger ran out.
            self.ctx.term()
        finally:
            if locked:
                self.io_lock.release()


class ReaderSocket:
    """A reader's SUB socket: connected to the writer's local socket (with a monitor of the
    connection) or to its remote one."""

    def __init__(self, life: Lifecycle, token: bytes, addr: str, local: bool) -> None:
        self._life = life
        self.token = token
        self.ctx = zmq.Context()
        life.resources.ctx = self.ctx
        self.io_lock = threading.RLock()
        self.monitor = None  # local: events of the connection to the writer's socket
        self.lost = False  # that connection dropped (it is never re-established)
        s = self.ctx.socket(zmq.SUB)
        life.resources.sockets.append(s)
        s.setsockopt(zmq.RCVHWM, 0)
        s.setsockopt(zmq.LINGER, 0)
        if local:
            # The socket's name is gone once every reader connected, so a dropped connection is
            # never re-established by the writer: it is an error (seen through this monitor)
            # once what came before is read. ZeroMQ still retries the name (disabling that,
            # ZMQ_RECONNECT_IVL=-1, makes it drop messages received but not yet read when the
            # writer closes); whatever answers there later is not the writer and its messages
            # fail the token check (recv).
            mon = s.get_monitor_socket(zmq.EVENT_DISCONNECTED)
            life.resources.sockets.append(mon)
            self.monitor = mon
        s.setsockopt_string(zmq.SUBSCRIBE, "")
        s.connect(addr)
        self.sock = s

    def connection_lost(self) -> bool:
        """Local readers: whether the connection to the writer's socket dropped (it is never
        re-established)."""
        mon = self.monitor
        if mon is None or not mon.poll(0):
            return False
        while mon.poll(0):
            mon.recv_multipart()
        self.lost = True
        return True

    def await_ready(self, deadline: float | None, writer_dead: Callable[[], bool]) -> None:
        """The reader's half of the handshake: the writer's ``READY``. ``writer_dead``: the
        ring's verdict on the writer (always False for a remote reader)."""
        sock = self.sock
        what = "the writer's READY"

        def idle() -> None:
            if writer_dead() and not sock.poll(0):
                raise writer_died(f"while waiting for {what}")
            if self.connection_lost() and not sock.poll(0):
                raise connection_lost_error()

        with self.io_lock:
            _poll(self._life, sock, deadline, what, idle)
            msg = sock.recv()
        if msg == SHUTDOWN_FRAME + self.token:
            raise RuntimeError("MessageQueue was shut down by the writer")
        if msg != READY_FRAME:
            raise RuntimeError(f"unexpected first message on the queue socket: {msg[:32]!r}")

    def recv(self, deadline: float | None, ring=None) -> list:
        """The next message's frames (frame 0 without the token). ``ring``: the local
        reader's ring watch (``writer_is_dead()``, ``shut_down()``) when the ring announced
        this message: if the writer shut down without sending it (its enqueue was interrupted,
        or a finalizer closed the socket), give up after SHUTDOWN_GRACE_S instead of waiting
        for good."""
        sock = self.sock
        writer_gone_at = None
        with self.io_lock:
            while True:
                self._life.check_running()
                now = time.monotonic()
                wait = WAIT_SLICE_S if deadline is None else min(WAIT_SLICE_S, deadline - now)
                if wait <= 0:
                    raise TimeoutError("timed out waiting for a message on the socket")
                if sock.poll(int(wait * 1000)):
                    break
                lost = self.lost or self.connection_lost()
                if ring is not None and ring.writer_is_dead():
                    if sock.poll(0):  # sent before it died: still delivered
                        break
                    raise writer_died("its ring announced a message it never sent")
                if ring is not None and writer_gone_at is None and ring.shut_down():
                    writer_gone_at = time.monotonic()
                if writer_gone_at is not None:
                    # The writer ended the ring: what it sent before comes within the grace.
                    if time.monotonic() - writer_gone_at > SHUTDOWN_GRACE_S:
                        raise RuntimeError(
                            "MessageQueue was shut down by the writer before it sent the "
                            "message its ring announced"
                        )
                elif lost:
                    # Never re-established: what the writer sent before it went is delivered
                    # first (ZeroMQ may report the drop before the last frames are readable).
                    if sock.poll(LOST_GRACE_MS):
                        break
                    raise connection_lost_error()
            # Zero-copy frames: each belongs to this reader for good, so tensors may alias them.
            frames = sock.recv_multipart(copy=False)
        token = self.token
        head = frames[0].buffer
        if len(frames) == 1 and head == SHUTDOWN_FRAME + token:
            raise RuntimeError("MessageQueue was shut down by the writer")
        if len(frames) < 2 or head[: len(token)] != token:
            # Not the writer's (it always sends the token, then the pickle): whoever answers at
            # the socket's address now. Nothing of it is unpickled.
            self.lost = True
            raise RuntimeError(
                "MessageQueue: a message on the queue's socket did not come from its writer "
                "(wrong token); nothing of it was used. Recreate the queue"
            )
        return [head[len(token) :], *(f.buffer for f in frames[1:])]

    def close(self) -> None:
        """Closes the socket and the monitor and terminates the context (bounded waits)."""
        locked = self.io_lock.acquire(timeout=10 * WAIT_SLICE_S)
        try:
            self.sock.close(linger=0)
            if self.monitor is not None:
                self.monitor.close(linger=0)
            self.ctx.term()
        finally:
            if locked:
                self.io_lock.release()
