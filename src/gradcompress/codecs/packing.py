"""Sub-byte packing shared by every codec that sends codes narrower than a byte.

``pack(codes, bits)`` turns unsigned integer codes in ``[0, 2**bits)`` into
``ceil(n * bits / 8)`` bytes; ``unpack(packed, bits, n)`` inverts it. Any width from
1 to 8 bits works: groups of 8 codes are combined into one 64-bit word (8 * bits bits)
whose low ``bits`` bytes are kept, so 3-bit codes really cost 3 bits.
Device-agnostic, no host synchronisation. Widths that divide 8 (1, 2, 4) are combined
in uint8 arithmetic (no 64-bit temporaries); large CPU tensors go through the fused
kernels of :mod:`gradcompress.codecs.fast` (the same bytes).
"""

from __future__ import annotations

import sys

import torch

if sys.byteorder != "little":  # pragma: no cover - every supported platform is little-endian
    raise ImportError("gradcompress.codecs.packing assumes a little-endian machine")

_SHIFT_CACHE: dict[tuple[int, str], torch.Tensor] = {}


def _shifts(bits: int, device: torch.device) -> torch.Tensor:
    key = (bits, str(device))
    t = _SHIFT_CACHE.get(key)
    if t is None:
        t = torch.arange(8, dtype=torch.int64, device=device) * bits
        _SHIFT_CACHE[key] = t
    return t


def packed_nbytes(n: int, bits: int) -> int:
    """Bytes that ``n`` codes of ``bits`` bits occupy once packed."""
    return (n * bits + 7) // 8


def _fast_ok(t: torch.Tensor, n: int) -> bool:
    from . import fast  # late: loading the kernels is deferred to first use

    return t.device.type == "cpu" and fast.MIN_NUMEL <= n < 2**31 and fast.enabled() and fast.kernels_available()


def pack(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack a 1-D tensor of codes in ``[0, 2**bits)`` into a uint8 tensor of ``packed_nbytes(n, bits)`` bytes."""
    if not 1 <= bits <= 8:
        raise ValueError(f"pack: bits must be in [1, 8], got {bits}")
    n = codes.numel()
    if bits == 8:
        return codes.to(torch.uint8).reshape(-1)
    if _fast_ok(codes, n):
        from . import fast

        return fast.pack(codes.to(torch.uint8).reshape(-1).contiguous(), bits)
    if 8 % bits == 0:  # 1, 2, 4: whole codes per byte, uint8 arithmetic
        per = 8 // bits
        c = codes.reshape(-1).to(torch.uint8)
        if n % per:
            c = torch.nn.functional.pad(c, (0, per - n % per))
        c = c.view(-1, per)
        out = c[:, 0].clone()
        for j in range(1, per):
            out |= c[:, j] << (j * bits)
        return out
    groups = (n + 7) // 8
    c = codes.reshape(-1).to(torch.int64)
    if groups * 8 != n:
        c = torch.nn.functional.pad(c, (0, groups * 8 - n))
    words = (c.view(groups, 8) << _shifts(bits, c.device)).sum(dim=1)  # disjoint bit fields: sum == or
    out = words.view(torch.uint8).view(groups, 8)[:, :bits].reshape(-1)
    return out[: packed_nbytes(n, bits)]


def unpack(packed: torch.Tensor, bits: int, n: int) -> torch.Tensor:
    """Inverse of :func:`pack`: the first ``n`` codes as a uint8 tensor (values in ``[0, 2**bits)``)."""
    if not 1 <= bits <= 8:
        raise ValueError(f"unpack: bits must be in [1, 8], got {bits}")
    if bits == 8:
        return packed[:n]
    b = packed.reshape(-1)
    if b.dtype != torch.uint8:
        b = b.to(torch.uint8)
    if b.numel() >= packed_nbytes(n, bits) and _fast_ok(b, n):
        from . import fast

        return fast.unpack(b.contiguous(), bits, n)
    if 8 % bits == 0:  # 1, 2, 4: uint8 arithmetic
        m = packed_nbytes(n, bits)
        if b.numel() < m:
            b = torch.nn.functional.pad(b, (0, m - b.numel()))
        shifts = torch.arange(0, 8, bits, dtype=torch.uint8, device=b.device)
        codes = (b[:m, None] >> shifts) & ((1 << bits) - 1)
        return codes.reshape(-1)[:n]
    groups = (n + 7) // 8
    need = groups * bits
    if b.numel() < need:
        b = torch.nn.functional.pad(b, (0, need - b.numel()))
    words = torch.zeros(groups, 8, dtype=torch.uint8, device=packed.device)
    words[:, :bits] = b[:need].view(groups, bits)
    w = words.view(torch.int64)  # (groups, 1)
    codes = (w >> _shifts(bits, packed.device)) & ((1 << bits) - 1)
    return codes.reshape(-1)[:n].to(torch.uint8)
