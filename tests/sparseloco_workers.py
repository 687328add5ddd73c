"""Worker functions for tests/test_sparseloco.py (DiLoCo with outer="sparseloco" on real gloo workers)."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn

from gradcompress import make
from gradcompress.optim import DiLoCo
from workers import batch, make_model

CODEC = "topk:ratio=0.05,chunk=256,values=int2"  # several chunks per tensor, a shorter last chunk


def _inner_steps(model, opt, rank, start, h):
    for step in range(start, start + h):
        x, y = batch(rank, step)
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        opt.inner.step()  # the inner optimizer alone: the test calls sync() itself


def _gathered(t: torch.Tensor, world: int) -> list[torch.Tensor]:
    everyone = [torch.empty_like(t) for _ in range(world)]
    dist.all_gather(everyone, t.contiguous())
    return everyone


def _flat(tensors) -> torch.Tensor:
    return torch.cat([t.detach().reshape(-1).float() for t in tensors])


def invariants(rank, world, decay, syncs=4, h=3, codec=CODEC, outer_lr=0.8):
    """Per sync: what this rank delivered (read off its residuals: decay * e + delta - e_new) against its own
    encode of that input, the average of the workers' deliveries against the anchor's move, and the replicas.
    Returns per-sync records and the cumulative sums for the error-feedback invariant."""
    model = make_model()
    opt = DiLoCo(model, torch.optim.AdamW(model.parameters(), lr=1e-2), sync_every=10**6, outer="sparseloco",
                 codec=codec, outer_lr=outer_lr, error_decay=decay)
    c = make(codec)
    n = len(opt.params)
    residual = [torch.zeros_like(p, dtype=torch.float32) for p in opt.params]
    sum_delta = [torch.zeros_like(r) for r in residual]
    sum_delivered = [torch.zeros_like(r) for r in residual]
    records = []
    for s in range(syncs):
        _inner_steps(model, opt, rank, s * h, h)
        delta = [(a - p).detach().float() for a, p in zip(opt.anchor, opt.params)]
        anchor_before = [a.detach().clone() for a in opt.anchor]
        fed = [decay * r + d for r, d in zip(residual, delta)]
        finite = opt.sync()
        new_residual = [opt.compressor.residual[k].detach().float().clone() for k in range(n)]
        delivered = [f - r for f, r in zip(fed, new_residual)]
        mine = [c.decode(c.encode(f, seed=0)) for f in fed]  # this rank's own encode of e, done here
        mean_delivered = sum(_gathered(_flat(delivered), world)) / world
        moved = _flat([(b - a) / outer_lr for b, a in zip(anchor_before, opt.anchor)])
        params = _gathered(_flat(opt.params), world)
        records.append({
            "finite": finite,
            "own_encode_err": max(float((d - m).abs().max()) for d, m in zip(delivered, mine)),
            "kept": [int((m != 0).sum()) for m in mine],
            "mean_vs_anchor_move": float((mean_delivered - moved).abs().max()),
            "moved": float(moved.abs().max()),
            "replicas_equal": all(torch.equal(params[0], q) for q in params),
            "params_are_anchor": all(torch.equal(p, a) for p, a in zip(opt.params, opt.anchor)),
        })
        for i in range(n):
            sum_delta[i] = decay * sum_delta[i] + delta[i]
            sum_delivered[i] = decay * sum_delivered[i] + delivered[i]
        residual = new_residual
    invariant = max(float((sd + r - sd_).abs().max()) for sd, r, sd_ in zip(sum_delivered, residual, sum_delta))
    scale = max(float(sd.abs().max()) for sd in sum_delta)
    numels = [p.numel() for p in opt.params]
    return records, invariant, scale, numels, opt.stats()


def resume(rank, world, path, steps=8, cut=5, h=3):
    """A run of ``steps`` against one saved at ``cut`` (mid-interval) and resumed by a fresh DiLoCo."""
    def build():
        model = make_model()
        inner = torch.optim.AdamW(model.parameters(), lr=1e-2)
        return model, DiLoCo(model, inner, sync_every=h, outer="sparseloco", codec=CODEC)

    def train(model, opt, start, stop):
        for step in range(start, stop):
            x, y = batch(rank, step)
            opt.zero_grad()
            nn.functional.cross_entropy(model(x), y).backward()
            opt.step()

    model, opt = build()
    train(model, opt, 0, steps)
    full = [p.detach().clone() for p in model.parameters()]
    model, opt = build()
    train(model, opt, 0, cut)
    torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, f"{path}.{rank}")
    model, opt = build()
    state = torch.load(f"{path}.{rank}", weights_only=True)
    model.load_state_dict(state["model"])
    opt.load_state_dict(state["opt"])
    train(model, opt, cut, steps)
    resumed = [p.detach().clone() for p in model.parameters()]
    nesterov = DiLoCo(make_model(), torch.optim.AdamW(model.parameters()), sync_every=h)
    try:
        nesterov.load_state_dict(state["opt"])
        mismatch = "no error"
    except ValueError as err:
        mismatch = str(err)
    dist.barrier()
    return full, resumed, opt.stats(), mismatch
