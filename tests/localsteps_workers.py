"""Worker functions for tests/test_local_steps.py (CompressedAdam/OneBitAdam with sync_every > 1, gloo)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from gradcompress.optim import CompressedAdam, OneBitAdam
from onebit_workers import backward, flat, make_model

LR = 1e-2


def _same_everywhere(t: torch.Tensor, world: int) -> bool:
    everyone = [torch.empty_like(t) for _ in range(world)]
    dist.all_gather(everyone, t)
    return all(torch.equal(everyone[0], e) for e in everyone)


def _run(rank, world, steps, **kwargs):
    """Per step: (bytes this rank sent, whether every rank holds the same parameters afterwards)."""
    model = make_model()
    codec = kwargs.pop("codec", None)
    opt = (CompressedAdam(model.parameters(), lr=LR, codec=codec, **kwargs) if codec
           else OneBitAdam(model.parameters(), lr=LR, **kwargs))
    record = []
    for step in range(steps):
        before = opt.bytes_sent()
        opt.zero_grad()
        backward(model, rank, step)
        opt.step()
        record.append((opt.bytes_sent() - before, _same_everywhere(flat(model), world)))
    return model, opt, record


def schedule(rank, world, warmup, steps, every, ramp):
    """Local steps against a run without the option (same data): the sync pattern, bytes and replicas."""
    _, opt, local = _run(rank, world, steps, warmup_steps=warmup, sync_every=every, sync_ramp_steps=ramp)
    _, _, plain = _run(rank, world, steps, warmup_steps=warmup)
    synced = [sent > 0 for sent, _ in local]
    pattern_everywhere = [None] * world
    dist.all_gather_object(pattern_everywhere, synced)
    return {"local": local, "plain": plain, "patterns": pattern_everywhere, "stats": opt.stats()}


def every_step_is_today(rank, world, warmup, steps):
    """sync_every=1 (also with a ramp) against a run without the option: parameters and state bit for bit."""
    out = {}
    for codec in (None, "topk:ratio=0.05"):
        extra = {} if codec is None else {"codec": codec}
        base_model, base, _ = _run(rank, world, steps, warmup_steps=warmup, **extra)
        for options in ({"sync_every": 1}, {"sync_every": 1, "sync_ramp_steps": 2}):
            model, opt, _ = _run(rank, world, steps, warmup_steps=warmup, **extra, **options)
            same_params = torch.equal(flat(base_model), flat(model))
            a, b = base.state_dict()["state"], opt.state_dict()["state"]
            same_state = a.keys() == b.keys() and all(
                a[k].keys() == b[k].keys() and all(torch.equal(a[k][n], b[k][n]) for n in a[k]) for k in a)
            out[f"{codec}/{sorted(options.items())}"] = (same_params, same_state, opt.bytes_sent() == base.bytes_sent())
    return out


def resume(rank, world, path, warmup=3, steps=12, cut=7, every=3):
    """A run of ``steps`` against one saved after ``cut`` (between two syncs: anchors in the state) and resumed."""
    def build():
        model = make_model()
        return model, OneBitAdam(model.parameters(), lr=LR, warmup_steps=warmup, sync_every=every)

    def train(model, opt, first, last):
        for step in range(first, last):
            opt.zero_grad()
            backward(model, rank, step)
            opt.step()

    model, opt = build()
    train(model, opt, 0, steps)
    full = flat(model)
    model, opt = build()
    train(model, opt, 0, cut)
    in_state = sorted(next(iter(opt.state.values())).keys())
    torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, f"{path}.{rank}")
    model, opt = build()
    saved = torch.load(f"{path}.{rank}", weights_only=True)
    model.load_state_dict(saved["model"])
    opt.load_state_dict(saved["opt"])
    train(model, opt, cut, steps)
    return full, flat(model), in_state


def two_worker_checks(rank, world, path):
    """One launch for the 2-worker checks: the growing schedule, sync_every=1 = today, resume."""
    return {"ramp": schedule(rank, world, 2, 22, 8, 3), "today": every_step_is_today(rank, world, 3, 8),
            "resume": resume(rank, world, path)}
