"""The autopilot as a coordinator of steps (:class:`~gradcompress.terms.Coordinator`): measure, decide, try.

The shell around the pure parts: it measures (:mod:`.measure`), gathers every rank's numbers, asks the policy
(:mod:`.policy`) and the trial (:mod:`.probation`), and applies the plan to the state (PowerSGD's factors of a key
whose codec changed start fresh; a change of layout moves the per-worker state). See the package's docstring for
what happens when.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging

from ..collectives import LocalCollectives
from ..spec import make
from ..terms import Coordinator, Terms
from ..timing import SOFTWARE_ALPHA, format_rate, payload_bandwidth
from . import report
from .allocate import LEVELS, REFERENCE, energies, errors, preconditioned
from .calibration import Cache
from .decide import MIN_GAIN, record
from .measure import Meter, Prober
from .policy import Basis, Check, Context, Decision, Regime, allocatable, decide, review
from .probation import (LAYOUTS, TRIAL_STEPS, Choice, LayoutTrial, Probation, Selection, Settling, Steady, judge,
                        pick)

log = logging.getLogger("gradcompress.auto")
#: dense, measured steps before the first decision (at least; ``warmup_steps`` may ask for more)
MEASURE_STEPS = 3


@dataclasses.dataclass
class Ledger:
    """What the decisions so far leave: their count, the switches of plan after the first, the step of the last,
    what it was based on, the link's fit it used ((overlap, share): how much of the backward pass the exchange
    hides behind, the share of the probed bandwidth it gets), and the last decision itself."""

    decisions: int = 0
    switches: int = 0
    decided_at: int | None = None
    basis: Basis | None = None
    fitted: tuple = (1.0, 1.0)
    last: Decision | None = None


class Costs:
    """What each candidate costs on each bucket (:func:`.decide.record`), for the buckets' keys it was recorded for;
    entries the calibration ``cache`` holds are not run again. ``digest()``: the recorded bytes as one number (48
    bits, exact in a float64), compared across ranks: a rank whose cache disagrees makes every rank record afresh."""

    def __init__(self, cache: Cache):
        self.cache = cache
        self.table: list | None = None  # [bucket][candidate] recorded options
        self.keys: list | None = None
        self.recalibrated = 0  # times the ranks' recorded bytes disagreed and every rank recorded without the cache

    def of(self, config, world: int, buckets) -> list:
        keys = [b.keys for b in buckets]
        if self.table is None or self.keys != keys:
            self.table, self.keys = record(config, world, buckets, config.auto.candidates, self.cache), keys
        return self.table

    def digest(self) -> float:
        rounds = repr([[o.rounds for o in row] for row in self.table or []])
        return float(int(hashlib.sha256(rounds.encode()).hexdigest()[:12], 16))

    def afresh(self, config, world: int, buckets) -> list:
        """Record every candidate again, the cache neither read nor written (every rank alike)."""
        self.recalibrated += 1
        self.table, self.keys = record(config, world, buckets, config.auto.candidates, None), [b.keys for b in buckets]
        return self.table


class Autopilot(Coordinator):
    """The plan of each step of a ``Compressor("auto")`` (``config.auto``: its options; ``session``: its group;
    ``cache``: the calibration cache, default where the options or the environment say, decided now)."""

    name = "auto"

    def __init__(self, config, state, session, cache: Cache | None = None):
        self.config, self.state, self.session = config, state, session
        self.meter, self.prober = Meter(), Prober()
        self.costs = Costs(cache if cache is not None else Cache.at(config.auto.cache))
        self.regime = Regime()
        self.probation = Probation()
        self.choice = Choice.of({})
        self.check: Check | None = None  # the last check's combined numbers
        self.ledger = Ledger()

    @property
    def options(self):
        return self.config.auto

    @property
    def first(self) -> int:
        return max(self.config.warmup_steps, MEASURE_STEPS)

    # ---------------------------------------------------------------- the coordinator
    def open(self, comm, index: int) -> Terms:
        """The terms of step ``index``; at a check step, every rank measures and decides together (on ``comm``)."""
        meter = self.meter
        meter.step_started(comm)
        due = index >= self.first and (index - self.first) % self.options.every == 0
        trial = self.probation.due(index)
        selecting = isinstance(self.probation.state, Selection)  # a check waits while plans are measured
        due = due and not selecting
        if (due or trial) and meter.buckets and comm.world > 1 and not isinstance(comm, LocalCollectives):
            meter.settle()  # the steps' times (on a GPU: the one synchronisation, here at a check)
            start = meter.clock.mark()
            if trial:  # a check due now waits for the next: the trial decides this step
                self._judge(comm, index)
            else:
                self._check(comm, index)
            meter.exclude(start, meter.clock.mark())
        after = index + 1 - self.first  # the step before each check keeps its gradients' norm (and a copy)
        measure = after >= 0 and after % self.options.every == 0
        return Terms(self.choice.plan, index, self.session.divisor(), sample=measure and self.options.allocate,
                     norm=measure and self.options.critical > 0)

    def closed(self, step) -> None:
        self.meter.closed(step.record)

    # ---------------------------------------------------------------- one check
    def _check(self, comm, index: int) -> None:
        meter, options, buckets = self.meter, self.options, self.meter.buckets
        costs = self.costs.of(self.config, comm.world, buckets)
        last = meter.record
        sample = last.sample if last is not None else None
        keys = allocatable(buckets, self.config.min_numel) if sample is not None else []
        fields = {"compute": [meter.compute_s()], "step": [meter.step_s()], "wait": [meter.wait_s()],
                  "digest": [self.costs.digest()], "codec": [o.codec_s for row in costs for o in row],
                  "norm": [float(last.norm_sq)] if last is not None and last.norm_sq is not None else [],
                  "errors": errors(sample, keys) if keys else [],
                  "energy": energies(sample, keys) if keys and options.allocate == "adam" else []}
        got = meter.gather(comm, fields, buckets[0].device)
        if (got["digest"] != got["digest"][0]).any():  # a rank's cache disagrees: every rank records afresh
            log.warning("gradcompress auto: step %d: the ranks' recorded bytes disagree (a stale calibration cache?); "
                        "every rank records its candidates again without the cache", index)
            costs = self.costs.afresh(self.config, comm.world, buckets)
            got["codec"] = meter.gather(comm, {"codec": [o.codec_s for row in costs for o in row]},
                                        buckets[0].device)["codec"]
        turned = bool(fields["norm"]) and self._observe(got["norm"].sum().item() ** 0.5)
        compute, step_s, wait_s = got["compute"].max().item(), got["step"].max().item(), got["wait"].max().item()
        steady = options.bandwidth is None and self.prober.link is not None and self.prober.steady(step_s, wait_s)
        bandwidth, alpha = self._link(comm, buckets[0].device, step_s, wait_s)
        codec = got["codec"].max(0).values.view(-1, len(options.candidates)).tolist()
        err = got["errors"].sum(0).view(len(keys), len(LEVELS)) if keys else None
        if err is not None and options.allocate == "adam":
            numels = [sample[k].numel() for k in keys]
            err = preconditioned(err, numels, got["energy"].sum(0))
        plan = self.choice.plan
        self.check = Check(index, compute, step_s, bandwidth, alpha, tuple(map(tuple, codec)),
                           step_s if plan.dense and plan.flat else 0.0, (tuple(keys), err))
        ctx = self._context()
        seen = review(self.check, ctx, turned, steady)
        if seen.decide:
            if seen.measured:  # the link or the compute changed: the layouts are compared again, and a plan a
                self.probation.moved(seen.more, seen.less)  # selection measured slower may be right now
            self.ledger.fitted = seen.fitted
            self._decide(decide(self.check, dataclasses.replace(ctx, fitted=seen.fitted)), step_s, tried=not turned)
        if isinstance(self.probation.state, Steady):
            self._try_layout(index, step_s)

    def _observe(self, norm: float) -> bool:
        """Record the gradient norm of this check; True if the regime changed (Accordion's detector)."""
        before, self.regime = self.regime, self.regime.observe(norm, self.options.critical)
        if self.regime.critical == before.critical:
            return False
        log.info("gradcompress auto: %s a critical regime (gradient norm %.4g, %.4g at the last check)",
                 "entering" if self.regime.critical else "leaving", norm, self.regime.norms[0])
        return True

    def _context(self) -> Context:
        ledger = self.ledger
        return Context(self.costs.table, self.meter.buckets, self.options, self.config.min_numel, self.meter.hooked,
                       ledger.basis, ledger.fitted, tuple(self.probation.rejected), self.regime.critical)

    def _link(self, comm, device, step_s: float, wait_s: float = 0.0) -> tuple[float, float]:
        """(payload bandwidth, alpha): the hint; or, where the prober says so, probed by every rank together (their
        numbers combined: the slowest link, the largest latency); else the last probe's, sending nothing."""
        if self.options.bandwidth is not None:
            return payload_bandwidth(self.options.bandwidth), SOFTWARE_ALPHA
        if not self.prober.due(step_s, wait_s):
            return self.prober.link
        probe = self.meter.link(comm, self.traffic() * self.options.every, device)
        got = self.meter.gather(comm, {"bandwidth": [probe[0]], "alpha": [probe[1]]}, device)
        link = (got["bandwidth"].min().item(), got["alpha"].max().item())
        self.prober.probed(step_s, link, wait_s)
        return link

    # ---------------------------------------------------------------- deciding and trying
    def _decide(self, decision: Decision, step_s: float, tried: bool = True) -> None:
        """Take ``decision``. Measured (no ``bandwidth=`` hint; ``tried``: not a change of regime): the current plan,
        the model's, the best uniform ones and dense are measured against each other (a :class:`Selection`), those a
        selection measured slower left out until the measurements move their way. Told: switch to the model's plan
        if it differs from the current one (measured for the layouts' comparison where there are nodes);
        ``step_s``: the current plan's measured step."""
        ledger, index = self.ledger, decision.check.index
        ledger.basis, ledger.last, ledger.decisions = decision.basis, decision, ledger.decisions + 1
        if self.options.bandwidth is None and tried:
            plans = self._proposals(decision)
            if len(plans) > 1:
                self.probation.begin(Selection.begin(index, plans))
                self.meter.start_block()
                log.info("gradcompress auto: step %d: measuring %s (the model predicted %.4g s/step for its plan, "
                         "dense %.4g s; link %s payload, latency %.3g ms, compute %.4g s)", index,
                         "; ".join(self.summary(p) for p in plans), decision.predicted_s, decision.dense_s,
                         format_rate(8 * decision.basis.bandwidth), 1e3 * decision.basis.alpha,
                         decision.basis.compute_s)
            ledger.decided_at = index
            return
        chosen = dict(decision.chosen)
        if chosen != self.choice.chosen and not self.probation.is_rejected(chosen):
            if ledger.decided_at is not None:
                ledger.switches += 1
            if self.options.bandwidth is None or self._layouts():
                self.probation.begin(Settling(index + TRIAL_STEPS, self.choice, step_s))
            self._apply(chosen)
            log.info("gradcompress auto: step %d: %s (predicted %.4g s/step, dense %.4g s; link %s payload, "
                     "latency %.3g ms, compute %.4g s)", index, self.summary(), decision.predicted_s,
                     decision.dense_s, format_rate(8 * decision.basis.bandwidth), 1e3 * decision.basis.alpha,
                     decision.basis.compute_s)
        ledger.decided_at = index

    def _proposals(self, decision: Decision) -> list[Choice]:
        """The plans a selection measures: the current one first, then the model's (a per-bucket mix only where the
        model predicts it faster than the best uniform plan by :data:`~.decide.MIN_GAIN`), the best uniform ones
        (:func:`~.policy.uniform_plans`) and dense (each once; those a selection measured slower left out)."""
        plans, mix = [self.choice], decision.predicted_s < decision.uniform_s * (1 - MIN_GAIN)
        models = (decision.chosen,) if mix or not decision.uniform else ()
        for chosen in models + tuple(decision.uniform) + ({},):
            chosen = dict(chosen)
            if all(p.chosen != chosen for p in plans) and not self.probation.is_rejected(chosen):
                plans.append(Choice.of(chosen, self.choice.layout))
        return plans

    def _measure_block(self, comm, index: int, selection: Selection) -> None:
        """A block of ``selection`` ended at step ``index``: its measure (the slowest rank's median step); the next
        block's plan, or the plan kept."""
        got = self.meter.gather(comm, {"block": list(self.meter.block_s())}, self.meter.buckets[0].device)
        selection = selection.measured(*got["block"].max(0).values.tolist())
        self.meter.start_block()
        if not selection.done:
            self.probation.begin(selection)
            nxt = selection.plans[selection.running]
            if nxt.chosen != self.choice.chosen:
                self._apply(nxt.chosen)
            return
        plans, means = selection.plans, selection.means()
        keys = {k for b in self.meter.buckets for k in b.keys}
        k = pick(plans, means, lambda c: set(c.chosen) == keys)
        kept, ledger = plans[k], self.ledger
        ledger.last = dataclasses.replace(ledger.last, trial=tuple((self.summary(p), t) for p, t in zip(plans, means)),
                                          trial_back=dict(kept.chosen) != dict(ledger.last.chosen))
        # the compute the next checks compare with: the selection's steady steps, not the warm-up's (a first
        # decision's compute comes from the steps right after the start, slower than those that follow)
        ledger.basis = dataclasses.replace(ledger.basis, compute_s=selection.means(2)[k])
        traffic = self.traffic(kept.chosen)
        self.probation.rejected += [(dict(p.chosen), self.traffic(p.chosen) < traffic) for p in plans if p is not kept]
        if kept.chosen != plans[0].chosen and ledger.decisions > 1:
            ledger.switches += 1
        if kept.chosen != self.choice.chosen:
            self._apply(kept.chosen)
        log.info("gradcompress auto: step %d: kept %s (measured: %s)", index, self.summary(),
                 ", ".join(f"{self.summary(p)} {t:.4g} s/step" for p, t in zip(plans, means)))
        self.prober.measured(means[k], selection.means(1)[k])
        self._try_layout(index, means[k])

    def _judge(self, comm, index: int) -> None:
        """The end of a selection's block, or of a layout's trial (the other layout's measured steps against the
        old's) or of a settling plan; then, where the session has nodes and they are still to be compared, the other
        layout's trial."""
        trial = self.probation.end()
        if isinstance(trial, Selection):
            return self._measure_block(comm, index, trial)
        new_step = self.meter.gather(comm, {"step": [self.meter.step_s()]}, self.meter.buckets[0].device)
        verdict = judge(trial, new_step["step"].max().item())
        if isinstance(trial, LayoutTrial):
            self.probation.layout_times = {trial.old.layout: verdict.old_step, self.choice.layout: verdict.new_step}
        if verdict.back:
            self.ledger.switches += 1
            self._apply(trial.old.chosen, trial.old.layout)
            log.info("gradcompress auto: step %d: back to %s (the new plan took %.4g s/step, the old %.4g s)",
                     index, self.summary(), verdict.new_step, verdict.old_step)
        self.prober.measured(verdict.kept)  # the plan kept, as measured: what the next checks are compared with
        self._try_layout(index, verdict.kept)

    def _try_layout(self, index: int, step_s: float) -> None:
        """Start the layout's trial (the current codecs on the other layout) if the session has nodes and the
        layouts are still to be compared; ``step_s``: the current plan's measured step time (every rank's same)."""
        if not self._layouts():
            return
        trial = self.probation.layout_trial(index, self.choice, step_s)
        if trial is None:
            return
        self.probation.begin(trial)
        if isinstance(trial, LayoutTrial):
            other = self.choice.other_layout()
            self.ledger.switches += 1
            self._apply(self.choice.chosen, other)
            log.info("gradcompress auto: step %d: trying the %s exchange (%s; %s took %.4g s/step)", index, other,
                     self.summary(), trial.old.layout, step_s)

    def _layouts(self) -> bool:
        """Whether flat and hierarchical can be compared: the session has nodes and the groups are exchanges (an
        FSDP reduce-scatter's layout is not switched)."""
        return self.session.hierarchy is not None and all(b.kind == "exchange" for b in self.meter.buckets)

    def _apply(self, chosen: dict, layout: str | None = None) -> None:
        """Make ``chosen`` (key -> spec) the plan, on ``layout`` (default: the current); PowerSGD factors of keys
        whose codec changed start fresh; a new layout takes the per-worker state along (``Session.relayout``)."""
        old = self.choice
        changed = [k for k in set(chosen) | set(old.chosen) if chosen.get(k, "none") != old.chosen.get(k, "none")]
        self.state.forget(("q", "p"), changed)
        layout = old.layout if layout is None else layout
        if layout != old.layout:
            session = self.session
            shapes = {k: s for b in self.meter.buckets for k, s in zip(b.keys, b.shapes)
                      if layout == "flat" or session.hierarchical(make(chosen.get(k, "none")))}
            session.relayout(self.state, shapes, layout == "hierarchical")
        self.choice = Choice.of(chosen, layout)

    def traffic(self, chosen: dict | None = None) -> int:
        """Bytes one step of the current plan (or ``chosen``) sends (from the recording: the same on every rank)."""
        index = self._indices(chosen)
        return sum(sum(c.sent for r in row[i].rounds for c in r) for i, row in zip(index, self.costs.table))

    def _indices(self, chosen: dict | None = None) -> list[int]:
        """The current plan (or ``chosen``) as a candidate index per bucket (0: dense; a bucket of allocated levels:
        the reference)."""
        chosen = self.choice.chosen if chosen is None else chosen
        index = {spec: i for i, spec in enumerate(self.options.candidates)}
        out = []
        for b in self.meter.buckets:
            specs = {chosen.get(k, "none") for k in b.keys} or {"none"}
            out.append(index[specs.pop()] if len(specs) == 1 and specs <= set(index) else index.get(REFERENCE, 0))
        return out

    # ---------------------------------------------------------------- reporting and checkpoints
    def stats(self) -> dict:
        return report.stats(self)

    def explain(self) -> str:
        return report.explain(self)

    def state_dict(self) -> dict:
        return report.state_dict(self)

    def load_state_dict(self, state: dict) -> None:
        """Resume the decision (``Compressor.load_state_dict``): the plan, its layout and what it was based on."""
        layout = state.get("layout", "flat")
        if layout not in LAYOUTS:
            raise ValueError(f"Compressor.load_state_dict: auto's layout must be one of {', '.join(LAYOUTS)}, got "
                             f"{layout!r}")
        basis, fitted, decided = state.get("basis") or (), state.get("fitted") or (1.0, 1.0), state.get("decided_at", -1)
        self.ledger = Ledger(int(state.get("decisions", 0)), int(state.get("switches", 0)),
                             None if int(decided) < 0 else int(decided), Basis(*basis) if len(basis) == 3 else None,
                             (float(fitted[0]), float(fitted[1])))
        self.choice = Choice.of({k: spec for k, spec in state.get("plan", {}).items() if spec != "none"}, layout)
        self.regime = Regime(tuple(float(n) for n in state.get("norms", [])), bool(state.get("critical", False)),
                             int(state.get("regimes", 0)))

    def summary(self, choice: Choice | None = None) -> str:
        """The plan (default the current) in words: codec and number of buckets."""
        chosen, counts = (self.choice if choice is None else choice).chosen, {}
        for b in self.meter.buckets:
            spec = "+".join(sorted({chosen.get(k, "none") for k in b.keys})) if b.keys else "none"
            counts[spec] = counts.get(spec, 0) + 1
        return ", ".join(f"{'dense' if s == 'none' else s} x{n} bucket{'s' * (n > 1)}" for s, n in counts.items())
