"""The dense exchange: an all-reduce of the tensors as they are (DDP's own), for ``none`` and warm-up steps.

What is sent: every element, in the gradients' dtype (2 (W-1)/W of their bytes, ring-counted). Exact; no state
but momentum correction. Finiteness: read on the reduced values (a NaN/Inf anywhere reaches every rank).
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

import torch

from ..collectives import Collectives, Job, one_job
from .context import Context, all_finite
from .layout import IN_PLACE_NUMEL, flat_cat, scatter


def dense_mean(comm: Collectives, flat: torch.Tensor, divisor: int) -> Job:
    """All-reduce ``flat`` in place and divide by ``divisor``."""
    if flat.numel():
        yield [comm.all_reduce(flat)]
        flat.div_(divisor)


class DenseExchange:
    """Averages tensors uncompressed, in place (the outputs are the inputs), after momentum correction where it is
    on: large contiguous ones where they lie, the others through one flat buffer (or ``buffer``, DDP's bucket,
    which holds them all). ``monitored``: the step's telemetry also records these tensors (exact, no error);
    None: whenever the step is monitored."""

    def __init__(self, comm: Collectives, buffer: torch.Tensor | None = None, monitored: bool | None = None):
        self.comm, self.buffer, self.monitored = comm, buffer, monitored

    def job(self, ctx: Context, keys: Sequence[Hashable], grads: Sequence[torch.Tensor],
            outs: Sequence[torch.Tensor]) -> Job:
        if ctx.transforms.momentum is not None:
            for k, g in zip(keys, grads):
                ctx.transforms.dense(k, g)
        comm, buffer, divisor = self.comm, self.buffer, ctx.divisor
        if buffer is None and ctx.monitor is None:  # large contiguous tensors are all-reduced where they lie
            where = [g.numel() >= IN_PLACE_NUMEL and g.is_contiguous() for g in grads]
            big = [g for g, w in zip(grads, where) if w]
            if big:
                rest = [g for g, w in zip(grads, where) if not w]
                flat = flat_cat(rest) if rest else None
                parts = big + ([flat] if flat is not None else [])
                yield from one_job([dense_mean(comm, t, divisor) for t in parts])
                ctx.check(torch.stack([all_finite(t) for t in parts]).all())
                if flat is not None:
                    scatter(flat, rest)
                return
        flat = buffer if buffer is not None else flat_cat(grads) if grads else None
        if flat is None or not flat.numel():
            return
        monitored = ctx.monitor is not None if self.monitored is None else self.monitored
        monitor = ctx.monitor if monitored else None
        exact = flat.float().clone() if monitor is not None else None
        if monitor is None or exact is None:
            yield from dense_mean(comm, flat, divisor)
        else:
            yield from one_job([dense_mean(comm, flat, divisor), monitor.exact_mean(comm, exact, divisor)])
        ctx.check(all_finite(flat))
        if buffer is None:
            scatter(flat, grads)
        if monitor is not None and exact is not None:
            monitor.record(keys, exact, [g.float() for g in grads])


__all__ = ["DenseExchange", "dense_mean"]
