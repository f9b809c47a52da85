"""Shared fixtures for the Python suite.

* ``seed`` / ``rng``: one seed per session (``VSA_SEED`` or random), printed in the report
  header and per test, so any failure replays with ``VSA_SEED=<n> pytest ...``.
* ``make_arena`` / ``arena``: a small writer arena with attached readers, closed afterwards.
* ``run_py``: runs a Python snippet in a fresh interpreter -> ``(returncode, stdout, stderr)``.
* ``dtype``: any test taking a ``dtype`` argument runs for every dtype a stub can carry.
* ``fake`` / ``context``: the fake CUDA runtime (tests/fake_cudart, built by the test command)
  loaded in place of the real one, and "this process has a CUDA context" forced.
"""

from __future__ import annotations

import dataclasses
import gc
import os
import random
import subprocess
import sys
import textwrap
import zlib
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]

# Every test, and every process a test starts, uses a private shared-memory directory, never
# the shared /dev/shm: set before the package is imported, inherited by children.
_OWN_SHM_DIR = None
if not os.environ.get("VLLM_SHM_ARENA_SHM_DIR"):
    import tempfile

    _base = "/dev/shm" if os.path.isdir("/dev/shm") else None
    _OWN_SHM_DIR = tempfile.mkdtemp(prefix="vsa-pytest-", dir=_base)
    os.environ["VLLM_SHM_ARENA_SHM_DIR"] = _OWN_SHM_DIR


def pytest_sessionfinish(session, exitstatus):
    """Removes the session's private shm directory, saying what tests left in it."""
    if _OWN_SHM_DIR is None:
        return
    import shutil

    left = sorted(os.listdir(_OWN_SHM_DIR)) if os.path.isdir(_OWN_SHM_DIR) else []
    if left:
        print(f"\nvllm-shm-arena: tests left {len(left)} name(s) in their shm dir: {left[:8]}")
    shutil.rmtree(_OWN_SHM_DIR, ignore_errors=True)


# The package is imported from the checkout; spawned children inherit this sys.path.
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from vllm_shm_arena import ShmTensorArena  # noqa: E402

#: Every dtype the arena and the out-of-band path must carry byte-exactly.
ALL_DTYPES = [
    torch.float32,
    torch.float16,
    torch.float64,
    torch.bfloat16,
    torch.float8_e4m3fn,
    torch.float8_e5m2,
    torch.bool,
    torch.complex64,
    torch.complex128,
    torch.int8,
    torch.int16,
    torch.int32,
    torch.int64,
    torch.uint8,
    torch.uint16,
    torch.uint32,
    torch.uint64,
]

SEED = int(os.environ.get("VSA_SEED", random.randrange(2**32)))


def pytest_report_header(config):
    return f"vllm-shm-arena: VSA_SEED={SEED} (set it to replay)"


def pytest_generate_tests(metafunc):
    if "dtype" in metafunc.fixturenames:
        metafunc.parametrize(
            "dtype", ALL_DTYPES, ids=[str(d).removeprefix("torch.") for d in ALL_DTYPES]
        )


#: The fake CUDA runtime the test command builds (tests/fake_cudart/fake_cudart.c).
FAKE_CUDART = str(REPO / "build" / "cpp" / "libfakecudart.so")


@pytest.fixture
def fake(monkeypatch):
    """The fake CUDA runtime, loaded through VLLM_SHM_ARENA_CUDART where the shim would
    otherwise find the real one; reset before and after the test."""
    if not os.path.exists(FAKE_CUDART):
        pytest.skip(f"fake CUDA runtime not built ({FAKE_CUDART}); run make test")
    import ctypes

    monkeypatch.setenv("VLLM_SHM_ARENA_CUDART", FAKE_CUDART)
    lib = ctypes.CDLL(FAKE_CUDART)
    for name in ("fake_cudart_registered_bytes", "fake_cudart_register_count"):
        getattr(lib, name).restype = ctypes.c_size_t
    lib.fake_cudart_register_count.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    lib.fake_cudart_last_record_stream.restype = ctypes.c_void_p
    lib.fake_cudart_reset()
    yield lib
    lib.fake_cudart_reset()


@pytest.fixture
def context(monkeypatch):
    """ "This process has a CUDA context", which torch.cuda.is_initialized() would say on a
    GPU machine: the arena pins what it hands out."""
    import vllm_shm_arena.arena as arena_mod

    monkeypatch.setattr(arena_mod, "_cuda_seen", True)


@pytest.fixture
def kids():
    """Child processes of the test (fork by default; mq_helpers.Kids); all killed at
    teardown."""
    import mq_helpers

    k = mq_helpers.Kids("fork")
    try:
        yield k
    finally:
        k.kill_all()


@pytest.fixture(scope="session")
def seed() -> int:
    """The session's random seed (printed so a failure can be replayed)."""
    print(f"VSA_SEED={SEED}")
    return SEED


@pytest.fixture
def rng(seed, request) -> torch.Generator:
    """A torch generator seeded from the session seed and the test's id (stable per test)."""
    per_test = (seed + zlib.crc32(request.node.nodeid.encode())) % 2**63
    print(f"VSA_SEED={seed} (test generator seed {per_test})")
    return torch.Generator().manual_seed(per_test)


def rand_tensor(shape, dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    """Random bytes of ``dtype`` (NaN payloads included: tests compare bytes, not values)."""
    shape = tuple(shape)
    numel = 1
    for d in shape:
        numel *= d
    if dtype is torch.bool:
        return torch.randint(0, 2, shape, generator=gen, dtype=torch.uint8).bool()
    itemsize = torch.empty((), dtype=dtype).element_size()
    raw = torch.randint(0, 256, (numel * itemsize,), generator=gen, dtype=torch.uint8)
    return raw.view(dtype).reshape(shape)


def byte_view(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes as a flat uint8 tensor (every dtype, 0-dim included)."""
    return t.detach().reshape(-1).view(torch.uint8)


def assert_same_bytes(got: torch.Tensor, want: torch.Tensor) -> None:
    """Same dtype, shape and bytes."""
    assert got.dtype == want.dtype, (got.dtype, want.dtype)
    assert tuple(got.shape) == tuple(want.shape), (got.shape, want.shape)
    assert torch.equal(byte_view(got), byte_view(want)), "bytes differ"


def in_use_after_release(writer: ShmTensorArena, readers=()) -> int:
    """Collects garbage, flushes every reader's releases, reclaims; -> slots still in use."""
    gc.collect()
    for r in readers:
        r.flush_releases()
    writer.reclaim()
    return writer.stats()["in_use"]


@dataclasses.dataclass
class Arena:
    """A writer and its attached readers (``reader`` is rank 0, the one stubs resolve to
    when there is a single reader)."""

    writer: ShmTensorArena
    readers: list

    @property
    def reader(self) -> ShmTensorArena:
        return self.readers[0]

    def in_use(self) -> int:
        return in_use_after_release(self.writer, self.readers)

    def declined(self) -> dict:
        return dict(self.writer.stats()["declined"])


@pytest.fixture
def make_arena():
    """Factory: ``make_arena(n_readers=1, num_slots=2, slot_bytes=16 MiB, attach=True)``.

    With ``attach``, every rank is attached in this process (for pickled stubs, the last one
    attached is the one ``loads`` resolves to, so keep n_readers=1 there). Everything made
    is closed at teardown.
    """
    made: list[Arena] = []

    def make(n_readers=1, num_slots=2, slot_bytes=16 << 20, attach=True) -> Arena:
        w = ShmTensorArena.create(n_readers, num_slots, slot_bytes)
        rs = [ShmTensorArena.attach(w.handle(), i) for i in range(n_readers)] if attach else []
        a = Arena(w, rs)
        made.append(a)
        return a

    yield make
    for a in made:
        for r in a.readers:
            r.close()
        a.writer.close()
    made.clear()
    gc.collect()


@pytest.fixture
def arena(make_arena) -> Arena:
    """One writer, one attached reader, 2 slots of 16 MiB."""
    return make_arena()


@pytest.fixture
def socket_overflow(monkeypatch):
    """Queues made in this test without a tensor arena get no blob region either: their
    messages too big for a ring chunk go over the local socket (the path a test of the socket
    means)."""
    from vllm_shm_arena.mq import writer as mq_writer

    monkeypatch.setattr(mq_writer, "_BLOB_REGION_BYTES", 0)


@pytest.fixture
def writers():
    """``writers(mq)`` registers a queue end to shut down at teardown (which also unlinks its
    shared-memory names)."""
    made = []
    yield made.append
    for mq in made:
        mq.shutdown()


def _run_py(code: str, timeout: float = 180, env: dict | None = None) -> tuple[int, str, str]:
    full_env = dict(os.environ)
    full_env["PYTHONPATH"] = os.pathsep.join(
        [str(REPO)] + ([full_env["PYTHONPATH"]] if full_env.get("PYTHONPATH") else [])
    )
    full_env.update(env or {})
    p = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        cwd=REPO,
        env=full_env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    return p.returncode, p.stdout, p.stderr


@pytest.fixture(scope="session")
def run_py():
    """``run_py(code, timeout=180, env=None) -> (returncode, stdout, stderr)`` in a fresh
    interpreter with the checkout importable. A negative returncode is a signal (a crash)."""
    return _run_py


@pytest.fixture
def rand(rng):
    """``rand(shape, dtype)``: random bytes of ``dtype`` from the test's seeded generator."""
    return lambda shape, dtype=torch.float32: rand_tensor(shape, dtype, rng)


@pytest.fixture
def same_bytes():
    """``same_bytes(got, want)``: asserts equal dtype, shape and bytes."""
    return assert_same_bytes
