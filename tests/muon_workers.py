"""Worker functions for tests/test_muon.py (gradcompress.optim.muon under DDP and inside DiLoCo, on gloo)."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn

import gradcompress
from gradcompress.optim import DiLoCo, muon
from workers import batch, make_model


def _flat(tensors) -> torch.Tensor:
    return torch.cat([t.detach().reshape(-1).float() for t in tensors])


def _equal_everywhere(t: torch.Tensor, world: int) -> bool:
    everyone = [torch.empty_like(t) for _ in range(world)]
    dist.all_gather(everyone, t)
    return all(torch.equal(everyone[0], e) for e in everyone)


def under_ddp(rank, world, codec, steps=4):
    """DDP (``codec`` None) or DDP with our hook, Muon + AdamW stepping: replicas equal after every step; the
    parameters move."""
    model = make_model()
    start = _flat(model.parameters())
    ddp = nn.parallel.DistributedDataParallel(model)
    if codec is not None:
        gradcompress.register_ddp_hook(ddp, codec)
    opt = muon(model, adamw_lr=1e-2)
    equal = []
    for step in range(steps):
        x, y = batch(rank, step)
        opt.zero_grad()
        nn.functional.cross_entropy(ddp(x), y).backward()
        opt.step()
        equal.append(_equal_everywhere(_flat(model.parameters()), world))
    return equal, float((_flat(model.parameters()) - start).abs().max())


def diloco_replicas(rank, world, steps=6, h=3, codec="int2"):
    """MuLoCo: DiLoCo over Muon with int2 outer gradients: replicas equal after every sync, apart between."""
    model = make_model()
    opt = DiLoCo(model, muon(model, adamw_lr=1e-2), sync_every=h, codec=codec)
    equal = []
    for step in range(steps):
        x, y = batch(rank, step)
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        equal.append(_equal_everywhere(_flat(model.parameters()), world))
    return equal, opt.stats(), sorted(opt.compressor.residual.keys())


def diloco_error_feedback(rank, world, syncs=4, h=3):
    """One worker, outer SGD lr 1 without momentum (the anchor moves by minus what the codec delivered): per sync
    the outer delta fed to int2 (delta + residual), the residual after it; the sums for the invariant."""
    model = make_model()
    opt = DiLoCo(model, muon(model, adamw_lr=1e-2), sync_every=10**6, codec="int2",
                 outer_lr=1.0, outer_momentum=0.0)
    n = len(opt.params)
    residual = [torch.zeros_like(p) for p in opt.params]
    sum_delta = [torch.zeros_like(p) for p in opt.params]
    sum_delivered = [torch.zeros_like(p) for p in opt.params]
    contraction = []
    for s in range(syncs):
        for step in range(s * h, (s + 1) * h):
            x, y = batch(rank, step)
            opt.zero_grad()
            nn.functional.cross_entropy(model(x), y).backward()
            opt.inner.step()
        delta = [(a - p).detach().clone() for a, p in zip(opt.anchor, opt.params)]
        before = [a.detach().clone() for a in opt.anchor]
        assert opt.sync()
        new = [opt.compressor.residual[k].float().clone() if k in opt.compressor.residual
               else torch.zeros_like(delta[k]) for k in range(n)]
        fed = [d + r for d, r in zip(delta, residual)]
        contraction.append(max(float(e.norm() / f.norm()) for e, f, p in zip(new, fed, opt.params)
                               if p.numel() >= 1024))
        for i in range(n):
            sum_delta[i] += delta[i]
            sum_delivered[i] += before[i] - opt.anchor[i]
        residual = new
    gap = max(float((d + r - t).abs().max()) for d, r, t in zip(sum_delivered, residual, sum_delta))
    scale = max(float(t.abs().max()) for t in sum_delta)
    return gap, scale, contraction, max(float(r.abs().max()) for r in residual)
