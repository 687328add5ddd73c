"""Worker functions for tests/test_streaming.py (streaming DiLoCo on a gloo group)."""

from __future__ import annotations


import torch
import torch.distributed as dist
import torch.nn as nn

from gradcompress.optim import DiLoCo
from workers import batch


def square_model(seed: int = 0) -> nn.Module:
    """Four equal layers (32x32 + 32 each): four equal fragments."""
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(),
                         nn.Linear(32, 32))


def _loss(model, rank, step):
    x, y = batch(rank, step)
    return nn.functional.cross_entropy(model(x), y)


def _gathered_equal(tensors) -> bool:
    mine = torch.cat([t.detach().reshape(-1) for t in tensors])
    everyone = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(everyone, mine)
    return all(torch.equal(everyone[0], e) for e in everyone)


def schedule(rank, world, codec="int8", fragments=4, delay=2, steps=40, h=8, inner="adamw"):
    """Per step: which fragments were applied (local == anchor right after, mix 1), whether every rank's anchors
    and applied fragments agree; the stats."""
    model = square_model()
    opt_cls = torch.optim.AdamW if inner == "adamw" else torch.optim.SGD
    opt = DiLoCo(model, opt_cls(model.parameters(), lr=1e-2), sync_every=h, codec=codec, fragments=fragments,
                 delay=delay, mix=1.0)
    log = []
    for step in range(steps):
        opt.zero_grad()
        _loss(model, rank, step).backward()
        before = opt.syncs
        opt.step()
        applied = [f for f, keys in enumerate(opt.parts)
                   if all(torch.equal(opt.params[i], opt.anchor[i]) for i in keys)] if opt.syncs > before else []
        agree = _gathered_equal(opt.anchor) and all(
            _gathered_equal([opt.params[i] for i in opt.parts[f]]) for f in applied)
        log.append({"step": opt.inner_steps, "applied": applied, "agree": agree})
    stats = opt.stats()
    opt.close()
    return log, stats, opt.sync_bytes, [len(p) for p in opt.parts]


def first_fragment_update(rank, world, fragments):
    """codec none, plain SGD inside, delay 0: the anchors after step H (fragment 0's first sync only)."""
    model = square_model()
    opt = DiLoCo(model, torch.optim.SGD(model.parameters(), lr=0.05), sync_every=4, fragments=fragments)
    for step in range(4):
        opt.zero_grad()
        _loss(model, rank, step).backward()
        opt.step()
    return [a.detach().clone() for a in opt.anchor], opt.parts


def slow_worker(rank, world, steps=24, h=8, fragments=2, delay=3):
    """Ordered by events, not timed: rank 1 holds back its first inner step until rank 0 has completed every step
    before its first apply step (fragment 0 is first sent after step ``h`` and applied ``delay`` steps later),
    which rank 0 can only do if its sends and ordinary steps never wait for rank 1. Returns, per rank, each step's
    ``(inner step, applied an update)``, whether rank 0 got that far alone (rank 1's view; True on rank 0) and
    the stats."""
    from datetime import timedelta

    store = dist.distributed_c10d._get_default_store()
    first_apply = h + delay  # streaming.due: fragment f at k*h + f*h // fragments, k >= 1
    model = square_model()
    opt = DiLoCo(model, torch.optim.SGD(model.parameters(), lr=0.05), sync_every=h, codec="int4",
                 fragments=fragments, delay=delay)
    steps_done, alone = [], True
    for step in range(steps):
        if rank == 1 and step == 0:
            try:
                store.wait(["slow_worker/fast_ready"], timedelta(seconds=60))
            except Exception:  # rank 0 never got there: it waited for this rank in an ordinary step
                alone = False
        opt.zero_grad()
        _loss(model, rank, step).backward()
        before = opt.syncs
        opt.step()
        steps_done.append((opt.inner_steps, opt.syncs > before))
        if rank == 0 and opt.inner_steps == first_apply - 1:
            store.set("slow_worker/fast_ready", "1")
    stats = opt.stats()
    opt.close()
    return steps_done, alone, stats


def inf_in_one_fragment(rank, world, h=8):
    """Rank 1 puts an Inf into a parameter of fragment 2 just before its first send: that update is skipped on
    every rank, the other fragments' are applied (delay 0: the poisoned parameter is reset to its anchor at once;
    with a delay it would poison rank 1's next inner steps, and with them every fragment)."""
    model = square_model()
    opt = DiLoCo(model, torch.optim.SGD(model.parameters(), lr=0.05), sync_every=h, codec="int8", fragments=4,
                 delay=0)
    anchors_before = None
    send = h + 2 * h // 4  # fragment 2's first send
    for step in range(2 * h):
        opt.zero_grad()
        _loss(model, rank, step).backward()
        if opt.inner_steps + 1 == send:
            anchors_before = [opt.anchor[i].clone() for i in opt.parts[2]]
            if rank == 1:
                opt.inner.step = _poisoned(opt.inner.step, opt.params[opt.parts[2][0]])
        opt.step()
    unchanged = [torch.equal(a, opt.anchor[i]) for a, i in zip(anchors_before, opt.parts[2])]
    finite = all(torch.isfinite(p).all() for p in model.parameters())
    stats = opt.stats()
    opt.close()
    return stats["skipped"], unchanged, finite, _gathered_equal(opt.anchor), stats["syncs"]


def _poisoned(step, param):
    """The inner optimizer's step, which once (the next call) leaves an Inf in ``param``."""
    calls = []

    def once(*args, **kwargs):
        out = step(*args, **kwargs)
        if not calls:
            calls.append(1)
            with torch.no_grad():
                param.view(-1)[0] = float("inf")
        return out

    return once


def resume(rank, world, path, cut=17, steps=30):
    """A run of ``steps`` against one saved at ``cut`` (a fragment in flight) and resumed in a new DiLoCo."""
    def build():
        model = square_model()
        return model, DiLoCo(model, torch.optim.AdamW(model.parameters(), lr=1e-2), sync_every=8, codec="int4",
                             fragments=2, delay=3)

    def train(model, opt, start, stop):
        for step in range(start, stop):
            opt.zero_grad()
            _loss(model, rank, step).backward()
            opt.step()

    model, opt = build()
    train(model, opt, 0, steps)
    full = [p.detach().clone() for p in model.parameters()]
    opt.close()
    model, opt = build()
    train(model, opt, 0, cut)
    in_flight = sorted(opt.flight)
    torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, f"{path}.{rank}")
    opt.close()
    model, opt = build()
    saved = torch.load(f"{path}.{rank}", weights_only=True)
    model.load_state_dict(saved["model"])
    opt.load_state_dict(saved["opt"])
    train(model, opt, cut, steps)
    opt.close()
    return in_flight, all(torch.equal(a, b) for a, b in zip(full, model.parameters()))
