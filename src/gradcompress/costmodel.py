"""An alpha-beta model of one data-parallel training step with gradient compression (pure functions).

Used by ``gradcompress plan``; checked against ``gradcompress netbench`` in BENCHMARKS.md.
Units: bytes, seconds; a link's payload bandwidth ``B`` in bytes/s (:func:`payload_bandwidth`
turns a link rate in bit/s into it), ``alpha`` the fixed cost of one message step (the
one-way latency plus a software overhead per message).

Collectives, W workers, each behind its own full-duplex link (as ``exchange`` counts them):

* all-reduce of M bytes (ring: reduce-scatter + all-gather):  2(W-1)/W M/B + 2(W-1) alpha
* all-gather of M bytes per rank (ring):                        (W-1) M/B + (W-1) alpha
* all-to-all of M bytes per rank (equal blocks):               (W-1)/W M/B + (W-1) alpha
* two-step reduce of a compressed size Mc (all-to-all + all-gather of the Mc/W re-encoded
  chunk):                                                       2(W-1)/W Mc/B + 2(W-1) alpha

What each scheme sends (:func:`wire_bytes`, byte for byte what ``Compressor.stats()``
counts for ours): ``ddp`` one all-reduce of the float32 bucket per DDP bucket;
``torch-fp16`` the same in float16; ``torch-powersgd`` (one bucket) P and Q all-reduced
in two rounds, the vectors and the matrices not worth compressing all-reduced dense;
ours per DDP bucket (codec `none`: one plain all-reduce, as DDP): the dense small tensors (plus a 4-byte finiteness flag) all-reduced,
the others by the codec's aggregation: ``SUM`` one all-reduce of the payloads, ``GATHER``
one all-gather, ``REQUANTIZE`` the two-step reduce of per-rank chunks, ``LOWRANK``
(PowerSGD) all-reduces of P then Q.

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
import math
import re
from typing import Sequence

from .exchanges.layout import chunk_numel, fills_buckets, whole_group_elements
from .scheme import BASELINES, DECOUPLED, ONEBITADAM, Scheme
from .scheme import parse_scheme as _parse_scheme

DEFAULT_SCHEMES = ("ddp", "torch-fp16", "torch-powersgd", "none", "fp16", "int8", "int4", "sign",
                   "topk:ratio=0.01", "powersgd:rank=1", "powersgd:rank=4")
#: TCP/IPv4 (with timestamps) + Ethernet headers: 66 bytes per 1448-byte segment at MTU 1500
FRAMING_EFFICIENCY = 1448 / 1514
#: software cost of one message step of a gloo collective over TCP (per alpha term), seconds
SOFTWARE_ALPHA = 100e-6
BACKWARD_SHARE = 2 / 3
DDP_BUCKET_BYTES = 25 * 1024 * 1024
DDP_FIRST_BUCKET_BYTES = 1024 * 1024
MIN_NUMEL = 1024  # Compressor's default: smaller tensors travel dense
FLOAT_BYTES = 4

# --------------------------------------------------------------------------- units
_RATE_UNITS = {"bit": 1, "kbit": 1e3, "mbit": 1e6, "gbit": 1e9, "tbit": 1e12,
               "bps": 8, "kbps": 8e3, "mbps": 8e6, "gbps": 8e9, "tbps": 8e12}
_TIME_UNITS = {"s": 1.0, "sec": 1.0, "ms": 1e-3, "msec": 1e-3, "us": 1e-6, "usec": 1e-6, "ns": 1e-9}


def parse_rate(text: str) -> float:
    """A link rate in bit/s from tc's notation: ``100mbit``, ``1gbit``, ``10Gbit``, ``125mbps`` (bytes/s)."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:e[+-]?\d+)?)\s*([a-z]*)(?:/s)?\s*", str(text).lower())
    if not m or m.group(2) not in _RATE_UNITS or float(m.group(1)) <= 0:
        raise ValueError(f"bad rate {text!r}: expected a positive number with a unit (bit, kbit, mbit, gbit; "
                         "bps, kbps, mbps, gbps are bytes/s), e.g. 100mbit, 1gbit, 10gbit")
    return float(m.group(1)) * _RATE_UNITS[m.group(2)]


def parse_duration(text: str) -> float:
    """A duration in seconds: ``1ms``, ``500us``, ``0.2s``, ``0``."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:e[+-]?\d+)?)\s*([a-z]*)\s*", str(text).lower())
    if not m or (m.group(2) not in _TIME_UNITS and not (m.group(2) == "" and float(m.group(1)) == 0)):
        raise ValueError(f"bad duration {text!r}: expected a number with a unit (s, ms, us), e.g. 1ms, or 0")
    return float(m.group(1)) * _TIME_UNITS.get(m.group(2), 1.0)


def format_rate(bit_per_s: float) -> str:
    for unit, scale in (("Gbit/s", 1e9), ("Mbit/s", 1e6), ("kbit/s", 1e3)):
        if bit_per_s >= scale:
            return f"{bit_per_s / scale:g} {unit}"
    return f"{bit_per_s:g} bit/s"


def payload_bandwidth(rate_bit: float, efficiency: float = FRAMING_EFFICIENCY) -> float:
    """Payload bytes per second through a link of ``rate_bit`` bit/s."""
    return rate_bit / 8 * efficiency


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


def allreduce_bytes(nbytes: int, workers: int) -> int:
    """Bytes one rank transmits in a ring all-reduce (as ``exchange.Collectives`` counts them)."""
    return 2 * (workers - 1) * nbytes // workers if workers > 1 else 0


def allgather_bytes(nbytes: int, workers: int) -> int:
    return (workers - 1) * nbytes if workers > 1 else 0


def alltoall_bytes(nbytes: int, workers: int) -> int:
    return (workers - 1) * nbytes // workers if workers > 1 else 0


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


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


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


def round_bytes(scheme: Scheme, shapes: Sequence[Sequence[int]], bucket: Sequence[int],
                workers: int, min_numel: int = MIN_NUMEL, dense: frozenset = frozenset()) -> list[tuple[str, int, int]]:
    """The rounds of one bucket: ``[(collective, local buffer bytes M, bytes this rank sends)]``.

    One entry per round; collectives issued together in a round (the dense tensors'
    all-reduce beside the compressed exchange) are summed into it. ``dense``: indices that
    travel dense whatever their size (the hierarchical exchange's pieces of small tensors,
    with ``min_numel=0``).
    """
    W = workers
    numels = [numel_of(shapes[i]) for i in bucket]
    total = sum(numels)
    if scheme.kind == "ddp":
        return [("allreduce", FLOAT_BYTES * total, allreduce_bytes(FLOAT_BYTES * total, W))]
    if scheme.kind == "torch-fp16":
        return [("allreduce", 2 * total, allreduce_bytes(2 * total, W))]
    if scheme.kind == "torch-powersgd":
        dense = ps = qs = 0
        for i in bucket:
            nm = _torch_powersgd_compresses(shapes[i], scheme.rank)
            if nm is None:
                dense += numel_of(shapes[i])
            else:
                r = min(scheme.rank, *nm)
                ps += nm[0] * r
                qs += nm[1] * r
        b1 = FLOAT_BYTES * (dense + ps)
        sent1 = allreduce_bytes(FLOAT_BYTES * dense, W) + allreduce_bytes(FLOAT_BYTES * ps, W)
        return [("allreduce", b1, sent1), ("allreduce", FLOAT_BYTES * qs, allreduce_bytes(FLOAT_BYTES * qs, W))]
    codec = scheme.codec
    if codec.exact:  # exact and stateless: the Compressor sends it as DDP does
        return [("allreduce", FLOAT_BYTES * total, allreduce_bytes(FLOAT_BYTES * total, W))]
    comp = [i for i in bucket if i not in dense and _compressible(scheme, shapes[i], min_numel)]
    dense = sum(numel_of(shapes[i]) for i in bucket if i not in comp)
    agg = codec.aggregation.value
    # the finiteness flag travels with the dense tensors; without them only for codecs whose received data
    # cannot carry a NaN/Inf (gradcompress.step: random-k)
    rides = codec.preserves_nonfinite
    dense_bytes = FLOAT_BYTES * (dense + 1) if dense or not rides or not comp else 0
    dense_sent = allreduce_bytes(dense_bytes, W)
    if not comp:
        return [("allreduce", dense_bytes, dense_sent)]
    if agg == "sum":
        pay = sum(payload_bytes(codec, numel_of(shapes[i]), shapes[i]) for i in comp)
        return [("allreduce", dense_bytes + pay, dense_sent + allreduce_bytes(pay, W))]
    if agg == "gather":
        pay = sum(payload_bytes(codec, numel_of(shapes[i]), shapes[i]) for i in comp)
        return [("allgather", dense_bytes + pay, dense_sent + allgather_bytes(pay, W))]
    if agg == "requantize":
        if W == 1:
            return [("allreduce", dense_bytes, 0)]
        numels = [numel_of(shapes[i]) for i in comp]
        grouped = codec.slices_by_bucket()
        whole = [n for n in numels if grouped and fills_buckets(n, codec.bucket)]  # one payload for these
        per_rank = payload_bytes(codec, whole_group_elements(whole, codec.bucket, W) // W) if whole else 0
        per_rank += sum(payload_bytes(codec, chunk_numel(n, W)) for n in numels
                        if not (grouped and fills_buckets(n, codec.bucket)))  # W chunks of each of these
        send = W * per_rank
        return [("alltoall", dense_bytes + send, dense_sent + alltoall_bytes(send, W)),
                ("allgather", per_rank, allgather_bytes(per_rank, W))]
    # lowrank (PowerSGD): P then Q
    ps = qs = 0
    for i in comp:
        n, m = codec.matrix_shape(tuple(shapes[i]))
        r = min(codec.rank, n, m)
        ps += n * r
        qs += m * r
    return [("allreduce", dense_bytes + FLOAT_BYTES * ps, dense_sent + allreduce_bytes(FLOAT_BYTES * ps, W)),
            ("allreduce", FLOAT_BYTES * qs, allreduce_bytes(FLOAT_BYTES * qs, W))]


def wire_bytes(scheme: Scheme, shapes: Sequence[Sequence[int]], workers: int,
               bucket_cap: int | None = None) -> int:
    """Bytes one rank transmits per (compressed) step, counted as ring algorithms send them."""
    return sum(sent for b in buckets_for(scheme, shapes, bucket_cap)
               for _, _, sent in round_bytes(scheme, shapes, b, workers))


# --------------------------------------------------------------------------- nodes
#: the default link inside a node: NVLink-class, 100 GB/s per direction (800 Gbit/s)
INTRA_NODE_RATE_BIT = 800e9
#: message steps of each collective among W workers (the alpha terms above)
MESSAGE_STEPS = {"allreduce": lambda w: 2 * (w - 1), "allgather": lambda w: w - 1, "alltoall": lambda w: w - 1}


def hierarchical_supported(scheme: Scheme) -> bool:
    """Whether the scheme has a hierarchical exchange: our codecs except PowerSGD (it needs whole matrices)."""
    return scheme.kind == "ours" and scheme.codec.aggregation.value != "lowrank"


def piece_shapes(shapes: Sequence[Sequence[int]], per_node: int) -> list[tuple[int]]:
    """The hierarchical exchange's piece of each tensor a worker sends between nodes: ceil(n / G) elements."""
    return [(_ceil_div(numel_of(s), per_node),) for s in shapes]


def flat_uplink_rounds(scheme: Scheme, shapes: Sequence[Sequence[int]], bucket: Sequence[int], nodes: int,
                       per_node: int) -> list[tuple[str, int, int]]:
    """The flat exchange's rounds of one bucket on N nodes of G workers (ranks contiguous per node): ``[(collective,
    bytes one node's uplink carries, 0)]``. gloo's all-reduce and all-gather are rings in rank order, so the uplink
    carries what the node's last rank sends (a worker's own count); its all-to-all sends every block directly, so
    the uplink carries G (W-G)/W of each worker's buffer: (W-G)/(W-1) of the worker's count, G times (the dense
    tensors all-reduced in the same round are counted at that share too: a few KB)."""
    W, G = nodes * per_node, per_node
    out = []
    for kind, _, sent in round_bytes(scheme, shapes, bucket, W):
        uplink = sent if kind != "alltoall" else G * sent * (W - G) // (W - 1)
        out.append((kind, uplink, 0))
    return out


def hierarchical_rounds(scheme: Scheme, shapes: Sequence[Sequence[int]], bucket: Sequence[int], nodes: int,
                        per_node: int) -> list[tuple[str, int, int]]:
    """The hierarchical exchange's rounds of one bucket (:mod:`gradcompress.exchanges.hierarchical`):
    ``[(collective, bytes one node's uplink carries, bytes one worker sends inside the node)]``: the reduce-scatter
    inside the node ((G-1)/G of the G blocks of pieces, float32), the codec's exchange of this worker's pieces
    (ceil(n/G) of each tensor; those of tensors below ``MIN_NUMEL`` dense) among the N workers of its local rank,
    which every one of the node's G workers runs at once on the uplink, then the all-gather of the averaged pieces
    and a flag inside."""
    G = per_node
    pieces = piece_shapes(shapes, G)
    block = sum(numel_of(pieces[i]) for i in bucket)
    small = frozenset(i for i in bucket if numel_of(shapes[i]) < MIN_NUMEL)
    inner = round_bytes(scheme, pieces, bucket, nodes, min_numel=0, dense=small) if not scheme.codec.exact else \
        [("allreduce", FLOAT_BYTES * block, allreduce_bytes(FLOAT_BYTES * block, nodes))]
    intra_rs = (G - 1) * FLOAT_BYTES * block
    intra_ag = (G - 1) * FLOAT_BYTES * (block + 1)
    return ([("reduce_scatter", 0, intra_rs)] + [(kind, G * sent, 0) for kind, _, sent in inner]
            + [("allgather_intra", 0, intra_ag)])


def node_bytes(scheme: Scheme, shapes: Sequence[Sequence[int]], nodes: int, per_node: int, hierarchical: bool,
               bucket_cap: int | None = None) -> tuple[int, int]:
    """(bytes one node's uplink carries, bytes one worker sends inside its node) per (compressed) step; flat
    counts only the uplink (its traffic inside the node overlaps the uplink's)."""
    rounds = hierarchical_rounds if hierarchical else flat_uplink_rounds
    rs = [r for b in buckets_for(scheme, shapes, bucket_cap) for r in rounds(scheme, shapes, b, nodes, per_node)]
    return sum(up for _, up, _ in rs), sum(intra for _, _, intra in rs)


def node_uplink_bytes(scheme: Scheme, shapes: Sequence[Sequence[int]], nodes: int, per_node: int,
                      hierarchical: bool, bucket_cap: int | None = None) -> int:
    """Bytes one node's uplink carries per (compressed) step (:func:`node_bytes`)."""
    return node_bytes(scheme, shapes, nodes, per_node, hierarchical, bucket_cap)[0]


def node_bucket_work(scheme: Scheme, shapes: Sequence[Sequence[int]], nodes: int, per_node: int, hierarchical: bool,
                     uplink: float, intra: float, alpha: float, speeds: Speeds, contention: float = 1.0,
                     error_feedback: bool = True, bucket_cap: int | None = None) -> list[BucketWork]:
    """The buckets of one step on N nodes of G workers; a round's time is its uplink bytes over ``uplink`` (the
    node's payload bytes/s, shared by its G workers) plus its intra-node bytes over ``intra``, plus ``alpha`` per
    message step. Codec work: the pass counts of :func:`codec_passes` (flat: on the whole tensors among W;
    hierarchical: on the pieces among N, plus 3 passes over the bucket for the blocks, the mean and the landing)."""
    W, G = nodes * per_node, per_node
    rounds_of = hierarchical_rounds if hierarchical else flat_uplink_rounds
    total = sum(numel_of(s) for s in shapes) or 1
    codec = speed_codec(scheme)
    out, done = [], 0
    for b in buckets_for(scheme, shapes, bucket_cap):
        numel = sum(numel_of(shapes[i]) for i in b)
        done += numel
        n = numel if scheme.kind != "ours" else sum(numel_of(shapes[i]) for i in b if _compressible(scheme, shapes[i]))
        phases = codec_passes(scheme, nodes if hierarchical else W, error_feedback) if n else [{}]
        secs = [contention * _phase_seconds(p, codec, speeds, n // G if hierarchical else n) for p in phases]
        rounds = rounds_of(scheme, shapes, b, nodes, per_node)
        if hierarchical:  # the reduce-scatter comes first: the hook's codec work waits for it
            secs = [contention * 2 * numel * speeds.elementwise] + secs
            secs[-1] += contention * numel * speeds.elementwise
        secs += [0.0] * (len(rounds) + 1 - len(secs))
        comm = [up / uplink + sent / intra + alpha * _message_steps(kind, nodes, per_node, hierarchical)
                for kind, up, sent in rounds]
        out.append(BucketWork(ready=done / total, hook_s=secs[0],
                              rounds=tuple(Round(c, a) for c, a in zip(comm, secs[1:]))))
    return out


def _message_steps(kind: str, nodes: int, per_node: int, hierarchical: bool) -> int:
    """Message steps of a round: intra-node collectives among G, the rest among N (hierarchical) or W (flat)."""
    if kind == "reduce_scatter":
        return per_node - 1
    if kind == "allgather_intra":
        return per_node - 1
    return MESSAGE_STEPS[kind](nodes if hierarchical else nodes * per_node)


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


def collective_time(kind: str, nbytes: float, workers: int, bandwidth: float, alpha: float) -> float:
    return {"allreduce": allreduce_time, "allgather": allgather_time,
            "alltoall": alltoall_time}[kind](nbytes, workers, bandwidth, alpha)


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


@dataclasses.dataclass(frozen=True)
class Round:
    """One round of a bucket's exchange: its collectives' time on the link, then codec work."""

    comm_s: float
    after_s: float = 0.0


@dataclasses.dataclass(frozen=True)
class BucketWork:
    """A bucket: ready after ``ready`` (0..1) of the backward pass; ``hook_s`` of codec work in the hook."""

    ready: float
    hook_s: float
    rounds: tuple[Round, ...]


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
    if scheme.kind == "torch-powersgd":  # bucket copy, EF add, clone; M Q | M^T P | P Q^T, error, copy back
        return [{"ew": 3, "enc": 0.5}, {"enc": 0.5}, {"dec": 1, "ew": 3}]
    if scheme.codec.exact:  # a plain all-reduce and a divide, as DDP's default hook
        return [{"ew": 1}, {}]
    agg = scheme.codec.aggregation.value
    # hook, every codec: input (x + residual, or a clone), the finiteness flag's sum; residual = x - delivered
    base = {"ew": 2 + ef}
    if agg == "sum":
        return [{**base, "ew": base["ew"] + 1, "enc": 1, "dec": 1}, {"dec": 1, "ew": 2}]
    if agg == "gather":
        return [{**base, "enc": 1, "dec": 1}, {"dec": W, "ew": W + 2}]
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
    """The buckets of one step of ``scheme``, in the order their gradients become ready."""
    buckets = buckets_for(scheme, shapes, bucket_cap)
    total = sum(numel_of(s) for s in shapes) or 1
    out, done = [], 0
    for b in buckets:
        done += sum(numel_of(shapes[i]) for i in b)
        rounds = round_bytes(scheme, shapes, b, workers)
        if scheme.kind == "ours":
            n = sum(numel_of(shapes[i]) for i in b if _compressible(scheme, shapes[i]))
            codec = scheme.codec
        else:
            n, codec = sum(numel_of(shapes[i]) for i in b), speed_codec(scheme)
        # measured phases of our Compressor (torch-powersgd: ours at the same rank stands in for it)
        measured = speeds.phases.get(phase_key(codec, workers)) if codec is not None else None
        if n and measured is not None:
            secs = [contention * n * m for m in measured]
        else:
            phases = codec_passes(scheme, workers, error_feedback) if n else [{}]
            secs = [contention * _phase_seconds(p, codec, speeds, n) for p in phases]
        secs += [0.0] * (len(rounds) + 1 - len(secs))
        comm = [collective_time(kind, nbytes, workers, bandwidth, alpha) for kind, nbytes, _ in rounds]
        out.append(BucketWork(ready=done / total, hook_s=secs[0],
                              rounds=tuple(Round(c, a) for c, a in zip(comm, secs[1:]))))
    return out


# --------------------------------------------------------------------------- the step
@dataclasses.dataclass(frozen=True)
class StepTime:
    step_s: float
    forward_s: float
    backward_s: float
    codec_s: float  # all codec work (hooks and between rounds)
    comm_s: float  # all collectives' time on the link
    exposed_comm_s: float  # step time not explained by compute and codec work


def simulate_step(forward_s: float, backward_s: float, buckets: Sequence[BucketWork]) -> StepTime:
    """Step time of buckets exchanged as described in the module docstring (a pure function)."""
    link = 0.0  # when the link is free, from the start of the backward pass
    hooks = 0.0
    first_done = []
    for b in buckets:
        ready = backward_s * b.ready + hooks + b.hook_s
        hooks += b.hook_s
        if b.rounds:
            start = max(ready, link)
            link = start + b.rounds[0].comm_s
        first_done.append(link if b.rounds else ready)
    t = backward_s + hooks  # end of the backward pass: the last hook has run
    pending = [(b, 0, done) for b, done in zip(buckets, first_done) if b.rounds]
    while pending:
        nxt = []
        for b, k, done in pending:
            t = max(t, done) + b.rounds[k].after_s
            if k + 1 < len(b.rounds):
                start = max(t, link)
                link = start + b.rounds[k + 1].comm_s
                nxt.append((b, k + 1, link))
        pending = nxt
    codec = hooks + sum(r.after_s for b in buckets for r in b.rounds)
    comm = sum(r.comm_s for b in buckets for r in b.rounds)
    step = forward_s + t
    return StepTime(step_s=step, forward_s=forward_s, backward_s=backward_s, codec_s=codec, comm_s=comm,
                    exposed_comm_s=max(0.0, step - forward_s - backward_s - codec))


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


__all__ = ["BASELINES", "DEFAULT_SCHEMES", "BucketWork", "Prediction", "Round", "Scheme", "Speeds", "StepTime",
           "allgather_bytes", "allgather_time", "allreduce_bytes", "allreduce_time", "alltoall_bytes",
           "alltoall_time", "bucket_work", "buckets_for", "chunk_numel", "codec_passes", "ddp_buckets",
           "default_error_feedback", "format_rate", "INTRA_NODE_RATE_BIT", "hierarchical_rounds",
           "hierarchical_supported", "flat_uplink_rounds", "node_bytes", "node_bucket_work", "node_uplink_bytes",
           "piece_shapes", "predict_nodes", "parse_duration", "phase_key", "parse_rate", "parse_scheme",
           "payload_bandwidth", "payload_bytes", "predict", "round_bytes", "simulate_step", "speed_codec", "square_shapes",
           "two_step_time", "wire_bytes", "with_speedups"]
