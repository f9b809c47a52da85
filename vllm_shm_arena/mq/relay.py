"""The relay of a remote node: one TCP subscription to the writer's queue for every reader on
that node, republished into a node-local queue (ring + arena) for them.

::

    writer (node 0)  --TCP, once per node-->  relay (node 1, reader rank R)
                                              upstream: RemoteReaderEnd declaring
                                                        [R] + relayed ranks
                                              thread:   dequeue upstream -> enqueue downstream
                                              downstream: WriterEnd, 1 + k local readers
                                                reader 0    the relay's own worker (dequeue)
                                                reader 1..k the relayed ranks, which join
                                                            with downstream_handle

The thread republishes in order as messages arrive, never waiting for the relay's own worker
(which reads the downstream ring like the relayed readers): upstream frames are unpickled with
tensors over the received frames (zero-copy), and the downstream enqueue copies them once into
this node's arena.

Bounded backlog: the thread stops receiving while the downstream ring is full (its enqueue
waits for a chunk), so what a slow downstream reader holds back is at most the downstream
ring's chunks plus the upstream socket's high-water marks (transport.SOCKET_HWM on either end,
plus the kernel's TCP buffers); the upstream writer then waits too. A slow reader is not a
fault: nothing is dropped.

How the upstream ends reaches the downstream readers after every message before it: the
writer's shutdown -> the downstream queue is shut down; the writer's death (its TCP connection
dropped) -> a last ``StreamEnd`` message, raised as ``WriterDiedError``; a message the relay
cannot forward (say, one that cannot be unpickled) -> a ``StreamEnd`` raised as
``RuntimeError`` naming it, then shut down: never a silent loss. The relay's own death is seen
by its readers as their writer's death (the downstream ring's liveness token).
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

from vllm_shm_arena.mq.end import End
from vllm_shm_arena.mq.lifecycle import DRAIN_S, WAIT_SLICE_S
from vllm_shm_arena.mq.protocol import Handle, ShutDownByWriter, StreamEnd, WriterDiedError
from vllm_shm_arena.mq.reader import LocalReaderEnd, RemoteReaderEnd
from vllm_shm_arena.mq.writer import WriterEnd

logger = logging.getLogger("vllm_shm_arena")

#: How long shutdown() waits for the relay thread to leave its current call.
JOIN_S = 10 * WAIT_SLICE_S


class RelayEnd(End):
    """A remote node's relay: upstream reader, downstream writer, its own downstream reader 0,
    and the thread between them."""

    ROLE = "relay"
    CLOSE_DRAIN_S = DRAIN_S

    def __init__(
        self,
        handle: Handle,
        rank: int,
        relayed_ranks: list[int],
        max_chunk_bytes: int,
        max_chunks: int,
    ) -> None:
        super().__init__()
        self.handle = handle
        self.rank = rank
        self.relayed_ranks = list(relayed_ranks)
        self.upstream: RemoteReaderEnd | None = None
        self.downstream: WriterEnd | None = None
        self.reader: LocalReaderEnd | None = None
        self.thread: threading.Thread | None = None
        #: Why the thread ended the downstream queue ("" while it runs or ended cleanly).
        self.ended = ""
        try:
            self.upstream = RemoteReaderEnd(handle, [rank, *self.relayed_ranks])
            n = 1 + len(self.relayed_ranks)
            ranks, _, roster = WriterEnd.check_args(
                n, n, None, max_chunk_bytes, max_chunks, None, True
            )
            self.downstream = WriterEnd(
                n, n, ranks, max_chunk_bytes, max_chunks, None, True, roster
            )
            self.reader = LocalReaderEnd(self.downstream.handle, 0)
        except BaseException:
            self._close_parts(0.0)
            self.lifecycle.abandon()
            raise
        self.arena = self.reader.arena
        self.downstream_handle = self.downstream.handle

    # ------------------------------------------------------------------ joining
    def _handshake(self, deadline: float | None) -> None:
        """Upstream ready, then downstream ready (every downstream reader, this relay's own
        reader 0 included), then the thread starts."""

        def left() -> float | None:
            return None if deadline is None else max(deadline - time.monotonic(), 0.0)

        if self.thread is not None:
            return
        self.upstream.wait_until_ready(left())
        self.downstream.wait_until_ready(left())
        self.reader.wait_until_ready(left())
        self.thread = threading.Thread(
            target=self._forward, name=f"vllm_shm_arena-relay-{self.rank}", daemon=True
        )
        self.thread.start()

    # ------------------------------------------------------------------ the thread
    def _forward(self) -> None:
        """Receives upstream and enqueues downstream, in order, until the upstream ends."""
        up, down = self.upstream, self.downstream
        try:
            while True:
                obj = up.dequeue(None, indefinite=True)
                down.enqueue(obj)  # waits while the downstream ring is full (the bound)
                self.counters["messages"] += 1
        except ShutDownByWriter:
            self.ended = "the writer shut the queue down"
            self._end_downstream(None)
        except WriterDiedError as e:
            self.ended = str(e)
            self._end_downstream(StreamEnd("writer_died", f"{e} (seen by the relay)"))
        except BaseException as e:
            if self.lifecycle.shutdown.is_set():
                return  # this relay's own shutdown()
            self.ended = f"{type(e).__name__}: {e}"
            logger.error("vllm_shm_arena: the relay could not forward a message: %s", self.ended)
            self._end_downstream(
                StreamEnd(
                    "broken",
                    "MessageQueue: the relay of this node could not forward a message "
                    f"({self.ended}); no more messages will come. Recreate the queue",
                )
            )

    def _end_downstream(self, end: StreamEnd | None) -> None:
        """The upstream ended: ``end`` (if any) as the last message, then the downstream
        queue shuts down (its readers see it after every message before)."""
        try:
            if end is not None:
                self.downstream.enqueue(end)
        except Exception:
            logger.exception("vllm_shm_arena: the relay could not forward the end of its queue")
        finally:
            self.downstream.shutdown()

    # ------------------------------------------------------------------ the worker's calls
    def dequeue(self, timeout: float | None = None, indefinite: bool = False) -> Any:
        """The relay's own worker reads the downstream ring, like the relayed readers."""
        return self.reader.dequeue(timeout, indefinite)

    def broadcast_object(self, obj: Any = None) -> Any:
        return self.dequeue()

    @property
    def last_dequeue_s(self) -> float:
        return self.reader.last_dequeue_s

    @property
    def remote_socket(self):
        return self.upstream.socket.sock

    @property
    def local_socket(self):
        return self.downstream.sockets.local

    def stats(self) -> dict:
        """``messages`` forwarded, and each part's stats."""
        out = dict(self.counters)
        out["role"] = self.ROLE
        out["upstream"] = self.upstream.stats()
        out["downstream"] = self.downstream.stats()
        out["reader"] = self.reader.stats()
        if self.ended:
            out["ended"] = self.ended
        if self.arena is not None:
            out["arena"] = self.arena.stats()
        return out

    # ------------------------------------------------------------------ ending
    def _close_parts(self, drain_s: float) -> None:
        """Stops the thread (its waits see the shutdown flags within a wait slice), then
        closes downstream (draining for ``drain_s``), the own reader and upstream."""
        if self.upstream is not None:
            self.upstream.shutdown()
        if self.downstream is not None:
            self.downstream.lifecycle.shutdown.set()
        t = self.thread
        if t is not None and t is not threading.current_thread():
            t.join(JOIN_S)
        if self.downstream is not None:
            self.downstream.close(drain_s)
        if self.reader is not None:
            self.reader.shutdown()

    def _close_locked(self, drain_s: float) -> None:
        self._close_parts(drain_s)
        self.reporter.cancel()
