"""Fork rules: a child forked from a queue end inherits objects, not roles.

Each test forks while an arena or queue end holds something, lets the child drop or shut down
its inherited copies, and checks the parent's state is untouched: its tensors keep their bytes,
its names stay, its queue keeps delivering.
"""

from __future__ import annotations

import gc
import os

import torch
from mq_helpers import ready_in_threads

from vllm_shm_arena import MessageQueue, ShmTensorArena
from vllm_shm_arena import arena as arena_mod

MiB = 1 << 20


def _fork(child) -> int:
    """Runs ``child()`` in a forked child; returns its exit code (1 if it raised)."""
    pid = os.fork()
    if pid == 0:
        code = 0
        try:
            child()
        except BaseException:
            code = 1
        os._exit(code)
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status)


def test_child_of_a_reader_never_releases_the_parents_tensor(tmp_path):
    writer = ShmTensorArena.create(1, num_slots=1, slot_bytes=MiB, shm_dir=str(tmp_path))
    box = {"reader": ShmTensorArena.attach(writer.handle(), 0)}
    src = torch.arange(MiB // 4, dtype=torch.int32)
    slot = writer.write_tensor(src)
    assert slot is not None
    box["t"] = box["reader"].get_tensor(slot, src.nbytes, torch.int32, src.shape)

    def child():
        # What a child does with inherited copies when it no longer needs them.
        box.clear()
        gc.collect()

    assert _fork(child) == 0
    # The slot is still the parent's: the writer may not reuse it, the bytes are unchanged.
    assert writer.write_tensor(torch.zeros(16)) is None
    assert torch.equal(box["t"], src)
    del box["t"]
    gc.collect()
    assert writer.write_tensor(torch.zeros(16)) is not None
    writer.close()


def test_child_of_the_writer_neither_unlinks_nor_writes(tmp_path):
    box = {"writer": ShmTensorArena.create(1, num_slots=1, slot_bytes=MiB, shm_dir=str(tmp_path))}
    handle = box["writer"].handle()

    def child():
        w = box.pop("writer")
        try:
            w.write_tensor(torch.zeros(4))
        except ValueError:
            pass
        else:
            raise AssertionError("a forked child wrote through its parent's writer")
        w.close()
        del w
        gc.collect()

    assert _fork(child) == 0
    assert os.path.exists(os.path.join(str(tmp_path), handle.name))
    reader = ShmTensorArena.attach(handle, 0)  # the name is still there
    assert box["writer"].write_tensor(torch.zeros(4)) is not None
    reader.close()
    box["writer"].close()


def test_child_of_the_queue_writer_calling_shutdown_leaves_the_queue_running():
    mq = MessageQueue(1, 1)
    r = MessageQueue.create_from_handle(mq.export_handle(), 0)
    ready_in_threads(mq, [r])
    try:

        def child():
            mq.shutdown()  # explicit, in the child: must not stop the parent's ring

        assert _fork(child) == 0
        mq.enqueue({"n": 1}, timeout=5)
        assert r.dequeue(timeout=5) == {"n": 1}
    finally:
        mq.shutdown()
        r.shutdown()


def test_a_child_of_a_process_with_a_cuda_context_does_not_pin(tmp_path, monkeypatch):
    # A child forked after the parent made a CUDA context has none (torch refuses CUDA there,
    # and is_initialized() says False): a reader it attaches must neither pin nor gate its
    # releases on CUDA events (seen on a GPU host: the child's first flush raised "Cannot
    # re-initialize CUDA in forked subprocess").
    monkeypatch.setattr(arena_mod, "_cuda_seen", True)  # the parent's context
    writer = ShmTensorArena.create(1, num_slots=1, slot_bytes=MiB, shm_dir=str(tmp_path))
    src = torch.ones(MiB // 4, dtype=torch.int32)
    slot = writer.write_tensor(src)
    assert slot is not None

    def child():
        assert not torch.cuda.is_initialized()
        reader = ShmTensorArena.attach(writer.handle(), 0)
        t = reader.get_tensor(slot, src.nbytes, torch.int32, src.shape)
        assert int(t[0]) == 1 and not reader.needs_flush
        del t
        reader.close()

    assert _fork(child) == 0
    writer.close()
