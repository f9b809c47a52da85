"""vllm_shm_arena.sizing: the arena a queue gets where the shm directory is small.

The rule is tested on measured values (``DirSpace``) first; then real queues on private tmpfs
mounts of 128 MiB to 4 GiB (root only: skipped otherwise) show that the queue with the arena
starts wherever the one without it does, logs the size it chose, still carries a tensor that
fits through the arena, and that queues created one after another get equal shares. Last, the
memory cgroup reader on fake cgroup trees.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

import pytest
import torch
from mq_helpers import ready_in_threads  # noqa: E402

from vllm_shm_arena import MessageQueue, metrics, sizing  # noqa: E402
from vllm_shm_arena.arena import ShmTensorArena  # noqa: E402
from vllm_shm_arena.mq import writer as mq_writer  # noqa: E402

MiB = 1 << 20
GiB = 1 << 30
RING = 160 * MiB  # MessageQueue's default ring: 10 chunks of 16 MiB (plus a 4 KiB header)


def space(free: int, ring: int = RING, backed: int = 0, cgroup: int | None = None, total=None):
    """A measured directory: ``free`` bytes free, this queue's ring of ``ring`` bytes (none of
    it backed yet), ``backed`` bytes held by this package's other live segments."""
    return sizing.DirSpace(
        dir="/shm",
        shm_free=free,
        shm_total=total if total is not None else free + backed,
        cgroup_available=cgroup,
        package_backed=backed,
        live_arenas=1 if backed else 0,
        ring_bytes=ring,
        ring_unbacked=ring,
    )


VARIABLE = sizing.Layout()  # 2048 MiB, the default
FIXED = sizing.Layout(policy="fixed", num_slots=8, slot_bytes=256 * MiB)


# ------------------------------------------------------------------------ 1. the rule
def test_configured_arena_when_it_fits_beside_the_ring():
    s = sizing.choose(2, VARIABLE, space(4 * GiB))
    assert s.sized_by == "config" and s.message == ""
    assert s.arena_bytes == s.requested_bytes == 2048 * MiB
    assert s.region_bytes > s.arena_bytes  # the tables


def test_a_directory_too_small_gives_half_of_what_is_left_beside_the_ring():
    s = sizing.choose(2, VARIABLE, space(GiB))
    share = (GiB - RING) // 2
    assert s.sized_by == "shm_free"
    assert share - 4 * MiB < s.arena_bytes <= share and s.region_bytes <= share
    assert s.arena_bytes % MiB == 0 and s.requested_bytes == 2048 * MiB
    assert "instead of 2048 MiB" in s.message and "--shm-size=" in s.message, s.message
    assert "VLLM_SHM_ARENA_MB" in s.message and "not a reservation" in s.message, s.message


def test_the_fraction_is_configurable(monkeypatch):
    monkeypatch.setenv("VLLM_SHM_ARENA_FREE_FRACTION", "0.25")
    s = sizing.choose(2, VARIABLE, space(GiB), sizing.free_fraction())
    assert s.region_bytes <= (GiB - RING) // 4 < s.arena_bytes + 4 * MiB


@pytest.mark.parametrize("raw", ["0", "-0.5", "1.5", "half", "nan", "inf"])
def test_a_bad_fraction_is_refused_naming_the_variable(raw, monkeypatch):
    monkeypatch.setenv("VLLM_SHM_ARENA_FREE_FRACTION", raw)
    with pytest.raises(ValueError, match="VLLM_SHM_ARENA_FREE_FRACTION"):
        sizing.free_fraction()


@pytest.mark.parametrize("raw", ["0", "-1", "64.5", "big"])
def test_a_bad_floor_is_refused_naming_the_variable(raw, monkeypatch):
    monkeypatch.setenv("VLLM_SHM_ARENA_MIN_MB", raw)
    with pytest.raises(ValueError, match="VLLM_SHM_ARENA_MIN_MB"):
        sizing.min_bytes()


def test_below_the_floor_there_is_no_arena_and_the_warning_says_how_to_get_one():
    s = sizing.choose(2, VARIABLE, space(256 * MiB))  # half of 96 MiB < 64 MiB
    assert s.arena_bytes == 0 and s.region_bytes == 0
    assert "no tensor arena" in s.message and "VLLM_SHM_ARENA_MIN_MB" in s.message, s.message
    # A lower floor lets the same directory have a small one.
    s = sizing.choose(2, VARIABLE, space(256 * MiB), floor=32 * MiB)
    assert 32 * MiB <= s.arena_bytes <= 48 * MiB


def test_a_configured_arena_smaller_than_the_floor_is_kept_when_it_fits():
    small = dataclasses.replace(VARIABLE, arena_bytes=16 * MiB)
    s = sizing.choose(2, small, space(200 * MiB))
    assert s.sized_by == "config" and s.arena_bytes == 16 * MiB


def test_the_fixed_layout_gets_fewer_slots_never_fewer_than_one():
    s = sizing.choose(2, FIXED, space(GiB))  # 432 MiB share: one 256 MiB slot
    assert (s.num_slots, s.slot_bytes, s.arena_bytes) == (1, 256 * MiB, 256 * MiB)
    assert "1 x 256 MiB slots instead of 8 x 256 MiB slots" in s.message, s.message
    assert "VLLM_SHM_ARENA_NUM_SLOTS" in s.message
    s = sizing.choose(2, FIXED, space(2 * GiB))  # 944 MiB share: three slots
    assert s.num_slots == 3 and s.region_bytes <= (2 * GiB - RING) // 2
    s = sizing.choose(2, FIXED, space(512 * MiB))  # 176 MiB share: not one slot
    assert s.arena_bytes == 0 and s.num_slots == 0
    assert "less than one 256 MiB slot" in s.message, s.message


def test_the_memory_cgroup_limits_the_arena_like_the_directory():
    s = sizing.choose(2, VARIABLE, space(8 * GiB, cgroup=GiB))
    assert s.sized_by == "cgroup"
    assert s.region_bytes <= (GiB - RING) // 2
    assert "memory limit" in s.message and "memory cgroup" in s.message, s.message


def test_pages_other_live_arenas_backed_are_added_back_so_shares_are_equal():
    """The second queue sees the first queue's ring and arena in the directory: what they
    backed comes off the free space, and is added back to the pool."""
    first = sizing.choose(2, VARIABLE, space(GiB))
    held = 2 * MiB + 4096 + 100 * MiB  # the first arena's tables and tensors, its ring's header
    second = sizing.choose(2, VARIABLE, space(GiB - held, backed=held))
    assert second.arena_bytes == first.arena_bytes
    # Without the add-back the second share would have been smaller.
    unseen = sizing.choose(2, VARIABLE, space(GiB - held))
    assert unseen.arena_bytes < first.arena_bytes


def test_the_share_never_exceeds_what_can_be_backed_now():
    # Other arenas backed most of the directory: the pool is large, the room is not.
    s = sizing.choose(2, VARIABLE, space(300 * MiB, backed=3 * GiB))
    assert s.region_bytes <= 300 * MiB - RING


def test_measure_counts_this_users_live_segments_and_the_own_rings_unbacked_part(tmp_path):
    w = ShmTensorArena.create(1, num_slots=2, slot_bytes=4 * MiB, shm_dir=str(tmp_path))
    try:
        assert w.write_tensor(torch.ones(4 * MiB, dtype=torch.uint8)) is not None
        ring = tmp_path / "ring"
        with open(ring, "wb") as f:
            f.truncate(16 * MiB)
        m = sizing.measure(str(tmp_path), ring_path=str(ring))
        arena_file = os.stat(tmp_path / w.name)
        assert m.live_arenas == 1 and m.package_backed == arena_file.st_blocks * 512 > 4 * MiB
        assert m.ring_bytes == 16 * MiB and m.ring_unbacked == 16 * MiB
    finally:
        w.close()
    # Unlinked: no longer seen.
    assert sizing.measure(str(tmp_path)).live_arenas == 0


# ------------------------------------------------------------------------ 2. real tmpfs mounts
@pytest.fixture
def tmpfs(monkeypatch):
    """``tmpfs("1g")``: a private tmpfs of that size (root only), made this process's shm
    directory (VLLM_SHM_ARENA_SHM_DIR, which the ring and arena read at creation); the queue's
    arena settings are the defaults whatever the environment says. Unmounted afterwards."""
    if os.geteuid() != 0:
        pytest.skip("mounting a private tmpfs needs root")
    mounted = []

    def mount(size: str) -> Path:
        # A short path: the queue's socket path inside it must fit sockaddr_un (107 bytes).
        d = Path(tempfile.mkdtemp(prefix=f"vsa-{size}-"))
        r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(d)])
        if r.returncode != 0:
            pytest.skip(f"mount -t tmpfs failed (rc={r.returncode}): no CAP_SYS_ADMIN here")
        mounted.append(d)
        monkeypatch.setenv("VLLM_SHM_ARENA_SHM_DIR", str(d))
        return d

    for name, value in (
        ("_ARENA_POLICY", "variable"),
        ("_ARENA_BYTES", 2048 * MiB),
        ("_ARENA_MAX_ALLOCATIONS", 1024),
    ):
        monkeypatch.setattr(mq_writer, name, value)
    for var in ("VLLM_SHM_ARENA_FREE_FRACTION", "VLLM_SHM_ARENA_MIN_MB"):
        monkeypatch.delenv(var, raising=False)
    try:
        yield mount
    finally:
        for d in mounted:
            subprocess.run(["umount", "-l", str(d)])
            d.rmdir()


def _send_one(mq: MessageQueue, nbytes: int) -> dict:
    """A reader (thread, this process) joins; one tensor of ``nbytes`` goes through; -> the
    writer's stats afterwards."""
    r = MessageQueue.create_from_handle(mq.export_handle(), 0)
    r2 = MessageQueue.create_from_handle(mq.export_handle(), 1)
    try:
        ready_in_threads(mq, [r, r2])
        t = torch.arange(nbytes // 4, dtype=torch.int32)
        mq.enqueue({"t": t}, timeout=30)
        for q in (r, r2):
            got = q.dequeue(timeout=30)["t"]
            assert torch.equal(got, t)
            del got
        return mq.stats()
    finally:
        r.shutdown()
        r2.shutdown()


#: tmpfs size -> (the arena it gets: MiB of tensor data, 0: none; the level of its log line).
EXPECTED = {
    "256m": (0, logging.WARNING),
    "512m": (173, logging.WARNING),
    "1g": (429, logging.WARNING),
    "4g": (2048, None),
}


@pytest.mark.parametrize("size", list(EXPECTED))
def test_the_queue_with_the_arena_starts_wherever_the_one_without_does(size, tmpfs, caplog):
    d = tmpfs(size)
    off = MessageQueue(2, 2)  # the ring alone: 160 MiB
    off.shutdown()
    want_mib, level = EXPECTED[size]
    with caplog.at_level(logging.INFO, logger="vllm_shm_arena"):
        mq = MessageQueue(2, 2, enable_shm_tensor_arena=True)
    try:
        st = mq.stats()["arena_size"]
        print(f"{size} tmpfs: arena {st['arena_bytes'] >> 20} MiB, sized by {st['sized_by']}")
        assert st["arena_bytes"] == want_mib * MiB, st
        assert st["requested_bytes"] == 2048 * MiB
        lines = [r for r in caplog.records if "tensor arena" in r.getMessage()]
        if level is None:
            assert st["sized_by"] == "config" and lines == [], caplog.text
        else:
            assert [r.levelno for r in lines] == [level], caplog.text
            assert str(d) in lines[0].getMessage() and "--shm-size" in lines[0].getMessage()
        if want_mib:
            # A tensor that fits the smaller arena still goes through it.
            out = _send_one(mq, 64 * MiB)
            assert out["arena"]["hits"] == 1 and out["arena"]["bytes"] == 64 * MiB, out
        else:
            assert mq.arena is None and mq.export_handle().tensor_arena_handle is None
            out = _send_one(mq, 64 * MiB)  # out of band
            assert "arena" not in out and out["messages"] == 1, out
    finally:
        mq.shutdown()
    assert list(d.iterdir()) == []


def test_no_blob_region_when_the_shm_directory_has_no_room_for_one(tmpfs, caplog):
    """Arena off, on a 256 MiB tmpfs the ring takes 160 MiB: half of the rest is under the region's
    minimum, so the queue is made without one (one warning) and overflow goes over the
    socket (mq/test_blob_region.py has the region itself)."""
    tmpfs("256m")
    with caplog.at_level(logging.WARNING, logger="vllm_shm_arena"):
        mq = MessageQueue(2, 2, enable_shm_tensor_arena=False)
    try:
        assert mq.export_handle().blob_arena_handle is None
        assert [r for r in caplog.records if "no blob region" in r.getMessage()], caplog.text
    finally:
        mq.shutdown()


def test_below_the_rings_own_size_both_queues_fail_the_same_way(tmpfs):
    tmpfs("128m")
    with pytest.raises(OSError) as off:
        MessageQueue(2, 2)
    with pytest.raises(OSError) as on:
        MessageQueue(2, 2, enable_shm_tensor_arena=True)
    assert "not enough shared memory" in str(off.value)
    assert str(on.value) == str(off.value)


def test_queues_created_one_after_another_get_equal_shares(tmpfs):
    """Three queues on one 1 GiB tmpfs (data-parallel ranks, each with its own executor): the
    same size each, even after the first one's arena backed pages for a tensor."""
    tmpfs("1g")
    queues = []
    try:
        for i in range(3):
            queues.append(MessageQueue(2, 2, enable_shm_tensor_arena=True))
            if i == 0:  # the first arena backs pages for a 100 MiB tensor (its name is linked)
                t = torch.ones(100 * MiB, dtype=torch.uint8)
                assert queues[0].arena.write_tensor(t) is not None
        sizes = [q.stats()["arena_size"]["arena_bytes"] for q in queues]
        print(f"1 GiB tmpfs, three queues: {[s >> 20 for s in sizes]} MiB")
        assert sizes[0] == sizes[1] == sizes[2] == 429 * MiB, sizes
    finally:
        for q in queues:
            q.shutdown()


def test_the_fixed_layout_on_a_small_tmpfs_gets_fewer_slots(tmpfs, monkeypatch):
    tmpfs("1g")
    monkeypatch.setattr(mq_writer, "_ARENA_POLICY", "fixed")
    monkeypatch.setattr(mq_writer, "_ARENA_NUM_SLOTS", 8)
    monkeypatch.setattr(mq_writer, "_ARENA_SLOT_BYTES", 128 * MiB)  # 1 GiB: does not fit
    mq = MessageQueue(2, 2, enable_shm_tensor_arena=True)
    try:
        # Half of 864 MiB: three 128 MiB slots and the tables.
        assert mq.arena.num_slots == 3 and mq.arena.slot_bytes == 128 * MiB
        assert mq.stats()["arena_size"]["num_slots"] == 3
    finally:
        mq.shutdown()


def test_an_arena_whose_creation_fails_leaves_the_queue_without_one(monkeypatch, caplog):
    def no_room(*a, **k):
        raise OSError("No space left on device")

    monkeypatch.setattr(ShmTensorArena, "create", no_room)
    with caplog.at_level(logging.WARNING, logger="vllm_shm_arena"):
        mq = MessageQueue(1, 1, max_chunk_bytes=MiB, max_chunks=2, enable_shm_tensor_arena=True)
    try:
        assert mq.arena is None
        st = mq.stats()["arena_size"]
        assert st["sized_by"] == "error" and st["arena_bytes"] == 0, st
        assert "No space left on device" in caplog.text
    finally:
        mq.shutdown()


def test_a_bad_fraction_fails_the_queue_naming_the_variable(monkeypatch, shm_dir_empty):
    monkeypatch.setenv("VLLM_SHM_ARENA_FREE_FRACTION", "most")
    with pytest.raises(ValueError, match="VLLM_SHM_ARENA_FREE_FRACTION"):
        MessageQueue(1, 1, max_chunk_bytes=MiB, max_chunks=2, enable_shm_tensor_arena=True)
    assert list(shm_dir_empty.iterdir()) == [], "the half-built queue left names behind"


@pytest.fixture
def shm_dir_empty(monkeypatch):
    """An empty private shm directory (short path: see ``tmpfs``), removed afterwards."""
    d = Path(
        tempfile.mkdtemp(
            prefix="vsa-sizing-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None
        )
    )
    monkeypatch.setenv("VLLM_SHM_ARENA_SHM_DIR", str(d))
    yield d
    shutil.rmtree(d, ignore_errors=True)


def test_the_capacity_gauges_follow_live_arenas():
    prom = pytest.importorskip("prometheus_client")
    metrics._reset()
    try:
        mq = MessageQueue(1, 1, max_chunk_bytes=MiB, max_chunks=2, enable_shm_tensor_arena=True)
        queue = {"arena": "queue"}
        cap = prom.REGISTRY.get_sample_value("vllm:shm_arena_capacity_bytes", queue)
        req = prom.REGISTRY.get_sample_value("vllm:shm_arena_requested_bytes", queue)
        assert cap == mq.stats()["arena_size"]["arena_bytes"] > 0
        assert req == mq.stats()["arena_size"]["requested_bytes"]
        mq.shutdown()
        del mq
        import gc

        gc.collect()
        assert prom.REGISTRY.get_sample_value("vllm:shm_arena_capacity_bytes", queue) == 0
    finally:
        metrics._reset()


# ------------------------------------------------------------------------ 3. the memory cgroup
def _write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def test_cgroup_v2_limit_minus_usage_tightest_over_ancestors(tmp_path):
    root = tmp_path / "cg"
    proc = tmp_path / "proc_cgroup"
    proc.write_text("0::/kubepods/pod1/c1\n")
    _write(root / "kubepods/pod1/c1/memory.max", "max\n")
    _write(root / "kubepods/pod1/c1/memory.current", "100\n")
    _write(root / "kubepods/pod1/memory.max", str(4 * GiB))
    _write(root / "kubepods/pod1/memory.current", str(3 * GiB))
    _write(root / "kubepods/memory.max", str(64 * GiB))
    _write(root / "kubepods/memory.current", str(10 * GiB))
    assert sizing.cgroup_memory_available(str(root), str(proc)) == GiB


def test_cgroup_v2_namespace_root_and_over_limit(tmp_path):
    root = tmp_path / "cg"
    proc = tmp_path / "proc_cgroup"
    proc.write_text("0::/\n")
    _write(root / "memory.max", str(GiB))
    _write(root / "memory.current", str(GiB + 5))
    assert sizing.cgroup_memory_available(str(root), str(proc)) == 0


def test_cgroup_v1_limit_and_its_unlimited_sentinel(tmp_path):
    root = tmp_path / "cg"
    proc = tmp_path / "proc_cgroup"
    proc.write_text("4:memory:/docker/abc\n0::/\n")
    _write(root / "memory/docker/abc/memory.limit_in_bytes", str(2 * GiB))
    _write(root / "memory/docker/abc/memory.usage_in_bytes", str(GiB // 2))
    assert sizing.cgroup_memory_available(str(root), str(proc)) == GiB + GiB // 2
    _write(root / "memory/docker/abc/memory.limit_in_bytes", "9223372036854771712")
    assert sizing.cgroup_memory_available(str(root), str(proc)) is None


def test_no_cgroup_files_mean_no_limit(tmp_path):
    proc = tmp_path / "proc_cgroup"
    proc.write_text("0::/user.slice\n")
    assert sizing.cgroup_memory_available(str(tmp_path / "none"), str(proc)) is None
    assert sizing.cgroup_memory_available(str(tmp_path), str(tmp_path / "missing")) is None


def test_forgetting_an_arena_from_a_finalizer_never_blocks_on_the_metrics_lock():
    """The finalizer runs from any garbage collection, also one inside ``record_writer_stats``
    while this thread holds the metrics lock (a queue hung there for good)."""
    metrics._reset()
    metrics.record_arena_size("gone", 1 << 20, 2 << 20)
    assert metrics._lock.acquire(timeout=1)
    try:
        done = []
        th = threading.Thread(target=lambda: done.append(metrics.forget_arena_size("gone")))
        th.start()
        th.join(5)
        assert done, "forget_arena_size blocked while the lock was held"
        metrics.forget_arena_size("gone")  # in the lock-holding thread itself: returns too
    finally:
        metrics._lock.release()
    metrics.record_writer_stats({"hits": 0})
    assert "gone" not in metrics._sizes
    metrics._reset()
