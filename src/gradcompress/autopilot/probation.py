"""A switch on probation: the autopilot's trial, as an explicit state machine (one type per state).

The model proposes, the step decides. A plan is a :class:`Choice` (key -> codec spec, and the layout: flat or
hierarchical). The states:

* :class:`Steady`: nothing on probation;
* :class:`Selection`: a measured decision (no ``bandwidth=`` hint): the current plan, the model's best, the best
  uniform plan of the budget and dense each run for blocks of :data:`BLOCK_STEPS` steps, in the palindromic order
  current, others..., others reversed..., current (a drift of the machine's speed favours none), on every rank at
  the same steps; each block's median step (the slowest rank's) is its measure, a plan's time the mean of its two
  blocks; the fastest stays (:func:`pick`: a simpler plan within :data:`PREFER_SIMPLER` of the fastest is preferred:
  dense, then one codec everywhere, then a per-bucket mix), but only if it was measured faster than the current
  plan by more than the measured noise (:meth:`Selection.kept`: :func:`noise_t` standard errors of the difference,
  the blocks' pooled spread, and :data:`HYSTERESIS` of the current step): else the current plan stays;
* :class:`LayoutTrial`: the same codecs on the other layout (where there are nodes), :data:`TRIAL_STEPS` steps: the
  faster layout stays;
* :class:`Settling`: a decision told by ``bandwidth=`` or a change of regime (nothing judged), measured for the
  layouts' comparison.

:class:`Probation` holds the state and what the selections taught: whether the layouts are still to be compared
since the measurements last moved, the last layout comparison, and the plans a selection measured slower (not
measured again until the measurements move the way that could make them faster).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Collection, Mapping, Sequence
from typing import cast

from ..schedule import Plan
from ..spec import make

#: steps after a switch at which the new plan's step time is compared with the old's
TRIAL_STEPS = 6
LAYOUTS = ("flat", "hierarchical")
#: a selection keeps a simpler plan measured within this share of the fastest (dense before compression, one codec
#: before a mix: the same bytes' effect for fewer surprises; a step's time varies by more than this between blocks)
PREFER_SIMPLER = 0.02
#: steps each plan of a selection runs per block (the first after a switch not counted: a compressed plan's first
#: step allocates its residuals); n plans: the selection ends 4n steps after it began
BLOCK_STEPS = 2
#: no flapping: a selection leaves the current plan only for one measured faster by more than Student's t (97.5 %)
#: for the pooled degrees of freedom standard errors of the difference (the blocks' spread around their plans' means,
#: pooled over the plans: two blocks a plan give one degree each, so a normal quantile of 2 read noise as a gain in
#: about 1 comparison in 10 and flapped on a loaded machine); NOISE_T[dof], beyond the table its last value...
NOISE_T = {1: 12.71, 2: 4.30, 3: 3.18, 4: 2.78, 5: 2.57, 6: 2.45, 7: 2.36, 8: 2.31, 9: 2.26, 10: 2.23, 12: 2.18,
           15: 2.13, 20: 2.09}
#: ... and by more than this share of the current plan's step (hysteresis: two blocks per plan can read a loaded
#: machine's noise as small by chance)
HYSTERESIS = 0.05


@dataclasses.dataclass(frozen=True)
class Choice:
    """A plan: ``chosen`` (key -> codec spec of each key compressed; the others dense) on ``layout``; ``plan`` the
    :class:`~gradcompress.schedule.Plan` steps run (built once: the meter tells plans apart by identity)."""

    chosen: Mapping
    layout: str = "flat"
    plan: Plan = dataclasses.field(default=cast(Plan, None), compare=False)  # always given: made by ``of``

    @staticmethod
    def of(chosen: Mapping, layout: str = "flat") -> Choice:
        codecs = {spec: make(spec) for spec in set(chosen.values())}
        compressed = {k: codecs[s] for k, s in chosen.items() if not codecs[s].exact}
        return Choice(dict(chosen), layout, Plan(None, compressed, flat=layout == "flat"))

    def other_layout(self) -> str:
        return LAYOUTS[1 - LAYOUTS.index(self.layout)]


@dataclasses.dataclass(frozen=True)
class Steady:
    """Nothing on probation."""


@dataclasses.dataclass(frozen=True)
class LayoutTrial:
    """The other layout, judged at step ``at`` against ``old`` (the same codecs) and its step time ``old_step``."""

    at: int
    old: Choice
    old_step: float


@dataclasses.dataclass(frozen=True)
class Settling:
    """A told switch (``bandwidth=``), measured until step ``at`` for the layouts' comparison; nothing judged."""

    at: int
    old: Choice
    old_step: float = 0.0


@dataclasses.dataclass(frozen=True)
class Selection:
    """The plans ``plans`` (``plans[0]``: the one running when it began) measured in blocks; ``order``: the plan
    index of each block; ``block``: the block running now, which ends at step ``at``; ``times[i]``: plan i's block
    measures so far, each (step, wait on the collectives, compute) in seconds."""

    at: int
    plans: tuple
    order: tuple
    block: int = 0
    times: tuple = ()

    @staticmethod
    def begin(index: int, plans: Sequence[Choice]) -> Selection:
        n = len(plans)
        order = tuple(range(n)) + tuple(reversed(range(n)))
        return Selection(index + BLOCK_STEPS, tuple(plans), order, 0, tuple(() for _ in plans))

    @property
    def running(self) -> int:
        """The index of the plan the current block runs."""
        return self.order[self.block]

    def measured(self, step_s: float, wait_s: float = 0.0, compute_s: float = 0.0) -> Selection:
        """The current block ended, measured at ``step_s`` (``wait_s`` of it waiting on the collectives, ``compute_s``
        computing); the next block (``done`` when none is left)."""
        times = tuple(t + ((step_s, wait_s, compute_s),) if i == self.running else t
                      for i, t in enumerate(self.times))
        return dataclasses.replace(self, at=self.at + BLOCK_STEPS, block=self.block + 1, times=times)

    @property
    def done(self) -> bool:
        return self.block >= len(self.order)

    def means(self, part: int = 0) -> list[float]:
        """Each plan's mean block measure: its step (``part`` 0), its wait (1) or its compute (2); blocks without a
        counted step (their steps aborted) left out, a plan with none reads as infinitely slow."""
        out = []
        for t in self.times:
            counted = [x[part] for x in t if x[0] > 0]
            out.append(sum(counted) / len(counted) if counted else float("inf"))
        return out

    def noise(self) -> float:
        """The blocks' standard deviation around their plans' mean step, pooled over the plans (0: no plan has two
        counted blocks): the measured noise of one block."""
        squares, dof = self._spread()
        return (squares / dof) ** 0.5 if dof else 0.0

    def dof(self) -> int:
        """The degrees of freedom of :meth:`noise` (counted blocks less one per plan, summed)."""
        return self._spread()[1]

    def _spread(self) -> tuple[float, int]:
        squares, dof = 0.0, 0
        for t in self.times:
            counted = [x[0] for x in t if x[0] > 0]
            if len(counted) > 1:
                mean = sum(counted) / len(counted)
                squares += sum((x - mean) ** 2 for x in counted)
                dof += len(counted) - 1
        return squares, dof

    def error(self, a: int, b: int) -> float:
        """The standard error of the difference of plans ``a`` and ``b``'s measured means (:meth:`noise`)."""
        n = [max(sum(1 for x in self.times[i] if x[0] > 0), 1) for i in (a, b)]
        return self.noise() * (1 / n[0] + 1 / n[1]) ** 0.5

    def kept(self, everywhere: Callable[[Choice], bool], barred: Collection[int] = frozenset()) -> int:
        """The index of the plan this selection keeps: :func:`pick`'s, if it was measured faster than the current
        plan (index 0) by more than :func:`noise_t` standard errors and :data:`HYSTERESIS` of the current plan's
        step; else the current plan (no flapping on noise). ``barred``: plans that may not stay (a critical
        regime's codecs), read as infinitely slow."""
        means = [float("inf") if i in barred else m for i, m in enumerate(self.means())]
        k = pick(self.plans, means, everywhere)
        return k if k == 0 or means[0] - means[k] > self.margin(k, 0 in barred) else 0

    def margin(self, k: int, barred: bool = False) -> float:
        """How much faster than the current plan plan ``k`` must be measured for the selection to change to it
        (``barred``: the current plan may not stay: nothing)."""
        current = self.means()[0]
        if current == float("inf") or barred:
            return float("-inf")  # the current plan's blocks were all aborted (or it may not stay): nothing to keep
        return max(noise_t(self.dof()) * self.error(0, k), HYSTERESIS * current)


def noise_t(dof: int) -> float:
    """Student's t at 97.5 % for ``dof`` degrees of freedom (:data:`NOISE_T`; 0 for none: no spread measured)."""
    if dof <= 0:
        return 0.0
    return NOISE_T[max(d for d in NOISE_T if d <= dof)]


def simplicity(choice: Choice) -> int:
    """0: dense; 1: one codec everywhere; 2: a per-bucket mix (a plan of keys left dense counts as a mix)."""
    specs = set(choice.chosen.values())
    return 0 if not specs else 1 if len(specs) == 1 else 2


def pick(plans: Sequence[Choice], means: Sequence[float], everywhere: Callable[[Choice], bool]) -> int:
    """The index of the plan a selection keeps: the fastest measured, unless a simpler plan (:func:`simplicity`;
    ``everywhere(choice)``: it covers every key) measured within :data:`PREFER_SIMPLER` of it."""
    def rank(i):
        level = simplicity(plans[i])
        return level if level != 1 or everywhere(plans[i]) else 2

    best = min(range(len(plans)), key=lambda i: means[i])
    near = [i for i in range(len(plans)) if means[i] <= means[best] * (1 + PREFER_SIMPLER) and rank(i) < rank(best)]
    return min(near, key=lambda i: (rank(i), means[i])) if near else best


#: what is on probation: nothing, a layout's trial, a settling plan or a selection of plans
TrialState = Steady | LayoutTrial | Settling | Selection


@dataclasses.dataclass(frozen=True)
class Verdict:
    """A judged trial: ``back`` (return to the old plan), the step time ``kept`` (of the plan that stays), and the
    two measured step times."""

    back: bool
    kept: float
    old_step: float
    new_step: float


def judge(state: LayoutTrial | Settling, new_step: float) -> Verdict:
    """The verdict on ``state`` (a layout trial or a settling plan) with the new plan measured at ``new_step``: a
    layout trial goes back if the other layout was slower; a settling plan is never judged."""
    old = state.old_step
    if isinstance(state, Settling):
        return Verdict(False, new_step, old, new_step)
    back = new_step > 0 and old > 0 and new_step > old
    return Verdict(back, old if back else new_step, old, new_step)


class Probation:
    """The trial's state (:class:`Steady` or a trial), ``layout_open`` (the layouts are to be compared since the
    measurements last moved), ``layout_times`` (layout -> step time at the last comparison) and ``rejected`` (plans
    the trial sent back)."""

    def __init__(self) -> None:
        self.state: TrialState = Steady()
        self.layout_open = True
        self.layout_times: dict = {}
        #: plans a selection measured slower, each with whether it compressed more than the plan kept
        self.rejected: list[tuple[dict, bool]] = []

    def due(self, index: int) -> bool:
        """Whether a trial is judged at step ``index``."""
        return not isinstance(self.state, Steady) and index == self.state.at

    def begin(self, state: TrialState) -> None:
        self.state = state

    def end(self) -> TrialState:
        """The trial to judge now (the state returns to :class:`Steady`)."""
        state, self.state = self.state, Steady()
        return state

    def moved(self, more: bool, less: bool) -> None:
        """The measurements moved: the layouts are compared again; ``more``/``less``: compressing more/less may pay
        now (the link got slower or the compute faster / the other way), so the rejected plans that compressed
        more/less than the plan kept are measured again when proposed."""
        self.layout_open = True
        self.rejected = [(c, m) for c, m in self.rejected if not (more if m else less)]

    def is_rejected(self, chosen: dict) -> bool:
        return any(c == chosen for c, _ in self.rejected)

    def layout_trial(self, index: int, current: Choice, step_s: float) -> LayoutTrial | Settling | None:
        """The layout trial to start now (None: none; :class:`Settling` while the current plan is unmeasured)."""
        if not self.layout_open:
            return None
        if step_s <= 0:
            return Settling(index + TRIAL_STEPS, current)
        self.layout_open = False
        return LayoutTrial(index + TRIAL_STEPS, current, step_s)


__all__ = ["BLOCK_STEPS", "Choice", "HYSTERESIS", "LAYOUTS", "LayoutTrial", "NOISE_T", "PREFER_SIMPLER", "Probation", "Selection", "Settling",
           "Steady", "TRIAL_STEPS", "Verdict", "judge", "pick", "simplicity"]
