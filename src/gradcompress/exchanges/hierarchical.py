"""The hierarchical exchange: dense inside a node, the codec's own exchange between nodes, on 1/G of the gradients.

For N nodes of G workers (``topology=`` of the Compressor, :mod:`gradcompress.topology`), worker j of a node:

1. inside the node, a reduce-scatter of the group's tensors: each tensor is cut into G pieces of ceil(n / G)
   elements (the last zero-padded), piece j of every tensor in block j; what is sent: (G-1)/G of the group's
   bytes, in the gradients' dtype or in bf16/fp16 (``intra_node``, as BytePS does: 16-bit on the wire and in the
   sum). Worker j then holds its node's sum of the pieces j, divided by G the node mean;
2. between nodes, the inner exchange (the codec's, :class:`~.grouped.GroupExchange` over the algebra's exchange,
   or a dense all-reduce for ``none`` and warm-up steps) of these pieces among the workers with local rank j on
   every node, averaged over the N nodes. Each piece is its own state key (``"<key>:<j>/<G>"``, independent of how tensors are bucketed):
   worker error feedback and momentum correction act on the piece this worker sends, so a residual costs 1/G of
   a gradient; pieces of tensors below ``min_numel`` travel dense;
3. inside the node, an all-gather of the averaged pieces and one finiteness flag per worker (in the same dtype as
   step 1), scattered back into the gradients.

Bias: the inner codec's, on node means instead of single workers' gradients (plus the 16-bit rounding of the
``intra_node`` casts, both ways). Between nodes each worker sends the codec's payload of 1/G of the gradients, so a
node's uplink carries about 2 c (N-1)/N for a codec of c bytes per gradient instead of G c (N-1)/N flat.
When to use: several workers per node on a fast link inside (NVLink, PCIe, shared memory) and a slow one between.
PowerSGD needs whole matrices: its hierarchical exchange assigns whole tensors to local ranks instead
(:mod:`.owners`, ``Hierarchy(..., owners=True)``).

Finiteness: the inner exchange's checks hold on its sub-group only (a NaN in one worker's gradient reaches only
the piece that holds it); they become this worker's flag, gathered inside the node with the result, and the step
reads the gathered buffer: a NaN/Inf on any worker of any node makes every rank's result non-finite and the
decision the same everywhere.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Hashable, Mapping, Sequence, Set
from typing import TYPE_CHECKING, cast

import torch

from ..codecs.base import Codec
from ..collectives import Collectives, Job
from .context import Context
from .dense import DenseExchange
from .grouped import GroupExchange, algebra_exchange
from .layout import split
from .lowrank import LowRankExchange
from .owners import OwnerExchange, gather_node, wire_dtype

if TYPE_CHECKING:
    import torch.distributed as dist

    from ..topology import Topology

#: the exchange between nodes (on ``inter``): dense, or the codec's
Between = DenseExchange | GroupExchange

CASTS = {"none": None, "bf16": torch.bfloat16, "fp16": torch.float16}


def piece_numel(numel: int, parts: int) -> int:
    """Elements of each of a tensor's ``parts`` pieces: ceil(numel / parts)."""
    return -(-numel // parts)


def piece_key(key: Hashable, local_rank: int, parts: int) -> str:
    """The state key of piece ``local_rank`` of ``parts`` of the tensor ``key`` (a string: checkpoints keep it)."""
    return f"{key}:{local_rank}/{parts}"


class Hierarchy:
    """The collectives of a hierarchical topology, kept across steps (their byte counters are
    ``stats()["intra_node_bytes"]`` and ``["inter_node_bytes"]``): ``intra`` on this node's workers, ``inter`` on
    the workers of this local rank on every node; ``intra_node``: the dtype of the traffic inside the node;
    ``owners``: whole tensors owned by local ranks (:mod:`.owners`, PowerSGD's layout, on every step, warm-up
    included, so that state keys stay whole tensors) instead of flat 1/G pieces."""

    def __init__(self, topology: Topology, intra_node: str = "none", owners: bool = False) -> None:
        self.topology, self.owners = topology, owners
        self.assigned: dict[Hashable, int] = {}  # owners=True: key -> the local rank that owns it (kept across steps)
        # process groups, or collectives ready made (the cost model's RecordingCollectives), used as they are
        self.intra, self.inter = _collectives(topology.intra), _collectives(topology.inter)
        self.cast = CASTS[intra_node]

    def exchange(self, codec: Codec | None, seed: int, min_numel: int) -> OwnerExchange | HierarchicalExchange:
        """The hierarchical exchange of a step with ``codec`` (None or exact: dense)."""
        dense = codec is None or codec.exact
        if self.owners:
            inner = DenseExchange(self.inter) if dense or codec is None else GroupExchange(  # (None: dense)
                self.inter, codec, LowRankExchange(self.inter, codec, seed), min_numel)
            return OwnerExchange(self.intra, inner, self.cast, self.assigned)
        return HierarchicalExchange(self.intra, lambda small: self.between(codec, seed, small), self.cast, min_numel)

    def between(self, codec: Codec | None, seed: int, dense_keys: Set[Hashable] = frozenset()) -> Between:
        """The exchange between nodes alone (on ``inter``): the codec's (``dense_keys`` sent dense), or dense for
        None or an exact codec."""
        if codec is None or codec.exact:
            return DenseExchange(self.inter)
        return GroupExchange(self.inter, codec, algebra_exchange(self.inter, codec, seed), 0, dense_keys)


def _collectives(group: object) -> Collectives:
    """The collectives of a process group, or collectives ready made (the cost model's RecordingCollectives) as they
    are (a :class:`~gradcompress.topology.Topology` holds either)."""
    return group if isinstance(group, Collectives) else Collectives(cast("dist.ProcessGroup | None", group))


def fill_blocks(send: torch.Tensor, tensors: Sequence[torch.Tensor], per: Sequence[int],
                offsets: Sequence[int]) -> torch.Tensor:
    """Write piece j (``per[i]`` elements from ``j * per[i]``) of each tensor i into row j of ``send`` at column
    ``offsets[i]`` (the reduce-scatter's G blocks; what is not written stays as it was: zero padding)."""
    for g, o, p in zip(tensors, offsets, per):
        flat = g.detach().reshape(-1)
        rows, rest = divmod(flat.numel(), p) if p else (0, 0)
        send[:rows, o : o + p] = flat[: rows * p].view(rows, p)
        if rest:
            send[rows, o : o + rest] = flat[rows * p :]
    return send


class HierarchicalExchange:
    """Reduce-scatter inside the node, the exchange between nodes on the pieces, all-gather inside (module doc); in
    place. ``between(dense_keys)``: the exchange between nodes, with the piece keys it must send dense."""

    def __init__(self, intra: Collectives, between: Callable[[Set[Hashable]], Between], cast: torch.dtype | None,
                 min_numel: int) -> None:
        self.intra, self.between, self.cast, self.min_numel = intra, between, cast, min_numel

    def _wire_dtype(self, grads: Sequence[torch.Tensor]) -> torch.dtype:
        return wire_dtype(self.cast, grads)

    def _blocks(self, ctx: Context, keys: Sequence[Hashable], grads: Sequence[torch.Tensor], per: Sequence[int],
                offsets: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
        """The reduce-scatter's input: G blocks, block j = piece j of every tensor (padding stays zero)."""
        parts = self.intra.world
        send = ctx.zeroed("intra send", tuple(keys), parts * offsets[-1], dtype, grads[0].device).view(parts, -1)
        return fill_blocks(send, grads, per, offsets)

    def job(self, ctx: Context, keys: Sequence[Hashable], grads: Sequence[torch.Tensor],
            outs: Sequence[torch.Tensor]) -> Job:
        if not grads:
            return
        parts, me = self.intra.world, self.intra.rank
        per = [piece_numel(g.numel(), parts) for g in grads]
        offsets = [0, *itertools.accumulate(per)]
        dtype = self._wire_dtype(grads)
        shard, work = self.intra.reduce_scatter(self._blocks(ctx, keys, grads, per, offsets, dtype))
        yield [work]
        shard = shard.float().div_(parts)  # the node mean of this worker's pieces
        pkeys = [piece_key(k, me, parts) for k in keys]
        small = frozenset(pk for pk, g in zip(pkeys, grads) if g.numel() < self.min_numel)
        between = self.between(small)
        inner = ctx.apart(between.comm.world)
        pieces = split(shard, [(p,) for p in per])
        yield from between.job(inner, pkeys, pieces, pieces)
        gathered = yield from gather_node(self.intra, ctx, inner, shard, dtype)
        self._land(gathered, grads, per, offsets)

    @staticmethod
    def _land(gathered: torch.Tensor, grads: Sequence[torch.Tensor], per: Sequence[int],
              offsets: Sequence[int]) -> None:
        """The gathered pieces back into the gradients; every worker's flag added to each gradient's first element
        (0 when every worker was finite, NaN else: the result is then non-finite on every rank)."""
        flags = gathered[:, -1].float().sum()
        for g, o, p in zip(grads, offsets, per):
            if g.numel():
                g.copy_(gathered[:, o : o + p].reshape(-1)[: g.numel()].view(g.shape))
                g[(0,) * g.dim()].add_(flags)


def to_pieces(intra: Collectives, whole: Mapping[Hashable, torch.Tensor],
              shapes: Mapping[Hashable, Sequence[int]]) -> dict[Hashable, torch.Tensor]:
    """Per-worker tensors in gradient space (``whole``: key -> tensor of ``shapes[key]``, e.g. flat error-feedback
    residuals) as this worker's pieces of their node mean (piece key -> tensor, the hierarchical exchange's state):
    one reduce-scatter inside the node (every worker of the node calls it with the same keys). The mean over the
    workers is kept: the pieces' mean over nodes equals the tensors' mean over every worker."""
    keys = [k for k in shapes if k in whole]
    if not keys:
        return {}
    parts, me = intra.world, intra.rank
    per = [piece_numel(torch.Size(shapes[k]).numel(), parts) for k in keys]
    offsets = [0, *itertools.accumulate(per)]
    send = torch.zeros(parts, offsets[-1], dtype=torch.float32, device=whole[keys[0]].device)
    shard, work = intra.reduce_scatter(fill_blocks(send, [whole[k].float() for k in keys], per, offsets))
    intra.wait([work])
    shard.div_(parts)
    return {piece_key(k, me, parts): shard[o : o + p].to(whole[k].dtype).clone()
            for k, o, p in zip(keys, offsets, per)}


def to_whole(parts: int, me: int, pieces: Mapping[Hashable, torch.Tensor],
             shapes: Mapping[Hashable, Sequence[int]]) -> dict[Hashable, torch.Tensor]:
    """The inverse of :func:`to_pieces` without communication: worker ``me`` holds ``parts`` times its piece, zeros
    elsewhere (key -> tensor of ``shapes[key]``): the mean over every worker equals the pieces' mean over nodes."""
    out: dict[Hashable, torch.Tensor] = {}
    for k, shape in shapes.items():
        piece = pieces.get(piece_key(k, me, parts))
        if piece is None:
            continue
        numel = torch.Size(shape).numel()
        p = piece_numel(numel, parts)
        whole = torch.zeros(numel, dtype=piece.dtype, device=piece.device)
        n = max(min(p, numel - me * p), 0)
        whole[me * p : me * p + n] = piece[:n] * parts
        out[k] = whole.view(shape)
    return out


__all__ = ["CASTS", "Hierarchy", "HierarchicalExchange", "piece_key", "piece_numel", "to_pieces", "to_whole"]
