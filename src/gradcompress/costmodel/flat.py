"""The predicted step of a flat world (:func:`predict`: one scheme; :func:`predict_plan`: a scheme per bucket), and
the helpers ``plan`` reads the predictions with (:mod:`gradcompress.costmodel`)."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import TYPE_CHECKING, cast

from ..spec import Scheme
from ..timing import BACKWARD_SHARE, FRAMING_EFFICIENCY, SOFTWARE_ALPHA, payload_bandwidth, simulate_step
from .recording import record_step, wire_bytes
from .sizes import modelled_scheme
from .work import Speeds, bucket_work

if TYPE_CHECKING:
    from ..autospec import Auto


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


def auto_candidates(spec: str) -> list[Scheme]:
    """The fixed schemes ``spec`` (``"auto..."``) chooses among, as ``plan`` rows would run them (index 0: dense)."""
    from ..config import Config

    return [modelled_scheme(c) for c in cast("Auto", Config.parse(spec, {}).auto).candidates]


def predict_plan(plan: Sequence[str], shapes: Sequence[Sequence[int]], workers: int, rate_bit: float,
                 compute_s: float, speeds: Speeds, latency_s: float = 0.0, contention: float = 1.0,
                 efficiency: float = FRAMING_EFFICIENCY, software_alpha: float = SOFTWARE_ALPHA,
                 bucket_cap: int | None = None, host_limit: float | None = None, label: str | None = None) -> Prediction:
    """Predicted step of scheme ``plan[b]`` on DDP bucket b (our Compressor's schemes; the buckets of
    :func:`buckets_for`), each bucket's rounds and codec work exactly as :func:`predict` times that scheme: a plan of
    one scheme on every bucket is that scheme's prediction, to the bit."""
    schemes = {s: modelled_scheme(s) for s in dict.fromkeys(plan)}
    if any(s.kind != "ours" for s in schemes.values()):
        raise ValueError("predict_plan: a plan of our Compressor's schemes (codec specs)")
    bandwidth = payload_bandwidth(rate_bit, efficiency)
    if host_limit is not None:
        bandwidth = min(bandwidth, host_limit)
    alpha = latency_s + software_alpha
    works = {t: bucket_work(s, shapes, workers, bandwidth, alpha, speeds, contention, default_error_feedback(s),
                            bucket_cap) for t, s in schemes.items()}
    buckets = [works[t][b] for b, t in enumerate(plan)]
    if len(buckets) != len(next(iter(works.values()))):
        raise ValueError(f"predict_plan: {len(plan)} schemes for {len(next(iter(works.values())))} buckets")
    st = simulate_step(compute_s * (1 - BACKWARD_SHARE), compute_s * BACKWARD_SHARE, buckets)
    sent = sum(c.sent for b, t in enumerate(plan)
               for r in record_step(schemes[t], shapes, workers, bucket_cap).buckets[b] for c in r)
    return Prediction(scheme=label or ";".join(dict.fromkeys(plan)), step_s=st.step_s, compute_s=compute_s,
                      codec_s=st.codec_s, comm_s=st.comm_s, exposed_comm_s=st.exposed_comm_s, wire_bytes=sent,
                      buckets=len(buckets))


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
    """``params`` elements as side x side matrices, then one side x k matrix (k >= 2) and a vector for the rest;
    ``side`` shrinks to the largest square that ``params`` holds (85,000 parameters: one 291x291 matrix and a
    vector of 319), so a small model is not assumed to have matrices larger than itself."""
    side = max(1, min(int(side), math.isqrt(max(int(params), 1))))
    shapes: list[tuple[int, ...]] = [(side, side)] * (params // (side * side))
    rest = params - len(shapes) * side * side
    if rest >= 2 * side:
        shapes.append((side, rest // side))
        rest -= side * (rest // side)
    if rest:
        shapes.append((rest,))
    return shapes


__all__ = ["Prediction", "auto_candidates", "default_error_feedback", "predict", "predict_plan", "square_shapes",
           "with_speedups"]
