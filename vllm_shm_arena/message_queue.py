"""``MessageQueue``: vLLM's broadcast queue interface with the tensor arena wired in.

One writer (the engine) sends every message to ``n_reader`` readers (the workers):

* node-local readers read a shared-memory ring of ``max_chunks`` chunks, in order; a message
  too big for a chunk leaves an "overflow" marker in the ring and travels over a local
  ZeroMQ XPUB socket bound to a path in a fresh 0700 directory inside the shm directory
  (no other user can connect), unlinked once the readers have subscribed;
* remote readers receive everything over a TCP XPUB socket (tensor bytes out of band), each
  subscriber declaring the reader ranks it covers; a relay (``create_relay``) covers a whole
  remote node with one subscription and republishes into that node's own ring and arena;
* with ``enable_shm_tensor_arena=True``, large CPU tensors go into a ``ShmTensorArena`` for the
  node-local readers: one copy, read zero-copy by all of them.

Works without vLLM; the vLLM plugin swaps it in for vLLM's own queue.

This module is the facade: each role (the writer, a node-local reader, a remote reader, a
remote node's relay) is built by its own constructor below, which gives the queue exactly that
role's state and one end object (vllm_shm_arena/mq/) that every call delegates to. The parts
never import this module; see vllm_shm_arena/mq/__init__.py for the map.
"""

from __future__ import annotations

from typing import Any

from vllm_shm_arena.arena import ShmTensorArena
from vllm_shm_arena.mq import groups
from vllm_shm_arena.mq.end import End
from vllm_shm_arena.mq.protocol import Handle, WriterDiedError
from vllm_shm_arena.mq.reader import LocalReaderEnd, RemoteReaderEnd
from vllm_shm_arena.mq.relay import RelayEnd
from vllm_shm_arena.mq.writer import WriterEnd, check_int

__all__ = ["Handle", "MessageQueue", "WriterDiedError"]


class MessageQueue:
    """A broadcast queue from one writer to ``n_reader`` readers (vLLM's interface).

    The writer constructs it; readers join with ``create_from_handle(writer.export_handle(),
    rank)``; everyone calls ``wait_until_ready()``. Then the writer ``enqueue``s and every
    reader ``dequeue``s every message, in order.
    """

    _end: End

    # ------------------------------------------------------------------ the roles
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
        remote_reader_ranks: list[int] | None = None,
        readers_cede_cpu: bool = False,
    ):
        """The writer. Every argument is checked before anything (ring, socket, arena) is
        created. ``remote_reader_ranks``: the ranks the TCP subscribers must declare (default:
        ``range(n_reader)`` without ``local_reader_ranks``, when that is the right count).
        ``readers_cede_cpu``: a local reader waiting for a message stops spinning as soon as
        another thread computes on its CPU and sleeps until this writer wakes it; for a queue
        whose writer waits once it has written (a worker's replies), since the woken reader
        tends to take its waker's CPU."""
        args = (n_reader, n_local_reader, local_reader_ranks, max_chunk_bytes, max_chunks)
        ranks, connect_ip, roster = WriterEnd.check_args(
            *args, connect_ip, enable_shm_tensor_arena, remote_reader_ranks
        )
        end = WriterEnd(
            n_reader,
            n_local_reader,
            ranks,
            max_chunk_bytes,
            max_chunks,
            connect_ip,
            enable_shm_tensor_arena,
            roster,
        )
        self._end = end
        end.handle.readers_cede_cpu = bool(readers_cede_cpu)
        self.handle = end.handle
        self.n_reader = n_reader
        self.n_local_reader = n_local_reader
        self.n_remote_reader = n_reader - n_local_reader
        self.max_chunk_bytes = max_chunk_bytes
        self.local_reader_rank = -1
        self._is_writer, self._is_local_reader, self._is_remote_reader = True, False, False

    @staticmethod
    def create_from_handle(handle: Handle, rank: int) -> MessageQueue:
        """Joins the queue described by ``handle`` as reader ``rank``."""
        # Checked before anything (context, ring, socket) is created.
        if not isinstance(handle, Handle):
            raise TypeError(f"expected a MessageQueue Handle, got {type(handle).__name__}")
        check_int("rank", rank, 0)
        if rank in handle.local_reader_ranks:
            return MessageQueue._local_reader(handle, handle.local_reader_ranks.index(rank))
        if handle.remote_subscribe_addr is None:
            raise ValueError(
                f"rank {rank} is not a local reader and the queue has no remote socket"
            )
        return MessageQueue._remote_reader(handle, rank)

    @classmethod
    def _local_reader(cls, handle: Handle, index: int) -> MessageQueue:
        """A reader on the writer's node: local reader ``index`` of ``handle``."""
        self = cls.__new__(cls)
        self._end = LocalReaderEnd(handle, index)
        self.handle = handle
        self.n_local_reader = len(handle.local_reader_ranks)
        self.local_reader_rank = index
        self._is_writer, self._is_local_reader, self._is_remote_reader = False, True, False
        return self

    @classmethod
    def _remote_reader(cls, handle: Handle, rank: int) -> MessageQueue:
        """A reader on another node: reader ``rank``, which it declares when subscribing."""
        self = cls.__new__(cls)
        self._end = RemoteReaderEnd(handle, [rank])
        self.handle = handle
        self.n_local_reader = len(handle.local_reader_ranks)
        self.local_reader_rank = -1
        self._is_writer, self._is_local_reader, self._is_remote_reader = False, False, True
        return self

    @staticmethod
    def create_relay(
        handle: Handle,
        rank: int,
        relayed_ranks: list[int],
        *,
        max_chunk_bytes: int = 16 << 20,
        max_chunks: int = 10,
    ) -> MessageQueue:
        """The relay of a remote node (vllm_shm_arena/mq/relay.py): reader ``rank`` of the
        queue ``handle`` describes, subscribing once for itself and ``relayed_ranks`` (the
        node's other remote ranks), and the writer of a node-local queue (ring + arena) with
        ``1 + len(relayed_ranks)`` readers: reader 0 is this relay's own ``dequeue``, readers
        1..k join with ``create_from_handle(relay.downstream_handle, i)``, in the order of
        ``relayed_ranks``. ``max_chunk_bytes``/``max_chunks``: the downstream ring's."""
        if not isinstance(handle, Handle):
            raise TypeError(f"expected a MessageQueue Handle, got {type(handle).__name__}")
        check_int("rank", rank, 0)
        relayed = list(relayed_ranks)
        for r in relayed:
            check_int("relayed_ranks[i]", r, 0)
        if len(set([rank, *relayed])) != 1 + len(relayed):
            raise ValueError(f"rank {rank} and relayed_ranks {relayed} must be distinct")
        local = [r for r in (rank, *relayed) if r in handle.local_reader_ranks]
        if local:
            raise ValueError(f"ranks {local} are the writer's local readers, not remote ones")
        if handle.remote_subscribe_addr is None:
            raise ValueError("the queue has no remote socket (every reader is local)")
        check_int("max_chunk_bytes", max_chunk_bytes, 1)
        check_int("max_chunks", max_chunks, 1)
        return MessageQueue._relay(handle, rank, relayed, max_chunk_bytes, max_chunks)

    @classmethod
    def _relay(
        cls, handle: Handle, rank: int, relayed: list[int], max_chunk_bytes: int, max_chunks: int
    ) -> MessageQueue:
        """A remote node's relay (see ``create_relay``)."""
        self = cls.__new__(cls)
        end = RelayEnd(handle, rank, relayed, max_chunk_bytes, max_chunks)
        self._end = end
        self.handle = handle
        self.downstream_handle = end.downstream_handle
        self.n_local_reader = len(handle.local_reader_ranks)
        self.local_reader_rank = -1
        self._is_writer, self._is_local_reader, self._is_remote_reader = False, False, True
        return self

    # ------------------------------------------------------------------ the end's state
    @property
    def arena(self) -> ShmTensorArena | None:
        """This end's tensor arena (the writer's, or this reader's attachment), or None."""
        return self._end.arena

    @property
    def tensor_arena(self) -> ShmTensorArena | None:
        """vLLM's name for ``arena`` (its ``MessageQueue.tensor_arena``); read-only."""
        return self._end.arena

    @property
    def local_socket(self):
        """The ZeroMQ socket to or from node-local readers (writer, local reader), or None."""
        return self._end.local_socket

    @local_socket.setter
    def local_socket(self, sock) -> None:
        self._end.local_socket = sock

    @property
    def remote_socket(self):
        """The ZeroMQ socket to or from remote readers (writer, remote reader), or None."""
        return self._end.remote_socket

    @remote_socket.setter
    def remote_socket(self, sock) -> None:
        self._end.remote_socket = sock

    @property
    def serialize_inband(self) -> bool:
        """Writer: pickle tensor bytes inside the stream (the pre-out-of-band baseline, for
        benchmarks)."""
        return self._end.serialize_inband

    @serialize_inband.setter
    def serialize_inband(self, value: bool) -> None:
        self._end.serialize_inband = value

    @property
    def last_dequeue_s(self) -> float:
        """Reader: seconds from the last message's arrival (ring chunk seen) to the object in
        hand."""
        return self._end.last_dequeue_s

    # ------------------------------------------------------------------ joining
    def export_handle(self) -> Handle:
        """The handle readers pass to ``create_from_handle``."""
        return self.handle

    def wait_until_ready(self, timeout: float | None = None) -> None:
        """Writer: waits for every reader to subscribe, then tells them to start. Readers:
        wait for that. Afterwards the shm names are unlinked, so nothing is left in
        ``/dev/shm`` even if every process is killed."""
        self._end.wait_until_ready(timeout)

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
        # Returned, not called and dropped: no bytecode of this frame runs after the end's
        # enqueue, where an exception would hide that the message was sent.
        return self._end.enqueue(obj, timeout)

    def empty(self, shape, dtype=None):
        """Writer: a tensor to fill in place that ``enqueue`` then sends without copying (a
        loan from the arena; see ``ShmTensorArena.empty`` for the rules). Without an arena, or
        when the arena cannot lend that much now, a plain ``torch.empty``."""
        return self._end.empty(shape, dtype)

    # ------------------------------------------------------------------ reader
    def dequeue(self, timeout: float | None = None, indefinite: bool = False) -> Any:
        """Receives the next message. Raises ``TimeoutError`` after ``timeout`` seconds (the
        queue is then exactly as it was: the message comes with a later call) and
        ``RuntimeError`` once the queue is shut down. ``indefinite`` silences the periodic
        "still waiting" log line. Thread-safe: calls from several threads are serialised, each
        message goes to one of them."""
        return self._end.dequeue(timeout, indefinite)

    # ------------------------------------------------------------------ both
    def broadcast_object(self, obj: Any = None) -> Any:
        """Writer: enqueue ``obj`` and return it. Reader: return the next message."""
        return self._end.broadcast_object(obj)

    def stats(self) -> dict:
        """Queue counters, plus the arena's (hits, bytes, declined{...}, per-reader holdings)
        when it has one, and on a writer asked for an arena the size it got under
        ``"arena_size"`` (arena_bytes, requested_bytes, sized_by, ...: ``sizing.ArenaSize``)."""
        return self._end.stats()

    def shutdown(self) -> None:
        """Stops the queue. A reader blocked in ``dequeue`` (in this process, or every reader
        when called on the writer) wakes and raises ``RuntimeError``.

        On the writer, every message an ``enqueue`` returned for is delivered first: queued
        socket frames get up to 5 s to reach the readers, then the ring is shut down; readers
        see the shutdown only after the messages before it. In a forked child, an inherited
        queue is only flagged: its ring, sockets, arena and names are the parent's."""
        self._end.shutdown()

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
        return groups.create_from_process_group(
            MessageQueue,
            pg,
            max_chunk_bytes,
            max_chunks,
            writer_rank,
            external_writer_handle,
            blocking,
            enable_shm_tensor_arena=enable_shm_tensor_arena,
        )

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
        return groups.create_from_process_group_single_reader(
            MessageQueue, pg, max_chunk_bytes, max_chunks, reader_rank, blocking
        )
