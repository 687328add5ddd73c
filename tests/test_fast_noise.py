"""The stochastic quantisers' fast paths against the reference (split from test_fast_paths.py): the same
distribution, not the same bits — unbiased, the exact variance of stochastic rounding, codes on the two neighbouring
levels — independent noise, and the kernels' noise being the counter hash of the element's index."""

from __future__ import annotations

import math

import pytest
import torch

from fast_common import N, STOCHASTIC, big_input, encode_both
from gradcompress import make
from gradcompress.codecs import fast
from gradcompress.codecs.packing import unpack


# --------------------------------------------------------------------------- stochastic quantisers
def exact_moments(spec: str, x: torch.Tensor):
    """Per element: the two neighbouring decoded levels' spacing and the exact variance (float64)."""
    codec = make(spec)
    bucket = codec.bucket
    n = x.numel()
    nb = -(-n // bucket)
    xb = torch.nn.functional.pad(x.double(), (0, nb * bucket - n)).view(nb, bucket)
    amax = xb.abs().amax(dim=1, keepdim=True)
    if codec.name == "qsgd":
        norm = torch.linalg.vector_norm(xb, dim=1, keepdim=True)
        step = norm / codec.levels
        y = xb.abs() / torch.where(step > 0, step, torch.ones_like(step))
    elif codec.name == "terngrad":
        step = amax
        y = xb.abs() / torch.where(step > 0, step, torch.ones_like(step))
    else:
        step = amax / codec.qmax
        y = xb / torch.where(step > 0, step, torch.ones_like(step))
    frac = y - torch.floor(y)
    var = step**2 * frac * (1 - frac)
    return step.expand_as(xb).reshape(-1)[:n], var.reshape(-1)[:n]




def _moments(codec, x, seeds):
    s = torch.zeros(x.numel(), dtype=torch.float64)
    s2 = torch.zeros_like(s)
    for seed in seeds:
        y = codec.decode(codec.encode(x, seed=seed)).double()
        s += y
        s2 += y * y
    mean = s / len(seeds)
    var = (s2 / len(seeds) - mean**2).clamp_min(0) * len(seeds) / (len(seeds) - 1)
    return mean, var


@pytest.mark.parametrize("spec", STOCHASTIC)
def test_stochastic_quantisers_same_distribution(lib, spec):
    codec = make(spec)
    x = big_input(wide=False)
    pf, pr = encode_both(codec, x, seed=5)
    # the same layout and the same scales / norms; codes on one of the two neighbouring levels
    assert [(t.dtype, t.shape) for t in pf.tensors] == [(t.dtype, t.shape) for t in pr.tensors]
    assert torch.allclose(pf.tensors[1], pr.tensors[1], rtol=1e-6, atol=0)
    step, exact_var = exact_moments(spec, x)
    y = codec.decode(pf).double()
    assert ((y - x.double()).abs() <= step * (1 + 1e-5)).all()
    if codec.name == "qsgd":
        assert ((y == 0) | (torch.sign(y) == torch.sign(x.double()))).all()
    # deterministic for a seed, another seed another draw
    again = codec.encode(x, seed=5)
    assert all(torch.equal(a, b) for a, b in zip(pf.tensors, again.tensors))
    assert not torch.equal(codec.encode(x, seed=6).tensors[0], pf.tensors[0])

    seeds = range(64)
    xd = x.double()
    for path in (True, False):  # the fast path and, for comparison, the reference
        with fast.use(path):
            mean, var = _moments(codec, x, seeds)
        # unbiased: ||mean - x||^2 about its expectation sum(var) / S, per chunk of 4096 and overall
        se2 = exact_var / len(seeds)
        err2 = (mean - xd) ** 2
        for a in range(0, N, 4096):
            ratio = err2[a : a + 4096].sum() / (se2[a : a + 4096].sum() + 1e-300)
            assert ratio < 1.5, (spec, path, a, ratio.item())
        assert 0.9 < err2.sum() / se2.sum() < 1.1, (spec, path, (err2.sum() / se2.sum()).item())
        # the exact variance of stochastic rounding (sum over elements)
        assert abs(var.sum() / exact_var.sum() - 1) < 0.03, (spec, path, (var.sum() / exact_var.sum()).item())


def test_noise_is_independent(lib):
    """terngrad on |x| = max/2: keep decisions are fair coins, independent of the neighbour and of the seed."""
    x = torch.full((N,), 0.5)
    x[::512] = 1.0
    x[1::2] *= -1
    codec = make("terngrad")
    mask = torch.ones(N, dtype=torch.bool)
    mask[::512] = False
    keeps = []
    for seed in (0, 1, 2**40, 2**63 + 5):
        y = codec.decode(codec.encode(x, seed=seed))
        keeps.append((y != 0)[mask].float())
    sd = 0.5 / math.sqrt(mask.sum().item())
    for k in keeps:
        assert abs(k.mean().item() - 0.5) < 5 * sd
        both = (k[1:] * k[:-1]).mean().item()  # neighbours: P(both kept) = 1/4
        assert abs(both - 0.25) < 5 * 0.433 / math.sqrt(k.numel())
    for a in range(len(keeps)):
        for b in range(a + 1, len(keeps)):  # different seeds agree half of the time
            agree = (keeps[a] == keeps[b]).float().mean().item()
            assert abs(agree - 0.5) < 5 * sd


def _hash32(z: torch.Tensor) -> torch.Tensor:
    """lowbias32 on int64 tensors holding uint32 values (products wrap; masked back to 32 bits)."""
    mask = 0xFFFFFFFF
    z = z ^ (z >> 16)
    z = (z * 0x7FEB352D) & mask
    z = z ^ (z >> 15)
    z = (z * 0x846CA68B) & mask
    return z ^ (z >> 16)


def counter_uniform(seed: int, index: torch.Tensor) -> torch.Tensor:
    """The quantisers' noise of element indices ``index`` for ``seed``, written down independently of the kernel:
    the stream key's halves k0, k1; hash32(hash32(i ^ k0) + k1), its top 24 bits as a float32 in [0, 1)."""
    key = fast.stream_key(seed, fast._SALT_NOISE)
    k0, k1 = key & 0xFFFFFFFF, key >> 32
    h = _hash32((_hash32(index ^ k0) + k1) & 0xFFFFFFFF)
    return (h >> 8).float() * 2.0**-24


def expected_codes(codec, x: torch.Tensor, scale: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """The codes (one per element, unpacked, as int64) the kernel's formula gives x with these scales and noise."""
    s = scale.repeat_interleave(codec.bucket)[: x.numel()]
    s = torch.where(s > 0, s, torch.full_like(s, math.inf))  # an all-zero bucket encodes to zeros
    if codec.name == "terngrad":
        keep = (u < x.abs() / s).long()
        return 1 + keep * torch.sign(x).long()
    if codec.name == "qsgd":
        y = x.abs() / s * float(codec.levels)
        f = torch.floor(y)
        level = (f + (u < y - f).float()).clamp(max=codec.levels).long()
        return torch.where(x < 0, -level, level) + codec.levels
    y = x / s  # stochastic int8 / int4
    f = torch.floor(y)
    r = (f + (u < y - f).float()).clamp(-codec.qmax, codec.qmax).long()
    return r if codec.bits == 8 else r + codec.qmax + 1


def unpacked_codes(codec, codes: torch.Tensor, n: int) -> torch.Tensor:
    """A payload's codes, one int64 per element."""
    return codes.long() if codec.bits == 8 else unpack(codes, codec.bits, n).long()


@pytest.mark.parametrize("spec", ["int8:stochastic=true", "int4:stochastic=true", "qsgd:levels=4", "terngrad"])
@pytest.mark.parametrize("start", [0, 512 * 37])
def test_kernel_noise_is_the_counter_hash(lib, spec, start):
    """The kernel's codes are those of the documented noise (computed here in torch integer arithmetic) at the
    elements' indices: a tensor encoded as a piece at element ``start`` draws the noise of indices start, ..."""
    codec = make(spec)
    x = big_input(wide=False)
    n = x.numel()
    dtype, count = codec.code_layout(n)
    codes, scales = torch.empty(count, dtype=dtype), torch.empty(-(-n // codec.bucket))
    codec.encode_piece(x, None, None, codes, scales, 11, start)
    u = counter_uniform(11, torch.arange(start, start + n))
    assert torch.equal(unpacked_codes(codec, codes, n), expected_codes(codec, x, scales, u))


@pytest.mark.parametrize("spec", STOCHASTIC)
def test_piece_noise_is_the_whole_tensors(lib, spec):
    """A piece of a tensor encoded alone at its element offset (a bucket edge) gets exactly the codes and scales of
    those elements in the whole tensor's encode (as the chunk owner's re-encode relies on); at offset 0 other noise."""
    codec = make(spec)
    x = big_input(wide=False)
    n = x.numel()
    dtype, count = codec.code_layout(n)
    codes, scales = torch.empty(count, dtype=dtype), torch.empty(-(-n // codec.bucket))
    codec.encode_piece(x, None, None, codes, scales, 7, 0)
    first = 37 * 512 // codec.bucket  # the piece's first bucket
    start = first * codec.bucket
    piece = x[start:]
    dtype, count = codec.code_layout(piece.numel())
    per_bucket = codec.code_layout(codec.bucket)[1]
    for offset, same_noise in ((start, True), (0, False)):
        pc, ps = torch.empty(count, dtype=dtype), torch.empty(-(-piece.numel() // codec.bucket))
        codec.encode_piece(piece, None, None, pc, ps, 7, offset)
        assert torch.equal(ps, scales[first:])
        assert torch.equal(pc, codes[first * per_bucket :]) == same_noise, (spec, offset)


def test_noise_counter_is_32_bits(lib):
    """Element indices beyond 2**32 have no noise of their own: refused, not wrapped around."""
    x = torch.ones(fast.MIN_NUMEL)
    fast.quantize(x, 512, fast.TERNGRAD, 2, seed=1, stochastic=True, index0=2**32 - x.numel())
    with pytest.raises(ValueError, match="32-bit noise counter"):
        fast.quantize(x, 512, fast.TERNGRAD, 2, seed=1, stochastic=True, index0=2**32 - x.numel() + 1)
