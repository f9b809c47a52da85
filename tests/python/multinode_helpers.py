"""Process entry points for mq/test_relay.py: readers, relays and a dying writer.

Every reader here reads ``n`` messages built by ``mq_helpers.make_msg`` and checks each (in
order: message ``seq`` carries its own key), notes the most arena tensors it held at once
(``arena.stats()["held"]``, with the last big tensor still in hand: tensors that live in its
node's arena), then keeps reading until the queue ends and reports how it ended.
"""

from __future__ import annotations

import os
import signal
import time

import mq_helpers as H  # noqa: E402
import torch

from vllm_shm_arena import MessageQueue  # noqa: E402

MiB = H.MiB


def read_and_report(
    r, name, seed, n, q, end_timeout=60.0, first_timeout=60.0, slow_s=0.0, got_all=None
):
    """Reads ``n`` checked messages from ``r`` (then sets the event ``got_all``, if given),
    then one more dequeue to see how it ends; reports ``{name, count, errors, held, end,
    stats}``."""
    errors, count, held, end = [], 0, 0, None
    keep = None
    try:
        for seq in range(n):
            msg = r.dequeue(timeout=first_timeout if seq == 0 else end_timeout)
            count += 1
            err = H.check_msg(msg, seed, seq)
            if err and len(errors) < 10:
                errors.append(err)
            if r.arena is not None and msg.get("t") is not None and msg["nbytes"] >= MiB:
                keep = msg["t"]
                held = max(held, r.arena.stats()["held"])
            del msg
            if slow_s:
                time.sleep(slow_s)
        del keep
        if got_all is not None:
            got_all.set()
        try:
            r.dequeue(timeout=end_timeout)
            end = "another message"
        except BaseException as e:
            end = f"{type(e).__name__}: {e}"
    except BaseException as e:
        errors.append(f"{type(e).__name__}: {e}")
    stats = {}
    try:
        stats = r.stats()
    except BaseException as e:
        errors.append(f"stats: {type(e).__name__}: {e}")
    q.put(
        {"name": name, "count": count, "errors": errors, "held": held, "end": end, "stats": stats}
    )


def _report_failure(q, name, e: BaseException) -> None:
    """What ``read_and_report`` puts on ``q`` for a reader that failed before reading."""
    q.put(
        {
            "name": name,
            "count": 0,
            "errors": [f"{type(e).__name__}: {e}"],
            "held": 0,
            "end": None,
            "stats": {},
        }
    )


def relay_node(handle, rank, relayed, seed, n, q, hq, go, end_timeout=60.0, got_all=None):
    """A remote node's relay: hands its downstream handle out on ``hq`` (once per relayed
    rank), reads as its node's worker (``got_all``: see ``read_and_report``), reports, then
    stays (its readers need it) until ``go`` is set."""
    torch.set_num_threads(1)
    try:
        relay = MessageQueue.create_relay(handle, rank, relayed)
    except BaseException as e:
        _report_failure(q, f"relay{rank}", e)
        return
    for _ in relayed:
        hq.put(relay.downstream_handle)
    try:
        relay.wait_until_ready(timeout=60)
    except BaseException as e:
        _report_failure(q, f"relay{rank}", e)
        return
    read_and_report(relay, f"relay{rank}", seed, n, q, end_timeout, got_all=got_all)
    go.wait(120)
    relay.shutdown()


def relayed_node(hq, index, seed, n, q, end_timeout=60.0, slow_s=0.0):
    """A relayed reader: joins its relay's downstream queue as local reader ``index``."""
    torch.set_num_threads(1)
    try:
        r = MessageQueue.create_from_handle(hq.get(timeout=60), index)
        r.wait_until_ready(timeout=60)
    except BaseException as e:
        _report_failure(q, f"relayed{index}", e)
        return
    read_and_report(r, f"relayed{index}", seed, n, q, end_timeout, slow_s=slow_s)


def plain_reader(handle, rank, seed, n, q, end_timeout=60.0):
    """A local reader of the writer's node, or a direct remote reader."""
    torch.set_num_threads(1)
    try:
        r = MessageQueue.create_from_handle(handle, rank)
        r.wait_until_ready(timeout=60)
    except BaseException as e:
        _report_failure(q, f"reader{rank}", e)
        return
    read_and_report(r, f"reader{rank}", seed, n, q, end_timeout)


def dying_writer(n_reader, sizes, seed, hq, go):
    """A writer (every reader remote, on 127.0.0.1) that sends ``sizes``, then kills itself
    once ``go`` is set (by a test that knows its readers have them all)."""
    torch.set_num_threads(1)
    mq = MessageQueue(n_reader, 0, connect_ip="127.0.0.1", enable_shm_tensor_arena=True)
    hq.put(mq.export_handle())
    mq.wait_until_ready(timeout=60)
    for seq, nbytes in enumerate(sizes):
        mq.enqueue(H.make_msg(seed, seq, nbytes), timeout=60)
    go.wait(60)
    os.kill(os.getpid(), signal.SIGKILL)
