"""``End``: what every queue end has, whatever its role.

A role (writer.py: the writer; reader.py: a node-local or a remote reader; relay.py: a remote
node's relay) is a subclass whose constructor sets exactly its state, and implements the
calls of its role. The calls of other roles fail here with the error the queue has always
raised, so no method tests a role flag: ``MessageQueue`` (message_queue.py) delegates every
call to its end.

Each end owns a ``Lifecycle`` (pid, shutdown flag, call lock, resources released by a
finalizer) and a ``Reporter`` (counters, rate-limited logs, the once-a-second reports).
"""

from __future__ import annotations

import time
from typing import Any

from vllm_shm_arena.mq.lifecycle import Lifecycle
from vllm_shm_arena.mq.reporting import Reporter


class End:
    """A queue end: the state and calls every role shares."""

    #: ``stats()["role"]``.
    ROLE = ""
    #: How long closing this end (shutdown(), or the exit hook) drains its sockets.
    CLOSE_DRAIN_S = 0.0
    #: The sockets a role has (vLLM's attribute names); None where it has none.
    local_socket: Any = None
    remote_socket: Any = None
    #: This end's ``ShmTensorArena``, if any.
    arena: Any = None
    #: A queue without a tensor arena: its own region for messages too big for a ring chunk.
    blob_region: Any = None

    @property
    def blob_arena(self) -> Any:
        """Where a message too big for a ring chunk is packed (the ring's blob markers point
        there): the tensor arena, or the queue's blob region; None: the local socket."""
        return self.arena if self.arena is not None else self.blob_region

    def __init__(self) -> None:
        self.lifecycle = Lifecycle(self)
        self.reporter = Reporter()
        self.counters = self.reporter.counters

    # ------------------------------------------------------------------ joining
    def wait_until_ready(self, timeout: float | None = None) -> None:
        """The handshake of this end's role, under its call lock."""
        deadline = None if timeout is None else time.monotonic() + timeout
        self.lifecycle.call(timeout, "call", self._handshake, deadline)

    def _handshake(self, deadline: float | None) -> None:
        raise NotImplementedError

    # ------------------------------------------------------------------ calls of other roles
    def enqueue(self, obj: Any, timeout: float | None = None) -> None:
        raise RuntimeError("only the writer can enqueue")

    def empty(self, shape, dtype=None):
        raise RuntimeError("only the writer can lend tensors")

    def dequeue(self, timeout: float | None = None, indefinite: bool = False) -> Any:
        raise RuntimeError("the writer cannot dequeue")

    def broadcast_object(self, obj: Any = None) -> Any:
        raise NotImplementedError

    # ------------------------------------------------------------------ reports
    def report(self) -> None:
        """The once-a-second report (see ``Reporter.maybe_report``); nothing by default."""

    def stats(self) -> dict:
        """The counters, the role, and the arena's stats when there is one (a local reader's
        rank of the frontend arena too: ``frontend``)."""
        out = dict(self.counters)
        out["role"] = self.ROLE
        if self.arena is not None:
            out["arena"] = self.arena.stats()
        frontend = getattr(self, "frontend", None)
        if frontend is not None:
            out["frontend"] = frontend.stats()
        return out

    # ------------------------------------------------------------------ ending
    def shutdown(self) -> None:
        """Sets the shutdown flag (blocked calls wake within a wait slice) and closes the end,
        draining its sockets for ``CLOSE_DRAIN_S``; a forked child's copy only sets the
        flag: the ring, the sockets, the arena and their names are the parent's."""
        self.lifecycle.shutdown.set()
        if not self.lifecycle.in_owner():
            return
        self.close(self.CLOSE_DRAIN_S)

    def close(self, drain_s: float) -> None:
        """Releases what ``shutdown()`` releases, draining for at most ``drain_s``;
        idempotent, and never in a forked child."""
        self.lifecycle.close(drain_s, self._close_locked)

    def _close_locked(self, drain_s: float) -> None:
        raise NotImplementedError
