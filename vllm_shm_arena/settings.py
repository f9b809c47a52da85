"""Every environment variable the Python side reads, in one place: name, default, meaning,
valid values, and when it is read.

Each variable is declared once below (``VARIABLES``) with its parser; the other modules ask for
a value through the functions of this module, which read ``os.environ`` (or a mapping a caller
passes) *when called* and raise ``ValueError`` naming the variable and the bad value. When a
value takes effect is the caller's choice, kept as it was: "Read" says which module reads it
and when. "At import" values are module constants of that module (tests patch those
constants); "per call" values follow the environment of the moment.

An empty value counts as unset (the default applies), except for ``VLLM_PLUGINS``, which vLLM
reads as "no plugin".

* ``VLLM_SHM_ARENA_POLICY``: the arena layout of the queues this process creates: one region
  packing any tensor up to its size, or fixed slots. Default: ``variable``. Valid: ``variable``
  or ``fixed``. Read at import (mq/writer.py), checked when a queue asks for an arena; per call
  by check.py.
* ``VLLM_SHM_ARENA_MB``: variable layout: the region's size, MiB. Default: ``2048``. Valid: a
  whole number >= 1. Read at import (mq/writer.py); per call by check.py.
* ``VLLM_SHM_ARENA_MAX_ALLOCATIONS``: variable layout: most tensors alive in the arena at once.
  Default: ``1024``. Valid: a whole number >= 1. Read at import (mq/writer.py); per call by
  check.py.
* ``VLLM_SHM_ARENA_NUM_SLOTS``: fixed layout: the number of slots. Default: ``8``. Valid: a
  whole number >= 1. Read at import (mq/writer.py); per call by check.py.
* ``VLLM_SHM_ARENA_SLOT_MB``: fixed layout: the size of a slot, MiB. Default: ``256``. Valid: a
  whole number >= 1. Read at import (mq/writer.py); per call by check.py.
* ``VLLM_SHM_ARENA_FREE_FRACTION``: the share of the free shared memory a smaller arena may take
  (sizing.py). Default: ``0.5``. Valid: a number in (0, 1]. Read per queue created with an
  arena, and per check.
* ``VLLM_SHM_ARENA_MIN_MB``: the smallest variable-size arena worth creating, MiB (sizing.py).
  Default: ``64``. Valid: a whole number >= 1. Read per queue created with an arena, per
  frontend arena, and per check.
* ``VLLM_SHM_ARENA_PIN``: readers page-lock the arena for CUDA copies once the process has a
  CUDA context. Default: ``1``. Valid: ``0`` turns it off; any other value leaves it on. Read at
  import (arena.py); per call by check.py.
* ``VLLM_SHM_ARENA_PIN_CHUNK_MB``: a reader pins its mapping in chunks of this many MiB.
  Default: ``0``. Valid: a whole number >= 0 (0: the extension's choice). Read per reader attach
  (arena.py).
* ``VLLM_SHM_ARENA_STREAM_MIN_MB``: a message's copies into the arena and the ring use streaming
  stores once they have written this many MiB. Default: the extension's (32 MiB). Valid: a whole
  number >= 0 (0 turns streaming off). Read at import (arena.py).
* ``VLLM_SHM_ARENA_FRAME_POOL_MB``: the warm buffers kept for large socket frames (idle ones, at
  most this many MiB, each for at most 10 s). Default: the extension's (512 MiB). Valid: a whole
  number >= 0 (0 keeps no idle buffer). Read at import (arena.py).
* ``VLLM_SHM_ARENA_BLOB_MB``: a queue without a tensor arena packs each message too big for a
  ring chunk into a blob region in shared memory of at most this many MiB (pages reserved as
  used, at most VLLM_SHM_ARENA_FREE_FRACTION of the free space) instead of sending it over the
  local socket. Default: ``512``. Valid: a whole number >= 0 (0: no region; such messages go
  over the local socket). Read at import (mq/writer.py).
* ``VLLM_SHM_ARENA_FRONTEND``: with the plugin active and --enable-shm-tensor-arena, vLLM's API
  server copies each new multimodal item's large tensors once into a frontend arena in shared
  memory and sends them to the engine core by reference (a stub) instead of over its socket.
  Default: ``1``. Valid: ``0`` turns it off; any other value leaves it on. Read when the API
  server builds its multimodal cache (vllm_frontend.py).
* ``VLLM_SHM_ARENA_RESPONSE_QUEUES``: with the plugin active and --enable-shm-tensor-arena, each
  worker's response queue (its step outputs to the engine core) is this package's queue too,
  without a tensor arena: the engine core waits for the workers on our ring, spinning only while
  messages flow (50 ms) and no other thread computes on its CPU, then asleep, where vLLM's
  reader spins a second after every message. Default: ``1``. Valid: ``0`` turns it off; any
  other value leaves it on. Read when a worker builds its response queue (vllm_plugin.py).
* ``VLLM_SHM_ARENA_FRONTEND_HANDLE``: the frontend arena's handle (JSON), which vLLM's API
  server sets for the engine core it starts. Default: unset. Valid: set by the package, never by
  hand (checked field by field where read). Read when the engine core is built, before its
  executor (vllm_frontend.py).
* ``VLLM_SHM_ARENA_DEBUG_CHECKSUM``: the writer checksums each tensor and readers report
  releases whose bytes changed (an in-place write by a reader). Default: unset. Valid: ``1``
  turns it on; any other value leaves it off. Read per arena created (arena.py).
* ``VLLM_SHM_ARENA_TCP_TIMEOUT_S``: a queue's TCP connection to another node that hears nothing
  from the peer's kernel this long is dropped (TCP keepalive probes); a reader then raises
  WriterDiedError after what arrived before, where a silent partition would otherwise leave it
  waiting. Default: ``60``. Valid: a whole number of seconds from 0 to 65535 (0: the kernel's
  keepalive settings; the kernel takes at most 32767 s of idle time, half of the timeout). Read
  per remote socket (mq/transport.py).
* ``VLLM_SHM_ARENA_TCP_SECURITY``: what a queue's TCP socket guarantees beyond both ends proving
  the queue's secret (always): ``authenticated`` (messages in the clear, every frame a reader
  acts on carries a MAC) or ``encrypted`` (CurveZMQ: confidentiality too, at a cost in
  throughput; docs/safety.md). Readers follow the writer's choice (it travels in the handle).
  Default: ``authenticated``. Valid: ``authenticated`` or ``encrypted``. Read per queue created
  with remote readers (mq/writer.py).
* ``VLLM_RINGBUFFER_WARNING_INTERVAL``: vLLM's: how often a reader waiting for a message logs
  that it is still waiting (vLLM's module constant wins when vLLM is loaded). Default: ``60``.
  Valid: a number of seconds >= 0. Read at import (mq/reader.py).
* ``VLLM_HOST_IP``: vLLM's: the address a queue with remote readers binds when given none.
  Default: unset. Valid: an address remote readers can reach. Read per queue created with remote
  readers and no connect_ip (mq/transport.py).
* ``VLLM_MQ_MAX_CHUNK_BYTES_MB``: vLLM's: its broadcast ring's chunk size, MiB; check.py sizes
  the ring from it. Default: ``16``. Valid: read as vLLM reads it (a whole number; anything else
  counts as the default here). Read per check (check.py).
* ``VLLM_PLUGINS``: vLLM's: which plugins load; check.py says whether ours is among them.
  Default: unset. Valid: vLLM's comma-separated plugin names (no spaces stripped). Read per
  check (check.py).
* ``PROMETHEUS_MULTIPROC_DIR`` (or ``prometheus_multiproc_dir``): prometheus_client's
  multi-process mode: metrics.py then uses live-summed gauges. Default: unset. Valid: a
  directory. Read per metrics call (metrics.py).

Read by the extension (C++), not here: ``VLLM_SHM_ARENA_SHM_DIR`` (the shared-memory
directory, default ``/dev/shm``) and ``VLLM_SHM_ARENA_CUDART`` (the path of the CUDA runtime
library to use when the one torch loaded is not found).

``table()`` renders the same list as a Markdown table (docs/configuration.md includes it).
"""

from __future__ import annotations

import os
import textwrap
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

_MIB = 1 << 20
#: The largest VLLM_SHM_ARENA_TCP_TIMEOUT_S: half of it is the keepalive idle time, and the
#: kernel refuses more than 32767 s there (MAX_TCP_KEEPIDLE), failing every connection.
MAX_TCP_TIMEOUT_S = 65535


@dataclass(frozen=True)
class Variable:
    """One environment variable: how it is written, parsed and documented."""

    name: str
    #: The default as written in the table ("" when unset is its own meaning).
    default: str
    valid: str
    meaning: str
    read: str
    #: raw (never empty) -> value; ``ValueError`` (any message) for a bad one.
    parse: Callable[[str], Any]
    #: The value when unset or empty.
    unset: Any = None
    #: Also looked up under these names, in order, when ``name`` is unset.
    aliases: tuple[str, ...] = ()
    #: Whether an empty value counts as unset (it does, except where its reader says
    #: otherwise: vLLM reads an empty ``VLLM_PLUGINS`` as "no plugin").
    empty_is_unset: bool = True


def _whole(minimum: int, maximum: int | None = None) -> Callable[[str], int]:
    def parse(raw: str) -> int:
        value = int(raw)  # ValueError for "64.5", "big"
        if value < minimum or (maximum is not None and value > maximum):
            raise ValueError
        return value

    return parse


def _fraction(raw: str) -> float:
    value = float(raw)
    if not (0.0 < value <= 1.0):  # NaN fails too
        raise ValueError
    return value


def _seconds(raw: str) -> float:
    value = float(raw)
    if not value >= 0.0:  # NaN fails too
        raise ValueError
    return value


def _choice(*allowed: str) -> Callable[[str], str]:
    def parse(raw: str) -> str:
        if raw not in allowed:
            raise ValueError
        return raw

    return parse


_policy = _choice("variable", "fixed")


def _lenient_whole(raw: str) -> int | None:
    try:
        return int(raw)
    except ValueError:
        return None


def _text(raw: str) -> str:
    return raw


VARIABLES: tuple[Variable, ...] = (
    Variable(
        "VLLM_SHM_ARENA_POLICY",
        "`variable`",
        "`variable` or `fixed`",
        "the arena layout of the queues this process creates: one region packing any tensor "
        "up to its size, or fixed slots",
        "at import (mq/writer.py), checked when a queue asks for an arena; per call by check.py",
        _policy,
        unset="variable",
    ),
    Variable(
        "VLLM_SHM_ARENA_MB",
        "`2048`",
        "a whole number >= 1",
        "variable layout: the region's size, MiB",
        "at import (mq/writer.py); per call by check.py",
        _whole(1),
        unset=2048,
    ),
    Variable(
        "VLLM_SHM_ARENA_MAX_ALLOCATIONS",
        "`1024`",
        "a whole number >= 1",
        "variable layout: most tensors alive in the arena at once",
        "at import (mq/writer.py); per call by check.py",
        _whole(1),
        unset=1024,
    ),
    Variable(
        "VLLM_SHM_ARENA_NUM_SLOTS",
        "`8`",
        "a whole number >= 1",
        "fixed layout: the number of slots",
        "at import (mq/writer.py); per call by check.py",
        _whole(1),
        unset=8,
    ),
    Variable(
        "VLLM_SHM_ARENA_SLOT_MB",
        "`256`",
        "a whole number >= 1",
        "fixed layout: the size of a slot, MiB",
        "at import (mq/writer.py); per call by check.py",
        _whole(1),
        unset=256,
    ),
    Variable(
        "VLLM_SHM_ARENA_FREE_FRACTION",
        "`0.5`",
        "a number in (0, 1]",
        "the share of the free shared memory a smaller arena may take (sizing.py)",
        "per queue created with an arena, and per check",
        _fraction,
        unset=0.5,
    ),
    Variable(
        "VLLM_SHM_ARENA_MIN_MB",
        "`64`",
        "a whole number >= 1",
        "the smallest variable-size arena worth creating, MiB (sizing.py)",
        "per queue created with an arena, per frontend arena, and per check",
        _whole(1),
        unset=64,
    ),
    Variable(
        "VLLM_SHM_ARENA_PIN",
        "`1`",
        "`0` turns it off; any other value leaves it on",
        "readers page-lock the arena for CUDA copies once the process has a CUDA context",
        "at import (arena.py); per call by check.py",
        lambda raw: raw != "0",
        unset=True,
    ),
    Variable(
        "VLLM_SHM_ARENA_PIN_CHUNK_MB",
        "`0`",
        "a whole number >= 0 (0: the extension's choice)",
        "a reader pins its mapping in chunks of this many MiB",
        "per reader attach (arena.py)",
        _whole(0),
        unset=0,
    ),
    Variable(
        "VLLM_SHM_ARENA_STREAM_MIN_MB",
        "the extension's (32 MiB)",
        "a whole number >= 0 (0 turns streaming off)",
        "a message's copies into the arena and the ring use streaming stores once they have "
        "written this many MiB",
        "at import (arena.py)",
        _whole(0),
    ),
    Variable(
        "VLLM_SHM_ARENA_FRAME_POOL_MB",
        "the extension's (512 MiB)",
        "a whole number >= 0 (0 keeps no idle buffer)",
        "the warm buffers kept for large socket frames (idle ones, at most this many MiB, "
        "each for at most 10 s)",
        "at import (arena.py)",
        _whole(0),
    ),
    Variable(
        "VLLM_SHM_ARENA_BLOB_MB",
        "`512`",
        "a whole number >= 0 (0: no region; such messages go over the local socket)",
        "a queue without a tensor arena packs each message too big for a ring chunk into a blob "
        "region in shared memory of at most this many MiB (pages reserved as used, at most "
        "VLLM_SHM_ARENA_FREE_FRACTION of the free space) instead of sending it over the local "
        "socket",
        "at import (mq/writer.py)",
        _whole(0),
        unset=512,
    ),
    Variable(
        "VLLM_SHM_ARENA_FRONTEND",
        "`1`",
        "`0` turns it off; any other value leaves it on",
        "with the plugin active and --enable-shm-tensor-arena, vLLM's API server copies each new "
        "multimodal item's large tensors once into a frontend arena in shared memory and sends "
        "them to the engine core by reference (a stub) instead of over its socket",
        "when the API server builds its multimodal cache (vllm_frontend.py)",
        lambda raw: raw != "0",
        unset=True,
    ),
    Variable(
        "VLLM_SHM_ARENA_RESPONSE_QUEUES",
        "`1`",
        "`0` turns it off; any other value leaves it on",
        "with the plugin active and --enable-shm-tensor-arena, each worker's response queue "
        "(its step outputs to the engine core) is this package's queue too, without a tensor "
        "arena: the engine core waits for the workers on our ring, spinning only while messages "
        "flow (50 ms) and no other thread computes on its CPU, then asleep, where vLLM's reader "
        "spins a second after every message",
        "when a worker builds its response queue (vllm_plugin.py)",
        lambda raw: raw != "0",
        unset=True,
    ),
    Variable(
        "VLLM_SHM_ARENA_FRONTEND_HANDLE",
        "unset",
        "set by the package, never by hand (checked field by field where read)",
        "the frontend arena's handle (JSON), which vLLM's API server sets for the engine core "
        "it starts",
        "when the engine core is built, before its executor (vllm_frontend.py)",
        _text,
    ),
    Variable(
        "VLLM_SHM_ARENA_DEBUG_CHECKSUM",
        "unset",
        "`1` turns it on; any other value leaves it off",
        "the writer checksums each tensor and readers report releases whose bytes changed (an "
        "in-place write by a reader)",
        "per arena created (arena.py)",
        lambda raw: raw == "1",
        unset=False,
    ),
    Variable(
        "VLLM_SHM_ARENA_TCP_TIMEOUT_S",
        "`60`",
        "a whole number of seconds from 0 to 65535 (0: the kernel's keepalive settings; the "
        "kernel takes at most 32767 s of idle time, half of the timeout)",
        "a queue's TCP connection to another node that hears nothing from the peer's kernel "
        "this long is dropped (TCP keepalive probes); a reader then raises WriterDiedError "
        "after what arrived before, where a silent partition would otherwise leave it waiting",
        "per remote socket (mq/transport.py)",
        _whole(0, MAX_TCP_TIMEOUT_S),
        unset=60,
    ),
    Variable(
        "VLLM_SHM_ARENA_TCP_SECURITY",
        "`authenticated`",
        "`authenticated` or `encrypted`",
        "what a queue's TCP socket guarantees beyond both ends proving the queue's secret "
        "(always): `authenticated` (messages in the clear, every frame a reader acts on carries "
        "a MAC) or `encrypted` (CurveZMQ: confidentiality too, at a cost in throughput; "
        "docs/safety.md). Readers follow the writer's choice (it travels in the handle)",
        "per queue created with remote readers (mq/writer.py)",
        _choice("authenticated", "encrypted"),
        unset="authenticated",
    ),
    Variable(
        "VLLM_RINGBUFFER_WARNING_INTERVAL",
        "`60`",
        "a number of seconds >= 0",
        "vLLM's: how often a reader waiting for a message logs that it is still waiting "
        "(vLLM's module constant wins when vLLM is loaded)",
        "at import (mq/reader.py)",
        _seconds,
        unset=60.0,
    ),
    Variable(
        "VLLM_HOST_IP",
        "unset",
        "an address remote readers can reach",
        "vLLM's: the address a queue with remote readers binds when given none",
        "per queue created with remote readers and no connect_ip (mq/transport.py)",
        _text,
    ),
    Variable(
        "VLLM_MQ_MAX_CHUNK_BYTES_MB",
        "`16`",
        "read as vLLM reads it (a whole number; anything else counts as the default here)",
        "vLLM's: its broadcast ring's chunk size, MiB; check.py sizes the ring from it",
        "per check (check.py)",
        _lenient_whole,
    ),
    Variable(
        "VLLM_PLUGINS",
        "unset",
        "vLLM's comma-separated plugin names (no spaces stripped)",
        "vLLM's: which plugins load; check.py says whether ours is among them",
        "per check (check.py)",
        _text,
        empty_is_unset=False,
    ),
    Variable(
        "PROMETHEUS_MULTIPROC_DIR",
        "unset",
        "a directory",
        "prometheus_client's multi-process mode: metrics.py then uses live-summed gauges",
        "per metrics call (metrics.py)",
        _text,
        aliases=("prometheus_multiproc_dir",),
    ),
)

_BY_NAME: dict[str, Variable] = {v.name: v for v in VARIABLES}

#: Read by the extension (C++), not by this module: listed so the documentation is complete.
READ_BY_EXTENSION: tuple[str, ...] = ("VLLM_SHM_ARENA_SHM_DIR", "VLLM_SHM_ARENA_CUDART")


def value(name: str, environ: Mapping[str, str] | None = None) -> Any:
    """The parsed value of variable ``name`` in ``environ`` (default: ``os.environ``, now).
    ``ValueError`` naming the variable for a bad value; ``KeyError`` for a name not declared
    in ``VARIABLES``."""
    var = _BY_NAME[name]
    env = os.environ if environ is None else environ
    for key in (var.name, *var.aliases):
        raw = env.get(key)
        if raw or (raw is not None and not var.empty_is_unset):
            return check(name, raw, key)
    return var.unset


def check(name: str, raw: str, key: str | None = None) -> Any:
    """``raw`` parsed as variable ``name`` parses it (a value read earlier and checked only
    when used); ``ValueError`` naming the variable (``key``: the spelling it was read under)
    otherwise."""
    var = _BY_NAME[name]
    try:
        return var.parse(raw)
    except ValueError:
        raise ValueError(f"{key or name} must be {_plain(var.valid)}, got {raw!r}") from None


def _plain(text: str) -> str:
    return text.replace("`", "'")


def listing(width: int = 96) -> str:
    """The variables as a wrapped reStructuredText list (the module docstring's)."""
    out = []
    for v in VARIABLES:
        names = " (or ".join(f"``{n}``" for n in (v.name, *v.aliases)) + ")" * len(v.aliases)
        text = (
            (f"{names}: {v.meaning}. Default: {v.default}. Valid: {v.valid}. Read {v.read}.")
            .replace("``", "\0")
            .replace("`", "``")
            .replace("\0", "``")
        )
        out.append(
            textwrap.fill(
                text,
                width,
                initial_indent="* ",
                subsequent_indent="  ",
                break_on_hyphens=False,
            )
        )
    return "\n".join(out)


def table() -> str:
    """The variables as a Markdown table (docs/configuration.md's)."""
    rows = [
        "| variable | default | valid values | meaning | read |",
        "|---|---|---|---|---|",
    ]
    for v in VARIABLES:
        name = f"`{v.name}`" + "".join(f" (or `{a}`)" for a in v.aliases)
        rows.append(f"| {name} | {v.default} | {v.valid} | {v.meaning} | {v.read} |")
    return "\n".join(rows)


# ---------------------------------------------------------------------------- accessors
# One per variable, so call sites read as what they ask for.
Env = Mapping[str, str] | None


def arena_policy(environ: Env = None) -> str:
    """``VLLM_SHM_ARENA_POLICY``: "variable" or "fixed"."""
    return value("VLLM_SHM_ARENA_POLICY", environ)


def arena_policy_unchecked(environ: Env = None) -> str:
    """``VLLM_SHM_ARENA_POLICY`` as written ("variable" when unset), not checked yet: a queue
    reads it at import and checks it (``check_arena_policy``) only when it asks for an arena,
    so a bad value never fails a queue without one."""
    env = os.environ if environ is None else environ
    return env.get("VLLM_SHM_ARENA_POLICY") or _BY_NAME["VLLM_SHM_ARENA_POLICY"].unset


def check_arena_policy(policy: str) -> str:
    """``policy`` if ``VLLM_SHM_ARENA_POLICY`` allows it, else the variable's ``ValueError``."""
    return check("VLLM_SHM_ARENA_POLICY", policy)


def arena_bytes(environ: Env = None) -> int:
    """``VLLM_SHM_ARENA_MB``, in bytes."""
    return value("VLLM_SHM_ARENA_MB", environ) * _MIB


def arena_max_allocations(environ: Env = None) -> int:
    """``VLLM_SHM_ARENA_MAX_ALLOCATIONS``."""
    return value("VLLM_SHM_ARENA_MAX_ALLOCATIONS", environ)


def arena_num_slots(environ: Env = None) -> int:
    """``VLLM_SHM_ARENA_NUM_SLOTS``."""
    return value("VLLM_SHM_ARENA_NUM_SLOTS", environ)


def arena_slot_bytes(environ: Env = None) -> int:
    """``VLLM_SHM_ARENA_SLOT_MB``, in bytes."""
    return value("VLLM_SHM_ARENA_SLOT_MB", environ) * _MIB


def free_fraction(environ: Env = None) -> float:
    """``VLLM_SHM_ARENA_FREE_FRACTION``, in (0, 1]."""
    return value("VLLM_SHM_ARENA_FREE_FRACTION", environ)


def min_arena_bytes(environ: Env = None) -> int:
    """``VLLM_SHM_ARENA_MIN_MB``, in bytes."""
    return value("VLLM_SHM_ARENA_MIN_MB", environ) * _MIB


def pin_enabled(environ: Env = None) -> bool:
    """``VLLM_SHM_ARENA_PIN``: False only for "0"."""
    return value("VLLM_SHM_ARENA_PIN", environ)


def pin_chunk_bytes(environ: Env = None) -> int:
    """``VLLM_SHM_ARENA_PIN_CHUNK_MB``, in bytes (0: the extension's choice)."""
    return value("VLLM_SHM_ARENA_PIN_CHUNK_MB", environ) * _MIB


def stream_min_bytes(environ: Env = None) -> int | None:
    """``VLLM_SHM_ARENA_STREAM_MIN_MB``, in bytes; None when unset (the extension's default
    stays)."""
    mib = value("VLLM_SHM_ARENA_STREAM_MIN_MB", environ)
    return None if mib is None else mib * _MIB


def blob_region_bytes(environ: Env = None) -> int:
    """``VLLM_SHM_ARENA_BLOB_MB``, in bytes."""
    return value("VLLM_SHM_ARENA_BLOB_MB", environ) * _MIB


def frame_pool_bytes(environ: Env = None) -> int | None:
    """``VLLM_SHM_ARENA_FRAME_POOL_MB``, in bytes; None when unset (the extension's default
    stays)."""
    mib = value("VLLM_SHM_ARENA_FRAME_POOL_MB", environ)
    return None if mib is None else mib * _MIB


def frontend_enabled(environ: Env = None) -> bool:
    """``VLLM_SHM_ARENA_FRONTEND``: False only for "0"."""
    return value("VLLM_SHM_ARENA_FRONTEND", environ)


def response_queues_enabled(environ: Env = None) -> bool:
    """``VLLM_SHM_ARENA_RESPONSE_QUEUES``: False only for "0"."""
    return value("VLLM_SHM_ARENA_RESPONSE_QUEUES", environ)


def frontend_handle(environ: Env = None) -> str | None:
    """``VLLM_SHM_ARENA_FRONTEND_HANDLE``: the raw JSON, or None when unset."""
    return value("VLLM_SHM_ARENA_FRONTEND_HANDLE", environ)


def set_frontend_handle(raw: str) -> None:
    """Sets ``VLLM_SHM_ARENA_FRONTEND_HANDLE`` in this process's environment (which the
    processes it starts inherit)."""
    os.environ["VLLM_SHM_ARENA_FRONTEND_HANDLE"] = raw


def debug_checksum(environ: Env = None) -> bool:
    """``VLLM_SHM_ARENA_DEBUG_CHECKSUM``: True only for "1"."""
    return value("VLLM_SHM_ARENA_DEBUG_CHECKSUM", environ)


def tcp_timeout_s(environ: Env = None) -> int:
    """``VLLM_SHM_ARENA_TCP_TIMEOUT_S``, whole seconds (0: the kernel's keepalive settings)."""
    return value("VLLM_SHM_ARENA_TCP_TIMEOUT_S", environ)


def tcp_security(environ: Env = None) -> str:
    """``VLLM_SHM_ARENA_TCP_SECURITY``: ``"authenticated"`` or ``"encrypted"``."""
    return value("VLLM_SHM_ARENA_TCP_SECURITY", environ)


def ringbuffer_warning_interval(environ: Env = None) -> float:
    """``VLLM_RINGBUFFER_WARNING_INTERVAL``, seconds."""
    return value("VLLM_RINGBUFFER_WARNING_INTERVAL", environ)


def host_ip(environ: Env = None) -> str | None:
    """``VLLM_HOST_IP``, or None when unset."""
    return value("VLLM_HOST_IP", environ)


def mq_max_chunk_mb(environ: Env = None) -> int | None:
    """``VLLM_MQ_MAX_CHUNK_BYTES_MB`` as a whole number, or None when unset or not a whole
    number (the caller applies vLLM's default)."""
    return value("VLLM_MQ_MAX_CHUNK_BYTES_MB", environ)


def vllm_plugins(environ: Env = None) -> str | None:
    """``VLLM_PLUGINS`` as written, or None when unset."""
    return value("VLLM_PLUGINS", environ)


def prometheus_multiproc_dir(environ: Env = None) -> str | None:
    """``PROMETHEUS_MULTIPROC_DIR`` (or its lower-case spelling), or None when unset."""
    return value("PROMETHEUS_MULTIPROC_DIR", environ)
