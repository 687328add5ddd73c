"""Worker functions for tests/test_fsdp.py: FSDP2 (fully_shard) on gloo with the compressed reduce-scatter."""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

import gradcompress
from gradcompress.cli.schemes import split_scheme
from workers import batch, make_model


def sharded_model(scheme: str | None, seed: int = 0, mp: MixedPrecisionPolicy | None = None, **extra):
    """The tests' MLP with fully_shard on every Linear and the root; ``scheme`` None: plain FSDP."""
    model = make_model(seed)
    kw = {"mp_policy": mp} if mp is not None else {}
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, **kw)
    fully_shard(model, **kw)
    comp = None
    if scheme is not None:
        codec, options = split_scheme(scheme)
        comp = gradcompress.register_fsdp(model, codec, **{**options, **extra})
    return model, comp


def shard_rows(t: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    """This rank's dim-0 shard of a full tensor, as FSDP2 cuts it (ceil(n / world) rows each)."""
    rows = math.ceil(t.shape[0] / world)
    return t[rank * rows : (rank + 1) * rows]


def fixed_batch_runs(rank, world, schemes, steps):
    """Per scheme: sharded gradients of ``steps`` backward passes on the same batch (no updates), the
    exact average's shards, every rank's local full gradients' shards, and stats."""
    x, y = batch(rank, 0)
    local = make_model()
    nn.functional.cross_entropy(local(x), y).backward()
    everyone = [None] * world
    dist.all_gather_object(everyone, [p.grad for p in local.parameters()])
    mine = [[shard_rows(g, rank, world) for g in grads] for grads in everyone]
    exact = [sum(m[i] for m in mine) / world for i in range(len(mine[0]))]
    out = {"exact": exact, "local_shards": mine, "shapes": [tuple(p.shape) for p in local.parameters()]}
    for scheme in schemes:
        model, comp = sharded_model(None if scheme == "plain" else scheme)
        grads = []
        for _ in range(steps):
            model.zero_grad()
            nn.functional.cross_entropy(model(x), y).backward()
            grads.append([p.grad.to_local().clone() for p in model.parameters()])
        out[scheme] = {"grads": grads, "stats": comp.stats() if comp else None,
                       "error_feedback": comp.error_feedback if comp else None}
        if comp is not None and comp.error_feedback:
            out[scheme]["residual"] = residual_shards(comp, model, rank, world)
    return out


def residual_shards(comp, model, rank, world) -> list[torch.Tensor]:
    """The mean over ranks of the residuals' part that this rank's chunk covers, per parameter (as its shard).

    A group's residual is FSDP's reduce-scatter input layout: ``world`` chunks; chunk j is every
    parameter's j-th dim-0 shard, padded to ceil(rows / world) rows, flattened, concatenated."""
    everyone = [None] * world
    dist.all_gather_object(everyone, {k: v.float() for k, v in comp.residual.items()})
    out = []
    for name, layer in model.named_children():
        params = list(layer.parameters(recurse=False))
        if not params:
            continue
        chunks = [r[f"fsdp:{name}"].view(world, -1)[rank] for r in everyone]
        mean = sum(chunks) / world
        offset = 0
        for p in params:
            rows = math.ceil(p.shape[0] / world)
            rest = math.prod(p.shape[1:])
            local = p.to_local()
            out.append(mean[offset : offset + local.numel()].view(local.shape))
            offset += rows * rest
    return out


def resume_runs(rank, world, scheme, steps=6, cut=3):
    """Run A: ``steps`` SGD steps. Run B: ``cut`` steps, then a fresh compressor that loads the first
    one's state_dict (weights_only) continues. Returns both runs' sharded gradients after the cut."""
    runs = []
    for resume in (False, True):
        model, comp = sharded_model(scheme)
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        grads = []
        for step in range(steps):
            if resume and step == cut:
                state = comp.state_dict()
                torch.save(state, f"/tmp/gc-fsdp-{rank}.pt")
                comp = gradcompress.register_fsdp(model, split_scheme(scheme)[0], **split_scheme(scheme)[1])
                comp.load_state_dict(torch.load(f"/tmp/gc-fsdp-{rank}.pt", weights_only=True))
            x, y = batch(rank, step)
            opt.zero_grad()
            nn.functional.cross_entropy(model(x), y).backward()
            if step >= cut:
                grads.append([p.grad.to_local().clone() for p in model.parameters()])
            opt.step()
        runs.append((grads, sum(len(v) for k, v in comp.state_dict().items() if isinstance(v, dict))))
    return runs


def overflow_run(rank, world, scheme, reduce_dtype):
    """bf16/fp16 reduce-scatter (MixedPrecisionPolicy); rank 1's gradient gets an Inf at step 2."""
    mp = MixedPrecisionPolicy(param_dtype=torch.float32, reduce_dtype=reduce_dtype)
    model, comp = sharded_model(scheme, mp=mp)
    poison = {"on": False}
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    scaler = torch.amp.GradScaler("cpu", init_scale=1.0)
    report = {"finite": []}
    for step in range(5):
        poison["on"] = step == 2 and rank == 1
        x, y = batch(rank, step)
        opt.zero_grad()
        before = comp.state_dict()
        loss = nn.functional.cross_entropy(model(x), y)
        (scaler.scale(loss) * (float("inf") if poison["on"] else 1.0)).backward()
        report["finite"].append(all(bool(torch.isfinite(p.grad.to_local()).all()) for p in model.parameters()))
        if step == 2:
            after = comp.state_dict()
            report["unchanged"] = before["step"] == after["step"] and all(
                torch.equal(before["residual"][k], after["residual"][k]) for k in before["residual"])
        scaler.step(opt)
        scaler.update()
    report["stats"] = comp.stats()
    report["dtypes"] = sorted({str(v.dtype) for v in comp.state_dict()["residual"].values()})
    report["params"] = [p.to_local().detach().clone() for p in model.parameters()]
    return report


def bad_registrations(rank, world, specs):
    out = {}
    for spec in specs:
        model, _ = sharded_model(None)
        try:
            gradcompress.register_fsdp(model, spec)
            out[spec] = "no error"
        except ValueError as err:
            out[spec] = str(err)
    try:
        gradcompress.register_fsdp(make_model(), "int8")
        out["unsharded"] = "no error"
    except ValueError as err:
        out["unsharded"] = str(err)
    for name, extra in (("manager+replicate_group", {"replicate_group": dist.group.WORLD}),
                        ("manager+topology", {"topology": 2})):  # under torchft: the replicas are the quorum
        try:
            gradcompress.register_fsdp(sharded_model(None)[0], "int8", manager=object(), **extra)
            out[name] = "no error"
        except ValueError as err:
            out[name] = str(err)
    dist.barrier()  # every rank got here: nothing hangs
    return out


def two_models(rank, world):
    """Two FSDP models with their own compressors, stepped alternately, equal each trained alone."""
    def train(which, interleave):
        models = {name: sharded_model(scheme, seed=seed) for name, scheme, seed in
                  (("a", "int8", 0), ("b", "topk:ratio=0.1", 1))}
        grads = {"a": [], "b": []}
        for step in range(3):
            for name in (("a", "b") if interleave else (which,)):
                model, _ = models[name]
                x, y = batch(rank, step)
                model.zero_grad()
                nn.functional.cross_entropy(model(x), y).backward()
                grads[name].append([p.grad.to_local().clone() for p in model.parameters()])
        return grads, {n: m[1].stats()["steps"] for n, m in models.items()}

    together, steps = train(None, True)
    alone_a, _ = train("a", False)
    alone_b, _ = train("b", False)
    return together, alone_a["a"], alone_b["b"], steps
