"""Bytes and rounds of one step, recorded from the real step (:func:`record_step`): our Compressor, or the
collectives PyTorch's hooks issue (:func:`hook_job`), on :class:`~gradcompress.collectives.RecordingCollectives`
(:mod:`gradcompress.costmodel`)."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence

import torch

from ..codecs.base import Aggregation
from ..collectives import Collectives, Job, RecordingCollectives, drive
from ..compressor import Compressor
from ..exchanges.layout import split
from ..spec import BASELINES, Scheme
from ..topology import Topology
from .sizes import _torch_powersgd_compresses, buckets_for

#: steps run to record one: variable-size codecs' bytes are those of the second compressed step (the first with
#: error-feedback residuals and momentum); fixed-size codecs send the same every step, so their first is recorded
RECORDED_STEPS = 2
#: the scale of :func:`gradients` (normal values times this)
GRADIENT_SCALE = 1e-3


def gradients(shapes: Sequence[Sequence[int]], seed: int = 0) -> list[torch.Tensor]:
    """The gradients the model records a step on and ``plan`` calibrates on: float32 normal values times
    :data:`GRADIENT_SCALE`, one generator seeded ``seed``, tensors in model order (new tensors). Only
    variable-size codecs' bytes depend on them."""
    return [g.clone() for g in _gradients(tuple(tuple(int(d) for d in s) for s in shapes), seed)]


@functools.lru_cache(maxsize=2)
def _gradients(shapes: tuple, seed: int) -> tuple:
    gen = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(s, generator=gen) * GRADIENT_SCALE for s in shapes)


@dataclasses.dataclass(frozen=True)
class Recorded:
    """One step of a scheme as the real step issued it (:func:`record_step`).

    ``workers[j][b][r]``: the collectives (:class:`~gradcompress.collectives.Issued`: kind, bytes, group size,
    link) of round r of bucket b as local rank j of a node issues them; one entry when every worker issues the
    same sizes (flat exchanges, a hierarchical one of fixed-size payloads), ``per_node`` entries otherwise.
    ``per_node``: G of a hierarchical layout (1: flat)."""

    workers: tuple
    per_node: int = 1

    @property
    def buckets(self) -> tuple:
        """Per bucket, the rounds of local rank 0 (the worker whose bytes ``wire_bytes`` reports)."""
        return self.workers[0]

    def sent(self, link: str | None = None, local_rank: int = 0) -> int:
        """Bytes a worker (``local_rank`` of a node) transmits in the step, counted as ``stats()`` does: on every link,
        or on ``link`` only (``"world"``: the flat group; ``"intra"``, ``"inter"``: a node layout's groups)."""
        worker = self.workers[local_rank if len(self.workers) > 1 else 0]
        return sum(c.sent for rounds in worker for r in rounds for c in r if link in (None, c.link))


def hierarchical_supported(scheme: Scheme) -> bool:
    """Whether :func:`predict_nodes` runs the scheme hierarchical: our codecs except PowerSGD (its exchange of whole
    tensors owned by local ranks is recorded by :func:`record_step` and counted by :func:`node_bytes`, but its codec
    work on nodes has no pass counts here: ``plan`` shows it flat)."""
    return scheme.kind == "ours" and scheme.codec.aggregation.value != "lowrank"


def record_step(scheme: Scheme, shapes: Sequence[Sequence[int]], workers: int, bucket_cap: int | None = None,
                per_node: int | None = None) -> Recorded:
    """Bytes and rounds of one step of ``scheme`` on ``workers`` ranks, recorded from the real step: our
    Compressor (warm-up 0, seed 0, the scheme's options but its ``schedule``: the steady state) steps on
    :func:`gradients` with one exchange per DDP bucket (:func:`buckets_for`, each bucket a flat buffer as DDP hands
    it to the hook) on :class:`~gradcompress.collectives.RecordingCollectives`; with ``per_node`` G (2 or more, and
    2 or more nodes) the world is N = workers / G nodes and the exchange hierarchical. PyTorch's baselines:
    :func:`hook_job`. Variable-size codecs: every rank is recorded (N G steps), each collective counted at the most
    its group sent. Cached: the same arguments record once."""
    shapes = tuple(tuple(int(d) for d in s) for s in shapes)
    G = per_node if per_node and per_node > 1 and workers // per_node > 1 else 1
    if workers % G:
        raise ValueError(f"record_step: {per_node} workers per node do not divide {workers} workers")
    return _record(scheme, shapes, int(workers), bucket_cap, G)


@functools.lru_cache(maxsize=64)
def _record(scheme: Scheme, shapes: tuple, workers: int, bucket_cap: int | None, G: int) -> Recorded:
    N = workers // G
    variable = scheme.kind == "ours" and not scheme.codec.fixed_layout
    owners = G > 1 and scheme.kind == "ours" and scheme.codec.aggregation is Aggregation.LOWRANK
    if variable:  # every rank: payload sizes differ by rank (its seed, its pieces)
        ranks = [(n, j) for n in range(N) for j in range(G)]
    else:  # every rank alike, or (PowerSGD's owners) every local rank alike on every node
        ranks = [(0, j) for j in range(G if owners else 1)]
    steps = RECORDED_STEPS if variable else 1
    views = {rank: _record_rank(scheme, shapes, bucket_cap, N, G, rank, steps) for rank in ranks}
    return Recorded(tuple(_combined(views, (0, j)) for j in sorted({j for _, j in ranks})), G)


def _recording(N: int, G: int, node: int, local: int) -> RecordingCollectives:
    """The recording collectives of worker ``local`` of node ``node``; hierarchical (a topology of recording
    sub-groups) for G >= 2."""
    comm = RecordingCollectives(N * G, node * G + local)
    if G > 1:
        comm.topology = Topology(N, G, node, local, comm.sub(G, local, "intra"), comm.sub(N, node, "inter"))
    return comm


def _record_rank(scheme: Scheme, shapes: tuple, bucket_cap: int | None, N: int, G: int, rank: tuple,
                 steps: int) -> tuple:
    """Per bucket, the rounds one worker (``rank`` = (node, local rank)) issues in the last of ``steps`` steps from
    a fresh state (the scheme's ``schedule`` left out: the model predicts the steady state)."""
    comm = _recording(N, G, *rank)
    buckets = buckets_for(scheme, shapes, bucket_cap)
    grads = _gradients(shapes, 0)
    if scheme.kind in BASELINES:
        out = []
        for bucket in buckets:
            drive([hook_job(scheme, comm, [grads[i] for i in bucket])], comm)
            out.append(tuple(comm.take_rounds()))
        return tuple(out)
    options = {**scheme.compressor, "schedule": None, "ramp_steps": 0, "warmup_steps": 0, "seed": 0}
    comp = Compressor(scheme.codec, **options, monitor_every=0)
    for _ in range(steps):
        out = []
        with comp.step(comm) as step:
            for bucket in buckets:  # as DDP's hook: the bucket's flat buffer, the gradients views of it
                buffer = torch.cat([grads[i].reshape(-1) for i in bucket])
                step.drive([step.exchange(list(bucket), split(buffer, [shapes[i] for i in bucket]), buffer)])
                out.append(tuple(comm.take_rounds()))
    return tuple(out)


def _same_group(link: str, a: tuple, b: tuple) -> bool:
    """Whether workers ``a`` and ``b`` ((node, local rank)) are in the same group of ``link``."""
    return link == "world" or (link == "intra" and a[0] == b[0]) or (link == "inter" and a[1] == b[1])


def _combined(views: dict, me: tuple) -> tuple:
    """``me``'s rounds, each collective counted at the most any recorded worker of its group sent in its place: a
    variable-size codec's padded all-gather sends the group's longest payload (fixed sizes: all alike)."""
    out = []
    for b, rounds in enumerate(views[me]):
        out.append(tuple(
            tuple(max((v[b][r][k] for w, v in views.items() if _same_group(c.link, w, me)), key=lambda x: x.sent)
                  for k, c in enumerate(rnd))
            for r, rnd in enumerate(rounds)))
    return tuple(out)


def hook_job(scheme: Scheme, comm: Collectives, tensors: Sequence[torch.Tensor]) -> Job:
    """The collectives PyTorch's hook issues for one DDP bucket, on ``comm``: ``ddp`` (DDP's own all-reduce, as
    ``default_hooks.allreduce_hook``) the float32 bucket; ``torch-fp16`` (``fp16_compress_hook``) its float16
    cast; ``torch-powersgd`` (``powerSGD_hook`` after ``start_powerSGD_iter``) three all-reduces one after the
    other (its future chain): the tensors it leaves uncompressed, the Ps, the Qs."""
    flat = torch.cat([t.reshape(-1) for t in tensors])
    if scheme.kind == "ddp":
        yield [comm.all_reduce(flat)]
        return
    if scheme.kind == "torch-fp16":
        yield [comm.all_reduce(flat.half())]
        return
    dense = ps = qs = 0
    for t in tensors:
        nm = _torch_powersgd_compresses(tuple(t.shape), scheme.rank)
        if nm is None:
            dense += t.numel()
        else:
            r = min(scheme.rank, *nm)
            ps, qs = ps + nm[0] * r, qs + nm[1] * r
    for numel in (dense, ps, qs):
        yield [comm.all_reduce(torch.zeros(numel))]


def wire_bytes(scheme: Scheme, shapes: Sequence[Sequence[int]], workers: int,
               bucket_cap: int | None = None) -> int:
    """Bytes one rank transmits per (compressed) step, as ``stats()["wire_bytes"]`` counts them (recorded)."""
    return record_step(scheme, shapes, workers, bucket_cap).sent()


__all__ = ["GRADIENT_SCALE", "RECORDED_STEPS", "Recorded", "gradients", "hierarchical_supported", "hook_job",
           "record_step", "wire_bytes"]
