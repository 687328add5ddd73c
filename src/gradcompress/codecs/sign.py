"""1-bit sign compression (``sign``): the EF-signSGD compressor (Karimireddy et al., 2019).

What is sent: one bit per element (1 for x >= 0) packed 8 per byte, and per bucket of
``bucket`` elements one float32 scale, the bucket's mean absolute value, so the decoded
bucket has the input's L1 norm. About 0.133 bytes per element (32x / 30x).
Bias: biased (a scaled sign); use it with error feedback, which makes it converge like
SGD. Payloads go through the two-step reduce.
Large CPU tensors take a fused kernel (:mod:`gradcompress.codecs.fast`): the same bits,
the scale summed in float64 (the last bits may differ from this float32 code's).
"""

from __future__ import annotations

import dataclasses

import torch

from .packing import pack, unpack
from ..spec import Range, option, register_codec
from . import fast
from .base import Aggregation
from .quantize import Bucketed, quantized_nbytes, rescale, to_buckets


@register_codec("sign")
@dataclasses.dataclass(frozen=True)
class Sign(Bucketed):
    bucket: int = option(512, range=Range(1, None), doc="elements per scale")
    aggregation = Aggregation.REQUANTIZE

    def payload_nbytes(self, numel: int, shape: tuple[int, ...] | None = None) -> int:
        return quantized_nbytes(numel, 1, self.bucket)

    bits = 1

    def kernel(self) -> tuple[int, int, int, bool] | None:
        return (fast.SIGN, 1, 0, False) if self.bucket % 8 == 0 else None

    def decoding(self) -> tuple[bool, int, int, float]:
        return (False, 2, 1, 1.0)

    def _encode(self, flat: torch.Tensor, seed: int | None) -> tuple[torch.Tensor, ...]:
        if self.bucket % 8 == 0 and fast.applies(flat):  # float32/16/bf16: flat >= 0 is the same after .float()
            return self._fast_encode(flat, seed)
        n = flat.numel()
        xb = to_buckets(flat, self.bucket)
        counts = torch.full((xb.shape[0],), float(self.bucket), device=xb.device)
        counts[-1] = n - (xb.shape[0] - 1) * self.bucket
        scale = xb.abs().sum(dim=1) / counts
        bits = flat >= 0  # NaN -> 0; its bucket's scale is NaN anyway
        return pack(bits.to(torch.uint8), 1), scale

    def _decode(self, tensors: tuple[torch.Tensor, ...], numel: int, seed: int | None,
                device: torch.device) -> torch.Tensor:
        if self._fast_decodes(tensors, numel):
            return self._fast_decode(tensors, numel)
        bits, scale = tensors
        y = unpack(bits, 1, numel).float() * 2 - 1
        return rescale(y, scale, self.bucket, numel)
