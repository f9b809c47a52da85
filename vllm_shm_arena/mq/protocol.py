"""What a queue's writer and its readers agree on: the handle a reader joins with, the frames
of a message, the ring's markers, the socket's token and last frame, and the errors a reader
raises when the writer is gone.

A message is a list of frames::

    frame 0   the arena slots it references, (slot, generation) pairs as <Q (see below)
    frame 1   the pickle stream
    frame 2.. its out-of-band buffers (tensor bytes the arena declined)

It travels one of three ways: in a ring chunk (when it fits), as a ring marker naming an arena
blob that holds all its frames (``BLOB_FLAGS``, one frame: ``BLOB_MARKER``), or as a ring
marker (``FLAG_OVERFLOW``) announcing it on the local socket; remote readers get every message
on their socket. On a socket, frame 0 starts with the handle's random token.

A TCP subscriber declares the reader ranks it covers (a remote reader: its own; a relay: its
node's) with a second subscription beside the one that receives everything: its topic is a
hello (``hello_topic``: magic, protocol version, the handle's token, the ranks) that no message
can match (every message starts with the token, a hello with the magic).

A relay forwards the end of its upstream downstream as one last message, a ``StreamEnd``
(the reason: the writer died, or the relay could not forward a message), which a node-local
reader raises instead of returning.
"""

from __future__ import annotations

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
#: Bytes of the random token that starts every socket message (see Handle.socket_token).
TOKEN_BYTES = 16
#: The writer's last frame on every socket (followed by the token): no message follows. Never
#: a real message, which has at least two frames (header, pickle).
SHUTDOWN_FRAME = b"VSA-SHUTDOWN"
#: The writer's first frame on every socket, once every reader subscribed.
READY_FRAME = b"READY"

#: A TCP subscriber's hello (see the module docstring): magic, version, token, rank count,
#: then that many ranks (<I each).
HELLO_MAGIC = b"VSA-HELLO\x00"
HELLO_VERSION = 1
HELLO_HEAD = struct.Struct(f"<{len(HELLO_MAGIC)}sB{TOKEN_BYTES}sH")
HELLO_RANK = struct.Struct("<I")
#: Most ranks one hello may declare.
HELLO_MAX_RANKS = 4096

#: The public names below live in ``vllm_shm_arena.message_queue`` (the facade re-exports
#: them): pickles and tracebacks name them where users import them from.
_PUBLIC_MODULE = "vllm_shm_arena.message_queue"


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


Handle.__module__ = WriterDiedError.__module__ = _PUBLIC_MODULE


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


def diverted_header(diverted: list[tuple[int, int]]) -> bytes:
    """Frame 0 of every message: the arena slots it references (released by a reader that
    fails to unpickle it)."""
    if not diverted:
        return b""
    flat = [x for pair in diverted for x in pair]
    return struct.pack(f"<{len(flat)}Q", *flat)


def parse_diverted(frame) -> list[tuple[int, int]]:
    """The slots ``diverted_header`` wrote; ``[]`` for a frame of the wrong length."""
    mv = memoryview(frame).cast("B")
    if len(mv) % 16:
        return []
    flat = struct.unpack(f"<{len(mv) // 8}Q", mv)
    return list(zip(flat[0::2], flat[1::2], strict=True))


class ShutDownByWriter(RuntimeError):
    """The writer's last frame arrived on the socket: it shut the queue down."""


def hello_topic(token: bytes, ranks: list[int]) -> bytes:
    """The subscription topic by which a TCP subscriber declares ``ranks``."""
    if not ranks or len(ranks) > HELLO_MAX_RANKS:
        raise ValueError(f"a subscriber declares 1..{HELLO_MAX_RANKS} ranks, got {len(ranks)}")
    head = HELLO_HEAD.pack(HELLO_MAGIC, HELLO_VERSION, bytes(token), len(ranks))
    return head + b"".join(HELLO_RANK.pack(r) for r in ranks)


def parse_hello(topic: bytes, token: bytes) -> list[int]:
    """The ranks a hello declares; ``ValueError`` naming what is wrong (version, token,
    length, no ranks)."""
    if len(topic) < HELLO_HEAD.size:
        raise ValueError(f"a subscriber's hello is truncated ({len(topic)} bytes)")
    magic, version, tok, n = HELLO_HEAD.unpack_from(topic)
    if version != HELLO_VERSION:
        raise ValueError(
            f"a subscriber speaks queue protocol version {version}, this writer {HELLO_VERSION}"
        )
    if tok != bytes(token):
        raise ValueError("a subscriber's hello carries a wrong socket token (another queue's?)")
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
