"""The multi-node join (vllm_multinode.create_mq_broadcaster) over a gloo group of 4 spawned
processes on loopback: 2 "nodes" of 2 ranks by rank number (they share /dev/shm here, which
vLLM's rank arithmetic does not look at), the pytest process as the executor's writer.

Each rank runs one *mode*:

* ``ours``: the plugin's join;
* ``vllm``: vLLM's own join (the plugin inactive on that node);
* ``nopkg``: vLLM's own join where vllm_shm_arena cannot be imported;
* ``other``: the plugin's join in another version of the package;
* ``badrelay``: the plugin's join where the relay cannot start.

Without vLLM (the default suite) vLLM's side is a stand-in written from vLLM 0.33's source:
its ``in_the_same_node_as`` collectives (broadcast, barrier, all_reduce), its
``create_from_process_group`` and a ``create_from_handle`` that reads the handle's fields as
vLLM's does. With vLLM (marker ``vllm``, ``make vllm-test``) the ranks call vLLM's real
``GroupCoordinator.create_mq_broadcaster`` (ours installed by the real ``register()``) with
vLLM's real ``in_the_same_node_as`` and queue.
"""

from __future__ import annotations

import dataclasses
import multiprocessing
import os
import socket
import sys
import time
import traceback
from datetime import timedelta
from typing import Any

import pytest
import torch

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
WORLD = 4
LOCAL = 2  # ranks per node: node 0 = ranks 0, 1; node 1 = ranks 2, 3
N_MSG = 3
MiB = 1 << 20
#: gloo's timeout in the children: a failure must come well before it (not by it).
GLOO_TIMEOUT_S = 120
#: A clear failure comes this fast; a hang would last GLOO_TIMEOUT_S.
FAST_S = 40


def _vllm_available() -> bool:
    try:
        import vllm.distributed.parallel_state  # noqa: F401
        import vllm.v1.executor.multiproc_executor  # noqa: F401
    except Exception:
        return False
    return True


# ------------------------------------------------------------------ vLLM's side, stood in
@dataclasses.dataclass
class FakeVllmHandle:
    """vLLM 0.33's shm_broadcast.Handle fields."""

    local_reader_ranks: list[int] = dataclasses.field(default_factory=list)
    buffer_handle: tuple | None = None
    local_subscribe_addr: str | None = None
    local_notify_addr: str | None = None
    remote_subscribe_addr: str | None = None
    remote_addr_ipv6: bool = False
    tensor_arena_handle: tuple | None = None


class FakeVllmMQ:
    """vLLM's MessageQueue as far as joining goes (no ring: these tests send nothing on it)."""

    def __init__(self, n_reader, n_local_reader, local_reader_ranks=None, **kw):
        self.handle = FakeVllmHandle(local_reader_ranks=list(local_reader_ranks or []))
        self.role = "vllm-writer"

    def export_handle(self):
        return self.handle

    @staticmethod
    def create_from_handle(handle, rank):
        # shm_broadcast.py create_from_handle: the first field it reads.
        q = FakeVllmMQ.__new__(FakeVllmMQ)
        q.handle = handle
        q.role = "vllm-local" if rank in handle.local_reader_ranks else "vllm-remote"
        _ = handle.remote_subscribe_addr
        return q

    def wait_until_ready(self):
        pass

    def shutdown(self):
        pass


def fake_in_the_same_node_as(pg, source_rank=0):
    """vLLM 0.33's in_the_same_node_as collectives (parallel_state.py:2597-2687)."""
    import torch.distributed as dist

    rank = dist.get_rank(group=pg)
    ranks = dist.get_process_group_ranks(pg)
    name = f"vsa-node-{os.getpid()}" if rank == source_rank else None
    dist.broadcast_object_list([name], src=ranks[source_rank], group=pg)
    dist.barrier(group=pg)
    flags = torch.tensor([1], dtype=torch.int32)  # this stand-in: one node by /dev/shm
    dist.all_reduce(flags, group=pg)
    return [True] * dist.get_world_size(pg)


def fake_vllm_create_from_process_group(pg, writer_rank, external_writer_handle, blocking):
    """vLLM 0.33's create_from_process_group (shm_broadcast.py:1079-1160) over FakeVllmMQ."""
    import torch.distributed as dist

    group_rank = dist.get_rank(pg)
    global_ranks = dist.get_process_group_ranks(pg)
    fake_in_the_same_node_as(pg, source_rank=writer_rank)
    if group_rank == writer_rank:
        buffer_io = FakeVllmMQ.create_from_handle(external_writer_handle, group_rank)
        dist.broadcast_object_list(
            [buffer_io.export_handle()], src=global_ranks[writer_rank], group=pg
        )
    else:
        recv = [None]
        dist.broadcast_object_list(recv, src=global_ranks[writer_rank], group=pg)
        buffer_io = FakeVllmMQ.create_from_handle(recv[0], group_rank)
    if blocking:
        buffer_io.wait_until_ready()
    return buffer_io


# ------------------------------------------------------------------ recording collectives
_COLLECTIVES = (
    "broadcast_object_list",
    "barrier",
    "all_reduce",
    "all_gather_object",
    "gather_object",
    "broadcast",
    "all_gather",
    "gather",
)


def _record_collectives() -> list:
    """Logs every torch.distributed collective called through the module's names (vLLM's
    and ours both call ``dist.<name>``), as (name, src or dst)."""
    import torch.distributed as dist

    log: list = []
    for name in _COLLECTIVES:
        fn = getattr(dist, name)

        def rec(*a, _fn=fn, _name=name, **kw):
            log.append((_name, kw.get("src", kw.get("dst"))))
            return _fn(*a, **kw)

        setattr(dist, name, rec)
    return log


# ------------------------------------------------------------------ one rank
def _message(i: int) -> dict:
    return {"i": i, "t": torch.full((2 * MiB,), i, dtype=torch.int32)}


def _rank_main(rank, port, mode, backend, handle, record, out) -> None:
    sys.path.insert(0, REPO)
    t0 = time.monotonic()
    report: dict[str, Any] = {"rank": rank, "mode": mode}
    try:
        import torch.distributed as dist

        if mode == "nopkg":
            for name in [m for m in sys.modules if m.startswith("vllm_shm_arena")]:
                del sys.modules[name]
            sys.modules["vllm_shm_arena"] = None  # "import of vllm_shm_arena halted"
        dist.init_process_group(
            "gloo",
            init_method=f"tcp://127.0.0.1:{port}",
            rank=rank,
            world_size=WORLD,
            timeout=timedelta(seconds=GLOO_TIMEOUT_S),
        )
        log = _record_collectives() if record else None
        external = handle  # node 0's ranks get the executor's handle, the others None
        t0 = time.monotonic()
        mq = _join(mode, backend, dist.group.WORLD, external)
        report["join_s"] = time.monotonic() - t0
        report["collectives"] = log
        report["kind"] = f"{type(mq).__module__}.{type(mq).__qualname__}"
        stats = getattr(mq, "stats", None)
        report["role"] = stats()["role"] if callable(stats) else getattr(mq, "role", None)
        if backend != "none":
            mq.wait_until_ready()
            got = [mq.dequeue(timeout=60) for _ in range(N_MSG)]
            report["received"] = [
                (m["i"], int(m["t"][0]), int(m["t"][-1]), m["t"].numel()) for m in got
            ]
            del got
        dist.barrier()
        mq.shutdown()
        report["error"] = None
    except BaseException as e:
        report["error"] = f"{type(e).__name__}: {e}"
        report["error_type"] = type(e).__name__
        report["join_s"] = time.monotonic() - t0
        report["tb"] = traceback.format_exc()
    out.put(report)
    # Like a vLLM worker that failed to start: the process ends (its gloo connections close).


def _join(mode, backend, pg, external):
    """This rank's create_mq_broadcaster for ``mode`` (see the module docstring)."""
    if backend == "vllm":
        from vllm.distributed import parallel_state as ps

        coordinator = type("Coordinator", (), {})()
        coordinator.cpu_group = pg
        if mode in ("ours", "other"):
            from vllm_shm_arena import vllm_multinode, vllm_plugin

            vllm_plugin.register()
            assert getattr(ps.GroupCoordinator.create_mq_broadcaster, "_vsa_stock", None)
            if mode == "other":
                vllm_multinode._PACKAGE_VERSION = "0.0.9"
                vllm_multinode.AGREEMENT = (vllm_multinode.WIRE, "0.0.9")
        return ps.GroupCoordinator.create_mq_broadcaster(
            coordinator, external_writer_handle=external, blocking=False
        )
    # The stand-in vLLM.
    if mode in ("vllm", "nopkg"):
        return fake_vllm_create_from_process_group(pg, 0, external, False)
    from vllm_shm_arena import vllm_multinode
    from vllm_shm_arena.message_queue import Handle, MessageQueue

    if mode == "other":
        vllm_multinode._PACKAGE_VERSION = "0.0.9"
        vllm_multinode.AGREEMENT = (vllm_multinode.WIRE, "0.0.9")
    ours_mq = MessageQueue
    if mode == "badrelay":

        def no_relay(handle, rank, relayed, **kw):
            raise OSError(f"rank {rank} cannot reach {handle.remote_subscribe_addr}")

        ours_mq = type("MessageQueue", (ours_mq,), {"create_relay": staticmethod(no_relay)})
    return vllm_multinode.create_mq_broadcaster(
        pg,
        0,
        external,
        False,
        stock_mq=FakeVllmMQ,
        stock_handle=FakeVllmHandle,
        ours_mq=ours_mq,
        ours_handle=Handle,
        in_the_same_node_as=fake_in_the_same_node_as,
    )


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_group(modes, backend, handle, writer=None, record=False) -> dict[int, dict]:
    """Runs ranks 0..3 in ``modes``; the caller's ``writer`` (if any) sends N_MSG messages
    once every reader is ready. -> each rank's report."""
    ctx = multiprocessing.get_context("spawn")
    out = ctx.Queue()
    port = _free_port()
    # Only node 0's workers get the executor's handle (a process on another node could not
    # even unpickle ours without the package).
    procs = [
        ctx.Process(
            target=_rank_main,
            args=(r, port, modes[r], backend, handle if r < LOCAL else None, record, out),
        )
        for r in range(WORLD)
    ]
    for p in procs:
        p.start()
    try:
        if writer is not None:
            writer.wait_until_ready()
            for i in range(N_MSG):
                writer.enqueue(_message(i))
        reports = {}
        for _ in range(WORLD):
            r = out.get(timeout=GLOO_TIMEOUT_S + 60)
            reports[r["rank"]] = r
        for p in procs:
            p.join(timeout=30)
        return reports
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()


def _our_writer(n_reader: int):
    from vllm_shm_arena import MessageQueue

    return MessageQueue(
        n_reader,
        LOCAL,
        max_chunk_bytes=1 * MiB,
        connect_ip="127.0.0.1",
        enable_shm_tensor_arena=True,
    )


def _check_all_ours_flowed(reports):
    for r, rep in reports.items():
        assert rep["error"] is None, f"rank {r}: {rep.get('tb')}"
        want = [(i, i, i, 2 * MiB) for i in range(N_MSG)]
        assert rep["received"] == want, (r, rep["received"])
    assert reports[0]["role"] == reports[1]["role"] == "local_reader"
    assert reports[2]["role"] == "relay", reports[2]
    assert reports[3]["role"] == "local_reader", reports[3]  # a reader of the relay's ring


def _check_clear_failure(reports, ours_ranks, expect_in_ours):
    for r in ours_ranks:
        rep = reports[r]
        assert rep["error_type"] == "PluginMismatchError", (r, rep.get("tb"))
        for text in expect_in_ours:
            assert text in rep["error"], (r, rep["error"])
        assert rep["join_s"] < FAST_S, (r, rep["join_s"])  # not gloo's timeout
        print(f"rank {r} failed after {rep['join_s']:.2f} s: {rep['error']}")


# ------------------------------------------------------------------ the pieces, in-process
def test_ticket_round_trips_and_trips_vllms_reader():
    import pickle

    from vllm_shm_arena import vllm_multinode
    from vllm_shm_arena.message_queue import Handle
    from vllm_shm_arena.vllm_multinode import JoinTicket, PluginMismatchError

    h = Handle(local_reader_ranks=[0, 1], remote_subscribe_addr="tcp://127.0.0.1:5")
    t = pickle.loads(pickle.dumps(JoinTicket.of(h)))
    assert t.matches() and t.handle() == h
    for field in dataclasses.fields(FakeVllmHandle):  # what vLLM's create_from_handle reads
        with pytest.raises(PluginMismatchError, match="the plugin is not active here"):
            getattr(t, field.name)
    with pytest.raises(PluginMismatchError):
        FakeVllmMQ.create_from_handle(t, 2)
    other = JoinTicket(vllm_multinode.WIRE, "9.9", b"")
    assert not pickle.loads(pickle.dumps(other)).matches()


def test_roles_by_rank_number():
    from vllm_shm_arena.vllm_multinode import Roles

    roles = Roles([0, 1], 6, 0)
    assert [roles.node(r) for r in range(6)] == [0, 0, 1, 1, 2, 2]
    assert [roles.relay_of(r) for r in range(6)] == [0, 0, 2, 2, 4, 4]
    assert roles.members(2) == [4, 5]
    for ranks, world in (([0, 1], 5), ([1, 2], 4), ([], 4), ([0, 2], 4)):
        with pytest.raises(ValueError, match="not vLLM's executor layout"):
            Roles(ranks, world, 0)
    with pytest.raises(ValueError, match="not on node 0"):
        Roles([0, 1], 4, 2)


def test_verdict_names_every_rank_that_disagrees():
    from vllm_shm_arena import vllm_multinode as vm

    ok = vm._vote(None)
    assert vm._verdict([ok, ok, vm._vote(None, {"h": 1}), ok]) is None
    bad = vm._verdict([ok, (vm.WIRE, "0.0.9", None, None), vm._vote("OSError: x"), "junk"])
    assert "rank 1 runs vllm_shm_arena 0.0.9" in bad
    assert "rank 2: OSError: x" in bad and "rank 3 sent 'junk'" in bad


# ------------------------------------------------------------------ without vLLM
def test_all_ranks_ours_roles_and_messages():
    writer = _our_writer(WORLD)
    try:
        reports = run_group(["ours"] * 4, "ours", writer.export_handle(), writer)
    finally:
        writer.shutdown()
    _check_all_ours_flowed(reports)


def test_plugin_inactive_on_node_1_fails_clearly_on_every_rank():
    writer = _our_writer(WORLD)
    try:
        reports = run_group(["ours", "ours", "vllm", "vllm"], "none", writer.export_handle())
    finally:
        writer.shutdown()
    for r in (2, 3):  # vLLM's create_from_handle read a field of our ticket
        assert reports[r]["error_type"] == "PluginMismatchError", reports[r].get("tb")
        assert "the plugin is not active here" in reports[r]["error"]
    _check_clear_failure(reports, (0, 1), ["Some rank left", "every node must run the plugin"])


def test_package_missing_on_node_1_fails_clearly_on_every_rank():
    writer = _our_writer(WORLD)
    try:
        reports = run_group(["ours", "ours", "nopkg", "nopkg"], "none", writer.export_handle())
    finally:
        writer.shutdown()
    for r in (2, 3):  # unpickling the ticket in the handle broadcast
        assert "vllm_shm_arena" in reports[r]["error"], reports[r]
        assert reports[r]["error_type"] in ("ModuleNotFoundError", "ImportError"), reports[r]
    _check_clear_failure(reports, (0, 1), ["Some rank left"])


def test_other_version_on_node_1_fails_clearly_on_every_rank():
    writer = _our_writer(WORLD)
    try:
        reports = run_group(["ours", "ours", "other", "other"], "none", writer.export_handle())
    finally:
        writer.shutdown()
    _check_clear_failure(reports, range(4), ["rank 2", "rank 3", "0.0.9"])
    assert len({reports[r]["error"] for r in (0, 1)}) == 1, reports
    assert len({reports[r]["error"] for r in (2, 3)}) == 1, reports


def test_a_relay_that_cannot_start_fails_every_rank_with_its_error():
    writer = _our_writer(WORLD)
    try:
        reports = run_group(["ours", "ours", "badrelay", "ours"], "none", writer.export_handle())
    finally:
        writer.shutdown()
    _check_clear_failure(reports, range(4), ["rank 2: OSError: rank 2 cannot reach tcp://"])
    assert len({rep["error"] for rep in reports.values()}) == 1, reports


def test_vllms_handle_joins_vllms_queue_with_vllms_collectives():
    """Plugin on node 1 only (node 0's executor built vLLM's queue): every rank joins vLLM's
    queue, with exactly vLLM's collectives."""
    handle = FakeVllmHandle(local_reader_ranks=[0, 1], remote_subscribe_addr="tcp://x:1")
    reports = run_group(["vllm", "vllm", "ours", "ours"], "none", handle, record=True)
    for r, rep in reports.items():
        assert rep["error"] is None, rep.get("tb")
        assert rep["kind"].endswith("FakeVllmMQ"), rep
        assert rep["role"] == ("vllm-local" if r < LOCAL else "vllm-remote"), rep
    assert reports[2]["collectives"] == reports[0]["collectives"], reports
    assert reports[2]["collectives"][:3] == [
        ("broadcast_object_list", 0),
        ("barrier", None),
        ("all_reduce", None),
    ]


# ------------------------------------------------------------------ with vLLM
def _registered():
    from vllm_shm_arena import vllm_plugin

    vllm_plugin.register()
    import vllm.v1.executor.multiproc_executor as mpe

    assert mpe.MessageQueue is vllm_plugin.ShmArenaMessageQueue
    return mpe


@pytest.mark.vllm
@pytest.mark.skipif(not _vllm_available(), reason="vLLM not importable (make vllm-test)")
def test_real_vllm_all_ranks_ours_roles_and_messages():
    """vLLM's real GroupCoordinator.create_mq_broadcaster (ours, installed by register()) and
    in_the_same_node_as; the executor's factory builds ours for 2 nodes of 2."""
    mpe = _registered()
    import vllm_shm_arena

    q = mpe.MessageQueue(
        WORLD, LOCAL, connect_ip="127.0.0.1", enable_shm_tensor_arena=True, max_chunk_bytes=MiB
    )
    assert type(q) is vllm_shm_arena.MessageQueue
    writer = q
    try:
        reports = run_group(["ours"] * 4, "vllm", writer.export_handle(), writer)
    finally:
        writer.shutdown()
    _check_all_ours_flowed(reports)


@pytest.mark.vllm
@pytest.mark.skipif(not _vllm_available(), reason="vLLM not importable (make vllm-test)")
def test_real_vllm_plugin_inactive_on_node_1_fails_clearly():
    writer = _our_writer(WORLD)
    try:
        reports = run_group(["ours", "ours", "vllm", "vllm"], "vllm", writer.export_handle())
    finally:
        writer.shutdown()
    for r in (2, 3):  # vLLM's own create_from_handle, given our ticket
        assert reports[r]["error_type"] == "PluginMismatchError", reports[r].get("tb")
        assert "create_from_handle" in reports[r]["tb"], reports[r]["tb"]
    _check_clear_failure(reports, (0, 1), ["Some rank left"])


@pytest.mark.vllm
@pytest.mark.skipif(not _vllm_available(), reason="vLLM not importable (make vllm-test)")
def test_real_vllm_package_missing_on_node_1_fails_clearly():
    writer = _our_writer(WORLD)
    try:
        reports = run_group(["ours", "ours", "nopkg", "nopkg"], "vllm", writer.export_handle())
    finally:
        writer.shutdown()
    for r in (2, 3):
        assert reports[r]["error_type"] in ("ModuleNotFoundError", "ImportError"), reports[r]
        assert "broadcast_object_list" in reports[r]["tb"], reports[r]["tb"]
    _check_clear_failure(reports, (0, 1), ["Some rank left"])


@pytest.mark.vllm
@pytest.mark.skipif(not _vllm_available(), reason="vLLM not importable (make vllm-test)")
@pytest.mark.parametrize("modes", [["ours"] * 4, ["vllm"] * 4, ["vllm", "vllm", "ours", "ours"]])
def test_real_vllm_handle_gets_vllms_queue_and_collectives(modes):
    """vLLM's own queue (the flag off, or a node without the plugin) through the wrapper:
    vLLM's queue on every rank, messages flow, and each rank's collectives are the ones
    vLLM's own create_mq_broadcaster makes."""
    from vllm.distributed.device_communicators import shm_broadcast

    writer = shm_broadcast.MessageQueue(WORLD, LOCAL, max_chunk_bytes=MiB, connect_ip="127.0.0.1")
    try:
        reports = run_group(modes, "vllm", writer.export_handle(), writer, record=True)
    finally:
        writer.shutdown()
    for rep in reports.values():
        assert rep["error"] is None, rep.get("tb")
        assert rep["kind"].endswith("shm_broadcast.MessageQueue"), rep
        assert rep["received"] == [(i, i, i, 2 * MiB) for i in range(N_MSG)], rep
    vllms = [
        ("broadcast_object_list", 0),
        ("barrier", None),
        ("all_reduce", None),
        ("broadcast_object_list", 0),
        ("barrier", None),  # the test's own, after the messages
    ]
    for r, rep in reports.items():
        assert rep["collectives"] == vllms, (r, modes[r], rep["collectives"])


def test_the_relay_logs_through_the_plugins_logger():
    """vLLM's logging configuration shows ``vllm.*`` loggers in every process, workers
    included: the relay's start-up line (the evidence, in a headless node's log, that its
    node uses the arena) must go through the plugin's logger, not a name vLLM does not show."""
    from vllm_shm_arena import vllm_multinode, vllm_plugin

    assert vllm_multinode.logger.name == f"vllm.plugins.{vllm_plugin.PLUGIN_NAME}"


def test_the_relays_ring_chunk_is_the_executors(monkeypatch):
    """The relay's downstream ring takes the executor's chunk size (vLLM's
    VLLM_MQ_MAX_CHUNK_BYTES_MB, 16 MiB by default), not a size of its own."""
    from vllm_shm_arena import vllm_multinode

    monkeypatch.delenv("VLLM_MQ_MAX_CHUNK_BYTES_MB", raising=False)
    assert vllm_multinode.relay_chunk_bytes() == 16 << 20
    monkeypatch.setenv("VLLM_MQ_MAX_CHUNK_BYTES_MB", "40")
    assert vllm_multinode.relay_chunk_bytes() == 40 << 20
