"""``plan --auto``: what ``"auto"`` settles on at its first decision and the step of that plan, as the autopilot
decides, with the link and compute given instead of measured (:func:`predict_auto`) (:mod:`gradcompress.costmodel`)."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import TYPE_CHECKING, cast

from ..timing import FRAMING_EFFICIENCY, SOFTWARE_ALPHA, payload_bandwidth
from .flat import Prediction, auto_candidates, default_error_feedback, predict_plan
from .recording import record_step
from .sizes import buckets_for, numel_of
from .work import Speeds, bucket_work

if TYPE_CHECKING:
    from ..autospec import Auto

#: a selection keeps a plan other than the current one only if it is faster by more than this share of the current
#: plan's step (the autopilot's hysteresis, :mod:`gradcompress.autopilot.probation`; a prediction has no noise)
SELECTION_HYSTERESIS = 0.05


@dataclasses.dataclass(frozen=True)
class AutoPrediction:
    """``plan --auto``: what ``"auto"`` settles on and its step.

    ``prediction``: the steady step of the plan it keeps, timed as the fixed schemes are (:func:`predict_plan`:
    nothing of its measuring); ``plan``: the scheme per DDP bucket, in the order the gradients are ready;
    ``dense``: the all-dense step (ours ``none``) it runs for its first ``measuring_steps`` steps, before it decides;
    ``proposals``: (plan, its predicted step) per plan its selection runs for ``selection_steps`` steps each (none
    with a ``bandwidth=`` hint: the model's plan is taken as told); ``one_off_s``: what those steps cost over the
    kept plan's, in all."""

    prediction: Prediction
    plan: tuple[str, ...]
    dense: Prediction
    measuring_steps: int
    proposals: tuple[tuple[tuple[str, ...], float], ...]
    selection_steps: int
    one_off_s: float


def _simplicity(plan: Sequence[str]) -> int:
    """0: dense; 1: one codec on every bucket; 2: a per-bucket mix (as the autopilot's selection ranks plans)."""
    specs = set(plan)
    return 0 if specs == {"none"} else 1 if len(specs) == 1 else 2


def predict_auto(spec: str, shapes: Sequence[Sequence[int]], workers: int, rate_bit: float, compute_s: float,
                 speeds: Speeds, latency_s: float = 0.0, contention: float = 1.0,
                 efficiency: float = FRAMING_EFFICIENCY, software_alpha: float = SOFTWARE_ALPHA,
                 bucket_cap: int | None = None, host_limit: float | None = None) -> AutoPrediction:
    """What ``spec`` (``"auto..."``) settles on at its first decision on DDP's buckets of ``shapes`` for these
    numbers, and the step of that plan, as the autopilot decides (:mod:`gradcompress.autopilot`) with the link and
    compute given instead of measured and each candidate's codec seconds on each bucket those the fixed rows count
    (``speeds``: the plan's calibration), on its candidates' recorded rounds (:func:`record_step`):

    * the model's plan: :func:`gradcompress.autopilot.decide.choose` (from all-dense, greedily the one bucket's change
      that shortens its predicted step most; compression kept only if it beats dense by ``MIN_GAIN``), and the best
      uniform plans (one codec on every bucket) within ``UNIFORM_BAND`` of the fastest, at most ``UNIFORM_MAX``;
    * with a ``bandwidth=`` hint the model's plan is taken; else a selection runs dense, the model's plan (where it
      is a mix predicted faster than the best uniform plan by ``MIN_GAIN``) and the uniform ones, and keeps the
      fastest (a simpler plan within ``PREFER_SIMPLER`` of it first), if faster than dense by
      :data:`SELECTION_HYSTERESIS`. Here "run" is :func:`predict_plan`, the steady step as the fixed rows time it.

    So the kept plan's step is never slower than the fixed scheme of one codec it names (that scheme's own row) and a
    selection never keeps a plan slower than dense; the measuring steps before it are reported apart."""
    from ..autopilot.decide import MIN_GAIN, Link, Option, choose
    from ..autopilot.decide import predicted_step_s as model_step
    from ..autopilot.pilot import MEASURE_STEPS
    from ..autopilot.policy import UNIFORM_BAND, UNIFORM_MAX
    from ..autopilot.probation import BLOCK_STEPS, PREFER_SIMPLER
    from ..config import Config

    config = Config.parse(spec, {})
    candidates = auto_candidates(spec)
    bandwidth = payload_bandwidth(rate_bit, efficiency)
    if host_limit is not None:
        bandwidth = min(bandwidth, host_limit)
    alpha = latency_s + software_alpha
    sizes = [sum(numel_of(shapes[i]) for i in b) for b in buckets_for(candidates[0], shapes, bucket_cap)]
    options: list[list[Option]] = [[] for _ in sizes]
    for s in candidates:
        work = bucket_work(s, shapes, workers, bandwidth, alpha, speeds, contention, default_error_feedback(s),
                           bucket_cap)
        for b, (w, rounds) in enumerate(zip(work, record_step(s, shapes, workers, bucket_cap).buckets)):
            options[b].append(Option(s.text, rounds, w.hook_s + sum(r.after_s for r in w.rounds)))
    link, n = Link(bandwidth, alpha), len(sizes)
    choice, model_s, _ = choose(options, sizes, link, compute_s, 1.0)
    model = tuple(candidates[c].text for c in choice)
    dense_plan = (candidates[0].text,) * n
    uniform = sorted((model_step([c] * n, options, sizes, link, compute_s, 1.0), c) for c in range(1, len(candidates)))
    near = [(candidates[c].text,) * n for t, c in uniform if t <= uniform[0][0] * (1 + UNIFORM_BAND)][:UNIFORM_MAX]

    def timed(plan: Sequence[str], name: str | None = None) -> Prediction:
        return predict_plan(plan, shapes, workers, rate_bit, compute_s, speeds, latency_s, contention, efficiency,
                            software_alpha, bucket_cap, host_limit, name)

    steady = {dense_plan: timed(dense_plan).step_s}
    if cast("Auto", config.auto).bandwidth is not None:  # told: the model's plan, nothing measured
        kept, plans = model, []
    else:
        mix = not near or model_s < uniform[0][0] * (1 - MIN_GAIN)
        plans = list(dict.fromkeys([dense_plan, *([model] if mix else []), *near]))
        steady.update((p, timed(p).step_s) for p in plans if p not in steady)
        best = min(plans, key=lambda p: steady[p])
        simpler = [p for p in plans if steady[p] <= steady[best] * (1 + PREFER_SIMPLER)
                   and _simplicity(p) < _simplicity(best)]
        pick = min(simpler, key=lambda p: (_simplicity(p), steady[p])) if simpler else best
        current = steady[dense_plan]
        kept = pick if current - steady[pick] > SELECTION_HYSTERESIS * current else dense_plan
    counts: dict[str, int] = {}
    for t in kept:
        counts[t] = counts.get(t, 0) + 1
    label = f"{spec} -> " + ", ".join(f"{'dense' if k == 'none' else k} x{c}" for k, c in counts.items())
    pred, dense = timed(kept, label), timed(dense_plan)
    measuring = max(config.warmup_steps, MEASURE_STEPS)
    per_plan = 2 * BLOCK_STEPS  # two blocks per plan (the selection ends 4n steps after it began)
    one_off = measuring * (dense.step_s - pred.step_s) + sum(per_plan * (steady[p] - pred.step_s) for p in plans)
    return AutoPrediction(prediction=pred, plan=kept, dense=dense, measuring_steps=measuring,
                          proposals=tuple((p, steady[p]) for p in plans), selection_steps=per_plan,
                          one_off_s=one_off)


__all__ = ["AutoPrediction", "SELECTION_HYSTERESIS", "predict_auto"]
