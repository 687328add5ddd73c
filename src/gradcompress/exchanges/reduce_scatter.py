"""The compressed reduce-scatter (FSDP2's, through ``register_fsdp``).

What is sent: ``input`` holds one chunk per rank; the whole local input goes through the transforms (momentum
correction, worker error feedback: the residual covers the local unsharded buffer) and is encoded chunk by
chunk; chunks travel by all-to-all ((W-1)/W of the compressed buffer; sizes first for variable-size codecs) and
are decoded and summed by their owner. The output is final: no second quantisation, no server residual.
Finiteness: a one-element all-reduce of a flag makes every rank's output non-finite if any rank's input was.
"""

from __future__ import annotations

import math
from collections.abc import Generator, Hashable, Sequence
from typing import Any

import torch

from ..codecs.base import Codec, Payload
from ..collectives import Collectives, Handle, Job, from_bytes, layout, parallel, to_bytes
from .context import Context, all_finite, mix_seed
from .dense import dense_mean
from .layout import decode_chunks


#: the received pieces and, for each, its tensors' (dtype, size)
Pieces = tuple[list[torch.Tensor], list[list[tuple[torch.dtype, torch.Size]]]]


def _exchange_sizes(comm: Collectives, template: Payload, payloads: list[Payload], parts: list[torch.Tensor],
                    device: torch.device) -> Generator[list[Handle], None, Pieces]:
    """Variable-size payloads: the sizes first, then an uneven all-to-all. Yields works; returns (pieces, layouts)."""
    world = comm.world
    counts = torch.tensor([[t.numel() for t in p.tensors] for p in payloads], dtype=torch.int64, device=device)
    got: Any  # the received counts, then their rows as lists
    got, work = comm.all_to_all(counts.reshape(-1))
    yield [work]
    got = got.view(world, -1).tolist()
    lays = [[(t.dtype, torch.Size([n])) for t, n in zip(template.tensors, row)] for row in got]
    sizes = [sum(n * t.element_size() for t, n in zip(template.tensors, row)) for row in got]
    received, work = comm.all_to_all_v(torch.cat(parts), [q.numel() for q in parts], sizes)
    yield [work]
    return list(torch.split(received, sizes)), lays


def reduce_scatter_sum(comm: Collectives, codec: Codec, payloads: list[Payload], out: torch.Tensor) -> Job:
    """``payloads[j]`` is this rank's payload of chunk j (every chunk has ``out``'s numel); ``out`` receives the
    sum of every rank's payload of this rank's chunk. Received payloads are read with this rank's own payload of
    its chunk as the template (layout, seed): the decode must not depend on a per-rank seed."""
    parts = [to_bytes(p.tensors, out.device) for p in payloads]
    template = payloads[comm.rank]
    if codec.fixed_layout:
        received, work = comm.all_to_all(torch.cat(parts))
        yield [work]
        lays = [layout(template.tensors)] * comm.world
        pieces = list(torch.split(received, parts[comm.rank].numel()))
    else:
        pieces, lays = yield from _exchange_sizes(comm, template, payloads, parts, out.device)
    out.zero_()
    for piece, lay in zip(pieces, lays):
        out.add_(codec.decode(template.replace(from_bytes(piece, lay))).float().reshape(out.shape))


class ReduceScatterExchange:
    """``output`` receives this rank's chunk of the sum over ranks of ``input``, times ``scale`` (FSDP's op: 1/W for
    its mean). ``job(ctx, [key], [input], [output])``."""

    def __init__(self, comm: Collectives, codec: Codec | None, dense_codec: Codec, scale: float) -> None:
        self.comm, self.codec, self.dense_codec, self.scale = comm, codec, dense_codec, scale

    def _encode(self, ctx: Context, key: Hashable, input: torch.Tensor) -> tuple[torch.Tensor, list[Payload], Codec]:
        """(the transformed flat input, its W chunks' payloads, the codec they were encoded with)."""
        world, codec = self.comm.world, self.codec
        if codec is None or codec.exact:  # dense: the chunks as they are (an all-to-all is a reduce-scatter)
            x = input.reshape(-1)
            if ctx.transforms.momentum is not None:
                x = ctx.transforms.dense(key, x.clone())
            codec, seeds = self.dense_codec, [0] * world
        else:
            x = ctx.transforms.input(key, input.reshape(-1))
            seed = ctx.seed(key, codec)
            seeds = [mix_seed(seed, j) for j in range(world)]
        return x, [codec.encode(c, seed=s) for c, s in zip(x.view(world, -1), seeds)], codec

    def job(self, ctx: Context, keys: Sequence[Hashable], inputs: Sequence[torch.Tensor],
            outputs: Sequence[torch.Tensor]) -> Job:
        (key,), (input,), (output,), scale = keys, inputs, outputs, self.scale
        world = self.comm.world
        if input.numel() != world * output.numel():
            raise ValueError(f"gradcompress: reduce-scatter input of {input.numel()} elements is not {world} chunks "
                             f"of the output's {output.numel()}")
        x, payloads, codec = self._encode(ctx, key, input)
        flag = torch.where(all_finite(x), 0.0, math.nan).reshape(1).to(torch.float32)  # before x becomes the residual
        if codec is not self.dense_codec:
            ctx.transforms.delivered(key, x, lambda: decode_chunks(codec, payloads, x.numel(), x.device))
        total = torch.empty(output.numel(), dtype=torch.float32, device=output.device)
        yield from parallel([reduce_scatter_sum(self.comm, codec, payloads, total), dense_mean(self.comm, flag, world)])
        ctx.check(all_finite(flag))
        total.mul_(scale)
        total[:1].add_(flag)
        output.copy_(total.view(output.shape))


class HierarchicalReduceScatter:
    """FSDP's reduce-scatter when its group spans nodes (N nodes of G workers, rank r = node * G + local rank):
    dense inside the node, compressed between.

    What is sent: (1) inside the node, a dense reduce-scatter (in the input's dtype, or bf16/fp16 with
    ``intra_node``) of the input laid out by local rank: block j holds the chunks of the ranks with local rank j on
    every node, so worker j receives its node's sum of those N chunks ((G-1)/G of the buffer); (2) between nodes,
    :class:`ReduceScatterExchange` of these N chunks among the workers with local rank j (the codec's all-to-all of
    1/G of the buffer, worker error feedback on it: the residual costs 1/G of the unsharded gradient, state key
    ``"<key>:<j>/<G>"``), whose output is this rank's chunk of the sum over all ranks; (3) one finiteness flag
    all-reduced inside the node (the inner check holds on the workers of one local rank only). Bias: the codec's,
    on node sums. When to use: FSDP over several nodes of several GPUs with a slow link between them."""

    def __init__(self, intra: Collectives, inter: Collectives, codec: Codec | None, dense_codec: Codec,
                 cast: torch.dtype | None, scale: float) -> None:
        self.intra, self.inter, self.cast = intra, inter, cast
        self.inner = ReduceScatterExchange(inter, codec, dense_codec, scale)

    def job(self, ctx: Context, keys: Sequence[Hashable], inputs: Sequence[torch.Tensor],
            outputs: Sequence[torch.Tensor]) -> Job:
        (key,), (input,), (output,) = keys, inputs, outputs
        parts, nodes, me = self.intra.world, self.inter.world, self.intra.rank
        if input.numel() != parts * nodes * output.numel():
            raise ValueError(f"gradcompress: reduce-scatter input of {input.numel()} elements is not "
                             f"{parts * nodes} chunks of the output's {output.numel()}")
        dtype = self.cast or input.dtype
        blocks = input.detach().reshape(nodes, parts, -1).transpose(0, 1).to(dtype).contiguous()
        mine, work = self.intra.reduce_scatter(blocks)
        yield [work]
        inner = ctx.apart(nodes)
        yield from self.inner.job(inner, [f"{key}:{me}/{parts}"], [mine.to(input.dtype)], [output])
        flag = torch.where(inner.all_checked(output.device), 0.0, math.nan).reshape(1).to(torch.float32)
        yield from dense_mean(self.intra, flag, parts)
        ctx.check(all_finite(flag))
        output.view(-1)[:1].add_(flag.to(output.dtype))


__all__ = ["HierarchicalReduceScatter", "ReduceScatterExchange", "reduce_scatter_sum"]
