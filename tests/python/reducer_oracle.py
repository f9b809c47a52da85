"""The divert decision, written out in Python: the oracle the C reducer
(``make_reducer`` in csrc/bindings/stubs.cpp, the package's only one) is checked against.

``expected(obj, ...)`` says what the reducer must do with one object of a message: divert it
into the arena ("divert"), leave it to the out-of-band path without counting anything
("pass": not a tensor the arena handles, or not host memory), or decline it and count why (one
of ``_C.DECLINE_REASONS``). The order of the checks is the C reducer's; a difference between the
two is a bug in one of them.
"""

from __future__ import annotations

import torch

from vllm_shm_arena.arena import _NAME_BY_DTYPE
from vllm_shm_arena.pickler import _oob_expressible

#: The exact types the arena diverts (like pickle's dispatch_table, no isinstance).
DIVERTED_TYPES = (torch.Tensor, torch.nn.Parameter)


def expected(obj, min_bytes: int, max_allocation: int, loaned: bool = False) -> str:
    """What the reducer does with ``obj`` for an arena whose divert threshold is ``min_bytes``
    and whose largest allocation is ``max_allocation``, with room for it (a full arena's
    declines are the writer's own); ``loaned``: ``obj`` is an unsent loan of that arena (or a
    contiguous view of one)."""
    if type(obj) not in DIVERTED_TYPES:
        return "pass"
    if obj.device.type != "cpu" or obj.layout is not torch.strided:
        return "pass"
    named = obj.dtype in _NAME_BY_DTYPE
    if named and obj.is_contiguous() and loaned:
        return "divert"  # in the arena already: no copy, whatever its size
    nbytes = obj.numel() * obj.element_size()
    if nbytes < min_bytes:
        return "too_small"
    if obj.requires_grad:
        return "unsupported"
    if obj.is_quantized or obj.is_conj() or obj.is_neg():
        return "unsupported"
    if not obj.is_contiguous():
        return "not_contiguous"
    if not named:
        return "unsupported"
    if nbytes > max_allocation:
        return "oversize"
    return "divert"


def expected_all(obj, min_bytes: int, max_allocation: int) -> list[str]:
    """Every decision the reducer makes while ``obj`` is pickled, in order: ``obj``'s, then,
    for a ``Parameter`` declined whose bytes the out-of-band path cannot carry either (a
    conj/neg view, a dtype without a name), its ``data``'s, which torch's own reduction pickles
    as a plain tensor."""
    first = expected(obj, min_bytes, max_allocation)
    out = [first]
    if (
        type(obj) is torch.nn.Parameter
        and first not in ("divert", "pass")
        and not _oob_expressible(obj.detach())
    ):
        out.append(expected(obj.data, min_bytes, max_allocation))
    return out
