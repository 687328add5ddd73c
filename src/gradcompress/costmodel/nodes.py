"""The predicted step on N nodes of G workers, flat or hierarchical: what a node's uplink carries, what a worker
sends inside its node, and the step (:func:`predict_nodes`) (:mod:`gradcompress.costmodel`)."""

from __future__ import annotations

from collections.abc import Sequence

from ..collectives import Issued
from ..spec import Scheme
from ..timing import (BACKWARD_SHARE, FRAMING_EFFICIENCY, SOFTWARE_ALPHA, BucketWork, Round, message_steps,
                      payload_bandwidth, simulate_step)
from .flat import Prediction, default_error_feedback
from .recording import Recorded, hierarchical_supported, record_step
from .sizes import _compressible, buckets_for, numel_of
from .work import Speeds, _phase_seconds, codec_passes, speed_codec

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
                  software_alpha: float = SOFTWARE_ALPHA, bucket_cap: int | None = None) -> Prediction:
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


__all__ = ["INTRA_NODE_RATE_BIT", "node_bucket_work", "node_bytes", "node_rounds", "node_uplink_bytes",
           "predict_nodes"]
