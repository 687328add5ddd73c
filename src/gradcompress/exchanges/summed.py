"""The summed exchange, for codecs whose payloads add elementwise (``Aggregation.SUM``: fp16/bf16 casts,
random-k with positions shared by every rank).

What is sent: each rank's payload of x / W (the casts: every element in 16 bits; random-k: the k values at the
shared positions), all-reduced in one buffer per dtype, then decoded into the outputs. Bias: the casts round
(a half-ulp, unbiased enough that no error feedback is used by default); random-k is biased unless scaled.
Finiteness: the casts carry a NaN/Inf through the sum, read on the summed buffer; random-k does not
(``preserves_nonfinite`` False: the caller checks its inputs).
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence

import torch

from ..codecs.base import Aggregation, Codec, Payload
from ..collectives import Collectives, Job
from .context import Context, all_finite


def sum_mean(comm: Collectives, codec: Codec, payloads: list[Payload], outs: Sequence[torch.Tensor],
             summed: Callable[[torch.Tensor], None] | None = None) -> Job:
    """Summable payloads (already encoded from x / W): one all-reduce, decode into ``outs``.
    ``summed(flat)`` is called with each all-reduced flat buffer (where finiteness is read)."""
    groups: dict[torch.dtype, list[torch.Tensor]] = {}
    for p in payloads:
        for t in p.tensors:
            groups.setdefault(t.dtype, []).append(t)
    flats = {dt: _joined(ts) for dt, ts in groups.items()}
    yield [comm.all_reduce(f) for f in flats.values()]
    if summed is not None:
        for f in flats.values():
            summed(f)
    offsets = dict.fromkeys(flats, 0)
    for p, out in zip(payloads, outs):
        parts = []
        for t in p.tensors:
            o = offsets[t.dtype]
            parts.append(flats[t.dtype][o : o + t.numel()].view(t.shape))
            offsets[t.dtype] = o + t.numel()
        codec.decode_into(p.replace(tuple(parts)), out)


def _joined(ts: list[torch.Tensor]) -> torch.Tensor:
    """The tensors as one flat tensor: a view when they already lie back to back in one buffer, else a copy."""
    first = ts[0]
    if all(t.is_contiguous() and t.untyped_storage().data_ptr() == first.untyped_storage().data_ptr() for t in ts):
        offset = first.storage_offset()
        for t in ts:
            if t.storage_offset() != offset:
                break
            offset += t.numel()
        else:
            base = torch.empty(0, dtype=first.dtype, device=first.device).set_(first.untyped_storage())
            return base[first.storage_offset() : offset]
    return torch.cat([t.reshape(-1) for t in ts])


class SummedExchange:
    """Encode x / W per tensor (the casts straight into one wire buffer), all-reduce, decode."""

    aggregation = Aggregation.SUM

    def __init__(self, comm: Collectives, codec: Codec) -> None:
        self.comm, self.codec = comm, codec
        self.check = codec.preserves_nonfinite  # finiteness read on the summed buffer

    def job(self, ctx: Context, keys: Sequence[Hashable], inputs: Sequence[torch.Tensor],
            outs: Sequence[torch.Tensor]) -> Job:
        """Encodes now (x / divisor); the job is the all-reduce and the decode (:func:`sum_mean`)."""
        codec, divisor, transforms, check = self.codec, ctx.divisor, ctx.transforms, self.check
        dtype = codec.mean_part_dtype(inputs[0]) if inputs else None
        buf = torch.empty(sum(x.numel() for x in inputs), dtype=dtype, device=inputs[0].device) if dtype else None
        payloads: list[Payload] = []
        offset = 0
        for k, x in zip(keys, inputs):  # casts write straight into one buffer: the all-reduce needs no cat
            part = buf[offset : offset + x.numel()] if buf is not None else None
            offset += x.numel()
            p = codec.encode_mean_part(x, divisor, seed=ctx.seed(k, codec), out=part)
            if not transforms.delivered_sparse(codec, k, x, p, divisor):
                transforms.delivered(k, x, _decoded(codec, p, divisor))
            payloads.append(p)
        return sum_mean(self.comm, codec, payloads, outs, (lambda f: ctx.check(all_finite(f))) if check else None)


def _decoded(codec: Codec, payload: Payload, divisor: int) -> Callable[[], torch.Tensor]:
    """What ``payload`` delivers (its decode times ``divisor``, in float32), computed when called."""
    return lambda: codec.decode(payload).float() * divisor


__all__ = ["SummedExchange", "sum_mean"]
