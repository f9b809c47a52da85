"""Smoke test of an installed vllm-shm-arena: the import, an arena write/get, a queue round trip.

Run by e2e/compat_test.sh and tests/python/test_install.py with the interpreter of the
environment under test, from a directory holding no source tree (so the installed package is
the one imported). Prints one line per check and ``smoke ok`` at the end; exits non-zero on the
first failure. Uses a private shared-memory directory, removed at the end.
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
import threading

_shm_dir = tempfile.mkdtemp(
    prefix="vsa-smoke-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None
)
os.environ["VLLM_SHM_ARENA_SHM_DIR"] = _shm_dir


def main() -> int:
    """Runs the checks; returns the exit code."""
    import torch

    import vllm_shm_arena
    from vllm_shm_arena import MessageQueue, ShmTensorArena, _build_info, _ext

    here = os.path.dirname(os.path.abspath(vllm_shm_arena.__file__))
    print(
        f"imported {here} (torch {torch.__version__}, _C built for {_ext._C.TORCH_VERSION}, "
        f"C++{_build_info.CXX_STANDARD})"
    )
    if not here.startswith(os.path.realpath(sys.prefix) + os.sep) and not here.startswith(
        sys.prefix + os.sep
    ):
        print(f"FAIL: the package came from {here}, not from the environment {sys.prefix}")
        return 1

    w = ShmTensorArena.create(1, 2, 4 << 20)
    r = ShmTensorArena.attach(w.handle(), 0)
    t = torch.arange(1 << 18, dtype=torch.float32)
    slot = w.write_tensor(t)
    if slot is None:
        print(f"FAIL: write_tensor declined: {w.stats()}")
        return 1
    got = r.get_tensor(slot, t.nbytes, t.dtype, t.shape)
    if not torch.equal(got, t):
        print("FAIL: get_tensor returned other bytes than were written")
        return 1
    del got
    r.close()
    w.close()
    print("arena write/get ok")

    mq = MessageQueue(1, 1, enable_shm_tensor_arena=True)
    rq = MessageQueue.create_from_handle(mq.export_handle(), 0)
    errors: list[BaseException] = []

    def ready(q):
        try:
            q.wait_until_ready(timeout=60)
        except BaseException as e:  # reported below
            errors.append(e)

    ths = [threading.Thread(target=ready, args=(q,), daemon=True) for q in (mq, rq)]
    for th in ths:
        th.start()
    for th in ths:
        th.join(90)
    if errors or any(th.is_alive() for th in ths):
        print(f"FAIL: wait_until_ready: {errors or 'timed out'}")
        return 1
    big = torch.full((4 << 20,), 7, dtype=torch.uint8)
    mq.enqueue({"pixel_values": big, "step": 1})
    msg = rq.dequeue(timeout=60)
    if msg["step"] != 1 or not torch.equal(msg["pixel_values"], big):
        print("FAIL: the message came back different")
        return 1
    arena_hits = mq.stats()["arena"]["hits"]
    del msg
    rq.shutdown()
    mq.shutdown()
    if arena_hits < 1:
        print("FAIL: the tensor did not go through the arena")
        return 1
    print(f"queue round trip ok (arena hits {arena_hits})")
    print("smoke ok")
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    finally:
        shutil.rmtree(_shm_dir, ignore_errors=True)
