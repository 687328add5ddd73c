"""The autopilot's decision, pure: from one check's combined numbers (:class:`Check`) to a :class:`Decision`.

No I/O here: no collective, no clock, no file. Everything a decision uses arrives in the :class:`Check` (every rank
holds the same one, built from gathered numbers) and the :class:`Situation` (what the last decision was based on and
what the trial sent back), so every rank decides alike.

* **When to decide** (:func:`review`): at the first check; whenever the compute time or the link's cost to a
  dense step (:func:`shift`) moved by more than :data:`MOVED` of the larger of the two since the last decision
  while the current plan's own step or wait moved too (a probe that reads otherwise under a steady step is noise);
  when the regime changed
  (``critical=``); or when the dense steps' fit of the link (overlap, share) moved by more than :data:`MOVED` while
  no plan stands rejected (a selection's loser).
* **What** (:func:`decide`): the cost model's choice per bucket (:func:`.decide.choose`) among the budget's
  candidates (fewer in a critical regime), with the per-tensor allocation of the int4 buckets where asked
  (``allocate=true``, :mod:`.allocate`), and the best uniform plans (:func:`uniform_plans`): the proposals the
  selection (:mod:`.probation`) measures against each other and dense.
* **The regime** (:class:`Regime`): Accordion's detector on the gradient norm at the checks.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Hashable, Iterable, Mapping
from typing import TYPE_CHECKING, cast

import torch

from .allocate import LEVELS, REFERENCE, allocate, level_bytes
from .decide import Link, choose, fit_link, predicted_step_s

if TYPE_CHECKING:
    from ..autospec import Auto
    from ..terms import Seen

#: a change of the link rate or the compute time that makes the autopilot decide again
MOVED = 0.25
#: the uniform plans a selection measures: those the model predicts within this share of the fastest uniform one
#: (the model ranks plans within 15 % of each other wrongly on the CPU testbed, and its ranking moves with the
#: probe from run to run), at most UNIFORM_MAX of them
UNIFORM_BAND = 0.5
UNIFORM_MAX = 3


@dataclasses.dataclass(frozen=True)
class Basis:
    """What a decision was made on: the compute time, the bandwidth the step gets (the probed one times the fitted
    share) and the latency."""

    compute_s: float
    bandwidth: float
    alpha: float


@dataclasses.dataclass(frozen=True)
class Check:
    """One check's numbers, every rank's combined (the slowest compute, the slowest link, the costliest codec run):
    ``step_s`` the current plan's measured step time, ``codec[b][c]`` candidate c's codec seconds on bucket b,
    ``dense_step_s`` the step time where the current plan is all dense and flat (the in-step probe; else 0),
    ``errors``: (keys, ``[tensors, levels]`` squared round-trip errors summed over ranks) for ``allocate``."""

    index: int
    compute_s: float
    step_s: float
    bandwidth: float
    alpha: float
    codec: tuple
    dense_step_s: float = 0.0
    errors: tuple = ((), None)


@dataclasses.dataclass(frozen=True)
class Situation:
    """What a decision reads besides the check: the candidates' recorded costs (``costs[b][c]``), the buckets
    (:class:`~gradcompress.step.Seen`), the autopilot's options, whether the buckets overlap the backward pass
    (``hooked``), the last decision's basis and fit, the plans the trial sent back and the regime."""

    costs: list
    buckets: tuple
    options: Auto
    min_numel: int
    hooked: bool
    basis: Basis | None
    fitted: tuple
    rejected: tuple
    critical: bool

    @property
    def dense_bytes(self) -> int:
        """The bytes a dense step sends (the recorded rounds of candidate 0 on every bucket)."""
        return sum(c.sent for row in self.costs for r in row[0].rounds for c in r)

    @property
    def sizes(self) -> list[int]:
        return [sum(int(torch.Size(s).numel()) for s in b.shapes) for b in self.buckets]


@dataclasses.dataclass(frozen=True)
class Trial:
    """What a selection measured: ``times`` ((plan in words, measured s/step) per plan, the current one first),
    ``back`` (the plan kept is not the model's) and ``noise_s`` (the measured noise of one block: the pooled spread of
    the blocks around their plans' means)."""

    times: tuple
    back: bool = False
    noise_s: float = 0.0


@dataclasses.dataclass(frozen=True)
class Decision:
    """A decision: ``chosen`` (key -> spec of every key it compresses), the cost model's ``choice`` (candidate index
    per bucket) with its ``predicted_s`` and the all-dense ``dense_s``, the ``check`` it came from, its ``basis``,
    the per-tensor ``allocation`` summary (``allocate=true``), ``uniform`` (the budget's best *uniform* compressed
    plans, one codec on every bucket, by the model (:func:`uniform_plans`), each key -> spec; measured against
    ``chosen`` and dense) with the best one's predicted ``uniform_s``, and once measured ``trial`` ((plan in words, measured s/step) per plan the
    selection measured, :class:`Trial`) and ``why`` (what made it decide: the first decision, the compute or the
    link moved, the in-step fit moved, a change of regime)."""

    chosen: Mapping
    choice: tuple
    predicted_s: float
    dense_s: float
    sizes: tuple
    check: Check
    basis: Basis
    allocation: Mapping = dataclasses.field(default_factory=dict)
    uniform: tuple = ()
    uniform_s: float = float("inf")
    trial: Trial | None = None
    why: str = ""


@dataclasses.dataclass(frozen=True)
class Review:
    """What a check calls for: ``decide`` (choose again), ``measured`` (the measurements moved: the layouts are to
    be compared again), ``more``/``less`` (compressing more/less may pay now: the plans a selection measured slower
    that compressed more/less than the one kept are measured again), the new ``fitted`` and ``why`` (in words)."""

    decide: bool
    measured: bool
    more: bool
    less: bool
    fitted: tuple
    why: str = ""


@dataclasses.dataclass(frozen=True)
class Regime:
    """Accordion's detector: the gradient norm at the last two checks, whether the regime is critical, how many
    times it changed."""

    norms: tuple = ()
    critical: bool = False
    changes: int = 0

    def observe(self, norm: float, threshold: float) -> Regime:
        """The regime after a check whose gradient norm is ``norm``: critical when it moved by more than
        ``threshold`` relative to the last check's."""
        norms = (self.norms + (norm,))[-2:]
        if len(norms) < 2:
            return Regime(norms, self.critical, self.changes)
        critical = abs(norm - norms[0]) > threshold * max(norms[0], 1e-30)
        return Regime(norms, critical, self.changes + (critical != self.critical))


def decided_on(basis: Basis, share: float) -> tuple[float, float]:
    """(compute time, probed bandwidth) a decision was made on."""
    return basis.compute_s, basis.bandwidth / share


def shift(basis: Basis, share: float, compute: float, bandwidth: float, dense_bytes: float) -> tuple[float, float]:
    """How the measurements moved since the decision, signed: the change of the compute time and of the link's cost
    (the seconds a dense step's bytes take on it), each relative to the larger of the two as decided (a fast link
    whose probe reads 50 % slower costs the step next to nothing more, nor does 30 % more compute next to a slow
    link's seconds: neither is a move)."""
    c0, b0 = decided_on(basis, share)
    link, link0 = dense_bytes / max(bandwidth, 1e-12), dense_bytes / max(b0, 1e-12)
    scale = max(link0, c0, 1e-12)
    return (compute - c0) / scale, (link - link0) / scale


def moved(basis: Basis, share: float, compute: float, bandwidth: float, dense_bytes: float) -> bool:
    """Whether the compute time or the link's cost moved by more than :data:`MOVED` since the decision."""
    return any(abs(x) > MOVED for x in shift(basis, share, compute, bandwidth, dense_bytes))


def favours_compression(basis: Basis, share: float, compute: float, bandwidth: float, dense_bytes: float) -> bool:
    """Whether the link's cost grew or the compute time shrank by more than :data:`MOVED` since the decision: only
    then is a plan that compressed more than the one kept (and was measured slower) measured again (a noisy probe of
    a fast link that reads faster or slower by turns would otherwise have it re-measure the same plan)."""
    dc, dl = shift(basis, share, compute, bandwidth, dense_bytes)
    return dl > MOVED or dc < -MOVED


def favours_less(basis: Basis, share: float, compute: float, bandwidth: float, dense_bytes: float) -> bool:
    """Whether the link's cost shrank or the compute time grew by more than :data:`MOVED` since the decision: only
    then is a plan that compressed less than the one kept (and was measured slower) measured again."""
    dc, dl = shift(basis, share, compute, bandwidth, dense_bytes)
    return dl < -MOVED or dc > MOVED


def refitted(new: tuple, old: tuple) -> bool:
    """Whether the dense steps' fit (overlap, share) moved by more than :data:`MOVED`."""
    return abs(new[0] - old[0]) > MOVED or abs(new[1] - old[1]) > MOVED * old[1]


def review(check: Check, situation: Situation, regime_changed: bool, steady: bool = False) -> Review:
    """Whether ``check`` calls for a decision (see the module docstring). ``steady``: the current plan's own step
    time and wait have not moved since they were last measured (a probe or a selection): then a probe or a compute
    reading that moved is noise, not a move (the step decides; a link that really changed moves the wait)."""
    fitted = situation.fitted
    if situation.options.bandwidth is None and check.dense_step_s > 0:  # fresh dense steps: the step as it went
        fitted = fit_link(situation.costs, situation.sizes, Link(check.bandwidth, check.alpha), check.compute_s,
                          1.0 if situation.hooked else 0.0, list(check.codec), check.dense_step_s)
    share, first = situation.fitted[1], situation.basis is None
    now = (check.compute_s, check.bandwidth, situation.dense_bytes)
    basis = cast(Basis, situation.basis)  # read only when not the first decision
    measured = first or (not steady and moved(basis, share, *now))
    more = first or (not steady and favours_compression(basis, share, *now))
    less = first or (not steady and favours_less(basis, share, *now))
    refit = refitted(fitted, situation.fitted) and not situation.rejected
    again = measured or regime_changed or refit
    why = ""
    if first:
        why = "first decision"
    elif measured:
        dc, dl = shift(basis, share, *now)
        why = " and ".join(f"{name} moved {100 * x:+.0f} %" for name, x in (("compute", dc), ("link cost", dl))
                           if abs(x) > MOVED)
    elif regime_changed:
        why = ("entering" if situation.critical else "leaving") + " a critical regime"
    elif refit:
        why = "the in-step fit of the link moved"
    return Review(again, measured, more, less, fitted, why)


def decide(check: Check, situation: Situation) -> Decision:
    """The plan for ``check`` under ``situation`` (its ``fitted``: the link's overlap and share to predict with)."""
    options, sizes = situation.options, situation.sizes
    overlap, share = situation.fitted
    link = Link(share * check.bandwidth, check.alpha)
    names = options.critical_candidates if situation.critical else options.candidates
    allowed = [i for i, spec in enumerate(options.candidates) if spec in names]
    overlap = overlap if situation.hooked else 0.0
    choice, predicted, dense = choose(situation.costs, sizes, link, check.compute_s, overlap, list(check.codec), allowed)
    chosen = {k: options.candidates[c] for b, c in zip(situation.buckets, choice) for k in b.keys if c}
    keys, err = check.errors
    allocation: dict = {}
    if err is not None:
        chosen, allocation = _allocated(chosen, situation.buckets, list(keys), err)
    uniform, uniform_s = uniform_plans(situation, link, check, [c for c in allowed if c])
    return Decision(chosen, tuple(choice), predicted, dense, tuple(sizes), check,
                    Basis(check.compute_s, link.bandwidth, link.alpha), allocation, uniform, uniform_s)


def uniform_plans(situation: Situation, link: Link, check: Check, allowed: list) -> tuple[tuple, float]:
    """The compressed plans with one codec (of ``allowed`` candidate indices) on every bucket that the model
    predicts within :data:`UNIFORM_BAND` of the fastest of them, fastest first, at most :data:`UNIFORM_MAX` (each
    key -> spec; none where no candidate can carry every bucket), and the fastest's predicted step time. The model
    ranks close plans within its error (on a CPU testbed int8 against int4 at 10 Gbit/s): those are measured."""
    overlap = situation.fitted[0] if situation.hooked else 0.0
    timed = []
    for c in allowed:
        if any(row[c].codec_s == float("inf") for row in situation.costs):
            continue
        timed.append((predicted_step_s([c] * len(situation.buckets), situation.costs, situation.sizes, link,
                                       check.compute_s, overlap, list(check.codec)), c))
    if not timed:
        return (), float("inf")
    timed.sort()
    best = timed[0][0]
    near = [c for t, c in timed if t <= best * (1 + UNIFORM_BAND)][:UNIFORM_MAX]
    return tuple({k: situation.options.candidates[c] for b in situation.buckets for k in b.keys} for c in near), best


def allocatable(buckets: Iterable[Seen], min_numel: int) -> list[Hashable]:
    """Keys the per-tensor allocation may measure: every exchanged tensor the codec would compress (the same list
    on every rank)."""
    return [k for b in buckets if b.kind == "exchange" for k, s in zip(b.keys, b.shapes)
            if torch.Size(s).numel() >= min_numel]


def _allocated(chosen: dict, buckets, keys: list, err: torch.Tensor) -> tuple[dict, dict]:
    """``chosen`` with the tensors given :data:`REFERENCE` re-allocated among :data:`LEVELS`
    (:func:`.allocate.allocate`: the fewest bytes within their total error under the reference), and a summary."""
    rows = [i for i, k in enumerate(keys) if chosen.get(k) == REFERENCE]
    if not rows:
        return chosen, {}
    sizes = {k: int(torch.Size(s).numel()) for b in buckets for k, s in zip(b.keys, b.shapes)}
    nbytes, sub = level_bytes([sizes[keys[i]] for i in rows]), err[rows]
    levels = allocate(sub, nbytes)
    out = dict(chosen)
    out.update((keys[i], LEVELS[c]) for i, c in zip(rows, levels))
    pick, ref = torch.tensor(levels)[:, None], LEVELS.index(REFERENCE)
    summary = {"tensors": {spec: levels.count(i) for i, spec in enumerate(LEVELS)},
               "payload_bytes": float(nbytes.gather(1, pick).sum()), "reference_bytes": float(nbytes[:, ref].sum()),
               "error": float(sub.double().gather(1, pick).sum()), "reference_error": float(sub.double()[:, ref].sum())}
    return out, summary


__all__ = ["Basis", "Check", "Decision", "MOVED", "Regime", "Review", "Situation", "Trial", "allocatable", "decide",
           "decided_on", "favours_compression", "favours_less", "moved", "refitted", "review", "shift", "UNIFORM_BAND", "UNIFORM_MAX", "uniform_plans"]
