"""Uniform and stochastic quantisers: ``int8``, ``int4``, ``qsgd``, ``terngrad``.

All work per bucket of ``bucket`` consecutive elements (default 512), each bucket with
one float32 scale, so one outlier only coarsens its own bucket. Codes narrower than a
byte are bit-packed (:mod:`gradcompress.packing`). Payloads are not summable: the
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

import torch

from ..packing import pack, unpack
from ..spec import Range, option, register
from . import fast
from .base import Aggregation, Codec, generator

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
    return torch.linalg.vector_norm(safe_divide(xb, amax), dim=1) * amax


def uniform_noise(shape, seed: int, device) -> torch.Tensor:
    """U[0, 1) noise from a private generator (stochastic rounding)."""
    return torch.rand(shape, generator=generator(seed, device), device=device)


def packed_nbytes(numel: int, bits: int, bucket: int) -> int:
    """Bytes of ``numel`` codes of ``bits`` bits packed whole-byte (int16 above 8 bits) + a float32 per bucket."""
    codes = 2 * numel if bits > 8 else -(-numel * bits // 8)
    return codes + 4 * -(-numel // bucket)


@dataclasses.dataclass(frozen=True)
class _Uniform(Codec):
    """Symmetric uniform quantiser with an abs-max scale per bucket."""

    bucket: int = option(512, range=Range(1, None), doc="elements per scale")
    stochastic: bool = option(False, doc="unbiased stochastic rounding instead of round-to-nearest")
    aggregation = Aggregation.REQUANTIZE
    bits = 8

    @property
    def unbiased(self) -> bool:
        return self.stochastic

    def payload_nbytes(self, numel: int, shape: tuple | None = None) -> int:
        return packed_nbytes(numel, self.bits, self.bucket)

    @property
    def qmax(self) -> int:
        return 2 ** (self.bits - 1) - 1

    def _encode(self, flat, seed):
        if _fast_ok(flat, self.bits, self.bucket):
            return fast.quantize(fast.as_float32(flat), self.bucket, fast.UNIFORM, self.bits, self.qmax, seed,
                                 self.stochastic)
        xb = to_buckets(flat, self.bucket)
        scale = xb.abs().amax(dim=1) / self.qmax
        y = safe_divide(xb, scale)
        if self.stochastic:
            y = torch.floor(y + uniform_noise(y.shape, seed, y.device))
        else:
            y = torch.round(y)
        codes = from_buckets(y.clamp_(-self.qmax, self.qmax), flat.numel())
        if self.bits == 8:
            return codes.to(torch.int8), scale
        return pack((codes + self.qmax + 1).to(torch.uint8), self.bits), scale

    def _decode(self, tensors, numel, seed, device):
        codes, scale = tensors
        if fast.dequantize_ok(codes, scale, numel, self.bucket, self.bits,
                              torch.int8 if self.bits == 8 else torch.uint8):
            return fast.dequantize(codes, scale, numel, self.bucket, self.bits, signed=self.bits == 8,
                                   offset=0 if self.bits == 8 else self.qmax + 1)
        if self.bits == 8:
            y = codes.float()
        else:
            y = unpack(codes, self.bits, numel).float() - (self.qmax + 1)
        return rescale(y, scale, self.bucket, numel)


@register("int8")
@dataclasses.dataclass(frozen=True)
class Int8(_Uniform):
    """int8 codes in [-127, 127] + one float32 scale per bucket: about 1.008 bytes per element.

    Bias: round-to-nearest is biased (error at most scale/2 per element);
    ``stochastic=true`` is unbiased. Use with or without error feedback; the workhorse 4x.
    """

    bits = 8


@register("int4")
@dataclasses.dataclass(frozen=True)
class Int4(_Uniform):
    """int4 codes in [-7, 7], packed two per byte, + one float32 scale per bucket (~0.508 B/element).

    Bias as ``int8`` but 18x coarser; pair with error feedback or ``stochastic=true``.
    """

    bits = 4


@register("qsgd")
@dataclasses.dataclass(frozen=True)
class QSGD(Codec):
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

    def payload_nbytes(self, numel: int, shape: tuple | None = None) -> int:
        return packed_nbytes(numel, self.bits, self.bucket)

    def _encode(self, flat, seed):
        if self.bits <= 8 and _fast_ok(flat, self.bits, self.bucket):
            return fast.quantize(fast.as_float32(flat), self.bucket, fast.QSGD, self.bits, self.levels, seed)
        xb = to_buckets(flat, self.bucket)
        norm = bucket_norm(xb)
        y = safe_divide(xb.abs(), norm) * self.levels
        level = torch.floor(y + uniform_noise(y.shape, seed, y.device)).clamp_(0, self.levels)
        signed = torch.where(xb < 0, -level, level) + self.levels
        codes = from_buckets(signed, flat.numel())
        if self.bits <= 8:
            return pack(codes.to(torch.uint8), self.bits), norm
        return (codes - self.levels).to(torch.int16), norm

    def _decode(self, tensors, numel, seed, device):
        codes, norm = tensors
        if self.bits <= 8 and fast.dequantize_ok(codes, norm, numel, self.bucket, self.bits, torch.uint8):
            return fast.dequantize(codes, norm, numel, self.bucket, self.bits, offset=self.levels, div=self.levels)
        if self.bits <= 8:
            y = unpack(codes, self.bits, numel).float() - self.levels
        else:
            y = codes.float()
        return rescale(y, (norm / self.levels), self.bucket, numel)


@register("terngrad")
@dataclasses.dataclass(frozen=True)
class TernGrad(Codec):
    """TernGrad (Wen et al., 2017): per bucket a float32 scale max|x|, per element {-1, 0, +1} in 2 bits.

    Element i is sent as sign(x_i) with probability |x_i| / scale, else 0.
    Bias: unbiased (E = x); variance up to scale * |x_i| per element.
    Use for ~16x compression without error feedback.
    """

    bucket: int = option(512, range=Range(1, None), doc="elements per scale")
    aggregation = Aggregation.REQUANTIZE
    stochastic = True
    unbiased = True

    def payload_nbytes(self, numel: int, shape: tuple | None = None) -> int:
        return packed_nbytes(numel, 2, self.bucket)

    def _encode(self, flat, seed):
        if _fast_ok(flat, 2, self.bucket):
            return fast.quantize(fast.as_float32(flat), self.bucket, fast.TERNGRAD, 2, 0, seed)
        xb = to_buckets(flat, self.bucket)
        scale = xb.abs().amax(dim=1)
        p = safe_divide(xb.abs(), scale)
        keep = uniform_noise(p.shape, seed, p.device) < p
        ternary = torch.where(keep, torch.sign(xb), torch.zeros_like(xb)) + 1
        return pack(from_buckets(ternary, flat.numel()).to(torch.uint8), 2), scale

    def _decode(self, tensors, numel, seed, device):
        codes, scale = tensors
        if fast.dequantize_ok(codes, scale, numel, self.bucket, 2, torch.uint8):
            return fast.dequantize(codes, scale, numel, self.bucket, 2, offset=1)
        y = unpack(codes, 2, numel).float() - 1
        return rescale(y, scale, self.bucket, numel)
