"""What the autopilot tells: ``stats()["auto"]``, ``explain()`` and its checkpoint (``state_dict()["auto"]``)."""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Mapping
from typing import TYPE_CHECKING, Any, Protocol

from ..autospec import CRITICAL_DROPS
from ..timing import format_rate
from .allocate import REFERENCE
from .decide import Link, predicted_step_s
from .probation import Selection

if TYPE_CHECKING:
    from ..session import Session
    from ..spec import Auto
    from ..terms import Seen
    from .ledger import Costs, Ledger
    from .measure import Meter
    from .policy import Check, Decision, Regime
    from .probation import Choice, Probation


class Reported(Protocol):
    """What the report reads of the autopilot (:class:`~.pilot.Autopilot`, named by its shape: pilot.py imports
    this module)."""

    choice: Choice
    meter: Meter
    check: Check | None
    ledger: Ledger
    regime: Regime
    probation: Probation
    costs: Costs
    session: Session

    @property
    def options(self) -> Auto: ...

    @property
    def first(self) -> int: ...

    def summary(self, choice: Choice | None = None) -> str: ...


def stats(pilot: Reported) -> dict[str, Any]:
    """``stats()["auto"]``: ``plan`` (DDP buckets, or FSDP groups, per codec spec, ``none`` = dense; a bucket whose
    tensors got several levels counts under their specs joined by ``+``: the unit the log's ``int4 x6`` counts),
    ``decisions`` (choices made),
    ``switches`` (changes of plan after the first), ``decided_at`` (step), the combined measurements of the last
    check (``compute_s``, ``bandwidth_bit`` (payload, probed), ``latency_s``), ``overlap`` and ``link_share`` (how
    much of the backward pass the exchange hides behind, and the share of the probed bandwidth it gets, fitted on
    the dense steps), ``predicted_step_s`` and ``dense_step_s`` of the last decision, ``trial`` (the last selection:
    ``[plan in words, measured s/step]`` per plan it measured, the current plan first; None before one ends),
    ``noise_s`` (the last selection's measured noise of one block) and ``why`` (what made the last decision),
    ``selecting`` (a selection is measuring now), ``recalibrated`` (times the ranks' recorded bytes disagreed and
    every rank recorded afresh), ``layout`` (``"flat"`` or ``"hierarchical"``),
    ``layout_step_s`` (layout -> measured step time, from the last comparison of the two; empty without nodes),
    ``critical`` (in a critical regime: the budget's riskiest codecs left out), ``regimes`` (changes of regime),
    ``grad_norm`` (the gradient norm at the last check), ``allocation`` (``allocate=true``: tensors per level,
    payload bytes and squared error against the reference's; empty otherwise) and ``probe_bytes`` (the measuring's
    own traffic)."""
    counts = plan_counts(pilot.choice.chosen, pilot.meter.buckets)
    check, ledger, regime = pilot.check, pilot.ledger, pilot.regime
    last = ledger.last
    return {"plan": counts, "decisions": ledger.decisions, "switches": ledger.switches,
            "decided_at": ledger.decided_at, "compute_s": check.compute_s if check else None,
            "bandwidth_bit": 8 * check.bandwidth if check else None, "latency_s": check.alpha if check else None,
            "link_share": ledger.fitted[1], "overlap": overlap(pilot),
            "predicted_step_s": last.predicted_s if last else None, "dense_step_s": last.dense_s if last else None,
            "trial": [list(t) for t in last.trial.times] if last and last.trial else None,
            "noise_s": last.trial.noise_s if last and last.trial else None, "why": last.why if last else None,
            "selecting": isinstance(pilot.probation.state, Selection), "recalibrated": pilot.costs.recalibrated,
            "layout": pilot.choice.layout,
            "layout_step_s": dict(pilot.probation.layout_times), "allocation": dict(last.allocation) if last else {},
            "critical": regime.critical, "regimes": regime.changes, "grad_norm": regime.norms[-1] if regime.norms
            else None, "probe_bytes": pilot.meter.probe_bytes}


def overlap(pilot: Reported) -> float:
    """How much of the backward pass the exchange hides behind: none without the DDP hook, else as fitted."""
    return pilot.ledger.fitted[0] if pilot.meter.hooked else 0.0


def explain(pilot: Reported) -> str:
    """What was measured and why each bucket got its codec: per bucket, the predicted step time with each candidate
    there (the other buckets as chosen)."""
    last, options = pilot.ledger.last, pilot.options
    if last is None:
        if pilot.choice.chosen:
            return (f"{options.text()}: the plan restored from a checkpoint ({pilot.summary()}); measured and "
                    f"decided again at the next check")
        return f"{options.text()}: no decision yet (dense; the first comes at step {pilot.first}, after measuring)"
    return "\n".join([_headline(pilot, last)] + _regime_lines(pilot) + _layout_lines(pilot)
                     + _allocation_lines(last) + _bucket_lines(pilot, last))


def _headline(pilot, last) -> str:
    ledger, check = pilot.ledger, last.check
    tried = "" if last.trial is None else ("; measured: " + measured_text(last)
                                          + f" (kept: {pilot.summary()}"
                                          + (", not the model's plan)" if last.trial.back else ", the model's plan)"))
    if isinstance(pilot.probation.state, Selection):
        tried = f"; measuring {len(pilot.probation.state.plans)} plans against each other"
    why = f" ({last.why})" if last.why else ""
    return (f"{pilot.options.text()}: decided at step {ledger.decided_at}{why} from the check at step {check.index}: "
            f"compute {seconds(check.compute_s)}/step, {link_text(last)} (overlap with the backward pass "
            f"{overlap(pilot):.2f}), latency {1e3 * check.alpha:.3g} ms; predicted {seconds(last.predicted_s)}/step "
            f"(all dense: {seconds(last.dense_s)}); {ledger.decisions} decisions, {ledger.switches} switches{tried}")


def seconds(t: float) -> str:
    """A time as the log and ``explain()`` both write it: ms below a second."""
    return f"{1e3 * t:.3g} ms" if abs(t) < 1 else f"{t:.4g} s"


def link_text(decision: Decision) -> str:
    """The link a decision was made on, as the log and ``explain()`` both say it: the rate probed (or given as
    ``bandwidth=``) and the rate the step gets (the probed one times the share fitted on the dense steps: what the
    model predicted with)."""
    probed, used = decision.check.bandwidth, decision.basis.bandwidth
    if abs(used - probed) <= 1e-9 * probed:
        return f"link {format_rate(8 * probed)} payload"
    return f"link {format_rate(8 * probed)} payload probed, {format_rate(8 * used)} in the step"


def measured_text(decision: Decision) -> str:
    """The plans a selection measured, the kept one first as it ran: ``plan t/step`` each, and the noise."""
    trial = decision.trial
    assert trial is not None, "a decision a selection measured"
    text = ", ".join(f"{plan} {seconds(t)}/step" for plan, t in trial.times)
    return text + (f" (noise ±{seconds(trial.noise_s)} per block)" if trial.noise_s else "")


def plan_counts(chosen: Mapping[Hashable, str], buckets: Iterable[Seen]) -> dict[str, int]:
    """The plan ``chosen`` (key -> spec, the others dense) as buckets per spec (``none``: dense; a bucket of several
    specs under them joined by ``+``), in the buckets' order of first appearance."""
    counts: dict = {}
    for b in buckets:
        spec = "+".join(sorted({chosen.get(k, "none") for k in b.keys})) if b.keys else "none"
        counts[spec] = counts.get(spec, 0) + 1
    return counts


def plan_text(counts: dict) -> str:
    """``int8 x2, dense x4``: buckets per codec (:func:`plan_counts`)."""
    return ", ".join(f"{'dense' if s == 'none' else s} x{n}" for s, n in counts.items()) or "dense"


def _regime_lines(pilot) -> list[str]:
    regime, options = pilot.regime, pilot.options
    if not regime.norms or options.critical <= 0:
        return []
    state = "critical: " + ", ".join(CRITICAL_DROPS[options.budget]) + " left out" if regime.critical else \
        "not critical"
    before = f", {regime.norms[0]:.4g} at the check before" if len(regime.norms) > 1 else ""
    return [f"  regime: {state} (gradient norm {regime.norms[-1]:.4g}{before}; critical above a change of "
            f"{options.critical:g})"]


def _layout_lines(pilot) -> list[str]:
    times = pilot.probation.layout_times
    if times:
        text = ", ".join(f"{k} {v:.4g} s/step" for k, v in times.items())
        return [f"  layout: {pilot.choice.layout} (measured: {text})"]
    if pilot.session.hierarchy is not None:
        return [f"  layout: {pilot.choice.layout} (the other not measured yet)"]
    return []


def _allocation_lines(last) -> list[str]:
    a = last.allocation
    if not a:
        return []
    counts = ", ".join(f"{spec} x{n}" for spec, n in a["tensors"].items() if n)
    return [f"  per-tensor allocation of the {REFERENCE} buckets: {counts}; payload "
            f"{a['payload_bytes'] / 1e3:.4g} KB against {a['reference_bytes'] / 1e3:.4g} KB with {REFERENCE} "
            f"everywhere, error {a['error']:.4g} against {a['reference_error']:.4g}"]


def _bucket_lines(pilot, last) -> list[str]:
    """Per bucket: the codec it runs now and, where the model would choose otherwise, the model's; the model's
    predicted step with each candidate there (the other buckets as the model chose)."""
    choice, cands, sizes = list(last.choice), pilot.options.candidates, list(last.sizes)
    basis, lines = last.basis, []
    link = Link(basis.bandwidth, basis.alpha)
    chosen = pilot.choice.chosen
    for b, c in enumerate(choice):
        times = [predicted_step_s(choice[:b] + [k] + choice[b + 1:], pilot.costs.table, sizes, link, basis.compute_s,
                         overlap(pilot), list(last.check.codec)) for k in range(len(cands))]
        alts = ", ".join(f"{'dense' if s == 'none' else s} {seconds(t)}" for s, t in zip(cands, times))
        keys = pilot.meter.buckets[b].keys if b < len(pilot.meter.buckets) else ()
        runs = plan_text(plan_counts(chosen, [pilot.meter.buckets[b]])).rsplit(" x", 1)[0] if keys else "dense"
        model = "dense" if cands[c] == "none" else cands[c]
        said = runs if runs == model else f"{runs} (the model's: {model})"
        lines.append(f"  bucket {b} ({sizes[b]} elements): {said}; predicted step with each: {alts}")
    return lines


def state_dict(pilot: Reported) -> dict[str, Any]:
    """The decision (``plan``: key -> spec), what it was based on, and the counters (plain values)."""
    ledger, regime, basis = pilot.ledger, pilot.regime, pilot.ledger.basis
    return {"plan": dict(pilot.choice.chosen), "layout": pilot.choice.layout,
            "basis": [basis.compute_s, basis.bandwidth, basis.alpha] if basis else [],
            "critical": regime.critical, "norms": list(regime.norms), "regimes": regime.changes,
            "fitted": list(ledger.fitted), "decisions": ledger.decisions, "switches": ledger.switches,
            "decided_at": -1 if ledger.decided_at is None else ledger.decided_at}


__all__ = ["explain", "link_text", "measured_text", "overlap", "plan_counts", "plan_text", "seconds", "state_dict",
           "stats"]
