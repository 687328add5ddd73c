"""The two-step exchange of a whole group at once, for bucketed quantisers whose codes can be cut at bucket edges.

Layout: the tensors' buckets back to back (each tensor starts on a bucket edge, so no bucket holds two tensors
and the scales are the same as encoding each tensor alone), cut into W chunks of ``ceil(buckets / W)`` buckets;
codes and scales are two flat buffers in that layout. Each tensor is encoded once into its place (worker error
feedback fused: ``Codec.encode_piece``); round 1, two all-to-alls (codes, scales); the chunk owner decodes the W
payloads of its chunk, averages and re-encodes it tensor piece by tensor piece; round 2, two all-gathers into
flat buffers, which are the group's payload in the same layout, decoded once per tensor straight into its
output. Python work per step: O(tensors + W) calls. Finiteness: the gathered scales (every rank holds them).
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Hashable, Sequence
from typing import TYPE_CHECKING

import torch

from ..codecs.base import Aggregation, Codec, Payload
from ..collectives import Collectives, Job
from .context import Context

if TYPE_CHECKING:
    from ..codecs.quantize import Bucketed

#: one payload of quantised buckets: (codes, scales)
Codes = tuple[torch.Tensor, torch.Tensor]


class _Layout:
    """Where each tensor's codes and scales lie in the group's buffers."""

    def __init__(self, codec: Bucketed, inputs: Sequence[torch.Tensor], world: int) -> None:
        self.codec, self.size = codec, codec.bucket
        self.first = [0]  # the first bucket of each tensor, then the total
        for x in inputs:
            self.first.append(self.first[-1] + -(-x.numel() // self.size))
        self.per_chunk = -(-self.first[-1] // world)  # buckets per chunk
        self.code_dtype, self.chunk_codes = codec.code_layout(self.per_chunk * self.size)
        self.per_bucket = codec.code_layout(self.size)[1]  # whole code elements per bucket (slices_by_bucket)

    def place(self, c: torch.Tensor, s: torch.Tensor, bucket: int, numel: int) -> Codes:
        """The codes and scales of ``numel`` elements starting at ``bucket`` (relative to c and s)."""
        at = bucket * self.per_bucket
        return c[at : at + self.codec.code_layout(numel)[1]], s[bucket : bucket - (-numel // self.size)]


def bucketed_two_step_mean(comm: Collectives, codec: Codec, codes: torch.Tensor, scales: torch.Tensor,
                           reencode: Callable[[list[Codes], int], Codes],
                           finish: Callable[[torch.Tensor, torch.Tensor], None], divisor: int) -> Job:
    """The rounds: ``codes``/``scales`` are this rank's payload of the group (W equal chunks of whole buckets,
    chunk j for rank j); ``reencode(received, divisor)`` gives this rank's chunk's codes and scales from the W
    (codes, scales) received for it (their decoded sum divided by ``divisor``, re-encoded); ``finish(codes, scales)``
    decodes the gathered payload. Each rank sends about twice its compressed size."""
    world = comm.world
    got_codes, w1 = comm.all_to_all(codes)
    got_scales, w2 = comm.all_to_all(scales)
    yield [w1, w2]
    cn, sn = codes.numel() // world, scales.numel() // world
    received = [(got_codes[i * cn : (i + 1) * cn], got_scales[i * sn : (i + 1) * sn]) for i in range(world)]
    mine_codes, mine_scales = reencode(received, divisor)
    all_codes, w1 = comm.all_gather_flat(mine_codes)
    all_scales, w2 = comm.all_gather_flat(mine_scales)
    yield [w1, w2]
    finish(all_codes, all_scales)


class BucketedExchange:
    """One payload for the group's tensors (see the module docstring); ``check``: read finiteness from the
    gathered scales."""

    def __init__(self, comm: Collectives, codec: Bucketed, check: bool) -> None:
        self.comm, self.codec, self.check = comm, codec, check

    def job(self, ctx: Context, keys: Sequence[Hashable], inputs: Sequence[torch.Tensor],
            outs: Sequence[torch.Tensor]) -> Job:
        """Encodes now; the job is the two rounds (:func:`bucketed_two_step_mean`)."""
        check = self.check
        codec, device, world = self.codec, inputs[0].device, self.comm.world
        lay = _Layout(codec, inputs, world)
        group = tuple(keys)
        codes = ctx.zeroed("codes", group, world * lay.chunk_codes, lay.code_dtype, device)
        scales = ctx.zeroed("scales", group, world * lay.per_chunk, torch.float32, device)
        reference = not ctx.transforms.fuses(Aggregation.REQUANTIZE)
        for t, (k, x) in enumerate(zip(keys, inputs)):
            c, s = lay.place(codes, scales, lay.first[t], x.numel())
            seed = ctx.seed(k, codec)
            ctx.transforms.encode_piece(codec, k, x, c, s, seed)
            if reference:
                ctx.transforms.delivered(k, x, _decoded(codec, Payload((c, s), x.shape, torch.float32, seed, device)))

        def finish(all_codes: torch.Tensor, all_scales: torch.Tensor) -> None:
            if check:
                ctx.check_values(all_scales)
            for t, (x, out) in enumerate(zip(inputs, outs)):
                c, s = lay.place(all_codes, all_scales, lay.first[t], x.numel())
                codec.decode_into(Payload((c, s), x.shape, torch.float32, None, device), out)

        return bucketed_two_step_mean(self.comm, codec, codes, scales,
                                      lambda received, divisor: self._reencode(ctx, lay, group, keys, inputs,
                                                                               received, divisor), finish,
                                      ctx.divisor)

    def _reencode(self, ctx: Context, lay: _Layout, group: tuple[Hashable, ...], keys: Sequence[Hashable],
                  inputs: Sequence[torch.Tensor], received: list[Codes], divisor: int) -> Codes:
        """This rank's chunk of the averaged group (the W ``received`` payloads of it, summed, divided by
        ``divisor``), re-encoded tensor piece by tensor piece without storing the mean (``encode_mean_piece``)."""
        codec, size = self.codec, lay.size
        lo, hi = self.comm.rank * lay.per_chunk, (self.comm.rank + 1) * lay.per_chunk
        mine_codes = ctx.zeroed("owner codes", group, lay.chunk_codes, lay.code_dtype, received[0][0].device)
        mine_scales = ctx.zeroed("owner scales", group, lay.per_chunk, torch.float32, received[0][0].device)
        first = lay.first
        for t in range(max(0, bisect.bisect_right(first, lo) - 1), len(inputs)):
            a, b = max(first[t], lo), min(first[t + 1], hi)
            if a >= hi:
                break
            if a >= b:
                continue
            start = (a - first[t]) * size
            numel = min(inputs[t].numel(), (b - first[t]) * size) - start
            c, s = lay.place(mine_codes, mine_scales, a - lo, numel)
            pieces = [lay.place(rc, rs, a - lo, numel) for rc, rs in received]
            # the noise of an element's re-encode does not depend on which rank owns it (nor on the grouping)
            codec.encode_mean_piece(pieces, numel, divisor, c, s, ctx.seed(keys[t], codec, salt=1, shared=True),
                                    start)
        return mine_codes, mine_scales


def _decoded(codec: Codec, payload: Payload) -> Callable[[], torch.Tensor]:
    """What ``payload`` delivers (its decode, in float32), computed when called."""
    return lambda: codec.decode(payload).float()


__all__ = ["BucketedExchange", "bucketed_two_step_mean"]
