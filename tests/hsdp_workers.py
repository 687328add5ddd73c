"""Worker functions for tests/test_hsdp.py: HSDP across 2 simulated nodes of 2 workers (gloo), compressed.

Ranks 0, 1 form node 0 and ranks 2, 3 node 1: ``init_device_mesh("cpu", (2, 2), ("replicate", "shard"))``. The
compressed layout shards over ``mesh["shard"]`` (the node) and passes the mesh to ``register_fsdp``; the
reference, FSDP's native HSDP, shards over the 2-D mesh."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule, fully_shard

import gradcompress
from gradcompress.cli.schemes import split_scheme
from workers import batch, make_model

NODES, PER_NODE = 2, 2


def hsdp_mesh():
    return init_device_mesh("cpu", (NODES, PER_NODE), mesh_dim_names=("replicate", "shard"))


def hsdp_model(scheme: str | None, seed: int = 0, native: bool = False, params=None, mp=None, **extra):
    """The tests' MLP under HSDP. ``scheme`` None: FSDP's own (native 2-D HSDP when ``native``, else sharded over
    the node only, with no replica exchange unless ``params`` asks for a compressor); else compressed HSDP."""
    mesh = hsdp_mesh()
    shard_over = mesh if native else mesh["shard"]
    model = make_model(seed)
    kw = {"mp_policy": mp} if mp is not None else {}
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=shard_over, **kw)
    fully_shard(model, mesh=shard_over, **kw)
    comp = None
    if scheme is not None:
        # specs the CLI's scheme grammar does not take ("auto", "warmup_steps=") go to register_fsdp as they are
        direct = scheme.startswith("auto") or "warmup_steps=" in scheme
        codec, options = (scheme, {}) if direct else split_scheme(scheme)
        comp = gradcompress.register_fsdp(model, codec, mesh=mesh, params=params, **{**options, **extra})
    return model, comp, mesh


def local_grads(model) -> list[torch.Tensor]:
    return [p.grad.to_local().clone() for p in model.parameters()]


def fixed_batch_runs(rank, world, schemes, steps):
    """Per scheme: the sharded gradients of ``steps`` backward passes on the same batch (no update), stats and
    residuals; plus the exact average over all 4 ranks of the full gradients, cut as this rank's shard."""
    x, y = batch(rank, 0)
    out = {"everyone": everyone_full_grads(rank, world)}
    for scheme in schemes:
        model, comp, _ = hsdp_model(None if scheme == "native" else scheme, native=scheme == "native")
        grads = []
        for _ in range(steps):
            model.zero_grad()
            nn.functional.cross_entropy(model(x), y).backward()
            grads.append(local_grads(model))
        out[scheme] = {"grads": grads, "stats": comp.stats() if comp else None,
                       "residual": {k: v.clone() for k, v in comp.residual.items()} if comp else None,
                       "server": {k: v.clone() for k, v in comp.server_residual.items()} if comp else None}
    return out


def everyone_full_grads(rank, world):
    """Every rank's full local gradient of batch (rank, 0), in rank order."""
    x, y = batch(rank, 0)
    local = make_model()
    nn.functional.cross_entropy(local(x), y).backward()
    everyone = [None] * world
    dist.all_gather_object(everyone, [p.grad for p in local.parameters()])
    return everyone


def same_shard_peers_equal(tensors, rank) -> bool:
    """Every rank's ``tensors`` gathered: True when they equal those of every rank holding the same shard."""
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, tensors)
    peers = [r for r in range(len(everyone)) if r % PER_NODE == rank % PER_NODE]
    return all(all(torch.equal(a, b) for a, b in zip(everyone[peers[0]], everyone[r])) for r in peers)


def training_runs(rank, world, scheme, steps, poison_step=None, cut=None):
    """SGD on each rank's own batches under compressed HSDP. Per step: the sharded gradients, whether they were
    finite, whether the ranks holding the same shard hold equal parameters after the step. ``poison_step``: rank
    ``world - 1``'s loss times Inf there (GradScaler skips it). ``cut``: a fresh compressor loads the state_dict
    there (weights_only)."""
    model, comp, mesh = hsdp_model(scheme)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    scaler = torch.amp.GradScaler("cpu", init_scale=1.0)
    out = {"grads": [], "finite": [], "replicas_equal": [], "unchanged": None}
    for step in range(steps):
        if step == cut:
            torch.save(comp.state_dict(), f"/tmp/gc-hsdp-{rank}.pt")
            codec, options = split_scheme(scheme)
            comp = gradcompress.register_fsdp(model, codec, mesh=mesh, **options)
            comp.load_state_dict(torch.load(f"/tmp/gc-hsdp-{rank}.pt", weights_only=True))
        x, y = batch(rank, step)
        opt.zero_grad()
        before = comp.state_dict()
        loss = nn.functional.cross_entropy(model(x), y)
        poisoned = step == poison_step and rank == world - 1
        (scaler.scale(loss) * (float("inf") if poisoned else 1.0)).backward()
        out["grads"].append(local_grads(model))
        out["finite"].append(all(bool(torch.isfinite(g).all()) for g in out["grads"][-1]))
        if step == poison_step:
            after = comp.state_dict()
            out["unchanged"] = before["step"] == after["step"] and all(
                torch.equal(before[s][k], after[s][k]) for s in ("residual", "server_residual") for k in before[s])
        scaler.step(opt)
        scaler.update()
        out["replicas_equal"].append(same_shard_peers_equal([p.to_local().detach() for p in model.parameters()],
                                                            rank))
    out["stats"] = comp.stats()
    return out


def training_variants(rank, world, scheme, steps, poison_step, cut):
    """:func:`training_runs` three ways in one launch: straight, resumed at ``cut``, poisoned at ``poison_step``."""
    return {"full": training_runs(rank, world, scheme, steps), "resumed": training_runs(rank, world, scheme, steps,
            cut=cut), "poisoned": training_runs(rank, world, scheme, steps, poison_step=poison_step)}


def flat_model(params, scheme="none"):
    """The tests' MLP sharded over all ranks (plain FSDP), gradients through ``scheme``, parameters per ``params``."""
    model = make_model(0)
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer)
    fully_shard(model)
    return model, gradcompress.register_fsdp(model, scheme, params=params)


def fixed_grad(shape, step: int, index: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(1000 * step + index)
    return torch.randn(shape, generator=gen)


def params_runs(rank, world, params, steps):
    """Plain FSDP over every rank, exact gradients replaced by fixed ones before each update: per step the exact
    full parameters and the unsharded ones the layers computed with, and the sharded parameters after it."""
    model, comp = flat_model(params)
    seen = []
    for layer in model:
        if isinstance(layer, nn.Linear):
            layer.register_forward_pre_hook(lambda m, i: seen.append([m.weight.detach().clone(), m.bias.detach().clone()]))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    out = {"exact": [], "used": [], "sharded": [], "loss": []}
    for step in range(steps):
        out["exact"].append([p.full_tensor().detach().clone() for p in model.parameters()])
        seen.clear()
        x, y = batch(rank, step)
        opt.zero_grad()
        loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()
        out["loss"].append(float(loss.detach()))
        out["used"].append([t for pair in seen for t in pair])
        for i, p in enumerate(model.parameters()):
            full = fixed_grad(p.shape, step, i)
            rows = -(-p.shape[0] // world)
            p.grad.to_local().copy_(full[rank * rows : (rank + 1) * rows])
        opt.step()
        out["sharded"].append([p.to_local().detach().clone() for p in model.parameters()])
    out["stats"] = comp.stats()
    return out


def params_variants(rank, world, variants, steps):
    """:func:`params_runs` for each ``params=`` value in one launch, keyed by ``str(value)``."""
    return {str(p): params_runs(rank, world, p, steps) for p in variants}


def native_model(scheme: str | None, factor: float | None = None):
    """The tests' MLP sharded by FSDP over the 2-D (replicate, shard) mesh itself — native HSDP, as torchtitan
    builds it — with ``factor`` as every module's gradient divide factor (torchtitan: 1.0, a sum) and, given a
    ``scheme``, ``register_fsdp(model, scheme)`` with no mesh: its own mesh gives the layout."""
    mesh = hsdp_mesh()
    model = make_model(0)
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    if factor is not None:  # as torchtitan's distributed/fsdp.py disable_fsdp_gradient_division: every module
        for module in model.modules():
            if isinstance(module, FSDPModule):
                module.set_gradient_divide_factor(factor)
                module.set_force_sum_reduction_for_comms(True)  # SUM, not PREMUL_SUM(1/factor): gloo has none
    comp = None
    if scheme is not None:
        codec, options = split_scheme(scheme)
        comp = gradcompress.register_fsdp(model, codec, **options)
    return model, comp


def native_runs(rank, world, schemes, steps):
    """Per scheme, ``steps`` backward passes on one batch (no update): the sharded gradients under the compressed
    1-D layout (``mesh=``), under native HSDP compressed (``native``), and native HSDP compressed with torchtitan's
    divide factor 1.0 (``summed``); FSDP's own native HSDP as ``reference``; and whether each native run's replicas of
    a shard hold equal gradients."""
    x, y = batch(rank, 0)
    out: dict = {}
    reference, _ = native_model(None)
    nn.functional.cross_entropy(reference(x), y).backward()
    out["reference"] = local_grads(reference)
    for scheme in schemes:
        runs = {}
        for name in ("layout", "native", "summed"):
            if name == "layout":
                model, comp, _ = hsdp_model(scheme)
            else:
                model, comp = native_model(scheme, 1.0 if name == "summed" else None)
            grads = []
            for _ in range(steps):
                model.zero_grad()
                nn.functional.cross_entropy(model(x), y).backward()
                grads.append(local_grads(model))
            runs[name] = {"grads": grads, "stats": comp.stats(),
                          "peers_equal": same_shard_peers_equal(grads[-1], rank)}
        out[scheme] = runs
    return out
