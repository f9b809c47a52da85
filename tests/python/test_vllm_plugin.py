"""vllm_plugin.register() and the MessageQueue factory, against a fake vLLM.

The fake is a handful of ``types.ModuleType``s in ``sys.modules``: ``vllm`` (with
``__version__``), ``vllm.config`` (a ``ParallelConfig`` dataclass) and
``vllm.v1.executor.multiproc_executor`` (stub ``MessageQueue`` and ``Handle``). Our own queue is
a stub too (``_import_extension`` is patched), so these tests build no shared memory; the real
pairing is tests/python/test_vllm_real.py.
"""

from __future__ import annotations

import dataclasses
import logging
import sys
import types
from typing import Any

import pytest

from vllm_shm_arena import vllm_plugin
from vllm_shm_arena.vllm_plugin import ShmArenaMessageQueue

MPE = "vllm.v1.executor.multiproc_executor"
PLUGIN_LOGGER = "vllm.plugins.shm_tensor_arena"


class _Recorder:
    """A stub queue that remembers how it was built."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.args = args
        self.kwargs = kwargs
        self.handle = None
        self.rank = None

    @classmethod
    def create_from_handle(cls, handle: Any, rank: int) -> _Recorder:
        q = cls.__new__(cls)
        q.args, q.kwargs, q.handle, q.rank = (), {}, handle, rank
        return q


class StockMQ(_Recorder):
    """Stands for vLLM's shm_broadcast.MessageQueue."""

    @staticmethod
    def recv(sock: Any, timeout: Any) -> str:
        return "stock-recv"


class StockHandle:
    """Stands for vLLM's shm_broadcast.Handle."""


class OurMQ(_Recorder):
    """Stands for vllm_shm_arena.MessageQueue."""

    arena = None


class OurHandle:
    """Stands for vllm_shm_arena.Handle."""


@pytest.fixture
def fake_ours(monkeypatch) -> types.SimpleNamespace:
    """Our queue module, stubbed: what ``_import_extension`` returns."""
    ours = types.SimpleNamespace(MessageQueue=OurMQ, Handle=OurHandle)
    monkeypatch.setattr(vllm_plugin, "_import_extension", lambda: ours)
    return ours


@pytest.fixture
def fresh_plugin(monkeypatch):
    """Plugin state as in a new process; restored afterwards."""
    monkeypatch.setattr(vllm_plugin, "_attempted", False)
    for attr in ("_stock_cls", "_stock_handle_cls", "_ours_cls", "_ours_handle_cls"):
        monkeypatch.setattr(ShmArenaMessageQueue, attr, None)


def _install_fake_vllm(monkeypatch, version: str = "0.33.0", native_field: bool = True):
    """Puts a fake vLLM into sys.modules; returns its multiproc_executor module."""
    vllm = types.ModuleType("vllm")
    vllm.__version__ = version
    config = types.ModuleType("vllm.config")
    fields: dict[str, Any] = {"tensor_parallel_size": 1}
    if native_field:
        fields["enable_shm_tensor_arena"] = False
    config.ParallelConfig = dataclasses.make_dataclass(
        "ParallelConfig", [(k, type(v), v) for k, v in fields.items()]
    )
    v1 = types.ModuleType("vllm.v1")
    executor = types.ModuleType("vllm.v1.executor")
    mpe = types.ModuleType(MPE)
    mpe.MessageQueue = StockMQ
    mpe.Handle = StockHandle
    vllm.config, vllm.v1, v1.executor, executor.multiproc_executor = config, v1, executor, mpe
    for name, mod in (
        ("vllm", vllm),
        ("vllm.config", config),
        ("vllm.v1", v1),
        ("vllm.v1.executor", executor),
        (MPE, mpe),
    ):
        monkeypatch.setitem(sys.modules, name, mod)
    return mpe


@pytest.fixture
def fake_vllm(monkeypatch, fresh_plugin, fake_ours):
    """A supported fake vLLM (0.33.0, native flag) and our stub queue."""
    return _install_fake_vllm(monkeypatch)


def _plugin_records(caplog) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.name == PLUGIN_LOGGER and r.levelno >= logging.INFO]


# ------------------------------------------------------------------------ register()
def test_register_patches_the_executor_name(fake_vllm, caplog):
    caplog.set_level(logging.DEBUG, logger="vllm")
    vllm_plugin.register()
    assert fake_vllm.MessageQueue is ShmArenaMessageQueue
    assert ShmArenaMessageQueue._stock_cls is StockMQ
    assert ShmArenaMessageQueue._ours_cls is OurMQ
    assert _plugin_records(caplog) == []


def test_register_is_idempotent(fake_vllm, monkeypatch):
    vllm_plugin.register()
    vllm_plugin.register()
    # Even a second attempt (as after a module reload) must not wrap the factory in itself.
    monkeypatch.setattr(vllm_plugin, "_attempted", False)
    vllm_plugin.register()
    assert fake_vllm.MessageQueue is ShmArenaMessageQueue
    assert ShmArenaMessageQueue._stock_cls is StockMQ


@pytest.mark.parametrize(
    ("version", "ok"),
    [
        ("0.33.0", True),
        ("0.33.7", True),
        ("0.33.1rc1", True),
        ("0.33.0+cu130", True),
        ("0.33", True),
        ("0.32.2", False),
        ("0.34.0", False),
        ("0.34.0.dev12+g1234", False),
        ("0.33.1.dev3", False),
        ("1.0.0", False),
        ("unknown", False),
    ],
)
def test_supported_versions(version, ok):
    assert vllm_plugin.is_supported_vllm_version(version) is ok


@pytest.mark.parametrize("version", ["0.32.1", "0.34.0", "0.34.0.dev3"])
def test_unsupported_version_logs_one_line_and_keeps_stock(
    monkeypatch, fresh_plugin, fake_ours, caplog, version
):
    mpe = _install_fake_vllm(monkeypatch, version=version)
    vllm_plugin.register()
    vllm_plugin.register()
    assert mpe.MessageQueue is StockMQ
    recs = _plugin_records(caplog)
    assert len(recs) == 1, [r.getMessage() for r in recs]
    msg = recs[0].getMessage()
    assert recs[0].levelno == logging.WARNING
    assert version in msg and "0.33.x" in msg, msg


def test_missing_native_field_is_unsupported(monkeypatch, fresh_plugin, fake_ours, caplog):
    mpe = _install_fake_vllm(monkeypatch, native_field=False)
    vllm_plugin.register()
    assert mpe.MessageQueue is StockMQ
    recs = _plugin_records(caplog)
    assert len(recs) == 1
    assert "enable_shm_tensor_arena" in recs[0].getMessage()


def test_extension_failing_to_load_keeps_stock(monkeypatch, fresh_plugin, caplog):
    mpe = _install_fake_vllm(monkeypatch)

    def broken() -> types.ModuleType:
        raise ImportError("vllm_shm_arena._C was built against torch 2.13.0, but torch 9.9")

    monkeypatch.setattr(vllm_plugin, "_import_extension", broken)
    vllm_plugin.register()  # must not raise
    assert mpe.MessageQueue is StockMQ
    recs = _plugin_records(caplog)
    assert len(recs) == 1
    msg = recs[0].getMessage()
    assert "cannot load the extension" in msg and "torch 9.9" in msg and "0.33.0" in msg, msg


def test_vllm_not_importable_is_quiet_and_safe(monkeypatch, fresh_plugin, caplog):
    monkeypatch.setitem(sys.modules, "vllm", None)  # `import vllm` raises ImportError
    vllm_plugin.register()
    recs = _plugin_records(caplog)
    assert len(recs) == 1 and "vLLM cannot be imported" in recs[0].getMessage()


def test_unexpected_error_never_escapes(monkeypatch, fresh_plugin, fake_ours, caplog):
    mpe = _install_fake_vllm(monkeypatch)
    del mpe.Handle  # a vLLM whose module no longer looks as verified
    vllm_plugin.register()
    recs = _plugin_records(caplog)
    assert len(recs) == 1 and "unexpected error" in recs[0].getMessage()


def test_register_uses_the_real_extension_by_default(fresh_plugin, monkeypatch):
    import vllm_shm_arena

    mpe = _install_fake_vllm(monkeypatch)
    vllm_plugin.register()
    assert mpe.MessageQueue is ShmArenaMessageQueue
    assert ShmArenaMessageQueue._ours_cls is vllm_shm_arena.MessageQueue
    assert ShmArenaMessageQueue._ours_handle_cls is vllm_shm_arena.Handle


def test_importing_the_package_does_not_import_vllm(run_py):
    rc, out, err = run_py(
        """
        import sys
        import vllm_shm_arena, vllm_shm_arena.vllm_plugin, vllm_shm_arena.metrics
        print("vllm" in sys.modules)
        """
    )
    assert rc == 0, err
    assert out.strip() == "False"


# ------------------------------------------------------------------------ the factory
def test_flag_off_builds_vllms_queue(fake_vllm):
    vllm_plugin.register()
    q = fake_vllm.MessageQueue(2, 2, max_chunk_bytes=16 << 20, connect_ip="127.0.0.1")
    assert type(q) is StockMQ
    assert q.args == (2, 2, None)
    assert q.kwargs == {
        "max_chunk_bytes": 16 << 20,
        "max_chunks": 10,
        "connect_ip": "127.0.0.1",
        "enable_shm_tensor_arena": False,
    }
    # vLLM's response queue, MessageQueue(1, 1), stays vLLM's too.
    assert type(fake_vllm.MessageQueue(1, 1)) is StockMQ


def test_flag_on_all_local_builds_ours(fake_vllm, caplog):
    caplog.set_level(logging.INFO, logger="vllm")
    vllm_plugin.register()
    q = fake_vllm.MessageQueue(
        4, 4, None, 16 << 20, 10, "127.0.0.1", enable_shm_tensor_arena=True, future_arg=1
    )
    assert type(q) is OurMQ
    assert q.args == (4, 4, None)
    assert q.kwargs == {
        "max_chunk_bytes": 16 << 20,
        "max_chunks": 10,
        "connect_ip": "127.0.0.1",
        "enable_shm_tensor_arena": True,
    }
    assert any("C++ shm tensor arena" in r.getMessage() for r in _plugin_records(caplog))


def test_flag_on_positional_like_vllm(fake_vllm):
    vllm_plugin.register()
    # vLLM's parameter is not keyword-only: the seventh positional argument is the flag.
    q = fake_vllm.MessageQueue(2, 2, [0, 1], 1 << 20, 4, None, True)
    assert type(q) is OurMQ
    assert q.args == (2, 2, [0, 1])


def test_flag_on_with_remote_readers_logs_once_and_builds_stock(fake_vllm, caplog):
    vllm_plugin.register()
    q = fake_vllm.MessageQueue(
        8, 4, max_chunk_bytes=1 << 20, connect_ip="127.0.0.1", enable_shm_tensor_arena=True
    )
    assert type(q) is StockMQ
    assert q.kwargs["enable_shm_tensor_arena"] is True  # vLLM's own class decides for itself
    recs = _plugin_records(caplog)
    assert len(recs) == 1 and recs[0].levelno == logging.WARNING
    assert "4 of 8 readers" in recs[0].getMessage()


def test_extra_kwargs_reach_vllms_queue(fake_vllm):
    vllm_plugin.register()
    q = fake_vllm.MessageQueue(1, 1, some_new_option="x")
    assert type(q) is StockMQ and q.kwargs["some_new_option"] == "x"


def test_errors_from_our_queue_propagate(fake_vllm, monkeypatch):
    def no_room(*args: Any, **kwargs: Any) -> None:
        raise OSError("/dev/shm has 64 MiB free; the arena needs 2048 MiB")

    monkeypatch.setattr(OurMQ, "__init__", no_room)
    vllm_plugin.register()
    with pytest.raises(OSError, match="/dev/shm"):
        fake_vllm.MessageQueue(2, 2, enable_shm_tensor_arena=True)


def test_create_from_handle_dispatches_on_handle_type(fake_vllm):
    vllm_plugin.register()
    ours = fake_vllm.MessageQueue.create_from_handle(OurHandle(), 1)
    assert type(ours) is OurMQ and ours.rank == 1
    stock = fake_vllm.MessageQueue.create_from_handle(StockHandle(), 0)
    assert type(stock) is StockMQ and stock.rank == 0


def test_create_from_handle_rejects_a_foreign_handle(fake_vllm):
    vllm_plugin.register()

    class SomeoneElsesHandle:
        pass

    with pytest.raises(TypeError, match="SomeoneElsesHandle"):
        fake_vllm.MessageQueue.create_from_handle(SomeoneElsesHandle(), 0)


def test_factory_stands_in_for_vllms_class(fake_vllm):
    vllm_plugin.register()
    mq_cls = fake_vllm.MessageQueue
    assert isinstance(mq_cls(1, 1), mq_cls)
    assert isinstance(mq_cls(2, 2, enable_shm_tensor_arena=True), mq_cls)
    assert not isinstance(object(), mq_cls)
    assert mq_cls.recv(None, None) == "stock-recv"  # other class-level names: vLLM's


def test_factory_before_register_says_so(fresh_plugin):
    with pytest.raises(RuntimeError, match="register"):
        ShmArenaMessageQueue(1, 1)
