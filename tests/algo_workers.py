"""Worker functions for the PowerSGD / DGC / schedule tests."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn

import gradcompress
from gradcompress.codecs.lowrank import initial_q, orthonormalize_
from gradcompress.step import mix_seed


def powersgd_low_rank(rank, world, r, steps=3):
    """Gradients whose average has rank <= r (shared column space): PowerSGD must be exact.

    Also returns PowerSGD of the averaged gradient computed by hand with the same first Q
    (linearity / shared Q) for the first step. Error feedback is off: exactness is a property
    of one compression; with it on, float32 rounding left in the residual makes the next
    input full-rank (the feedback invariant is tested in test_exchange).
    """
    shapes = [(64, 48), (30, 20, 3)]  # a matrix and a conv-like tensor (viewed 30 x 60)
    params = [nn.Parameter(torch.zeros(s)) for s in shapes]
    comp = gradcompress.Compressor(f"powersgd:rank={r}", min_numel=0, error_feedback=False)
    shared = torch.Generator().manual_seed(123)
    bases = [torch.randn(s[0], r, generator=shared) for s in shapes]
    own = torch.Generator().manual_seed(1000 + rank)
    out = []
    for step in range(steps):
        inputs = []
        for p, a in zip(params, bases):
            m = p.shape[0]
            rest = p.numel() // m
            coeff = torch.randn(rest, r, generator=own)
            p.grad = (a @ coeff.T).reshape(p.shape)
            inputs.append(p.grad.clone())
        averaged = [g.clone() for g in inputs]
        for g in averaged:
            dist.all_reduce(g)
            g /= world
        reference = None
        if step == 0:
            reference = []
            for k, g in enumerate(averaged):
                mat = g.reshape(g.shape[0], -1)
                q = initial_q(mat.shape[1], r, mix_seed(0, k, 0), mat.device)
                p_hat = orthonormalize_(mat @ q)
                reference.append((p_hat @ (mat.T @ p_hat).T).reshape(g.shape))
        comp.synchronize(params)
        out.append({"result": [p.grad.clone() for p in params], "averaged": averaged, "reference": reference})
    return out


def powersgd_many_buckets(rank, world, specs):
    """PowerSGD through the DDP hook with one bucket per tensor: must not deadlock."""
    from workers import ddp_steps

    return {spec: ddp_steps(rank, world, spec, steps=4, bucket_cap_mb=0.001, options={"min_numel": 0})
            for spec in specs}


def dgc_vs_sgd_momentum(rank, world, steps=6):
    """One worker, ratio 1.0, momentum correction on, masking and clipping off == SGD with momentum."""
    from workers import batch, make_model

    model_a, model_b = make_model(), make_model()
    comp = gradcompress.Compressor("dgc:ratio=1.0,momentum=0.9,masking=false", min_numel=256)
    opt_a = torch.optim.SGD(model_a.parameters(), lr=0.1)  # DGC: momentum lives in the compressor
    opt_b = torch.optim.SGD(model_b.parameters(), lr=0.1, momentum=0.9)
    for step in range(steps):
        x, y = batch(rank, step)
        for model, opt in ((model_a, opt_a), (model_b, opt_b)):
            opt.zero_grad()
            nn.functional.cross_entropy(model(x), y).backward()
        comp.synchronize(model_a.parameters())
        opt_a.step()
        opt_b.step()
    return [p.detach().clone() for p in model_a.parameters()], [p.detach().clone() for p in model_b.parameters()]


def dgc_density_trace(rank, world, warmup, steps):
    """Fraction of elements each step actually sends under DGC's sparsity warm-up."""
    p = nn.Parameter(torch.zeros(100_000))
    comp = gradcompress.Compressor(f"dgc:ratio=0.001,warmup_steps={warmup},momentum=0", min_numel=0)
    g = torch.Generator().manual_seed(0)
    densities = []
    for _ in range(steps):
        p.grad = torch.randn(p.shape, generator=g)
        comp.synchronize([p])
        densities.append(float((p.grad != 0).float().mean()))
    return densities
