"""The exchange of one group of gradients (a DDP bucket, a ``synchronize`` call): it wraps an algebra's exchange.

Tensors below ``min_numel`` (and, for PowerSGD, those without a matrix shape) travel dense, batched into one
all-reduce with one flag element that carries this rank's inputs' finiteness where the codec's own payloads do not
carry a NaN/Inf through; the others go through the transforms (clip, momentum correction, worker error feedback)
and the exchange of the codec's algebra (:func:`algebra_exchange`), and the results land in the gradients.
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Sequence, Set

import torch

from ..codecs.base import Aggregation, Codec
from ..collectives import Collectives, Job, one_job
from .context import Context, all_finite
from .dense import dense_mean
from .gathered import GatheredExchange
from .layout import scatter
from .lowrank import LowRankExchange
from .summed import SummedExchange
from .twostep import TwoStepExchange

#: the exchange of one algebra of payloads
Algebra = SummedExchange | GatheredExchange | TwoStepExchange | LowRankExchange
#: (key, tensor) pairs of a group
Keyed = list[tuple[Hashable, torch.Tensor]]


def algebra_exchange(comm: Collectives, codec: Codec, seed: int) -> Algebra:
    """The exchange of ``codec``'s payloads that its aggregation allows, on ``comm``."""
    aggregation = codec.aggregation
    if aggregation is Aggregation.SUM:
        return SummedExchange(comm, codec)
    if aggregation is Aggregation.GATHER:
        return GatheredExchange(comm, codec)
    if aggregation is Aggregation.REQUANTIZE:
        return TwoStepExchange(comm, codec)
    return LowRankExchange(comm, codec, seed)


class GroupExchange:
    """Small tensors dense with a finiteness flag, the others through ``inner`` (an algebra's exchange); in place
    (the outputs are the inputs). ``dense_keys``: keys sent dense whatever their size (pieces of small tensors, as
    the hierarchical exchange cuts them)."""

    def __init__(self, comm: Collectives, codec: Codec, inner: Algebra, min_numel: int,
                 dense_keys: Set[Hashable] = frozenset()) -> None:
        self.comm, self.codec, self.inner, self.min_numel = comm, codec, inner, min_numel
        self.dense_keys = dense_keys

    def _split(self, keys: Sequence[Hashable], grads: Sequence[torch.Tensor],
               dense_keys: Set[Hashable]) -> tuple[Keyed, Keyed]:
        dense: Keyed = []
        comp: Keyed = []
        inner = self.inner  # its aggregation is LOWRANK: a LowRankExchange, which takes only matrices
        for k, g in zip(keys, grads):
            small = (k in dense_keys or g.numel() < self.min_numel
                     or (isinstance(inner, LowRankExchange) and not inner.takes(g)))
            (dense if small else comp).append((k, g))
        return dense, comp

    def _inputs(self, ctx: Context, comp: Keyed) -> list[torch.Tensor]:
        """The compressed tensors' inputs. Summed codecs read their inputs only before the collective, so they may
        alias the gradients, which then receive the result directly; so may inputs whose error feedback is fused
        into the encode (read once, before the first collective)."""
        aggregation = self.inner.aggregation
        summed = aggregation is Aggregation.SUM
        fused = aggregation is not Aggregation.LOWRANK and ctx.transforms.fuses(aggregation)
        return [ctx.transforms.input(k, g, private=not (summed or fused), fused=fused) for k, g in comp]

    def _flag(self, inputs: Sequence[torch.Tensor], dense: Keyed, device: torch.device | None) -> torch.Tensor:
        """NaN when some input is non-finite (0 else). Codecs that carry a NaN/Inf through to what every rank
        receives are checked there instead (the casts on the summed buffer, the quantisers and sparsifiers on the
        received scales or values, PowerSGD on the summed first factor): no pass over their inputs."""
        ride = self.codec.preserves_nonfinite
        ok = ([] if ride else [all_finite(x) for x in inputs]) + [all_finite(g) for _, g in dense]
        return torch.where(torch.stack(ok).all(), 0.0, math.nan) if ok else torch.zeros((), device=device)

    def job(self, ctx: Context, keys: Sequence[Hashable], grads: Sequence[torch.Tensor],
            outs: Sequence[torch.Tensor]) -> Job:
        dense, comp = self._split(keys, grads, self.dense_keys)
        if ctx.transforms.momentum is not None:
            for k, g in dense:
                ctx.transforms.dense(k, g)
        inputs = self._inputs(ctx, comp)
        flag = self._flag(inputs, dense, grads[0].device if grads else None)
        dtype = grads[0].dtype if grads else torch.float32
        dense_flat = torch.cat([g.reshape(-1) for _, g in dense] + [flag.reshape(1).to(dtype)])
        summed = self.inner.aggregation is Aggregation.SUM
        # results land in the gradients themselves where nothing reads the inputs after the result is written
        # (beyond the summed path only for float32 gradients, so that sums round as before)
        direct = [g.is_contiguous() and (summed or g.dtype == x.dtype) for x, (_, g) in zip(inputs, comp)]
        results = [g if d else torch.empty_like(x) for d, x, (_, g) in zip(direct, inputs, comp)]
        ride = self.codec.preserves_nonfinite
        flagged = bool(dense) or not ride
        exact, monitor = None, ctx.monitor
        if monitor is not None and comp:  # telemetry: the exact average of the same tensors, counted apart
            exact = torch.cat([monitor.refs.pop(k).reshape(-1) for k, _ in comp])  # before anything encodes
        jobs = [dense_mean(self.comm, dense_flat, ctx.divisor)] if flagged else []
        if comp:
            jobs.append(self.inner.job(ctx, [k for k, _ in comp], inputs, results))
        if monitor is not None and exact is not None:
            jobs.append(monitor.exact_mean(self.comm, exact, ctx.divisor))
        yield from one_job(jobs)
        self._land(ctx, dense, comp, results, dense_flat, exact, flagged)

    def _land(self, ctx: Context, dense: Keyed, comp: Keyed, outs: list[torch.Tensor], dense_flat: torch.Tensor,
              exact: torch.Tensor | None, flagged: bool) -> None:
        """Results into the gradients: the dense ones scattered, the flag added where the codec's payloads do not
        carry a NaN/Inf, the others copied from their outputs where they were not written in place."""
        monitor = ctx.monitor
        if monitor is not None and exact is not None:
            monitor.record([k for k, _ in comp], exact, outs)
        scatter(dense_flat[:-1], [g for _, g in dense])
        if flagged:
            ctx.check(all_finite(dense_flat))
        if monitor is not None:  # tensors that travelled dense are exact: they count with no error
            for k, g in dense:
                monitor.record_dense(k, g)
        flag = dense_flat[-1:].float()
        for (_k, g), out in zip(comp, outs):
            if not self.codec.preserves_nonfinite:
                out.view(-1)[:1].add_(flag)
            if out is not g:
                g.copy_(out.view(g.shape))


__all__ = ["GroupExchange", "algebra_exchange"]
