"""A switch on probation: the autopilot's trial, as an explicit state machine (one type per state).

The model proposes, the step decides. A plan is a :class:`Choice` (key -> codec spec, and the layout: flat or
hierarchical). After a switch the new plan runs for :data:`TRIAL_STEPS` steps and is judged on its measured step
time (:func:`judge`); the states:

* :class:`Steady`: nothing on probation;
* :class:`CodecTrial`: the model's proposal (measured, no ``bandwidth=`` hint): back to the old plan if it sends
  fewer bytes and is not faster, or sends more and is more than :data:`TRIAL_MARGIN` slower;
* :class:`LayoutTrial`: the same codecs on the other layout (where there are nodes): the faster layout stays;
* :class:`Settling`: a decision told by ``bandwidth=`` (nothing judged), measured for the layouts' comparison.

:class:`Probation` holds the state and what the trials taught: whether the layouts are still to be compared since
the measurements last moved, the last layout comparison, and the plans the trial sent back (not proposed again
until compressing pays more).
"""

from __future__ import annotations

import dataclasses
from typing import Mapping

from ..schedule import Plan
from ..spec import make

#: steps after a switch at which the new plan's step time is compared with the old's
TRIAL_STEPS = 6
#: the trial goes back only when the new plan measured this much slower than the old (a step's time varies by more
#: than the model's margin between close plans; a clearly slower plan is what the trial is for)
TRIAL_MARGIN = 0.05
LAYOUTS = ("flat", "hierarchical")


@dataclasses.dataclass(frozen=True)
class Choice:
    """A plan: ``chosen`` (key -> codec spec of each key compressed; the others dense) on ``layout``; ``plan`` the
    :class:`~gradcompress.schedule.Plan` steps run (built once: the meter tells plans apart by identity)."""

    chosen: Mapping
    layout: str = "flat"
    plan: Plan = dataclasses.field(default=None, compare=False)

    @staticmethod
    def of(chosen: Mapping, layout: str = "flat") -> "Choice":
        codecs = {spec: make(spec) for spec in set(chosen.values())}
        compressed = {k: codecs[s] for k, s in chosen.items() if not codecs[s].exact}
        return Choice(dict(chosen), layout, Plan(None, compressed, flat=layout == "flat"))

    def other_layout(self) -> str:
        return LAYOUTS[1 - LAYOUTS.index(self.layout)]


@dataclasses.dataclass(frozen=True)
class Steady:
    """Nothing on probation."""


@dataclasses.dataclass(frozen=True)
class CodecTrial:
    """The model's switch, judged at step ``at`` against ``old`` and its measured step time ``old_step``."""

    at: int
    old: Choice
    old_step: float


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
class Verdict:
    """A judged trial: ``back`` (return to the old plan), the step time ``kept`` (of the plan that stays), and the
    two measured step times."""

    back: bool
    kept: float
    old_step: float
    new_step: float


def judge(state, new_step: float, fewer_bytes: bool) -> Verdict:
    """The verdict on ``state`` (a trial) with the new plan measured at ``new_step``; ``fewer_bytes``: the new plan
    sends fewer bytes than the old (a codec trial's rule: compression must pay as measured; a tie goes to the plan
    that compresses less)."""
    old = state.old_step
    if isinstance(state, Settling):
        return Verdict(False, new_step, old, new_step)
    margin = TRIAL_MARGIN if isinstance(state, CodecTrial) and not fewer_bytes else 0.0
    slower = new_step >= old if fewer_bytes else new_step > old * (1 + margin)
    back = new_step > 0 and old > 0 and slower
    return Verdict(back, old if back else new_step, old, new_step)


class Probation:
    """The trial's state (:class:`Steady` or a trial), ``layout_open`` (the layouts are to be compared since the
    measurements last moved), ``layout_times`` (layout -> step time at the last comparison) and ``rejected`` (plans
    the trial sent back)."""

    def __init__(self) -> None:
        self.state = Steady()
        self.layout_open = True
        self.layout_times: dict = {}
        self.rejected: list[dict] = []

    def due(self, index: int) -> bool:
        """Whether a trial is judged at step ``index``."""
        return not isinstance(self.state, Steady) and index == self.state.at

    def begin(self, state) -> None:
        self.state = state

    def end(self):
        """The trial to judge now (the state returns to :class:`Steady`)."""
        state, self.state = self.state, Steady()
        return state

    def moved(self, forget: bool) -> None:
        """The measurements moved: the layouts are compared again; ``forget``: the rejected plans may be right now."""
        self.layout_open = True
        if forget:
            self.rejected = []

    def layout_trial(self, index: int, current: Choice, step_s: float):
        """The layout trial to start now (None: none; :class:`Settling` while the current plan is unmeasured)."""
        if not self.layout_open:
            return None
        if step_s <= 0:
            return Settling(index + TRIAL_STEPS, current)
        self.layout_open = False
        return LayoutTrial(index + TRIAL_STEPS, current, step_s)


__all__ = ["Choice", "CodecTrial", "LAYOUTS", "LayoutTrial", "Probation", "Settling", "Steady", "TRIAL_MARGIN",
           "TRIAL_STEPS", "Verdict", "judge"]
