"""Worker functions for the topology tests (tests/test_nodes.py): simulated nodes of a few gloo processes.

Gradients are a pure function of (rank, step, tensor), so the test recomputes every rank's inputs itself.
"""

from __future__ import annotations

import os

import torch
import torch.nn as nn

import gradcompress

#: a matrix and a vector compressed (their pieces straddle min_numel), a bias sent dense
SHAPES = [(48, 64), (2000,), (10,)]
MIN_NUMEL = 1000


def grad(rank: int, step: int, i: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(100_000 * step + 100 * rank + i)
    return torch.randn(SHAPES[i], generator=g) * (1.0 + 0.5 * i)


def _params():
    return [nn.Parameter(torch.zeros(s)) for s in SHAPES]


def _steps(rank: int, comp, params, steps, start: int = 0, poison: tuple | None = None, grad_of=None,
           poison_at: tuple = (0, 5)) -> dict:
    """``steps`` synchronize() steps from ``start``; ``poison=(rank, step)``: an Inf in that rank's gradient at
    that step (tensor, element ``poison_at``); ``grad_of(rank, step, i)``: the gradients (default :func:`grad`).
    Returns per step the averaged gradients, committed flags and the state after the step."""
    grad_of = grad_of or grad
    out = {"grads": [], "committed": [], "states": []}
    for step in range(start, start + steps):
        for i, p in enumerate(params):
            p.grad = grad_of(rank, step, i)
        if poison == (rank, step):
            params[poison_at[0]].grad.view(-1)[poison_at[1]] = float("inf")
        out["committed"].append(comp.synchronize(params))
        out["grads"].append([p.grad.clone() for p in params])
        out["states"].append(comp.state_dict())
    out["stats"] = comp.stats()
    return out


def _torchrun_env(rank: int, per_node: int) -> dict:
    """What torchrun sets for ``rank`` on nodes of ``per_node`` workers."""
    return {"LOCAL_WORLD_SIZE": str(per_node), "GROUP_RANK": str(rank // per_node), "LOCAL_RANK": str(rank % per_node)}


def run_cases(rank, world, cases, steps):
    """For each ``(name, spec, options)``: ``steps`` steps of a fresh Compressor; see :func:`_steps`. The option
    ``torchrun=G`` sets torchrun's environment for nodes of G workers around the run (``topology`` stays auto)."""
    out = {}
    for name, spec, options in cases:
        options = dict(options)
        per_node = options.pop("torchrun", None)
        env = _torchrun_env(rank, per_node) if per_node else {}
        saved = {k: os.environ.get(k) for k in env}
        os.environ.update(env)
        try:
            comp = gradcompress.Compressor(spec, min_numel=MIN_NUMEL, **options)
            out[name] = _steps(rank, comp, _params(), steps)
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k)
                else:
                    os.environ[k] = v
    return out


def poisoned(rank, world, specs, per_node, bad_rank, bad_step, steps):
    """For each spec: an Inf on ``bad_rank`` at ``bad_step`` (error feedback and momentum state on)."""
    out = {}
    for spec in specs:
        comp = gradcompress.Compressor(spec, min_numel=MIN_NUMEL, topology=per_node, momentum=0.9)
        out[spec] = _steps(rank, comp, _params(), steps, poison=(bad_rank, bad_step))
    return out


def resumed(rank, world, spec, per_node, steps, cut):
    """``steps`` steps straight, and ``cut`` steps then a state_dict loaded into a fresh Compressor for the rest."""
    options = dict(min_numel=MIN_NUMEL, topology=per_node, momentum=0.9)
    straight = _steps(rank, gradcompress.Compressor(spec, **options), _params(), steps)
    first = gradcompress.Compressor(spec, **options)
    _steps(rank, first, _params(), cut)
    state = first.state_dict()
    second = gradcompress.Compressor(spec, **options)
    second.load_state_dict(state)
    rest = _steps(rank, second, _params(), steps - cut, start=cut)
    flat = gradcompress.Compressor(spec, min_numel=MIN_NUMEL, topology="flat", momentum=0.9)
    flat.load_state_dict(state)
    try:
        flat.synchronize(_params_with_grads(rank))
        refused = None
    except ValueError as err:
        refused = str(err)
    return {"straight": straight, "rest": rest, "saved_topology": state.get("topology"), "refused": refused}


def _params_with_grads(rank):
    params = _params()
    for i, p in enumerate(params):
        p.grad = grad(rank, 0, i)
    return params


def refuses_powersgd(rank, world, per_node):
    """The error of powersgd with an explicit hierarchical topology (None if it ran)."""
    comp = gradcompress.Compressor("powersgd:rank=2", min_numel=MIN_NUMEL, topology=per_node)
    try:
        comp.synchronize(_params_with_grads(rank))
    except ValueError as err:
        return str(err)
    return None


def _error_of(fn):
    try:
        fn()
    except ValueError as err:
        return str(err)
    return None


def misc(rank, world, per_node):
    """An Inf on one worker of node 0, a resume, and the refusals (powersgd, a G that does not divide W)."""
    return {"poisoned": poisoned(rank, world, ["int8", "randomk:ratio=0.1"], per_node, 1, 1, 3),
            "resumed": resumed(rank, world, "int8", per_node, 5, 2),
            "powersgd": refuses_powersgd(rank, world, per_node),
            "indivisible": _error_of(lambda: gradcompress.Compressor("int8", topology=world - 1).synchronize(
                _params_with_grads(rank)))}


def ddp_hierarchical(rank, world, per_node, spec, steps):
    """The DDP hook (many buckets, warm-up included) and synchronize() with ``topology=per_node``."""
    import workers

    options = {"min_numel": 256, "topology": per_node, "warmup_steps": 1}
    hook = workers.ddp_steps(rank, world, spec, steps, 0.005, dict(options), "hook")
    sync = workers.ddp_steps(rank, world, spec, steps, options=dict(options), mode="synchronize")
    return {"hook": hook, "sync": sync}


#: PowerSGD's cases: two matrices (one per local rank of 2 under the size-balanced ownership), a vector and a bias
#: (dense: no matrix shape)
POWER_SHAPES = [(48, 64), (40, 32), (2000,), (10,)]
POWER_RANK = 2


def _factors(i: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Fixed rank-POWER_RANK bases (columns) of matrix i: every worker's matrix lies in their span."""
    g = torch.Generator().manual_seed(7_000 + i)
    n, m = POWER_SHAPES[i]
    return torch.randn(n, POWER_RANK, generator=g), torch.randn(m, POWER_RANK, generator=g)


def power_grad(rank: int, step: int, i: int, low_rank: bool) -> torch.Tensor:
    """Worker ``rank``'s gradient of tensor i at ``step``; ``low_rank``: the matrices are a * diag(c) * b^T with
    fixed bases a, b and per-worker coefficients c (so every average has rank <= POWER_RANK)."""
    g = torch.Generator().manual_seed(200_000 * step + 100 * rank + i)
    shape = POWER_SHAPES[i]
    if low_rank and len(shape) == 2:
        a, b = _factors(i)
        return (a * torch.randn(POWER_RANK, generator=g)) @ b.T
    return torch.randn(shape, generator=g)


def power_steps(rank: int, comp, steps: int, low_rank: bool, poison: tuple | None = None) -> dict:
    """``steps`` synchronize() steps of PowerSGD's cases (see :func:`_steps`; an Inf in the second matrix)."""
    params = [nn.Parameter(torch.zeros(s)) for s in POWER_SHAPES]
    return _steps(rank, comp, params, steps, poison=poison, poison_at=(1, 3),
                  grad_of=lambda r, s, i: power_grad(r, s, i, low_rank))


def powersgd(rank, world, per_node, steps):
    """PowerSGD hierarchical (``topology=per_node``) and flat: random and low-rank inputs, an Inf on rank 1 at
    step 1 (momentum correction on), and a resume."""
    spec = f"powersgd:rank={POWER_RANK}"

    def comp(**kw):
        return gradcompress.Compressor(spec, min_numel=MIN_NUMEL, **{"topology": per_node, **kw})

    return {"random": power_steps(rank, comp(), steps, False),
            "low rank": power_steps(rank, comp(), steps, True),
            "flat": power_steps(rank, comp(topology="flat"), steps, False),
            "poisoned": power_steps(rank, comp(momentum=0.9), 3, False, poison=(1, 1)),
            "alternate": power_steps(rank, gradcompress.Compressor(spec + ",alternate=true", min_numel=MIN_NUMEL,
                                                                   topology=per_node), steps, False),
            "resumed": resumed(rank, world, spec, per_node, 5, 2)}


def _adam_run(rank, make_opt, first, last, model=None, opt=None):
    """Steps ``first .. last - 1`` of onebit_workers' model; returns (model, optimizer, inter-node bytes per step)."""
    import onebit_workers as ow

    if model is None:
        model = ow.make_model()
        opt = make_opt(model)
    inter = []
    for step in range(first, last):
        before = opt.stats()["inter_node_bytes"]
        opt.zero_grad()
        ow.backward(model, rank, step)
        opt.step()
        inter.append(opt.stats()["inter_node_bytes"] - before)
    return model, opt, inter


def adam_nodes(rank, world, cases, warmup, total, cut):
    """For each ``(name, codec, topology)``: CompressedAdam (OneBitAdam for ``codec=None``) for ``total`` steps,
    and ``cut`` steps, a state_dict through torch.save/load (weights_only), a fresh optimizer for the rest."""
    import io

    import onebit_workers as ow
    from gradcompress.optim import CompressedAdam, OneBitAdam

    def make(codec, topology):
        def make_opt(model):
            if codec is None:
                return OneBitAdam(model.parameters(), warmup_steps=warmup, topology=topology, **ow.HYPER)
            return CompressedAdam(model.parameters(), warmup_steps=warmup, codec=codec, topology=topology,
                                  **ow.HYPER)
        return make_opt

    out = {}
    for name, codec, topology in cases:
        make_opt = make(codec, topology)
        model, opt, inter = _adam_run(rank, make_opt, 0, total)
        first, first_opt, _ = _adam_run(rank, make_opt, 0, cut)
        buf = io.BytesIO()
        torch.save({"model": first.state_dict(), "opt": first_opt.state_dict()}, buf)
        buf.seek(0)
        saved = torch.load(buf, weights_only=True)
        second = ow.make_model(seed=123)
        second.load_state_dict(saved["model"])
        second_opt = make_opt(second)
        second_opt.load_state_dict(saved["opt"])
        _adam_run(rank, make_opt, cut, total, second, second_opt)
        out[name] = {"params": ow.flat(model), "inter": inter, "stats": opt.stats(), "resumed": ow.flat(second),
                     "worker_error": tuple(opt.state[model[0].weight]["worker_error"].shape),
                     "server_error": tuple(opt.state[model[0].weight]["server_error"].shape)}
        if name == "onebit":  # the hierarchical checkpoint resumed flat: the residuals restart, with a warning
            out["mismatch"] = _resume_flat(rank, saved, cut, warmup)
    return out


def _resume_flat(rank, saved, cut, warmup) -> list[str]:
    """One OneBitAdam step, topology="flat", from a checkpoint of another topology: the warnings it gave."""
    import warnings

    import onebit_workers as ow
    from gradcompress.optim import OneBitAdam

    model = ow.make_model(seed=123)
    model.load_state_dict(saved["model"])
    opt = OneBitAdam(model.parameters(), warmup_steps=warmup, topology="flat", **ow.HYPER)
    opt.load_state_dict(saved["opt"])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _adam_run(rank, None, cut, cut + 1, model, opt)
    return [str(w.message) for w in caught]


def _diloco_model() -> nn.Module:
    torch.manual_seed(0)  # the same start everywhere (DiLoCo broadcasts rank 0's anyway)
    return nn.Sequential(nn.Linear(32, 64), nn.Tanh(), nn.Linear(64, 8))


def _diloco_batch(rank: int, step: int):
    g = torch.Generator().manual_seed(50_000 * step + rank)
    return torch.randn(16, 32, generator=g), torch.randint(0, 8, (16,), generator=g)


def diloco_ddp(rank, world, per_node, codecs, syncs, every):
    """DiLoCo between nodes with DDP inside each node (on ``gradcompress.topology.resolve(per_node).intra``): the
    parameters after every inner step, and before and after every sync (called explicitly every ``every`` steps;
    ``codec="none"``, outer_lr 1, no outer momentum: a sync is the mean of the nodes' parameters)."""
    from gradcompress import topology
    from gradcompress.optim import DiLoCo

    nodes = topology.resolve(per_node)
    out = {}
    for codec in codecs:
        model = _diloco_model()
        ddp = nn.parallel.DistributedDataParallel(model, process_group=nodes.intra)
        opt = DiLoCo(ddp, torch.optim.SGD(ddp.parameters(), lr=0.2), sync_every=10**6, codec=codec, outer_lr=1.0,
                     outer_momentum=0.0)
        rec = {"steps": [], "before": [], "after": [], "committed": []}
        for step in range(syncs * every):
            x, y = _diloco_batch(rank, step)
            opt.zero_grad()
            nn.functional.cross_entropy(ddp(x), y).backward()
            opt.step()
            flat = torch.cat([p.detach().reshape(-1).clone() for p in model.parameters()])
            rec["steps"].append(flat)
            if (step + 1) % every == 0:
                rec["before"].append(flat)
                rec["committed"].append(opt.sync())
                rec["after"].append(torch.cat([p.detach().reshape(-1).clone() for p in model.parameters()]))
        rec["stats"] = opt.stats()
        out[codec] = rec
    return out


def fsdp_nodes(rank, world, cases, steps):
    """FSDP2 with ``register_fsdp(model, spec, topology=...)``: for each ``(name, scheme, options)`` the sharded
    gradients of ``steps`` backward passes on a fixed batch (no updates) and stats; ``poison=step`` in the options:
    an Inf in rank 1's batch at that step. Also the exact average's shards."""
    import fsdp_workers as fw
    from workers import batch, make_model

    x, y = batch(rank, 0)
    local = make_model()
    nn.functional.cross_entropy(local(x), y).backward()
    everyone: list = [None] * world
    torch.distributed.all_gather_object(everyone, [p.grad for p in local.parameters()])
    mine = [[fw.shard_rows(g, rank, world) for g in grads] for grads in everyone]
    out = {"exact": [sum(m[i] for m in mine) / world for i in range(len(mine[0]))]}
    for name, scheme, options in cases:
        options = dict(options)
        poison = options.pop("poison", None)
        model, comp = fw.sharded_model(scheme, **options)
        grads = []
        for step in range(steps):
            model.zero_grad()
            xs = x.clone()
            if poison == step and rank == 1:
                xs[0, 0] = float("inf")
            nn.functional.cross_entropy(model(xs), y).backward()
            grads.append([p.grad.to_local().clone() for p in model.parameters()])
        out[name] = {"grads": grads, "stats": comp.stats() if comp else None}
    return out
