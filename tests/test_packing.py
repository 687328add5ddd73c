"""Bit packing: round trip, exact packed size and the wire bit layout."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from gradcompress.codecs.packing import pack, packed_nbytes, unpack

BITS = list(range(1, 9))


def _codes(n: int, bits: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 2**bits, (n,), generator=g, dtype=torch.int64).to(torch.uint8)


@settings(deadline=None, max_examples=400)
@given(bits=st.integers(1, 8), n=st.integers(0, 3000), seed=st.integers(0, 2**31 - 1))
def test_round_trip_random_lengths(bits, n, seed):
    codes = _codes(n, bits, seed)
    packed = pack(codes, bits)
    assert packed.dtype == torch.uint8
    assert packed.dim() == 1
    assert packed.numel() == math.ceil(n * bits / 8) == packed_nbytes(n, bits)
    out = unpack(packed, bits, n)
    assert out.dtype == torch.uint8
    assert out.shape == (n,)
    assert torch.equal(out, codes)


@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("n", [0, 1, 2, 3, 7, 8, 9, 15, 16, 17, 63, 64, 65, 511, 512, 513, 1000, 4097])
def test_round_trip_edge_lengths(bits, n):
    codes = _codes(n, bits, seed=1000 * bits + n)
    packed = pack(codes, bits)
    assert packed.numel() == math.ceil(n * bits / 8)
    assert torch.equal(unpack(packed, bits, n), codes)


@pytest.mark.parametrize("bits", BITS)
def test_extreme_codes(bits):
    """All-zero and all-max codes (every bit set) survive: no bleeding between fields."""
    for n in (1, 8, 13, 100):
        for value in (0, 2**bits - 1):
            codes = torch.full((n,), value, dtype=torch.uint8)
            packed = pack(codes, bits)
            assert torch.equal(unpack(packed, bits, n), codes)
        alternating = torch.tensor([(2**bits - 1) if i % 2 else 0 for i in range(n)], dtype=torch.uint8)
        assert torch.equal(unpack(pack(alternating, bits), bits, n), alternating)


@pytest.mark.parametrize("bits", BITS)
def test_accepts_other_integer_dtypes_and_shapes(bits):
    codes = _codes(60, bits, seed=bits)
    for dt in (torch.int64, torch.int32, torch.int16):
        assert torch.equal(pack(codes.to(dt), bits), pack(codes, bits))
    # a 2-D (and a non-contiguous) tensor of codes packs like its flattening
    mat = codes.view(6, 10)
    assert torch.equal(pack(mat, bits), pack(codes, bits))
    assert torch.equal(pack(mat.t(), bits), pack(mat.t().reshape(-1), bits))


@pytest.mark.parametrize("bits", BITS)
def test_unpack_reads_a_prefix(bits):
    """unpack(..., n) may be asked for fewer codes than were packed."""
    codes = _codes(100, bits, seed=7)
    packed = pack(codes, bits)
    for n in (0, 1, 9, 50, 99, 100):
        assert torch.equal(unpack(packed, bits, n), codes[:n])


def test_bit_layout_is_little_endian_fields():
    """Code i occupies bits [i*bits, (i+1)*bits) of the little-endian byte stream (the wire format)."""
    assert pack(torch.tensor([1, 0, 1, 1, 0, 0, 0, 0, 1], dtype=torch.uint8), 1).tolist() == [0b00001101, 0b1]
    assert pack(torch.tensor([1, 2, 15], dtype=torch.uint8), 4).tolist() == [0x21, 0x0F]
    assert pack(torch.tensor([3, 0, 2, 1], dtype=torch.uint8), 2).tolist() == [0b01100011]
    # 3-bit: codes 5, 6, 7 -> bits 101 | 110 << 3 | 111 << 6 = 0b111110101 -> bytes 0xF5, 0x01
    assert pack(torch.tensor([5, 6, 7], dtype=torch.uint8), 3).tolist() == [0xF5, 0x01]
    assert pack(torch.tensor([200, 7], dtype=torch.uint8), 8).tolist() == [200, 7]


@pytest.mark.parametrize("bits", [0, 9, -1, 16])
def test_bad_bits(bits):
    with pytest.raises(ValueError, match="bits"):
        pack(torch.zeros(4, dtype=torch.uint8), bits)
    with pytest.raises(ValueError, match="bits"):
        unpack(torch.zeros(4, dtype=torch.uint8), bits, 4)


@pytest.mark.parametrize("bits", BITS)
def test_packed_nbytes(bits):
    for n in range(70):
        assert packed_nbytes(n, bits) == math.ceil(n * bits / 8)
