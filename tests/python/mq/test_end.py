"""The facade and its role objects: each role (writer, local reader, remote reader) is built by
its own constructor with exactly its state, stays a ``MessageQueue``, and fails the calls of
other roles with the errors the queue has always raised; no method tests a role flag. Also
the parts with no queue around them: the writer's argument checks, the wire format
(mq/protocol.py), and a reader's unpickling with a real arena (mq/reader.py)."""

from __future__ import annotations

import ast
import os
import pickle
import struct
import sys
from pathlib import Path

import pytest
import torch
from mq_helpers import ready_in_threads  # noqa: E402

from vllm_shm_arena import dumps, message_queue  # noqa: E402
from vllm_shm_arena.message_queue import Handle, MessageQueue, WriterDiedError  # noqa: E402
from vllm_shm_arena.mq import protocol, reader  # noqa: E402
from vllm_shm_arena.mq.reader import LocalReaderEnd, RemoteReaderEnd  # noqa: E402
from vllm_shm_arena.mq.writer import WriterEnd  # noqa: E402

PACKAGE = Path(__file__).resolve().parents[3] / "vllm_shm_arena"
MiB = 1 << 20
FLAGS = {"_is_writer", "_is_local_reader", "_is_remote_reader"}


@pytest.fixture
def roles(writers):
    """A writer with one local and one remote reader, ready; shut down at teardown."""
    w = MessageQueue(2, 1, max_chunk_bytes=MiB, max_chunks=4, connect_ip="127.0.0.1")
    writers(w)
    local = MessageQueue.create_from_handle(w.export_handle(), 0)
    writers(local)
    remote = MessageQueue.create_from_handle(w.export_handle(), 1)
    writers(remote)
    ready_in_threads(w, [local, remote])
    return w, local, remote


def test_each_role_is_a_message_queue_with_exactly_its_state(roles):
    w, local, remote = roles
    for q in roles:
        assert type(q) is MessageQueue  # the plugin's factory and vLLM check isinstance
    assert set(vars(w)) == {
        "_end",
        "handle",
        "n_reader",
        "n_local_reader",
        "n_remote_reader",
        "max_chunk_bytes",
        "local_reader_rank",
        *FLAGS,
    }
    reader_state = {"_end", "handle", "n_local_reader", "local_reader_rank", *FLAGS}
    assert set(vars(local)) == reader_state and set(vars(remote)) == reader_state
    assert (w._is_writer, w._is_local_reader, w._is_remote_reader) == (True, False, False)
    assert (local._is_writer, local._is_local_reader, local._is_remote_reader) == (
        False,
        True,
        False,
    )
    assert (remote._is_writer, remote._is_local_reader, remote._is_remote_reader) == (
        False,
        False,
        True,
    )
    assert (w.local_reader_rank, local.local_reader_rank, remote.local_reader_rank) == (-1, 0, -1)
    assert (w.n_reader, w.n_remote_reader, w.max_chunk_bytes) == (2, 1, MiB)
    assert type(w._end) is WriterEnd
    assert type(local._end) is LocalReaderEnd
    assert type(remote._end) is RemoteReaderEnd


def test_each_end_has_only_its_roles_state(roles):
    w, local, remote = roles
    common = {"lifecycle", "reporter", "counters"}
    assert set(vars(w._end)) == common | {
        "n_local_reader",
        "n_remote_reader",
        "max_chunk_bytes",
        "serialize_inband",
        "broken",
        "ring",
        "arena",
        "arena_size",
        "blob_region",
        "blob_max",
        "forward_source",
        "sockets",
        "handle",
        "roster",
        "seq",
        "pending",
        "keys",
    }
    readers = common | {"handle", "keys", "last_dequeue_s", "socket", "inbox", "broken"}
    assert set(vars(local._end)) == readers | {
        "index",
        "ring",
        "arena",
        "blob_region",
        "ended",
        "frontend",
    }
    assert set(vars(remote._end)) == readers | {"ranks", "checked"}


def test_the_sockets_and_the_arena_are_the_ends(roles):
    w, local, remote = roles
    assert w.local_socket is w._end.sockets.local and w.remote_socket is w._end.sockets.remote
    assert local.local_socket is local._end.socket.sock and local.remote_socket is None
    assert remote.remote_socket is remote._end.socket.sock and remote.local_socket is None
    assert w.arena is None and w.tensor_arena is None and remote.arena is None
    with pytest.raises(AttributeError):
        w.tensor_arena = None  # read-only, as vLLM's


def test_the_calls_of_other_roles_fail_as_they_always_did(roles):
    w, local, remote = roles
    for r in (local, remote):
        with pytest.raises(RuntimeError, match="only the writer can enqueue"):
            r.enqueue("x")
        with pytest.raises(RuntimeError, match="only the writer can lend tensors"):
            r.empty((4,))
        with pytest.raises(AttributeError):
            r.serialize_inband  # noqa: B018 - the writer's option only
    with pytest.raises(RuntimeError, match="the writer cannot dequeue"):
        w.dequeue(timeout=0.1)
    with pytest.raises(AttributeError):
        w.last_dequeue_s  # noqa: B018 - readers only


def test_every_role_carries_a_message_its_way(roles):
    w, local, remote = roles
    w.enqueue({"n": 1, "t": torch.arange(4)}, timeout=10)
    w.enqueue(b"y" * (2 * MiB), timeout=10)  # overflow: the local socket
    assert w.broadcast_object("z") == "z"
    for r in (local, remote):
        first = r.dequeue(timeout=10)
        assert first["n"] == 1 and torch.equal(first["t"], torch.arange(4))
        assert len(r.dequeue(timeout=10)) == 2 * MiB
        assert r.broadcast_object() == "z"
        assert r.last_dequeue_s >= 0.0
    assert w.stats()["role"] == "writer" and w.stats()["messages"] == 3
    assert local.stats()["role"] == "local_reader" and local.stats()["overflow_messages"] == 1
    assert remote.stats()["role"] == "remote_reader" and remote.stats()["messages"] == 3


def test_no_method_of_the_queue_tests_a_role_flag():
    """The role flags are data the role constructors set (vLLM-facing code reads them); no
    method of the facade or of its parts branches on them."""
    reads = []
    for path in [PACKAGE / "message_queue.py", *sorted((PACKAGE / "mq").glob("*.py"))]:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and node.attr in FLAGS:
                if not isinstance(node.ctx, ast.Store):
                    reads.append(f"{path.name}:{node.lineno} {node.attr}")
    assert reads == []


# ------------------------------------------------------------------ the writer's arguments
@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(n_reader=-1, n_local_reader=0), "n_reader must be an int >= 0"),
        (dict(n_reader=True, n_local_reader=0), "n_reader must be an int"),
        (dict(n_reader=1, n_local_reader=2), r"0 <= n_local_reader \(2\) <= n_reader \(1\)"),
        (dict(n_reader=1, n_local_reader=1, max_chunks=0), "max_chunks must be an int >= 1"),
        (dict(n_reader=2, n_local_reader=2, local_reader_ranks=[0]), "has 1 entries"),
        (dict(n_reader=2, n_local_reader=1, connect_ip=7), "remote readers need connect_ip"),
    ],
)
def test_the_writers_arguments_are_checked_before_anything_is_built(kwargs, match):
    args = dict(
        local_reader_ranks=None,
        max_chunk_bytes=MiB,
        max_chunks=4,
        connect_ip=None,
        enable_arena=False,
    )
    args.update(kwargs)
    with pytest.raises(ValueError, match=match):
        WriterEnd.check_args(**args)


def test_the_writers_arguments_get_their_defaults():
    ranks, ip, roster = WriterEnd.check_args(3, 3, None, MiB, 4, None, False)
    assert ranks == [0, 1, 2] and ip is None and roster.n == 0
    _, ip, roster = WriterEnd.check_args(4, 2, [0, 1], MiB, 4, "127.0.0.1", False)
    assert roster.expected == {2, 3}
    _, _, roster = WriterEnd.check_args(4, 2, [3, 4], MiB, 4, "127.0.0.1", False)
    assert roster.expected is None and roster.n == 2 and roster.local == {3, 4}


def test_a_bad_arena_policy_fails_only_a_queue_that_asks_for_an_arena(monkeypatch):
    from vllm_shm_arena.mq import writer

    monkeypatch.setattr(writer, "_ARENA_POLICY", "slots")
    WriterEnd.check_args(1, 1, None, MiB, 4, None, False)
    with pytest.raises(ValueError, match="VLLM_SHM_ARENA_POLICY"):
        WriterEnd.check_args(1, 1, None, MiB, 4, None, True)


def test_joining_checks_the_handle_and_the_rank():
    with pytest.raises(TypeError, match="expected a MessageQueue Handle"):
        MessageQueue.create_from_handle(object(), 0)
    with pytest.raises(ValueError, match="rank must be an int >= 0"):
        MessageQueue.create_from_handle(Handle(), -1)
    with pytest.raises(ValueError, match="not a local reader and the queue has no remote"):
        MessageQueue.create_from_handle(Handle(local_reader_ranks=[0]), 1)


# ------------------------------------------------------------------ the wire format
def test_the_arena_records_header_round_trips():
    recs = [(0, 1), (7, 1 << 40), ((1 << 64) - 1, 3)]
    frame = protocol.diverted_header(recs)
    assert len(frame) == 16 * len(recs)
    assert protocol.parse_diverted(frame) == recs
    assert protocol.parse_diverted(memoryview(bytearray(frame))) == recs
    assert protocol.diverted_header([]) == b"" and protocol.parse_diverted(b"") == []
    assert protocol.parse_diverted(frame[:-8]) == []  # not whole pairs: nothing


def test_frame_0_with_forwards_round_trips_and_reads_as_before_without():
    div, fwd = [(0, 1), (7, 1 << 40)], [(3, 9), (3, 9), (5, 2)]
    frame = protocol.diverted_header(div, fwd)
    assert len(frame) == 16 * 5 + 8  # pairs, then the forward count: 8 mod 16
    assert protocol.parse_header(frame) == (div, fwd)
    assert protocol.parse_header(memoryview(bytearray(frame))) == (div, fwd)
    assert protocol.parse_diverted(frame) == div
    assert protocol.diverted_header([], fwd) != b""
    assert protocol.parse_header(protocol.diverted_header([], fwd)) == ([], fwd)
    assert protocol.diverted_header(div, []) == protocol.diverted_header(div)  # as before
    assert protocol.parse_header(protocol.diverted_header(div)) == (div, [])
    # A count that does not fit the frame, or is 0, or a length not whole <Q: nothing.
    flat = struct.pack("<5Q", 1, 2, 3, 4, 3)  # 2 pairs, a count of 3
    assert protocol.parse_header(flat) == ([], [])
    assert protocol.parse_header(struct.pack("<3Q", 1, 2, 0)) == ([], [])
    assert protocol.parse_header(frame[:-3]) == ([], [])
    assert protocol.parse_diverted(flat) == []


def test_the_public_names_live_where_users_import_them():
    assert Handle.__module__ == WriterDiedError.__module__ == "vllm_shm_arena.message_queue"
    assert message_queue.Handle is protocol.Handle
    h = Handle(local_reader_ranks=[0, 1], secret=b"k" * 32)
    assert pickle.loads(pickle.dumps(h)) == h
    assert "secret" not in repr(h) and "k" * 8 not in repr(h)  # a credential prints no secret
    e = pickle.loads(pickle.dumps(protocol.writer_died("at a test")))
    assert type(e) is WriterDiedError and "at a test" in str(e)
    assert isinstance(protocol.connection_lost_error(), RuntimeError)


# ------------------------------------------------------------------ a reader's unpickling
def test_unpickle_resolves_stubs_to_its_own_reader_and_leaves_no_reader_behind(arena):
    from vllm_shm_arena import arena as arena_mod
    from vllm_shm_arena.pickler import dump_message

    d = dump_message({"t": torch.ones(3 << 20)}, arena.writer)  # 12 MiB: into the arena
    assert d.diverted
    frames = [protocol.diverted_header(d.diverted), d.data, *d.buffers]
    got = reader.unpickle(frames, arena.reader)
    assert torch.equal(got["t"], torch.ones(3 << 20))
    assert getattr(arena_mod._CURRENT_READER, "arena", None) is None


def test_unpickle_without_an_arena():
    data, buffers = dumps({"x": torch.arange(3)})
    got = reader.unpickle([b"", data, *buffers], None)
    assert torch.equal(got["x"], torch.arange(3))


def test_the_long_wait_interval_comes_from_vllm_when_it_is_loaded(monkeypatch):
    import types

    mod = types.ModuleType("shm_broadcast")
    mod.VLLM_RINGBUFFER_WARNING_INTERVAL = 7
    monkeypatch.setitem(sys.modules, "vllm.distributed.device_communicators.shm_broadcast", mod)
    assert reader._warn_interval() == 7.0
    mod.VLLM_RINGBUFFER_WARNING_INTERVAL = True  # not a number of seconds
    assert reader._warn_interval() == reader._WAIT_WARN_S


def test_the_exit_hook_knows_every_end(roles):
    from vllm_shm_arena.mq import lifecycle

    for q in roles:
        assert q._end in lifecycle.LIVE and q._end.lifecycle.pid == os.getpid()
    assert roles[0]._end.CLOSE_DRAIN_S == lifecycle.DRAIN_S
    assert roles[1]._end.CLOSE_DRAIN_S == roles[2]._end.CLOSE_DRAIN_S == 0.0
