"""vllm_shm_arena.metrics: deltas from cumulative stats, multiprocess export, no-op fallback."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from mq_helpers import ready_in_threads

from vllm_shm_arena import metrics

prometheus_client = pytest.importorskip("prometheus_client")
from prometheus_client import REGISTRY, CollectorRegistry, multiprocess  # noqa: E402

REPO = Path(__file__).resolve().parents[2]

_CHILD = textwrap.dedent(
    """
    import sys
    from vllm_shm_arena import metrics

    def writer(hits, nbytes, full, reclaimed, in_use):
        return {"hits": hits, "bytes": nbytes, "reclaimed": reclaimed, "dead_readers": 0,
                "declined": {"no_free_slot": full, "oversize": 0}, "in_use": in_use}

    metrics.record_writer_stats(writer(2, 100, 1, 1, 3))
    metrics.record_writer_stats(writer(5, 300, 4, 2, 1))  # cumulative: adds 3, 200, 3, 1
    metrics.record_reader_stats({"pinned_bytes": 4096, "held": 2, "pending_releases": 1})
    metrics.record_reader_stats({"pinned_bytes": 64, "held": 1}, key="fe", arena="frontend")
    print("recorded", flush=True)
    sys.stdin.readline()  # stay alive (live gauges) until the parent has looked
    """
)


@pytest.fixture(autouse=True)
def _fresh_metrics():
    metrics._reset()
    yield
    metrics._reset()


def _spawn_child(prom_dir: Path) -> subprocess.Popen:
    env = dict(os.environ)
    env["PROMETHEUS_MULTIPROC_DIR"] = str(prom_dir)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")])
    return subprocess.Popen(
        [sys.executable, "-c", _CHILD],
        cwd=REPO,
        env=env,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )


def test_values_from_child_processes_reach_another_process(tmp_path):
    children = [_spawn_child(tmp_path) for _ in range(2)]
    try:
        for c in children:
            assert c.stdout.readline().strip() == "recorded"
        registry = CollectorRegistry()
        multiprocess.MultiProcessCollector(registry, path=str(tmp_path))

        def get(name, **labels):
            return registry.get_sample_value(name, {"arena": "queue", **labels})

        # Counters add up over processes.
        assert get("vllm:shm_arena_hits_total") == 10
        assert get("vllm:shm_arena_bytes_total") == 600
        assert get("vllm:shm_arena_declined_total", reason="no_free_slot") == 8
        assert get("vllm:shm_arena_reclaimed_slots_total") == 4
        # Live gauges: the sum over processes still running, per arena.
        assert get("vllm:shm_arena_slots_in_use") == 2
        assert get("vllm:shm_arena_pinned_bytes") == 8192
        assert get("vllm:shm_arena_reader_held_slots") == 4
        assert get("vllm:shm_arena_pending_releases") == 2
        assert get("vllm:shm_arena_pinned_bytes", arena="frontend") == 128
        assert get("vllm:shm_arena_reader_held_slots", arena="frontend") == 2
    finally:
        for c in children:
            c.communicate("\n", timeout=60)
    assert all(c.returncode == 0 for c in children)

    # Exited processes take their live gauges with them; their counts stay.
    registry = CollectorRegistry()
    multiprocess.MultiProcessCollector(registry, path=str(tmp_path))
    queue = {"arena": "queue"}
    assert registry.get_sample_value("vllm:shm_arena_hits_total", queue) == 10
    assert not registry.get_sample_value("vllm:shm_arena_pinned_bytes", queue)


def _value(name: str, labels: dict | None = None, arena: str = "queue") -> float:
    return REGISTRY.get_sample_value(name, {"arena": arena, **(labels or {})}) or 0.0


def test_cumulative_stats_become_increments():
    if os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
        pytest.skip("reads this process's default registry")
    before = _value("vllm:shm_arena_hits_total")
    before_full = _value("vllm:shm_arena_declined_total", {"reason": "no_free_slot"})
    metrics.record_writer_stats({"hits": 3, "declined": {"no_free_slot": 2}}, key="a")
    metrics.record_writer_stats({"hits": 7, "declined": {"no_free_slot": 2}}, key="a")
    assert _value("vllm:shm_arena_hits_total") - before == 7
    # Another writer in the same process counts on its own.
    metrics.record_writer_stats({"hits": 4}, key="b")
    assert _value("vllm:shm_arena_hits_total") - before == 11
    # A total that went down is a new arena under the same key: all of it is new.
    metrics.record_writer_stats({"hits": 1, "declined": {"no_free_slot": 1}}, key="a")
    assert _value("vllm:shm_arena_hits_total") - before == 12
    assert _value("vllm:shm_arena_declined_total", {"reason": "no_free_slot"}) - before_full == 3
    # A MessageQueue.stats() dict (arena nested) is accepted as well.
    metrics.record_writer_stats({"messages": 9, "arena": {"hits": 2}}, key="c")
    assert _value("vllm:shm_arena_hits_total") - before == 14
    # Forwards (a queue that forwards from a frontend arena) count on their own, as the
    # frontend arena's.
    fwd = _value("vllm:shm_arena_forwarded_total", arena="frontend")
    metrics.record_writer_stats({"hits": 2, "forwarded": 5}, key="c")
    metrics.record_writer_stats({"hits": 2, "forwarded": 8}, key="c")
    assert _value("vllm:shm_arena_forwarded_total", arena="frontend") - fwd == 8
    assert _value("vllm:shm_arena_forwarded_total") == 0
    assert _value("vllm:shm_arena_hits_total") - before == 14


def test_reader_gauges_take_the_latest_value():
    if os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
        pytest.skip("reads this process's default registry")
    metrics.record_reader_stats({"pinned_bytes": 1 << 20, "held": 3, "pending_releases": 0})
    metrics.record_reader_stats({"pinned_bytes": 2 << 20, "held": 1, "pending_releases": 2})
    assert _value("vllm:shm_arena_pinned_bytes") == 2 << 20
    assert _value("vllm:shm_arena_reader_held_slots") == 1
    assert _value("vllm:shm_arena_pending_releases") == 2


def _frontend(sends, in_use, owed, declined=None, reclaimed=0):
    """A frontend arena writer's ``stats()`` as record_frontend_stats reads it."""
    return {
        "sends": sends,
        "in_use": in_use,
        "reclaimed": reclaimed,
        "dead_readers": 0,
        "declined": declined or {},
        "holdings": [{"rank": r, "owed": n} for r, n in enumerate(owed)],
    }


def test_the_frontend_arenas_counters_and_gauges_are_its_own():
    if os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
        pytest.skip("reads this process's default registry")
    names = ["hits", "bytes", "stubs", "reclaimed_slots"]
    queue = {n: _value(f"vllm:shm_arena_{n}_total") for n in names}
    before = {n: _value(f"vllm:shm_arena_{n}_total", arena="frontend") for n in names}
    full = {"reason": "no_free_slot"}
    full0 = _value("vllm:shm_arena_declined_total", full, arena="frontend")
    metrics.record_frontend_stats(2, 200, _frontend(3, 2, [2, 1, 0], {"no_free_slot": 1}, 1))
    metrics.record_frontend_stats(5, 500, _frontend(9, 1, [1, 0, 4], {"no_free_slot": 3}, 4))
    got = {n: _value(f"vllm:shm_arena_{n}_total", arena="frontend") - before[n] for n in names}
    assert got == {"hits": 5, "bytes": 500, "stubs": 9, "reclaimed_slots": 4}
    assert _value("vllm:shm_arena_declined_total", full, arena="frontend") - full0 == 3
    assert _value("vllm:shm_arena_slots_in_use", arena="frontend") == 1
    owed = [_value("vllm:shm_arena_owed", {"rank": r}, arena="frontend") for r in "012"]
    assert owed == [1, 0, 4]  # a gauge per rank: what it owes now
    # The queue's series are untouched.
    assert {n: _value(f"vllm:shm_arena_{n}_total") for n in names} == queue


def test_capacity_is_summed_per_kind_of_arena():
    if os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
        pytest.skip("reads this process's default registry")
    metrics.record_arena_size("q1", 100, 200)
    metrics.record_arena_size("q2", 50, 50)
    metrics.record_arena_size("f1", 30, 40, metrics.FRONTEND)
    assert _value("vllm:shm_arena_capacity_bytes") == 150
    assert _value("vllm:shm_arena_requested_bytes") == 250
    assert _value("vllm:shm_arena_capacity_bytes", arena="frontend") == 30
    assert _value("vllm:shm_arena_requested_bytes", arena="frontend") == 40
    metrics.forget_arena_size("f1")
    metrics.forget_arena_size("q2")
    assert _value("vllm:shm_arena_capacity_bytes") == 100
    assert _value("vllm:shm_arena_capacity_bytes", arena="frontend") == 0


def test_reader_checksum_mismatches_are_a_counter():
    # VLLM_SHM_ARENA_DEBUG_CHECKSUM=1's verdict must be visible at /metrics (the serve test
    # asserts 0 there): a reader's cumulative checksum_mismatches becomes a counter, and a
    # reader that reported finds 0 exported rather than nothing.
    if os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
        pytest.skip("reads this process's default registry")
    name = "vllm:shm_arena_checksum_mismatches_total"
    queue = {"arena": "queue"}
    before = REGISTRY.get_sample_value(name, queue)
    metrics.record_reader_stats({"held": 0, "checksum_mismatches": 0})
    assert REGISTRY.get_sample_value(name, queue) == (before or 0.0)
    metrics.record_reader_stats({"held": 0, "checksum_mismatches": 2})
    metrics.record_reader_stats({"held": 0, "checksum_mismatches": 5})
    assert REGISTRY.get_sample_value(name, queue) - (before or 0.0) == 5
    # Another reader queue in the same process counts on its own.
    metrics.record_reader_stats({"checksum_mismatches": 1}, key="other")
    assert REGISTRY.get_sample_value(name, queue) - (before or 0.0) == 6
    # A frontend arena reader: the frontend's series, 0 shown once it reported.
    fe = {"arena": "frontend"}
    fe0 = REGISTRY.get_sample_value(name, fe) or 0.0
    metrics.record_reader_stats({"checksum_mismatches": 0}, key="fe", arena=metrics.FRONTEND)
    assert REGISTRY.get_sample_value(name, fe) == fe0
    assert REGISTRY.get_sample_value(name, queue) - (before or 0.0) == 6


def test_a_frontend_readers_acks_are_a_counter_per_rank():
    if os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
        pytest.skip("reads this process's default registry")
    name = "vllm:shm_arena_acked_total"
    before = [_value(name, {"rank": r}, arena="frontend") for r in "01"]
    metrics.record_reader_stats({"rank": 0, "acked": 4}, key="fe0", arena=metrics.FRONTEND)
    metrics.record_reader_stats({"rank": 1, "acked": 2}, key="fe1", arena=metrics.FRONTEND)
    metrics.record_reader_stats({"rank": 1, "acked": 7}, key="fe1", arena=metrics.FRONTEND)
    got = [
        _value(name, {"rank": r}, arena="frontend") - b for r, b in zip("01", before, strict=True)
    ]
    assert got == [4, 7]
    # A queue arena's readers ack nothing per stub: no series.
    metrics.record_reader_stats({"rank": 0, "acked": 0}, key="q")
    assert REGISTRY.get_sample_value(name, {"arena": "queue", "rank": "0"}) is None


def test_everything_is_a_no_op_without_prometheus_client(monkeypatch):
    monkeypatch.setitem(sys.modules, "prometheus_client", None)  # import raises ImportError
    metrics._reset()
    assert metrics.enabled() is False
    metrics.record_writer_stats({"hits": 1, "bytes": 2, "declined": {"oversize": 1}})
    metrics.record_reader_stats({"pinned_bytes": 1, "held": 1, "pending_releases": 1})
    assert metrics._metrics is None


def test_missing_fields_are_tolerated():
    metrics.record_writer_stats({})
    metrics.record_reader_stats({})
    assert metrics.enabled() is True


def test_a_broken_metrics_backend_never_breaks_the_caller(monkeypatch, caplog):
    metrics.enabled()

    def boom(*args, **kwargs):
        raise ValueError("registry exploded")

    monkeypatch.setattr(metrics._metrics.hits, "labels", boom)
    metrics.record_writer_stats({"hits": 10**9}, key="boom")  # must not raise
    assert metrics.enabled() is False
    assert sum("metrics disabled" in r.getMessage() for r in caplog.records) == 1
    metrics.record_writer_stats({"hits": 10**9 + 1}, key="boom")  # now a no-op


def test_writer_totals_settle_without_another_message(monkeypatch):
    """A report skipped by the once-a-second limit is made by a timer: the last message's hit
    shows within about a second even if no message follows (an idle server)."""
    import time

    import torch

    import vllm_shm_arena.mq.reporting as mq_mod
    from vllm_shm_arena import MessageQueue

    seen = []
    monkeypatch.setattr(
        mq_mod.metrics, "record_writer_stats", lambda s, key: seen.append(s["hits"])
    )
    mq = MessageQueue(1, 1, enable_shm_tensor_arena=True)
    r = MessageQueue.create_from_handle(mq.export_handle(), 0)
    ready_in_threads(mq, [r])
    try:
        t = torch.ones(2 << 20, dtype=torch.uint8)
        for _ in range(2):
            mq.enqueue({"t": t}, timeout=10)
            r.dequeue(timeout=10)
        assert seen == [1]  # the second was within the second: not reported yet
        deadline = time.monotonic() + 10
        while seen[-1] != 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert seen[-1] == 2, seen
    finally:
        mq.shutdown()
        r.shutdown()


def test_decline_reasons_are_the_extensions_and_importing_needs_no_extension(run_py):
    rc, out, err = run_py(
        """
        import sys
        from vllm_shm_arena import metrics
        print("torch" in sys.modules, "vllm_shm_arena._C" in sys.modules)
        reasons = metrics.DECLINE_REASONS
        from vllm_shm_arena._ext import _C
        print(reasons == _C.DECLINE_REASONS, "no_record" in reasons)
        """
    )
    assert rc == 0, err
    assert out.split() == ["False", "False", "True", "True"]
    with pytest.raises(AttributeError):
        metrics.NO_SUCH_NAME  # noqa: B018
