"""Worker functions for tests/test_diloco.py."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn

from gradcompress.optim import DiLoCo, muon
from workers import batch, make_model


def equals_ddp(rank, world, steps=4):
    """Plain SGD inside, H=1, codec none, outer lr 1, no outer momentum: the parameters after every step
    against DDP with the same SGD."""
    ref = make_model()
    ddp = nn.parallel.DistributedDataParallel(ref)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    torch.manual_seed(rank)  # DiLoCo must start from rank 0's parameters whatever each rank built
    model = make_model(seed=rank)
    opt = DiLoCo(model, torch.optim.SGD(model.parameters(), lr=0.1), sync_every=1, outer_lr=1.0,
                 outer_momentum=0.0)
    diffs = []
    for step in range(steps):
        x, y = batch(rank, step)
        ref_opt.zero_grad()
        nn.functional.cross_entropy(ddp(x), y).backward()
        ref_opt.step()
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        diffs.append(max(float((a - b).abs().max()) for a, b in zip(ref.parameters(), model.parameters())))
    return diffs


def replicas(rank, world, codec, steps=6, h=3):
    """After every sync all ranks hold the same parameters; between syncs they differ."""
    model = make_model()
    opt = DiLoCo(model, torch.optim.AdamW(model.parameters(), lr=1e-2), sync_every=h, codec=codec)
    out = []
    for step in range(steps):
        x, y = batch(rank, step)
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        mine = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
        everyone = [torch.empty_like(mine) for _ in range(world)]
        dist.all_gather(everyone, mine)
        out.append(all(torch.equal(everyone[0], e) for e in everyone))
    return out, opt.stats()


def resume(rank, world, codec, path, steps=8, cut=5, h=3, inner="adamw"):
    """A run of ``steps`` against one that saves at ``cut`` (mid-interval) and a fresh one that resumes; ``inner``:
    AdamW or ``"muon"`` (:func:`gradcompress.optim.muon`, one lr for both parts)."""
    def build():
        model = make_model()
        inner_opt = muon(model, adamw_lr=1e-2) if inner == "muon" else torch.optim.AdamW(model.parameters(), lr=1e-2)
        sched = torch.optim.lr_scheduler.StepLR(inner_opt, step_size=2, gamma=0.5)
        return model, DiLoCo(model, inner_opt, sync_every=h, codec=codec), sched

    def train(model, opt, sched, start, stop):
        for step in range(start, stop):
            x, y = batch(rank, step)
            opt.zero_grad()
            nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
            sched.step()

    model, opt, sched = build()
    train(model, opt, sched, 0, steps)
    full = [p.detach().clone() for p in model.parameters()]
    model, opt, sched = build()
    train(model, opt, sched, 0, cut)
    torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "sched": sched.state_dict()}, f"{path}.{rank}")
    model, opt, sched = build()
    state = torch.load(f"{path}.{rank}", weights_only=True)
    model.load_state_dict(state["model"])
    opt.load_state_dict(state["opt"])
    sched.load_state_dict(state["sched"])
    train(model, opt, sched, cut, steps)
    return full, [p.detach().clone() for p in model.parameters()], opt.stats()


def wire_bytes(rank, world, codecs, h=2, syncs=3):
    out = {}
    for codec in codecs:
        model = make_model()
        opt = DiLoCo(model, torch.optim.SGD(model.parameters(), lr=0.05), sync_every=h, codec=codec)
        for step in range(h * syncs):
            x, y = batch(rank, step)
            opt.zero_grad()
            nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
        out[codec] = opt.stats(), [tuple(p.shape) for p in model.parameters()]
    return out


def bad_arguments(rank, world):
    out = {}
    model = make_model()
    for name, kwargs in (("sync_every", {"sync_every": 0}), ("codec", {"sync_every": 2, "codec": "int9"})):
        try:
            DiLoCo(model, torch.optim.SGD(model.parameters(), lr=0.1), **kwargs)
            out[name] = "no error"
        except ValueError as err:
            out[name] = str(err)
    try:
        DiLoCo(nn.parallel.DistributedDataParallel(model), torch.optim.SGD(model.parameters(), lr=0.1), sync_every=2)
        out["ddp"] = "no error"
    except ValueError as err:
        out["ddp"] = str(err)
    dist.barrier()
    return out
