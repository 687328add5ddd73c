"""The two-step exchange, for quantisers (``Aggregation.REQUANTIZE``: int8, int4, sign, QSGD, TernGrad).

What is sent: round 1, an all-to-all of each rank's payload cut in W chunks (chunk j to rank j); the chunk's owner
decodes and sums the W payloads of its chunk, averages and re-encodes it (with server error feedback when on);
round 2, an all-gather of the re-encoded chunks, which every rank decodes. About twice the compressed size per
rank, whatever W (qgZ / 1-bit Adam's compressed all-reduce). Biased for round-to-nearest codecs (worker error
feedback on by default); the re-encode adds a second quantisation. Finiteness: read from the gathered scales.

Tensors on (nearly) whole quantisation buckets travel as one payload for the whole group
(:mod:`.bucketed`); the others, and every tensor under server error feedback, as W chunks each (here).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Hashable, Sequence
from typing import TYPE_CHECKING, TypeVar, cast

import torch

from ..codecs import fast
from ..codecs.base import Aggregation, Codec, Payload
from ..collectives import Collectives, Job, floats, from_bytes, layout, nbytes, one_job, to_bytes
from .bucketed import BucketedExchange
from .context import Context, mix_seed
from .layout import fills_buckets

if TYPE_CHECKING:
    from ..codecs.quantize import Bucketed

T = TypeVar("T")


def _owner_sums(comm: Collectives, codec: Codec, chunks: list[list[Payload]], received_bytes: torch.Tensor,
                reencode: Callable[[int, torch.Tensor], Payload], divisor: int) -> list[Payload]:
    """Round 1's second half: this rank decodes and sums every rank's payload of its chunk of each tensor,
    divides it by ``divisor`` and re-encodes it (``reencode(k, mean_chunk)``)."""
    world = comm.world
    block_bytes = received_bytes.numel() // world
    lays = [layout(per_tensor[comm.rank].tensors) for per_tensor in chunks]
    sizes = [nbytes(per_tensor[comm.rank].tensors) for per_tensor in chunks]
    offsets = [0, *itertools.accumulate(sizes)]
    mine = []
    for k, per_tensor in enumerate(chunks):
        template = per_tensor[comm.rank]
        total = fast.empty(template.numel, device=received_bytes.device)
        theirs = [template.replace(from_bytes(received_bytes[i * block_bytes + offsets[k]:
                                                             i * block_bytes + offsets[k] + sizes[k]], lays[k]))
                  for i in range(world)]
        codec.mean_into(theirs, total, divisor)  # decode, sum in order, divide: one pass with the kernels
        mine.append(reencode(k, total))
    return mine


def _decode_gathered(codec: Codec, mine: list[Payload], gathered: list[torch.Tensor], outs: Sequence[torch.Tensor],
                     seen: list[Payload]) -> None:
    """Round 2's second half: every rank's re-encoded chunks decoded straight into ``outs`` (last chunk trimmed)."""
    lays2 = [layout(p.tensors) for p in mine]
    sizes2 = [nbytes(p.tensors) for p in mine]
    offsets2 = [0, *itertools.accumulate(sizes2)]
    for k, out in enumerate(outs):
        flat = out.reshape(-1)
        per = mine[k].numel
        for i, buf in enumerate(gathered):
            start_at = offsets2[k]
            theirs = mine[k].replace(from_bytes(buf[start_at : start_at + sizes2[k]], lays2[k]))
            seen.append(theirs)
            lo = i * per
            hi = min(flat.numel(), lo + per)
            if hi - lo == per:
                codec.decode_into(theirs, flat[lo:hi].view(mine[k].shape))
            elif hi > lo:
                flat[lo:hi].copy_(codec.decode(theirs).reshape(-1)[: hi - lo])
        if not out.is_contiguous() or flat.data_ptr() != out.data_ptr():
            out.copy_(flat.view(out.shape))


def two_step_mean(comm: Collectives, codec: Codec, chunks: list[list[Payload]], outs: Sequence[torch.Tensor],
                  reencode: Callable[[int, torch.Tensor], Payload],
                  received: Callable[[list[Payload]], None] | None, divisor: int) -> Job:
    """Two-step reduce of chunked payloads: ``chunks[k][j]`` is this rank's payload for chunk j of tensor k
    (every chunk of a tensor has the same numel); the sum is divided by ``divisor``.
    ``received(payloads)`` is called with the gathered payloads
    (the same on every rank). Received chunks are decoded with this rank's payload as the template (layout,
    seed): the codec must have a fixed layout and a decode that does not depend on the seed."""
    if not codec.fixed_layout:
        raise ValueError(f"two-step reduce needs a fixed-layout codec, {codec.name} is not")
    if not chunks:
        return
    send = to_bytes([t for j in range(comm.world) for per_tensor in chunks for t in per_tensor[j].tensors])
    received_bytes, work = comm.all_to_all(send)
    yield [work]
    mine = _owner_sums(comm, codec, chunks, received_bytes, reencode, divisor)
    gathered, work = comm.all_gather(to_bytes([t for p in mine for t in p.tensors]))
    yield [work]
    seen: list[Payload] = []
    _decode_gathered(codec, mine, gathered, outs, seen)
    if received is not None:
        received(seen)


class TwoStepExchange:
    """Per tensor: the whole-group payload where the codec can cut codes at bucket edges and no server residual
    is kept, else W chunks each; on one rank, an encode and decode (nothing to reduce, no second quantisation)."""

    aggregation = Aggregation.REQUANTIZE

    def __init__(self, comm: Collectives, codec: Codec) -> None:
        self.comm, self.codec = comm, codec
        self.check = codec.preserves_nonfinite  # finiteness read from the gathered scales

    def _whole_group(self, ctx: Context, x: torch.Tensor) -> bool:
        """Whether ``x`` travels in its group's single payload: tensors whose last bucket pads them by at most
        1 % (:func:`~.layout.fills_buckets`), without server error feedback (kept per tensor chunk)."""
        return (ctx.transforms.server is None and self.codec.slices_by_bucket()
                and fills_buckets(x.numel(), cast("Bucketed", self.codec).bucket))  # slices_by_bucket: Bucketed

    def job(self, ctx: Context, keys: Sequence[Hashable], inputs: Sequence[torch.Tensor],
            outs: Sequence[torch.Tensor]) -> Job:
        """The job (encoded now, its rounds when driven): the bucketed and the chunked tensors side by side."""
        if self.comm.world == 1:
            return self._alone(ctx, keys, inputs, outs)
        # decided per tensor, so results do not depend on how tensors are grouped
        whole = [self._whole_group(ctx, x) for x in inputs]
        jobs = []
        at = [i for i, w in enumerate(whole) if w]
        if at:
            bucketed = cast("Bucketed", self.codec)  # _whole_group took tensors only for codecs that slice by bucket
            exchange = BucketedExchange(self.comm, bucketed, self.check)
            jobs.append(exchange.job(ctx, _pick(keys, at), _pick(inputs, at), _pick(outs, at)))
        at = [i for i, w in enumerate(whole) if not w]
        if at:
            jobs.append(self._chunked(ctx, _pick(keys, at), _pick(inputs, at), _pick(outs, at)))
        return one_job(jobs)

    def _alone(self, ctx: Context, keys: Sequence[Hashable], inputs: Sequence[torch.Tensor],
               outs: Sequence[torch.Tensor]) -> Job:
        codec = self.codec
        for k, x, out in zip(keys, inputs, outs):
            p = ctx.transforms.encode(codec, k, x, [ctx.seed(k, codec)], 1, Aggregation.REQUANTIZE)[0]
            if self.check:
                ctx.check_values(floats([p]))
            codec.decode_into(p, out)
        return
        yield  # a job with no rounds

    def _chunked(self, ctx: Context, keys: Sequence[Hashable], inputs: Sequence[torch.Tensor],
                 outs: Sequence[torch.Tensor]) -> Job:
        """The per-tensor two-step reduce: each tensor cut into W chunks, each chunk its own payload (O(tensors x W)
        calls; for tensors off the bucket grid and server error feedback)."""
        codec, world = self.codec, self.comm.world
        chunked = []
        for k, x in zip(keys, inputs):
            seed = ctx.seed(k, codec)
            chunked.append(ctx.transforms.encode(codec, k, x, [mix_seed(seed, j) for j in range(world)], world,
                                                 Aggregation.REQUANTIZE))

        def reencode(i: int, mean_chunk: torch.Tensor) -> Payload:
            payload: Payload = ctx.transforms.server_encode(codec, keys[i], mean_chunk, ctx.seed(keys[i], codec, salt=1))
            return payload

        yield from two_step_mean(self.comm, codec, chunked, outs, reencode,
                                 (lambda seen: ctx.check_values(floats(seen))) if self.check else None, ctx.divisor)


def _pick(seq: Sequence[T], at: list[int]) -> list[T]:
    """The items of ``seq`` at the positions ``at``, in that order."""
    return [seq[i] for i in at]


__all__ = ["TwoStepExchange", "two_step_mean"]
