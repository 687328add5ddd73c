"""Worker functions for tests/test_hsdp.py: HSDP across 2 simulated nodes of 2 workers (gloo), compressed.

Ranks 0, 1 form node 0 and ranks 2, 3 node 1: ``init_device_mesh("cpu", (2, 2), ("replicate", "shard"))``. The
compressed layout shards over ``mesh["shard"]`` (the node) and passes the mesh to ``register_fsdp``; the
reference, FSDP's native HSDP, shards over the 2-D mesh."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

import gradcompress
from gradcompress.cli.task import split_scheme
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
        codec, options = split_scheme(scheme)
        comp = gradcompress.register_fsdp(model, codec, mesh=mesh, params=params, **{**options, **extra})
    return model, comp, mesh


def local_grads(model) -> list[torch.Tensor]:
    return [p.grad.to_local().clone() for p in model.parameters()]


def fixed_batch_runs(rank, world, schemes, steps):
    """Per scheme: the sharded gradients of ``steps`` backward passes on the same batch (no update), stats and
    residuals; plus the exact average over all 4 ranks of the full gradients, cut as this rank's shard."""
    x, y = batch(rank, 0)
    local = make_model()
    nn.functional.cross_entropy(local(x), y).backward()
    full = [p.grad.clone() for p in local.parameters()]
    for g in full:
        dist.all_reduce(g)
        g.div_(world)
    out = {"exact_full": full}
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
    out["exact"] = [p.to_local().detach().clone() * 0 for p in model.parameters()]  # shapes of the shards
    return out
