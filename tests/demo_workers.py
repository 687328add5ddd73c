"""Worker functions for the DeMo multi-process tests (module level, so they can be pickled)."""

from __future__ import annotations

import copy
import os

import torch
import torch.distributed as dist
import torch.nn as nn

from gradcompress.optim import DeMo

IN, HIDDEN, OUT = 8, 8, 6
#: small chunks so that the model's 8 x 8 matrix is cut into 2-D blocks (4 of 4 x 4) and the vectors into 1-D
#: chunks of 4 (the last ones zero-padded: 6 = 4 + 2); FULL extracts every coefficient of both kinds
CHUNK, FULL, PARTIAL = 4, 16, 3
LR, BETA, WD = 0.05, 0.9, 0.1


def make_model(seed: int = 0) -> nn.Module:
    """Weights 8x8 (2-D blocks), 6x8 (1-D chunks: 6 is no multiple of 4), biases 8 and 6 (1-D)."""
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(IN, HIDDEN), nn.Tanh(), nn.Linear(HIDDEN, OUT))


def backward(model: nn.Module, rank: int, step: int) -> None:
    g = torch.Generator().manual_seed(1000 * step + rank)
    x, y = torch.randn(16, IN, generator=g), torch.randn(16, OUT, generator=g)
    nn.functional.mse_loss(model(x), y).backward()


def flat(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1).clone() for p in model.parameters()])


def average_grads(model: nn.Module, world: int) -> None:
    for p in model.parameters():
        dist.all_reduce(p.grad)
        p.grad.div_(world)


def replicas_equal(model: nn.Module, world: int) -> bool:
    mine = flat(model)
    every = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(every, mine)
    return all(torch.equal(mine, other) for other in every)


def against_sgd(rank: int, world: int, steps: int) -> dict:
    """DeMo with everything extracted and no sign, next to torch SGD without momentum (and with momentum, to show
    the difference) on the all-reduced mean gradient: the largest parameter difference per step."""
    model, plain, heavy = make_model(), make_model(), make_model()
    opt = DeMo(model.parameters(), lr=LR, momentum_decay=BETA, chunk=CHUNK, topk=FULL, sign=False, weight_decay=WD)
    sgd = torch.optim.SGD(plain.parameters(), lr=LR, weight_decay=WD)  # L2 = decoupled decay for plain SGD
    sgdm = torch.optim.SGD(heavy.parameters(), lr=LR, momentum=BETA, dampening=0, weight_decay=WD)
    out = {"plain": [], "momentum": [], "residual": []}
    for step in range(steps):
        for m, o in ((model, opt), (plain, sgd), (heavy, sgdm)):
            o.zero_grad()
            backward(m, rank, step)
        average_grads(plain, world)
        average_grads(heavy, world)
        for o in (opt, sgd, sgdm):
            o.step()
        out["plain"].append((flat(model) - flat(plain)).abs().max().item())
        out["momentum"].append((flat(model) - flat(heavy)).abs().max().item())
        out["residual"].append(max(opt.state[p]["momentum"].abs().max().item() for p in model.parameters()))
    return out


def sign_run(rank: int, world: int, steps: int, bad_step: int) -> dict:
    """Partial extraction with sign steps: replicas after every step, bytes per step, and a step with an Inf in
    rank W-1's gradient (parameters, momenta and step counts before and after it)."""
    model = make_model()
    opt = DeMo(model.parameters(), lr=LR, momentum_decay=BETA, chunk=CHUNK, topk=PARTIAL, weight_decay=WD)
    out = {"equal": [], "bytes": [], "changed": []}
    for step in range(steps):
        opt.zero_grad()
        backward(model, rank, step)
        if step == bad_step and rank == world - 1:
            model[0].weight.grad[0, 0] = float("inf")
        before_params, before_state = flat(model), copy.deepcopy(opt.state_dict()["state"])
        sent = opt.bytes_sent()
        opt.step()
        out["bytes"].append(opt.bytes_sent() - sent)
        out["equal"].append(replicas_equal(model, world))
        out["changed"].append(not torch.equal(before_params, flat(model)))
        if step == bad_step:
            after = opt.state_dict()["state"]
            out["bad_state_same"] = all(torch.equal(before_state[k][n], after[k][n])
                                        for k in before_state for n in before_state[k])
    out["stats"] = opt.stats()
    mine = opt.state[model[0].weight]["momentum"]
    every = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(every, mine)
    out["momenta_all_equal"] = all(torch.equal(mine, other) for other in every)  # decoupled: they differ
    return out


def checkpoint(rank: int, world: int, total: int, cut: int, directory: str) -> dict:
    """``total`` steps uninterrupted, and ``cut`` steps, a checkpoint on disk, fresh objects, the rest."""
    full = make_model()
    opt = DeMo(full.parameters(), lr=LR, chunk=CHUNK, topk=PARTIAL, weight_decay=WD)
    for step in range(total):
        opt.zero_grad()
        backward(full, rank, step)
        opt.step()
    first = make_model()
    o1 = DeMo(first.parameters(), lr=LR, chunk=CHUNK, topk=PARTIAL, weight_decay=WD)
    for step in range(cut):
        o1.zero_grad()
        backward(first, rank, step)
        o1.step()
    path = os.path.join(directory, f"demo-rank{rank}.pt")
    torch.save({"model": first.state_dict(), "opt": o1.state_dict()}, path)
    saved = torch.load(path, weights_only=True)
    resumed = make_model(seed=1)  # other initial weights: the checkpoint must bring everything back
    resumed.load_state_dict(saved["model"])
    o2 = DeMo(resumed.parameters(), lr=LR, chunk=CHUNK, topk=PARTIAL, weight_decay=WD)
    o2.load_state_dict(saved["opt"])
    for step in range(cut, total):
        o2.zero_grad()
        backward(resumed, rank, step)
        o2.step()
    momenta = lambda o, m: torch.cat([o.state[p]["momentum"].reshape(-1) for p in m.parameters()])  # noqa: E731
    return {"params_equal": torch.equal(flat(full), flat(resumed)),
            "momenta_equal": torch.equal(momenta(opt, full), momenta(o2, resumed)),
            "dtypes": sorted({str(o2.state[p]["momentum"].dtype) for p in resumed.parameters()})}


def hierarchical_refused(rank: int, world: int) -> str:
    """DeMo under a hierarchical topology (2 nodes of world/2): the first step must refuse it on every rank."""
    model = make_model()
    opt = DeMo(model.parameters(), topology=world // 2)
    backward(model, rank, 0)
    before = flat(model)
    try:
        opt.step()
    except ValueError as err:
        assert torch.equal(before, flat(model))
        return str(err)
    return "no error"


def main_checks(rank: int, world: int, steps: int, bad_step: int, ckpt: tuple | None) -> dict:
    out = {"sgd": against_sgd(rank, world, steps), "sign": sign_run(rank, world, steps, bad_step)}
    if ckpt is not None:
        out["ckpt"] = checkpoint(rank, world, *ckpt)
    if world >= 4:
        out["hierarchical"] = hierarchical_refused(rank, world)
    return out
