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
from typing import cast

import torch

from ..codecs.base import Aggregation, Codec, Payload, SizedEncode, run_sized
from ..collectives import Collectives, Handle, HostRead, Job, floats, from_bytes, layout, to_bytes
from .context import Context

#: where one payload's tensors lie in a rank's buffer: (dtype, size) of each
Layout = list[tuple[torch.dtype, torch.Size]]
#: what the all-gather returns: this rank's payloads, every rank's byte buffer, their layouts
Gathered = tuple[list[Payload], list[torch.Tensor], list[list[Layout]]]


def _ready(payload: Payload) -> SizedEncode:
    """A payload already made, as a two-half encode that returns it at once."""
    yield from ()
    return payload


def _gather(comm: Collectives, codec: Codec, encodes: list[SizedEncode], device: torch.device | None,
            bad: dict[int, str]) -> Generator[list[Handle], None, Gathered]:
    """Round(s) of the all-gather: yields works, returns (this rank's payloads, every rank's byte buffer, their
    layouts). Variable sizes: every encode's sizes counted on the device, all-gathered in one tensor and read on the
    host once, for every rank and tensor, before the encodes that asked for them finish (:data:`SizedEncode`).
    Announced sizes that do not add up or exceed what the codec sends for the tensor (a garbled or truncated count)
    are recorded in ``bad`` (rank -> problem) and read as an empty payload."""
    if codec.fixed_layout:
        payloads = [run_sized(e) for e in encodes]
        local = to_bytes([t for p in payloads for t in p.tensors], device)
        gathered, work = comm.all_gather(local)
        yield [work]
        return payloads, gathered, [[layout(p.tensors) for p in payloads]] * comm.world
    started = [_start(e) for e in encodes]
    counts, own = _counts(started, device or torch.device("cpu"))
    all_counts, work = comm.all_gather(counts)
    sizes = HostRead([own, *all_counts])  # this rank's numbers, every rank's sizes: read with every other job's
    yield [work, sizes]
    read = sizes.result()
    payloads = _finished(started, read)
    rows = [read[len(own) + r * len(counts) : len(own) + (r + 1) * len(counts)] for r in range(len(all_counts))]
    local = to_bytes([t for p in payloads for t in p.tensors], device)
    layouts = [_announced(row, payloads, rank, bad) for rank, row in enumerate(rows)]
    longest = max(sum(s.numel() * d.itemsize for lay in rank_layout for d, s in lay) for rank_layout in layouts)
    padded = torch.zeros(max(longest, local.numel()), dtype=torch.uint8, device=local.device)
    padded[: local.numel()] = local
    gathered, work = comm.all_gather(padded)
    yield [work]
    return payloads, gathered, layouts


#: an encode started: its payload, or (the encode waiting, its numbers on the device, its payload tensors' dtypes)
Started = Payload | tuple[SizedEncode, torch.Tensor, tuple[torch.dtype, ...]]


def _start(encode: SizedEncode) -> Started:
    """Run an encode to its first half."""
    try:
        numbers, dtypes = next(encode)
    except StopIteration as done:
        return cast(Payload, done.value)
    return encode, numbers, dtypes


def _counts(started: list[Started], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(the sizes this rank announces: the element count of each payload tensor, then their bytes in all, as one
    int64 tensor on the device; the numbers of the encodes that wait, one after the other)."""
    sizes, itemsizes, own = [], [], []
    for s in started:
        if isinstance(s, Payload):
            sizes.append(torch.tensor([t.numel() for t in s.tensors], dtype=torch.int64, device=device))
            itemsizes += [t.element_size() for t in s.tensors]
        else:
            _, numbers, dtypes = s
            sizes.append(numbers[: len(dtypes)].to(device))
            itemsizes += [d.itemsize for d in dtypes]
            own.append(numbers.to(device))
    each = torch.cat(sizes) if sizes else torch.zeros(0, dtype=torch.int64, device=device)
    total = (each * torch.tensor(itemsizes, dtype=torch.int64, device=device)).sum().reshape(1)
    return torch.cat([each, total]), (torch.cat(own) if own else each[:0])


def _finished(started: list[Started], read: list[int]) -> list[Payload]:
    """Each encode's payload, the waiting ones sent their numbers (``read`` from the first, in order)."""
    payloads, at = [], 0
    for s in started:
        if isinstance(s, Payload):
            payloads.append(s)
            continue
        encode, numbers, _ = s
        try:
            encode.send(read[at : at + numbers.numel()])
        except StopIteration as done:
            payloads.append(cast(Payload, done.value))
        else:
            raise RuntimeError("a two-half encode did not return its payload once sent its numbers")
        at += numbers.numel()
    return payloads


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


def gather_mean(comm: Collectives, codec: Codec, payloads: Sequence[Payload | SizedEncode],
                outs: Sequence[torch.Tensor], received: Callable[[list[Payload]], None] | None, divisor: int,
                ctx: Context | None = None, keys: Sequence[Hashable] | None = None) -> Job:
    """All-gather every rank's payloads (sizes first if they vary), decode each, add them into ``outs`` and divide
    by ``divisor``. ``payloads``: this rank's, made, or encodes in two halves (:data:`~.codecs.base.SizedEncode`,
    whose sizes are read with every other's). ``received(payloads)`` is called with every rank's payloads (the same
    on every rank); ``ctx`` (the step's :class:`~.context.Context`) hears which rank sent what could not be used, by
    ``keys``."""
    bad: dict[int, str] = {}
    halves = [_ready(p) if isinstance(p, Payload) else p for p in payloads]
    mine, gathered, layouts = yield from _gather(comm, codec, halves, outs[0].device if outs else None, bad)
    for out in outs:
        out.zero_()
    seen: list[Payload] = []
    divided: set[int] = set()  # outs already divided by W (where anything was added)
    valid: list[torch.Tensor] = []
    if codec.fixed_layout and codec.gathers_stacked and len(gathered) > 1:
        _add_stacked(codec, mine, gathered, outs, divisor, seen, divided, valid)
    else:
        _add_each(codec, mine, gathered, layouts, outs, seen, valid)
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
        """The encodes (in two halves where sizes vary), the all-gather and the sum (:func:`gather_mean`)."""
        codec = self.codec
        payloads = [ctx.transforms.encode_sized(codec, k, x, ctx.seed(k, codec)) for k, x in zip(keys, inputs)]
        return gather_mean(self.comm, codec, payloads, outs,
                           (lambda seen: ctx.check_values(floats(seen))) if self.check else None, ctx.divisor,
                           ctx, keys)


__all__ = ["GatheredExchange", "gather_mean"]
