"""Pinning and event-gated release through the real bindings, against a fake CUDA runtime.

The fake (tests/fake_cudart/fake_cudart.c, built into build/cpp by the test command) is loaded
through VLLM_SHM_ARENA_CUDART, exactly where the shim would otherwise find the runtime torch
loaded. "This process has a CUDA context" is forced by setting arena._cuda_seen, which is what
torch.cuda.is_initialized() would flip on a GPU machine.
"""

from __future__ import annotations

import ctypes
import gc
import mmap
import os
import struct
import subprocess
import sys
import textwrap

import pytest
import torch
from conftest import FAKE_CUDART as FAKE

import vllm_shm_arena.arena as arena_mod
from vllm_shm_arena import ShmTensorArena

pytestmark = pytest.mark.skipif(
    not os.path.exists(FAKE), reason=f"fake CUDA runtime not built ({FAKE}); run make test"
)

SLOT = 4 << 20
STREAM = 0x5EED  # any non-null cudaStream_t value; the fake only records it


def _pair(num_slots=2):
    w = ShmTensorArena.create(1, num_slots=num_slots, slot_bytes=SLOT)
    r = ShmTensorArena.attach(w.handle(), 0)
    w.unlink()
    return w, r


def _get(w, r, value=7):
    t = torch.full((SLOT,), value, dtype=torch.uint8)
    slot, gen = w.write(t)
    return r.get_tensor(slot, SLOT, torch.uint8, (SLOT,), generation=gen)


def test_registers_the_data_region_once(fake, context):
    w, r = _pair(num_slots=3)
    a = _get(w, r)
    b = _get(w, r)
    assert fake.fake_cudart_register_calls() == 1
    # One registration covering every slot: a copy never crosses two registrations.
    assert fake.fake_cudart_registered_bytes() == 3 * SLOT
    assert r.stats()["pinned_bytes"] == 3 * SLOT
    assert fake.fake_cudart_last_register_flags() == 1  # cudaHostRegisterPortable
    for t in (a, b):
        ptr, n = ctypes.c_void_p(t.data_ptr()), ctypes.c_size_t(SLOT)
        assert fake.fake_cudart_is_registered(ptr, n) == 1
    del a, b


def test_freed_slot_waits_for_its_event(fake, context):
    live = fake.fake_cudart_live_events()  # (events of gates other tests left alive)
    w, r = _pair(num_slots=1)
    fake.fake_cudart_hold_events(1)
    t = _get(w, r)
    del t  # storage freed: now only the (fake) DMA may still read the slot
    assert w.write_tensor(torch.zeros(16, dtype=torch.uint8)) is None  # not released yet
    assert r.flush_releases(STREAM) == 0  # event recorded, still pending
    assert fake.fake_cudart_last_record_stream() == STREAM
    assert r.stats()["pending_releases"] == 1
    assert w.write_tensor(torch.zeros(16, dtype=torch.uint8)) is None
    fake.fake_cudart_complete_all()
    assert r.flush_releases(STREAM) == 1
    assert w.write_tensor(torch.zeros(16, dtype=torch.uint8)) is not None
    assert fake.fake_cudart_live_events() - live <= 1  # pooled, not leaked


# ArenaHeader.next_generation (csrc/core/arena_layout.h): the generation the writer hands out
# next, at this byte offset of the region's first page.
_NEXT_GENERATION_OFFSET = 96


def _set_next_generation(w: ShmTensorArena, gen: int) -> None:
    h = w.handle()
    with open(os.path.join(h.dir, h.name), "r+b") as f, mmap.mmap(f.fileno(), 4096) as m:
        (now,) = struct.unpack_from("<Q", m, _NEXT_GENERATION_OFFSET)
        assert now == 1, f"not a fresh arena's next_generation ({now}): has the layout moved?"
        struct.pack_into("<Q", m, _NEXT_GENERATION_OFFSET, gen)


def test_a_pinned_release_never_loses_a_large_generation(fake, context):
    # A pinned tensor's release travels through the event gate as one 64-bit token. The
    # writer counts generations privately (a peer rewriting the shared counter changes
    # nothing) and below 2^44; a stub naming a generation whose bits do not fit a token is
    # refused up front, holding nothing, never released as another.
    w = ShmTensorArena.create(1, num_slots=1, slot_bytes=SLOT)
    r = ShmTensorArena.attach(w.handle(), 0)
    _set_next_generation(w, (1 << 44) - 1)
    w.unlink()
    t = torch.full((SLOT,), 3, dtype=torch.uint8)
    slot, gen = w.write(t)
    assert gen == 1  # from the writer's private counter, not the rewritten shared one
    got = r.get_tensor(slot, SLOT, torch.uint8, (SLOT,), generation=gen)
    assert r.stats()["pinned_bytes"] > 0  # its release goes through the gate
    del got
    fake.fake_cudart_complete_all()
    assert r.flush_releases(STREAM) == 1
    res = w.write(t)
    assert res is not None, "the slot did not come back"
    slot, gen = res
    with pytest.raises(ValueError, match="generation"):
        r.get_tensor(slot, SLOT, torch.uint8, (SLOT,), generation=1 << 44)
    assert r.stats()["held"] == 0
    got = r.get_tensor(slot, SLOT, torch.uint8, (SLOT,), generation=gen)
    del got
    fake.fake_cudart_complete_all()
    assert r.flush_releases(STREAM) == 1
    assert w.write(t) is not None, "a refused stub cost the slot"


def test_views_keep_the_slot_until_the_last_dies(fake, context):
    w, r = _pair(num_slots=1)
    t = _get(w, r)
    view = t[10:20]
    del t
    assert r.flush_releases(STREAM) == 0
    assert r.stats()["pending_releases"] == 0  # the view still holds the storage
    del view
    assert r.flush_releases(STREAM) == 1


def test_unpinned_release_is_immediate_and_calls_nothing(fake, monkeypatch):
    # No CUDA context (forced off: on a GPU machine an earlier test may have created one):
    # the runtime must not even be looked at.
    monkeypatch.setattr(arena_mod, "_cuda_seen", False)
    monkeypatch.setattr(arena_mod, "_cuda_context", lambda: False)
    w, r = _pair(num_slots=1)
    t = _get(w, r)
    del t
    assert w.write_tensor(torch.zeros(16, dtype=torch.uint8)) is not None
    assert r.flush_releases() == 0
    assert fake.fake_cudart_calls() == 0


def test_registration_failure_leaves_the_arena_working(fake, context, capfd):
    fake.fake_cudart_fail_register(2)  # cudaErrorMemoryAllocation
    w, r = _pair(num_slots=1)
    for v in (1, 2, 3):
        t = _get(w, r, value=v)
        assert int(t[0]) == v and int(t[-1]) == v
        del t  # unpinned: released at once
    assert fake.fake_cudart_register_calls() == 1  # tried once, never retried
    assert r.stats()["pin_failed"] is True
    assert r.stats()["pinned_bytes"] == 0
    err = capfd.readouterr().err
    assert err.count("cudaHostRegister") == 1  # logged once


def test_process_without_context_never_calls_runtime():
    # A clean interpreter: point the shim at the fake, never create a context, use the arena.
    code = textwrap.dedent(
        f"""
        import ctypes, torch
        from vllm_shm_arena import ShmTensorArena, dumps, loads
        w = ShmTensorArena.create(1, num_slots=2, slot_bytes={SLOT})
        r = ShmTensorArena.attach(w.handle(), 0)
        t = torch.ones({SLOT}, dtype=torch.uint8)
        for _ in range(3):
            out = loads(*dumps({{"t": t}}, w))  # below MIN_BYTES: out-of-band
            s = w.write_tensor(t)
            x = r.get_tensor(s, {SLOT}, torch.uint8, ({SLOT},))
            del x, out
            r.flush_releases()
        lib = ctypes.CDLL({FAKE!r})
        print("calls", lib.fake_cudart_calls())
        """
    )
    env = dict(os.environ, VLLM_SHM_ARENA_CUDART=FAKE)
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    assert "calls 0" in out.stdout


def test_dropping_the_arena_before_its_last_pinned_tensor_keeps_the_gate(fake, context):
    """The arena (or its queue) is dropped first, then the last pinned tensor dies with no
    event recorded for it: a non_blocking H2D may still read the slot, so the rank stays
    attached and the memory registered; the writer may not reuse the slot."""
    w, r = _pair(num_slots=1)
    fake.fake_cudart_hold_events(1)
    t = _get(w, r)
    ptr = ctypes.c_void_p(t.data_ptr())
    del r
    gc.collect()
    del t
    gc.collect()
    assert w.write_tensor(torch.zeros(16, dtype=torch.uint8)) is None
    assert fake.fake_cudart_is_registered(ptr, ctypes.c_size_t(SLOT)) == 1
    assert w.stats()["holdings"][0]["state"] == "attached"


def test_pinning_on_a_full_shm_dir_fails_cleanly_and_stays_unpinned(fake, context, tmp_path):
    """cudaHostRegister faults in every page of the data region; on a tmpfs too full to back
    them that would be a SIGBUS. The reader backs them first and, when it cannot, stays
    unpinned (the tensor still arrives, byte-exact)."""
    mnt = tmp_path / "small"
    mnt.mkdir()
    rc = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=16m", "tmpfs", str(mnt)]).returncode
    if rc != 0:
        pytest.skip("mounting a small tmpfs needs root")
    try:
        w = ShmTensorArena.create(1, num_slots=2, slot_bytes=SLOT, shm_dir=str(mnt))
        r = ShmTensorArena.attach(w.handle(), 0)
        src = torch.full((SLOT,), 5, dtype=torch.uint8)
        slot, gen = w.write(src)  # backs slot 0 only
        with open(mnt / "filler", "wb") as f:  # someone else fills the rest
            try:
                os.posix_fallocate(f.fileno(), 0, 16 << 20)
            except OSError:
                size = 16 << 20
                while size > 0:
                    try:
                        os.posix_fallocate(f.fileno(), 0, size)
                        break
                    except OSError:
                        size -= 64 << 10
        t = r.get_tensor(slot, SLOT, torch.uint8, (SLOT,), generation=gen)
        assert torch.equal(t, src)
        st = r.stats()
        assert st["pin_failed"] is True and st["pin_no_space"] is True
        assert st["pinned_bytes"] == 0
        assert fake.fake_cudart_register_calls() == 0
        del t
        assert w.write_tensor(torch.zeros(16, dtype=torch.uint8)) is not None  # unpinned: freed
        r.close()
        w.close()
        del r, w
        gc.collect()
    finally:
        subprocess.run(["umount", "-l", str(mnt)])
