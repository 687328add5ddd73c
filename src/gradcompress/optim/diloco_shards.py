"""DiLoCo over FSDP2 / DTensor parameters: each rank syncs its own shards with the same shard of every replica.

Layout (torchtitan's ``dp_replicate x fsdp``, as :func:`gradcompress.register_fsdp`'s compressed HSDP): every
replica shards the model with ``fully_shard`` over its own 1-D mesh (``mesh["shard"]``), so FSDP's all-gathers and
reduce-scatters stay inside the replica; DiLoCo's outer sync runs across the replicas, on the group of the ranks
that hold the same shard in every replica (``mesh.get_group("replicate")``)::

    mesh = init_device_mesh("cuda", (replicas, per_replica), mesh_dim_names=("replicate", "shard"))
    fully_shard(model, mesh=mesh["shard"])                # (and each block first, as usual)
    opt = DiLoCo(model, muon(model), sync_every=100, codec="int2", mesh=mesh)
    # or: DiLoCo(model, ..., process_group=mesh.get_group("replicate"))

DiLoCo then works on each parameter's local shard (``p.to_local()``, a view of the parameter's own storage): the
anchors, the outer optimizer's state and the codec's residuals are local tensors of the shard's shape, the outer
gradient ``anchor - local`` of the shard goes through the codec to the peers of the same shard index, and the
streaming fragments (layers) are the same on every replica. What is sent per sync: each rank's shards' outer
gradients, compressed: 1/S of the model per rank for S shards per replica. The inner optimizer steps the DTensors
as usual (FSDP's collectives inside the replica); :func:`gradcompress.optim.muon` orthogonalises a sharded matrix
whole (an all-gather of the matrix over the shard group per step).

A model sharded natively over the 2-D mesh (``fully_shard(model, mesh=mesh)``: torchtitan with
``--parallelism.data_parallel_replicate_degree`` > 1) is taken as the same layout: FSDP's own HSDP would all-reduce
the gradients across the replicas every step (nothing left for DiLoCo), so DiLoCo makes every FSDP parameter group
of the model reduce-scatter over the shard dimension only
(:func:`gradcompress.adapters.fsdp_native.reduce_within_shards`: each replica trains on its own between syncs, as
with ``mesh["shard"]``) and syncs across the mesh's dim 0, the replicate dimension; pass no group, or ``mesh=``
that same mesh::

    fully_shard(model, mesh=mesh)                         # (and each block first, as usual)
    opt = DiLoCo(model, muon(model), sync_every=100, codec="int2")

Refused with the recipe: no group (the world would pair different shards), a group whose ranks do not hold the
same shards, some parameters sharded while others are not, and with a natively 2-D sharded model:
``process_group=``, another ``mesh=``, ``manager=`` (torchft), the parameters without their model.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, overload

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from ..adapters.fsdp_native import reduce_within_shards

try:
    from torch.distributed.fsdp import FSDPModule
except ImportError:  # pragma: no cover - torch without FSDP2
    FSDPModule = None  # type: ignore[assignment,misc]


class LocalShards(Sequence[torch.Tensor]):
    """The parameters' local shards as DiLoCo reads and writes them: item i is parameter i's ``to_local()``, a
    detached view of its storage, taken afresh at every access (FSDP may give a parameter a new local tensor: a
    ``load_state_dict(assign=True)``, ``module._apply``)."""

    def __init__(self, params: list[DTensor]):
        self._params = params

    def __len__(self) -> int:
        return len(self._params)

    @overload
    def __getitem__(self, i: int) -> torch.Tensor: ...

    @overload
    def __getitem__(self, i: slice) -> list[torch.Tensor]: ...

    def __getitem__(self, i: int | slice) -> torch.Tensor | list[torch.Tensor]:
        if isinstance(i, slice):
            return [p.to_local().detach() for p in self._params[i]]
        return self._params[i].to_local().detach()


class Shards:
    """The sharded layout of a DiLoCo's parameters (:attr:`layout`, saved in its state dict as ``"shards"``): this
    rank's position in the mesh they are sharded over, each one's placements, global and local shapes (what a
    checkpoint must match)."""

    def __init__(self, params: list[DTensor]):
        mesh = params[0].device_mesh
        self.layout: dict[str, Any] = {
            "coordinate": _shard_coordinate(mesh),
            "placements": [str(p.placements) for p in params],
            "global_shapes": [list(p.shape) for p in params],
            "local_shapes": [list(p.to_local().shape) for p in params]}


def check_shards(shards: Shards | None, saved: dict | None) -> None:
    """A checkpoint's layout (``state["shards"]``, None when saved unsharded) against this DiLoCo's (None:
    unsharded): ``ValueError`` when it was saved with other shards (another mesh position, sharding or model), or
    sharded where this is not (or the reverse)."""
    if shards is None or saved is None:
        if shards is not None or saved is not None:
            raise ValueError(f"DiLoCo: the checkpoint was saved with {'sharded' if saved else 'unsharded'} "
                             f"parameters, these are {'sharded (DTensor)' if shards else 'unsharded'}; resume with "
                             f"the same sharding")
        return
    for key, mine in shards.layout.items():
        if saved.get(key) != mine:
            raise ValueError(f"DiLoCo: the checkpoint's shards differ from this rank's ({key}: saved {saved.get(key)}, "
                             f"here {mine}); resume each rank from its own file, with the same mesh and sharding")


def resolve_shards(params: Sequence[torch.Tensor], process_group: Any, mesh: DeviceMesh | None,
            manager: Any, model: Any = None) -> tuple[Sequence[torch.Tensor], Any, Shards | None]:
    """(the tensors DiLoCo syncs, its group, the layout or None). Plain parameters: returned as they are (``mesh=``
    refused). DTensor parameters: their local shards (:class:`LocalShards`), the replicate group
    (``process_group`` itself, or ``mesh``'s dim 0; the model's own mesh's dim 0 when it is sharded natively over
    a 2-D mesh, whose FSDP modules ``model`` then reduces within the shard dimension only), and the layout;
    checked (module doc)."""
    sharded = [isinstance(p, DTensor) for p in params]
    if not any(sharded):
        if mesh is not None:
            raise ValueError("DiLoCo: mesh= is for a model sharded with fully_shard (DTensor parameters); these "
                             "parameters are not sharded: pass process_group= (or nothing: the world)")
        return params, process_group, None
    if not all(sharded):
        raise ValueError("DiLoCo: some parameters are sharded (DTensor) and some are not; shard the whole model "
                         "(fully_shard(model, mesh=...) at the root too)")
    dtensors: list[DTensor] = [p for p in params if isinstance(p, DTensor)]
    own = _one_mesh(dtensors)
    if own.ndim == 2:  # FSDP's native HSDP: each replica trains apart, synced across the mesh's dim 0
        modules = _native_modules(own, model, process_group, mesh, manager)
        process_group = own.get_group(0)
        _check_peers(dtensors, own, process_group)
        reduce_within_shards(modules)  # only once every check passed: a refused DiLoCo leaves the model as it was
    elif manager is None:
        process_group = _replicate_group(own, process_group, mesh)
        _check_peers(dtensors, own, process_group)
    elif process_group is not None or mesh is not None:
        raise ValueError("DiLoCo: under torchft (manager=...) the outer exchange runs between the replica groups "
                         "of the quorum (the Manager's group joins the same shard of every replica group): "
                         "process_group= and mesh= do not apply")
    return LocalShards(dtensors), process_group, Shards(dtensors)


def _one_mesh(params: list[DTensor]) -> DeviceMesh:
    """The one mesh every parameter is sharded over: 1-D (each replica's own) or 2-D (FSDP's native HSDP);
    refused: several meshes, or more dimensions."""
    own = params[0].device_mesh
    if any(p.device_mesh != own for p in params):
        raise ValueError("DiLoCo: the parameters are sharded over different meshes; shard the model over one mesh "
                         "(each replica's own, or the 2-D (replicate, shard) mesh)")
    if own.ndim not in (1, 2):
        raise ValueError(f"DiLoCo: the model is sharded over a {own.ndim}-D mesh; shard it with fully_shard over "
                         "each replica's own mesh (mesh['shard']) or over the 2-D (replicate, shard) mesh")
    return own


def _shard_coordinate(mesh: DeviceMesh) -> list[int]:
    """This rank's position along the dimension the model is sharded over (the last one: the 1-D mesh's, or a
    native 2-D mesh's dim 1): the same for the ranks of the replicate group, whichever the layout."""
    return list(mesh.get_coordinate() or [])[-1:]


def _native_modules(own: DeviceMesh, model: Any, process_group: Any, mesh: DeviceMesh | None,
                    manager: Any) -> list[torch.nn.Module]:
    """The FSDP modules of ``model``, sharded natively over the 2-D mesh ``own`` (module doc); ``ValueError``
    naming the fix for what does not apply to that layout."""
    if manager is not None:
        raise ValueError("DiLoCo: under torchft (manager=...) the replicas are the Manager's quorum: shard each "
                         "replica group's model over its own 1-D mesh (fully_shard(model, mesh=mesh)), not over a "
                         "2-D (replicate, shard) mesh")
    if process_group is not None or (mesh is not None and mesh != own):
        raise ValueError("DiLoCo: the model is sharded natively over a 2-D (replicate, shard) mesh, which gives "
                         "the layout: DiLoCo syncs across its dim 0; pass no process_group= and no mesh= (or mesh= "
                         "that same mesh)")
    modules: list[torch.nn.Module] = []
    if FSDPModule is not None and isinstance(model, torch.nn.Module):
        modules = [m for m in model.modules() if isinstance(m, FSDPModule)]
    if not modules:
        raise ValueError("DiLoCo: the parameters are sharded over a 2-D mesh: pass the model sharded with "
                         "fully_shard (DiLoCo makes its FSDP modules reduce within the shard dimension only), not "
                         "its parameters")
    return modules


def _ranks(group: Any) -> list[int]:
    return dist.get_process_group_ranks(group)


def _replicate_group(own: DeviceMesh, process_group: Any, mesh: DeviceMesh | None) -> Any:
    """The group of the ranks holding this rank's shard in every replica: ``process_group``, or ``mesh``'s dim 0
    (the model sharded over ``mesh``'s dim 1). Its ranks meet the model's mesh in this rank only."""
    if process_group is not None and mesh is not None:
        raise ValueError("DiLoCo: pass process_group= (the replicate group) or mesh= (the 2-D mesh), not both")
    if mesh is not None:
        if mesh.ndim != 2:
            raise ValueError(f"DiLoCo: mesh= must be a 2-D DeviceMesh (replicate, shard), got {mesh.ndim}-D")
        if _ranks(mesh.get_group(1)) != _ranks(own.get_group()):
            raise ValueError("DiLoCo: the model is not sharded over mesh= 's shard dimension (dim 1); shard it with "
                             "fully_shard(model, mesh=mesh['shard'])")
        process_group = mesh.get_group(0)
    if process_group is None:
        raise ValueError("DiLoCo: the parameters are sharded (DTensor): pass the group of the ranks that hold the "
                         "same shard in every replica, process_group=mesh.get_group('replicate'), or mesh= the 2-D "
                         "(replicate, shard) mesh; the world would average different shards")
    if set(_ranks(process_group)) & set(own.mesh.flatten().tolist()) != {dist.get_rank()}:
        raise ValueError("DiLoCo: process_group must hold this rank and, of the ranks the model is sharded over, only "
                         "this rank: the same shard in every replica (mesh.get_group('replicate'))")
    return process_group


def _check_peers(params: list[DTensor], own: DeviceMesh, group: Any) -> None:
    """Every rank of ``group`` holds the same shards (mesh position, placements, shapes): one all-gather of that
    description over the group at construction; ``ValueError`` on every rank otherwise."""
    mine = (_shard_coordinate(own), [str(p.placements) for p in params], [tuple(p.shape) for p in params],
            [tuple(p.to_local().shape) for p in params])
    everyone: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(everyone, mine, group=group)
    if any(other != everyone[0] for other in everyone):
        raise ValueError("DiLoCo: the ranks of process_group do not hold the same shards (mesh position, placements "
                         "or shapes differ): it must join the same shard of every replica, each replica sharding "
                         "the same model over a mesh of the same shape")


__all__ = ["LocalShards", "Shards", "check_shards", "resolve_shards"]
