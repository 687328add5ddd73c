"""Worker functions for the multi-process tests (module level, so they can be pickled)."""

from __future__ import annotations

import io

import torch
import torch.distributed as dist
import torch.nn as nn

import gradcompress


def make_model(seed: int = 0) -> nn.Module:
    """A small MLP with tensors above and below min_numel (several DDP buckets at small bucket_cap_mb)."""
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 48), nn.ReLU(), nn.Linear(48, 10))


def batch(rank: int, step: int, n: int = 16):
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(n, 32, generator=g), torch.randint(0, 10, (n,), generator=g)


def ddp_steps(rank, world, spec, steps=3, bucket_cap_mb=0.01, options=None, mode="hook", lr=0.05):
    """Train ``steps`` steps; return per-step averaged grads (list of lists) and final params."""
    options = dict(options or {"min_numel": 256})
    model = make_model()
    if mode == "ddp_default":
        ddp = nn.parallel.DistributedDataParallel(model, bucket_cap_mb=bucket_cap_mb)
        comp = None
    elif mode == "hook":
        ddp = nn.parallel.DistributedDataParallel(model, bucket_cap_mb=bucket_cap_mb)
        comp = gradcompress.register_ddp_hook(ddp, spec, **options)
    else:  # synchronize
        ddp = model
        comp = gradcompress.Compressor(spec, **options)
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    grads = []
    for step in range(steps):
        x, y = batch(rank, step)
        opt.zero_grad()
        nn.functional.cross_entropy(ddp(x), y).backward()
        if mode == "synchronize":
            comp.synchronize(model.parameters())
        grads.append([p.grad.clone() for p in model.parameters()])
        opt.step()
    return {"grads": grads, "params": [p.detach().clone() for p in model.parameters()],
            "stats": comp.stats() if comp else None}
