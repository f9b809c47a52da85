"""The sockets beside the ring: ZeroMQ publish/subscribe between the writer and its readers.

::

    writer                                   readers
    local XPUB  ipc://<0700 dir>/s  ------>  SUB (+ a monitor of its connection)   node-local
                (overflow messages only; no cap: each is announced by a ring marker)
    remote XPUB tcp://<connect_ip>:<port> -> SUB                                    remote
                (every message; at most SOCKET_HWM queued per reader, then enqueue waits)

The handshake (``wait_until_ready``): each reader subscribes; the writer waits for exactly the
expected number of subscriptions on the local socket and, on the remote one, for subscribers
whose hellos (protocol.py) declare every remote reader rank exactly once (``Roster``; a
duplicate, unknown rank, wrong token or version, or a subscriber declaring nothing is refused);
it removes the local socket's name (nobody else may
connect now; its directory stays, so the name is never free for another user), and sends
``READY``. Every later message on a socket starts with the handle's random token; the writer's
last frame is ``SHUTDOWN_FRAME`` + token. A reader takes nothing without the token: whatever
answers at the socket's address after the writer is gone is not the writer.

``WriterSockets`` and ``ReaderSocket`` own their context, sockets and ``io_lock`` (held while
a call uses a socket, so shutdown() from another thread does not close one under it: ZeroMQ
sockets are not thread-safe); they register them in the end's ``Resources``.

Every TCP socket sends keepalive probes (``tcp_keepalive``): a connection whose peer's kernel
stays silent for ``VLLM_SHM_ARENA_TCP_TIMEOUT_S`` (a partition, a host that vanished) is
dropped, which a remote reader sees as its writer's death. A slow reader is not silent: its
kernel answers the probes (and acknowledges data) however long the process does not read.

A remote reader's connection that drops is never resumed in order (a PUB socket does not
replay what a subscriber missed): the reader delivers what arrived, then raises
``WriterDiedError``. Its receive queue holds at most SOCKET_HWM messages, so a reader that does
not read makes the writer wait (ZeroMQ stops reading the TCP connection at the cap).
"""

from __future__ import annotations

import ipaddress
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
    HELLO_MAGIC,
    READY_FRAME,
    SHUTDOWN_FRAME,
    ShutDownByWriter,
    WriterDiedError,
    connection_lost_error,
    hello_topic,
    parse_hello,
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


def is_ipv6(address: str) -> bool:
    """Whether ``address`` is a bare IPv6 address (vLLM's ``is_valid_ipv6_address``)."""
    try:
        ipaddress.IPv6Address(address)
    except ValueError:
        return False
    return True


def remote_lost_error() -> WriterDiedError:
    """A remote reader's TCP connection to the writer dropped (for good: see the module
    docstring)."""
    return WriterDiedError(
        "MessageQueue: the TCP connection to the writer dropped (the writer process died or "
        "the network failed); messages sent before were delivered, no more will come"
    )


class Roster:
    """The reader ranks the remote socket's subscribers must declare, each exactly once:
    ``expected`` (a set), or, when None, any ``n`` distinct ranks not in ``local``."""

    def __init__(self, n: int, local=(), expected=None) -> None:
        self.n = n
        self.local = frozenset(local)
        self.expected = None if expected is None else frozenset(expected)
        self.declared: set[int] = set()
        self.hellos = 0
        self.plain = 0

    def add(self, ranks: list[int]) -> None:
        """A subscriber's declared ranks; ``RuntimeError`` naming what is wrong."""
        for r in ranks:
            if r in self.declared or ranks.count(r) > 1:
                raise RuntimeError(
                    f"refusing a subscriber of the queue socket: reader rank {r} was declared twice"
                )
            if r in self.local or (self.expected is not None and r not in self.expected):
                raise RuntimeError(
                    f"refusing a subscriber of the queue socket: it declared reader rank {r}, "
                    f"which is not a remote reader of this queue (remote: {self.describe()})"
                )
        self.declared.update(ranks)
        self.hellos += 1

    def complete(self) -> bool:
        """Every remote rank declared, and every declaring subscriber's receiving
        subscription in."""
        if self.expected is not None:
            covered = self.declared == self.expected
        else:
            covered = len(self.declared) == self.n
        return covered and self.plain >= self.hellos

    def describe(self) -> str:
        if self.expected is not None:
            return f"ranks {sorted(self.expected)}"
        return f"any {self.n} ranks not in {sorted(self.local)}"

    def missing(self) -> str:
        """For a timeout: who has not come."""
        if self.expected is not None:
            left = f"ranks {sorted(self.expected - self.declared)} undeclared"
        else:
            left = f"{self.n - len(self.declared)} of {self.n} ranks undeclared"
        if self.plain > self.hellos:
            left += f"; {self.plain - self.hellos} subscriber(s) declared no reader ranks"
        return left


def keepalive_options(timeout_s: int) -> list[tuple[int, int]]:
    """The ZeroMQ options that drop a TCP connection whose peer's kernel answers nothing for
    about ``timeout_s`` seconds: probes after ``timeout_s // 2`` idle, then every
    ``timeout_s // 12`` (at least 1 s) until the rest of ``timeout_s`` is spent. 0: keepalive
    on with the kernel's own times."""
    if timeout_s <= 0:
        return [(zmq.TCP_KEEPALIVE, 1)]
    idle = max(1, timeout_s // 2)
    interval = max(1, timeout_s // 12)
    count = max(1, (timeout_s - idle) // interval)
    return [
        (zmq.TCP_KEEPALIVE, 1),
        (zmq.TCP_KEEPALIVE_IDLE, idle),
        (zmq.TCP_KEEPALIVE_INTVL, interval),
        (zmq.TCP_KEEPALIVE_CNT, count),
    ]


def tcp_keepalive(sock) -> None:
    """Keepalive on ``sock``'s TCP connections (set before bind/connect)."""
    for opt, val in keepalive_options(settings.tcp_timeout_s()):
        sock.setsockopt(opt, val)


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
        self.remote_ipv6 = False

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
        """The remote (TCP) socket on ``connect_ip``, a free port -> its address. A bare IPv6
        address is bound as vLLM does: ``tcp://[addr]:port`` with ``zmq.IPV6`` set
        (``remote_ipv6`` then says so, for the handle)."""
        self.remote = self._xpub(SOCKET_HWM)
        tcp_keepalive(self.remote)
        self.remote_ipv6 = is_ipv6(connect_ip)
        if self.remote_ipv6:
            self.remote.setsockopt(zmq.IPV6, 1)
            connect_ip = f"[{connect_ip}]"
        port = self.remote.bind_to_random_port(f"tcp://{connect_ip}")
        return f"tcp://{connect_ip}:{port}"

    def _await_roster(self, roster: Roster, deadline: float | None) -> None:
        """Subscriptions on the remote socket until ``roster`` is complete."""
        sock = self.remote
        while not roster.complete():
            try:
                _poll(self._life, sock, deadline, "readers to subscribe", None)
            except TimeoutError as e:
                raise TimeoutError(f"{e} ({roster.missing()})") from None
            msg = sock.recv()
            if not msg or msg[0] != 1:
                continue  # an unsubscription (a subscriber went away): nothing declared
            topic = msg[1:]
            if topic == b"":
                roster.plain += 1
            elif topic.startswith(HELLO_MAGIC):
                try:
                    ranks = parse_hello(topic, self.token)
                except ValueError as e:
                    raise RuntimeError(f"refusing a subscriber of the queue socket: {e}") from None
                roster.add(ranks)
            else:
                raise RuntimeError(
                    "refusing a subscriber of the queue socket: unexpected subscription "
                    f"{topic[:32]!r}"
                )

    def await_subscribers(
        self, n_local: int, roster: Roster | None, deadline: float | None
    ) -> None:
        """The writer's half of the handshake (see the module docstring): ``n_local``
        subscriptions on the local socket, ``roster`` complete on the remote one."""
        with self.io_lock:
            for sock in (self.local, self.remote):
                if sock is None:
                    continue
                if sock is self.local:
                    n = n_local
                    for _ in range(n):
                        _poll(self._life, sock, deadline, "readers to subscribe", None)
                        sock.recv()
                else:
                    n = roster.n
                    self._await_roster(roster, deadline)
                res = self._life.resources
                if sock is self.local and res.socket_dir is not None:
                    # Every expected reader is connected: nobody else may connect now. The
                    # directory stays until shutdown, so its name never becomes free.
                    res.socket_dir.unlink_socket()
                if sock.poll(0):
                    extra = sock.recv()
                    why = " (one declared no reader ranks)" if extra == b"\x01" else ""
                    raise RuntimeError(
                        f"more than the {n} expected readers subscribed to the queue "
                        f"socket{why}; refusing to start"
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

    def __init__(
        self,
        life: Lifecycle,
        token: bytes,
        addr: str,
        local: bool,
        declare: list[int] | None = None,
        ipv6: bool = False,
    ) -> None:
        """``declare``: the reader ranks a remote subscriber covers (sent in its hello);
        ``ipv6``: the address is IPv6 (``Handle.remote_addr_ipv6``)."""
        self._life = life
        self.token = token
        self.ctx = zmq.Context()
        life.resources.ctx = self.ctx
        self.io_lock = threading.RLock()
        self.monitor = None  # events of the connection to the writer's socket
        self.lost = False  # that connection dropped (it is never re-established)
        self.lost_error = connection_lost_error if local else remote_lost_error
        s = self.ctx.socket(zmq.SUB)
        life.resources.sockets.append(s)
        # Remote: bounded, so a reader that does not read makes the writer wait (module
        # docstring). Local: the ring bounds the overflow messages.
        s.setsockopt(zmq.RCVHWM, 0 if local else SOCKET_HWM)
        s.setsockopt(zmq.LINGER, 0)
        if ipv6:
            s.setsockopt(zmq.IPV6, 1)
        if not local:
            tcp_keepalive(s)
        if local or declare is not None:
            # The socket's name is gone once every reader connected, so a dropped connection is
            # never re-established by the writer: it is an error (seen through this monitor)
            # once what came before is read. ZeroMQ still retries the name (disabling that,
            # ZMQ_RECONNECT_IVL=-1, makes it drop messages received but not yet read when the
            # writer closes); whatever answers there later is not the writer and its messages
            # fail the token check (recv).
            # A remote reader's dropped TCP connection is final the same way (module
            # docstring).
            mon = s.get_monitor_socket(zmq.EVENT_DISCONNECTED)
            life.resources.sockets.append(mon)
            self.monitor = mon
        s.setsockopt_string(zmq.SUBSCRIBE, "")
        if declare is not None:
            s.setsockopt(zmq.SUBSCRIBE, hello_topic(token, list(declare)))
        s.connect(addr)
        self.sock = s

    def connection_lost(self) -> bool:
        """Whether the connection to the writer's socket dropped (it is never
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
                raise self.lost_error()

        with self.io_lock:
            _poll(self._life, sock, deadline, what, idle)
            msg = sock.recv()
        if msg == SHUTDOWN_FRAME + self.token:
            raise ShutDownByWriter("MessageQueue was shut down by the writer")
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
                    raise self.lost_error()
            # Zero-copy frames: each belongs to this reader for good, so tensors may alias them.
            frames = sock.recv_multipart(copy=False)
        token = self.token
        head = frames[0].buffer
        if len(frames) == 1 and head == SHUTDOWN_FRAME + token:
            raise ShutDownByWriter("MessageQueue was shut down by the writer")
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
