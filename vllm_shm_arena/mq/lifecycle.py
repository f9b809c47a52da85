"""The process side of a queue end: who owns it, how it ends, and what is released when
nobody ends it.

* ``Lifecycle``: per end, the owning pid (a forked child inherits objects, not roles), the
  shutdown flag every wait checks, the lock that serialises the end's calls (``_C.CallLock``:
  taken and released in C, so a signal handler's exception never leaves it held), and the
  ``Resources`` a ``weakref.finalize`` releases when the end is dropped unclosed.
* ``shutdown_at_exit``: the ``atexit`` hook that shuts down this process's live ends (it
  closes the extension's gate of GIL-released calls first).

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
from collections.abc import Callable
from typing import Any

from vllm_shm_arena._ext import _C

logger = logging.getLogger("vllm_shm_arena")

#: How long a blocking wait sleeps in C++ before Python checks for shutdown/timeouts.
WAIT_SLICE_S = 0.1
#: At interpreter exit, how long to wait for threads to leave GIL-released calls.
EXIT_WAIT_S = 2.0
#: How long the writer's shutdown() waits for queued socket frames to reach the readers.
DRAIN_S = 5.0

#: Every queue end this process built, for the exit hook (weak: never keeps one alive).
LIVE: weakref.WeakSet[Any] = weakref.WeakSet()


def call_timeout(timeout: float | None) -> float:
    """A call's ``timeout`` as ``CallLock.hold`` takes it: < 0 waits without limit."""
    return -1.0 if timeout is None else max(timeout, 0.0)


def shutdown_at_exit(
    live: weakref.WeakSet = LIVE,
    close_and_wait: Callable[[float], int] | None = None,
    wait_s: float = EXIT_WAIT_S,
) -> None:
    """Shuts down this process's live queue ends before Python finalizes: wakes blocked
    waits, lets no new GIL-released call start, and waits a bounded time for threads to
    leave the ones they are in (``close_and_wait``: the extension's gate, counted in C++ so
    that neither a signal handler's exception nor a fork can leave the count wrong; see
    ``NoGilGate`` in csrc/bindings/gil.h)."""
    if close_and_wait is None:
        close_and_wait = _C.nogil_gate_close_and_wait
    pid = os.getpid()
    # A forked child's inherited queues belong to its parent: leave them alone.
    ends = [e for e in list(live) if e.lifecycle.pid == pid]
    for e in ends:
        e.lifecycle.shutdown.set()  # every wait loop checks it at least once per WAIT_SLICE_S
    left = close_and_wait(wait_s)
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
        # reader) and the timed report: the C++ ring ends are single-threaded. A call holds it
        # through ``self.call(timeout, what, fn, *args)`` (``_C.call_locked``: taken and let go
        # in C); a nested call of the same thread (a signal handler) is refused.
        self.call_lock = _C.CallLock()
        self.resources = Resources(self.pid)
        self.finalizer = weakref.finalize(owner, Resources.release, self.resources)
        # Not at exit on its own: the exit hook runs it after waking blocked threads.
        self.finalizer.atexit = False
        LIVE.add(owner)

    def call(self, timeout: float | None, what: str, fn, *args):
        """``fn(*args)`` holding the call lock (taken within ``timeout``, None: no limit, or
        TimeoutError naming ``what``), taken and let go in C whatever happens."""
        return _C.call_locked(self.call_lock, call_timeout(timeout), what, fn, args)

    def in_owner(self) -> bool:
        """Whether this process built the end (not a forked child holding a copy)."""
        return os.getpid() == self.pid

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
        call_locked = self.call_lock.acquire(timeout=10 * WAIT_SLICE_S)
        try:
            close_locked(drain_s)
            self.finalizer()  # everything is closed already; marks it done
        finally:
            if call_locked:
                self.call_lock.release()
