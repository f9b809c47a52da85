"""The workers' join of the executor's broadcast queue on a multi-node vLLM run.

On ``--nnodes N`` vLLM's workers join the executor's queue through
``GroupCoordinator.create_mq_broadcaster`` (``WorkerProc._init_message_queues``), which the
plugin replaces with ``create_mq_broadcaster`` below. Over the group's gloo ``cpu_group``,
every rank runs, in this order::

    C1  in_the_same_node_as(pg, source_rank=writer_rank)   vLLM's own function: broadcast,
                                                           barrier, all_reduce
    C2  broadcast_object_list([handle], src=writer)        what the writer rank was handed
        -- vLLM's Handle:   MessageQueue.create_from_handle(handle, rank) (vLLM's, nothing more)
        -- a JoinTicket:    our roles, then
    C3  all_gather_object(vote)                            ours only: every rank's version,
                                                           error and relay handle

C1 and C2 are vLLM's ``create_from_process_group`` step for step, so before C2 no rank can
tell which queue it joins, and a rank running vLLM's own code takes the same steps. After C2
every rank holds the same object, so every rank takes the same branch.

Our roles, from our ``Handle`` alone (vLLM decides nodes by rank number, contiguous per node:
the executor gives node 0's ranks as ``local_reader_ranks``, ``L`` of them, so rank ``r`` is
on node ``r // L``)::

    node 0   ranks 0..L-1     local readers of the writer's ring and arena
    node n   rank n*L         the relay: a remote reader upstream, a ring downstream
             ranks n*L+1..    readers of the relay's ring (rank n*L+i joins as reader i)

Agreement: our handle travels in C2 inside a ``JoinTicket`` (our version and the handle's
pickle). A rank whose vLLM join is not ours (the plugin inactive there) gets the ticket from
vLLM's own C2 and fails at once in vLLM's ``create_from_handle``, whose first look at the
handle raises ``PluginMismatchError``; where the package is missing, unpickling the ticket in
C2 fails (``No module named 'vllm_shm_arena'``). Such a process leaves, and gloo fails C3 on
the others (the peer's connection closes), which ``create_mq_broadcaster`` turns into one
clear error. Every rank that runs ours, whatever its version, takes part in C3 exactly once
and raises nothing before it: what went wrong on any rank (another version, a relay that
cannot start, a layout that is not the executor's) is in its vote, and every rank raises the
same error after C3.

Only the plugin imports this module; it imports neither vLLM nor the extension at import time
(a ``JoinTicket`` must unpickle on a node whose extension does not load).
"""

from __future__ import annotations

import logging
import pickle
from typing import Any

import vllm_shm_arena
from vllm_shm_arena import settings

#: The plugin's logger (vllm_plugin.PLUGIN_NAME): vLLM's logging configuration shows its lines
#: in every process, a worker's included.
logger = logging.getLogger("vllm.plugins.shm_tensor_arena")
_PACKAGE_VERSION: str = vllm_shm_arena.__version__

#: The ticket's format; bumped whenever ``JoinTicket``'s fields or C3's vote change meaning.
#: The class name, its module and ``__reduce__``'s three arguments never change, so every
#: version can unpickle every other's ticket and vote, and tell it apart.
WIRE = 1
#: What has to match on every rank: the ticket format and the package version.
AGREEMENT = (WIRE, _PACKAGE_VERSION)

#: vLLM's Handle fields (0.32, 0.33): vLLM's ``create_from_handle`` reads one of them first.
_VLLM_HANDLE_FIELDS = (
    "local_reader_ranks",
    "buffer_handle",
    "local_subscribe_addr",
    "local_notify_addr",
    "remote_subscribe_addr",
    "remote_addr_ipv6",
    "tensor_arena_handle",
)


class PluginMismatchError(RuntimeError):
    """The ranks of one vLLM group do not all run vllm_shm_arena's plugin (same version)."""


def _tripwire(field: str) -> property:
    def read(self: JoinTicket) -> Any:
        raise PluginMismatchError(
            f"vllm_shm_arena: this process got the broadcast queue's handle from a node where "
            f"vllm_shm_arena {self.version}'s plugin is active (vLLM read Handle.{field}), "
            "but joins it with vLLM's own create_mq_broadcaster: the plugin is not active "
            "here (see this process's 'vllm_shm_arena:' log line). Every node must run the "
            "plugin, in the same version, or none (VLLM_PLUGINS, "
            "--enable-shm-tensor-arena)"
        )

    return property(read)


class JoinTicket:
    """Our handle as it travels in C2: ``(wire, version, pickled Handle)``.

    The pickled handle is opened only by a rank that runs ours in the same version, so a
    ticket unpickles wherever the package imports. vLLM's ``create_from_handle`` given a
    ticket raises ``PluginMismatchError`` at its first field."""

    __slots__ = ("wire", "version", "payload")

    def __init__(self, wire: int, version: str, payload: bytes):
        self.wire, self.version, self.payload = wire, version, payload

    @classmethod
    def of(cls, handle: Any) -> JoinTicket:
        return cls(WIRE, _PACKAGE_VERSION, pickle.dumps(handle))

    def __reduce__(self):
        return (JoinTicket, (self.wire, self.version, self.payload))

    def matches(self) -> bool:
        return (self.wire, self.version) == AGREEMENT

    def handle(self) -> Any:
        return pickle.loads(self.payload)

    def __repr__(self) -> str:
        return f"JoinTicket(wire={self.wire}, version={self.version!r})"


for _field in _VLLM_HANDLE_FIELDS:
    setattr(JoinTicket, _field, _tripwire(_field))


class Roles:
    """Who is what in a group joining our queue (see the module docstring); the same on every
    rank, computed from the handle and the group's size."""

    def __init__(self, local_reader_ranks: list[int], world: int, writer_rank: int):
        n = len(local_reader_ranks)
        if n == 0 or list(local_reader_ranks) != list(range(n)) or world % n:
            raise ValueError(
                f"the queue's local readers are ranks {list(local_reader_ranks)} of a group of "
                f"{world}: not vLLM's executor layout (node 0 = ranks 0..L-1, every node L "
                "ranks), so the nodes cannot be told by rank number"
            )
        if writer_rank not in local_reader_ranks:
            raise ValueError(f"the writer rank {writer_rank} is not on node 0")
        self.local_world_size = n
        self.world = world

    def node(self, rank: int) -> int:
        return rank // self.local_world_size

    def members(self, node: int) -> list[int]:
        return list(range(node * self.local_world_size, (node + 1) * self.local_world_size))

    def relay_of(self, rank: int) -> int:
        return self.members(self.node(rank))[0]


def _vote(error: str | None, downstream: Any = None) -> tuple:
    """A rank's entry in C3, builtins only (any version unpickles it)."""
    blob = None if downstream is None else pickle.dumps(downstream)
    return (WIRE, _PACKAGE_VERSION, error, blob)


def _verdict(votes: list) -> str | None:
    """Every rank's reading of C3: None when all agree and none failed, else the error."""
    problems = []
    for rank, vote in enumerate(votes):
        if not (isinstance(vote, tuple) and len(vote) >= 3):
            problems.append(f"rank {rank} sent {vote!r}")
            continue
        if tuple(vote[:2]) != AGREEMENT:
            problems.append(
                f"rank {rank} runs vllm_shm_arena {vote[1]} (ticket format {vote[0]}), "
                f"not {_PACKAGE_VERSION} (format {WIRE})"
            )
        elif vote[2] is not None:
            problems.append(f"rank {rank}: {vote[2]}")
    if not problems:
        return None
    return "vllm_shm_arena: the broadcast queue's group cannot join it: " + "; ".join(problems)


def _shutdown_quietly(q: Any) -> None:
    if q is not None:
        try:
            q.shutdown()
        except Exception:  # already failing; the verdict is the error to report
            pass


def create_mq_broadcaster(
    pg,
    writer_rank: int,
    external_writer_handle: Any,
    blocking: bool,
    *,
    stock_mq: type,
    stock_handle: type,
    ours_mq: type,
    ours_handle: type,
    in_the_same_node_as,
) -> Any:
    """vLLM's ``create_from_process_group`` over the torch.distributed group ``pg``
    (``GroupCoordinator.cpu_group``), then whichever queue the writer's handle describes.

    ``stock_mq``/``stock_handle``: vLLM's ``MessageQueue``/``Handle``; ``ours_*``: ours;
    ``in_the_same_node_as``: vLLM's function (called, never copied, so C1 is vLLM's)."""
    import torch.distributed as dist

    group_rank = dist.get_rank(pg)
    group_world_size = dist.get_world_size(pg)
    global_ranks = dist.get_process_group_ranks(pg)

    # C1, C2: shm_broadcast.py's create_from_process_group, step for step.
    status = in_the_same_node_as(pg, source_rank=writer_rank)
    buffer_io = None
    if group_rank == writer_rank:
        if isinstance(external_writer_handle, ours_handle):
            sent = JoinTicket.of(external_writer_handle)
        else:
            if external_writer_handle is not None:
                buffer_io = stock_mq.create_from_handle(external_writer_handle, group_rank)
            else:
                same_node_ranks = [i for i, s in enumerate(status) if s]
                buffer_io = stock_mq(
                    n_reader=group_world_size - 1,
                    n_local_reader=len(same_node_ranks) - 1,
                    local_reader_ranks=[i for i in same_node_ranks if i != writer_rank],
                    max_chunk_bytes=1 << 22,
                    max_chunks=6,
                )
            sent = buffer_io.export_handle()
        dist.broadcast_object_list([sent], src=global_ranks[writer_rank], group=pg)
        received = sent
    else:
        recv = [None]
        dist.broadcast_object_list(recv, src=global_ranks[writer_rank], group=pg)
        received = recv[0]

    if isinstance(received, JoinTicket):
        mq = _join_ours(pg, group_rank, group_world_size, writer_rank, received, ours_mq)
    elif isinstance(received, stock_handle):
        # vLLM's: the writer keeps the reader it made before C2, the others join as vLLM's do.
        mq = buffer_io
        if mq is None:
            mq = stock_mq.create_from_handle(received, group_rank)
    else:
        # The same object on every rank: every rank raises this, none is left in a collective.
        raise TypeError(
            f"create_mq_broadcaster: the writer rank sent a {type(received).__module__}."
            f"{type(received).__qualname__}; expected vLLM's Handle or vllm_shm_arena's "
            "JoinTicket"
        )
    if blocking:
        mq.wait_until_ready()
    return mq


def relay_chunk_bytes() -> int:
    """The relay's downstream ring chunk: the executor's ring's, as vLLM sizes it on node 0
    (``VLLM_MQ_MAX_CHUNK_BYTES_MB``, default 16 MiB; the same environment on every node)."""
    return (settings.mq_max_chunk_mb() or 16) << 20


def _join_ours(pg, rank: int, world: int, writer_rank: int, ticket: JoinTicket, ours_mq) -> Any:
    """Our roles and C3. Nothing raises between C2 and C3: a failure is this rank's vote."""
    import torch.distributed as dist

    mine = None  # the queue this rank built before C3 (a local reader or a relay)
    roles = None
    downstream = None  # the relay's downstream handle, for its relayed ranks' votes
    try:
        if not ticket.matches():
            raise PluginMismatchError(
                f"the writer's ticket is vllm_shm_arena {ticket.version} (format {ticket.wire})"
            )
        handle = ticket.handle()
        roles = Roles(handle.local_reader_ranks, world, writer_rank)
        if roles.node(rank) == 0:
            mine = ours_mq.create_from_handle(handle, rank)
        elif roles.local_world_size == 1:
            mine = ours_mq.create_from_handle(handle, rank)  # alone on its node: no relay
        elif roles.relay_of(rank) == rank:
            relayed = roles.members(roles.node(rank))[1:]
            mine = ours_mq.create_relay(handle, rank, relayed, max_chunk_bytes=relay_chunk_bytes())
            downstream = mine.downstream_handle
        vote = _vote(None, downstream)
    except Exception as e:
        vote = _vote(f"{type(e).__name__}: {e}")

    votes: list = [None] * world
    try:
        dist.all_gather_object(votes, vote, group=pg)
    except Exception as e:
        _shutdown_quietly(mine)
        raise PluginMismatchError(
            f"vllm_shm_arena: rank {rank} got the broadcast queue's handle of vllm_shm_arena "
            f"{ticket.version}'s plugin, but the group's one collective of that plugin failed "
            f"({type(e).__name__}: {e}). Some rank left instead of taking part: on its node "
            "the plugin is not active or the package is missing (that node's log says which); "
            "every node must run the plugin, in the same version, or none"
        ) from e

    verdict = _verdict(votes)
    if verdict is not None:
        _shutdown_quietly(mine)
        raise PluginMismatchError(verdict)
    if mine is not None:
        if downstream is not None:
            arena = mine.arena.layout if mine.arena is not None else "none"
            logger.info(
                "vllm_shm_arena: rank %d relays the broadcast queue to ranks %s of its node "
                "through the C++ shm tensor arena (%s): one TCP subscription for the node",
                rank,
                relayed,
                arena,
            )
        return mine
    relay = roles.relay_of(rank)
    relayed = roles.members(roles.node(rank))[1:]
    return ours_mq.create_from_handle(pickle.loads(votes[relay][3]), 1 + relayed.index(rank))
