"""Sparsifiers: ``topk``, ``randomk``, ``threshold``, ``dgc`` (and top-k with quantised values).

What is sent: the kept values (in the input's dtype, or encoded by the ``values`` codec,
e.g. ``topk:ratio=0.01,values=int8``) and their positions as int32. ``randomk`` sends
no positions: every rank draws them from the shared seed, so its payloads add up.

Bias: ``topk``/``threshold``/``dgc`` are biased (they drop small values) and contract:
||x - C(x)||^2 <= (1 - k/n) ||x||^2. Use them with error feedback. ``randomk`` is
unbiased with ``scale=true`` (values multiplied by n/k), at a large variance.
Top-k-type payloads are not summable (positions differ per rank): the exchange gathers
them, so the bytes received grow with the number of workers.

Speed: on large CPU tensors ``topk``, ``dgc`` and ``threshold`` select in fused kernels
(:mod:`gradcompress.codecs.fast`): a threshold from a sample, one pass collecting every
position at or above it, then the exact top-k among those candidates. The selection is
the same (``topk`` stays the exact top-k; among equal magnitudes it keeps the lowest
positions), the positions are sent in ascending order.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, cast

import torch

from ..spec import Range, option, register
from . import fast
from .packing import pack, packed_nbytes, unpack
from .base import Aggregation, Codec, Payload, SizedEncode, check_input, fresh_seed, generator, in_range, run_sized

_RATIO = Range(0, 1, lo_open=True)
#: a selection in two halves: (numbers on the device, the number kept first; the positions, given them read)
Prepared = tuple[torch.Tensor, Callable[[list[int]], torch.Tensor]]
#: DGC's sparsity warm-up densities, one per stage
DGC_STAGES = (0.25, 0.0625, 0.015625, 0.00390625)


def dgc_density(step: int, warmup_steps: int, ratio: float) -> float:
    """DGC's sparsity warm-up: the density ``step`` steps after the dense warm-up."""
    if step >= warmup_steps or warmup_steps <= 0:
        return ratio
    stage = min(len(DGC_STAGES) - 1, step * len(DGC_STAGES) // warmup_steps)
    return max(ratio, DGC_STAGES[stage])


def kept_count(ratio: float, n: int) -> int:
    """k = ceil(ratio * n), at least 1 for a non-empty tensor."""
    return min(n, max(1, math.ceil(ratio * n)))


def chunk_counts(ratio: float, chunk: int, n: int) -> tuple[int, int, int]:
    """Chunked top-k of ``n`` elements: (kept per whole chunk, kept in the last shorter chunk, kept in all)."""
    full, rest = divmod(n, chunk)
    per = kept_count(ratio, chunk)
    last = kept_count(ratio, rest) if rest else 0
    return per, last, full * per + last


def _offset_bits(chunk: int) -> int:
    """Bits of a position inside a chunk of ``chunk`` elements."""
    return max(1, (chunk - 1).bit_length())


def _offset_nbytes(k: int, bits: int) -> int:
    """Bytes of ``k`` packed offsets: one byte and a packed high part above 8 bits."""
    return packed_nbytes(k, bits) if bits <= 8 else k + packed_nbytes(k, bits - 8)


def _pack_offsets(offsets: torch.Tensor, bits: int) -> tuple[torch.Tensor, ...]:
    if bits <= 8:
        return (pack(offsets.to(torch.uint8), bits),)
    return (offsets.bitwise_and(255).to(torch.uint8), pack(offsets.bitwise_right_shift(8).to(torch.uint8), bits - 8))


def _unpack_offsets(packed: tuple[torch.Tensor, ...], bits: int, k: int) -> torch.Tensor:
    if bits <= 8:
        return unpack(packed[0], bits, k).long()
    return packed[0].long() + unpack(packed[1], bits - 8, k).long().bitwise_left_shift(8)


def _chunk_base(ratio: float, chunk: int, n: int, device: torch.device) -> torch.Tensor:
    """The first position of the chunk of each kept element, in payload order (chunk by chunk)."""
    per, last, _ = chunk_counts(ratio, chunk, n)
    full = n // chunk
    base = (torch.arange(full, device=device, dtype=torch.int64) * chunk).repeat_interleave(per)
    if last:
        base = torch.cat([base, torch.full((last,), full * chunk, dtype=torch.int64, device=device)])
    return base


def chunked_topk(flat: torch.Tensor, ratio: float, chunk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(offsets inside their chunks, positions), int64, of each chunk's largest magnitudes, ascending per chunk."""
    n = flat.numel()
    per, last, _ = chunk_counts(ratio, chunk, n)
    full = n // chunk
    mag = flat.float().abs()
    offsets = []
    if full:
        rows = torch.topk(mag[: full * chunk].view(full, chunk), per, dim=1, sorted=False).indices
        offsets.append(rows.sort(dim=1).values.reshape(-1))
    if last:
        offsets.append(torch.topk(mag[full * chunk :], last, sorted=False).indices.sort().values)
    off = torch.cat(offsets)
    return off, _chunk_base(ratio, chunk, n, flat.device) + off


@dataclasses.dataclass(frozen=True)
class _Sparse(Codec):
    """Values at selected positions + int32 positions; subclasses choose the positions."""

    values: Codec | None = option(None, doc="codec for the kept values (e.g. int8); default: as they are")
    aggregation = Aggregation.GATHER
    if TYPE_CHECKING:  # top-k computes it from its options: a read-only property to the type checker
        @property
        def gathers_stacked(self) -> bool: ...
    else:
        gathers_stacked = True

    def _select(self, flat: torch.Tensor, seed: int | None) -> torch.Tensor:
        raise NotImplementedError

    def payload_nbytes(self, numel: int, shape: tuple[int, ...] | None = None) -> int:
        """k values (or the ``values`` codec's payload of k) + k int32 positions, k from ``ratio``
        (``dgc``: its target k; it sends between k/2 and 2k)."""
        if not hasattr(self, "ratio"):
            raise ValueError(f"{self.name}'s payload size depends on the data; it cannot be predicted")
        k = kept_count(self.ratio, numel) if numel else 0
        values = 4 * k if self.values is None else self.values.payload_nbytes(k)
        return values + 4 * k

    def _prepare(self, flat: torch.Tensor, seed: int | None) -> Prepared | None:
        """The selection in two halves where torch makes it and its size depends on the data (:data:`Prepared`:
        the number kept, and any other the positions need, counted on the device without a host read). None: the
        positions are found at once (a fixed number of them, or the CPU's fused kernels, which read on the host)."""
        return None

    def _tensors(self, flat: torch.Tensor, idx: torch.Tensor, seed: int | None) -> tuple[torch.Tensor, ...]:
        """The payload tensors of the positions ``idx``: their values (or the ``values`` codec's payload of them), then
        the positions as int32."""
        vals = flat.index_select(0, idx)  # int32 positions as they are (flat[idx] would copy them to int64)
        head = (vals,) if self.values is None else self.values.encode(vals, seed=seed).tensors
        return (*head, idx.to(torch.int32))

    def _encode(self, flat: torch.Tensor, seed: int | None) -> tuple[torch.Tensor, ...]:
        return self._tensors(flat, self._select(flat, seed), seed)

    def encode_sized(self, x: torch.Tensor, *, seed: int | None = None) -> SizedEncode:
        """:meth:`encode` in two halves where the number kept depends on the data (``threshold``, ``dgc``, on the
        torch path, values as they are): the selection is counted on the device, the exchange reads that count with
        every other tensor's at once, then the positions are taken (the same payload as :meth:`encode`)."""
        prepared = None
        if self.values is None and isinstance(x, torch.Tensor) and x.numel() and x.is_contiguous() \
                and (seed is not None or not self.stochastic):
            check_input(x, self.name)
            prepared = self._prepare(x.reshape(-1), seed)
        if prepared is None:
            return (yield from super().encode_sized(x, seed=seed))
        flat = x.reshape(-1)
        numbers, positions = prepared
        read = yield torch.cat([numbers[:1], numbers]), (flat.dtype, torch.int32)
        return Payload(self._tensors(flat, positions(read[1:]), seed), x.shape, x.dtype, seed, x.device)

    def _kept(self, tensors: tuple[torch.Tensor, ...], seed: int | None,
              numel: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(positions as int64, their values in float32) of a payload (of a tensor of ``numel`` elements)."""
        *head, idx = tensors
        if self.values is None:
            vals = head[0].float()
        else:
            vals = self.values.decode(Payload(tuple(head), torch.Size([idx.numel()]), torch.float32, seed))
        return idx.long(), vals

    def _decode(self, tensors: tuple[torch.Tensor, ...], numel: int, seed: int | None,
                device: torch.device) -> torch.Tensor:
        idx, vals = self._kept(tensors, seed, numel)
        out = torch.zeros(numel, dtype=torch.float32, device=device)
        return out.index_copy_(0, idx, vals)

    def encode_feedback(self, x: torch.Tensor, residual: torch.Tensor | None, *, seed: int | None = None,
                        out: torch.Tensor) -> Payload:
        """y = x + residual written into ``out`` once; the selection reads it there; then only the k kept
        entries change (y - their decoded values): O(k) instead of a dense decode and a subtraction."""
        return run_sized(self.encode_feedback_sized(x, residual, seed=seed, out=out))

    def encode_feedback_sized(self, x: torch.Tensor, residual: torch.Tensor | None, *, seed: int | None = None,
                              out: torch.Tensor) -> SizedEncode:
        """:meth:`encode_feedback` in two halves (the encode's, :meth:`encode_sized`)."""
        flat = out.view(-1) if out.is_contiguous() else None
        if (flat is None or out.dtype != torch.float32 or x.dtype != torch.float32
                or (residual is not None and residual.dtype != torch.float32)):
            yield from ()
            return super().encode_feedback(x, residual, seed=seed, out=out)  # the reference
        if residual is not None:
            torch.add(x.reshape(-1), residual.reshape(-1), out=flat)
        elif flat.data_ptr() != x.data_ptr():
            flat.copy_(x.reshape(-1))
        payload = yield from self.encode_sized(out.view(x.shape), seed=seed)
        if payload.tensors:
            idx, vals = self._kept(payload.tensors, payload.seed, payload.numel)
            flat.index_put_((idx,), flat.index_select(0, idx) - vals)
        return payload

    def accumulate_gathered(self, payload: Payload, parts: Sequence[torch.Tensor], out: torch.Tensor,
                            world: int | None = None) -> torch.Tensor | None:
        """Every rank's payload of one tensor added at once: ``parts`` are the payload's tensors with a leading
        rank dimension (values, positions). One ``index_add_`` in rank order: the same sums as adding each
        rank's payload in turn. ``world``: ``out`` (zero before) is then divided by it where anything was added
        (elsewhere it stays 0 = 0 / world): the mean in O(W k), not a pass over ``out``. Returns whether each
        rank's positions were in range (:func:`~.base.in_range`: the others are not added); None (not handled)
        for quantised values and variable sizes."""
        if self.values is not None or not self.fixed_layout or payload.numel == 0:
            return None
        vals, idx = parts
        idx, vals, valid = in_range(idx.long(), vals, payload.numel)
        flat, idx = out.view(-1), idx.reshape(-1)
        flat.index_add_(0, idx, vals.reshape(-1).to(out.dtype))
        if world is not None:  # a position sent by several ranks is written several times with the same value
            flat.index_copy_(0, idx, flat.index_select(0, idx).div_(world))
        return valid

    def accumulate_into(self, payload: Payload, out: torch.Tensor) -> torch.Tensor | None:
        """The kept entries added at their positions (distinct within a payload): the gather path's mean costs
        O(W k + n), not W dense decodes. Same values as adding the dense decode (+0.0 elsewhere). Returns whether
        every position was in range (:func:`~.base.in_range`)."""
        if payload.numel == 0:
            return None
        idx, vals = self._kept(payload.tensors, payload.seed, payload.numel)
        idx, vals, valid = in_range(idx, vals, payload.numel)
        out.view(-1).index_add_(0, idx, vals.to(out.dtype))
        return valid


@register("topk")
@dataclasses.dataclass(frozen=True)
class TopK(_Sparse):
    """Exact top-k by magnitude (Aji & Heafield 2017; Stich et al. 2018): k = ceil(ratio * n) values + int32 indices.

    ``chunk=C`` (chunked top-k, as SparseLoCo sends its outer gradients, Sarfi et al. 2025): the tensor is cut
    into chunks of C consecutive elements and each keeps its own ceil(ratio * C) largest (the last, shorter
    chunk ceil(ratio * its length)); a position is then sent as its offset inside its chunk, packed in
    ceil(log2 C) bits (12 bits for C = 4096) instead of 32. The same bias and contraction per chunk.
    """

    ratio: float = option(0.01, range=_RATIO, doc="fraction of elements kept")
    chunk: int | None = option(None, doc="chunked top-k: elements per chunk (2 to 65536); default: the whole tensor")
    schedule_knobs = ("ratio",)

    def __post_init__(self) -> None:
        super().__post_init__()
        c = self.chunk
        if c is not None and (isinstance(c, bool) or not isinstance(c, int) or not 2 <= c <= 65536):
            raise ValueError(f"topk: chunk must be an integer in [2, 65536], got {c!r}")

    @property
    def gathers_stacked(self) -> bool:
        return self.chunk is None

    def payload_nbytes(self, numel: int, shape: tuple[int, ...] | None = None) -> int:
        if self.chunk is None:
            return super().payload_nbytes(numel, shape)
        k = chunk_counts(self.ratio, self.chunk, numel)[2] if numel else 0
        values = 4 * k if self.values is None else self.values.payload_nbytes(k)
        return values + _offset_nbytes(k, _offset_bits(self.chunk))

    def _encode(self, flat: torch.Tensor, seed: int | None) -> tuple[torch.Tensor, ...]:
        if self.chunk is None:
            return super()._encode(flat, seed)
        offsets, idx = chunked_topk(flat, self.ratio, self.chunk)
        vals = flat.index_select(0, idx)
        head = (vals,) if self.values is None else self.values.encode(vals, seed=seed).tensors
        return (*head, *_pack_offsets(offsets, _offset_bits(self.chunk)))

    def _kept(self, tensors: tuple[torch.Tensor, ...], seed: int | None,
              numel: int) -> tuple[torch.Tensor, torch.Tensor]:
        if self.chunk is None:
            return super()._kept(tensors, seed, numel)
        bits = _offset_bits(self.chunk)
        parts = 2 if bits > 8 else 1
        head, packed = tensors[:-parts], tensors[-parts:]
        k = chunk_counts(self.ratio, self.chunk, numel)[2]
        if self.values is None:
            vals = head[0].float()
        else:
            vals = self.values.decode(Payload(tuple(head), torch.Size([k]), torch.float32, seed))
        base = _chunk_base(self.ratio, self.chunk, numel, packed[0].device)
        return base + _unpack_offsets(packed, bits, k), vals

    def _select(self, flat: torch.Tensor, seed: int | None) -> torch.Tensor:
        k = kept_count(self.ratio, flat.numel())
        if fast.applies(flat):  # float32/16/bf16 convert to float32 exactly: the same order of magnitudes
            return fast.topk_indices(fast.as_float32(flat), k)
        return torch.topk(flat.abs(), k, sorted=False).indices


@register("threshold")
@dataclasses.dataclass(frozen=True)
class Threshold(_Sparse):
    """Every element with |x| >= value (and every NaN), exactly, + int32 indices. Sizes vary per step."""

    value: float = option(1e-3, range=Range(0, None), doc="magnitude threshold")
    fixed_layout = False

    def _prepare(self, flat: torch.Tensor, seed: int | None) -> Prepared | None:
        if fast.applies(flat, (torch.float32,)):  # the comparison is in the input's dtype: float32 only
            return None
        kept = ~(flat.abs() < self.value)  # ~(<) keeps NaN
        return kept.sum().reshape(1), lambda read: torch.nonzero_static(kept, size=read[0]).reshape(-1)

    def _select(self, flat: torch.Tensor, seed: int | None) -> torch.Tensor:
        prepared = self._prepare(flat, seed)
        if prepared is None:
            return fast.collect(flat, fast.abs_key(self.value))
        numbers, positions = prepared
        return positions(numbers.tolist())


@register("dgc")
@dataclasses.dataclass(frozen=True)
class DGC(_Sparse):
    """Deep Gradient Compression's sparsifier (Lin et al., 2018): top-k through a sampled threshold.

    The threshold is the k-th largest magnitude of a random sample (``sample`` of the
    elements, at least 256), then every element at or above it is kept; more than 2k
    kept: the k largest of those; fewer than k/2: an exact top-k. So about k values are
    sent, never fewer than k/2 nor more than 2k, each at least as large as any dropped.
    ``momentum``, ``masking``, ``clip`` and ``warmup_steps`` configure the stateful parts
    (momentum correction, factor masking, local clipping, sparsity warm-up) that a
    :class:`gradcompress.Compressor` applies; the codec alone is the sampled top-k.
    """

    ratio: float = option(0.01, range=_RATIO, doc="target fraction of elements kept")
    sample: float = option(0.01, range=_RATIO, doc="fraction of elements sampled for the threshold")
    momentum: float = option(0.9, range=Range(0, 1, hi_open=True), doc="momentum correction (Compressor)")
    masking: bool = option(True, doc="momentum factor masking (Compressor)")
    clip: float = option(0.0, range=Range(0, None), doc="local gradient clipping norm, 0 = off (Compressor)")
    warmup_steps: int = option(0, range=Range(0, None), doc="sparsity warm-up steps (Compressor)")
    fixed_layout = False
    stochastic = True
    carries_momentum = True
    schedule_knobs = ("ratio",)

    def at_step(self, step: int) -> DGC:
        """Sparsity warm-up (Lin et al. 2018): density 25% -> 6.25% -> 1.56% -> 0.39% -> ``ratio``
        in four equal stages over ``warmup_steps`` (never below ``ratio``)."""
        density = dgc_density(step, self.warmup_steps, self.ratio)
        return self if density == self.ratio else dataclasses.replace(self, ratio=density)

    def _sample(self, n: int, k: int) -> tuple[int, int]:
        """(elements sampled, rank of the threshold among them) for ``k`` of ``n``."""
        m = min(n, max(256, math.ceil(self.sample * n)))
        return m, min(m, max(1, math.ceil(k * m / n)))

    def _prepare(self, flat: torch.Tensor, seed: int | None) -> Prepared | None:
        """The torch path's sampled threshold: (the number sent, the number at or above it) counted on the
        device; the positions then taken with them as :meth:`_select` always did."""
        n = flat.numel()
        k = kept_count(self.ratio, n)
        if fast.applies(flat) or k * 2 >= n:
            return None
        m, kth = self._sample(n, k)
        mag = flat.abs()
        seed = cast(int, seed)  # never None: Codec.encode draws one for a stochastic codec
        pos = torch.randint(0, n, (m,), generator=generator(seed, flat.device), device=flat.device)
        threshold = torch.topk(mag[pos], kth, sorted=False).values.min()
        above = ~(mag < threshold)
        count = above.sum()
        sent = torch.where((count > 2 * k) | (2 * count < k), k, count)

        def positions(read: list[int]) -> torch.Tensor:
            count = read[1]
            idx = torch.nonzero_static(above, size=count).reshape(-1)
            if count > 2 * k:
                idx = idx[torch.topk(mag[idx], k, sorted=False).indices]
            elif 2 * count < k:
                idx = torch.topk(mag, k, sorted=False).indices
            return idx

        return torch.stack([sent, count]), positions

    def _select(self, flat: torch.Tensor, seed: int | None) -> torch.Tensor:
        prepared = self._prepare(flat, seed)
        if prepared is not None:
            numbers, positions = prepared
            return positions(numbers.tolist())
        n = flat.numel()
        k = kept_count(self.ratio, n)
        if not fast.applies(flat):
            return torch.topk(flat.abs(), k, sorted=False).indices
        x32 = fast.as_float32(flat)
        if k * 2 >= n:
            return fast.topk_indices(x32, k)
        # the same selection; the sample from the seed's counter-based stream
        return fast.dgc_indices(x32, k, *self._sample(n, k), cast(int, seed))


@register("randomk")
@dataclasses.dataclass(frozen=True)
class RandomK(Codec):
    """k = ceil(ratio * n) values at positions drawn from the seed; positions are not sent.

    Every rank must encode with the same seed (the exchange does this), so payloads
    add up and one all-reduce suffices. ``scale=true`` multiplies by n/k: unbiased.
    The positions are the first k of a keyed pseudo-random permutation (a Feistel network
    over the index, :func:`fast.random_positions`), in ascending order: about 2k hashes and an
    n-bit map, no O(n) permutation, identical on every device.
    """

    ratio: float = option(0.01, range=_RATIO, doc="fraction of elements kept")
    scale: bool = option(False, doc="multiply kept values by n/k (unbiased)")
    aggregation = Aggregation.SUM
    shared_seed = True
    preserves_nonfinite = False
    keeps_positions = True
    schedule_knobs = ("ratio",)

    @property
    def unbiased(self) -> bool:
        return self.scale

    def payload_nbytes(self, numel: int, shape: tuple[int, ...] | None = None) -> int:
        return 4 * kept_count(self.ratio, numel) if numel else 0

    def positions(self, n: int, seed: int, device: torch.device | str | None) -> torch.Tensor:
        k = kept_count(self.ratio, n)
        if k == n:
            return torch.arange(n, device=device)
        return fast.random_positions(n, k, seed, device)

    def encode(self, x: torch.Tensor, *, seed: int | None = None) -> Payload:
        """The k values at the seed's positions (scaled by n/k with ``scale``); the positions stay with the
        payload (``Payload.local``, never sent): decoding it does not draw them again."""
        return self.encode_mean_part(x, 1, seed=seed)

    def encode_mean_part(self, x: torch.Tensor, world: int, *, seed: int | None = None,
                         out: torch.Tensor | None = None) -> Payload:
        """``encode(x / world)`` dividing only the k kept values (the same values: the division is per element)."""
        check_input(x, self.name)
        if seed is None:
            seed = fresh_seed()
        flat = x.reshape(-1)
        if not flat.numel():
            return Payload((), x.shape, x.dtype, seed, x.device)
        pos = self.positions(flat.numel(), seed, flat.device)
        vals = flat.index_select(0, pos)
        if world != 1:
            vals = vals / world
        if self.scale:
            vals = vals * (flat.numel() / vals.numel())
        return Payload((vals,), x.shape, x.dtype, seed, x.device, local=(pos,))

    def _positions_of(self, payload: Payload) -> torch.Tensor:
        if payload.local:
            return payload.local[0]
        seed = cast(int, payload.seed)  # never None: random-k's encode draws one (shared_seed)
        return self.positions(payload.numel, seed, payload.tensors[0].device)

    def kept(self, payload: Payload) -> tuple[torch.Tensor, torch.Tensor]:
        """(int64 positions, float32 values) of a payload: its decode is zero elsewhere."""
        return self._positions_of(payload), payload.tensors[0].float()

    def decode_into(self, payload: Payload, out: torch.Tensor) -> None:
        """``out.copy_(decode(payload))`` without the temporary: zeros, then the k values at their positions."""
        if payload.numel == 0 or not payload.tensors or not out.is_contiguous():
            return super().decode_into(payload, out)
        out.zero_()
        vals = payload.tensors[0].float().to(payload.dtype).to(out.dtype)
        out.view(-1).index_copy_(0, self._positions_of(payload), vals)

    def _decode(self, tensors: tuple[torch.Tensor, ...], numel: int, seed: int | None,
                device: torch.device) -> torch.Tensor:
        out = torch.zeros(numel, dtype=torch.float32, device=device)
        seed = cast(int, seed)  # never None: random-k's encode draws one (shared_seed)
        return out.index_copy_(0, self.positions(numel, seed, device), tensors[0].float())
