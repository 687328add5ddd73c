"""Which workers of a process group share a node: the layout the hierarchical exchange runs on.

``topology`` (a :class:`~gradcompress.Compressor` option) names it:

* ``"auto"`` (default): from torchrun's environment (``LOCAL_WORLD_SIZE`` and ``GROUP_RANK``), else from
  ``LOCAL_RANK``/``RANK`` (ranks contiguous per node: the node's first rank is ``RANK - LOCAL_RANK``), else from
  the hostname. Each rank's node key is gathered once (one small all-gather, riding on the configuration check of
  the first step) and every rank derives the same layout from the same list;
* ``"flat"``: no layout, today's exchange;
* an ``int`` G: the group's ranks in consecutive blocks of G per node (G must divide the group's size);
* a 2-D ``DeviceMesh``: dim 0 between nodes, dim 1 inside a node;
* a :class:`Topology` built from two process groups (:meth:`Topology.of_groups`: HSDP's shard group inside the
  node, its replicate group between), as ``register_fsdp(..., replicate_group=...)`` does.

:func:`resolve` returns a :class:`Topology` (with the intra-node group of this rank's node and the inter-node group
of the workers with this rank's local rank on every node) when the group spans 2 or more nodes of 2 or more of its
workers each; otherwise None: the exchange stays flat, bit for bit today's. Nodes with different numbers of the
group's workers are a ``ValueError`` naming them.
"""

from __future__ import annotations

import dataclasses
import os
import socket
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, TypeGuard, cast

import torch.distributed as dist

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

TOPOLOGIES = ("auto", "flat")
INTRA_NODE = ("none", "bf16", "fp16")


def _is_mesh(topology: object) -> TypeGuard[DeviceMesh]:
    try:
        from torch.distributed.device_mesh import DeviceMesh
    except ImportError:  # pragma: no cover - old torch
        return False
    return isinstance(topology, DeviceMesh)


def check_topology(topology: object, intra_node: str) -> None:
    """``ValueError`` naming what is allowed, for a bad ``topology`` or ``intra_node`` option."""
    if intra_node not in INTRA_NODE:
        raise ValueError(f"Compressor: intra_node must be one of {', '.join(INTRA_NODE)}, got {intra_node!r}")
    if isinstance(topology, str) and topology in TOPOLOGIES:
        return
    if isinstance(topology, int) and not isinstance(topology, bool) and topology >= 1:
        return
    if _is_mesh(topology) and topology.ndim == 2:
        return
    if isinstance(topology, Topology):
        return
    raise ValueError(f"Compressor: topology must be 'auto', 'flat', an integer >= 1 (workers per node) or a 2-D "
                     f"DeviceMesh (dim 0 between nodes, dim 1 inside a node), got {topology!r}")


def describe(topology: object) -> str:
    """The option as one word, for the configuration check across ranks."""
    if _is_mesh(topology):
        return f"mesh{tuple(topology.mesh.shape)}"
    if isinstance(topology, Topology):
        return f"groups{topology.text}"
    return str(topology)


@dataclasses.dataclass(frozen=True)
class Topology:
    """A hierarchical layout: ``nodes`` N nodes of ``workers_per_node`` G workers each; this rank is worker
    ``local_rank`` of node ``node``. ``intra``: the process group of this node's workers (rank = local rank);
    ``inter``: the process group of the workers with this local rank on every node (rank = node)."""

    nodes: int
    workers_per_node: int
    node: int
    local_rank: int
    intra: object = dataclasses.field(repr=False, compare=False)
    inter: object = dataclasses.field(repr=False, compare=False)

    @property
    def text(self) -> str:
        """``"NxG"``, as the state records it."""
        return f"{self.nodes}x{self.workers_per_node}"

    @classmethod
    def of_groups(cls, intra: dist.ProcessGroup, inter: dist.ProcessGroup) -> Topology:
        """The layout of two process groups: ``intra`` this rank's node (e.g. HSDP's shard group), ``inter`` the
        workers with this rank's local rank on every node (HSDP's replicate group)."""
        return cls(dist.get_world_size(inter), dist.get_world_size(intra), dist.get_rank(inter),
                   dist.get_rank(intra), intra, inter)

    def members(self) -> list[list[int]]:
        """Ranks per node in the world group the two groups span (rank = node * G + local rank)."""
        g = self.workers_per_node
        return [list(range(n * g, (n + 1) * g)) for n in range(self.nodes)]


def node_key() -> str:
    """This process's node, as the environment says: torchrun's ``GROUP_RANK``, else the node's first rank from
    ``RANK - LOCAL_RANK``, else the hostname."""
    env = os.environ
    if "GROUP_RANK" in env and "LOCAL_WORLD_SIZE" in env:
        return f"GROUP_RANK={env['GROUP_RANK']} LOCAL_WORLD_SIZE={env['LOCAL_WORLD_SIZE']}"
    if "LOCAL_RANK" in env and "RANK" in env:
        return f"first RANK={int(env['RANK']) - int(env['LOCAL_RANK'])}"
    return f"host={socket.gethostname()}"


def gather_keys(group: dist.ProcessGroup | None) -> list[str]:
    """Every rank's :func:`node_key`, in group rank order (one small all-gather)."""
    keys: list[Any] = [None]  # all_gather_object fills it with every rank's str * dist.get_world_size(group)
    dist.all_gather_object(keys, node_key(), group=group)
    return keys


def members_of(keys: Sequence[str]) -> list[list[int]]:
    """The group's ranks per node (ascending; nodes in the order of their first rank), from each rank's node key;
    ``ValueError`` naming the nodes when their sizes differ, or when torchrun's sizes disagree with them."""
    nodes: dict[str, list[int]] = {}
    for rank, key in enumerate(keys):
        nodes.setdefault(key, []).append(rank)
    kinds = {key.split("=")[0] for key in nodes}
    if len(kinds) > 1:
        raise ValueError(f"gradcompress: topology='auto': ranks describe their node differently ({sorted(kinds)}); "
                         "launch every rank the same way, or pass topology= explicitly")
    sizes = {len(ranks) for ranks in nodes.values()}
    if len(sizes) > 1:
        listed = "; ".join(f"node {key!r}: {len(r)} workers (ranks {', '.join(map(str, r))})"
                           for key, r in nodes.items())
        raise ValueError(f"gradcompress: the nodes hold different numbers of the group's workers ({listed}); the "
                         "hierarchical exchange needs the same number per node: pass topology='flat'")
    return list(nodes.values())


def _blocks(world: int, per_node: int) -> list[list[int]]:
    if world % per_node:
        raise ValueError(f"gradcompress: topology={per_node} (workers per node) does not divide the group's "
                         f"{world} workers")
    return [list(range(i, i + per_node)) for i in range(0, world, per_node)]


def nodes_of(topology: object, group: dist.ProcessGroup | None,
             keys: Sequence[str] | None = None) -> list[list[int]] | None:
    """The group's ranks per node under ``topology`` (None for ``"flat"``); ``keys``: the gathered node keys
    (``"auto"``; gathered here when not given)."""
    if topology == "flat":
        return None
    if isinstance(topology, Topology):
        return topology.members()
    world = dist.get_world_size(group)
    if _is_mesh(topology):
        n, g = topology.mesh.shape
        if n * g != world:
            raise ValueError(f"gradcompress: the DeviceMesh holds {n * g} ranks, the group {world}")
        return _blocks(world, g)
    if topology == "auto":
        return members_of(keys if keys is not None else gather_keys(group))
    return _blocks(world, cast(int, topology))  # check_topology() lets only an int >= 1 reach here


def _global(group: dist.ProcessGroup | None, ranks: list[int]) -> list[int]:
    if group is None or group is dist.group.WORLD:
        return list(ranks)
    return [dist.get_global_rank(group, r) for r in ranks]


def build_topology(topology: object, members: list[list[int]] | None, group: dist.ProcessGroup | None) -> Topology | None:
    """The :class:`Topology` of ``members`` (every rank creates every intra and inter group, in the same order),
    or None when it is not hierarchical (fewer than 2 nodes, or fewer than 2 workers per node)."""
    if members is None or len(members) < 2 or len(members[0]) < 2:
        return None
    if isinstance(topology, Topology):
        return topology
    me = dist.get_rank(group)
    node = next(i for i, ranks in enumerate(members) if me in ranks)
    local = members[node].index(me)
    if _is_mesh(topology):
        return Topology(len(members), len(members[0]), topology.get_local_rank(0), topology.get_local_rank(1),
                        topology.get_group(1), topology.get_group(0))
    local_sync = not (group is None or group is dist.group.WORLD)
    kw: dict[str, Any] = {"use_local_synchronization": True} if local_sync else {}
    intra = [dist.new_group(_global(group, ranks), **kw) for ranks in members]
    inter = [dist.new_group(_global(group, [ranks[j] for ranks in members]), **kw) for j in range(len(members[0]))]
    return Topology(len(members), len(members[0]), node, local, intra[node], inter[local])


def resolve(topology: object, group: dist.ProcessGroup | None = None,
            keys: Sequence[str] | None = None) -> Topology | None:
    """The hierarchical :class:`Topology` of ``group`` under ``topology``, or None (flat); see the module doc."""
    return build_topology(topology, nodes_of(topology, group, keys), group)


__all__ = ["INTRA_NODE", "TOPOLOGIES", "Topology", "build_topology", "check_topology", "describe", "gather_keys",
           "members_of", "node_key", "nodes_of", "resolve"]
