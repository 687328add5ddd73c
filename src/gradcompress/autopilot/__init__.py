"""The autopilot behind ``Compressor("auto")``: measure, predict, choose per bucket, keep measuring.

Each step's plan (key -> codec) is the autopilot's. The first ``max(warmup_steps, 3)`` steps are dense and
measured (:mod:`.measure`: the compute time of each step); then, at that step and every ``every`` steps after, on
every rank at the same step (the committed step count, equal everywhere):

1. each rank measures (the compute time and the current plan's step time; the link by probes unless ``bandwidth=``
   is given, at the first check and then only when the step time moved by more than :data:`MOVED` or every
   :data:`PROBE_EVERY` checks; at the first check the
   codecs' cost on its buckets, :func:`.decide.record`, unless an earlier run on this machine and device left them
   in the calibration cache, :mod:`.calibration`);
2. every rank's numbers are gathered (one small all-reduce: every rank gets the same table, bit for bit) and
   combined the same way everywhere: the slowest compute, the slowest link, the costliest codec run;
3. if no decision was made yet, or the link rate or the compute time moved by more than 25 % since the last one,
   the plan is chosen again (:func:`.decide.choose`) — the same on every rank, so every rank switches at the same
   step. A switch is logged (INFO) and counted.
4. **The trial** (without a ``bandwidth=`` hint): :data:`TRIAL_STEPS` steps after a switch, the new plan's measured
   step time (the median of its last 5 steps, the slowest rank's) is compared with the old plan's last 5 steps; if
   it is not faster (a plan that sends fewer bytes than the old one: compression must pay as measured) or more
   than :data:`TRIAL_MARGIN` slower (a plan that sends more), every rank goes back to the old plan at that step, and
   the new one is not chosen again until the link gets slower or the compute faster by more than :data:`MOVED`. The model proposes, the step decides.
5. **Flat or hierarchical** (where the session found 2 or more nodes of 2 or more workers: ``topology=``, torchrun's
   environment): measured, never assumed. The measuring steps and the first plan run flat; once the plan's step
   time is measured (after its trial, or :data:`TRIAL_STEPS` steps after a decision told by ``bandwidth=``), the
   same codecs run hierarchically for :data:`TRIAL_STEPS` steps, and the faster of the two, as measured, stays.
   Tried again whenever the measurements move. The model decides the codecs for the flat exchange; low-rank
   codecs (PowerSGD, whole matrices) travel flat in either layout.

Across a switch, error-feedback residuals carry over (they live in gradient space: a bucket that goes dense keeps its
residual until it is compressed again); PowerSGD's factors of a bucket whose codec changed start fresh; across a switch of layout, residuals and momentum
move to the other layout's keys with their mean over the workers kept (:meth:`~gradcompress.session.Session.relayout`).
The decision is state: ``Compressor.state_dict()["auto"]`` holds the plan and what it was based on, so a resumed run
uses the same codecs from its first step. :meth:`Autopilot.explain` says what was measured and why each bucket got
its codec.
"""

from __future__ import annotations

import dataclasses
import logging

import torch

from ..schedule import Plan
from ..autospec import CRITICAL_DROPS
from ..spec import make
from ..collectives import LocalCollectives
from ..timing import SOFTWARE_ALPHA, format_rate, payload_bandwidth
from .allocate import LEVELS, REFERENCE, allocate, errors, payload_bytes
from .calibration import Cache
from .decide import Link, choose, fit_link, predict, record
from .measure import Meter

log = logging.getLogger("gradcompress.auto")
#: dense, measured steps before the first decision (at least; ``warmup_steps`` may ask for more)
MEASURE_STEPS = 3
#: a change of the link rate or the compute time that makes the autopilot decide again
MOVED = 0.25
#: steps after a switch (measured, no ``bandwidth=`` hint) at which the new plan's step time is compared with the old's
TRIAL_STEPS = 6
#: the trial goes back only when the new plan measured this much slower than the old (a step's time varies by more
#: than the model's margin between close plans; a clearly slower plan is what the trial is for)
TRIAL_MARGIN = 0.05
#: without a ``bandwidth=`` hint the link is probed at most every this many checks while the current plan's measured
#: step time stays within :data:`MOVED` of what it was (a probe of a slow link costs a small model's step 10 %)
PROBE_EVERY = 5


LAYOUTS = ("flat", "hierarchical")


@dataclasses.dataclass(frozen=True)
class Trial:
    """A switch on probation: judged at step ``at`` against ``old`` ((chosen, layout) to go back to) and its measured
    step time ``old_step``. ``kind``: ``"codec"`` (the model's proposal: back if not faster when it sends fewer bytes,
    if more than :data:`TRIAL_MARGIN` slower when it sends more), ``"layout"`` (flat against hierarchical: the faster stays), ``"settle"`` (a decision told by
    ``bandwidth=``: nothing judged, the new plan's step time measured for the layout's trial)."""

    at: int
    old: tuple
    old_step: float
    kind: str


class Autopilot:
    """The plan of each step of a ``Compressor("auto")`` (``config.auto``: its options; ``session``: its group)."""

    def __init__(self, config, state, session):
        self.config, self.options, self._state, self._session = config, config.auto, state, session
        self.meter = Meter()
        self.layout = "flat"  # the layout of the current plan (:data:`LAYOUTS`)
        self.layout_open = True  # the layouts are still to be compared (since the measurements last moved)
        self.layout_times: dict = {}  # layout -> the measured step time of the last layout trial
        self.plan = Plan(None, flat=True)
        self.chosen: dict = {}  # key -> codec spec of the keys the current decision compresses (the others: dense)
        self.buckets: list | None = None  # (keys, shapes, device) of the last step's groups
        self.costs: list | None = None  # [bucket][candidate] recorded options
        self._costs_for: list | None = None  # the buckets' keys they were recorded for
        self.basis: tuple | None = None  # (compute_s, bandwidth B/s in the step, alpha s) of the last decision
        #: (overlap with the backward pass, share of the probed bandwidth) as the dense steps went (:func:`.decide.fit_link`)
        self.fitted = (1.0, 1.0)
        self.last: dict = {}  # the last check's combined numbers (stats)
        self.reference_step = 0.0  # the current plan's measured step time when the link was last probed (or tried)
        self.unprobed = 0  # checks since the last probe
        self.decision: dict = {}  # the last decision's numbers, prediction and choice (explain, stats)
        self.decisions, self.switches, self.decided_at = 0, 0, None
        self.hooked = False  # the steps launch buckets early (the DDP hook): the exchange can overlap the backward pass
        self.trial: Trial | None = None  # the last switch's, until judged
        self.rejected: list[dict] = []  # plans the trial sent back, not chosen again until compressing pays more
        self.sample: dict | None = None  # the previous step's inputs, where it kept them (``allocate``)
        self.norm_sq: float | None = None  # the previous step's squared gradient norm, where it measured it
        self.norms: list[float] = []  # the gradient norm at the last two checks (every rank's, combined)
        self.critical = False  # in a critical regime (``critical=``): the budget's riskiest codecs left out
        self.regimes = 0  # changes of regime
        self.allocation: dict = {}  # the last per-tensor allocation's summary (explain, stats)

    @property
    def first(self) -> int:
        return max(self.config.warmup_steps, MEASURE_STEPS)

    def plan_for(self, prev, comm, index: int) -> Plan:
        """The plan of step ``index`` (``prev``: the previous step, None at the first); at a check step, every rank
        measures and decides together (collectives on ``comm``)."""
        self.meter.step_started(comm, prev)
        self.sample = prev.sample if prev is not None else None
        self.norm_sq = float(prev.norm_sq) if prev is not None and prev.norm_sq is not None else None
        if prev is not None and prev.seen:
            self.buckets, self.hooked = prev.seen, prev.overlapped
        due = index >= self.first and (index - self.first) % self.options.every == 0
        trial = self.trial is not None and index == self.trial.at
        if (due or trial) and self.buckets and comm.world > 1 and not isinstance(comm, LocalCollectives):
            start = self.meter.clock()
            if trial:  # a check due now waits for the next: the trial decides this step
                self._judge(comm, index)
            else:
                self._check(comm, index)
            self.meter.excluded += self.meter.clock() - start
        return self.plan

    def opened(self, step) -> None:
        """A step opened: the step before each check measures its gradients' norm (``critical``) and keeps them
        (``allocate``)."""
        after = step.index + 1 - self.first
        if after >= 0 and after % self.options.every == 0:
            step.sample = {} if self.options.allocate else None
            step.norm_sq = torch.zeros((), dtype=torch.float64) if self.options.critical > 0 else None

    # ---------------------------------------------------------------- one check
    def _check(self, comm, index: int) -> None:
        bucket_keys = [b.keys for b in self.buckets]
        if self.costs is None or self._costs_for != bucket_keys:
            cache = Cache()  # the calibration of an earlier run on this machine and device, where there is one
            self.costs = record(self.config, comm.world, self.buckets, self.options.candidates, cache)
            self._costs_for = bucket_keys
        device = self.buckets[0].device
        local = [self.meter.compute_s(), self.meter.step_s()]
        costs = [o.codec_s for row in self.costs for o in row]
        keys = self._allocatable() if self.sample is not None else []
        norm = [self.norm_sq] if self.norm_sq is not None else []
        table = self._gather(comm, local + costs + norm + errors(self.sample, keys), device)
        at = 2 + len(costs) + len(norm)
        err = table[:, at:].sum(0).view(len(keys), len(LEVELS)) if keys else None
        regime = self._regime(table[:, at - 1].sum().item() ** 0.5) if norm else False
        compute, step_s = table[:, 0].max().item(), table[:, 1].max().item()
        bandwidth, alpha = self._link(comm, device, step_s)
        dense_step = step_s if self.plan.dense and self.plan.flat else 0.0
        codec = table[:, 2:2 + len(costs)].max(0).values.view(-1, len(self.options.candidates)).tolist()
        overlap, share = self.fitted
        if self.options.bandwidth is None and dense_step > 0:  # fresh dense steps: the step as it went
            overlap, share = fit_link(self.costs, self._sizes(), Link(bandwidth, alpha), compute,
                                      1.0 if self.hooked else 0.0, codec, dense_step)
        self.last = dict(step=index, compute_s=compute, bandwidth=bandwidth, alpha=alpha, codec=codec)
        measured = self.basis is None or self._moved(compute, bandwidth)
        if measured or regime or (self._refitted((overlap, share)) and not self.rejected):
            if measured:  # the link or the compute changed: the layouts are compared again, and a plan the trial
                self.layout_open = True  # sent back may be right now if compressing pays more than it did
                if self.basis is None or self._favours_compression(compute, bandwidth):
                    self.rejected = []
            self.fitted = (overlap, share)
            self._decide(index, compute, Link(share * bandwidth, alpha), codec, step_s, (keys, err), tried=not regime)
        if self.trial is None:
            self._try_layout(index, step_s)

    def _link(self, comm, device, step_s: float) -> tuple[float, float]:
        """(payload bandwidth, alpha): the hint; or probed (every rank together, their numbers combined: the slowest
        link, the largest latency) at the first check, every :data:`PROBE_EVERY` checks, and whenever the current
        plan's step time (``step_s``, every rank's same) moved by more than :data:`MOVED` since the last probe; else
        the last probe's, sending nothing (the step's own time is the passive probe)."""
        if self.options.bandwidth is not None:
            return payload_bandwidth(self.options.bandwidth), SOFTWARE_ALPHA
        ref, self.unprobed = self.reference_step, self.unprobed + 1
        steady = ref > 0 and step_s > 0 and abs(step_s - ref) <= MOVED * ref
        if self.last and steady and self.unprobed < PROBE_EVERY:
            return self.last["bandwidth"], self.last["alpha"]
        probed = self._gather(comm, list(self.meter.link(comm, self._traffic() * self.options.every, device)), device)
        self.reference_step, self.unprobed = step_s, 0
        return probed[:, 0].min().item(), probed[:, 1].max().item()

    def _judge(self, comm, index: int) -> None:
        """The trial of the last switch (:class:`Trial`): the new plan's measured steps against the old plan's;
        then, where the session has nodes and they are still to be compared, the other layout's trial."""
        trial, self.trial = self.trial, None
        new_step = self._gather(comm, [self.meter.step_s()], self.buckets[0].device)[:, 0].max().item()
        kept = new_step
        if trial.kind != "settle":
            # a plan that sends fewer bytes stays only if measured faster; one that sends more (less compression),
            # unless measured clearly slower: a tie goes to the plan that compresses less
            fewer = trial.kind == "codec" and self._traffic() < self._traffic(trial.old[0])
            margin = TRIAL_MARGIN if trial.kind == "codec" and not fewer else 0.0
            slower = new_step >= trial.old_step if fewer else new_step > trial.old_step * (1 + margin)
            back = new_step > 0 and trial.old_step > 0 and slower
            if trial.kind == "codec":
                self.decision.update(trial=(trial.old_step, new_step), trial_back=back)
                if back:
                    self.rejected.append(dict(self.chosen))
            else:
                self.layout_times = {trial.old[1]: trial.old_step, self.layout: new_step}
            if back:
                self.switches += 1
                kept = trial.old_step
                self._apply(*trial.old)
                log.info("gradcompress auto: step %d: back to %s (the new plan took %.4g s/step, the old %.4g s)",
                         index, self._summary(), new_step, trial.old_step)
        self.reference_step = kept  # the plan kept, as measured: what the next checks' steps are compared with
        self._try_layout(index, kept)

    def _try_layout(self, index: int, step_s: float) -> None:
        """Start the layout's trial (the current codecs on the other layout) if the session has nodes and the
        layouts are still to be compared; ``step_s``: the current plan's measured step time (every rank's same)."""
        if not self.layout_open or not self._layouts():
            return
        if step_s <= 0:  # the current plan is not measured yet: measure it first
            self.trial = Trial(index + TRIAL_STEPS, (dict(self.chosen), self.layout), 0.0, "settle")
            return
        self.layout_open = False
        other = LAYOUTS[1 - LAYOUTS.index(self.layout)]
        self.trial = Trial(index + TRIAL_STEPS, (dict(self.chosen), self.layout), step_s, "layout")
        self.switches += 1
        self._apply(self.chosen, other)
        log.info("gradcompress auto: step %d: trying the %s exchange (%s; %s took %.4g s/step)", index, other,
                 self._summary(), LAYOUTS[1 - LAYOUTS.index(other)], step_s)

    def _regime(self, norm: float) -> bool:
        """Record the gradient norm of this check; True if the regime changed (critical: the norm moved by more than
        ``critical`` relative to the last check's; Accordion's detector)."""
        self.norms = (self.norms + [norm])[-2:]
        if len(self.norms) < 2:
            return False
        critical = abs(norm - self.norms[0]) > self.options.critical * max(self.norms[0], 1e-30)
        if critical == self.critical:
            return False
        self.critical, self.regimes = critical, self.regimes + 1
        log.info("gradcompress auto: %s a critical regime (gradient norm %.4g, %.4g at the last check)",
                 "entering" if critical else "leaving", norm, self.norms[0])
        return True

    def _gather(self, comm, local: list, device) -> torch.Tensor:
        """Every rank's ``local`` numbers, rank by rank: the same table on every rank, bit for bit (an all-reduce
        of rows that are zero but one's; counted as measuring bytes, not ``wire_bytes``)."""
        table = torch.zeros(comm.world, len(local), dtype=torch.float64, device=device)
        table[comm.rank] = torch.tensor(local, dtype=torch.float64)
        before = comm.monitor_bytes
        comm.all_reduce(table, monitor=True).wait()
        self.meter.probe_bytes += comm.monitor_bytes - before
        return table.cpu()

    def _layouts(self) -> bool:
        """Whether flat and hierarchical can be compared: the session has nodes and the groups are exchanges (an
        FSDP reduce-scatter's layout is not switched)."""
        return self._session.hierarchy is not None and all(b.kind == "exchange" for b in self.buckets or ())

    @property
    def share(self) -> float:
        return self.fitted[1]

    def _decided_on(self) -> tuple[float, float]:
        """(compute time, probed bandwidth) the last decision was made on."""
        return self.basis[0], self.basis[1] / self.share

    def _moved(self, compute: float, bandwidth: float) -> bool:
        """Whether the compute time or the probed link moved by more than :data:`MOVED` since the last decision."""
        c0, b0 = self._decided_on()
        return any(abs(x - x0) > MOVED * max(x0, 1e-12) for x, x0 in ((compute, c0), (bandwidth, b0)))

    def _favours_compression(self, compute: float, bandwidth: float) -> bool:
        """Whether the link got slower or the compute faster by more than :data:`MOVED` since the last decision:
        only then is a plan the trial sent back proposed again (a noisy probe of a fast link that reads faster or
        slower by turns would otherwise make the autopilot try the same slower plan at every check)."""
        c0, b0 = self._decided_on()
        return bandwidth < (1 - MOVED) * b0 or compute < (1 - MOVED) * c0

    def _refitted(self, fitted: tuple) -> bool:
        """Whether the dense steps' fit (overlap, share) moved by more than :data:`MOVED`."""
        return abs(fitted[0] - self.fitted[0]) > MOVED or abs(fitted[1] - self.share) > MOVED * self.share

    def _current(self, chosen: dict | None = None) -> list[int]:
        """The current plan (or ``chosen``) as a candidate index per bucket (0: dense; a bucket of allocated levels:
        the reference)."""
        chosen = self.chosen if chosen is None else chosen
        index = {spec: i for i, spec in enumerate(self.options.candidates)}
        out = []
        for b in self.buckets:
            specs = {chosen.get(k, "none") for k in b.keys} or {"none"}
            out.append(index[specs.pop()] if len(specs) == 1 and specs <= set(index) else index.get(REFERENCE, 0))
        return out

    def _traffic(self, chosen: dict | None = None) -> int:
        """Bytes one step of the current plan (or ``chosen``) sends (from the recording: the same on every rank)."""
        return sum(sum(c.sent for r in row[i].rounds for c in r) for i, row in zip(self._current(chosen), self.costs))

    def _overlap(self) -> float:
        """How much of the backward pass the exchange hides behind: none without the DDP hook, else as fitted."""
        return self.fitted[0] if self.hooked else 0.0

    def _sizes(self) -> list[int]:
        return [sum(int(torch.Size(s).numel()) for s in b.shapes) for b in self.buckets]

    def _decide(self, index: int, compute: float, link: Link, codec: list, step_s: float,
                measured_errors: tuple = ((), None), tried: bool = True) -> None:
        """Choose for ``link`` (the bandwidth the step gets) and ``compute``; switch if the choice changed (unless
        the trial rejected that plan since the measurements last moved); ``step_s``: the current plan's measured
        step, what a switch is judged against :data:`TRIAL_STEPS` steps later."""
        sizes = self._sizes()
        names = self.options.critical_candidates if self.critical else self.options.candidates
        allowed = [i for i, spec in enumerate(self.options.candidates) if spec in names]
        choice, predicted, dense = choose(self.costs, sizes, link, compute, self._overlap(), codec, allowed)
        self.basis = (compute, link.bandwidth, link.alpha)
        self.decision = dict(self.last, predicted_s=predicted, dense_s=dense, choice=choice, sizes=sizes)
        chosen = {k: self.options.candidates[c] for b, c in zip(self.buckets, choice) for k in b.keys if c}
        if measured_errors[1] is not None:
            chosen = self._allocated(chosen, *measured_errors)
        self.decisions += 1
        if chosen != self.chosen and chosen not in self.rejected:
            if self.decided_at is not None:
                self.switches += 1
            # measured, not told: the switch is tried against the old plan; told: its step time is measured for
            # the layouts' comparison (where there are nodes)
            if self.options.bandwidth is None or self._layouts():
                kind = "codec" if self.options.bandwidth is None and tried else "settle"
                self.trial = Trial(index + TRIAL_STEPS, (dict(self.chosen), self.layout), step_s, kind)
            self._apply(chosen)
            log.info("gradcompress auto: step %d: %s (predicted %.4g s/step, dense %.4g s; link %s payload, "
                     "latency %.3g ms, compute %.4g s)", index, self._summary(), predicted, dense,
                     format_rate(8 * link.bandwidth), 1e3 * link.alpha, compute)
        self.decided_at = index

    def _allocatable(self) -> list:
        """Keys the per-tensor allocation may measure: every exchanged tensor the codec would compress (the same
        list on every rank)."""
        return [k for b in self.buckets if b.kind == "exchange" for k, s in zip(b.keys, b.shapes)
                if torch.Size(s).numel() >= self.config.min_numel]

    def _allocated(self, chosen: dict, keys: list, err: torch.Tensor) -> dict:
        """``chosen`` with the tensors given :data:`REFERENCE` re-allocated among :data:`LEVELS`
        (:func:`.allocate.allocate`: the fewest bytes within their total error under the reference)."""
        rows = [i for i, k in enumerate(keys) if chosen.get(k) == REFERENCE]
        if not rows:
            return chosen
        sizes = {k: int(torch.Size(s).numel()) for b in self.buckets for k, s in zip(b.keys, b.shapes)}
        numels = [sizes[keys[i]] for i in rows]
        nbytes, sub = payload_bytes(numels), err[rows]
        levels = allocate(sub, nbytes)
        out = dict(chosen)
        out.update((keys[i], LEVELS[c]) for i, c in zip(rows, levels))
        pick = torch.tensor(levels)[:, None]
        ref = LEVELS.index(REFERENCE)
        self.allocation = {"tensors": {spec: levels.count(i) for i, spec in enumerate(LEVELS)},
                           "payload_bytes": float(nbytes.gather(1, pick).sum()),
                           "reference_bytes": float(nbytes[:, ref].sum()),
                           "error": float(sub.double().gather(1, pick).sum()),
                           "reference_error": float(sub.double()[:, ref].sum())}
        return out

    def _apply(self, chosen: dict, layout: str | None = None) -> None:
        """Make ``chosen`` (key -> spec) the plan, on ``layout`` (default: the current); PowerSGD factors of keys
        whose codec changed start fresh; a new layout takes the per-worker state along (``Session.relayout``)."""
        changed = [k for k in set(chosen) | set(self.chosen) if chosen.get(k, "none") != self.chosen.get(k, "none")]
        self._state.forget(("q", "p"), changed)
        if layout is not None and layout != self.layout:
            session = self._session
            shapes = {k: s for b in self.buckets for k, s in zip(b.keys, b.shapes)
                      if layout == "flat" or session.hierarchical(make(chosen.get(k, "none")))}
            session.relayout(self._state, shapes, layout == "hierarchical")
            self.layout = layout
        self._set_plan(chosen)

    def _set_plan(self, chosen: dict) -> None:
        self.chosen = dict(chosen)
        codecs = {spec: make(spec) for spec in set(chosen.values())}
        dense_default = {k: codecs[s] for k, s in chosen.items() if not codecs[s].exact}
        self.plan = Plan(None, dense_default, flat=self.layout == "flat")

    def _summary(self) -> str:
        counts: dict = {}
        for b in self.buckets or []:
            spec = "+".join(sorted({self.chosen.get(k, "none") for k in b.keys})) if b.keys else "none"
            counts[spec] = counts.get(spec, 0) + 1
        return ", ".join(f"{'dense' if s == 'none' else s} x{n} bucket{'s' * (n > 1)}" for s, n in counts.items())

    # ---------------------------------------------------------------- reporting and checkpoints
    def stats(self) -> dict:
        """``stats()["auto"]``: ``plan`` (keys per codec spec, ``none`` = dense), ``decisions`` (choices made),
        ``switches`` (changes of plan after the first), ``decided_at`` (step), the combined measurements of the last
        check (``compute_s``, ``bandwidth_bit`` (payload, probed), ``latency_s``), ``overlap`` and ``link_share`` (how
        much of the backward pass the exchange hides behind, and the share of the probed bandwidth it gets, fitted on
        the dense steps), ``predicted_step_s`` and ``dense_step_s`` of the last decision, ``trial`` (the last switch's
        trial: the old and the new plan's measured step time, or None), ``layout`` (``"flat"`` or
        ``"hierarchical"``), ``layout_step_s`` (layout -> measured step time, from the last comparison of the two;
        empty without nodes), ``critical`` (in a critical regime: the budget's riskiest codecs left out), ``regimes``
        (changes of regime), ``grad_norm`` (the gradient norm at the last check), ``allocation`` (``allocate=true``: tensors per level, payload bytes and squared error
        against the reference's; empty otherwise) and ``probe_bytes`` (the measuring's own traffic)."""
        counts: dict = {}
        for spec in self.chosen.values():
            counts[spec] = counts.get(spec, 0) + 1
        dense = sum(len(b.keys) for b in self.buckets or []) - len(self.chosen)
        if dense > 0:
            counts["none"] = dense
        last, decision = self.last, self.decision
        return {"plan": counts, "decisions": self.decisions, "switches": self.switches, "decided_at": self.decided_at,
                "compute_s": last.get("compute_s"), "bandwidth_bit": 8 * last["bandwidth"] if last else None,
                "latency_s": last.get("alpha"), "link_share": self.share, "overlap": self._overlap(),
                "predicted_step_s": decision.get("predicted_s"),
                "dense_step_s": decision.get("dense_s"), "trial": decision.get("trial"), "layout": self.layout,
                "layout_step_s": dict(self.layout_times), "allocation": dict(self.allocation),
                "critical": self.critical, "regimes": self.regimes, "grad_norm": self.norms[-1] if self.norms else None,
                "probe_bytes": self.meter.probe_bytes}

    def explain(self) -> str:
        """What was measured and why each bucket got its codec: per bucket, the predicted step time with each
        candidate there (the other buckets as chosen)."""
        last = self.decision
        if "choice" not in last:
            if self.chosen:
                return (f"{self.options.text()}: the plan restored from a checkpoint ({self._summary()}); measured "
                        f"and decided again at the next check")
            return (f"{self.options.text()}: no decision yet (dense; the first comes at step {self.first}, "
                    "after measuring)")
        trial = last.get("trial")
        back = bool(last.get("trial_back"))
        tried = "" if trial is None else (f"; trial of the switch: {trial[1]:.4g} s/step against the old plan's "
                                          f"{trial[0]:.4g} s ({'went back' if back else 'kept'})")
        lines = [f"{self.options.text()}: decided at step {self.decided_at} from the check at step {last['step']}: "
                 f"compute {last['compute_s']:.4g} s/step, link {format_rate(8 * last['bandwidth'])} payload "
                 f"(in the step: x{self.share:.3g}; overlap with the backward pass {self._overlap():.2f}), "
                 f"latency {1e3 * last['alpha']:.3g} ms; predicted {last['predicted_s']:.4g} s/step "
                 f"(all dense: {last['dense_s']:.4g} s); {self.decisions} decisions, {self.switches} switches{tried}"]
        if self.norms and self.options.critical > 0:
            state = "critical: " + ", ".join(CRITICAL_DROPS[self.options.budget]) + " left out" if self.critical else \
                "not critical"
            lines.append(f"  regime: {state} (gradient norm {self.norms[-1]:.4g}"
                         + (f", {self.norms[0]:.4g} at the check before" if len(self.norms) > 1 else "")
                         + f"; critical above a change of {self.options.critical:g})")
        if self.layout_times:
            times = ", ".join(f"{k} {v:.4g} s/step" for k, v in self.layout_times.items())
            lines.append(f"  layout: {self.layout} (measured: {times})")
        elif self._session.hierarchy is not None:
            lines.append(f"  layout: {self.layout} (the other not measured yet)")
        a = self.allocation
        if a:
            counts = ", ".join(f"{spec} x{n}" for spec, n in a["tensors"].items() if n)
            lines.append(f"  per-tensor allocation of the {REFERENCE} buckets (allocate=true): {counts}; payload "
                         f"{a['payload_bytes'] / 1e3:.4g} KB against {a['reference_bytes'] / 1e3:.4g} KB with "
                         f"{REFERENCE} everywhere, squared error {a['error']:.4g} against {a['reference_error']:.4g}")
        choice, cands, sizes = last["choice"], self.options.candidates, last["sizes"]
        link = Link(self.basis[1], self.basis[2])
        for b, c in enumerate(choice):
            times = [predict(choice[:b] + [k] + choice[b + 1:], self.costs, sizes, link, self.basis[0],
                             self._overlap(), last["codec"]) for k in range(len(cands))]
            alts = ", ".join(f"{'dense' if s == 'none' else s} {t:.4g}" for s, t in zip(cands, times))
            lines.append(f"  bucket {b} ({sizes[b]} elements): {'dense' if cands[c] == 'none' else cands[c]}; "
                         f"step s with each: {alts}")
        return "\n".join(lines)

    def state_dict(self) -> dict:
        """The decision (``plan``: key -> spec), what it was based on, and the counters (plain values)."""
        return {"plan": dict(self.chosen), "layout": self.layout, "basis": list(self.basis or ()),
                "critical": self.critical, "norms": list(self.norms), "regimes": self.regimes,
                "fitted": list(self.fitted),
                "decisions": self.decisions,
                "switches": self.switches, "decided_at": -1 if self.decided_at is None else self.decided_at}

    def load_state_dict(self, state: dict) -> None:
        self.layout = state.get("layout", "flat")
        if self.layout not in LAYOUTS:
            raise ValueError(f"Compressor.load_state_dict: auto's layout must be one of {', '.join(LAYOUTS)}, got "
                             f"{self.layout!r}")
        self._set_plan({k: spec for k, spec in state.get("plan", {}).items() if spec != "none"})
        basis = state.get("basis") or ()
        self.basis = tuple(basis) if len(basis) == 3 else None
        fitted = state.get("fitted") or (1.0, 1.0)
        self.fitted = (float(fitted[0]), float(fitted[1]))
        self.decisions, self.switches = int(state.get("decisions", 0)), int(state.get("switches", 0))
        self.critical, self.regimes = bool(state.get("critical", False)), int(state.get("regimes", 0))
        self.norms = [float(n) for n in state.get("norms", [])]
        decided = int(state.get("decided_at", -1))
        self.decided_at = None if decided < 0 else decided


__all__ = ["Autopilot", "LAYOUTS", "MEASURE_STEPS", "MOVED", "PROBE_EVERY", "TRIAL_MARGIN", "TRIAL_STEPS", "Trial"]
