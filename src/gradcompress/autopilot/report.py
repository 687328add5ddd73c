"""What the autopilot tells: ``stats()["auto"]``, ``explain()`` and its checkpoint (``state_dict()["auto"]``)."""

from __future__ import annotations

from ..autospec import CRITICAL_DROPS
from ..timing import format_rate
from .allocate import REFERENCE
from .decide import Link, predict
from .probation import Selection


def stats(pilot) -> dict:
    """``stats()["auto"]``: ``plan`` (keys per codec spec, ``none`` = dense), ``decisions`` (choices made),
    ``switches`` (changes of plan after the first), ``decided_at`` (step), the combined measurements of the last
    check (``compute_s``, ``bandwidth_bit`` (payload, probed), ``latency_s``), ``overlap`` and ``link_share`` (how
    much of the backward pass the exchange hides behind, and the share of the probed bandwidth it gets, fitted on
    the dense steps), ``predicted_step_s`` and ``dense_step_s`` of the last decision, ``trial`` (the last selection:
    ``[plan in words, measured s/step]`` per plan it measured, the current plan first; None before one ends),
    ``selecting`` (a selection is measuring now), ``recalibrated`` (times the ranks' recorded bytes disagreed and
    every rank recorded afresh), ``layout`` (``"flat"`` or ``"hierarchical"``),
    ``layout_step_s`` (layout -> measured step time, from the last comparison of the two; empty without nodes),
    ``critical`` (in a critical regime: the budget's riskiest codecs left out), ``regimes`` (changes of regime),
    ``grad_norm`` (the gradient norm at the last check), ``allocation`` (``allocate=true``: tensors per level,
    payload bytes and squared error against the reference's; empty otherwise) and ``probe_bytes`` (the measuring's
    own traffic)."""
    counts: dict = {}
    chosen = pilot.choice.chosen
    for spec in chosen.values():
        counts[spec] = counts.get(spec, 0) + 1
    dense = sum(len(b.keys) for b in pilot.meter.buckets) - len(chosen)
    if dense > 0:
        counts["none"] = dense
    check, ledger, regime = pilot.check, pilot.ledger, pilot.regime
    last = ledger.last
    return {"plan": counts, "decisions": ledger.decisions, "switches": ledger.switches,
            "decided_at": ledger.decided_at, "compute_s": check.compute_s if check else None,
            "bandwidth_bit": 8 * check.bandwidth if check else None, "latency_s": check.alpha if check else None,
            "link_share": ledger.fitted[1], "overlap": overlap(pilot),
            "predicted_step_s": last.predicted_s if last else None, "dense_step_s": last.dense_s if last else None,
            "trial": [list(t) for t in last.trial] if last and last.trial else None,
            "selecting": isinstance(pilot.probation.state, Selection), "recalibrated": pilot.costs.recalibrated,
            "layout": pilot.choice.layout,
            "layout_step_s": dict(pilot.probation.layout_times), "allocation": dict(last.allocation) if last else {},
            "critical": regime.critical, "regimes": regime.changes, "grad_norm": regime.norms[-1] if regime.norms
            else None, "probe_bytes": pilot.meter.probe_bytes}


def overlap(pilot) -> float:
    """How much of the backward pass the exchange hides behind: none without the DDP hook, else as fitted."""
    return pilot.ledger.fitted[0] if pilot.meter.hooked else 0.0


def explain(pilot) -> str:
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
    tried = "" if last.trial is None else ("; measured: " + ", ".join(f"{plan} {t:.4g} s/step" for plan, t in last.trial)
                                          + f" (kept: {pilot.summary()}"
                                          + (", not the model's plan)" if last.trial_back else ", the model's plan)"))
    if isinstance(pilot.probation.state, Selection):
        tried = f"; measuring {len(pilot.probation.state.plans)} plans against each other"
    return (f"{pilot.options.text()}: decided at step {ledger.decided_at} from the check at step {check.index}: "
            f"compute {check.compute_s:.4g} s/step, link {format_rate(8 * check.bandwidth)} payload "
            f"(in the step: x{ledger.fitted[1]:.3g}; overlap with the backward pass {overlap(pilot):.2f}), "
            f"latency {1e3 * check.alpha:.3g} ms; predicted {last.predicted_s:.4g} s/step "
            f"(all dense: {last.dense_s:.4g} s); {ledger.decisions} decisions, {ledger.switches} switches{tried}")


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
    choice, cands, sizes = list(last.choice), pilot.options.candidates, list(last.sizes)
    basis, lines = pilot.ledger.basis, []
    link = Link(basis.bandwidth, basis.alpha)
    for b, c in enumerate(choice):
        times = [predict(choice[:b] + [k] + choice[b + 1:], pilot.costs.table, sizes, link, basis.compute_s,
                         overlap(pilot), list(last.check.codec)) for k in range(len(cands))]
        alts = ", ".join(f"{'dense' if s == 'none' else s} {t:.4g}" for s, t in zip(cands, times))
        lines.append(f"  bucket {b} ({sizes[b]} elements): {'dense' if cands[c] == 'none' else cands[c]}; "
                     f"step s with each: {alts}")
    return lines


def state_dict(pilot) -> dict:
    """The decision (``plan``: key -> spec), what it was based on, and the counters (plain values)."""
    ledger, regime, basis = pilot.ledger, pilot.regime, pilot.ledger.basis
    return {"plan": dict(pilot.choice.chosen), "layout": pilot.choice.layout,
            "basis": [basis.compute_s, basis.bandwidth, basis.alpha] if basis else [],
            "critical": regime.critical, "norms": list(regime.norms), "regimes": regime.changes,
            "fitted": list(ledger.fitted), "decisions": ledger.decisions, "switches": ledger.switches,
            "decided_at": -1 if ledger.decided_at is None else ledger.decided_at}


__all__ = ["explain", "overlap", "state_dict", "stats"]
