"""The autopilot as a coordinator of steps (:class:`~gradcompress.terms.Coordinator`): measure, decide, try.

The shell around the pure parts: it measures (:mod:`.measure`), gathers every rank's numbers, asks the policy
(:mod:`.policy`) and the trial (:mod:`.probation`), and applies the plan to the state (PowerSGD's factors of a key
whose codec changed start fresh; a change of layout moves the per-worker state). See the package's docstring for
what happens when.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, cast

from ..collectives import LocalCollectives
from ..spec import make
from ..terms import Coordinator, Terms
from ..timing import SOFTWARE_ALPHA, payload_bandwidth
from . import report
from .allocate import LEVELS, REFERENCE, energies, errors, preconditioned
from .calibration import Cache
from .decide import MIN_GAIN
from .ledger import Costs, Ledger, _auto
from .measure import Meter, Prober
from .policy import Basis, Check, Situation, Decision, Regime, Trial, allocatable, decide, review
from .probation import LAYOUTS, TRIAL_STEPS, Choice, LayoutTrial, Probation, Selection, Settling, Steady, judge

if TYPE_CHECKING:
    from ..collectives import Collectives
    from ..config import Config
    from ..session import Session
    from ..spec import Auto
    from ..state import State
    from ..terms import Closed

log = logging.getLogger("gradcompress.auto")
#: dense, measured steps before the first decision (at least; ``warmup_steps`` may ask for more)
MEASURE_STEPS = 3
#: the critical-regime detector reads the gradients' mean squared norm over this many steps before each check (at
#: most ``every``): one minibatch's norm is noise that flipped the regime at most checks of a converging run
NORM_STEPS = 4


class Autopilot(Coordinator):
    """The plan of each step of a ``Compressor("auto")`` (``config.auto``: its options; ``session``: its group;
    ``cache``: the calibration cache, default where the options or the environment say, decided now)."""

    name = "auto"

    def __init__(self, config: Config, state: State, session: Session, cache: Cache | None = None):
        self.config, self.state, self.session = config, state, session
        self.meter, self.prober = Meter(norms=NORM_STEPS), Prober()
        self.costs = Costs(cache if cache is not None else Cache.at(_auto(config).cache))
        self.regime = Regime()
        self.probation = Probation()
        self.choice = Choice.of({})
        self.check: Check | None = None  # the last check's combined numbers
        self.ledger = Ledger()
        self.rank = 0  # this process's rank in the group (set at each step): only rank 0 logs the decisions

    @property
    def options(self) -> Auto:
        return _auto(self.config)

    @property
    def first(self) -> int:
        return max(self.config.warmup_steps, MEASURE_STEPS)

    # ---------------------------------------------------------------- the coordinator
    def open(self, comm: Collectives, index: int) -> Terms:
        """The terms of step ``index``; at a check step, every rank measures and decides together (on ``comm``)."""
        meter = self.meter
        self.rank = comm.rank
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
        after = index + 1 - self.first  # the step before each check keeps a copy of its gradients
        measure = after >= 0 and after % self.options.every == 0
        # the last NORM_STEPS steps before each check sum their gradients' squared norm (the regime's detector)
        until = (self.first - 1 - index) % self.options.every
        norm = index >= 0 and until < min(NORM_STEPS, self.options.every) and self.options.critical > 0
        return Terms(self.choice.plan, index, self.session.divisor(), sample=cast(bool, measure and self.options.allocate),  # truthy (allocate: True or "adam")
                     norm=norm)

    def closed(self, step: Closed) -> None:
        self.meter.closed(step.record)

    # ---------------------------------------------------------------- one check
    def _check(self, comm, index: int) -> None:
        meter, options, buckets = self.meter, self.options, self.meter.buckets
        costs = self.costs.of(self.config, comm.world, buckets)
        last = meter.record
        sample: Any = last.sample if last is not None else None  # read only where keys: a sample was taken
        keys = allocatable(buckets, self.config.min_numel) if sample is not None else []
        fields = {"compute": [meter.compute_s()], "step": [meter.step_s()], "wait": [meter.wait_s()],
                  "digest": [self.costs.digest()], "codec": [o.codec_s for row in costs for o in row],
                  "norm": meter.norm_sq(),
                  "errors": errors(sample, keys) if keys else [],
                  "energy": energies(sample, keys) if keys and options.allocate == "adam" else []}
        got = meter.gather(comm, fields, buckets[0].device)
        if (got["digest"] != got["digest"][0]).any():  # a rank's cache disagrees: every rank records afresh
            log.warning("gradcompress auto [rank %d]: step %d: the ranks' recorded bytes disagree (a stale calibration "
                        "cache?); every rank records its candidates again without the cache", self.rank, index)
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
        situation = self._situation()
        seen = review(self.check, situation, turned, steady)
        if seen.decide:
            if seen.measured:  # the link or the compute changed: the layouts are compared again, and a plan a
                self.probation.moved(seen.more, seen.less)  # selection measured slower may be right now
                self.ledger.displaced = None  # measured again: the plan a regime displaced is not restored blindly
            self.ledger.fitted = seen.fitted
            decision = decide(self.check, dataclasses.replace(situation, fitted=seen.fitted))
            decision = dataclasses.replace(decision, why=seen.why)
            if turned and not seen.measured:
                self._regime(decision, step_s)
            else:
                self._decide(decision, step_s)
        if isinstance(self.probation.state, Steady):
            self._try_layout(index, step_s)

    def _observe(self, norm: float) -> bool:
        """Record the gradient norm of this check; True if the regime changed (Accordion's detector)."""
        before, self.regime = self.regime, self.regime.observe(norm, self.options.critical)
        return self.regime.critical != before.critical

    def _situation(self) -> Situation:
        ledger = self.ledger
        table = cast(list, self.costs.table)  # recorded at the check
        return Situation(table, self.meter.buckets, self.options, self.config.min_numel, self.meter.hooked,
                       ledger.basis, ledger.fitted, tuple(self.probation.rejected), self.regime.critical)

    def _link(self, comm, device, step_s: float, wait_s: float = 0.0) -> tuple[float, float]:
        """(payload bandwidth, alpha): the hint; or, where the prober says so, probed by every rank together (their
        numbers combined: the slowest link, the largest latency); else the last probe's, sending nothing."""
        if self.options.bandwidth is not None:
            return payload_bandwidth(self.options.bandwidth), SOFTWARE_ALPHA
        if not self.prober.due(step_s, wait_s):
            return cast("tuple[float, float]", self.prober.link)  # due() until a probe has set it
        probe = self.meter.link(comm, self.traffic() * self.options.every, device)
        got = self.meter.gather(comm, {"bandwidth": [probe[0]], "alpha": [probe[1]]}, device)
        link = (got["bandwidth"].min().item(), got["alpha"].max().item())
        self.prober.probed(step_s, link, wait_s)
        return link

    # ---------------------------------------------------------------- deciding and trying
    def _decide(self, decision: Decision, step_s: float) -> None:
        """Take ``decision``. Measured (no ``bandwidth=`` hint; ``tried``: not a change of regime): the current plan,
        the model's, the best uniform ones and dense are measured against each other (a :class:`Selection`), those a
        selection measured slower left out until the measurements move their way (the selection's end logs the
        decision, on rank 0). Told: switch to the model's plan if it differs from the current one (measured for the
        layouts' comparison where there are nodes); ``step_s``: the current plan's measured step."""
        ledger, index = self.ledger, decision.check.index
        ledger.basis, ledger.last, ledger.decisions = decision.basis, decision, ledger.decisions + 1
        if self.options.bandwidth is None:
            plans = self._proposals(decision)
            if len(plans) > 1:
                self.probation.begin(Selection.begin(index, plans))
                self.meter.start_block()
                self._say(logging.DEBUG, "step %d: measuring %s (%s; the model predicted %s/step for its plan, "
                          "dense %s; %s, compute %s/step)", index, "; ".join(self.summary(p) for p in plans),
                          decision.why, report.seconds(decision.predicted_s), report.seconds(decision.dense_s),
                          report.link_text(decision), report.seconds(decision.basis.compute_s))
            else:
                self._say(logging.INFO, "step %d: %s stays (%s; nothing new to measure: the other plans were "
                          "measured slower; %s, compute %s/step)", index, self.summary(), decision.why,
                          report.link_text(decision), report.seconds(decision.basis.compute_s))
            ledger.decided_at = index
            return
        chosen = dict(decision.chosen)
        changed = chosen != self.choice.chosen and not self.probation.is_rejected(chosen)
        if changed:
            if ledger.decided_at is not None:
                ledger.switches += 1
            if self.options.bandwidth is None or self._layouts():
                self.probation.begin(Settling(index + TRIAL_STEPS, self.choice, step_s))
            self._apply(chosen)
        self._say(logging.INFO, "step %d: %s%s (%s; predicted %s/step, dense %s; %s as given, compute %s/step)", index,
                  self.summary(), "" if changed else " stays", decision.why, report.seconds(decision.predicted_s),
                  report.seconds(decision.dense_s), report.link_text(decision),
                  report.seconds(decision.basis.compute_s))
        ledger.decided_at = index

    def _regime(self, decision: Decision, step_s: float) -> None:
        """A change of regime (``critical=``), nothing else moved: entering one, a plan that uses a codec it leaves
        out moves to the fastest plan of the last selection without them (else the model's); a plan that does not
        stays. Leaving one, the plan it displaced comes back; without one, a measured decision as any other (the plans
        left out may be measured now). No switch on a regime change otherwise: the plan the step measured stays."""
        ledger, index, regime = self.ledger, decision.check.index, self.regime
        ledger.basis, ledger.last, ledger.decisions = decision.basis, decision, ledger.decisions + 1
        ledger.decided_at = index
        dropped = self._dropped()
        norms = f"gradient norm {regime.norms[-1]:.4g}, {regime.norms[0]:.4g} at the last check"
        if regime.critical and set(self.choice.chosen.values()) & dropped:
            allowed = [(t, chosen) for chosen, t in ledger.measured if not set(chosen.values()) & dropped]
            target = min(allowed, key=lambda x: x[0])[1] if allowed else dict(decision.chosen)
            ledger.displaced = dict(self.choice.chosen)
            self._switch(index, target, step_s)
            self._say(logging.INFO, "step %d: %s (%s: %s; %s left out, %s)", index, self.summary(), decision.why,
                      norms, ", ".join(sorted(dropped)), "the fastest plan without them the last selection measured"
                      if allowed else "the model's plan without them")
        elif not regime.critical and ledger.displaced is not None:
            target, ledger.displaced = ledger.displaced, None
            self._switch(index, target, step_s)
            self._say(logging.INFO, "step %d: %s (%s: %s; back to the plan it displaced)", index, self.summary(),
                      decision.why, norms)
        elif not regime.critical:
            ledger.decisions -= 1  # counted by _decide
            self._decide(decision, step_s)
        else:
            self._say(logging.INFO, "step %d: %s stays (%s: %s; it uses none of %s)", index, self.summary(),
                      decision.why, norms, ", ".join(sorted(dropped)))

    def _dropped(self) -> set:
        """The codecs a critical regime leaves out."""
        return set(self.options.candidates) - set(self.options.critical_candidates)

    def _switch(self, index: int, chosen: dict, step_s: float) -> None:
        """A switch the step does not judge (a change of regime): to ``chosen``, counted, settled for the layouts'
        comparison."""
        if chosen == self.choice.chosen:
            return
        self.ledger.switches += 1
        if self.options.bandwidth is None or self._layouts():
            self.probation.begin(Settling(index + TRIAL_STEPS, self.choice, step_s))
        self._apply(chosen)

    def _say(self, level: int, message: str, *args) -> None:
        """A decision's line, on rank 0 only (every rank decides alike: one line says it)."""
        if self.rank == 0:
            log.log(level, "gradcompress auto: " + message, *args)

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
        dropped = self._dropped() if self.regime.critical else set()
        barred = {i for i, p in enumerate(plans) if set(p.chosen.values()) & dropped}  # a critical regime's
        k = selection.kept(lambda c: set(c.chosen) == keys, barred)
        kept, ledger = plans[k], self.ledger
        last = cast(Decision, ledger.last)  # a selection follows a decision
        times = tuple((self.summary(p), t) for p, t in zip(plans, means))
        ledger.last = dataclasses.replace(last, trial=Trial(times, dict(kept.chosen) != dict(last.chosen),
                                                            selection.noise()))
        ledger.measured = tuple((dict(p.chosen), t) for p, t in zip(plans, means))
        # the compute the next checks compare with: the selection's steady steps, not the warm-up's (a first
        # decision's compute comes from the steps right after the start, slower than those that follow)
        ledger.basis = dataclasses.replace(cast(Basis, ledger.basis), compute_s=selection.means(2)[k])
        traffic = self.traffic(kept.chosen)
        self.probation.rejected += [(dict(p.chosen), self.traffic(p.chosen) < traffic) for p in plans if p is not kept]
        if kept.chosen != plans[0].chosen and ledger.decisions > 1:
            ledger.switches += 1
        if kept.chosen != self.choice.chosen:
            self._apply(kept.chosen)
        best = min(range(len(plans)), key=lambda i: means[i])
        note = ""
        if k == 0 and best != 0:
            note = f"; {self.summary(plans[best])} not faster by more than {report.seconds(selection.margin(best))}"
        others = ", ".join(f"{self.summary(p)} {report.seconds(t)}" for i, (p, t) in enumerate(zip(plans, means))
                           if i != k)
        self._say(logging.INFO, "step %d: %s%s (%s; measured %s/step against %s, noise ±%s per block%s; %s, "
                  "compute %s/step)", index, self.summary(), " stays" if k == 0 else "", last.why,
                  report.seconds(means[k]), others,
                  report.seconds(selection.noise()), note, report.link_text(last), report.seconds(last.basis.compute_s))
        self.prober.measured(means[k], selection.means(1)[k])
        self._try_layout(index, means[k])

    def _judge(self, comm, index: int) -> None:
        """The end of a selection's block, or of a layout's trial (the other layout's measured steps against the
        old's) or of a settling plan; then, where the session has nodes and they are still to be compared, the other
        layout's trial."""
        trial = self.probation.end()
        if isinstance(trial, Selection):
            return self._measure_block(comm, index, trial)
        assert not isinstance(trial, Steady), "judged only when due: something is on probation"
        new_step = self.meter.gather(comm, {"step": [self.meter.step_s()]}, self.meter.buckets[0].device)
        verdict = judge(trial, new_step["step"].max().item())
        if isinstance(trial, LayoutTrial):
            self.probation.layout_times = {trial.old.layout: verdict.old_step, self.choice.layout: verdict.new_step}
        if verdict.back:
            self.ledger.switches += 1
            self._apply(trial.old.chosen, trial.old.layout)
            self._say(logging.INFO, "step %d: back to %s (the %s exchange took %s/step, the %s %s)", index,
                      self.summary(), trial.old.other_layout(), report.seconds(verdict.new_step), trial.old.layout,
                      report.seconds(verdict.old_step))
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
            self._say(logging.INFO, "step %d: trying the %s exchange (%s; %s took %s/step)", index, other,
                      self.summary(), trial.old.layout, report.seconds(step_s))

    def _layouts(self) -> bool:
        """Whether flat and hierarchical can be compared: the session has nodes and the groups are exchanges (an
        FSDP reduce-scatter's layout is not switched)."""
        return self.session.hierarchy is not None and all(b.kind == "exchange" for b in self.meter.buckets)

    def _apply(self, chosen: Mapping, layout: str | None = None) -> None:
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

    def traffic(self, chosen: Mapping | None = None) -> int:
        """Bytes one step of the current plan (or ``chosen``) sends (from the recording: the same on every rank)."""
        index = self._indices(chosen)
        table = cast(list, self.costs.table)  # recorded at the first check
        return sum(sum(c.sent for r in row[i].rounds for c in r) for i, row in zip(index, table))

    def _indices(self, chosen: Mapping | None = None) -> list[int]:
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
        """The plan (default the current) in words: buckets per codec (``int8 x2, dense x4``;
        ``stats()["auto"]["plan"]`` counts the same)."""
        return report.plan_text(report.plan_counts((self.choice if choice is None else choice).chosen,
                                                   self.meter.buckets))
