"""FSDP2's native HSDP (a model sharded with ``fully_shard`` over a 2-D ``(replicate, shard)`` mesh, as torchtitan
builds it with ``--parallelism.data_parallel_replicate_degree``), made compressible.

FSDP2 all-reduces each shard across the replicas itself, dense (``dist.all_reduce`` inside ``foreach_reduce``, no
extension point), and its all-reduce hook runs after that. :func:`reduce_within_shards` turns each parameter group's
reduction into the 1-D layout the compressed HSDP of :mod:`gradcompress.adapters.fsdp` already drives: the group's
``mesh_info`` (the one FSDP reads its reduce-scatter and all-reduce groups from) becomes the shard dimension's
alone, so FSDP reduce-scatters over the shard group and hands the result to the all-reduce hook, which averages it
across the replicas through the codec. Everything else is untouched: the parameters stay DTensors on the 2-D mesh
(``Replicate, Shard(0)``), the all-gathers run over the shard group as before, checkpoints see the same layout.

What FSDP would have done across the replicas: the mean (AVG), or the sum where a gradient divide factor is set
(torchtitan sets 1.0 and normalises the loss by the global token count itself): :func:`replica_scale`.

This reaches into FSDP2's ``FSDPParamGroup.mesh_info`` and ``post_forward_mesh_info`` (torch 2.13,
``torch/distributed/fsdp/_fully_shard/_fsdp_param_group.py``): a torch whose FSDP lacks them is refused with a
clear error at registration, never silently left dense.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

try:
    from torch.distributed.fsdp._fully_shard._fsdp_common import FSDPMeshInfo, HSDPMeshInfo
except ImportError:  # pragma: no cover - torch without FSDP2
    FSDPMeshInfo = HSDPMeshInfo = None  # type: ignore[assignment,misc]


def _param_groups(module: torch.nn.Module) -> list:
    return list(module._get_fsdp_state()._fsdp_param_groups)  # type: ignore[operator]  # FSDPModule's own method


def reduce_within_shards(modules: list[torch.nn.Module]) -> None:
    """Make every FSDP parameter group of ``modules`` reduce over its shard dimension only (module doc); a
    ``RuntimeError`` where torch's FSDP2 is not laid out as this expects."""
    for module in modules:
        for group in _param_groups(module):
            info = getattr(group, "mesh_info", None)
            if FSDPMeshInfo is None or not isinstance(info, HSDPMeshInfo):
                if FSDPMeshInfo is not None and isinstance(info, FSDPMeshInfo):
                    continue  # already the shard dimension's (a second registration)
                raise RuntimeError("gradcompress FSDP: cannot compress this torch's native HSDP (its FSDP parameter "
                                   f"group holds {type(info).__name__}); shard over mesh['shard'] and pass mesh=")
            shard = FSDPMeshInfo(info.mesh, shard_mesh_dim=info.shard_mesh_dim, dp_mesh_dims=info.dp_mesh_dims,
                                 spmd_mesh=info.spmd_mesh)
            shard.reduce_scatter_process_group = info.reduce_scatter_process_group
            if group.post_forward_mesh_info is info:  # resharded to the full shard group after forward
                group.post_forward_mesh_info = shard
            group.mesh_info = shard


def replica_scale(module: torch.nn.Module, replicas: int) -> Callable[[], float]:
    """What the replicas' mean is multiplied by to give what FSDP's native all-reduce would: ``replicas`` (a sum)
    where the group has a gradient divide factor when it reduces, else 1 (the mean)."""
    groups = _param_groups(module)

    def scale() -> float:
        return float(replicas) if any(g.gradient_divide_factor is not None for g in groups) else 1.0

    return scale


__all__ = ["reduce_within_shards", "replica_scale"]
