"""Worker functions for tests/test_diloco_fsdp.py: DiLoCo across 2 replicas of a model sharded with FSDP2 over 2
ranks each (gloo, 4 processes).

``init_device_mesh("cpu", (2, 2), ("replicate", "shard"))``: ranks 0, 1 are replica 0 and ranks 2, 3 replica 1;
each replica shards the tests' MLP with ``fully_shard`` over ``mesh["shard"]`` (FSDP's reduce-scatter averages the
gradients of the replica's two ranks), and DiLoCo syncs each shard with the same shard of the other replica (ranks
0-2 and 1-3). The reference is the unsharded DiLoCo on the same data: each rank holds the whole MLP, averages its
gradients with the other rank of its replica (what FSDP's reduce-scatter does) and runs DiLoCo across the replicas
on the whole tensors."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.distributed.fsdp._fully_shard._fsdp_common import HSDPMeshInfo

from gradcompress.optim import DiLoCo, muon
from workers import batch, make_model

REPLICAS, SHARDS = 2, 2


def mesh2d() -> DeviceMesh:
    return init_device_mesh("cpu", (REPLICAS, SHARDS), mesh_dim_names=("replicate", "shard"))


def sharded_model(mesh: DeviceMesh, over: Any = None, out: int = 10, seed: int = 0) -> nn.Module:
    """The tests' MLP (``out`` classes), each Linear and the root sharded over ``over`` (default mesh["shard"])."""
    model = _mlp(out, seed)
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh["shard"] if over is None else over)
    fully_shard(model, mesh=mesh["shard"] if over is None else over)
    return model


def _mlp(out: int, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 48), nn.ReLU(), nn.Linear(48, out))


def _inner(model: nn.Module, inner: str) -> torch.optim.Optimizer:
    if inner == "muon":
        return muon(model, adamw_lr=1e-2)
    if inner == "sgd":
        return torch.optim.SGD(model.parameters(), lr=0.05)
    return torch.optim.AdamW(model.parameters(), lr=1e-2)


def _locals(model: nn.Module) -> list[torch.Tensor]:
    """This rank's shards of the parameters (the whole tensors for a plain model)."""
    return [p.detach().to_local().clone() if hasattr(p, "to_local") else p.detach().clone()
            for p in model.parameters()]


def replicas_equal(tensors: list[torch.Tensor], group: Any) -> bool:
    """Whether every rank of ``group`` holds bit for bit the same ``tensors``."""
    mine = torch.cat([t.reshape(-1) for t in tensors])
    everyone = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(everyone, mine, group=group)
    return all(torch.equal(everyone[0], e) for e in everyone)


# how the sharded model is laid out and DiLoCo told so: (sharded over mesh["shard"], not the 2-D mesh; DiLoCo's
# group arguments). "native": sharded natively over the 2-D mesh (torchtitan's HSDP), DiLoCo given no group
HOW: dict[str, tuple[bool, Any]] = {
    "mesh": (True, lambda mesh: {"mesh": mesh}),
    "process_group": (True, lambda mesh: {"process_group": mesh.get_group("replicate")}),
    "native": (False, lambda mesh: {}),
    "native_mesh": (False, lambda mesh: {"mesh": mesh}),
}


def build(mesh: DeviceMesh, sharded: bool, inner: str, diloco: dict, how: str = "mesh",
          out: int = 10) -> tuple[nn.Module, DiLoCo]:
    """The sharded model's DiLoCo (``how``: a key of :data:`HOW`) or the unsharded reference's (``process_group=``
    the replicate group); ``out``: the last layer's rows (11: uneven shards, 6 and 5)."""
    if not sharded:
        model = _mlp(out)
        return model, DiLoCo(model, _inner(model, inner), **diloco, process_group=mesh.get_group("replicate"))
    per_replica, group = HOW[how]
    model = sharded_model(mesh, over=None if per_replica else mesh, out=out)
    return model, DiLoCo(model, _inner(model, inner), **diloco, **group(mesh))


def train(rank: int, mesh: DeviceMesh, model: nn.Module, opt: DiLoCo, sharded: bool, start: int,
          stop: int) -> list[dict]:
    """Steps ``start`` to ``stop`` on this rank's batches. Per step: the whole parameters (the sharded ones
    gathered), whether a sync (of some fragment) was applied, whether the replicas' shards and anchors are equal."""
    log = []
    for step in range(start, stop):
        x, y = batch(rank, step)
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        if not sharded:  # what FSDP's reduce-scatter does: the replica's mean gradient
            for p in model.parameters():
                dist.all_reduce(p.grad, group=mesh.get_group("shard"))
                p.grad.div_(SHARDS)
        before = opt.syncs
        opt.step()
        with torch.no_grad():
            whole = [p.full_tensor() if sharded else p.detach().clone() for p in model.parameters()]
        group = mesh.get_group("replicate")
        log.append({"params": whole, "synced": opt.syncs > before, "equal": replicas_equal(_locals(model), group),
                    "anchors_equal": replicas_equal([a.detach() for a in opt.anchor], group)})
    return log


def compare(rank: int, world: int, cases: dict[str, dict], steps: int = 12) -> dict[str, dict]:
    """Per case (``{"inner": ..., "reference": bool, **DiLoCo options}``): the sharded run's log and stats, this
    rank's local numels, and (``reference``) the unsharded run's whole parameters per step."""
    mesh = mesh2d()
    out = {}
    for name, case in cases.items():
        case = dict(case)
        inner, reference, how = case.pop("inner", "adamw"), case.pop("reference", False), case.pop("how", "mesh")
        out_rows = case.pop("out", 10)
        model, opt = build(mesh, True, inner, case, how, out_rows)
        log = train(rank, mesh, model, opt, True, 0, steps)
        result = {"log": log, "stats": opt.stats(), "local_numels": [a.numel() for a in opt.anchor],
                  "anchor_types": sorted({type(a.data).__name__ for a in opt.anchor})}
        opt.close()
        if reference:
            ref_model, ref_opt = build(mesh, False, inner, case, out=out_rows)
            result["reference"] = [row["params"] for row in train(rank, mesh, ref_model, ref_opt, False, 0, steps)]
            ref_opt.close()
        out[name] = result
    return out


def resume(rank: int, world: int, path: str, cases: dict[str, dict], steps: int = 14,
           cut: int = 9) -> dict[str, dict]:
    """Per case: the sharded run of ``steps`` against one saved at ``cut`` (model and DiLoCo state dicts, this
    rank's file, weights only) and resumed in fresh objects; plus loading another rank's file (the other shard of
    this replica) into a fresh DiLoCo."""
    mesh = mesh2d()
    out = {}
    for name, case in cases.items():
        case = dict(case)
        inner = case.pop("inner", "adamw")
        model, opt = build(mesh, True, inner, case)
        train(rank, mesh, model, opt, True, 0, steps)
        full = _locals(model)
        opt.close()
        model, opt = build(mesh, True, inner, case)
        train(rank, mesh, model, opt, True, 0, cut)
        in_flight = sorted(opt.flight)
        torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, f"{path}.{name}.{rank}")
        opt.close()
        dist.barrier()
        model, opt = build(mesh, True, inner, case)
        state = torch.load(f"{path}.{name}.{rank}", weights_only=True)
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
        train(rank, mesh, model, opt, True, cut, steps)
        resumed = _locals(model)
        stats = opt.stats()
        opt.close()
        other = torch.load(f"{path}.{name}.{rank ^ 1}", weights_only=True)
        try:
            opt.load_state_dict(other["opt"])
            wrong = "no error"
        except ValueError as err:
            wrong = str(err)
        dist.barrier()
        out[name] = {"same": all(torch.equal(a, b) for a, b in zip(full, resumed)), "in_flight": in_flight,
                     "stats": stats, "wrong_file": wrong, "shards_key": state["opt"].get("shards")}
    return out


def bad_arguments(rank: int, world: int) -> dict[str, str]:
    """Each refused configuration's error (every rank builds the same ones)."""
    mesh = mesh2d()
    out = {}

    def attempt(name: str, model: nn.Module | list, **kwargs: Any) -> None:
        params = model if isinstance(model, list) else model.parameters()
        try:
            DiLoCo(model, torch.optim.SGD(params, lr=0.1), sync_every=2, **kwargs).close()
            out[name] = "no error"
        except ValueError as err:
            out[name] = str(err)

    attempt("no_group", sharded_model(mesh))
    attempt("shard_group", sharded_model(mesh), process_group=mesh.get_group("shard"))
    attempt("both", sharded_model(mesh), mesh=mesh, process_group=mesh.get_group("replicate"))
    native = sharded_model(mesh, over=mesh)  # FSDP's native HSDP: its own mesh gives the layout
    attempt("native_group", native, process_group=mesh.get_group("replicate"))
    attempt("native_params", list(native.parameters()))
    out["native_untouched"] = str(all(isinstance(g.mesh_info, HSDPMeshInfo) for g in _param_groups(native)))
    attempt("mesh_plain", make_model(), mesh=mesh)
    # the replicas shard different models (replica 1: 12 classes): the ranks of the group hold different shards
    attempt("different", sharded_model(mesh, out=10 if rank < SHARDS else 12), mesh=mesh)
    dist.barrier()
    return out


def _param_groups(model: nn.Module) -> list:
    """Every FSDP parameter group of ``model`` (FSDP2's internals: where its reduction groups are read from)."""
    return [g for m in model.modules() if isinstance(m, FSDPModule) for g in m._get_fsdp_state()._fsdp_param_groups]


def starts_from_replica_0(rank: int, world: int) -> list[bool]:
    """Replica 1 builds its model from another seed: after DiLoCo's construction every rank's shards are replica
    0's (one broadcast of the shards over the replicate group), and were not before."""
    mesh = mesh2d()
    model = sharded_model(mesh, seed=rank // SHARDS)
    group = mesh.get_group("replicate")
    before = replicas_equal(_locals(model), group)
    opt = DiLoCo(model, torch.optim.SGD(model.parameters(), lr=0.1), sync_every=2, mesh=mesh)
    after = replicas_equal(_locals(model), group)
    first = sharded_model(mesh, seed=0)
    return [before, after, all(torch.equal(a, b) for a, b in zip(_locals(model), _locals(first))),
            all(torch.equal(a, b) for a, b in zip(_locals(model), opt.anchor))]
