"""The plugin against the real vLLM wheel (``make vllm-test``; skipped without vLLM).

Drives ``vllm.v1.executor.multiproc_executor.MessageQueue`` the way the executor does: the
engine side constructs it with the executor's arguments, spawned workers import vLLM, run
``register()`` and join with ``MessageQueue.create_from_handle(handle, rank)``. Messages are
shaped like the executor's RPCs, ``(method, args, kwargs, output_rank)``, and carry tensors
of at least 8 MiB, which readers check byte for byte against the seed.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import subprocess
import sys
import textwrap
import traceback
from pathlib import Path
from typing import Any

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]

try:
    import vllm.v1.executor.multiproc_executor as mpe
    from vllm.distributed.device_communicators import shm_broadcast

    _SKIP_REASON = ""
except Exception as e:  # not installed, or its import dependencies are missing
    mpe = shm_broadcast = None
    _SKIP_REASON = (
        f"vllm.v1.executor.multiproc_executor is not importable here "
        f"({type(e).__name__}: {e}); `make vllm-test` builds a venv where it is"
    )

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(bool(_SKIP_REASON), reason=_SKIP_REASON or "vLLM importable"),
]

MiB = 1 << 20
N_MSG = 3
#: Bytes of the two large tensors of every message (both >= the arena's 8 MiB threshold).
BIG = (8 * MiB, 12 * MiB)
TIMEOUT_S = 240


def make_message(seed: int, i: int) -> tuple[str, tuple, dict, int | None]:
    """Message ``i``: an RPC tuple with two large tensors (fp32, bf16) and a small one."""
    g = torch.Generator().manual_seed(seed * 1000 + i)
    a = torch.randint(0, 256, (BIG[0],), generator=g, dtype=torch.uint8).view(torch.float32)
    b = torch.randint(0, 256, (BIG[1],), generator=g, dtype=torch.uint8).view(torch.bfloat16)
    small = torch.arange(100, dtype=torch.int64) + i
    return ("execute_model", (i, a.reshape(-1, 1024)), {"mm": {"pixels": b}, "ids": small}, None)


def check_message(msg: Any, seed: int, i: int) -> str | None:
    """None if ``msg`` is byte-identical to ``make_message(seed, i)``; else what differs."""
    want = make_message(seed, i)
    try:
        method, (idx, a), kwargs, rank = msg
        pairs = [(a, want[1][1]), (kwargs["mm"]["pixels"], want[2]["mm"]["pixels"])]
        pairs.append((kwargs["ids"], want[2]["ids"]))
    except Exception as e:
        return f"message {i} has the wrong structure: {e!r}"
    if (method, idx, rank) != (want[0], i, want[3]):
        return f"message {i}: header {(method, idx, rank)}"
    for got, exp in pairs:
        if got.dtype != exp.dtype or got.shape != exp.shape:
            return f"message {i}: {got.dtype}{tuple(got.shape)} != {exp.dtype}{tuple(exp.shape)}"
        if not torch.equal(got.reshape(-1).view(torch.uint8), exp.reshape(-1).view(torch.uint8)):
            return f"message {i}: bytes differ"
    return None


def reader_main(handle: Any, rank: int, seed: int, results: Any) -> None:
    """A worker: registers the plugin, joins through vLLM's name, checks every message."""
    try:
        import vllm.v1.executor.multiproc_executor as mpe

        from vllm_shm_arena import vllm_plugin

        vllm_plugin.register()
        q = mpe.MessageQueue.create_from_handle(handle, rank)
        q.wait_until_ready()
        errors = []
        for i in range(N_MSG):
            msg = q.dequeue(timeout=TIMEOUT_S)
            err = check_message(msg, seed, i)
            if err:
                errors.append(err)
            del msg
        kind = f"{type(q).__module__}.{type(q).__qualname__}"
        results.put((rank, kind, errors, None))
        q.shutdown()
    except BaseException:
        results.put((rank, None, [], traceback.format_exc()))


@pytest.fixture(scope="module")
def patched() -> Any:
    from vllm_shm_arena import vllm_plugin

    vllm_plugin.register()
    assert mpe.MessageQueue is vllm_plugin.ShmArenaMessageQueue
    return mpe


def _broadcast(q: Any, seed: int) -> list[tuple]:
    """Runs two spawned readers of ``q`` through N_MSG messages; -> their reports."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    handle = q.export_handle()
    procs = [
        ctx.Process(target=reader_main, args=(handle, r, seed, results), daemon=True)
        for r in range(2)
    ]
    for p in procs:
        p.start()
    try:
        q.wait_until_ready()
        for i in range(N_MSG):
            q.enqueue(make_message(seed, i))
        reports = sorted(results.get(timeout=TIMEOUT_S) for _ in procs)
        for p in procs:
            p.join(timeout=60)
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
    for rank, _, _, tb in reports:
        assert tb is None, f"reader {rank} failed:\n{tb}"
    return reports


def test_flag_on_uses_our_queue_end_to_end(patched, seed):
    import vllm_shm_arena

    q = patched.MessageQueue(
        2,
        2,
        max_chunk_bytes=16 << 20,
        connect_ip="127.0.0.1",
        enable_shm_tensor_arena=True,
    )
    try:
        assert type(q) is vllm_shm_arena.MessageQueue
        assert isinstance(q, patched.MessageQueue)
        reports = _broadcast(q, seed)
        for rank, kind, errors, _ in reports:
            assert kind == "vllm_shm_arena.message_queue.MessageQueue", (rank, kind)
            assert errors == [], (rank, errors)
        arena = q.stats()["arena"]
        # Every large tensor took the arena: one copy each, for both readers.
        assert arena["hits"] == N_MSG * len(BIG), arena
        assert arena["bytes"] == N_MSG * sum(BIG), arena
        assert arena["declined"]["no_free_slot"] == 0, arena
        print(f"writer arena stats: hits={arena['hits']} bytes={arena['bytes']}")
    finally:
        q.shutdown()


def test_flag_off_is_vllms_own_queue_end_to_end(patched, seed):
    q = patched.MessageQueue(2, 2, max_chunk_bytes=16 << 20, connect_ip="127.0.0.1")
    try:
        assert type(q) is shm_broadcast.MessageQueue
        assert getattr(q, "tensor_arena", None) is None
        reports = _broadcast(q, seed)
        for rank, kind, errors, _ in reports:
            # The readers got vLLM's Handle, so create_from_handle built vLLM's reader.
            assert kind.endswith("shm_broadcast.MessageQueue"), (rank, kind)
            assert errors == [], (rank, errors)
    finally:
        q.shutdown()


def test_remote_readers_and_response_queues_stay_stock(patched):
    # Remote readers in a layout vLLM's executor does not make (3 readers, 2 of them local:
    # nodes cannot be told by rank number) stay vLLM's; the executor's own multi-node layout
    # is tests/python/test_vllm_multinode.py's.
    q = patched.MessageQueue(
        3, 2, max_chunk_bytes=1 << 20, connect_ip="127.0.0.1", enable_shm_tensor_arena=True
    )
    try:
        assert type(q) is shm_broadcast.MessageQueue
        assert q.export_handle().remote_subscribe_addr.startswith("tcp://127.0.0.1:")
    finally:
        q.shutdown()
    response_q = patched.MessageQueue(1, 1)  # what every worker builds for its replies
    try:
        assert type(response_q) is shm_broadcast.MessageQueue
    finally:
        response_q.shutdown()


def worker_main(handle: Any, seed: int, results: Any) -> None:
    """A worker as vLLM's ``WorkerProc`` sets up its queues on one node (its real
    ``_init_message_queues``, with the flag in its parallel config): joins the broadcast,
    builds its response queue, hands its handle back, then answers every message with
    ``(SUCCESS, output)``, the output carrying a 3 MiB tensor."""
    try:
        import types

        import vllm.v1.executor.multiproc_executor as mpe

        from vllm_shm_arena import vllm_plugin

        vllm_plugin.register()
        proc = types.SimpleNamespace(worker=types.SimpleNamespace(rank=0))
        parallel = types.SimpleNamespace(nnodes_within_dp=1, enable_shm_tensor_arena=True)
        config = types.SimpleNamespace(parallel_config=parallel)
        mpe.WorkerProc._init_message_queues(proc, handle, config)
        response = proc.worker_response_mq
        kind = f"{type(response).__module__}.{type(response).__qualname__}"
        results.put(("handle", kind, response.export_handle()))
        proc.rpc_broadcast_mq.wait_until_ready()
        response.wait_until_ready()
        for i in range(N_MSG):
            msg = proc.rpc_broadcast_mq.dequeue(timeout=TIMEOUT_S)
            out = {"i": i, "error": check_message(msg, seed, i)}
            out["pooled"] = torch.full((3 * MiB // 4,), float(i), dtype=torch.float32)
            del msg
            response.enqueue((mpe.WorkerProc.ResponseStatus.SUCCESS, out))
        results.put(("done", kind, None))
        proc.rpc_broadcast_mq.shutdown()
        response.shutdown()
    except BaseException:
        results.put(("failed", traceback.format_exc(), None))


def test_a_flagged_workers_response_queue_is_ours_end_to_end(patched, seed):
    """vLLM's own ``WorkerProc._init_message_queues`` with the flag on builds our queue for
    the worker's replies (no tensor arena); the engine side joins it through vLLM's name with
    vLLM's call, ``create_from_handle(handle, 0)``, and gets every reply in order."""
    import vllm_shm_arena

    q = patched.MessageQueue(1, 1, connect_ip="127.0.0.1", enable_shm_tensor_arena=True)
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    proc = ctx.Process(target=worker_main, args=(q.export_handle(), seed, results), daemon=True)
    proc.start()
    response = None
    try:
        what, kind, handle = results.get(timeout=TIMEOUT_S)
        assert what == "handle", kind
        assert kind == "vllm_shm_arena.message_queue.MessageQueue", kind
        response = patched.MessageQueue.create_from_handle(handle, 0)
        assert type(response) is vllm_shm_arena.MessageQueue
        q.wait_until_ready()
        response.wait_until_ready()
        for i in range(N_MSG):
            q.enqueue(make_message(seed, i))
            status, out = response.dequeue(timeout=TIMEOUT_S)
            assert status == patched.WorkerProc.ResponseStatus.SUCCESS
            assert (out["i"], out["error"]) == (i, None), out
            assert torch.equal(out["pooled"], torch.full((3 * MiB // 4,), float(i)))
        assert results.get(timeout=TIMEOUT_S)[0] == "done"
        assert response.arena is None
        assert response._end.ring.cede_cpu  # the engine core cedes its CPU to the workers
        proc.join(timeout=60)
    finally:
        if proc.is_alive():
            proc.kill()
        if response is not None:
            response.shutdown()
        q.shutdown()


def _run_vllm_py(code: str, env: dict[str, str] | None = None) -> str:
    full_env = dict(os.environ)
    full_env["PYTHONPATH"] = os.pathsep.join([str(REPO), full_env.get("PYTHONPATH", "")])
    # Building EngineArgs' parser needs a device type; a CPU-only machine cannot infer one.
    full_env.setdefault("VLLM_TARGET_DEVICE", "cpu")
    full_env.update(env or {})
    p = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        cwd=REPO,
        env=full_env,
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
    )
    assert p.returncode == 0, p.stderr
    return p.stdout.strip().splitlines()[-1]


_LOAD_PLUGINS = """
    from vllm.plugins import load_general_plugins
    load_general_plugins()
    import vllm.v1.executor.multiproc_executor as mpe
    from vllm.engine.arg_utils import EngineArgs
    from vllm.utils.argparse_utils import FlexibleArgumentParser
    parser = EngineArgs.add_cli_args(FlexibleArgumentParser())
    on = parser.parse_args(["--enable-shm-tensor-arena"]).enable_shm_tensor_arena
    off = parser.parse_args([]).enable_shm_tensor_arena
    print(mpe.MessageQueue.__name__, on, off)
"""


def _entry_point_installed() -> bool:
    from importlib.metadata import entry_points

    return any(ep.name == "shm_tensor_arena" for ep in entry_points(group="vllm.general_plugins"))


@pytest.mark.skipif(
    not _SKIP_REASON and not _entry_point_installed(),
    reason="vllm_shm_arena is not installed here (no vllm.general_plugins entry point)",
)
def test_vllms_plugin_loader_patches_and_the_native_flag_parses():
    # vLLM's own loader finds our entry point; the plugin adds no CLI flag of its own.
    assert _run_vllm_py(_LOAD_PLUGINS) == "ShmArenaMessageQueue True False"
    # VLLM_PLUGINS is an allowlist: without our name, vLLM's queue stays.
    only_lora = {"VLLM_PLUGINS": "lora_filesystem_resolver"}
    assert _run_vllm_py(_LOAD_PLUGINS, env=only_lora) == "MessageQueue True False"
