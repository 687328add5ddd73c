"""The low-rank exchange: PowerSGD (Vogels et al. 2019), all matrices of the group batched into one all-reduce
per round (``Aggregation.LOWRANK``).

What is sent: default, P = M Q (n x r) all-reduced, orthonormalised, then Q = M^T P (m x r) all-reduced; the
result is P Q^T and Q warm-starts the next step. ``alternate=true``: one all-reduce per step, even steps reduce
P = M Q_hat (result P Q_hat^T), odd steps Q = M^T P_hat (result P_hat Q^T); the reduced factor orthonormalised
becomes the next step's basis. Biased (a rank-r approximation: error feedback on by default); exact for matrices
of rank <= r. Finiteness: read from the first all-reduced factor (a NaN/Inf in a row of M makes that row of
M Q NaN/Inf under IEEE arithmetic, Inf * 0 included).
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import TYPE_CHECKING, cast

import torch

from ..codecs.base import Aggregation, Codec
from ..codecs.lowrank import initial_q, orthonormalize_, product, transposed_product
from ..collectives import Collectives, Job
from .context import Context, all_finite, key_number, mix_seed
from .layout import flat_cat, split

if TYPE_CHECKING:
    from ..codecs.lowrank import PowerSGD


class LowRankExchange:
    """PowerSGD's rounds over the group's matrices (tensors that have a matrix shape; the others go dense)."""

    aggregation = Aggregation.LOWRANK

    def __init__(self, comm: Collectives, codec: Codec, seed: int) -> None:
        # the codec's aggregation is LOWRANK (PowerSGD, the one such codec): its rank, matrix_shape, alternate
        self.comm, self.codec, self.seed = comm, cast("PowerSGD", codec), seed
        self.check = codec.preserves_nonfinite  # finiteness read from the first all-reduced factor

    def takes(self, x: torch.Tensor) -> bool:
        return self.codec.matrix_shape(x.shape) is not None

    def _basis(self, ctx: Context, slot: str, key: Hashable, size: int, rank: int, device: torch.device,
               salt: int) -> torch.Tensor:
        """The warm-started factor for ``key``, drawn from the seed at first use (or on a rank change)."""
        cur = ctx.old(slot, key)
        if cur is None or cur.shape != (size, rank):
            fresh = initial_q(size, rank, mix_seed(self.seed, key_number(key), salt), device)
            if cur is not None and cur.shape[0] == size:
                r = min(rank, cur.shape[1])
                fresh[:, :r] = cur[:, :r]
            cur = orthonormalize_(fresh) if salt else fresh
        return cur

    def job(self, ctx: Context, keys: Sequence[Hashable], inputs: Sequence[torch.Tensor],
            outs: Sequence[torch.Tensor]) -> Job:
        # inputs: tensors that take() said have a matrix shape
        mats = [x.view(*cast("tuple[int, int]", self.codec.matrix_shape(x.shape))) for x in inputs]
        ranks = [min(self.codec.rank, *m.shape) for m in mats]
        rounds = self._alternating if self.codec.alternate else self._two_rounds
        return rounds(ctx, keys, inputs, outs, mats, ranks, self.check)

    def _two_rounds(self, ctx: Context, keys: Sequence[Hashable], inputs: Sequence[torch.Tensor],
                    outs: Sequence[torch.Tensor], mats: list[torch.Tensor], ranks: list[int], check: bool) -> Job:
        comm, dev = self.comm, mats[0].device
        qs = [self._basis(ctx, "q", k, m.shape[1], r, dev, 0) for k, m, r in zip(keys, mats, ranks)]
        ps = torch.cat([product(m, q).reshape(-1) for m, q in zip(mats, qs)])
        yield [comm.all_reduce(ps)]
        if check:
            ctx.check(all_finite(ps))
        p_hat = [orthonormalize_(p) for p in split(ps, [(m.shape[0], r) for m, r in zip(mats, ranks)])]
        q_local = [transposed_product(m, p) for m, p in zip(mats, p_hat)]
        for k, x, p, q in zip(keys, inputs, p_hat, q_local):
            ctx.transforms.delivered_product(k, x, p, q)
        q_flat = flat_cat(q_local)
        yield [comm.all_reduce(q_flat)]
        q_flat.div_(ctx.divisor)
        for k, p, q, out in zip(keys, p_hat, split(q_flat, [q.shape for q in q_local]), outs):
            torch.matmul(p, q.T, out=out.view(p.shape[0], q.shape[0]))
            ctx.put("q", k, q.clone())

    def _alternating(self, ctx: Context, keys: Sequence[Hashable], inputs: Sequence[torch.Tensor],
                     outs: Sequence[torch.Tensor], mats: list[torch.Tensor], ranks: list[int], check: bool) -> Job:
        comm, dev = self.comm, mats[0].device
        p_step = ctx.index % 2 == 0
        bases = [self._basis(ctx, "q" if p_step else "p", k, m.shape[1] if p_step else m.shape[0], r, dev,
                             1 if p_step else 2) for k, m, r in zip(keys, mats, ranks)]
        local = [product(m, b) if p_step else transposed_product(m, b) for m, b in zip(mats, bases)]
        for k, x, b, f in zip(keys, inputs, bases, local):
            ctx.transforms.delivered_product(k, x, f, b) if p_step else ctx.transforms.delivered_product(k, x, b, f)
        flat = flat_cat(local)
        yield [comm.all_reduce(flat)]
        if check:
            ctx.check(all_finite(flat))
        flat.div_(ctx.divisor)
        for k, b, f, out in zip(keys, bases, split(flat, [f.shape for f in local]), outs):
            if p_step:
                torch.matmul(f, b.T, out=out.view(f.shape[0], b.shape[0]))
                ctx.put("p", k, orthonormalize_(f.clone()))
            else:
                torch.matmul(b, f.T, out=out.view(b.shape[0], f.shape[0]))
                ctx.put("q", k, orthonormalize_(f.clone()))


__all__ = ["LowRankExchange"]
