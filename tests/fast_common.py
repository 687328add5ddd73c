"""What the tests of the fast codec paths share (tests/test_fast_paths.py, test_fast_noise.py): inputs that reach
the kernels' corner cases, both paths' payloads, and the codec lists; the ``lib`` fixture is in conftest.py."""

from __future__ import annotations

import torch

from gradcompress.codecs import fast

DETERMINISTIC = ["int8", "int4", "int8:bucket=7", "int4:bucket=64", "int8:bucket=100000", "sign", "sign:bucket=64"]
STOCHASTIC = ["int8:stochastic=true", "int4:stochastic=true", "int4:stochastic=true,bucket=64", "qsgd",
              "qsgd:levels=1", "qsgd:levels=100", "terngrad"]

N = 70_001  # > fast.MIN_NUMEL; 70001 % 512 = 369 (partial last bucket), % 8 = 1 (partial last byte)




def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def big_input(n: int = N, seed: int = 0, dtype=torch.float32, wide: bool = True) -> torch.Tensor:
    """Gaussian values, magnitudes varying per bucket (1e-30..1e30 when wide), and special buckets."""
    g = gen(seed)
    x = torch.randn(n, generator=g) * (0.2 + 3 * torch.rand(n, generator=g))
    if wide:
        scales = 10.0 ** (torch.rand(-(-n // 512), generator=g) * 60 - 30)
        x = x * scales.repeat_interleave(512)[:n]
        x[1024:1536] *= 1e-38 / x[1024:1536].abs().max()  # subnormal scale (amax / 127)
    x[512:1024] = 0.0  # an all-zero bucket
    x[1536:2048] = torch.arange(512) % 16 * 0.5 - 4.0  # exact halves: round half to even
    x[1536] = 127.0
    x[2048:2560] = torch.randint(-3, 4, (512,), generator=g).float()  # ties
    return x.to(dtype)


def encode_both(codec, x, seed=3):
    fast_p = codec.encode(x, seed=seed)
    with fast.use(False):
        ref_p = codec.encode(x, seed=seed)
    return fast_p, ref_p


def decode_ref(codec, payload):
    with fast.use(False):
        return codec.decode(payload)
