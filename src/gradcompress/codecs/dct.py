"""``dct``: the top-k coefficients of an orthonormal DCT per chunk (DeMo's extraction, Peng et al. 2024).

What is sent: per chunk, the ``topk`` largest-magnitude DCT-II coefficients (in the input's dtype, or encoded by
the ``values`` codec, e.g. ``values=bf16``) and their positions inside the chunk (uint8 for chunks of at most
256 coefficients, int16 up to 32768, else int32). Chunks:

* a tensor of two or more dims whose first dim and the product of the others are both multiples of ``chunk``
  (a weight matrix, viewed as ``shape[0] x rest``) is cut into ``chunk x chunk`` blocks, each transformed by the
  2-D DCT (``D B D^T``): ``chunk**2`` coefficients per block, as the paper does for matrices;
* any other tensor (vectors, odd shapes, flat buckets and pieces as the exchanges hand them over) is flattened
  and cut into chunks of ``chunk`` values (the last one zero-padded), each transformed by the 1-D DCT.

So with the paper's defaults (chunk 64, topk 32) a 64-divisible matrix sends 32 of every 4096 coefficients
(0.8 %: 32 x (4 + 2) bytes per 16 KB of float32), a vector 32 of every 64 (50 %).

Bias: biased and a contraction (the DCT is orthonormal, so the energy left out is that of the dropped
coefficients, at most ``1 - k/block`` of the chunk's): use it with error feedback, or as DeMo does with the
momentum as the error-feedback buffer (:class:`gradcompress.optim.DeMo`). With ``topk`` at least the chunk's
coefficient count everything is kept and ``decode(encode(x))`` is ``x`` up to floating-point rounding.
Deterministic (no seed), so two encodes of the same tensor give the same payload. When to use it: DeMo; as a
plain gradient sparsifier it is top-k in a basis where smooth (low-frequency) structure is concentrated.

Aggregation: gathered (positions differ per rank); every rank's coefficients of a tensor are added in DCT space
and transformed back once (one inverse DCT per tensor, not one per rank).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Sequence
from typing import cast

import torch

from ..spec import Range, option, register_codec
from .base import Aggregation, Codec, Payload, check_input, in_range


@functools.lru_cache(maxsize=64)
def dct_matrix(n: int, dtype: torch.dtype = torch.float32, device: torch.device | None = None) -> torch.Tensor:
    """The orthonormal DCT-II matrix D (``D @ x`` transforms a column of n values; ``D.T`` inverts it), computed in
    float64 and rounded once. A constant, cached per (n, dtype, device)."""
    k = torch.arange(n, dtype=torch.float64).unsqueeze(1)
    i = torch.arange(n, dtype=torch.float64).unsqueeze(0)
    d = torch.cos(math.pi * (2 * i + 1) * k / (2 * n)) * math.sqrt(2.0 / n)
    d[0] /= math.sqrt(2.0)
    return d.to(dtype=dtype, device=device)


def index_dtype(block: int) -> torch.dtype:
    """The smallest integer dtype that holds a position inside a chunk of ``block`` coefficients."""
    return torch.uint8 if block <= 256 else torch.int16 if block <= 32768 else torch.int32


@dataclasses.dataclass(frozen=True)
class ChunkLayout:
    """How a tensor of ``shape`` is cut: ``blocks`` chunks of ``block`` coefficients each; ``rows``/``cols`` the
    matrix view in 2-D mode (``cols`` 0 in 1-D mode); ``side`` the chunk's side."""

    numel: int
    side: int
    rows: int
    cols: int

    @staticmethod
    def of(shape: Sequence[int], chunk: int) -> ChunkLayout:
        numel = math.prod(shape)
        rows = shape[0] if len(shape) >= 2 else 0
        cols = numel // rows if rows else 0
        if chunk > 1 and rows and rows % chunk == 0 and cols % chunk == 0:
            return ChunkLayout(numel, chunk, rows, cols)
        return ChunkLayout(numel, chunk, 0, 0)

    @property
    def two_d(self) -> bool:
        return self.cols > 0

    @property
    def block(self) -> int:
        return self.side * self.side if self.two_d else self.side

    @property
    def blocks(self) -> int:
        return self.numel // self.block if self.two_d else -(-self.numel // self.side)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """(blocks, block) DCT coefficients of ``x`` (any shape with this layout's numel), in ``x``'s float dtype."""
        c = self.side
        d = dct_matrix(c, x.dtype, x.device)
        if self.two_d:
            b = x.reshape(self.rows // c, c, self.cols // c, c).transpose(1, 2)  # (R, C, c, c) blocks
            return (d @ b @ d.T).reshape(self.blocks, self.block)
        flat = x.reshape(-1)
        pad = self.blocks * c - self.numel
        if pad:
            flat = torch.nn.functional.pad(flat, (0, pad))
        return flat.view(self.blocks, c) @ d.T

    def inverse(self, coeffs: torch.Tensor) -> torch.Tensor:
        """The flat tensor (``numel`` values) whose DCT coefficients are ``coeffs`` (blocks, block)."""
        c = self.side
        d = dct_matrix(c, coeffs.dtype, coeffs.device)
        if self.two_d:
            b = d.T @ coeffs.view(self.rows // c, self.cols // c, c, c) @ d  # (R, C, c, c)
            return b.transpose(1, 2).reshape(-1)
        return (coeffs @ d).reshape(-1)[: self.numel]


def _work_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


@register_codec("dct")
@dataclasses.dataclass(frozen=True)
class ChunkedDCTTopK(Codec):
    """Per chunk, the ``topk`` largest DCT coefficients and their positions (see the module documentation).

    Options: ``chunk`` (the chunk's side: 64 in DeMo, 2-D blocks of 64 x 64 for divisible matrices), ``topk``
    (coefficients kept per chunk: DeMo's 32; capped at the chunk's coefficient count), ``values`` (a codec for the
    kept values, e.g. ``bf16``; default: as they are).
    """

    chunk: int = option(64, range=Range(1, 4096), doc="chunk side (2-D blocks chunk x chunk for divisible matrices)")
    topk: int = option(32, range=Range(1, None), doc="DCT coefficients kept per chunk")
    values: Codec | None = option(None, doc="codec for the kept values (e.g. bf16); default: as they are")
    aggregation = Aggregation.GATHER
    gathers_stacked = True
    uses_fast_kernels = False

    def layout(self, shape: Sequence[int]) -> ChunkLayout:
        return ChunkLayout.of(tuple(shape), self.chunk)

    def kept_per_chunk(self, layout: ChunkLayout) -> int:
        return min(self.topk, layout.block)

    def payload_nbytes(self, numel: int, shape: tuple[int, ...] | None = None) -> int:
        """blocks x k x (value bytes + position bytes), k = min(topk, coefficients per chunk); float32 values."""
        if not numel:
            return 0
        lay = self.layout(shape if shape is not None else (numel,))
        kept = lay.blocks * self.kept_per_chunk(lay)
        values = 4 * kept if self.values is None else self.values.payload_nbytes(kept)
        return values + kept * index_dtype(lay.block).itemsize

    # ----------------------------------------------------------------- encode / decode
    def encode(self, x: torch.Tensor, *, seed: int | None = None) -> Payload:
        check_input(x, self.name)
        if x.numel() == 0:
            return Payload((), x.shape, x.dtype, seed, x.device)
        lay = self.layout(x.shape)
        coeffs = lay.forward(x.detach().to(_work_dtype(x.dtype)))
        k = self.kept_per_chunk(lay)
        idx = torch.topk(coeffs.abs(), k, dim=1, sorted=True).indices  # (sorted: 6x faster on CPU here)
        vals = coeffs.gather(1, idx).reshape(-1).to(x.dtype)
        head = (vals,) if self.values is None else self.values.encode(vals, seed=seed).tensors
        return Payload((*head, idx.reshape(-1).to(index_dtype(lay.block))), x.shape, x.dtype, seed, x.device)

    def kept(self, payload: Payload) -> tuple[torch.Tensor, torch.Tensor]:
        """(int64 positions into the (blocks x block) coefficient array, float values) of a payload."""
        *head, idx = payload.tensors
        lay = self.layout(payload.shape)
        k = self.kept_per_chunk(lay)
        work = _work_dtype(payload.dtype)
        if self.values is None:
            vals = head[0].to(work)
        else:
            vals = self.values.decode(Payload(tuple(head), torch.Size([idx.numel()]), torch.float32,
                                              payload.seed)).to(work)
        base = torch.arange(lay.blocks, device=idx.device).repeat_interleave(k) * lay.block
        return base + idx.long().reshape(-1), vals.reshape(-1)

    def decode(self, payload: Payload) -> torch.Tensor:
        if payload.numel == 0:
            return torch.zeros(payload.shape, dtype=payload.dtype, device=payload.device)
        lay = self.layout(payload.shape)
        pos, vals = self.kept(payload)
        coeffs = torch.zeros(lay.blocks * lay.block, dtype=vals.dtype, device=vals.device)
        coeffs.index_copy_(0, pos, vals)
        return lay.inverse(coeffs.view(lay.blocks, lay.block)).to(payload.dtype).reshape(payload.shape)

    def accumulate_into(self, payload: Payload, out: torch.Tensor) -> torch.Tensor | None:
        """``out += decode(payload)`` for a payload received from a peer: its positions checked first
        (:func:`~.base.in_range`); returns whether they were all in range."""
        if payload.numel == 0:
            return None
        lay = self.layout(payload.shape)
        pos, vals, valid = in_range(*self.kept(payload), lay.blocks * lay.block)
        coeffs = torch.zeros(lay.blocks * lay.block, dtype=vals.dtype, device=vals.device)
        coeffs.index_copy_(0, pos, vals)
        out.view(-1).add_(lay.inverse(coeffs.view(lay.blocks, lay.block)).to(out.dtype).reshape(-1))
        return valid

    def accumulate_gathered(self, payload: Payload, parts: Sequence[torch.Tensor], out: torch.Tensor,
                            world: int | None = None) -> torch.Tensor | None:
        """Every rank's coefficients of one tensor added in DCT space (rank order), divided by ``world`` when
        given, and transformed back once into ``out`` (zero before): the mean of the ranks' decodes. Returns
        whether each rank's positions were in range (the others add nothing)."""
        if payload.numel == 0:
            return None
        lay = self.layout(payload.shape)
        ranks = parts[-1].shape[0]
        coeffs: torch.Tensor | None = None
        valid = []
        for r in range(ranks):
            pos, vals, ok = in_range(*self.kept(payload.replace(tuple(q[r] for q in parts))), lay.blocks * lay.block)
            valid.append(ok)
            if coeffs is None:
                coeffs = torch.zeros(lay.blocks * lay.block, dtype=vals.dtype, device=vals.device)
            coeffs.index_add_(0, pos, vals)
        coeffs = cast(torch.Tensor, coeffs)  # gathered from every rank: at least one
        if world is not None:
            coeffs.div_(world)
        out.view(-1).add_(lay.inverse(coeffs.view(lay.blocks, lay.block)).to(out.dtype).reshape(-1))
        return torch.stack(valid)


__all__ = ["ChunkLayout", "ChunkedDCTTopK", "dct_matrix", "index_dtype"]
