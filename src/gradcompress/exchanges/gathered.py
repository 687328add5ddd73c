"""The gathered exchange, for sparsifiers (``Aggregation.GATHER``: top-k, threshold, DGC).

What is sent: every rank's whole payload to every other rank ((W-1) times its size; sizes first when they vary,
threshold and DGC), each decoded and added at its positions, then divided by W. Biased (what is not kept is
delayed by error feedback, on by default). Finiteness: read from the received values and scales, which every
rank holds alike.
"""

from __future__ import annotations

from typing import Callable

import torch

from ..codecs.base import Aggregation, Codec, Payload
from ..collectives import Collectives, Job, floats, from_bytes, layout, to_bytes


def _gather(comm: Collectives, codec: Codec, payloads: list[Payload], device):
    """Round(s) of the all-gather: yields works, returns (every rank's byte buffer, their layouts)."""
    local = to_bytes([t for p in payloads for t in p.tensors], device)
    if codec.fixed_layout:
        gathered, work = comm.all_gather(local)
        yield [work]
        return gathered, [[layout(p.tensors) for p in payloads]] * comm.world
    counts = torch.tensor([t.numel() for p in payloads for t in p.tensors] + [local.numel()], dtype=torch.int64,
                          device=local.device)
    all_counts, work = comm.all_gather(counts)
    yield [work]
    longest = max(int(c[-1]) for c in all_counts)
    padded = torch.zeros(longest, dtype=torch.uint8, device=local.device)
    padded[: local.numel()] = local
    gathered, work = comm.all_gather(padded)
    layouts = []
    for c in all_counts:
        it = iter(c[:-1].tolist())
        layouts.append([[(t.dtype, torch.Size([next(it)])) for t in p.tensors] for p in payloads])
    yield [work]
    return gathered, layouts


def _add_stacked(codec: Codec, payloads, gathered, outs, world: int, seen: list, divided: set) -> None:
    """Every rank's buffer has the same layout: one view per payload tensor with a leading rank dimension, and one
    accumulate per tensor for all ranks (O(tensors) calls, not O(tensors x W))."""
    stacked = torch.stack(gathered)
    if stacked.shape[1] % 8:  # rows 8-byte aligned, so that a row's tensors can be viewed in their dtype
        stacked = torch.nn.functional.pad(stacked, (0, 8 - stacked.shape[1] % 8))
    offset = 0
    for p, out in zip(payloads, outs):
        parts = []
        for t in p.tensors:
            size = t.numel() * t.element_size()
            part = stacked[:, offset : offset + size]
            if offset % t.element_size():
                part = part.clone()
            parts.append(part.view(t.dtype))
            offset += size
        if codec.accumulate_gathered(p, parts, out, world):
            divided.add(id(out))
        else:
            for i in range(len(gathered)):
                codec.accumulate_into(p.replace(tuple(q[i] for q in parts)), out)
        seen.append(p.replace(tuple(parts)))


def _add_each(codec: Codec, payloads, gathered, layouts, outs, seen: list) -> None:
    """Each rank's payloads read from its buffer and added one by one."""
    for buf, rank_layout in zip(gathered, layouts):
        offset = 0
        for p, lay, out in zip(payloads, rank_layout, outs):
            size = sum(s.numel() * d.itemsize for d, s in lay)
            theirs = p.replace(from_bytes(buf[offset : offset + size], lay))
            offset += size
            codec.accumulate_into(theirs, out)
            seen.append(theirs)


def gather_mean(comm: Collectives, codec: Codec, payloads: list[Payload], outs: list[torch.Tensor],
                received: Callable[[list[Payload]], None] | None, divisor: int) -> Job:
    """All-gather every rank's payloads (sizes first if they vary), decode each, add them into ``outs`` and divide
    by ``divisor``. ``received(payloads)`` is called with every rank's payloads (the
    same on every rank)."""
    gathered, layouts = yield from _gather(comm, codec, payloads, outs[0].device if outs else None)
    for out in outs:
        out.zero_()
    seen, divided = [], set()  # outs already divided by W (where anything was added)
    if codec.fixed_layout and codec.gathers_stacked and len(gathered) > 1:
        _add_stacked(codec, payloads, gathered, outs, divisor, seen, divided)
    else:
        _add_each(codec, payloads, gathered, layouts, outs, seen)
    if received is not None:
        received(seen)
    for out in outs:
        if id(out) not in divided:
            out.div_(divisor)


class GatheredExchange:
    """Encode each tensor whole (worker error feedback fused into the encode), all-gather, add, divide."""

    aggregation = Aggregation.GATHER

    def __init__(self, comm: Collectives, codec: Codec):
        self.comm, self.codec = comm, codec
        self.check = codec.preserves_nonfinite  # finiteness read from the received values and scales

    def job(self, ctx, keys, inputs, outs) -> Job:
        """Encodes now; the job is the all-gather and the sum (:func:`gather_mean`)."""
        codec = self.codec
        payloads = [ctx.transforms.encode(codec, k, x, [ctx.seed(k, codec)], 1, Aggregation.GATHER)[0]
                    for k, x in zip(keys, inputs)]
        return gather_mean(self.comm, codec, payloads, outs,
                           (lambda seen: ctx.check_values(floats(seen))) if self.check else None, ctx.divisor)


__all__ = ["GatheredExchange", "gather_mean"]
