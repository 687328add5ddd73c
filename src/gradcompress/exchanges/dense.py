"""The dense exchange: an all-reduce of the tensors as they are (DDP's own), for ``none`` and warm-up steps.

What is sent: every element, in the gradients' dtype (2 (W-1)/W of their bytes, ring-counted). Exact; no state
but momentum correction. Finiteness: read on the reduced values (a NaN/Inf anywhere reaches every rank).
"""

from __future__ import annotations

import torch

from ..collectives import Collectives, Job, parallel
from .context import all_finite
from .layout import IN_PLACE_NUMEL, flat_cat, scatter


def dense_mean(comm: Collectives, flat: torch.Tensor) -> Job:
    """All-reduce ``flat`` in place and divide by the world size."""
    if flat.numel():
        yield [comm.all_reduce(flat)]
        flat.div_(comm.world)


class DenseExchange:
    """Averages tensors uncompressed: large contiguous ones where they lie, the others through one flat buffer
    (or the caller's ``buffer``, DDP's bucket, which holds them all)."""

    def __init__(self, comm: Collectives):
        self.comm = comm

    def job(self, ctx, keys, grads: list[torch.Tensor], buffer: torch.Tensor | None, monitored: bool) -> Job:
        """The job; ``monitored``: the step's telemetry also records these tensors (exact, no error)."""
        comm = self.comm
        if buffer is None and ctx.monitor is None:  # large contiguous tensors are all-reduced where they lie
            where = [g.numel() >= IN_PLACE_NUMEL and g.is_contiguous() for g in grads]
            big = [g for g, w in zip(grads, where) if w]
            if big:
                rest = [g for g, w in zip(grads, where) if not w]
                flat = flat_cat(rest) if rest else None
                parts = big + ([flat] if flat is not None else [])
                yield from parallel([dense_mean(comm, t) for t in parts])
                ctx.check(torch.stack([all_finite(t) for t in parts]).all())
                if flat is not None:
                    scatter(flat, rest)
                return
        flat = buffer if buffer is not None else flat_cat(grads) if grads else None
        if flat is None or not flat.numel():
            return
        exact = flat.float().clone() if monitored else None
        jobs = [dense_mean(comm, flat)] + ([ctx.monitor.exact_mean(comm, exact)] if exact is not None else [])
        yield from parallel(jobs)
        ctx.check(all_finite(flat))
        if buffer is None:
            scatter(flat, grads)
        if exact is not None:
            ctx.monitor.record(keys, exact, [g.float() for g in grads])


__all__ = ["DenseExchange", "dense_mean"]
