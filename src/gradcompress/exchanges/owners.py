"""The hierarchical exchange of whole tensors (PowerSGD): each tensor owned by one local rank, not cut into slices.

PowerSGD compresses matrices, so the flat 1/G pieces of :mod:`.hierarchical` do not fit it. Here, for N nodes of G
workers, each tensor of the group belongs to one local rank (:func:`owners`: largest first, each to the least
loaded rank, so every rank holds about 1/G of the bytes; the same assignment on every rank and every node, kept
for the tensor's later steps):

1. inside the node, a reduce-scatter of a buffer laid out by owner (block j: the tensors owned by local rank j,
   back to back, zero-padded to the largest block): what is sent is (G-1) blocks, about (G-1)/G of the group's
   bytes, in the gradients' dtype or bf16/fp16 (``intra_node``). The owner then holds its node's sum of its
   tensors, divided by G the node mean;
2. between nodes, the inner exchange (PowerSGD's :class:`~.grouped.GroupExchange` over
   :class:`~.lowrank.LowRankExchange`, or a dense all-reduce on warm-up steps) of the owner's whole tensors among
   the workers with the same local rank on every node. State is keyed by the tensor's own key and lives on its
   owner: worker error feedback and momentum correction act on the owner's whole node-mean tensor, and the warm
   started factors are the owner's. Tensors below ``min_numel`` or without a matrix shape travel dense;
3. inside the node, an all-gather of every owner's block and one finiteness flag per worker, copied back into the
   gradients.

Bias: PowerSGD's rank-r approximation of the average of the node means (exact for an average of rank <= r, as
flat), plus the 16-bit rounding of the ``intra_node`` casts. When to use: PowerSGD on several workers per node with
a slow link between nodes: each node's uplink carries the factors of its tensors once (spread over its G workers)
instead of G times. Finiteness: as :mod:`.hierarchical` (the inner checks travel as each worker's flag).
"""

from __future__ import annotations

import math
from collections.abc import Generator, Hashable, Sequence
from typing import TYPE_CHECKING

import torch

from ..collectives import Collectives, Handle, Job
from .context import ChecksApart, Context, all_finite

if TYPE_CHECKING:
    from .dense import DenseExchange
    from .grouped import GroupExchange


#: rounds of collectives an inner exchange may take (PowerSGD's P and Q all-reduces; dense: one)
INNER_ROUNDS = 2


def padded(job: Job, rounds: int) -> Job:
    """``job`` followed by empty rounds up to ``rounds`` in all. The local ranks of a node run inner exchanges of
    different lengths (an owner of matrices two rounds, one of only small tensors one, one of nothing none); padded,
    every local rank reaches the node's all-gather at the same round, so jobs driven round-robin (DDP's buckets)
    issue the node's collectives in the same order on each of its workers."""
    count = 0
    for works in job:
        count += 1
        yield works
    if count > rounds:
        raise RuntimeError(f"gradcompress: an inner exchange took {count} rounds, more than {rounds}")
    for _ in range(rounds - count):
        yield []


def gather_node(intra: Collectives, ctx: Context, inner: ChecksApart, values: torch.Tensor,
                dtype: torch.dtype) -> Generator[list[Handle], None, torch.Tensor]:
    """The node's all-gather of this worker's ``values`` and its flag (0 when every check ``inner``, the inner
    exchange's :class:`~.context.ChecksApart`, collected holds, NaN else), in ``dtype``; the step checks the gathered
    buffer (the same on every worker of the node). Returns the gathered buffer, one row per worker."""
    flag = torch.where(inner.all_checked(values.device), 0.0, math.nan).reshape(1)
    gathered, work = intra.all_gather_flat(torch.cat([values, flag]).to(dtype))
    yield [work]
    ctx.check(all_finite(gathered))
    return gathered.view(intra.world, -1)


def owners(numels: Sequence[int], parts: int, known: Sequence[int | None] = ()) -> list[int]:
    """The local rank that owns each tensor: ``known[i]`` where given (an owner assigned at an earlier step), the
    others largest first (ties by position), each to the least loaded rank (ties to the lowest). Deterministic:
    every rank computes the same list from the same sizes."""
    known = list(known) or [None] * len(numels)
    load = [0] * parts
    owner = [0] * len(numels)
    for i, j in enumerate(known):
        if j is not None:
            owner[i] = j
            load[j] += numels[i]
    for i in sorted((i for i, j in enumerate(known) if j is None), key=lambda i: (-numels[i], i)):
        j = min(range(parts), key=lambda r: (load[r], r))
        owner[i] = j
        load[j] += numels[i]
    return owner


def _places(numels: Sequence[int], owner: Sequence[int], parts: int) -> tuple[list[int], int]:
    """(each tensor's offset inside its owner's block, the block size: the largest owner's load)."""
    load = [0] * parts
    offsets: list[int] = []
    for n, j in zip(numels, owner):
        offsets.append(load[j])
        load[j] += n
    return offsets, max(load)


def wire_dtype(cast: torch.dtype | None, grads: Sequence[torch.Tensor]) -> torch.dtype:
    """The dtype of the traffic inside a node: ``cast``, else the gradients' common dtype (float32 if mixed)."""
    if cast is not None:
        return cast
    dtypes = {g.dtype for g in grads}
    return dtypes.pop() if len(dtypes) == 1 else torch.float32


class OwnerExchange:
    """Reduce to each tensor's owner inside the node, ``inner`` between nodes on the owner's tensors, all-gather
    inside (module doc); in place. ``inner.job(ctx, keys, tensors, tensors)`` averages the owner's tensors in place
    over the nodes.
    ``assigned``: key -> owner, kept across steps (by the :class:`~.hierarchical.Hierarchy`): a tensor keeps the
    owner it got when first seen, so its state stays where it lives when DDP regroups its buckets."""

    def __init__(self, intra: Collectives, inner: DenseExchange | GroupExchange, cast: torch.dtype | None,
                 assigned: dict[Hashable, int] | None = None) -> None:
        self.intra, self.inner, self.cast = intra, inner, cast
        self.assigned = {} if assigned is None else assigned

    def job(self, ctx: Context, keys: Sequence[Hashable], grads: Sequence[torch.Tensor],
            outs: Sequence[torch.Tensor]) -> Job:
        if not grads:
            return
        parts, me = self.intra.world, self.intra.rank
        numels = [g.numel() for g in grads]
        owner = owners(numels, parts, [self.assigned.get(k) for k in keys])
        for k, j in zip(keys, owner):
            self.assigned.setdefault(k, j)
        offsets, block = _places(numels, owner, parts)
        dtype = wire_dtype(self.cast, grads)
        send = ctx.zeroed("owner send", tuple(keys), parts * block, dtype, grads[0].device).view(parts, block)
        for g, j, o in zip(grads, owner, offsets):
            send[j, o : o + g.numel()] = g.detach().reshape(-1)
        mine, work = self.intra.reduce_scatter(send)
        yield [work]
        mine = mine.float().div_(parts)  # the node mean of this worker's tensors
        idx = [i for i, j in enumerate(owner) if j == me]
        tensors = [mine[offsets[i] : offsets[i] + numels[i]].view(grads[i].shape) for i in idx]
        inner = ctx.apart(self.inner.comm.world)
        yield from padded(self.inner.job(inner, [keys[i] for i in idx], tensors, tensors), INNER_ROUNDS)
        gathered = yield from gather_node(self.intra, ctx, inner, mine, dtype)
        self._land(gathered, grads, owner, offsets)

    @staticmethod
    def _land(gathered: torch.Tensor, grads: Sequence[torch.Tensor], owner: Sequence[int],
              offsets: Sequence[int]) -> None:
        """Each owner's results back into the gradients, every worker's flag added to each gradient's first
        element (0 when every worker was finite, NaN else: the result is then non-finite on every rank)."""
        flags = gathered[:, -1].float().sum()
        for g, j, o in zip(grads, owner, offsets):
            if g.numel():
                g.copy_(gathered[j, o : o + g.numel()].view(g.shape))
                g[(0,) * g.dim()].add_(flags)


__all__ = ["INNER_ROUNDS", "OwnerExchange", "gather_node", "owners", "padded", "wire_dtype"]
