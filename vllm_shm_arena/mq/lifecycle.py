"""The process side of a queue end: who owns it, how it ends, and what is released when
nobody ends it.

* ``Lifecycle``: per end, the owning pid (a forked child inherits objects, not roles), the
  shutdown flag every wait checks, the lock that serialises the end's calls, and the
  ``Resources`` a ``weakref.finalize`` releases when the end is dropped unclosed.
* ``NOGIL``: the gate around the ``_C`` calls that release the GIL; the exit hook closes it.
* ``shutdown_at_exit``: the ``atexit`` hook that shuts down this process's live ends.

An end (see end.py) is anything with a ``lifecycle``, a ``close(drain_s)`` and a
``CLOSE_DRAIN_S``; ``Lifecycle`` registers it in ``LIVE`` (weakly).
"""

from __future__ import annotations

import atexit
import logging
import os
import threading
import time
import weakref
from typing import Any

logger = logging.getLogger("vllm_shm_arena")

#: How long a blocking wait sleeps in C++ before Python checks for shutdown/timeouts.
WAIT_SLICE_S = 0.1
#: At interpreter exit, how long to wait for threads to leave GIL-released calls.
EXIT_WAIT_S = 2.0
#: How long the writer's shutdown() waits for queued socket frames to reach the readers.
DRAIN_S = 5.0


class NoGilCalls:
    """Counts threads inside the ``_C`` calls that release the GIL (ring waits, copies).

    The bindings already make such a call safe at interpreter exit (a thread coming back
    after finalization began parks instead of taking the GIL; see ``with_nogil`` in
    csrc/bindings/gil.h). This gate is about the queue: the exit hook closes it, so no
    new call starts, and waits a bounded time until no thread is inside one, so queues are
    shut down cleanly (their sockets drained) rather than abandoned mid-call.
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


NOGIL = NoGilCalls()
#: Every queue end this process built, for the exit hook (weak: never keeps one alive).
LIVE: weakref.WeakSet[Any] = weakref.WeakSet()


def shutdown_at_exit(
    live: weakref.WeakSet = LIVE, gate: NoGilCalls = NOGIL, wait_s: float = EXIT_WAIT_S
) -> None:
    """Shuts down this process's live queue ends before Python finalizes: wakes blocked
    waits, lets no new GIL-released call start, and waits a bounded time for threads to
    leave the ones they are in."""
    pid = os.getpid()
    # A forked child's inherited queues belong to its parent: leave them alone.
    ends = [e for e in list(live) if e.lifecycle.pid == pid]
    for e in ends:
        e.lifecycle.shutdown.set()  # every wait loop checks it at least once per WAIT_SLICE_S
    left = gate.close_and_wait(wait_s)
    if left:
        logger.warning(
            "vllm_shm_arena: %d thread(s) still inside a queue call at exit after %.0f s",
            left,
            wait_s,
        )
    for e in ends:
        try:
            e.close(e.CLOSE_DRAIN_S)
        except Exception:
            logger.debug("vllm_shm_arena: closing a queue at exit failed", exc_info=True)


atexit.register(shutdown_at_exit)


class Resources:
    """What a queue end must close even when nobody calls ``shutdown()``: its ZeroMQ sockets
    and context (an open socket makes the context's ``term()``, run when pyzmq collects it,
    wait for good: a queue in a reference cycle hung ``gc.collect()``), the local socket's
    directory and, on the writer, the ring (shut down so blocked readers wake).

    A ``weakref.finalize`` holds this object, never the end, so the end can still be
    collected; ``release`` runs once, when the end dies or is shut down, or when its
    constructor fails. The transport and the ring register what they open here.
    """

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.ctx = None
        self.sockets: list = []
        self.ring_writer = None
        self.socket_dir = None  # the local socket's _C.SocketDir (0700, with its token)

    def remove_socket_dir(self) -> None:
        """Removes the local socket's directory, its token and the socket's name (idempotent;
        connected readers keep their connections)."""
        d, self.socket_dir = self.socket_dir, None
        if d is not None:
            d.remove()

    def release(self) -> None:
        """Closes the sockets (dropping unsent frames: ``shutdown()`` is the path that
        drains), terminates the context, shuts the writer's ring down."""
        if os.getpid() != self.pid:
            return  # a forked child's inherited copy: these belong to the parent
        self.remove_socket_dir()
        for s in self.sockets:
            s.close(linger=0)
        if self.ctx is not None:
            self.ctx.term()
        if self.ring_writer is not None:
            self.ring_writer.shutdown()


class Lifecycle:
    """One end's process state: owner pid, shutdown flag, closed flag, call lock, resources.

    ``owner`` is the end: the finalizer and the ``LIVE`` registry refer to it weakly.
    """

    def __init__(self, owner: Any) -> None:
        self.pid = os.getpid()
        self.shutdown = threading.Event()
        self.closed = False
        # Serialises the end's calls (enqueue and wait_until_ready on the writer, dequeue on a
        # reader) and the timed report: the C++ ring ends are single-threaded.
        self.side_lock = threading.Lock()
        self.resources = Resources(self.pid)
        self.finalizer = weakref.finalize(owner, Resources.release, self.resources)
        # Not at exit on its own: the exit hook runs it after waking blocked threads.
        self.finalizer.atexit = False
        LIVE.add(owner)

    def in_owner(self) -> bool:
        """Whether this process built the end (not a forked child holding a copy)."""
        return os.getpid() == self.pid

    def take(self, timeout: float | None, what: str) -> None:
        """Takes the call lock within ``timeout`` (None: no limit), or raises TimeoutError
        naming the ``what`` another thread is in."""
        if not self.side_lock.acquire(timeout=-1 if timeout is None else max(timeout, 0.0)):
            raise TimeoutError(f"timed out waiting for another thread's {what} on this queue")

    def check_running(self) -> None:
        """``RuntimeError`` once the queue was shut down."""
        if self.shutdown.is_set():
            raise RuntimeError("MessageQueue was shut down")

    def time_left(self, deadline: float | None, what: str) -> float | None:
        """Seconds until ``deadline`` (None: no limit); ``RuntimeError`` once shut down,
        ``TimeoutError`` (nothing was sent) once past it."""
        self.check_running()
        if deadline is None:
            return None
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError(f"timed out waiting for {what}; the message was not sent")
        return left

    def abandon(self) -> None:
        """A constructor failed half-way: releases what it built now, not whenever a reference
        cycle through the traceback is collected."""
        self.closed = True
        self.finalizer()

    def close(self, drain_s: float, close_locked) -> None:
        """Runs ``close_locked(drain_s)`` (the end's own steps) once, in the owning process,
        with the call lock held when another thread lets go of it in time, then marks the
        resources released. Idempotent."""
        if self.closed or not self.in_owner():
            return
        self.closed = True
        # A call of this end in another thread sees the shutdown flag within one wait slice and
        # returns; waiting for it (bounded) means the ring and sockets are not closed under it.
        side_locked = self.side_lock.acquire(timeout=10 * WAIT_SLICE_S)
        try:
            close_locked(drain_s)
            self.finalizer()  # everything is closed already; marks it done
        finally:
            if side_locked:
                self.side_lock.release()
