"""1-bit sign compression (``sign``): the EF-signSGD compressor (Karimireddy et al., 2019).

What is sent: one bit per element (1 for x >= 0) packed 8 per byte, and per bucket of
``bucket`` elements one float32 scale, the bucket's mean absolute value, so the decoded
bucket has the input's L1 norm. About 0.133 bytes per element (32x / 30x).
Bias: biased (a scaled sign); use it with error feedback, which makes it converge like
SGD. Payloads go through the two-step reduce.
"""

from __future__ import annotations

import dataclasses

import torch

from ..packing import pack, unpack
from ..spec import Range, option, register
from .base import Aggregation, Codec
from .quantize import rescale, to_buckets


@register("sign")
@dataclasses.dataclass(frozen=True)
class Sign(Codec):
    bucket: int = option(512, range=Range(1, None), doc="elements per scale")
    aggregation = Aggregation.REQUANTIZE

    def _encode(self, flat, seed):
        n = flat.numel()
        xb = to_buckets(flat, self.bucket)
        counts = torch.full((xb.shape[0],), float(self.bucket), device=xb.device)
        counts[-1] = n - (xb.shape[0] - 1) * self.bucket
        scale = xb.abs().sum(dim=1) / counts
        bits = flat >= 0  # NaN -> 0; its bucket's scale is NaN anyway
        return pack(bits.to(torch.uint8), 1), scale

    def _decode(self, tensors, numel, seed, device):
        bits, scale = tensors
        y = unpack(bits, 1, numel).float() * 2 - 1
        return rescale(y, scale, self.bucket, numel)
