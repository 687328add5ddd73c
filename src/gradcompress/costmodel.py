"""An alpha-beta model of one data-parallel training step with gradient compression, timing the bytes and rounds
of collectives recorded from the real step (:func:`record_step`).

Used by ``gradcompress plan``; checked against ``gradcompress netbench`` in BENCHMARKS.md.
Units: bytes, seconds; a link's payload bandwidth ``B`` in bytes/s (:func:`payload_bandwidth`
turns a link rate in bit/s into it), ``alpha`` the fixed cost of one message step (the
one-way latency plus a software overhead per message).

Collectives, W workers, each behind its own full-duplex link (as ``Collectives`` counts them):

* all-reduce of M bytes (ring: reduce-scatter + all-gather):  2(W-1)/W M/B + 2(W-1) alpha
* all-gather of M bytes per rank (ring):                        (W-1) M/B + (W-1) alpha
* all-to-all of M bytes per rank (equal blocks):               (W-1)/W M/B + (W-1) alpha
* two-step reduce of a compressed size Mc (all-to-all + all-gather of the Mc/W re-encoded
  chunk):                                                       2(W-1)/W Mc/B + 2(W-1) alpha

What each scheme sends is not derived here: it is recorded from the real step (:func:`record_step`). Our
Compressor runs one compressed step of the model's tensors, one exchange per DDP bucket (:func:`buckets_for`), on
:class:`gradcompress.collectives.RecordingCollectives`, which counts bytes exactly as ``Compressor.stats()`` does
and records each collective (kind, bytes, group) per round; on nodes, with a recording topology, the Compressor runs
its hierarchical exchange. PyTorch's baselines are the collectives their hooks issue, replayed on the same
recorder (:func:`hook_job`). The data is :func:`gradients`, the data ``plan`` calibrates on. What variable-size
codecs (``dgc``, ``threshold``) send depends on it and on the rank: for them the second step is recorded (the
first with error-feedback residuals and momentum), on every rank, and each collective counted at the most any
rank of its group sent (the padded all-gather sends the longest payload).
A round's time: its collectives share the link (their bytes add) and are in flight together (the longest chain
of message steps counts once).

The step (:func:`simulate_step`): forward (1/3 of the compute time), then backward (2/3).
DDP hands a bucket to the hook when its gradients are ready (after the share of the
backward pass proportional to the parameters behind it, in reverse order); the hook's
codec work runs on the backward thread and delays the rest of it; the bucket's first
round of collectives starts then and overlaps with the remaining backward pass. The link
carries one collective at a time (first come, first served). Later rounds (and the codec
work between rounds) run after the backward pass, bucket after bucket, as
``exchange.drive`` does; PyTorch's PowerSGD hook has one bucket so the same holds.
Codec work is counted in passes over the elements with per-element costs measured on
the machine (:class:`Speeds`): encode, decode and one elementwise pass (error feedback
adds, copies) per codec, or, better, measured per phase on our Compressor itself
(``Speeds.phases``), multiplied by ``contention`` when workers share CPU cores. The
compute time is that of a DDP step without communication (DDP's own copies included).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Sequence

import torch

from .codecs.base import Aggregation
from .collectives import Issued, Job, RecordingCollectives, drive
from .compressor import Compressor
from .exchanges.layout import split
from .scheme import BASELINES, DECOUPLED, ONEBITADAM, Scheme
from .scheme import parse_scheme as _parse_scheme
from .timing import (BACKWARD_SHARE, FRAMING_EFFICIENCY, MESSAGE_STEPS, SOFTWARE_ALPHA, BucketWork, Round,
                     StepTime, format_rate, message_steps, parse_duration, parse_rate, payload_bandwidth,
                     round_seconds, simulate_step)
from .topology import Topology

DEFAULT_SCHEMES = ("ddp", "torch-fp16", "torch-powersgd", "none", "fp16", "int8", "int4", "sign",
                   "topk:ratio=0.01", "powersgd:rank=1", "powersgd:rank=4")
DDP_BUCKET_BYTES = 25 * 1024 * 1024
DDP_FIRST_BUCKET_BYTES = 1024 * 1024
MIN_NUMEL = 1024  # Compressor's default: smaller tensors travel dense
FLOAT_BYTES = 4

# --------------------------------------------------------------------------- collectives
def allreduce_time(nbytes: float, workers: int, bandwidth: float, alpha: float = 0.0) -> float:
    """Ring all-reduce of ``nbytes``: 2(W-1)/W M/B + 2(W-1) alpha (0 for one worker or no bytes)."""
    if workers <= 1 or nbytes <= 0:
        return 0.0
    return 2 * (workers - 1) / workers * nbytes / bandwidth + 2 * (workers - 1) * alpha


def allgather_time(nbytes: float, workers: int, bandwidth: float, alpha: float = 0.0) -> float:
    """Ring all-gather of ``nbytes`` per rank: (W-1) M/B + (W-1) alpha."""
    if workers <= 1 or nbytes <= 0:
        return 0.0
    return (workers - 1) * nbytes / bandwidth + (workers - 1) * alpha


def alltoall_time(nbytes: float, workers: int, bandwidth: float, alpha: float = 0.0) -> float:
    """All-to-all of ``nbytes`` per rank in W equal blocks: (W-1)/W M/B + (W-1) alpha."""
    if workers <= 1 or nbytes <= 0:
        return 0.0
    return (workers - 1) / workers * nbytes / bandwidth + (workers - 1) * alpha


def two_step_time(nbytes: float, workers: int, bandwidth: float, alpha: float = 0.0) -> float:
    """Two-step reduce of a compressed size Mc: all-to-all of Mc, then all-gather of Mc/W."""
    return alltoall_time(nbytes, workers, bandwidth, alpha) + allgather_time(nbytes / workers, workers, bandwidth,
                                                                             alpha)


# --------------------------------------------------------------------------- schemes and payloads
def parse_scheme(text: str) -> Scheme:
    """``ddp``, ``torch-fp16``, ``torch-powersgd[:rank=R]`` or a codec spec (:func:`gradcompress.scheme.parse_scheme`:
    Compressor options by name, ``diloco=H``, which the model ignores); ``ValueError`` otherwise."""
    scheme = _parse_scheme(text)
    if scheme.kind in (ONEBITADAM, DECOUPLED):
        raise ValueError(f"the cost model has no model of {scheme.kind!r} (an optimizer that exchanges its own "
                         f"momentum); schemes: {', '.join(BASELINES)} or a codec spec")
    return scheme


def numel_of(shape: Sequence[int]) -> int:
    return math.prod(shape)


def payload_bytes(codec, numel: int, shape: Sequence[int] | None = None) -> int:
    """Bytes one ``codec.encode`` of a float32 tensor sends (PowerSGD's factors: pass ``shape``).

    Exact for the fixed-layout codecs; ``dgc`` counts its target k values; ``threshold``
    (data-dependent) raises ``ValueError``.
    """
    n = int(numel)
    return codec.payload_nbytes(n, tuple(shape) if shape is not None else None) if n else 0


def ddp_buckets(nbytes: Sequence[int], cap: int = DDP_BUCKET_BYTES,
                first_cap: int = DDP_FIRST_BUCKET_BYTES) -> list[list[int]]:
    """DDP's (rebuilt) buckets: indices into ``nbytes`` (given in gradient-ready order, i.e. the
    parameters reversed). A bucket closes once it holds at least its cap; the first one's cap is
    ``first_cap`` (1 MiB when DDP's default cap is used, else the cap)."""
    buckets: list[list[int]] = []
    cur: list[int] = []
    size = 0
    for i, b in enumerate(nbytes):
        cur.append(i)
        size += b
        if size >= (first_cap if not buckets else cap):
            buckets.append(cur)
            cur, size = [], 0
    if cur:
        buckets.append(cur)
    return buckets


def buckets_for(scheme: Scheme, shapes: Sequence[Sequence[int]], bucket_cap: int | None = None) -> list[list[int]]:
    """Bucket assignment (indices into ``shapes``, which are in model order) the scheme runs with."""
    order = list(range(len(shapes)))[::-1]
    sizes = [FLOAT_BYTES * numel_of(shapes[i]) for i in order]
    if scheme.kind == "torch-powersgd":
        return [order]
    cap = DDP_BUCKET_BYTES if bucket_cap is None else bucket_cap
    first = DDP_FIRST_BUCKET_BYTES if bucket_cap is None else bucket_cap
    return [[order[j] for j in b] for b in ddp_buckets(sizes, cap, first)]


def _torch_powersgd_compresses(shape: Sequence[int], rank: int) -> tuple[int, int] | None:
    """(n, m) when PyTorch's powerSGD_hook compresses a tensor (ndim >= 2, worth it at rate 2)."""
    if len(shape) < 2:
        return None
    n, m = shape[0], numel_of(shape[1:])
    r = min(n, m, rank)
    return (n, m) if (n + m) * r * 2 < n * m else None


def _compressible(scheme: Scheme, shape: Sequence[int], min_numel: int = MIN_NUMEL) -> bool:
    codec = scheme.codec
    if numel_of(shape) < min_numel:
        return False
    if codec.aggregation.value == "lowrank" and codec.matrix_shape(tuple(shape)) is None:
        return False
    return True


# --------------------------------------------------------------------------- bytes and rounds, from the real step
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


def hook_job(scheme: Scheme, comm, tensors: Sequence[torch.Tensor]) -> Job:
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


#: message steps of each collective among w ranks (the alpha terms above), by kind
# --------------------------------------------------------------------------- nodes
#: the default link inside a node: NVLink-class, 100 GB/s per direction (800 Gbit/s)
INTRA_NODE_RATE_BIT = 800e9


def _flat_uplink(c: Issued, G: int) -> int:
    """What one of the flat exchange's collectives puts on a node's uplink (ranks contiguous per node): gloo's
    all-reduce and all-gather are rings in rank order, so the uplink carries what the node's last rank sends (a
    worker's own count); its all-to-all sends every block directly, so the uplink carries G (W-G)/W of each
    worker's buffer: (W-G)/(W-1) of the worker's count, G times."""
    W = c.world
    if c.kind in ("all_to_all", "all_to_all_v") and W > 1:
        return G * c.sent * (W - G) // (W - 1)
    return c.sent


def node_rounds(recorded: Recorded, bucket: int, per_node: int) -> list[tuple[int, int, int]]:
    """The rounds of one bucket on N nodes of G workers: ``[(bytes one node's uplink carries, bytes one worker
    sends inside its node, message steps)]``. Hierarchical: the node's G workers each send their own exchange
    between nodes at once; flat (``recorded`` among all N G workers): :func:`_flat_uplink`."""
    G, workers = per_node, recorded.workers
    out = []
    for r, mine in enumerate(workers[0][bucket]):
        each = [w[bucket][r] for w in workers] if len(workers) > 1 else [mine] * G
        up = sum(_flat_uplink(c, G) for c in mine if c.link == "world")
        up += sum(c.sent for issued in each for c in issued if c.link == "inter")
        out.append((up, sum(c.sent for c in mine if c.link == "intra"), message_steps(mine)))
    return out


def node_bytes(scheme: Scheme, shapes: Sequence[Sequence[int]], nodes: int, per_node: int, hierarchical: bool,
               bucket_cap: int | None = None) -> tuple[int, int]:
    """(bytes one node's uplink carries, bytes one worker sends inside its node) per (compressed) step, from the
    recorded step; flat counts only the uplink (its traffic inside the node overlaps the uplink's). Hierarchical:
    the uplink's bytes are the sum of the node's workers' ``stats()["inter_node_bytes"]``."""
    rec = record_step(scheme, shapes, nodes * per_node, bucket_cap, per_node if hierarchical else None)
    rounds = [r for b in range(len(rec.buckets)) for r in node_rounds(rec, b, per_node)]
    return sum(up for up, _, _ in rounds), (sum(intra for _, intra, _ in rounds) if hierarchical else 0)


def node_uplink_bytes(scheme: Scheme, shapes: Sequence[Sequence[int]], nodes: int, per_node: int,
                      hierarchical: bool, bucket_cap: int | None = None) -> int:
    """Bytes one node's uplink carries per (compressed) step (:func:`node_bytes`)."""
    return node_bytes(scheme, shapes, nodes, per_node, hierarchical, bucket_cap)[0]


def node_bucket_work(scheme: Scheme, shapes: Sequence[Sequence[int]], nodes: int, per_node: int, hierarchical: bool,
                     uplink: float, intra: float, alpha: float, speeds: Speeds, contention: float = 1.0,
                     error_feedback: bool = True, bucket_cap: int | None = None) -> list[BucketWork]:
    """The buckets of one step on N nodes of G workers; a round's time is its uplink bytes over ``uplink`` (the
    node's payload bytes/s, shared by its G workers) plus its intra-node bytes over ``intra``, plus ``alpha`` per
    message step (:func:`node_rounds`). Codec work: the pass counts of :func:`codec_passes` (flat: on the whole
    tensors among W; hierarchical: on the pieces among N, plus 3 passes over the bucket for the blocks, the mean
    and the landing)."""
    W, G = nodes * per_node, per_node
    rec = record_step(scheme, shapes, W, bucket_cap, G if hierarchical else None)
    total = sum(numel_of(s) for s in shapes) or 1
    codec = speed_codec(scheme)
    out, done = [], 0
    for b, bucket in enumerate(buckets_for(scheme, shapes, bucket_cap)):
        numel = sum(numel_of(shapes[i]) for i in bucket)
        done += numel
        n = numel if scheme.kind != "ours" else sum(numel_of(shapes[i]) for i in bucket
                                                    if _compressible(scheme, shapes[i]))
        phases = codec_passes(scheme, nodes if hierarchical else W, error_feedback) if n else [{}]
        secs = [contention * _phase_seconds(p, codec, speeds, n // G if hierarchical else n) for p in phases]
        rounds = node_rounds(rec, b, G)
        if hierarchical:  # the reduce-scatter comes first: the hook's codec work waits for it
            secs = [contention * 2 * numel * speeds.elementwise] + secs
            secs[-1] += contention * numel * speeds.elementwise
        secs += [0.0] * (len(rounds) + 1 - len(secs))
        comm = [up / uplink + sent / intra + alpha * steps for up, sent, steps in rounds]
        out.append(BucketWork(ready=done / total, hook_s=secs[0],
                              rounds=tuple(Round(c, a) for c, a in zip(comm, secs[1:]))))
    return out


def predict_nodes(scheme: Scheme, shapes: Sequence[Sequence[int]], nodes: int, per_node: int, rate_bit: float,
                  compute_s: float, speeds: Speeds, hierarchical: bool, intra_rate_bit: float = INTRA_NODE_RATE_BIT,
                  latency_s: float = 0.0, contention: float = 1.0, efficiency: float = FRAMING_EFFICIENCY,
                  software_alpha: float = SOFTWARE_ALPHA, bucket_cap: int | None = None) -> "Prediction":
    """Predicted compressed step on N nodes of G workers, the node's uplink at ``rate_bit`` and the links inside
    a node at ``intra_rate_bit``; flat or hierarchical (``ValueError`` for a scheme without a hierarchical exchange).
    ``wire_bytes`` of the result: the uplink's bytes per node; ``intra_bytes``: one worker's inside the node."""
    if hierarchical and not hierarchical_supported(scheme):
        raise ValueError(f"{scheme.text}: no hierarchical exchange (PyTorch's hooks and PowerSGD run flat)")
    ef = default_error_feedback(scheme)
    alpha = latency_s + software_alpha
    buckets = node_bucket_work(scheme, shapes, nodes, per_node, hierarchical, payload_bandwidth(rate_bit, efficiency),
                               intra_rate_bit / 8, alpha, speeds, contention, ef, bucket_cap)
    st = simulate_step(compute_s * (1 - BACKWARD_SHARE), compute_s * BACKWARD_SHARE, buckets)
    up, intra = node_bytes(scheme, shapes, nodes, per_node, hierarchical, bucket_cap)
    return Prediction(scheme=scheme.text, step_s=st.step_s, compute_s=compute_s, codec_s=st.codec_s, comm_s=st.comm_s,
                      exposed_comm_s=st.exposed_comm_s, wire_bytes=up, buckets=len(buckets),
                      topology="hierarchical" if hierarchical else "flat", intra_bytes=intra)


# --------------------------------------------------------------------------- codec work
@dataclasses.dataclass(frozen=True)
class Speeds:
    """Per-element costs in seconds measured on a machine (see ``gradcompress plan``'s calibration).

    ``elementwise``: one pass over float32 elements (an add or a copy); ``encode`` / ``decode``:
    by codec spec (canonical, ``codec.spec``), seconds per input element (PowerSGD: per element
    of the matrix, at its rank).
    """

    elementwise: float
    encode: dict
    decode: dict
    #: measured Compressor work per compressible element, by phase (hook, after round 1, ...), keyed by
    #: :func:`phase_key`; when present it replaces the pass counts of :func:`codec_passes`
    phases: dict = dataclasses.field(default_factory=dict)

    def enc(self, codec) -> float:
        return self.encode.get(codec.spec, 0.0)

    def dec(self, codec) -> float:
        return self.decode.get(codec.spec, 0.0)


def codec_passes(scheme: Scheme, workers: int, error_feedback: bool = True) -> list[dict]:
    """Codec work per compressible element, by phase: ``[hook, after round 1, after round 2...]``.

    Each phase is a dict of pass counts: ``{"ew": elementwise passes, "enc": encodes,
    "dec": decodes}`` (per element of the compressed tensors; PowerSGD's encode is split
    into its two matrix products, half before each round).
    """
    W = workers
    if scheme.kind == "ddp":  # the default hook divides the bucket (DDP's own copies are part of the compute)
        return [{"ew": 1}, {}]
    if scheme.kind == "torch-fp16":  # cast to fp16 and divide; decompress into the bucket
        return [{"ew": 2}, {"ew": 1}]
    ef = 1 if error_feedback else 0
    if scheme.kind == "torch-powersgd":  # bucket copy, EF add, clone, M Q | (uncompressed) | M^T P | P Q^T, error, copy
        return [{"ew": 3, "enc": 0.5}, {}, {"enc": 0.5}, {"dec": 1, "ew": 3}]
    if scheme.codec.exact:  # a plain all-reduce and a divide, as DDP's default hook
        return [{"ew": 1}, {}]
    agg = scheme.codec.aggregation.value
    # hook, every codec: input (x + residual, or a clone), the finiteness flag's sum; residual = x - delivered
    base = {"ew": 2 + ef}
    if agg == "sum":
        return [{**base, "ew": base["ew"] + 1, "enc": 1, "dec": 1}, {"dec": 1, "ew": 2}]
    if agg == "gather":  # variable sizes (dgc, threshold): the sizes' round first
        sizes = [] if scheme.codec.fixed_layout else [{}]
        return [{**base, "enc": 1, "dec": 1}, *sizes, {"dec": W, "ew": W + 2}]
    if agg == "requantize":
        if W == 1:
            return [{**base, "enc": 1, "dec": 1}]
        return [{**base, "enc": 1, "dec": 1}, {"dec": 1, "ew": 1, "enc": 1 / W}, {"dec": 1, "ew": 2}]
    # lowrank: M Q in the hook; M^T P, delivered P Q^T, residual after round 1; P Q^T, copy after round 2
    return [{"ew": 2, "enc": 0.5}, {"enc": 0.5, "dec": 1, "ew": ef}, {"dec": 1, "ew": 1}]


def phase_key(codec, workers: int) -> str:
    return f"{codec.spec}@{workers}"


def speed_codec(scheme: Scheme):
    """The codec whose measured speed stands for the scheme's codec work (None: copies only)."""
    if scheme.kind == "ours":
        return scheme.codec
    if scheme.kind == "torch-powersgd":
        from .spec import make

        return make(f"powersgd:rank={scheme.rank}")
    return None


def _phase_seconds(phase: dict, codec, speeds: Speeds, numel: int) -> float:
    enc = speeds.enc(codec) if codec is not None else 0.0
    dec = speeds.dec(codec) if codec is not None else 0.0
    return numel * (phase.get("ew", 0) * speeds.elementwise + phase.get("enc", 0) * enc + phase.get("dec", 0) * dec)


def bucket_work(scheme: Scheme, shapes: Sequence[Sequence[int]], workers: int, bandwidth: float, alpha: float,
                speeds: Speeds, contention: float = 1.0, error_feedback: bool = True,
                bucket_cap: int | None = None) -> list[BucketWork]:
    """The buckets of one step of ``scheme``, in the order their gradients become ready: each round of the
    recorded step (:func:`record_step`) timed by :func:`round_seconds`, then the codec work after it."""
    buckets = buckets_for(scheme, shapes, bucket_cap)
    recorded = record_step(scheme, shapes, workers, bucket_cap).buckets
    total = sum(numel_of(s) for s in shapes) or 1
    out, done = [], 0
    for b, rounds in zip(buckets, recorded):
        done += sum(numel_of(shapes[i]) for i in b)
        if scheme.kind == "ours":
            n = sum(numel_of(shapes[i]) for i in b if _compressible(scheme, shapes[i]))
            codec = scheme.codec
        else:
            n, codec = sum(numel_of(shapes[i]) for i in b), speed_codec(scheme)
        # measured phases of our Compressor (torch-powersgd: ours at the same rank stands in for it, with nothing
        # to do after the hook's first round, its uncompressed tensors' all-reduce)
        measured = speeds.phases.get(phase_key(codec, workers)) if codec is not None else None
        if n and measured is not None:
            secs = [contention * n * m for m in measured]
            if scheme.kind == "torch-powersgd":
                secs = secs[:1] + [0.0] + secs[1:]
        else:
            phases = codec_passes(scheme, workers, error_feedback) if n else [{}]
            secs = [contention * _phase_seconds(p, codec, speeds, n) for p in phases]
        secs += [0.0] * (len(rounds) + 1 - len(secs))
        comm = [round_seconds(r, bandwidth, alpha) for r in rounds]
        out.append(BucketWork(ready=done / total, hook_s=secs[0],
                              rounds=tuple(Round(c, a) for c, a in zip(comm, secs[1:]))))
    return out


@dataclasses.dataclass(frozen=True)
class Prediction:
    scheme: str
    step_s: float
    compute_s: float
    codec_s: float
    comm_s: float
    exposed_comm_s: float
    wire_bytes: int
    buckets: int
    speedup: float | None = None  # over ``ddp`` (uncompressed, no hook)
    topology: str | None = None  # predict_nodes: "flat" or "hierarchical" (wire_bytes: a node's uplink bytes)
    intra_bytes: int | None = None  # predict_nodes: what one worker sends inside its node


def predict(scheme: Scheme, shapes: Sequence[Sequence[int]], workers: int, rate_bit: float, compute_s: float,
            speeds: Speeds, latency_s: float = 0.0, contention: float = 1.0, error_feedback: bool | None = None,
            efficiency: float = FRAMING_EFFICIENCY, software_alpha: float = SOFTWARE_ALPHA,
            bucket_cap: int | None = None, host_limit: float | None = None) -> Prediction:
    """Predicted time of one compressed step of ``scheme`` (see the module docstring).

    ``host_limit``: the most payload bytes/s a host's CPU can push through its network stack
    (None: no limit); the link's payload bandwidth is capped at it.
    """
    if error_feedback is None:
        error_feedback = default_error_feedback(scheme)
    bandwidth = payload_bandwidth(rate_bit, efficiency)
    if host_limit is not None:
        bandwidth = min(bandwidth, host_limit)
    alpha = latency_s + software_alpha
    buckets = bucket_work(scheme, shapes, workers, bandwidth, alpha, speeds, contention, error_feedback, bucket_cap)
    st = simulate_step(compute_s * (1 - BACKWARD_SHARE), compute_s * BACKWARD_SHARE, buckets)
    return Prediction(scheme=scheme.text, step_s=st.step_s, compute_s=compute_s, codec_s=st.codec_s,
                      comm_s=st.comm_s, exposed_comm_s=st.exposed_comm_s,
                      wire_bytes=wire_bytes(scheme, shapes, workers, bucket_cap), buckets=len(buckets))


def predict_auto(spec: str, shapes: Sequence[Sequence[int]], workers: int, rate_bit: float, compute_s: float,
                 latency_s: float = 0.0, contention: float = 1.0, efficiency: float = FRAMING_EFFICIENCY,
                 software_alpha: float = SOFTWARE_ALPHA, bucket_cap: int | None = None) -> Prediction:
    """What ``spec`` (``"auto..."``) would choose on DDP's buckets of ``shapes`` for these numbers, and its predicted
    step: the autopilot's own decision (:mod:`gradcompress.autopilot.decide`: each candidate's real exchange recorded
    and timed here, on this machine), given the link and compute instead of measuring them."""
    from .autopilot.decide import Link, choose, record
    from .config import Config
    from .step import Seen

    config = Config.parse(spec, {"warmup_steps": 0})
    buckets = [Seen(tuple(b), tuple(tuple(shapes[i]) for i in b), torch.device("cpu"))
               for b in buckets_for(parse_scheme("none"), shapes, bucket_cap)]
    options = record(config, workers, buckets, config.auto.candidates)
    costs = [[contention * o.codec_s for o in row] for row in options]
    link = Link(payload_bandwidth(rate_bit, efficiency), latency_s + software_alpha)
    sizes = [sum(numel_of(s) for s in b.shapes) for b in buckets]
    choice, step_s, _ = choose(options, sizes, link, compute_s, 1.0, costs)
    picked = [options[b][c] for b, c in enumerate(choice)]
    counts: dict = {}
    for o in picked:
        counts[o.spec] = counts.get(o.spec, 0) + 1
    label = f"{spec} -> " + ", ".join(f"{'dense' if k == 'none' else k} x{n}" for k, n in counts.items())
    comm = sum(round_seconds(r, link.bandwidth, link.alpha) for o in picked for r in o.rounds)
    codec = sum(costs[b][c] for b, c in enumerate(choice))
    return Prediction(scheme=label, step_s=step_s, compute_s=compute_s, codec_s=codec, comm_s=comm,
                      exposed_comm_s=max(0.0, step_s - compute_s - codec),
                      wire_bytes=sum(i.sent for o in picked for r in o.rounds for i in r), buckets=len(buckets))


def with_speedups(preds: list[Prediction]) -> list[Prediction]:
    """Fill ``speedup`` = step time of ``ddp`` (or, without it, ours ``none``) / the scheme's."""
    base = next((p for p in preds if p.scheme == "ddp"), None) or next((p for p in preds if p.scheme == "none"), None)
    if base is None:
        return preds
    return [dataclasses.replace(p, speedup=base.step_s / p.step_s if p.step_s > 0 else None) for p in preds]


def default_error_feedback(scheme: Scheme) -> bool:
    """Whether the scheme runs with error feedback by default: ours as ``Compressor(error_feedback="auto")``
    resolves it (the codec's ``wants_error_feedback``); PyTorch's PowerSGD hook always."""
    if scheme.kind != "ours":
        return scheme.kind == "torch-powersgd"
    return scheme.codec.wants_error_feedback


def square_shapes(params: int, side: int = 2048) -> list[tuple[int, ...]]:
    """``params`` elements as side x side matrices, then one side x k matrix and a vector for the rest."""
    shapes: list[tuple[int, ...]] = [(side, side)] * (params // (side * side))
    rest = params - len(shapes) * side * side
    if rest >= side:
        shapes.append((side, rest // side))
        rest -= side * (rest // side)
    if rest:
        shapes.append((rest,))
    return shapes


__all__ = ["BASELINES", "DEFAULT_SCHEMES", "BucketWork", "INTRA_NODE_RATE_BIT", "MESSAGE_STEPS", "Prediction",
           "Recorded", "Round", "Scheme", "Speeds", "StepTime", "allgather_time", "allreduce_time", "alltoall_time",
           "bucket_work", "buckets_for", "codec_passes", "ddp_buckets", "default_error_feedback", "format_rate",
           "gradients", "hierarchical_supported", "hook_job", "message_steps", "node_bucket_work", "node_bytes",
           "node_rounds", "node_uplink_bytes", "parse_duration", "parse_rate", "parse_scheme", "payload_bandwidth",
           "payload_bytes", "phase_key", "predict", "predict_auto", "predict_nodes", "record_step", "round_seconds", "simulate_step",
           "speed_codec", "square_shapes", "two_step_time", "wire_bytes", "with_speedups"]
