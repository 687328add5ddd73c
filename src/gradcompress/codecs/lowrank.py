"""PowerSGD low-rank compression (``powersgd``; Vogels et al., 2019).

A gradient is viewed as a matrix M (n x m: first dimension by the rest) and sent as
the rank-``rank`` factors P (n x r) and Q (m x r) of one power-iteration step:
P = M Q, P orthonormalised, Q = M^T P, decoded as P Q^T. Wire size (n + m) * r floats
instead of n * m. Bias: biased (a projection, it drops the tail of the spectrum) and
exact for a matrix of rank <= r; use with error feedback. Tensors with fewer than two
dimensions, and those whose factors would not be at least ``min_compression_rate``
times smaller than the tensor, are sent dense.

This codec is the single-process round trip (a fresh Q drawn from the seed). The
distributed algorithm (P and Q all-reduced in two rounds, Q warm-started from the
previous step, shared by all ranks) is driven by :mod:`gradcompress.exchanges.lowrank` with the
helpers below.
"""

from __future__ import annotations

import dataclasses

import torch

from ..spec import Range, option, register_codec
from . import fast
from .base import Aggregation, Codec, Payload, check_input, fresh_seed, generator


def matrix_shape(shape: tuple[int, ...], rank: int, min_compression_rate: float) -> tuple[int, int] | None:
    """(n, m) of the matrix view, or None when the tensor is sent dense."""
    if len(shape) < 2:
        return None
    n = shape[0]
    m = 1
    for s in shape[1:]:
        m *= s
    r = min(rank, n, m)
    if n * m == 0 or (n + m) * r * min_compression_rate > n * m:
        return None
    return n, m


def orthonormalize_(p: torch.Tensor, eps: float = 1e-8) -> torch.Tensor:
    """Gram-Schmidt on the columns of ``p`` (in place), with eps against division by zero.

    Never raises on NaN/Inf (they propagate); every rank that holds the same ``p`` gets
    the same result.
    """
    for i in range(p.shape[1]):
        col = p[:, i : i + 1]
        if i:
            prev = p[:, :i]
            col -= prev @ (prev.T @ col)
            col -= prev @ (prev.T @ col)  # twice: a column (nearly) in the span of prev leaves only
            # rounding noise, which must be orthogonal to prev too (exact for matrices of rank < r)
        col /= torch.linalg.vector_norm(col) + eps
    return p


def initial_q(m: int, rank: int, seed: int, device: torch.device,
              dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """A standard normal m x rank matrix drawn from ``seed`` (the same on every rank)."""
    return torch.randn(m, rank, generator=generator(seed, device), device=device, dtype=dtype)


def transposed_product(mat: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """``mat.T @ p`` computed as ``(p.T @ mat).T`` (contiguous): the same product, but a row-major pass over
    ``mat`` (5x faster on CPU for a skinny ``p`` than BLAS's transposed path here); float32 sums in
    another order, so the last bits can differ from ``mat.T @ p``."""
    return (p.T @ mat).T.contiguous()


def product(mat: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """``mat @ q`` computed as ``(q.T @ mat.T).T`` (contiguous): for a skinny ``q`` BLAS then reads ``mat``
    row by row (3x faster on CPU here than its path for ``mat @ q``); float32 sums in another order."""
    return (q.T.contiguous() @ mat.T).T.contiguous()


@register_codec("powersgd")
@dataclasses.dataclass(frozen=True)
class PowerSGD(Codec):
    """Rank-``rank`` PowerSGD factors; see the module docstring for what is sent and when to use it."""

    uses_fast_kernels = False

    rank: int = option(1, range=Range(1, None), doc="rank of the approximation (1 to 4 are typical)")
    alternate: bool = option(False, doc="one all-reduce per step, alternating P and Q steps (Compressor)")
    min_compression_rate: float = option(2.0, range=Range(1, None), doc="send dense below this saving")
    aggregation = Aggregation.LOWRANK
    schedule_knobs = ("rank",)
    stochastic = True

    def matrix_shape(self, shape: tuple[int, ...]) -> tuple[int, int] | None:
        return matrix_shape(shape, self.rank, self.min_compression_rate)

    def payload_nbytes(self, numel: int, shape: tuple[int, ...] | None = None) -> int:
        """(n + m) * r float32 factors for an n x m ``shape``; the dense tensor where it is not compressed."""
        nm = self.matrix_shape(tuple(shape)) if shape is not None else None
        if nm is None:
            return 4 * numel
        return 4 * (nm[0] + nm[1]) * min(self.rank, *nm)

    def encode(self, x: torch.Tensor, *, seed: int | None = None) -> Payload:
        check_input(x, self.name)
        seed = fresh_seed() if seed is None else seed
        nm = self.matrix_shape(x.shape)
        if nm is None:
            return Payload((x.reshape(-1).contiguous(),), x.shape, x.dtype, seed)
        n, m = nm
        r = min(self.rank, n, m)
        mat = x.reshape(n, m).float().contiguous()  # same bits for any memory layout of x
        p = orthonormalize_(product(mat, initial_q(m, r, seed, x.device)))
        q = transposed_product(mat, p)
        return Payload((p, q), x.shape, x.dtype, seed)

    def decode(self, payload: Payload) -> torch.Tensor:
        if len(payload.tensors) == 1:
            return payload.tensors[0].to(payload.dtype).reshape(payload.shape)
        p, q = payload.tensors
        if p.dtype == torch.float32 and payload.dtype == torch.float32:
            # the product written straight into a fresh output whose memory takes huge pages (fast.empty): the
            # same values as p @ q.T; most of this decode's time was the page faults of its output
            out = fast.empty((p.shape[0], q.shape[0]), device=p.device)
            return torch.matmul(p, q.T, out=out).reshape(payload.shape)
        return (p @ q.T).to(payload.dtype).reshape(payload.shape)
