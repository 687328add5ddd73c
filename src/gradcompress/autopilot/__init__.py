"""The autopilot behind ``Compressor("auto")``: measure, predict, choose per bucket, keep measuring.

The first ``max(warmup_steps, 3)`` steps are dense and measured; then at that step and every ``every`` steps after,
on every rank at the same step: each rank measures (:mod:`.measure`: the compute time, the current plan's step time,
the link by probes unless ``bandwidth=`` is given, the codecs' cost on its buckets once per machine,
:mod:`.calibration`), every rank's numbers are gathered, and the policy (:mod:`.policy`, pure) decides again if
nothing was decided yet or the link or the compute moved by 25 %. The model proposes, the step decides
(:mod:`.probation`): the current plan, the model's best, the best uniform plan of the budget and dense each run a
few blocks of steps, interleaved, on every rank at the same steps, and the measured fastest stays. Where the session
has nodes, flat and hierarchical are then measured against each other.

The parts: :class:`~.pilot.Autopilot` (the coordinator of steps, :mod:`gradcompress.terms`), :mod:`.measure`,
:mod:`.policy`, :mod:`.probation`, :mod:`.decide` (the cost model's choice per bucket), :mod:`.allocate`,
:mod:`.calibration`, :mod:`.report` (``stats()["auto"]``, ``explain()``, the checkpoint). Across a switch residuals
carry over; PowerSGD's factors of a key whose codec changed start fresh; across a change of layout, residuals and
momentum move to the other layout's keys with their mean kept (``Session.relayout``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

from ..terms import Coordinator, Fixed
from .measure import PROBE_EVERY
from .pilot import MEASURE_STEPS, Autopilot
from .policy import MOVED
from .probation import BLOCK_STEPS, LAYOUTS, PREFER_SIMPLER, TRIAL_STEPS

if TYPE_CHECKING:
    from ..config import Config
    from ..session import Session
    from ..state import State


class Coordinating(Protocol):
    """What :func:`coordinator_for` reads of a Compressor (by its shape: compressor.py sits a layer above)."""

    options: Config
    state: State
    session: Session


def coordinator_for(compressor: Coordinating) -> Coordinator:
    """The coordinator of a Compressor's steps: the autopilot for ``"auto"``, else the user's codec and schedule."""
    config, session = compressor.options, compressor.session
    return Autopilot(config, compressor.state, session) if config.auto is not None else Fixed(config, session)


__all__ = ["Autopilot", "BLOCK_STEPS", "LAYOUTS", "MEASURE_STEPS", "MOVED", "PREFER_SIMPLER", "PROBE_EVERY", "TRIAL_STEPS",
           "coordinator_for"]
