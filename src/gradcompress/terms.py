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
import types
from collections.abc import Callable, Hashable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, NamedTuple, Protocol

import torch

from .collectives import Collectives, Stopwatch
from .schedule import Plan, plan_at

if TYPE_CHECKING:
    from .config import Config
    from .session import Session


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

    keys: tuple[Hashable, ...]
    shapes: tuple[tuple[int, ...], ...]
    device: torch.device | None
    kind: str = "exchange"
    out: tuple[int, ...] = ()
    scale: float = 1.0


class StepRecord(NamedTuple):
    """What a step did, published at its end (:attr:`Step.record`), immutable: what a coordinator reads.

    ``committed``: True/False once decided, None while a deferred step waits or after an abort; ``finite``: every
    rank's inputs were finite (None: the step did not end); ``seen``: each group of tensors it averaged
    (:class:`Seen`); ``overlapped``: a job was launched early (the DDP hook: the exchange overlapped the backward
    pass); ``raw_bytes``: the gradients' own size; ``codec_seconds``: time in the exchanges' own code; ``sample``
    (where the terms asked): key -> a copy of each exchanged tensor as given (read-only mapping); ``norm_sq``
    (where asked): the sum of their squared norms, a float64 tensor on their device (one host sync to read)."""

    index: int  # type: ignore[assignment]  # a field named like tuple.index, on purpose (the step's index)
    plan: Plan
    committed: bool | None
    finite: bool | None
    seen: tuple[Seen, ...]
    overlapped: bool
    raw_bytes: int
    codec_seconds: float
    silent: bool
    sample: Mapping[Hashable, torch.Tensor] | None = None
    norm_sq: torch.Tensor | None = None


class Recorder:
    """A step's record-keeping: what it saw and measured, published as its :class:`StepRecord`.

    ``seen``: each group of tensors averaged, in order (:class:`Seen`: the autopilot's buckets); ``raw_bytes``:
    their own size; ``sample``/``norm_sq`` (where the terms ask, else None): a copy of each exchanged tensor, the sum
    of their squared norms; ``overlapped``: a job was launched early (the DDP hook, overlapping the backward pass);
    ``clock``: the time in the exchanges' own code (a :class:`~gradcompress.collectives.Stopwatch`)."""

    def __init__(self, terms: Terms) -> None:
        self.seen: list[Seen] = []
        self.overlapped = False
        self.sample: dict[Hashable, torch.Tensor] | None = {} if terms.sample else None
        self.norm_sq: torch.Tensor | None = torch.zeros((), dtype=torch.float64) if terms.norm else None
        self.raw_bytes = 0
        self.clock = Stopwatch()

    @property
    def seconds(self) -> float:
        """The time in the exchanges' own code so far."""
        return self.clock.seconds

    def saw(self, seen: Seen, tensors: Sequence[torch.Tensor], sampled: bool = False) -> None:
        """Record a group of tensors about to be averaged (as given: before anything changes them): ``seen``, their
        squared norm and bytes, and, with ``sampled`` where the terms ask, a copy of each (keyed by ``seen.keys``)."""
        self.seen.append(seen)
        if sampled and self.sample is not None:
            self.sample.update((k, t.detach().clone()) for k, t in zip(seen.keys, tensors))
        if self.norm_sq is not None:  # on the tensors' device: one host sync when the autopilot reads it
            for t in tensors:
                # each tensor's norm in its own dtype (a float64 pass costs 13x on a CPU), summed in float64
                self.norm_sq = self.norm_sq + torch.linalg.vector_norm(t.detach()).double() ** 2
        self.raw_bytes += sum(t.numel() * t.element_size() for t in tensors)

    def overlap(self) -> None:
        """A job was launched early (overlapping the backward pass)."""
        self.overlapped = True

    def record(self, index: int, plan: Plan, committed: bool | None, finite: bool | None, silent: bool) -> StepRecord:
        """The step's record so far (a snapshot), with the step's own ``index``, ``plan``, outcome and ``silent``."""
        sample = None if self.sample is None else types.MappingProxyType(dict(self.sample))
        return StepRecord(index, plan, committed, finite, tuple(self.seen), self.overlapped, self.raw_bytes,
                          self.clock.seconds, silent, sample, self.norm_sq)


class Closed(Protocol):
    """A step as its coordinator hears of it at its end (:meth:`Coordinator.closed`): what it measured."""

    @property
    def record(self) -> StepRecord: ...


class Coordinator:
    """Decides each step's terms and hears how each step went (the base: nothing to hear, nothing to report).

    ``name``: where its report and checkpoint stand in ``Compressor.stats()`` / ``state_dict()`` (None: nowhere);
    ``checks_group``: the Compressor runs its one-time checks on the group (every rank configured alike, the
    replicas' parameters equal) — a coordinator that checks each new membership itself says False."""

    name: str | None = None
    checks_group = True

    def collectives(self) -> Collectives | None:
        """The collectives this coordinator's steps run on, ready for a step (None: the session's)."""
        return None

    def open(self, comm: Collectives, index: int) -> Terms:
        raise NotImplementedError

    def override(self, terms: Terms, given: dict[str, Any]) -> Terms:
        """``terms`` with what the caller of ``begin_step`` set (:data:`OVERRIDES`)."""
        return dataclasses.replace(terms, **given) if given else terms

    def closed(self, step: Closed) -> None:
        """A step ended (committed, rolled back, deferred) or was aborted: ``step.record`` is what it measured."""

    def settle(self) -> None:
        """Decide what can be decided now of steps waiting for an outside decision (before a report or a checkpoint)."""

    def mine(self, entries: list[tuple[int, torch.Tensor]]) -> list[tuple[int, torch.Tensor]]:
        """Of ``synchronize``'s (position, gradient) entries, those this process exchanges (default: all)."""
        return entries

    def share(self, params: list[torch.nn.Parameter]) -> None:
        """After ``synchronize``'s exchange: hand the averaged gradients this process did not exchange to it."""

    def stats(self) -> dict[str, Any]:
        return {}

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass

    def explain(self) -> str | None:
        """Why the steps run what they run, in words (None: the codec is the user's)."""
        return None


class Fixed(Coordinator):
    """The user's codec with its warm-up and schedule (:func:`~gradcompress.schedule.plan_at`), averaged over the
    session's group."""

    def __init__(self, config: Config, session: Session) -> None:
        self.config, self.session = config, session

    def open(self, comm: Collectives, index: int) -> Terms:
        return Terms(plan_at(self.config, index), index, self.session.divisor())


__all__ = ["Closed", "Coordinator", "Fixed", "OVERRIDES", "Recorder", "Seen", "StepRecord", "Terms"]
