"""The seam between a step and whoever decides what it does: a step's **terms**, set by a **coordinator**.

What varies from step to step is decided in one place, behind one small interface, and the
:class:`~gradcompress.step.Step` only carries it out::

    Terms        the step's index (schedule position), plan (key -> codec, layout), divisor of the mean, whether
                 this rank is silent, who decides the commit and whether that decision is deferred, what the step
                 keeps for its coordinator (a copy of the gradients, their squared norm)
    Coordinator  collectives() -> the collectives its steps run on (None: the session's)
                 open(comm, index) -> Terms          at each step's beginning
                 closed(step)                        at each step's end (its immutable ``record``), or abort
      fixed        plan_at(options, index), the session's divisor                   (:class:`Fixed`)
      auto         measures, decides, tries plans on probation                      (:mod:`gradcompress.autopilot`)
      quorum       a replica manager's quorum: participants, step, should_commit    (:mod:`gradcompress.quorum`)

A coordinator reads what a step measured only from :attr:`Step.record <gradcompress.step.Step.record>` (a
:class:`~gradcompress.step.StepRecord`), never the step's attributes, and writes nothing into a step or the
:class:`~gradcompress.state.State`: what it wants changed in the state it says in the terms (``new_group``) or does
through the state's own methods.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, NamedTuple

import torch

from .schedule import Plan, plan_at


@dataclasses.dataclass(frozen=True)
class Terms:
    """One step's terms (see the module docstring). ``divisor`` None: the session's (the group's size);
    ``should_commit``: an outside decision asked at the step's end on every rank; ``deferred``: that decision comes
    later, through ``Step.decide``; ``silent``: this rank takes part in the collectives but sends zeros and reads
    none of its own state (a replica being healed); ``sample``/``norm``: the step keeps a copy of each exchanged
    tensor / sums their squared norms, published in its record; ``new_group``: the group's members changed since
    the last step (the chunk owners' server residuals restart); ``fault``: where a payload a peer sent cannot be used
    (:class:`~gradcompress.codecs.base.PayloadError`), the step is reported here and not committed (a quorum's
    ``report_error``); None: the error is raised."""

    plan: Plan
    index: int = 0
    divisor: int | None = None
    silent: bool = False
    deferred: bool = False
    should_commit: Callable[[], bool] | None = None
    sample: bool = False
    norm: bool = False
    new_group: bool = False
    fault: Callable[[Exception], None] | None = None


#: the terms a caller of ``Compressor.begin_step`` may set for one step
OVERRIDES = ("plan", "should_commit", "deferred", "silent")


class Seen(NamedTuple):
    """A group of tensors a step averaged (what the autopilot decides for): ``kind`` ``"exchange"`` (``keys``, the
    tensors' ``shapes``), ``"replicas"`` (HSDP's replica all-reduce of one shard) or ``"reduce_scatter"`` (one key;
    ``shapes``: the input's, ``out``: the output's shape; ``scale``)."""

    keys: tuple
    shapes: tuple
    device: object
    kind: str = "exchange"
    out: tuple = ()
    scale: float = 1.0


class StepRecord(NamedTuple):
    """What a step did, published at its end (:attr:`Step.record`), immutable: what a coordinator reads.

    ``committed``: True/False once decided, None while a deferred step waits or after an abort; ``finite``: every
    rank's inputs were finite (None: the step did not end); ``seen``: each group of tensors it averaged
    (:class:`Seen`); ``overlapped``: a job was launched early (the DDP hook: the exchange overlapped the backward
    pass); ``raw_bytes``: the gradients' own size; ``codec_seconds``: time in the exchanges' own code; ``sample``
    (where the terms asked): key -> a copy of each exchanged tensor as given (read-only mapping); ``norm_sq``
    (where asked): the sum of their squared norms, a float64 tensor on their device (one host sync to read)."""

    index: int
    plan: Plan
    committed: bool | None
    finite: bool | None
    seen: tuple
    overlapped: bool
    raw_bytes: int
    codec_seconds: float
    silent: bool
    sample: object = None
    norm_sq: torch.Tensor | None = None


class Coordinator:
    """Decides each step's terms and hears how each step went (the base: nothing to hear, nothing to report).

    ``name``: where its report and checkpoint stand in ``Compressor.stats()`` / ``state_dict()`` (None: nowhere);
    ``checks_group``: the Compressor runs its one-time checks on the group (every rank configured alike, the
    replicas' parameters equal) — a coordinator that checks each new membership itself says False."""

    name: str | None = None
    checks_group = True

    def collectives(self):
        """The collectives this coordinator's steps run on, ready for a step (None: the session's)."""
        return None

    def open(self, comm, index: int) -> Terms:
        raise NotImplementedError

    def override(self, terms: Terms, given: dict) -> Terms:
        """``terms`` with what the caller of ``begin_step`` set (:data:`OVERRIDES`)."""
        return dataclasses.replace(terms, **given) if given else terms

    def closed(self, step) -> None:
        """A step ended (committed, rolled back, deferred) or was aborted: ``step.record`` is what it measured."""

    def settle(self) -> None:
        """Decide what can be decided now of steps waiting for an outside decision (before a report or a checkpoint)."""

    def mine(self, entries: list) -> list:
        """Of ``synchronize``'s (position, gradient) entries, those this process exchanges (default: all)."""
        return entries

    def share(self, params: list) -> None:
        """After ``synchronize``'s exchange: hand the averaged gradients this process did not exchange to it."""

    def stats(self) -> dict:
        return {}

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass

    def explain(self) -> str | None:
        """Why the steps run what they run, in words (None: the codec is the user's)."""
        return None


class Fixed(Coordinator):
    """The user's codec with its warm-up and schedule (:func:`~gradcompress.schedule.plan_at`), averaged over the
    session's group."""

    def __init__(self, config, session):
        self.config, self.session = config, session

    def open(self, comm, index: int) -> Terms:
        return Terms(plan_at(self.config, index), index, self.session.divisor())


__all__ = ["Coordinator", "Fixed", "OVERRIDES", "Seen", "StepRecord", "Terms"]
