"""HSDP's replica all-reduce, compressed: the shards FSDP reduced inside each node, averaged across the nodes.

With HSDP (FSDP sharding over the G workers of a node, replicated over N nodes), FSDP's own reduce-scatter inside
the node leaves worker j of every node holding its node's mean of shard j. This exchange averages that shard among
the N workers that hold shard j (HSDP's replicate group, the slow link):

1. the inner exchange (the codec's, :class:`~.grouped.GroupExchange` over the algebra's exchange, or a dense
   all-reduce on warm-up steps and for ``none``) of the shard among the replicas: what is sent is the codec's
   payload of one shard, 1/G of the gradients (int8: about 2 (N-1)/N x 1/4 of the shard's float32 bytes by the
   two-step reduce); worker error feedback acts on the shard (the residual is 1/G of a gradient), and the chunk
   owner's server error feedback where the codec re-quantises;
2. one finiteness flag all-reduced inside the node (4 bytes): the inner checks hold among the replicas of one
   shard only, so a NaN/Inf on any worker of any node makes every rank's shard non-finite and the step's decision
   the same everywhere.

Bias: the codec's, on node means of the shard. When to use: FSDP across several nodes of several GPUs, where the
replica all-reduce crosses the slow link (``register_fsdp(model, spec, replicate_group=...)``).
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Sequence

import torch

from ..collectives import Collectives, Job
from .context import Context, all_finite
from .dense import DenseExchange, dense_mean
from .grouped import GroupExchange


class ReplicaExchange:
    """``shard`` (this worker's, already its node's mean) becomes the mean over the replicas (module doc)."""

    def __init__(self, intra: Collectives, inner: DenseExchange | GroupExchange) -> None:
        self.intra, self.inner = intra, inner

    def job(self, ctx: Context, keys: Sequence[Hashable], shards: Sequence[torch.Tensor],
            outs: Sequence[torch.Tensor]) -> Job:
        """In place: ``keys``/``shards`` hold one shard (the outputs are the inputs)."""
        (key,), (shard,) = keys, shards
        flat = shard.view(-1)
        work = flat if flat.dtype == torch.float32 else flat.float()
        inner = ctx.apart(self.inner.comm.world)
        yield from self.inner.job(inner, [key], [work], [work])
        flag = torch.where(inner.all_checked(flat.device), 0.0, math.nan).reshape(1)
        yield from dense_mean(self.intra, flag, self.intra.world)
        ctx.check(all_finite(flag))
        if work is not flat:
            flat.copy_(work)
        if flat.numel():
            flat[:1].add_(flag.to(flat.dtype))


__all__ = ["ReplicaExchange"]
