"""Queues over a process group: vLLM's ``create_from_process_group`` (one writer rank, every
other rank reads; readers on the writer's host use shared memory) and
``create_from_process_group_single_reader`` (every rank writes a queue with one reader).

The queue class is a parameter (``MessageQueue`` passes itself), so this module never imports
the facade. ``pg`` is a ``torch.distributed`` group (e.g. gloo) or anything with vLLM's
``StatelessProcessGroup`` interface (``rank``, ``world_size``, ``broadcast_obj``,
``all_gather_obj``).
"""

from __future__ import annotations

import socket

from vllm_shm_arena.mq.protocol import Handle
from vllm_shm_arena.mq.transport import local_ip


class Group:
    """One view of a torch.distributed group or a vLLM ``StatelessProcessGroup``."""

    def __init__(self, pg):
        self.pg = pg
        self.stateless = hasattr(pg, "broadcast_obj") and hasattr(pg, "world_size")
        if self.stateless:
            self.rank, self.world = int(pg.rank), int(pg.world_size)
        else:
            import torch.distributed as dist

            self.dist = dist
            self.rank = dist.get_rank(pg)
            self.world = dist.get_world_size(pg)
            self.ranks = dist.get_process_group_ranks(pg)

    def all_gather(self, obj) -> list:
        if self.stateless:
            return list(self.pg.all_gather_obj(obj))
        out = [None] * self.world
        self.dist.all_gather_object(out, obj, group=self.pg)
        return out

    def broadcast(self, obj, src: int):
        if self.stateless:
            return self.pg.broadcast_obj(obj, src)
        box = [obj]
        self.dist.broadcast_object_list(box, src=self.ranks[src], group=self.pg)
        return box[0]

    def gather(self, obj, dst: int) -> list:
        # all_gather: StatelessProcessGroup has no gather, and the handles are small.
        return self.all_gather(obj)


def create_from_process_group(
    queue_cls,
    pg,
    max_chunk_bytes: int,
    max_chunks: int,
    writer_rank: int = 0,
    external_writer_handle: Handle | None = None,
    blocking: bool = True,
    *,
    enable_shm_tensor_arena: bool = False,
):
    """See ``MessageQueue.create_from_process_group``; ``queue_cls`` builds the queues."""
    g = Group(pg)
    hosts = g.all_gather(socket.gethostname())
    local = [r for r in range(g.world) if r != writer_rank and hosts[r] == hosts[writer_rank]]
    n_reader = g.world - 1
    remote = [r for r in range(g.world) if r != writer_rank and r not in local]
    if g.rank == writer_rank:
        if external_writer_handle is not None:
            mq = queue_cls.create_from_handle(external_writer_handle, g.rank)
        else:
            mq = queue_cls(
                n_reader,
                len(local),
                local,
                max_chunk_bytes=max_chunk_bytes,
                max_chunks=max_chunks,
                connect_ip=None if len(local) == n_reader else local_ip(),
                enable_shm_tensor_arena=enable_shm_tensor_arena,
                remote_reader_ranks=remote,
            )
        g.broadcast(mq.export_handle(), writer_rank)
    else:
        mq = queue_cls.create_from_handle(g.broadcast(None, writer_rank), g.rank)
    if blocking:
        mq.wait_until_ready()
    return mq


def create_from_process_group_single_reader(
    queue_cls,
    pg,
    max_chunk_bytes: int,
    max_chunks: int,
    reader_rank: int = 0,
    blocking: bool = False,
) -> tuple:
    """See ``MessageQueue.create_from_process_group_single_reader``."""
    g = Group(pg)
    hosts = g.all_gather(socket.gethostname())
    same_node = hosts[g.rank] == hosts[reader_rank]
    mq = queue_cls(
        n_reader=1,
        n_local_reader=1 if same_node else 0,
        max_chunk_bytes=max_chunk_bytes,
        max_chunks=max_chunks,
        connect_ip=None if same_node else local_ip(),
    )
    handles = g.gather(mq.export_handle(), reader_rank)
    if blocking:
        mq.wait_until_ready()
    return mq, handles if g.rank == reader_rank else []
