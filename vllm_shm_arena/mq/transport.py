"""The sockets beside the ring: ZeroMQ publish/subscribe between the writer and its readers.

::

    writer                                   readers
    local XPUB  ipc://<0700 dir>/s  ------>  SUB (+ a monitor of its connection)   node-local
                (overflow messages only; no cap: each is announced by a ring marker)
    remote XPUB tcp://<connect_ip>:<port> -> SUB (+ a monitor)                      remote
                (every message; at most SOCKET_HWM queued per reader, then enqueue waits)
                ZAP handler (a thread of the writer): who may connect

Whom each end trusts, and why:

* The writer's TCP socket admits only its readers: admission.py (ZAP, per-principal
  credentials derived from the handle's secret, one connection per principal; strangers are
  refused at the handshake and never counted, sent anything or waited for).
* The local socket is bound in a fresh 0700 directory in the shm directory: only this uid can
  connect while its name exists. Once every local reader is in, the socket's name and the
  directory go, so a SIGKILL leaves nothing behind; the name is then free for anyone, which is
  why readers trust no socket frame on its address alone:
* Readers trust only frames their writer sealed (protocol.py: a MAC keyed by a handle secret
  that travels on no connection, over the frame and its sequence number), checked before
  anything is unpickled. PLAIN authenticates the client only, so whatever answers at a freed
  port receives a reader's password and is believed by ZeroMQ; it still cannot seal a frame.
  The encrypted setting (CurveZMQ) authenticates the writer too and hides the traffic.
* The handle is the credential. It travels through the caller's control plane (vLLM: a gloo
  broadcast, a TCP store): whoever reads that plane can join; reaching the queue's port is not
  enough.

The handshake (``wait_until_ready``): each reader subscribes; the writer waits for exactly the
expected number of subscriptions on the local socket and, on the remote one, for authenticated
subscribers whose hellos (protocol.py) declare every remote reader rank exactly once
(admission.py's ``Roster``); it removes the local socket's directory, and sends ``READY``.
The writer's last frame is ``SHUTDOWN`` with the last sequence number it sent.

``WriterSockets`` and ``ReaderSocket`` own their context, sockets and ``io_lock`` (held while
a call uses a socket, so shutdown() or the ZAP handler in another thread does not use one under
it: ZeroMQ sockets are not thread-safe); they register them in the end's ``Resources``.

Every TCP socket sends keepalive probes (``tcp_keepalive``): a connection whose peer's kernel
stays silent for ``VLLM_SHM_ARENA_TCP_TIMEOUT_S`` (a partition, a host that vanished) is
dropped. A slow reader is not silent: its kernel answers the probes (and acknowledges data)
however long the process does not read.

A remote reader whose connection dropped is resumed if ZeroMQ re-establishes it within
``RESUME_GRACE_S`` (the writer admits the principal again once its old connection is gone);
its next message must then be the next in sequence (a publisher drops what it sends while a
subscriber is away, so a drop that overlapped a send is an error, never a silent loss). A
connection not re-established in time is the writer's death for that reader (after what
arrived before). Its receive queue holds at most SOCKET_HWM messages, so a reader that does not
read makes the writer wait (ZeroMQ stops reading the TCP connection at the cap).
"""

from __future__ import annotations

import ipaddress
import itertools
import logging
import socket
import threading
import time
from collections.abc import Callable

import zmq
from zmq.utils.monitor import parse_monitor_message

from vllm_shm_arena import settings
from vllm_shm_arena._ext import _C
from vllm_shm_arena.mq.admission import (
    HANDSHAKE_IVL_MS,
    LOCAL_DOMAIN,
    REMOTE_DOMAIN,
    Admission,
    Roster,
    ZapHandler,
    drain_subscriptions,
)
from vllm_shm_arena.mq.lifecycle import WAIT_SLICE_S, Lifecycle
from vllm_shm_arena.mq.protocol import (
    HELLO_MAX_BYTES,
    SOCKET_PART_BYTES,
    SOCKET_SPLIT_ABOVE,
    Forged,
    Keys,
    ShutDownByWriter,
    WriterDiedError,
    connection_lost_error,
    control_frame,
    hello_topic,
    ready_frame,
    shutdown_frame,
    unseal,
    writer_died,
)
from vllm_shm_arena.mq.reporting import RateLimitedLog

logger = logging.getLogger("vllm_shm_arena")

#: Most messages a remote reader's socket backlog holds before enqueue waits (and, with a
#: timeout, raises TimeoutError with nothing sent). The local socket needs no cap: it carries
#: only overflow messages, each announced by a ring marker, so the ring bounds its backlog.
SOCKET_HWM = 64
#: After a local reader's connection dropped, how long it still waits for frames the writer
#: sent before (ZeroMQ may report the drop before the last frames are readable).
LOST_GRACE_MS = 200
#: How long a remote reader whose connection dropped waits for ZeroMQ to re-establish it
#: (it retries every 100 ms) before it takes the drop for its writer's death.
RESUME_GRACE_S = 1.0
#: A reader waiting for an overflow message after the writer shut the ring down gives the
#: socket this long to deliver what the writer's drain already handed to the kernel.
SHUTDOWN_GRACE_S = 2.0
#: A message's frames sent and received through libzmq itself (csrc/bindings/call_safety.cpp:
#: pyzmq's calls run signal handlers after each frame, hiding whether it went or came).
_send_frames = _C.send_frames
_recv_frames = _C.recv_frames
#: Frames from this size on may be the heap anchor (``ReaderSocket.open``).
_ANCHOR_MIN_BYTES = 1 << 20


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
    """A remote reader's TCP connection to the writer dropped and was not re-established."""
    return WriterDiedError(
        "MessageQueue: the TCP connection to the writer dropped and was not re-established "
        f"within {RESUME_GRACE_S:g} s (the writer process died or the network failed); "
        "messages sent before were delivered, no more will come"
    )


def keepalive_options(timeout_s: int) -> list[tuple[int, int]]:
    """The ZeroMQ options that drop a TCP connection whose peer's kernel answers nothing for
    about ``timeout_s`` seconds: probes after ``timeout_s // 2`` idle, then every
    ``timeout_s // 12`` (at least 1 s) until the rest of ``timeout_s`` is spent. 0: keepalive
    on with the kernel's own times. ``timeout_s`` is at most settings.MAX_TCP_TIMEOUT_S (the
    kernel's limit on the idle time)."""
    if timeout_s <= 0:
        return [(zmq.TCP_KEEPALIVE, 1)]
    if timeout_s > settings.MAX_TCP_TIMEOUT_S:
        raise ValueError(
            f"a TCP timeout of {timeout_s} s is more than the kernel's keepalive allows "
            f"({settings.MAX_TCP_TIMEOUT_S} s)"
        )
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


#: Whether writers keep their I/O thread off the sending thread's CPU (``WriterSockets``);
#: benchmarks/bench_remote_publish.py compares both.
PLACE_IO_THREADS = True
#: Messages from this size on are sent with the I/O thread placed: below it the thread's work
#: is too short for a preemption to matter, and placing costs two system calls.
PLACED_SEND_BYTES = 1 << 20
#: Numbers for the names of each writer context's threads (``WriterSockets``).
_THREAD_PREFIXES = itertools.count()


class WriterSockets:
    """The writer's XPUB sockets: ``local`` (overflow messages to node-local readers) and
    ``remote`` (every message to remote readers, behind the ZAP handler); either may be
    None."""

    def __init__(self, life: Lifecycle, keys: Keys, log: RateLimitedLog) -> None:
        self._life = life
        self.keys = keys
        self._log = log
        self.ctx = zmq.Context()
        life.resources.ctx = self.ctx
        # This context's threads get names of their own ("<n>/ZMQbg/IO/0"): the handshake
        # finds its I/O thread by name for ``placement``.
        self.thread_prefix = next(_THREAD_PREFIXES) % 9999 + 1
        try:
            self.ctx.set(zmq.THREAD_NAME_PREFIX, self.thread_prefix)
        except (AttributeError, zmq.ZMQError):
            self.thread_prefix = None  # a libzmq without the option: no placement
        # Keeps the I/O thread off the sending thread's CPU while a large send wakes it
        # (core/thread_placement.h: it would otherwise preempt the sender where no CPU is
        # idle); set once the handshake is done, when the thread has long been running and
        # named.
        self.placement = None
        self.io_lock = threading.RLock()
        self.local = None
        self.remote = None
        self.remote_ipv6 = False
        self.admission: Admission | None = None
        self.zap: ZapHandler | None = None

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
        self.local.setsockopt(zmq.ZAP_DOMAIN, LOCAL_DOMAIN)
        # A path, not an abstract socket (which any uid in the network namespace can reach),
        # in a fresh 0700 directory of fresh random name: the directory is the access check
        # while readers connect, as ZeroMQ has no portable peer-credential check. Its liveness
        # token tells the stale-name cleaner it is in use; it goes after the handshake.
        res = self._life.resources
        res.socket_dir = _C.SocketDir(shm_dir)
        addr = f"ipc://{res.socket_dir.socket_path}"
        self.local.bind(addr)
        return addr

    def bind_remote(self, connect_ip: str, roster: Roster, security: str) -> str:
        """The remote (TCP) socket on ``connect_ip``, a free port, behind the ZAP handler ->
        its address. A bare IPv6 address is bound as vLLM does: ``tcp://[addr]:port`` with
        ``zmq.IPV6`` set (``remote_ipv6`` then says so, for the handle)."""
        self.remote = s = self._xpub(SOCKET_HWM)
        # Every unsubscription too, including those of a connection that ended (Admission).
        s.setsockopt(zmq.XPUB_VERBOSER, 1)
        s.setsockopt(zmq.MAXMSGSIZE, HELLO_MAX_BYTES)
        s.setsockopt(zmq.HANDSHAKE_IVL, HANDSHAKE_IVL_MS)
        s.setsockopt(zmq.ZAP_DOMAIN, REMOTE_DOMAIN)
        if security == "encrypted":
            s.setsockopt(zmq.CURVE_SERVER, 1)
            s.setsockopt(zmq.CURVE_SECRETKEY, self.keys.curve_server()[1])
        else:
            s.setsockopt(zmq.PLAIN_SERVER, 1)
        tcp_keepalive(s)
        self.admission = Admission(roster, self._log)
        self.zap = ZapHandler(self.ctx, self.keys, security, self.admission, s, self.io_lock)
        self.remote_ipv6 = is_ipv6(connect_ip)
        if self.remote_ipv6:
            s.setsockopt(zmq.IPV6, 1)
            connect_ip = f"[{connect_ip}]"
        port = s.bind_to_random_port(f"tcp://{connect_ip}")
        return f"tcp://{connect_ip}:{port}"

    def refused(self) -> int:
        """Peers of the TCP socket refused so far (credentials, a second connection, a bad
        hello or subscription)."""
        return 0 if self.admission is None else self.admission.refused

    def _await_roster(self, deadline: float | None) -> None:
        """Subscriptions on the remote socket until the roster is complete."""
        sock, admission = self.remote, self.admission
        while not admission.roster.complete():
            try:
                _poll(self._life, sock, deadline, "readers to subscribe", None)
            except TimeoutError as e:
                why = admission.last_refusal
                last = f"; last refusal: {why}" if why else ""
                raise TimeoutError(f"{e} ({admission.roster.missing()}{last})") from None
            drain_subscriptions(sock, admission)

    def await_subscribers(self, n_local: int, deadline: float | None) -> None:
        """The writer's half of the handshake (see the module docstring): ``n_local``
        subscriptions on the local socket, the roster complete on the remote one."""
        with self.io_lock:
            if self.local is not None:
                sock = self.local
                for _ in range(n_local):
                    _poll(self._life, sock, deadline, "readers to subscribe", None)
                    sock.recv()
                # Every expected reader is connected: the socket's name and directory go (a
                # SIGKILL now leaves nothing; whoever takes the name later cannot seal a frame).
                self._life.resources.remove_socket_dir()
                if sock.poll(0):
                    raise RuntimeError(
                        f"more than the {n_local} expected readers subscribed to the queue's "
                        "local socket; refusing to start"
                    )
                sock.send(ready_frame(self.keys.mac_key))
            if self.remote is not None:
                self._await_roster(deadline)
                self.remote.send(ready_frame(self.keys.mac_key))
            if PLACE_IO_THREADS and self.thread_prefix is not None and self.placement is None:
                io_threads = _C.find_threads(f"{self.thread_prefix}/ZMQbg/IO/")
                self.placement = _C.ThreadPlacement(io_threads)

    def read_subscriptions(self) -> None:
        """Reads what the remote socket's subscribers sent (connections that ended or came
        back); cheap when there is nothing. Call with ``io_lock`` held."""
        if self.remote is not None:
            drain_subscriptions(self.remote, self.admission)

    def send(
        self, sock, frames: list, deadline: float | None, sending, may_wait: bool, nbytes: int = 0
    ) -> None:
        """Queues ``frames`` (frame 0 sealed) on ``sock`` as one message, copied (ZeroMQ owns
        the copy, so nothing aliases the caller's memory once this returns). Only the first
        frame can meet the backlog cap (``ZMQ_XPUB_NODROP``: a full subscriber makes the send
        fail, never drop); waiting for it honours ``deadline``, and nothing of the message has
        been sent then. ``may_wait=False``: a socket without a cap, which never waits.
        ``nbytes``: the message's size; from ``PLACED_SEND_BYTES`` on, the I/O thread the send
        wakes is kept off this thread's CPU while it wakes (``placement``).

        ``sending.sent[id(sock)]`` is a one-item list registered before the first frame goes:
        the count of frames ``sock`` took, updated in the C call that sends them
        (``_C.send_frames``), so that whatever exception ends this call, it says exactly how
        much of the message went."""
        progress = [0]
        sending.sent[id(sock)] = progress
        with self.io_lock:
            self._life.check_running()  # the socket is closed (or about to be)
            if sock is self.remote:
                self.read_subscriptions()
            placement = self.placement if nbytes >= PLACED_SEND_BYTES else None
            while True:
                try:
                    try:
                        if placement is not None:
                            placement.keep_off_caller()
                        _send_frames(
                            sock.underlying,
                            frames,
                            zmq.NOBLOCK,
                            zmq.SNDMORE,
                            progress,
                            SOCKET_PART_BYTES,
                            SOCKET_SPLIT_ABOVE,
                        )
                    finally:
                        if placement is not None:
                            placement.release()
                    return
                except zmq.Again:
                    if progress[0] or not may_wait:
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
                self.read_subscriptions()

    def break_off(self) -> None:
        """Closes both sockets at once (ZeroMQ drops a half-sent message)."""
        for s in (self.local, self.remote):
            if s is not None:
                s.close(linger=0)

    def close(self, drain_s: float, last_seq: int) -> None:
        """Queues the last frame (``last_seq``: the last message sent) on each socket, then
        closes them, giving queued frames up to ``drain_s`` to go out, and terminates the
        context (bounded waits throughout; the ZAP handler ends with it)."""
        self._life.resources.remove_socket_dir()
        locked = self.io_lock.acquire(timeout=10 * WAIT_SLICE_S)
        try:
            linger_ms = int(drain_s * 1000) if locked else 0
            last = shutdown_frame(self.keys.mac_key, last_seq)
            for s in (self.local, self.remote):
                if s is None:
                    continue
                if linger_ms and not s.closed:
                    # Queued after every message sent: a reader waiting on the socket for an
                    # overflow message that never went out learns that none is coming.
                    try:
                        s.send(last, zmq.NOBLOCK)
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
    """A reader's SUB socket: connected to the writer's local socket or to its remote one
    (with the principal's credentials), with a monitor of the connection."""

    def __init__(
        self,
        life: Lifecycle,
        keys: Keys,
        addr: str,
        local: bool,
        declare: list[int] | None = None,
        ipv6: bool = False,
        security: str = "authenticated",
    ) -> None:
        """``declare``: the reader ranks a remote subscriber covers, its own (the principal it
        authenticates as) first, sent in its hello; ``ipv6``: the address is IPv6
        (``Handle.remote_addr_ipv6``); ``security``: ``Handle.tcp_security``."""
        self._life = life
        self.keys = keys
        self.mac_key = keys.mac_key
        self.local = local
        self.ctx = zmq.Context()
        life.resources.ctx = self.ctx
        self.io_lock = threading.RLock()
        self.lost = False  # a local connection dropped (it is never re-established)
        self._anchor = None  # the last message's last large frame (see open)
        self.down_since: float | None = None  # a remote connection dropped at (monotonic)
        s = self.ctx.socket(zmq.SUB)
        life.resources.sockets.append(s)
        # Remote: bounded, so a reader that does not read makes the writer wait (module
        # docstring). Local: the ring bounds the overflow messages.
        s.setsockopt(zmq.RCVHWM, 0 if local else SOCKET_HWM)
        s.setsockopt(zmq.LINGER, 0)
        if ipv6:
            s.setsockopt(zmq.IPV6, 1)
        if not local:
            principal = list(declare)[0]
            tcp_keepalive(s)
            if security == "encrypted":
                s.setsockopt(zmq.CURVE_SERVERKEY, keys.curve_server()[0])
                public, secret = keys.curve_client(principal)
                s.setsockopt(zmq.CURVE_PUBLICKEY, public)
                s.setsockopt(zmq.CURVE_SECRETKEY, secret)
            elif security == "authenticated":
                user = str(principal).encode()
                s.setsockopt(zmq.PLAIN_USERNAME, user)
                s.setsockopt(zmq.PLAIN_PASSWORD, keys.plain_password(user))
            else:
                raise ValueError(
                    f"the queue handle asks for TCP security {security!r}, which this version "
                    "of vllm_shm_arena does not know"
                )
        # The connection's drops (and, remote, its re-establishment): a local one is never
        # re-established by the writer (its socket's name is gone), a remote one may be
        # (module docstring). ZeroMQ still retries the local name (disabling that,
        # ZMQ_RECONNECT_IVL=-1, makes it drop messages received but not yet read when the
        # writer closes); whatever answers there later cannot seal a frame.
        events = zmq.EVENT_DISCONNECTED
        if not local:
            events |= zmq.EVENT_HANDSHAKE_SUCCEEDED
        mon = s.get_monitor_socket(events)
        life.resources.sockets.append(mon)
        self.monitor = mon
        s.setsockopt_string(zmq.SUBSCRIBE, "")
        if declare is not None:
            s.setsockopt(zmq.SUBSCRIBE, hello_topic(list(declare)))
        s.connect(addr)
        self.sock = s

    def _watch(self) -> None:
        """Reads the monitor's news of the connection."""
        mon = self.monitor
        while mon.poll(0):
            event = parse_monitor_message(mon.recv_multipart())["event"]
            if event == zmq.EVENT_DISCONNECTED:
                if self.local:
                    self.lost = True
                elif self.down_since is None:
                    self.down_since = time.monotonic()
            elif event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                self.down_since = None

    def _check_connection(self) -> None:
        """After an empty wait: a dropped connection not re-established in time is final,
        once what arrived before is read."""
        self._watch()
        if self.lost:
            # Never re-established: what the writer sent before it went is delivered first
            # (ZeroMQ may report the drop before the last frames are readable).
            if not self.sock.poll(LOST_GRACE_MS):
                raise connection_lost_error()
        elif self.down_since is not None:
            if time.monotonic() - self.down_since > RESUME_GRACE_S and not self.sock.poll(0):
                raise remote_lost_error()

    def await_ready(self, deadline: float | None, writer_dead: Callable[[], bool]) -> None:
        """The reader's half of the handshake: the writer's sealed ``READY``. ``writer_dead``:
        the ring's verdict on the writer (always False for a remote reader)."""
        sock = self.sock
        what = "the writer's READY"

        def idle() -> None:
            if writer_dead() and not sock.poll(0):
                raise writer_died(f"while waiting for {what}")
            self._check_connection()

        with self.io_lock:
            _poll(self._life, sock, deadline, what, idle)
            frames = sock.recv_multipart()
        if len(frames) != 1:
            raise Forged("a first message")
        kind, _ = control_frame(self.mac_key, frames[0])
        if kind == "shutdown":
            raise ShutDownByWriter("MessageQueue was shut down by the writer")

    def receive(self, deadline: float | None, store, ring=None) -> None:
        """Waits for the next message on the socket and takes it whole through ``store``
        (``lambda f, args: _C.call_store(entry, key, f, args)`` or ``_C.call_append``): the
        list of its frames reaches the caller's state in the C call that received it, so no
        exception can fall between. ``ring``: the local reader's ring watch
        (``writer_is_dead()``, ``shut_down()``) when the ring announced this message: if the
        writer shut down without sending it (its enqueue was interrupted, or a finalizer
        closed the socket), give up after SHUTDOWN_GRACE_S instead of waiting for good."""
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
                    continue
                if self.lost or self.down_since is not None or self.monitor.poll(0):
                    self._check_connection()
                    if sock.poll(0):
                        break
            # Zero-copy frames: each belongs to this reader for good, so tensors may alias them.
            store(_recv_frames, (sock.underlying, zmq.NOBLOCK))

    def open(self, frames: list) -> tuple[int, list]:
        """A received message's frames -> (its sequence number, its frames as the writer had
        them: frame 0's sealed head removed, split buffers joined), checked to come from the
        writer (``Forged`` otherwise: nothing of it is used). The writer's last frame raises
        ``ShutDownByWriter`` (``.last_seq``: the last message it sent)."""
        if len(frames) == 1:
            kind, last = control_frame(self.mac_key, frames[0].buffer)
            if kind == "shutdown":
                e = ShutDownByWriter("MessageQueue was shut down by the writer")
                e.last_seq = last
                raise e
            raise Forged("a second READY")
        out = unseal(self.mac_key, [f.buffer for f in frames])
        # The heap anchor: ZeroMQ's I/O thread allocates each received frame from its malloc
        # arena (frames up to 32 MiB: larger ones are split, protocol.py), and once a
        # message's frames are all freed glibc unmaps the heaps they emptied, from the newest
        # down, so the next message faults its pages in again. Keeping the last large frame
        # until the next message is opened keeps the newest heap in use, and the ones below
        # it stay mapped for the next message's frames: measured on 25 x 16 MiB, ~90,000 page
        # faults per message -> ~10,000 (median), 200 MiB in parts 51,200 -> ~4,000.
        for f in reversed(frames):
            if _ANCHOR_MIN_BYTES <= len(f) <= SOCKET_SPLIT_ABOVE:
                self._anchor = f
                break
        return out

    def close(self) -> None:
        """Closes the socket and the monitor and terminates the context (bounded waits)."""
        self._anchor = None
        locked = self.io_lock.acquire(timeout=10 * WAIT_SLICE_S)
        try:
            self.sock.close(linger=0)
            self.monitor.close(linger=0)
            self.ctx.term()
        finally:
            if locked:
                self.io_lock.release()
