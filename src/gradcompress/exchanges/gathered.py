"""The gathered exchange, for sparsifiers (``Aggregation.GATHER``: top-k, threshold, DGC).

What is sent: every rank's whole payload to every other rank ((W-1) times its size; sizes first when they vary,
threshold and DGC), each decoded and added at its positions, then divided by W. Biased (what is not kept is
delayed by error feedback, on by default). Finiteness: read from the received values and scales, which every
rank holds alike. What is received is checked before it is used (the sizes a rank announces add up and fit the
tensor, its positions are in range; :meth:`Context.malformed <gradcompress.exchanges.context.Context.malformed>`):
a payload that does not is not added, and the step reports it naming the rank (every rank holds the same gathered
payloads, so every rank finds the same).
"""

from __future__ import annotations

from collections.abc import Callable, Generator, Hashable, Sequence

import torch

from ..codecs.base import Aggregation, Codec, Payload
from ..collectives import Collectives, Job, floats, from_bytes, layout, to_bytes
from .context import Context

#: where one payload's tensors lie in a rank's buffer: (dtype, size) of each
Layout = list[tuple[torch.dtype, torch.Size]]


def _gather(comm: Collectives, codec: Codec, payloads: list[Payload], device: torch.device | None,
            bad: dict[int, str]) -> Generator[list[object], None, tuple[list[torch.Tensor], list[list[Layout]]]]:
    """Round(s) of the all-gather: yields works, returns (every rank's byte buffer, their layouts). Announced sizes
    that do not add up or exceed what the codec sends for the tensor (a garbled or truncated count) are recorded in
    ``bad`` (rank -> problem) and read as an empty payload."""
    local = to_bytes([t for p in payloads for t in p.tensors], device)
    if codec.fixed_layout:
        gathered, work = comm.all_gather(local)
        yield [work]
        return gathered, [[layout(p.tensors) for p in payloads]] * comm.world
    counts = torch.tensor([t.numel() for p in payloads for t in p.tensors] + [local.numel()], dtype=torch.int64,
                          device=local.device)
    all_counts, work = comm.all_gather(counts)
    yield [work]
    layouts = [_announced(c.tolist(), payloads, rank, bad) for rank, c in enumerate(all_counts)]
    longest = max(sum(s.numel() * d.itemsize for lay in rank_layout for d, s in lay) for rank_layout in layouts)
    padded = torch.zeros(max(longest, local.numel()), dtype=torch.uint8, device=local.device)
    padded[: local.numel()] = local
    gathered, work = comm.all_gather(padded)
    yield [work]
    return gathered, layouts


def _announced(counts: list[int], payloads: list[Payload], rank: int, bad: dict[int, str]) -> list[Layout]:
    """The layout ``rank`` announced (element counts of each payload tensor, then its byte total), or, where they do
    not add up or a payload would hold more than one value and one position per element, an empty one."""
    *numels, total = counts
    dtypes = [t.dtype for p in payloads for t in p.tensors]
    sizes = [n * d.itemsize for n, d in zip(numels, dtypes)]
    limits = [2 * p.numel + 16 for p in payloads for _ in p.tensors]
    if len(numels) != len(dtypes) or min(numels, default=0) < 0 or sum(sizes) != total \
            or any(n > limit for n, limit in zip(numels, limits)):
        bad.setdefault(rank, f"announced sizes {counts} do not fit its {len(dtypes)} payload tensors")
        numels = [0] * len(dtypes)
    it = iter(numels)
    return [[(t.dtype, torch.Size([next(it)])) for t in p.tensors] for p in payloads]


def _add_stacked(codec: Codec, payloads: list[Payload], gathered: list[torch.Tensor], outs: Sequence[torch.Tensor],
                 world: int, seen: list[Payload], divided: set[int], valid: list[torch.Tensor]) -> None:
    """Every rank's buffer has the same layout: one view per payload tensor with a leading rank dimension, and one
    accumulate per tensor for all ranks (O(tensors) calls, not O(tensors x W))."""
    stacked = torch.stack(gathered)
    if stacked.shape[1] % 8:  # rows 8-byte aligned, so that a row's tensors can be viewed in their dtype
        stacked = torch.nn.functional.pad(stacked, (0, 8 - stacked.shape[1] % 8))
    offset = 0
    for p, out in zip(payloads, outs):
        parts: list[torch.Tensor] = []
        for t in p.tensors:
            size = t.numel() * t.element_size()
            part = stacked[:, offset : offset + size]
            if offset % t.element_size():
                part = part.clone()
            parts.append(part.view(t.dtype))
            offset += size
        flags = codec.accumulate_gathered(p, parts, out, world)
        if flags is not None:
            divided.add(id(out))
            valid.append(flags)
        else:
            valid.append(_each_valid([codec.accumulate_into(p.replace(tuple(q[i] for q in parts)), out)
                                      for i in range(len(gathered))], out.device))
        seen.append(p.replace(tuple(parts)))


def _each_valid(flags: Sequence[torch.Tensor | None], device: torch.device) -> torch.Tensor:
    """Per-rank validity flags (None: nothing to check) as one bool tensor."""
    ok = torch.ones((), dtype=torch.bool, device=device)
    return torch.stack([ok if f is None else f for f in flags])


def _add_each(codec: Codec, payloads: list[Payload], gathered: list[torch.Tensor], layouts: list[list[Layout]],
              outs: Sequence[torch.Tensor], seen: list[Payload], valid: list[torch.Tensor]) -> None:
    """Each rank's payloads read from its buffer and added one by one."""
    flags: list[list[torch.Tensor | None]] = [[] for _ in payloads]
    for buf, rank_layout in zip(gathered, layouts):
        offset = 0
        for j, (p, lay, out) in enumerate(zip(payloads, rank_layout, outs)):
            size = sum(s.numel() * d.itemsize for d, s in lay)
            theirs = p.replace(from_bytes(buf[offset : offset + size], lay))
            offset += size
            flags[j].append(codec.accumulate_into(theirs, out))
            seen.append(theirs)
    valid.extend(_each_valid(f, out.device) for f, out in zip(flags, outs))


def gather_mean(comm: Collectives, codec: Codec, payloads: list[Payload], outs: Sequence[torch.Tensor],
                received: Callable[[list[Payload]], None] | None, divisor: int, ctx: Context | None = None,
                keys: Sequence[Hashable] | None = None) -> Job:
    """All-gather every rank's payloads (sizes first if they vary), decode each, add them into ``outs`` and divide
    by ``divisor``. ``received(payloads)`` is called with every rank's payloads (the same on every rank); ``ctx``
    (the step's :class:`~.context.Context`) hears which rank sent what could not be used, by ``keys``."""
    bad: dict[int, str] = {}
    gathered, layouts = yield from _gather(comm, codec, payloads, outs[0].device if outs else None, bad)
    for out in outs:
        out.zero_()
    seen: list[Payload] = []
    divided: set[int] = set()  # outs already divided by W (where anything was added)
    valid: list[torch.Tensor] = []
    if codec.fixed_layout and codec.gathers_stacked and len(gathered) > 1:
        _add_stacked(codec, payloads, gathered, outs, divisor, seen, divided, valid)
    else:
        _add_each(codec, payloads, gathered, layouts, outs, seen, valid)
    if ctx is not None:
        for rank, problem in bad.items():
            flags = torch.ones(comm.world, dtype=torch.bool)
            flags[rank] = False
            ctx.malformed(flags, (keys or [None])[0], problem)
        for key, flags in zip(keys or [None] * len(valid), valid):
            ctx.malformed(flags, key, "a position out of range, or values and positions of different counts")
    if received is not None:
        received(seen)
    for out in outs:
        if id(out) not in divided:
            out.div_(divisor)


class GatheredExchange:
    """Encode each tensor whole (worker error feedback fused into the encode), all-gather, add, divide."""

    aggregation = Aggregation.GATHER

    def __init__(self, comm: Collectives, codec: Codec) -> None:
        self.comm, self.codec = comm, codec
        self.check = codec.preserves_nonfinite  # finiteness read from the received values and scales

    def job(self, ctx: Context, keys: Sequence[Hashable], inputs: Sequence[torch.Tensor],
            outs: Sequence[torch.Tensor]) -> Job:
        """Encodes now; the job is the all-gather and the sum (:func:`gather_mean`)."""
        codec = self.codec
        payloads = [ctx.transforms.encode(codec, k, x, [ctx.seed(k, codec)], 1, Aggregation.GATHER)[0]
                    for k, x in zip(keys, inputs)]
        return gather_mean(self.comm, codec, payloads, outs,
                           (lambda seen: ctx.check_values(floats(seen))) if self.check else None, ctx.divisor,
                           ctx, keys)


__all__ = ["GatheredExchange", "gather_mean"]
