"""Worker functions for tests/test_ddp_ratio.py (module level, so they can be pickled)."""

from __future__ import annotations

import torch
import torch.nn as nn

import gradcompress
from gradcompress.optim import DiLoCo


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 4))


def _backward(model: nn.Module, rank: int, step: int) -> None:
    g = torch.Generator().manual_seed(100 * step + rank)
    x, y = torch.randn(8, 32, generator=g), torch.randn(8, 4, generator=g)
    nn.functional.mse_loss(model(x), y).backward()


def compressor_stats(rank: int, world: int, spec: str, steps: int) -> dict:
    """``Compressor(spec).synchronize`` of the model's gradients for ``steps`` steps; its stats and the gradient bytes."""
    model = make_model()
    comp = gradcompress.Compressor(spec, warmup_steps=0)
    for step in range(steps):
        model.zero_grad()
        _backward(model, rank, step)
        comp.synchronize(model.parameters())
    st = comp.stats()
    return {"stats": {k: v for k, v in st.items() if not isinstance(v, dict)},
            "gradient_bytes": sum(p.numel() * p.element_size() for p in model.parameters())}


def diloco_stats(rank: int, world: int, codec: str, sync_every: int, steps: int) -> dict:
    """DiLoCo with SGD inside for ``steps`` steps; its stats and the model's gradient bytes."""
    model = make_model()
    opt = DiLoCo(model, torch.optim.SGD(model.parameters(), lr=0.01), sync_every=sync_every, codec=codec)
    for step in range(steps):
        opt.zero_grad()
        _backward(model, rank, step)
        opt.step()
    st = opt.stats()
    opt.close()
    return {"stats": {k: v for k, v in st.items() if not isinstance(v, dict)},
            "gradient_bytes": sum(p.numel() * p.element_size() for p in model.parameters())}
