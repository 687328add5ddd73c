"""Casts: ``none`` (identity), ``fp16`` and ``bf16``.

What is sent: every element, in the input's dtype (``none``) or cast to 16 bits.
Bias: ``none`` is exact; the 16-bit casts round to nearest (deterministic, error below
one unit in the last place; ``fp16`` overflows to Inf above 65504, ``bf16`` keeps
float32's range with 8 bits of mantissa). Payloads are summable, so the exchange uses
one all-reduce. Use ``fp16``/``bf16`` as the safe first step (2x fewer bytes, no
tuning); ``bf16`` where gradients may exceed fp16's range.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import torch

from ..spec import register_codec
from .base import Aggregation, Codec, Payload, check_input


_PIECE = 1 << 16  # elements divided at a time on CPU (256 KB of float32: stays in cache)


@dataclasses.dataclass(frozen=True)
class _Cast(Codec):
    aggregation = Aggregation.SUM
    uses_fast_kernels = False
    wire_dtype: ClassVar[torch.dtype | None] = None  # None: keep the input's dtype

    @property
    def wants_error_feedback(self) -> bool:
        return False  # round to nearest in 16 bits: a residual of half an ulp buys nothing (as torch's fp16 hook)

    def payload_nbytes(self, numel: int, shape: tuple[int, ...] | None = None) -> int:
        return numel * (4 if self.wire_dtype is None else 2)

    def _encode(self, flat: torch.Tensor, seed: int | None) -> tuple[torch.Tensor, ...]:
        return (flat if self.wire_dtype is None else flat.to(self.wire_dtype),)

    def mean_part_dtype(self, x: torch.Tensor) -> torch.dtype:
        return self.wire_dtype or x.dtype

    def encode_mean_part(self, x: torch.Tensor, world: int, *, seed: int | None = None,
                         out: torch.Tensor | None = None) -> Payload:
        """x / world rounded once into the wire dtype, in one pass (the values of ``encode(x / world)``)."""
        check_input(x, self.name)
        flat = x.reshape(-1)
        if out is None:
            out = torch.empty(flat.numel(), dtype=self.mean_part_dtype(x), device=x.device)
        if out.dtype == flat.dtype or flat.device.type != "cpu":
            torch.div(flat, world, out=out)
        else:  # torch's mixed-dtype div(out=) is unvectorised on CPU (5x slower): divide cache-sized pieces, then cast
            tmp = torch.empty(min(flat.numel(), _PIECE), dtype=flat.dtype)
            for lo in range(0, flat.numel(), _PIECE):
                hi = min(flat.numel(), lo + _PIECE)
                out[lo:hi].copy_(torch.div(flat[lo:hi], world, out=tmp[: hi - lo]))
        return Payload((out,), x.shape, x.dtype, seed, x.device)

    def decode_into(self, payload: Payload, out: torch.Tensor) -> None:
        out.copy_(payload.tensors[0].view(out.shape))

    def _decode(self, tensors: tuple[torch.Tensor, ...], numel: int, seed: int | None,
                device: torch.device) -> torch.Tensor:
        return tensors[0]


@register_codec("none")
@dataclasses.dataclass(frozen=True)
class NoCompression(_Cast):
    """Identity: sends the tensor as it is (fp32 for float32 gradients)."""

    exact = True


@register_codec("fp16")
@dataclasses.dataclass(frozen=True)
class Float16(_Cast):
    """IEEE half precision: 2 bytes per element, round to nearest."""

    wire_dtype = torch.float16


@register_codec("bf16")
@dataclasses.dataclass(frozen=True)
class BFloat16(_Cast):
    """bfloat16: 2 bytes per element, float32's exponent range, round to nearest."""

    wire_dtype = torch.bfloat16
