"""What a queue's writer and its readers agree on: the handle a reader joins with and the
keys its secret derives, the frames of a message, the ring's markers, how socket frames are
sealed (sequence number and MAC), the hello, and the errors a reader raises when the writer is
gone.

A message is a list of frames::

    frame 0   the arena slots it references, (slot, generation) pairs as <Q (see below);
              with forwards (allocations of the frontend arena its stubs name, engine core
              to workers only, never on the remote socket), those pairs follow, then their
              count (<Q): a frame of 8 mod 16 bytes (``diverted_header``)
    frame 1   the pickle stream
    frame 2.. its out-of-band buffers (tensor bytes the arena declined)
    then      on the remote socket only: the bytes of each arena allocation frame 0 names, in
              its order (a remote node cannot map the arena; its reader's stubs resolve to
              these frames)

It travels one of three ways: in a ring chunk (when it fits), as a ring marker naming an arena
blob that holds all its frames (in the tensor arena, or without one in the queue's blob region;
``BLOB_FLAGS``, one frame: ``BLOB_MARKER``), or as a ring marker (``FLAG_OVERFLOW``)
announcing it on the local socket; remote readers get every message on their socket.

Whom a reader trusts: its writer, and nobody else. The ring and the arena are shared memory
this uid alone can map (0600, names unlinked once the readers are in). A socket is another
matter: whatever answers at its address is believed by ZeroMQ (a TCP port a dead writer freed,
a socket name another user created after the writer removed its directory). So every frame a
reader acts on from a socket is sealed by the writer with a MAC keyed by the handle's secret
(``Keys.mac_key``, which never travels on any connection) over the frame and the message's
sequence number, and the reader checks it before anything is unpickled:

    frame 0 on a socket   MAC (16 bytes) | sequence number (<Q) | split table | the arena
                          slots
                          MAC = keyed BLAKE2b over (sequence number, split table, slots,
                          frame count on the wire, the pickle stream); the out-of-band
                          buffers are raw bytes that are never unpickled, so they need none
    split table           count (<I), then per out-of-band buffer longer than
                          SOCKET_SPLIT_ABOVE: its frame index and its number of parts (<II);
                          such a buffer goes on the wire as that many frames of
                          SOCKET_PART_BYTES (the last one shorter or equal), which the reader
                          joins into one buffer
    READY                 READY_FRAME | MAC of the queue's READY
    SHUTDOWN              SHUTDOWN_FRAME | the last sequence number sent (<Q) | its MAC

Sequence numbers count the messages a queue sent, from 1. A remote reader takes exactly the
last + 1 (a gap or a repeat is an error naming both); a local reader takes, from the socket,
the message its ring announced with that number. The writer's own peer check (who may
subscribe to its TCP socket) is transport.py's: ZeroMQ's ZAP with per-rank credentials the
secret derives (``Keys``).

A TCP subscriber declares the reader ranks it covers (a remote reader: its own; a relay: its
node's, its own first) with a second subscription beside the one that receives everything: its
topic is a hello (``hello_topic``: magic, protocol version, the ranks); the writer binds it to
the principal ZAP authenticated (the hello's first rank is that principal's). A subscriber
matching both of its subscriptions still gets each message once.

A relay forwards the end of its upstream downstream as one last message, a ``StreamEnd``
(the reason: the writer died, or the relay could not forward a message), which a node-local
reader raises instead of returning.
"""

from __future__ import annotations

import hashlib
import hmac
import struct
from dataclasses import dataclass, field

from vllm_shm_arena._ext import _C
from vllm_shm_arena.arena import ArenaHandle

#: Flags of a ring marker: the message is not in the chunk (overflow); it is in an arena blob.
FLAG_OVERFLOW = _C.RING_FLAG_OVERFLOW
FLAG_BLOB = _C.RING_FLAG_BLOB
BLOB_FLAGS = FLAG_OVERFLOW | FLAG_BLOB
#: The one frame of a blob marker: the blob's slot, generation and bytes.
BLOB_MARKER = struct.Struct("<QQQ")

#: Out-of-band buffers longer than SOCKET_SPLIT_ABOVE go on a socket in parts of
#: SOCKET_PART_BYTES. Why: a receiver's ZeroMQ allocates each frame whole, and glibc maps an
#: allocation above 32 MiB (its largest mmap threshold) afresh each time, faulting its pages
#: in as the kernel writes them (a 200 MiB frame: ~51,000 faults, about as long as the
#: transfer); parts of 16 MiB come from the heap, kept warm by the reader's heap anchor
#: (transport.py), and the reader joins them into a warm buffer of its frame pool.
SOCKET_SPLIT_ABOVE = 32 << 20
SOCKET_PART_BYTES = 16 << 20
#: Bytes of a queue's secret (``Handle.secret``).
SECRET_BYTES = 32
#: Bytes of a frame's MAC (128 bits).
MAC_BYTES = 16
#: A sequence number (messages sent so far, the first is 1).
SEQ = struct.Struct("<Q")
#: The sealed head of frame 0 on a socket: MAC, then the sequence number.
SEALED_HEAD = MAC_BYTES + SEQ.size
#: The writer's first frame on every socket, once every reader subscribed (then its MAC).
READY_FRAME = b"VSA-READY"
#: The writer's last frame on every socket: no message follows (then the last sequence number
#: and its MAC). Never a real message, which has at least two frames (header, pickle).
SHUTDOWN_FRAME = b"VSA-SHUTDOWN"

#: A TCP subscriber's hello (see the module docstring): magic, version, rank count, then that
#: many ranks (<I each). Version 2: the per-queue token is gone (ZAP authenticates the peer).
#: Version 3: a remote message carries the arena allocations its stubs name (module docstring).
HELLO_MAGIC = b"VSA-HELLO\x00"
HELLO_VERSION = 3
HELLO_HEAD = struct.Struct(f"<{len(HELLO_MAGIC)}sBH")
HELLO_RANK = struct.Struct("<I")
#: Most ranks one hello may declare.
HELLO_MAX_RANKS = 4096
#: The largest subscription a hello makes (the subscribe byte, head, ranks): the writer's TCP
#: socket takes no larger message from anyone (``ZMQ_MAXMSGSIZE``).
HELLO_MAX_BYTES = 1 + HELLO_HEAD.size + HELLO_MAX_RANKS * HELLO_RANK.size

#: ``Handle.tcp_security``: every TCP peer proves the secret (PLAIN credentials, MACs); or that
#: plus CurveZMQ encryption of the connection.
TCP_SECURITY = ("authenticated", "encrypted")

#: The public names below live in ``vllm_shm_arena.message_queue`` (the facade re-exports
#: them): pickles and tracebacks name them where users import them from.
_PUBLIC_MODULE = "vllm_shm_arena.message_queue"


@dataclass
class Handle:
    """What a reader needs to join a queue (picklable; works with fork and spawn).

    A credential: whoever holds it can join the queue and read every message (the secret
    derives the readers' TCP credentials and the key of every frame's MAC). Hand it only to
    the queue's readers; its ``repr`` leaves the secret out.
    """

    local_reader_ranks: list[int] = field(default_factory=list)
    buffer_handle: tuple | None = None  # (ring shm name, shm dir)
    local_subscribe_addr: str | None = None
    remote_subscribe_addr: str | None = None
    remote_addr_ipv6: bool = False
    #: The queue's random secret (``SECRET_BYTES``): see ``Keys``.
    secret: bytes = field(default=b"", repr=False)
    #: ``TCP_SECURITY``: what the remote socket adds to authentication (the writer's setting).
    tcp_security: str = "authenticated"
    tensor_arena_handle: ArenaHandle | None = None
    #: A queue without a tensor arena: the region its overflow messages are packed into
    #: (``BLOB_FLAGS`` markers), for its node-local readers. None with a tensor arena (which
    #: holds the blobs then) or without either.
    blob_arena_handle: ArenaHandle | None = None
    #: The frontend arena whose allocations messages may forward (``WriterEnd._forward_from``):
    #: local reader ``i`` attaches it as rank ``1 + i``. None: no forwards.
    frontend_arena_handle: ArenaHandle | None = None
    #: The local readers stop spinning for a message as soon as another thread computes on
    #: their CPU, and sleep until the writer wakes them (``MessageQueue``'s
    #: ``readers_cede_cpu``; ``RingReader`` in csrc/core/ring.h).
    readers_cede_cpu: bool = False


class WriterDiedError(RuntimeError):
    """The queue's writer process is gone (the kernel released its liveness token): no more
    messages will come. Messages it published before dying were delivered first."""


Handle.__module__ = WriterDiedError.__module__ = _PUBLIC_MODULE


def _derive(secret: bytes, label: bytes) -> bytes:
    return hmac.digest(secret, b"vllm_shm_arena/" + label, "sha256")


class Keys:
    """What a queue's secret derives (each a one-way function of it, so one leaking reveals
    neither the secret nor another):

    * ``mac_key``: keys every sealed frame's MAC. Never sent anywhere.
    * ``plain_password(user)``: the PLAIN password of TCP principal ``user`` (a reader's or a
      relay's own rank, in decimal). Sent to whatever answers at the writer's address (PLAIN
      authenticates the client only), which is why it cannot forge a MAC.
    * ``curve_server()`` / ``curve_client(rank)``: CurveZMQ key pairs (z85), for the
      encrypted setting.
    """

    __slots__ = ("_secret", "mac_key")

    def __init__(self, secret: bytes) -> None:
        secret = bytes(secret)
        if len(secret) != SECRET_BYTES:
            raise ValueError(
                f"a queue handle's secret has {len(secret)} bytes, not {SECRET_BYTES} (a handle "
                "from another version of vllm_shm_arena?)"
            )
        self._secret = secret
        self.mac_key = _derive(secret, b"mac")

    def plain_password(self, user: bytes) -> bytes:
        return _derive(self._secret, b"plain/" + bytes(user)).hex().encode()

    def _curve_pair(self, label: bytes) -> tuple[bytes, bytes]:
        import zmq
        from zmq.utils import z85

        secret = z85.encode(_derive(self._secret, b"curve/" + label))
        return zmq.curve_public(secret), secret

    def curve_server(self) -> tuple[bytes, bytes]:
        """The writer's (public, secret) CurveZMQ keys, z85."""
        return self._curve_pair(b"server")

    def curve_client(self, rank: int) -> tuple[bytes, bytes]:
        """Principal ``rank``'s (public, secret) CurveZMQ keys, z85."""
        return self._curve_pair(b"client/%d" % rank)

    def __repr__(self) -> str:
        return "Keys(<secret>)"


def _mac(key: bytes, person: bytes, *parts) -> bytes:
    h = hashlib.blake2b(key=key, digest_size=MAC_BYTES, person=person)
    for p in parts:
        h.update(p)
    return h.digest()


_NFRAMES = struct.Struct("<I")
_SPLIT = struct.Struct("<II")


def parts_of(nbytes: int) -> int:
    """The frames an out-of-band buffer of ``nbytes`` takes on a socket."""
    return 1 if nbytes <= SOCKET_SPLIT_ABOVE else -(-nbytes // SOCKET_PART_BYTES)


def split_table(frames: list) -> tuple[bytes, int]:
    """The split table of ``frames`` (see the module docstring) and their count on the wire."""
    entries = []
    wire = len(frames)
    for i in range(2, len(frames)):
        n = parts_of(memoryview(frames[i]).nbytes)
        if n > 1:
            entries.append(_SPLIT.pack(i, n))
            wire += n - 1
    return _NFRAMES.pack(len(entries)) + b"".join(entries), wire


def seal(key: bytes, seq: int, frames: list) -> bytes:
    """Frame 0 of ``frames`` as sent on a socket: MAC, sequence number, split table, the arena
    slots."""
    table, wire = split_table(frames)
    head = SEQ.pack(seq) + table + bytes(frames[0])
    return _mac(key, b"vsa-message", head, _NFRAMES.pack(wire), frames[1]) + head


class Forged(RuntimeError):
    """A frame on a queue's socket that its writer did not send (a wrong MAC, or a shape the
    writer never sends): whatever answers at the socket's address is not the writer."""

    def __init__(self, what: str) -> None:
        super().__init__(
            f"MessageQueue: {what} on the queue's socket did not come from its writer (its "
            "authentication failed); nothing of it was used. Whatever answers at the writer's "
            "address now is not the writer: recreate the queue"
        )


def unseal(key: bytes, frames: list) -> tuple[int, list]:
    """Checks a message's frames from a socket -> (sequence number, its frames as the writer
    had them: frame 0 without the sealed head, split buffers joined); ``Forged`` unless the
    writer sealed them."""
    head = memoryview(frames[0])
    if len(head) < SEALED_HEAD + _NFRAMES.size or len(frames) < 2:
        raise Forged("a message of a shape the writer never sends")
    want = _mac(key, b"vsa-message", head[MAC_BYTES:], _NFRAMES.pack(len(frames)), frames[1])
    if not hmac.compare_digest(want, head[:MAC_BYTES]):
        raise Forged("a message")
    seq = SEQ.unpack_from(head, MAC_BYTES)[0]
    (count,) = _NFRAMES.unpack_from(head, SEALED_HEAD)
    at = SEALED_HEAD + _NFRAMES.size
    if count > len(frames) or len(head) < at + count * _SPLIT.size:
        raise Forged("a message with a split table it does not hold")
    out = [head[at + count * _SPLIT.size :], frames[1]]
    k = 2  # the next frame on the wire
    for j in range(count):
        i, n = _SPLIT.unpack_from(head, at + j * _SPLIT.size)
        gap = i - len(out)  # frames before buffer i, not split
        # Sealed by the writer, so never wrong; checked all the same, never trusted.
        if gap < 0 or n < 2 or k + gap + n > len(frames):
            raise Forged("a message whose split table does not match its frames")
        out.extend(frames[k : k + gap])
        k += gap
        out.append(_C.join_frames(frames[k : k + n]))  # a warm frame-pool buffer
        k += n
    out.extend(frames[k:])
    return seq, out


def ready_frame(key: bytes) -> bytes:
    """The writer's READY, sealed."""
    return READY_FRAME + _mac(key, b"vsa-ready")


def shutdown_frame(key: bytes, last_seq: int) -> bytes:
    """The writer's last frame: the last sequence number it sent, sealed."""
    s = SEQ.pack(last_seq)
    return SHUTDOWN_FRAME + s + _mac(key, b"vsa-shutdown", s)


def control_frame(key: bytes, frame) -> tuple[str, int]:
    """A one-frame message from a socket -> ("ready", 0) or ("shutdown", last sequence
    number); ``Forged`` for anything else."""
    b = bytes(frame)
    if b.startswith(READY_FRAME):
        if hmac.compare_digest(b, ready_frame(key)):
            return "ready", 0
        raise Forged("a READY")
    if b.startswith(SHUTDOWN_FRAME) and len(b) == len(SHUTDOWN_FRAME) + SEQ.size + MAC_BYTES:
        seq = SEQ.unpack_from(b, len(SHUTDOWN_FRAME))[0]
        if hmac.compare_digest(b, shutdown_frame(key, seq)):
            return "shutdown", seq
        raise Forged("a SHUTDOWN")
    raise Forged("a frame of a shape the writer never sends")


class SequenceError(RuntimeError):
    """A remote reader's messages skipped or repeated a sequence number: some were lost on the
    way (its TCP connection dropped while they were sent). Raised after every message before
    the gap was delivered; nothing after it is."""

    def __init__(self, last: int, got: int) -> None:
        if got > last + 1:
            what = (
                f"message {got} arrived after message {last}: {got - last - 1} message(s) "
                f"({last + 1}..{got - 1}) were lost on the way"
            )
        else:
            what = f"message {got} arrived again after message {last}"
        super().__init__(
            f"MessageQueue: {what} (the TCP connection to the writer dropped while they were "
            "sent: a publisher does not resend what a subscriber missed). Messages up to "
            f"{last} were delivered; none after. Recreate the queue"
        )


SequenceError.__module__ = Forged.__module__ = _PUBLIC_MODULE


def connection_lost_error() -> RuntimeError:
    """A local reader's connection to the writer's socket dropped (for good)."""
    return RuntimeError(
        "MessageQueue: this reader's connection to the writer's local socket dropped (it is "
        "never re-established: the socket's name is gone); recreate the queue"
    )


def writer_died(what: str) -> WriterDiedError:
    """The writer's liveness token is free; ``what``: when the reader noticed."""
    return WriterDiedError(
        f"MessageQueue: the writer process died ({what}); no more messages will come"
    )


def diverted_header(
    diverted: list[tuple[int, int]], forwarded: list[tuple[int, int]] | tuple = ()
) -> bytes:
    """Frame 0 of every message: the arena slots it references (released by a reader that
    fails to unpickle it), as (slot, generation) pairs of <Q. With forwards (allocations of
    the frontend arena the stubs name, ``ShmTensorArenaWriter.forward_from``): the diverted
    pairs, the forwarded pairs, then their count (<Q), so that its length is 8 mod 16 and a
    frame without forwards reads as before."""
    flat = [x for pair in diverted for x in pair]
    if forwarded:
        flat += [x for pair in forwarded for x in pair]
        flat.append(len(forwarded))
    if not flat:
        return b""
    return struct.pack(f"<{len(flat)}Q", *flat)


def parse_header(frame) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
    """-> (diverted, forwarded), the pairs ``diverted_header`` wrote; ``([], [])`` for a frame
    whose length or forward count does not fit."""
    mv = memoryview(frame).cast("B")
    n = len(mv) // 8
    if len(mv) % 8:
        return [], []
    flat = struct.unpack(f"<{n}Q", mv)
    n_fwd = 0
    if n % 2:  # forwards: a count closes the frame
        n_fwd = flat[-1]
        if n_fwd == 0 or 2 * n_fwd > n - 1:
            return [], []
        flat = flat[:-1]
    pairs = list(zip(flat[0::2], flat[1::2], strict=True))
    cut = len(pairs) - n_fwd
    return pairs[:cut], pairs[cut:]


def parse_diverted(frame) -> list[tuple[int, int]]:
    """The slots ``diverted_header`` wrote (without its forwards); ``[]`` for a frame that
    does not parse."""
    mv = memoryview(frame).cast("B")
    if len(mv) % 16 == 0:  # no forwards: the common case, without the general parse
        flat = struct.unpack(f"<{len(mv) // 8}Q", mv)
        return list(zip(flat[0::2], flat[1::2], strict=True))
    return parse_header(mv)[0]


class ShutDownByWriter(RuntimeError):
    """The writer's last frame arrived on the socket: it shut the queue down."""


def hello_topic(ranks: list[int]) -> bytes:
    """The subscription topic by which a TCP subscriber declares ``ranks`` (its own first)."""
    if not ranks or len(ranks) > HELLO_MAX_RANKS:
        raise ValueError(f"a subscriber declares 1..{HELLO_MAX_RANKS} ranks, got {len(ranks)}")
    head = HELLO_HEAD.pack(HELLO_MAGIC, HELLO_VERSION, len(ranks))
    return head + b"".join(HELLO_RANK.pack(r) for r in ranks)


def parse_hello(topic: bytes) -> list[int]:
    """The ranks a hello declares; ``ValueError`` naming what is wrong (version, length, no
    ranks)."""
    if len(topic) < HELLO_HEAD.size:
        raise ValueError(f"a subscriber's hello is truncated ({len(topic)} bytes)")
    _magic, version, n = HELLO_HEAD.unpack_from(topic)
    if version != HELLO_VERSION:
        raise ValueError(
            f"a subscriber speaks queue protocol version {version}, this writer {HELLO_VERSION}"
        )
    if n == 0:
        raise ValueError("a subscriber declared no reader ranks")
    if len(topic) != HELLO_HEAD.size + n * HELLO_RANK.size:
        raise ValueError(f"a subscriber's hello has {len(topic)} bytes for {n} ranks")
    return [HELLO_RANK.unpack_from(topic, HELLO_HEAD.size + i * 4)[0] for i in range(n)]


class StreamEnd:
    """A relay's last message downstream: why its upstream ended. ``kind``: "writer_died"
    (raised as ``WriterDiedError``) or "broken" (``RuntimeError``)."""

    __slots__ = ("kind", "text")

    def __init__(self, kind: str, text: str) -> None:
        self.kind = kind
        self.text = text

    def __reduce__(self):
        return (StreamEnd, (self.kind, self.text))

    def error(self) -> RuntimeError:
        """The exception a reader raises for it."""
        if self.kind == "writer_died":
            return WriterDiedError(self.text)
        return RuntimeError(self.text)
