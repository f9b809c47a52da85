"""Who may connect to a writer's TCP socket, and who is connected: the writer's side of the
trust the queue's sockets need (transport.py says the rest).

The writer's TCP socket admits only its readers. ZeroMQ's ZAP asks the writer's handler thread
(``ZapHandler``) about every connection before a byte of a message flows: the peer must
present the PLAIN credentials (or, encrypted, the CurveZMQ key) of one reader principal (a
remote reader's rank, or a relay's own rank), derived from the handle's secret
(protocol.Keys), and each principal is admitted for one connection at a time (``Admission``).
A stranger is refused at the handshake: it never has a pipe in the XPUB, so it is never
counted, never sent anything and never waited for. Refusals are counted
(``stats()["tcp_refused"]``) and logged with the peer's address, rate-limited. Before
authentication a peer can send at most ``ZMQ_MAXMSGSIZE`` bytes per message (the largest hello)
and must finish its handshake within ``HANDSHAKE_IVL_MS``.

The authenticated subscribers then declare the reader ranks they cover (``Roster``, from their
hellos); a bad declaration is refused and logged, never ending the start-up for the others.
"""

from __future__ import annotations

import hmac
import logging
import os
import socket
import threading
import time

import zmq
from zmq.utils.monitor import parse_monitor_message

from vllm_shm_arena.mq.protocol import HELLO_MAGIC, Keys, parse_hello
from vllm_shm_arena.mq.reporting import RateLimitedLog

logger = logging.getLogger("vllm_shm_arena")

#: ZAP's endpoint in a context (ZeroMQ's fixed name) and the domain of the queue's sockets.
ZAP_ENDPOINT = "inproc://zeromq.zap.01"
REMOTE_DOMAIN = b"vllm_shm_arena.remote"
LOCAL_DOMAIN = b"vllm_shm_arena.local"
#: A peer of the writer's TCP socket must finish its ZMTP handshake (authentication included)
#: this soon, or it is dropped.
HANDSHAKE_IVL_MS = 10_000
#: A principal ZAP admitted whose hello has not come this long is admitted again (its first
#: connection never finished the handshake).
ADMIT_TIMEOUT_S = HANDSHAKE_IVL_MS / 1000 + 5.0
#: How long the ZAP handler waits for the writer's socket to read its subscriptions (to learn
#: that a principal's old connection is gone) before it refuses a second connection.
ZAP_DRAIN_WAIT_S = 0.05


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

    def check(self, ranks: list[int]) -> None:
        """``ValueError`` naming what is wrong with a subscriber declaring ``ranks``."""
        for r in ranks:
            if r in self.declared or ranks.count(r) > 1:
                raise ValueError(f"reader rank {r} was declared twice")
            if r in self.local or (self.expected is not None and r not in self.expected):
                raise ValueError(
                    f"it declared reader rank {r}, which is not a remote reader of this queue "
                    f"(remote: {self.describe()})"
                )
        if self.expected is None and len(self.declared) + len(ranks) > self.n:
            raise ValueError(f"it declared more than the {self.n} remote reader ranks")

    def add(self, ranks: list[int]) -> None:
        self.declared.update(ranks)
        self.hellos += 1

    def remove(self, ranks: list[int]) -> None:
        """A declaring subscriber's connection is gone: its ranks may be declared again."""
        self.declared.difference_update(ranks)
        self.hellos -= 1

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


def _user_id(frame) -> int | None:
    """The principal ZAP admitted for the connection a subscription came from, or None (a
    subscription the socket made up when a connection ended carries none)."""
    try:
        uid = frame.get("User-Id")
    except zmq.ZMQError:
        return None
    try:
        return int(uid)
    except (TypeError, ValueError):
        return None


class Admission:
    """Who may connect to the writer's TCP socket and who is connected: the ZAP handler's
    decisions (its thread) and the subscription stream's news (whichever thread holds the
    socket's ``io_lock``), one principal one connection at a time.

    A principal is *pending* from ZAP's admission until its hello arrives (at most
    ``ADMIT_TIMEOUT_S``), then *connected* until the socket reports its hello's unsubscription
    (its connection ended: ZeroMQ unsubscribes a dead pipe's topics, ``XPUB_VERBOSER``).
    """

    def __init__(self, roster: Roster, log: RateLimitedLog) -> None:
        self.roster = roster
        self._log = log
        self.lock = threading.Lock()  # pending, connected, counters: two threads use them
        self.pending: dict[int, float] = {}
        self.connected: dict[bytes, int] = {}  # accepted hello topic -> its principal
        self.refused = 0
        self.admitted = 0  # connections ZAP admitted
        self.last_refusal = ""

    def may_admit(self, principal: int) -> bool:
        """ZAP's one-at-a-time rule; admits ``principal`` (pending) when it holds."""
        now = time.monotonic()
        with self.lock:
            if principal in self.connected.values():
                return False
            at = self.pending.get(principal)
            if at is not None and now - at < ADMIT_TIMEOUT_S:
                return False
            self.pending[principal] = now
            self.admitted += 1
            return True

    def refuse(self, key: str, why: str, address: str = "") -> None:
        """Counts and logs (rate-limited per ``key``) a refusal."""
        with self.lock:
            self.refused += 1
            self.last_refusal = why
            n = self.refused
        peer = f" from {address}" if address else ""
        self._log(
            key,
            logging.WARNING,
            "vllm_shm_arena: refused a peer of the queue's TCP socket%s: %s (%d refused so far)",
            peer,
            why,
            n,
        )

    def on_subscription(self, frame) -> None:
        """One message of the remote XPUB: a (un)subscription. Never raises for what a peer
        sent: a bad one is refused and logged."""
        data = frame.bytes
        if not data or data[0] > 1:
            return
        subscribe, topic = data[0] == 1, data[1:]
        roster = self.roster
        if topic == b"":
            roster.plain += 1 if subscribe else -1
            return
        if not topic.startswith(HELLO_MAGIC):
            if subscribe:
                self.refuse(
                    "tcp_subscription",
                    f"an unexpected subscription {topic[:32]!r} (principal "
                    f"{_user_id(frame)}); ignored",
                )
            return
        if not subscribe:
            with self.lock:
                principal = self.connected.pop(topic, None)
            if principal is not None:
                roster.remove(parse_hello(topic))
            return
        principal = _user_id(frame)
        try:
            ranks = parse_hello(topic)
            if principal is None or ranks[0] != principal:
                raise ValueError(
                    f"its hello declares {ranks[:1]} first, but it authenticated as "
                    f"principal {principal}"
                )
            roster.check(ranks)
        except ValueError as e:
            self.refuse("tcp_hello", f"principal {principal}'s hello: {e}; ignored")
            return
        roster.add(ranks)
        with self.lock:
            self.connected[topic] = principal
            self.pending.pop(principal, None)


#: The writer's TCP socket's events the ZAP thread watches: connections accepted (their
#: peers' addresses), handshakes that failed before ZAP was asked (a mechanism mismatch, junk,
#: a CurveZMQ peer without the keys, the handshake interval run out) or by it, and ends.
_WATCHED = (
    zmq.EVENT_ACCEPTED
    | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
    | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
    | zmq.EVENT_HANDSHAKE_FAILED_AUTH
    | zmq.EVENT_DISCONNECTED
)


def _peer_of(fd: int) -> str:
    """The address of the peer of the TCP connection ``fd`` (a descriptor ZeroMQ owns: read
    through a duplicate); "" once it is gone or is not a TCP connection. Best effort: a
    descriptor closed and reused before this runs names another connection's peer."""
    try:
        with socket.socket(fileno=os.dup(fd)) as s:
            peer = s.getpeername()
    except OSError:
        return ""
    return str(peer[0]) if isinstance(peer, tuple) and peer else ""


class ZapHandler:
    """The writer's ZAP handler: a thread answering ZeroMQ's authentication requests for the
    writer's context (each request is a connection to the TCP socket, or to the local one),
    and counting the connections whose handshake failed before a request was made (from the
    TCP socket's monitor).

    Its sockets live in the writer's context, so ``ctx.term()`` ends it: the thread's blocking
    poll fails with ETERM, it closes its sockets, and the termination completes. It holds
    nothing of the queue end (so a queue dropped without shutdown() is still collected), only
    the admission state, the keys, and the writer's remote socket and ``io_lock`` for reading
    subscriptions.
    """

    def __init__(
        self,
        ctx,
        keys: Keys,
        security: str,
        admission: Admission,
        remote_sock,
        io_lock,
    ) -> None:
        self.keys = keys
        self.admission = admission
        self._remote = remote_sock
        self._io_lock = io_lock
        self._curve_principals: dict[bytes, int] = {}
        if security == "encrypted":
            from zmq.utils import z85

            expected = admission.roster.expected
            for r in expected:
                self._curve_principals[z85.decode(keys.curve_client(r)[0])] = r
        self.security = security
        self._peers: dict[int, str] = {}  # fd -> peer address, from EVENT_ACCEPTED
        self._failed: str | None = None  # why the handshake whose end comes next failed
        self.sock = ctx.socket(zmq.REP)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.bind(ZAP_ENDPOINT)
        self.monitor = remote_sock.get_monitor_socket(_WATCHED)
        self.monitor.setsockopt(zmq.LINGER, 0)
        self.thread = threading.Thread(target=self._run, name="vllm_shm_arena-zap", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        sock, monitor = self.sock, self.monitor
        poller = zmq.Poller()
        poller.register(sock, zmq.POLLIN)
        poller.register(monitor, zmq.POLLIN)
        try:
            while True:
                try:
                    ready = dict(poller.poll())
                    if monitor in ready:
                        event = parse_monitor_message(monitor.recv_multipart())
                        try:
                            self._on_event(event)
                        except Exception:  # counting must never stop the handler
                            logger.exception("vllm_shm_arena: the ZAP handler's event failed")
                    if sock not in ready:
                        continue
                    request = sock.recv_multipart()
                except zmq.ZMQError:
                    return  # ETERM: the context is terminating (or a socket was closed)
                try:
                    reply = self.decide(request)
                except Exception as e:  # a bug here must not leave ZeroMQ waiting
                    logger.exception("vllm_shm_arena: the ZAP handler failed")
                    reply = self._reply(request, b"500", f"internal error: {e}", b"")
                try:
                    sock.send_multipart(reply)
                except zmq.ZMQError:
                    return
        finally:
            sock.close(linger=0)
            monitor.close(linger=0)

    def _on_event(self, ev: dict) -> None:
        """One event of the TCP socket. ZeroMQ's I/O thread reports a connection's failed
        handshake and then its end, one after the other, so the end that follows a failure
        is that connection's."""
        event, value = ev["event"], ev["value"]
        if event == zmq.EVENT_ACCEPTED:
            self._peers[value] = _peer_of(value)
        elif event == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
            self._failed = ""  # ZAP refused it: counted there
        elif event == zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL:
            self._failed = f"a failed ZMTP handshake (protocol error {value:#x})"
        elif event == zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL:
            self._failed = (
                f"a failed ZMTP handshake ({os.strerror(value) if value else 'no detail'})"
            )
        elif event == zmq.EVENT_DISCONNECTED:
            peer = self._peers.pop(value, "")
            why, self._failed = self._failed, None
            if why:
                self.admission.refuse("tcp_handshake", why, peer)

    @staticmethod
    def _reply(request: list, status: bytes, text: str, user: bytes) -> list:
        version = request[0] if request else b"1.0"
        rid = request[1] if len(request) > 1 else b""
        return [version, rid, status, text.encode()[:255], user, b""]

    def decide(self, request: list) -> list:
        """One ZAP request -> its reply (RFC 27): 200 with the principal as user id, or a
        refusal (counted, logged with the peer's address)."""
        if len(request) < 6 or request[0] != b"1.0":
            return self._reply(request, b"400", "malformed ZAP request", b"")
        _version, _rid, domain, address, _identity, mechanism, *creds = request
        addr = address.decode(errors="replace")
        if domain == LOCAL_DOMAIN and mechanism == b"NULL":
            return self._reply(request, b"200", "OK", b"")  # the 0700 local socket
        principal = None
        if domain == REMOTE_DOMAIN:
            principal = self._principal(mechanism, creds)
        if principal is None:
            self.admission.refuse("tcp_auth", f"wrong credentials ({mechanism.decode()})", addr)
            return self._reply(request, b"400", "wrong credentials", b"")
        if not self._admit(principal):
            self.admission.refuse("tcp_twice", f"principal {principal} is connected already", addr)
            return self._reply(request, b"400", "already connected", b"")
        return self._reply(request, b"200", "OK", str(principal).encode())

    def _principal(self, mechanism: bytes, creds: list) -> int | None:
        if self.security == "authenticated" and mechanism == b"PLAIN" and len(creds) == 2:
            user, password = creds
            if not (0 < len(user) <= 10 and user.isdigit()):
                return None
            want = self.keys.plain_password(user)
            if hmac.compare_digest(bytes(password), want):
                return int(user)
            return None
        if self.security == "encrypted" and mechanism == b"CURVE" and len(creds) == 1:
            return self._curve_principals.get(bytes(creds[0]))
        return None

    def _admit(self, principal: int) -> bool:
        if self.admission.may_admit(principal):
            return True
        # Its old connection may be gone without the socket's news read yet: read it (the
        # writer's thread may be using the socket; then refuse, and ZeroMQ retries soon).
        if self._io_lock.acquire(timeout=ZAP_DRAIN_WAIT_S):
            try:
                drain_subscriptions(self._remote, self.admission)
            except zmq.ZMQError:
                pass  # the socket is closing
            finally:
                self._io_lock.release()
            return self.admission.may_admit(principal)
        return False


def drain_subscriptions(sock, admission: Admission) -> None:
    """Reads every (un)subscription waiting on the writer's remote socket (with its
    ``io_lock`` held)."""
    while sock.getsockopt(zmq.EVENTS) & zmq.POLLIN:
        admission.on_subscription(sock.recv(zmq.NOBLOCK, copy=False))
