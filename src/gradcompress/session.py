"""``Session``: what a Compressor resolves once per process group, and the exchanges it builds for a step.

Resolved at the first step (the same on every rank): the collectives, the check that every rank is configured alike,
the nodes and, where there are 2 or more nodes of 2 or more workers, the hierarchical exchange's collectives. Also
here: the state keys of parameters (by position), and the **divisor** of the mean (the group's size, unless the
session is given another number: a quorum of fewer live workers). Every exchange a step runs is built here, from the
step's codec, and divides by that divisor.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, cast

import torch
import torch.distributed as dist

from . import topology as topology_mod
from .codecs.base import Aggregation, Codec
from .collectives import Collectives, LocalCollectives, ddp_bytes, x_fewer_than_ddp
from .exchanges.dense import DenseExchange
from .exchanges.grouped import GroupExchange, algebra_exchange
from .exchanges.hierarchical import HierarchicalExchange, Hierarchy, piece_key, to_pieces, to_whole
from .exchanges.owners import OwnerExchange
from .exchanges.reduce_scatter import HierarchicalReduceScatter, ReduceScatterExchange
from .exchanges.replicas import ReplicaExchange
from .spec import make

if TYPE_CHECKING:
    from .config import Config
    from .state import State

NOT_INITIALISED = (
    "gradcompress: torch.distributed is not initialised, so there is no group to average over; call "
    "torch.distributed.init_process_group(...) first (or launch with torchrun, then init_process_group). "
    "For a single process without torch.distributed, pass the collectives explicitly: "
    "compressor.synchronize(params, collectives=gradcompress.collectives.LocalCollectives(1)) or "
    "compressor.begin_step(gradcompress.collectives.LocalCollectives(1))")


def default_group() -> dist.ProcessGroup | None:
    """The default process group, or None when ``torch.distributed`` is not initialised."""
    return dist.group.WORLD if dist.is_available() and dist.is_initialized() else None


def _same_group(a: dist.ProcessGroup | None, b: dist.ProcessGroup | None) -> bool:
    world = dist.group.WORLD
    return (a if a is not None else world) is (b if b is not None else world)


class Session:
    """The group a Compressor averages over (``process_group``, None: the world), resolved once.

    ``divisor``: a callable giving the number the mean divides by at each step (default: the group's size)."""

    def __init__(self, config: Config, process_group: dist.ProcessGroup | None = None,
                 divisor: Callable[[], int] | None = None) -> None:
        self.config, self.group = config, process_group
        self.comm: Collectives | None = None
        self.hierarchy: Hierarchy | None = None
        self.nodes: list[list[int]] | None = None
        self.key_of: dict[int, int] = {}
        self.params_checked = False  # synchronize's one check that the replicas start equal
        self.resolved = False
        self._divisor = divisor
        self.dense_codec = make("none")  # the codec of dense steps on paths that encode anyway (FSDP)

    # ---------------------------------------------------------------- the group
    def bind(self, group: dist.ProcessGroup | None) -> None:
        """Average over ``group`` (an adapter's: the DDP model's, FSDP's); an error if another group was given."""
        if self.group is None:
            self.group = group
        elif not _same_group(self.group, group):
            raise ValueError("gradcompress: the Compressor's process_group is not the group the model averages "
                             "over (DistributedDataParallel(..., process_group=...)); pass the same group, or none "
                             "to use the model's")

    def open(self, collectives: Collectives | None) -> Collectives:
        """The collectives of this step (``collectives`` if given), resolved and checked once."""
        if collectives is not None:
            self.comm = collectives
        if self.comm is None:
            if not (dist.is_available() and dist.is_initialized()):
                raise RuntimeError(NOT_INITIALISED)
            self.comm = Collectives(self.group)
        return self.comm

    def resolve(self) -> None:
        """Check once that every rank is configured alike and find the nodes (one small all-gather; later calls do
        nothing, unless this one raised)."""
        if not self.resolved:
            self._resolve()
            self.resolved = True

    def _resolve(self) -> None:
        c = self.config
        comm = cast(Collectives, self.comm)  # resolved at the first step, after open()
        text = f"{c.text()} topology={topology_mod.describe(c.topology)} intra_node={c.intra_node}"
        keys = comm.check_same(text, "gradcompress", topology_mod.node_key() if c.topology == "auto" else None)
        local = comm if isinstance(comm, LocalCollectives) else None
        # no group; the cost model's recording may carry N x G workers
        if local is not None and local.topology is None:
            return
        option = local.topology if local is not None else c.topology
        self.nodes = topology_mod.nodes_of(option, comm.group, keys)
        if self.nodes is None or len(self.nodes) < 2 or len(self.nodes[0]) < 2:
            return
        whole = c.codec.aggregation is Aggregation.LOWRANK
        # not None: two nodes or more, of two workers or more (checked above as build checks it)
        layout = cast(topology_mod.Topology, topology_mod.build_topology(option, self.nodes, comm.group))
        self.hierarchy = Hierarchy(layout, c.intra_node, owners=whole)

    def world(self) -> int:
        """The size of the group (known before the first step where torch.distributed is initialised)."""
        if self.comm is not None:
            return self.comm.world
        if dist.is_available() and dist.is_initialized():
            return dist.get_world_size(self.group)
        return 1

    def divisor(self) -> int:
        """What this step's mean divides by: the group's size, or the number the session was given."""
        return cast(Collectives, self.comm).world if self._divisor is None else int(self._divisor())  # after open()

    # ---------------------------------------------------------------- keys
    def keys_for(self, parameters: Iterable[torch.nn.Parameter]) -> list[int]:
        """State keys of ``parameters``: their positions as indexed, or the order in which they are first seen."""
        keys = []
        for p in parameters:
            if id(p) not in self.key_of:
                self.key_of[id(p)] = len(self.key_of)
            keys.append(self.key_of[id(p)])
        return keys

    def index_parameters(self, parameters: Iterable[torch.nn.Parameter]) -> None:
        params = [p for p in parameters if p.requires_grad]
        self.key_of = {id(p): i for i, p in enumerate(params)}

    # ---------------------------------------------------------------- exchanges
    def exchange(self, codec: Codec | None, force_dense: bool, buffer: torch.Tensor | None, monitored: bool,
                 flat: bool = False) -> OwnerExchange | HierarchicalExchange | DenseExchange | GroupExchange:
        """The exchange of a group of tensors at a step with ``codec`` (None: dense); ``flat``: not hierarchical
        even where the session has nodes (the autopilot's choice). A low-rank codec on a layout of flat pieces
        (the autopilot's: its session was not built for one codec) travels flat: PowerSGD needs whole matrices."""
        c, comm = self.config, cast(Collectives, self.comm)  # a step's exchanges: after open()
        if self.hierarchical(codec, flat) and not force_dense:  # dense inside each node, the codec's between
            return cast(Hierarchy, self.hierarchy).exchange(codec, c.seed, c.min_numel)  # hierarchical(): not None
        if codec is None or codec.exact:  # dense: DDP's own all-reduce (plus momentum correction)
            return DenseExchange(comm, buffer, monitored)
        return GroupExchange(comm, codec, algebra_exchange(comm, codec, c.seed), c.min_numel)

    def hierarchical(self, codec: Codec | None, flat: bool = False) -> bool:
        """Whether a group with ``codec`` travels hierarchically (see :meth:`exchange`)."""
        h = self.hierarchy
        if h is None or flat:
            return False
        return h.owners or codec is None or codec.aggregation is not Aggregation.LOWRANK

    def reduce_scatter(self, codec: Codec | None, scale: float,
                       flat: bool = False) -> HierarchicalReduceScatter | ReduceScatterExchange:
        """FSDP's compressed reduce-scatter (dense inside each node, compressed between, where hierarchical and
        not ``flat``)."""
        h = self.hierarchy
        if h is not None and not flat:
            return HierarchicalReduceScatter(h.intra, h.inter, codec, self.dense_codec, h.cast, scale)
        return ReduceScatterExchange(cast(Collectives, self.comm), codec, self.dense_codec, scale)  # after open()

    def replicas(self, codec: Codec | None) -> ReplicaExchange | None:
        """HSDP's replica all-reduce of a shard (None: flat, the plain exchange does it)."""
        h = self.hierarchy
        return None if h is None else ReplicaExchange(h.intra, h.between(codec, self.config.seed))

    def relayout(self, state: State, shapes: Mapping[Hashable, Sequence[int]], hierarchical: bool) -> None:
        """Move the per-worker state of the keys ``shapes`` (key -> tensor shape) to the other layout, between two
        steps, on every rank together (the autopilot's switch between flat and hierarchical): residuals and
        momentum (gradient space) keep their mean over the workers — to pieces by a reduce-scatter inside each node,
        back to whole tensors without communication (:func:`~.exchanges.hierarchical.to_pieces`, ``to_whole``),
        added to what the other layout holds for the key — so error feedback loses nothing; server residuals (per
        chunk owner, a layout's own) start at zero."""
        h = cast(Hierarchy, self.hierarchy)  # a switch between layouts: the session has nodes
        parts, me = h.intra.world, h.intra.rank
        for slot in ("residual", "momentum"):
            values = state.slots[slot]
            if hierarchical:
                moved, gone = to_pieces(h.intra, values, shapes), [k for k in shapes if k in values]
            else:
                moved, gone = to_whole(parts, me, values, shapes), [piece_key(k, me, parts) for k in shapes]
            state.forget((slot,), gone)
            state.add(slot, moved)
        state.forget(("server_residual",), list(state.slots["server_residual"]))

    # ---------------------------------------------------------------- what it sent
    def bytes(self) -> tuple[int, int, int]:
        """(bytes sent between nodes, inside a node, telemetry's)."""
        flat = self.comm.wire_bytes if self.comm else 0
        monitor = self.comm.monitor_bytes if self.comm else 0
        if self.hierarchy is not None:
            intra, inter = self.hierarchy.intra, self.hierarchy.inter
            return flat + inter.wire_bytes, intra.wire_bytes, monitor + intra.monitor_bytes + inter.monitor_bytes
        if self.nodes is not None and len(self.nodes) == 1:
            return 0, flat, monitor
        return flat, 0, monitor

    def stats(self, totals: Mapping[str, Any]) -> dict[str, Any]:
        """``Compressor.stats()``'s counters: the state's ``totals`` with what this session's collectives sent."""
        inter, intra, monitor = self.bytes()
        # the group's size as the exchanges saw it (nothing exchanged yet: nothing to compare; asking the group
        # itself is a call into it, which torchft's managed group answers from its live quorum)
        wire, raw, world = inter + intra, totals["raw_bytes"], self.comm.world if self.comm is not None else 1
        return {"steps": totals["steps"], "skipped": totals["skipped"], "raw_bytes": raw, "wire_bytes": wire,
                "ratio": raw / wire if wire else float("inf") if raw else 1.0,
                "ddp_bytes": ddp_bytes(raw, world), "x_fewer_than_ddp": x_fewer_than_ddp(raw, wire, world),
                "codec_seconds": totals["codec_seconds"], "comm_seconds": self.comm.comm_seconds if self.comm else 0.0,
                "monitor_bytes": monitor, "inter_node_bytes": inter, "intra_node_bytes": intra,
                "topology": self.topology_stats(), "param_bytes": totals["param_bytes"]}

    def topology_text(self) -> str:
        """The resolved topology as a checkpoint records it (``"flat"``, or ``"NxG intra_node=..."``)."""
        if self.hierarchy is None:
            return "flat"
        return f"{self.hierarchy.topology.text} intra_node={self.config.intra_node}"

    def check_topology(self, saved: str | None) -> None:
        """A loaded state's topology (None: none loaded) must be this group's (its keys are pieces of a G-way cut)."""
        now = self.topology_text()
        if saved is not None and saved != now:
            raise ValueError(f"Compressor.load_state_dict: the state was saved with topology {saved!r}, this "
                             f"compressor runs {now!r}; resume with the same topology")

    def topology_stats(self) -> dict[str, Any]:
        nodes = self.nodes
        return {"nodes": len(nodes) if nodes else None, "workers_per_node": len(nodes[0]) if nodes else None,
                "kind": "flat" if self.hierarchy is None else "hierarchical"}


__all__ = ["Session", "default_group"]
