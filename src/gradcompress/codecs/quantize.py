"""Uniform and stochastic quantisers: ``int8``, ``int4``, ``qsgd``, ``terngrad``.

All work per bucket of ``bucket`` consecutive elements (default 512), each bucket with
one float32 scale, so one outlier only coarsens its own bucket. Codes narrower than a
byte are bit-packed (:mod:`gradcompress.codecs.packing`). Payloads are not summable: the
exchange uses the two-step reduce (all-to-all of chunks, decode + sum + re-encode,
all-gather), which keeps the bytes each worker sends near twice the compressed size.

A non-finite element makes its bucket's scale non-finite, so the decoded bucket is
non-finite too and a loss scaler still sees the overflow.

Speed: on large CPU tensors (and ``bucket`` a multiple of 8 for codes narrower than a
byte) encode and decode run as one fused pass per bucket (:mod:`gradcompress.codecs.fast`):
the same codes as the code below for the deterministic quantisers, the same distribution
(noise from a hash of seed and index instead of ``torch.rand``) for the stochastic ones.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import TYPE_CHECKING, cast

import torch

from .packing import pack, unpack
from ..spec import Range, option, register_codec
from . import fast
from .base import Aggregation, Codec, Payload, fresh_seed, generator

_FAST_DTYPES = fast.FAST_DTYPES + (torch.float64,)  # every quantiser reads flat.float()


def _fast_ok(flat: torch.Tensor, bits: int, bucket: int) -> bool:
    """Whether an encode takes the fused kernel (packed codes need byte-aligned buckets)."""
    return (bits == 8 or bucket % 8 == 0) and fast.applies(flat, _FAST_DTYPES)


def to_buckets(flat: torch.Tensor, bucket: int) -> torch.Tensor:
    """``flat`` as float32 of shape ``(ceil(n / bucket), bucket)``, zero-padded at the end."""
    x = flat.float()
    n = x.numel()
    nb = -(-n // bucket)
    if nb * bucket != n:
        x = torch.nn.functional.pad(x, (0, nb * bucket - n))
    return x.view(nb, bucket)


def from_buckets(values: torch.Tensor, n: int) -> torch.Tensor:
    """Flatten a bucketed tensor and drop the padding."""
    return values.reshape(-1)[:n]


def rescale(values: torch.Tensor, scale: torch.Tensor, bucket: int, n: int) -> torch.Tensor:
    """Multiply each bucket of ``n`` decoded code values by its bucket's scale; 1-D result."""
    nb = scale.numel()
    if nb * bucket != n:
        values = torch.nn.functional.pad(values, (0, nb * bucket - n))
    return from_buckets(values.view(nb, bucket) * scale[:, None], n)


def safe_inverse(scale: torch.Tensor) -> torch.Tensor:
    """1/scale where scale > 0, else 0 (an all-zero or non-finite bucket encodes to zeros)."""
    return torch.where(scale > 0, 1.0 / scale, torch.zeros_like(scale))


def safe_divide(xb: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Each bucket (row) of ``xb`` divided by its scale where scale > 0, else 0.

    A division, not a multiplication by 1/scale: 1/scale overflows to Inf for a
    subnormal scale (all values of a bucket below ~4e-37), which turned codes into NaN.
    """
    ok = (scale > 0)[:, None]
    return torch.where(ok, xb / torch.where(ok, scale[:, None], torch.ones_like(scale[:, None])), torch.zeros_like(xb))


def bucket_norm(xb: torch.Tensor) -> torch.Tensor:
    """L2 norm of each bucket, scaled by its abs-max so the squares neither underflow nor overflow.

    (A plain float32 norm is 0 for values below ~1e-19 and Inf above ~1e19.) NaN or Inf in a
    bucket gives a NaN norm.
    """
    amax = xb.abs().amax(dim=1)
    norm: torch.Tensor = torch.linalg.vector_norm(safe_divide(xb, amax), dim=1) * amax
    return norm


def uniform_noise(shape: torch.Size | tuple[int, ...], seed: int, device: torch.device) -> torch.Tensor:
    """U[0, 1) noise from a private generator (stochastic rounding)."""
    return torch.rand(shape, generator=generator(seed, device), device=device)


def quantized_nbytes(numel: int, bits: int, bucket: int) -> int:
    """Bytes of ``numel`` codes of ``bits`` bits packed whole-byte (int16 above 8 bits) + a float32 per bucket."""
    codes = 2 * numel if bits > 8 else -(-numel * bits // 8)
    return codes + 4 * -(-numel // bucket)


def _kernel_residuals(residual: torch.Tensor | None, out: torch.Tensor | None) -> bool:
    """Whether the kernel's fused error feedback reads ``residual`` and writes ``out`` as they are: contiguous,
    both float32 or both bfloat16 (either may be None)."""
    given = [t for t in (residual, out) if t is not None]
    return (all(t.is_contiguous() and t.dtype in fast.RESIDUAL_DTYPES for t in given)
            and len({t.dtype for t in given}) <= 1)


@dataclasses.dataclass(frozen=True)
class Bucketed(Codec):
    """The fused CPU paths every bucketed quantiser shares (one float32 scale per ``bucket``, one code per element).

    A subclass says which kernel encodes it (:meth:`kernel`) and how its codes decode
    (:meth:`decoding`); this class then provides the fused encode, the decode into a caller's
    buffer (``decode_into``, ``accumulate_into``: the chunk owner sums W payloads without
    temporaries) and the encode with fused error feedback (``encode_feedback``: one pass
    reads x and the residual and writes the codes, the scales and the new residual).
    """

    if TYPE_CHECKING:  # each subclass declares them: an option (a dataclass field) or a property of its options
        bucket: int

        @property
        def bits(self) -> int: ...

        @property  # the codes' dtype: uint8 here, a property of ``bits`` for int8/int4 (read-only to the checker)
        def code_dtype(self) -> torch.dtype: ...
    else:
        bits = 8
        code_dtype = torch.uint8

    def kernel(self) -> tuple[int, int, int, bool] | None:
        """(kind, bits, qmax, stochastic) of :func:`fast.quantize`, or None when no kernel applies."""
        return None

    def decoding(self) -> tuple[bool, int, int, float]:
        """(signed, mul, offset, div): a code c decodes to ``float(c * mul - offset) * (scale / div)``."""
        raise NotImplementedError

    def code_layout(self, numel: int) -> tuple[torch.dtype, int]:
        """(dtype, count) of the codes of ``numel`` elements: packed bytes, or one int16 each above 8 bits."""
        if self.bits > 8:
            return torch.int16, numel
        return self.code_dtype, (numel * self.bits + 7) // 8

    def slices_by_bucket(self) -> bool:
        """Whether codes of whole buckets start on a whole code element, so a payload of many buckets can be
        cut at any bucket edge (the whole-group two-step reduce, :meth:`encode_piece`)."""
        return self.bits >= 8 or (self.bucket * self.bits) % 8 == 0

    def encode_piece(self, x: torch.Tensor, residual: torch.Tensor | None, out: torch.Tensor | None,
                     codes: torch.Tensor, scales: torch.Tensor, seed: int | None, offset: int = 0) -> None:
        """Encode ``x`` (+ ``residual``) into the caller's payload buffers ``codes`` and ``scales`` (of
        :meth:`code_layout` and one scale per bucket); ``out`` (optional) receives (x + residual) - decode.
        ``x`` may be a piece of a tensor starting at element ``offset`` (on a bucket edge): with the kernels,
        stochastic rounding then draws the noise the whole tensor's encode would (the reference path
        draws from ``seed`` mixed with ``offset``).

        With the fused kernels (CPU, at any size) it is one pass; else the reference (encode, copy, and a
        full decode subtracted). The whole-group two-step reduce calls this once per tensor, so its
        payload is one buffer whose buckets never straddle two tensors."""
        flat = x.reshape(-1)
        kernel = self.kernel()
        if (kernel is not None and flat.device.type == "cpu" and flat.dtype == torch.float32 and flat.is_contiguous()
                and flat.numel() < 2**31 and fast.enabled() and fast.library() is not None
                and _kernel_residuals(residual, out)):
            self._fast_encode(flat, seed, None if residual is None else residual.reshape(-1),
                              None if out is None else out.view(-1), codes, scales, offset)
            return
        if offset and seed is not None:
            seed = (seed * 0x9E3779B97F4A7C15 + offset) & (2**62 - 1)
        if out is not None:
            payload = Codec.encode_feedback(self, x, residual, seed=seed, out=out)
        else:
            payload = self.encode(x if residual is None else x + residual.to(x.dtype), seed=seed)
        codes.copy_(payload.tensors[0].reshape(-1))
        scales.copy_(payload.tensors[1])

    def encode_mean_piece(self, payloads: Sequence[tuple[torch.Tensor, torch.Tensor]], numel: int, divisor: int,
                          codes: torch.Tensor, scales: torch.Tensor, seed: int | None, offset: int = 0) -> None:
        """:meth:`encode_piece` (no residuals) of the mean of W payloads of ``numel`` elements into the caller's
        ``codes`` and ``scales``: what :meth:`mean_into` a float32 buffer followed by ``encode_piece(buffer, None,
        None, codes, scales, seed, offset)`` writes, the same bits. ``payloads``: (codes, scales) pairs of this
        codec's layout (:meth:`code_layout`, one scale per bucket), each starting on a bucket edge. With the
        kernels (CPU) it is one pass that never stores the mean (the chunk owner's decode, sum and re-encode in the
        two-step reduce); else exactly that composition."""
        kernel = self.kernel()
        layout = self.code_layout(numel)
        nb = -(-numel // self.bucket)
        if (kernel is not None and payloads and 0 < numel < 2**31 and fast.enabled() and fast.library() is not None
                and codes.device.type == "cpu" and codes.dtype == layout[0] and codes.numel() == layout[1]
                and codes.is_contiguous() and scales.dtype == torch.float32 and scales.numel() == nb
                and scales.is_contiguous()
                and all(fast.dequantize_ok(c, s, numel, self.bucket, kernel[1], self.code_dtype, any_size=True)
                        for c, s in payloads)):
            kind, bits, qmax, stochastic = kernel
            fast.quantize_mean(list(payloads), float(divisor), numel, self.bucket, kind, bits, qmax, seed, stochastic,
                               decoding=self.decoding(), codes_out=codes, scale_out=scales, index0=offset)
            return
        device = payloads[0][0].device if payloads else codes.device
        mean = torch.empty(numel, dtype=torch.float32, device=device)
        shape = torch.Size([numel])
        self.mean_into([Payload((c, s), shape, torch.float32, None, device) for c, s in payloads], mean, divisor)
        self.encode_piece(mean, None, None, codes, scales, seed, offset)

    def _fast_encode(self, flat: torch.Tensor, seed: int | None, residual: torch.Tensor | None = None,
                     residual_out: torch.Tensor | None = None, codes: torch.Tensor | None = None,
                     scales: torch.Tensor | None = None, offset: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        kind, bits, qmax, stochastic = cast("tuple[int, int, int, bool]", self.kernel())  # callers checked it
        return fast.quantize(fast.as_float32(flat), self.bucket, kind, bits, qmax, seed, stochastic,
                             residual=residual, residual_out=residual_out, decoding=self.decoding(),
                             codes_out=codes, scale_out=scales, index0=offset)

    def _fast_decodes(self, tensors: tuple[torch.Tensor, ...], numel: int, any_size: bool = False) -> bool:
        kernel = self.kernel()
        if kernel is None or len(tensors) != 2:
            return False
        codes, scale = tensors
        return fast.dequantize_ok(codes, scale, numel, self.bucket, kernel[1], self.code_dtype, any_size)

    def _fast_decode(self, tensors: tuple[torch.Tensor, ...], numel: int, out: torch.Tensor | None = None,
                     accumulate: bool = False) -> torch.Tensor:
        codes, scale = tensors
        signed, mul, offset, div = self.decoding()
        kernel = cast("tuple[int, int, int, bool]", self.kernel())  # callers checked it (_fast_decodes)
        return fast.dequantize(codes, scale, numel, self.bucket, kernel[1], signed=signed, mul=mul,
                               offset=offset, div=div, out=out, accumulate=accumulate)

    def _into(self, payload: Payload, out: torch.Tensor, accumulate: bool) -> bool:
        n = payload.numel
        if (n == 0 or out.dtype != torch.float32 or not out.is_contiguous() or out.numel() != n
                or not self._fast_decodes(payload.tensors, n, any_size=True)):
            return False
        self._fast_decode(payload.tensors, n, out.view(-1), accumulate)
        return True

    def decode_into(self, payload: Payload, out: torch.Tensor) -> None:
        if not self._into(payload, out, False):
            super().decode_into(payload, out)

    def accumulate_into(self, payload: Payload, out: torch.Tensor) -> None:
        if not self._into(payload, out, True):
            super().accumulate_into(payload, out)

    def mean_into(self, payloads: Sequence[Payload], out: torch.Tensor, divisor: int) -> None:
        """:meth:`Codec.mean_into` in one pass of the kernel (W payloads decoded, summed in order, divided, written
        once; the same values) where every payload has the layout it reads, else the reference."""
        n = out.numel()
        if (not payloads or n == 0 or out.dtype != torch.float32 or not out.is_contiguous()
                or any(p.numel != n or not self._fast_decodes(p.tensors, n, any_size=True) for p in payloads)):
            return super().mean_into(payloads, out, divisor)
        signed, mul, offset, div = self.decoding()
        kernel = cast("tuple[int, int, int, bool]", self.kernel())  # _fast_decodes said there is one
        fast.dequantize_mean([p.tensors for p in payloads], n, self.bucket, kernel[1], float(divisor),
                             out.view(-1), signed=signed, mul=mul, offset=offset, div=div)

    def encode_feedback(self, x: torch.Tensor, residual: torch.Tensor | None, *, seed: int | None = None,
                        out: torch.Tensor) -> Payload:
        kernel = self.kernel()
        flat = x.reshape(-1)
        ok = (kernel is not None and x.dtype == torch.float32 and flat.is_contiguous()
              and out.numel() == flat.numel() and (residual is None or residual.numel() == flat.numel())
              and _kernel_residuals(residual, out) and (kernel[1] == 8 or self.bucket % 8 == 0)
              and fast.applies(flat))
        if not ok:
            return super().encode_feedback(x, residual, seed=seed, out=out)
        if seed is None and self.stochastic:
            seed = fresh_seed()
        tensors = self._fast_encode(flat, seed, None if residual is None else residual.reshape(-1), out.view(-1))
        return Payload(tuple(tensors), x.shape, x.dtype, seed, x.device)


@dataclasses.dataclass(frozen=True)
class _Uniform(Bucketed):
    """Symmetric uniform quantiser with an abs-max scale per bucket."""

    bucket: int = option(512, range=Range(1, None), doc="elements per scale")
    stochastic: bool = option(False, doc="unbiased stochastic rounding instead of round-to-nearest")
    aggregation = Aggregation.REQUANTIZE
    bits = 8

    @property
    def unbiased(self) -> bool:
        return self.stochastic

    def payload_nbytes(self, numel: int, shape: tuple[int, ...] | None = None) -> int:
        return quantized_nbytes(numel, self.bits, self.bucket)

    @property
    def qmax(self) -> int:
        return int(2 ** (self.bits - 1)) - 1  # an int (bits >= 1); int() for the type checker

    @property
    def code_dtype(self) -> torch.dtype:
        return torch.int8 if self.bits == 8 else torch.uint8

    def kernel(self) -> tuple[int, int, int, bool] | None:
        return (fast.UNIFORM, self.bits, self.qmax, self.stochastic) if self.bits == 8 or self.bucket % 8 == 0 else None

    def decoding(self) -> tuple[bool, int, int, float]:
        return (True, 1, 0, 1.0) if self.bits == 8 else (False, 1, self.qmax + 1, 1.0)

    def _encode(self, flat: torch.Tensor, seed: int | None) -> tuple[torch.Tensor, ...]:
        if _fast_ok(flat, self.bits, self.bucket):
            return self._fast_encode(flat, seed)
        xb = to_buckets(flat, self.bucket)
        scale = xb.abs().amax(dim=1) / self.qmax
        y = safe_divide(xb, scale)
        if self.stochastic:
            # the seed is never None: Codec.encode draws one for a stochastic codec
            y = torch.floor(y + uniform_noise(y.shape, cast(int, seed), y.device))
        else:
            y = torch.round(y)
        codes = from_buckets(y.clamp_(-self.qmax, self.qmax), flat.numel())
        if self.bits == 8:
            return codes.to(torch.int8), scale
        return pack((codes + self.qmax + 1).to(torch.uint8), self.bits), scale

    def _decode(self, tensors: tuple[torch.Tensor, ...], numel: int, seed: int | None,
                device: torch.device) -> torch.Tensor:
        if self._fast_decodes(tensors, numel):
            return self._fast_decode(tensors, numel)
        codes, scale = tensors
        if self.bits == 8:
            y = codes.float()
        else:
            y = unpack(codes, self.bits, numel).float() - (self.qmax + 1)
        return rescale(y, scale, self.bucket, numel)


@register_codec("int8")
@dataclasses.dataclass(frozen=True)
class Int8(_Uniform):
    """int8 codes in [-127, 127] + one float32 scale per bucket: about 1.008 bytes per element.

    Bias: round-to-nearest is biased (error at most scale/2 per element);
    ``stochastic=true`` is unbiased. Use with or without error feedback; the workhorse 4x.
    """

    bits = 8


@register_codec("int4")
@dataclasses.dataclass(frozen=True)
class Int4(_Uniform):
    """int4 codes in [-7, 7], packed two per byte, + one float32 scale per bucket (~0.508 B/element).

    Bias as ``int8`` but 18x coarser; pair with error feedback or ``stochastic=true``.
    """

    bits = 4


@register_codec("qsgd")
@dataclasses.dataclass(frozen=True)
class QSGD(Bucketed):
    """QSGD (Alistarh et al., 2017): per bucket the L2 norm, and per element sign and level.

    What is sent: one float32 norm per bucket and, per element, ``sign * level`` with
    level in ``0..levels`` stochastically rounded, packed in ceil(log2(2*levels + 1)) bits
    (4 bits for the default ``levels=7``; int16 above 127 levels).
    Bias: unbiased; variance at most min(n/s^2, sqrt(n)/s) * ||x||^2 per bucket of n.
    Use where an unbiased estimate matters (no error feedback) at 4 to 8x compression.
    """

    levels: int = option(7, range=Range(1, 32767), doc="quantisation levels s")
    bucket: int = option(512, range=Range(1, None), doc="elements per norm")
    aggregation = Aggregation.REQUANTIZE
    stochastic = True
    unbiased = True

    @property
    def bits(self) -> int:
        return max(1, math.ceil(math.log2(2 * self.levels + 1)))

    def payload_nbytes(self, numel: int, shape: tuple[int, ...] | None = None) -> int:
        return quantized_nbytes(numel, self.bits, self.bucket)

    def kernel(self) -> tuple[int, int, int, bool] | None:
        return (fast.QSGD, self.bits, self.levels, True) if self.bits <= 8 and (
            self.bits == 8 or self.bucket % 8 == 0) else None

    def decoding(self) -> tuple[bool, int, int, float]:
        return (False, 1, self.levels, float(self.levels))

    def _encode(self, flat: torch.Tensor, seed: int | None) -> tuple[torch.Tensor, ...]:
        if self.bits <= 8 and _fast_ok(flat, self.bits, self.bucket):
            return self._fast_encode(flat, seed)
        xb = to_buckets(flat, self.bucket)
        norm = bucket_norm(xb)
        y = safe_divide(xb.abs(), norm) * self.levels
        # the seed is never None: Codec.encode draws one for a stochastic codec
        noise = uniform_noise(y.shape, cast(int, seed), y.device)
        level = torch.floor(y + noise).clamp_(0, self.levels)
        signed = torch.where(xb < 0, -level, level) + self.levels
        codes = from_buckets(signed, flat.numel())
        if self.bits <= 8:
            return pack(codes.to(torch.uint8), self.bits), norm
        return (codes - self.levels).to(torch.int16), norm

    def _decode(self, tensors: tuple[torch.Tensor, ...], numel: int, seed: int | None,
                device: torch.device) -> torch.Tensor:
        if self._fast_decodes(tensors, numel):
            return self._fast_decode(tensors, numel)
        codes, norm = tensors
        if self.bits <= 8:
            y = unpack(codes, self.bits, numel).float() - self.levels
        else:
            y = codes.float()
        return rescale(y, (norm / self.levels), self.bucket, numel)


@register_codec("terngrad")
@dataclasses.dataclass(frozen=True)
class TernGrad(Bucketed):
    """TernGrad (Wen et al., 2017): per bucket a float32 scale max|x|, per element {-1, 0, +1} in 2 bits.

    Element i is sent as sign(x_i) with probability |x_i| / scale, else 0.
    Bias: unbiased (E = x); variance up to scale * |x_i| per element.
    Use for ~16x compression without error feedback.
    """

    bucket: int = option(512, range=Range(1, None), doc="elements per scale")
    aggregation = Aggregation.REQUANTIZE
    stochastic = True
    unbiased = True

    def payload_nbytes(self, numel: int, shape: tuple[int, ...] | None = None) -> int:
        return quantized_nbytes(numel, 2, self.bucket)

    bits = 2

    def kernel(self) -> tuple[int, int, int, bool] | None:
        return (fast.TERNGRAD, 2, 0, True) if self.bucket % 8 == 0 else None

    def decoding(self) -> tuple[bool, int, int, float]:
        return (False, 1, 1, 1.0)

    def _encode(self, flat: torch.Tensor, seed: int | None) -> tuple[torch.Tensor, ...]:
        if _fast_ok(flat, 2, self.bucket):
            return self._fast_encode(flat, seed)
        xb = to_buckets(flat, self.bucket)
        scale = xb.abs().amax(dim=1)
        p = safe_divide(xb.abs(), scale)
        # the seed is never None: Codec.encode draws one for a stochastic codec
        keep = uniform_noise(p.shape, cast(int, seed), p.device) < p
        ternary = torch.where(keep, torch.sign(xb), torch.zeros_like(xb)) + 1
        return pack(from_buckets(ternary, flat.numel()).to(torch.uint8), 2), scale

    def _decode(self, tensors: tuple[torch.Tensor, ...], numel: int, seed: int | None,
                device: torch.device) -> torch.Tensor:
        if self._fast_decodes(tensors, numel):
            return self._fast_decode(tensors, numel)
        codes, scale = tensors
        y = unpack(codes, 2, numel).float() - 1
        return rescale(y, scale, self.bucket, numel)


def two_level_magnitudes(xb: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per bucket (row) of ``xb`` (``n`` elements, then zero padding): (whether each |x| is at or above the
    bucket's mean |x|, the two levels).

    The levels are the mean |x| of the elements below the bucket's mean |x| and of those at or above it (0 for an
    empty group); the padding counts in neither. A bucket holding an Inf or NaN gets NaN levels, so it decodes
    non-finite.
    """
    mag = xb.abs()
    valid = (torch.arange(mag.numel(), device=mag.device) < n).view(mag.shape)
    split = mag.sum(dim=1, keepdim=True) / valid.sum(dim=1, keepdim=True)
    high = mag >= split
    levels = []
    for group in (valid & ~high, valid & high):
        count = group.sum(dim=1).clamp_(min=1)
        levels.append(torch.where(group, mag, torch.zeros_like(mag)).sum(dim=1) / count)
    poison = split.squeeze(1) - split.squeeze(1)  # 0, or NaN for a non-finite bucket
    return high, torch.stack(levels, dim=1) + poison[:, None]


@register_codec("int2")
@dataclasses.dataclass(frozen=True)
class Int2(Codec):
    """2-bit codes (a sign bit and a magnitude bit) + two float32 magnitudes per bucket: ~0.27 B/element.

    What is sent: per element its sign and whether its |x| is below or at/above the bucket's mean |x|
    (packed four to a byte), and per bucket of ``bucket`` elements the two levels: the mean |x| of each of the
    two groups. An element decodes to ``sign * level[its group]``: a sign-magnitude 2-means quantiser
    (SparseLoCo's 2-bit values, Sarfi et al. 2025, sent here with a deterministic rule instead of their
    statistical bins).

    Bias: deterministic and biased per element, but each group keeps its sum of magnitudes, and it is a
    contraction: ``||x - Q(x)||^2 = ||x||^2 - sum_groups n_g level_g^2 <= ||x||^2``, so error feedback is
    safe with it. When to use it: as the ``values`` codec of a sparsifier
    (``topk:ratio=0.015625,chunk=4096,values=int2``): the kept values are all large, which two levels per
    bucket describe well. On dense gradients ``int4`` keeps far more (2 levels cannot separate small values).
    """

    bucket: int = option(512, range=Range(1, None), doc="elements per pair of levels")
    aggregation = Aggregation.REQUANTIZE
    uses_fast_kernels = False

    def payload_nbytes(self, numel: int, shape: tuple[int, ...] | None = None) -> int:
        return -(-numel * 2 // 8) + 8 * -(-numel // self.bucket)

    def _encode(self, flat: torch.Tensor, seed: int | None) -> tuple[torch.Tensor, ...]:
        xb = to_buckets(flat, self.bucket)
        high, levels = two_level_magnitudes(xb, flat.numel())
        codes = (xb < 0).to(torch.uint8) + 2 * high.to(torch.uint8)
        return pack(from_buckets(codes, flat.numel()), 2), levels.reshape(-1)

    def _decode(self, tensors: tuple[torch.Tensor, ...], numel: int, seed: int | None,
                device: torch.device) -> torch.Tensor:
        packed, levels = tensors
        codes = unpack(packed, 2, numel).long()
        nb = levels.numel() // 2
        bucket_of = torch.arange(numel, device=codes.device) // self.bucket
        magnitude = levels.view(nb, 2).float()[bucket_of, codes // 2]
        return torch.where(codes % 2 == 1, -magnitude, magnitude)
