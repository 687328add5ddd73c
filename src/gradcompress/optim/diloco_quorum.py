"""DiLoCo's quorum: who takes part in an outer exchange and whether its update applies.

Without a torchft ``Manager`` the group is fixed: every exchange is the group's, and its update applies when every
rank's outer gradient was finite. Under a ``Manager`` (:mod:`gradcompress.quorum`) each send starts a quorum, each
fragment's Compressor runs its exchanges on the live replicas (phase f: its fragment), the Manager decides at the
apply whether the update is committed, and a rejoining replica receives the anchors, the outer optimizer's state and
the counters from a peer (``<compressor's state key>.diloco`` in torchft's state transfer), then restarts every
fragment from the anchors.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import TYPE_CHECKING

from ..compressor import Compressor
from ..quorum import under

if TYPE_CHECKING:
    import torch.distributed as dist
    from torchft.manager import Manager

    from ..config import TopologyOption
    from ..step import Step
    from .streaming import Schedule


class Replicas:
    """DiLoCo's quorum over ``manager`` (a torchft ``Manager``; None: the fixed group of ``torch.distributed``)."""

    def __init__(self, manager: Manager | None = None) -> None:
        self.manager = manager
        self.healed = False  # under torchft: this replica took a peer's anchors in the exchange in flight
        self.key: str | None = None  # the state key of the first Compressor's quorum (torchft's state transfer)

    @property
    def managed(self) -> bool:
        """Under torchft."""
        return self.manager is not None

    def compressors(self, process_group: dist.ProcessGroup | None, topology: TopologyOption | None,
                    schedule: Schedule) -> Callable[..., Compressor]:
        """What builds the outer exchange's Compressors: :class:`Compressor`, or under torchft the same on the live
        quorum (``schedule``: :class:`gradcompress.optim.streaming.Schedule`, the quorum's position; fragment f's
        Compressor is built f-th: its exchanges are phase f)."""
        if self.manager is None:
            return Compressor
        if process_group is not None or topology not in (None, "auto", "flat"):
            raise ValueError("DiLoCo: under torchft (manager=...) the outer exchange runs between the replicas of "
                             "the quorum: process_group and a hierarchical topology do not apply")
        phases = itertools.count()

        def build(codec, *, process_group=None, topology=None, **options) -> Compressor:
            return Compressor(codec, topology="flat", coordinator=self._quorum(next(phases), schedule), **options)

        return build

    def _quorum(self, phase: int, schedule):
        """The coordinator factory of phase ``phase``'s Compressor, which notes the first one's state key."""
        make = under(self.manager, phase=phase, schedule=schedule)

        def coordinator(compressor):
            quorum = make(compressor)
            if self.key is None:
                self.key = quorum.state_key
            return quorum

        return coordinator

    def start(self) -> None:
        """A send: under torchft a quorum starts (who is live now; a rejoining replica heals at the decision)."""
        if self.manager is not None:
            self.manager.start_quorum()

    def outcome(self, step: Step) -> Step | bool:
        """What an exchange's closed ``step`` gives: whether every rank was finite, or under torchft the step
        itself, waiting for :meth:`decide`."""
        return step if self.manager is not None else bool(step.committed)

    def decide(self, outcome: Step | bool) -> bool:
        """Whether an exchange's update applies: its :meth:`outcome`, or under torchft the Manager's decision
        (``should_commit``, asked here, in the training thread: healing loads the user's state too, which must not
        run during a backward) and the step's finiteness."""
        if isinstance(outcome, bool):
            return outcome
        assert self.manager is not None  # outcome() gives a step only under torchft
        agreed = self.manager.should_commit()
        outcome.decide(agreed)
        return bool(agreed and outcome.finite)

    def lost(self, outcome: Step | bool) -> bool:
        """Whether a decided exchange that does not apply was lost rather than refused: under torchft, the Manager
        did not commit it (a peer died in it, the quorum changed) although no rank's outer gradient was non-finite.
        Without a Manager an exchange that does not apply had a non-finite rank: never lost."""
        return not isinstance(outcome, bool) and outcome.finite is not False and not outcome.committed

    def share(self, save: Callable[[], dict], load: Callable[[dict], None]) -> None:
        """Under torchft: a rejoining replica receives ``save()`` of a peer, taken by ``load`` (then
        :meth:`take_healed` says so once)."""

        def healed(state: dict) -> None:
            load(state)
            self.healed = True

        assert self.manager is not None  # DiLoCo shares its state only under torchft
        self.manager.register_state_dict_fn(f"{self.key}.diloco", healed, save)

    def take_healed(self) -> bool:
        """Whether this replica was healed since the last call."""
        healed, self.healed = self.healed, False
        return healed


__all__ = ["Replicas"]
