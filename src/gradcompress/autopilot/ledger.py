"""The autopilot's books: what its decisions so far leave (:class:`Ledger`) and what each candidate costs on each
bucket (:class:`Costs`), kept by :class:`~.pilot.Autopilot` and read by :mod:`.report`."""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Sequence
from typing import TYPE_CHECKING

from .calibration import Cache
from .decide import record
from .policy import Basis, Decision

if TYPE_CHECKING:
    from ..config import Config
    from ..spec import Auto
    from ..terms import Seen
    from .decide import Option


def _auto(config: Config) -> Auto:
    """The autopilot's options of an ``"auto"`` configuration (the only kind an :class:`Autopilot` is made for)."""
    assert config.auto is not None, "an Autopilot runs an auto configuration"
    return config.auto


@dataclasses.dataclass
class Ledger:
    """What the decisions so far leave: their count, the switches of plan after the first, the step of the last,
    what it was based on, the link's fit it used ((overlap, share): how much of the backward pass the exchange
    hides behind, the share of the probed bandwidth it gets), the last decision itself, the plan a critical regime
    displaced and what the last selection measured."""

    decisions: int = 0
    switches: int = 0
    decided_at: int | None = None
    basis: Basis | None = None
    fitted: tuple = (1.0, 1.0)
    last: Decision | None = None
    #: the plan a critical regime moved off (its codecs left out), restored when the regime ends
    displaced: dict | None = None
    #: the last selection's plans (key -> spec) and their measured steps: what a critical regime moves to
    measured: tuple = ()


class Costs:
    """What each candidate costs on each bucket (:func:`.decide.record`), for the buckets' keys it was recorded for;
    entries the calibration ``cache`` holds are not run again. ``digest()``: the recorded bytes as one number (48
    bits, exact in a float64), compared across ranks: a rank whose cache disagrees makes every rank record afresh."""

    def __init__(self, cache: Cache):
        self.cache = cache
        self.table: list | None = None  # [bucket][candidate] recorded options
        self.keys: list | None = None
        self.recalibrated = 0  # times the ranks' recorded bytes disagreed and every rank recorded without the cache

    def of(self, config: Config, world: int, buckets: Sequence[Seen]) -> list[list[Option]]:
        keys = [b.keys for b in buckets]
        if self.table is None or self.keys != keys:
            self.table, self.keys = record(config, world, buckets, _auto(config).candidates, self.cache), keys
        return self.table

    def digest(self) -> float:
        rounds = repr([[o.rounds for o in row] for row in self.table or []])
        return float(int(hashlib.sha256(rounds.encode()).hexdigest()[:12], 16))

    def afresh(self, config: Config, world: int, buckets: Sequence[Seen]) -> list[list[Option]]:
        """Record every candidate again, the cache neither read nor written (every rank alike)."""
        self.recalibrated += 1
        self.table, self.keys = record(config, world, buckets, _auto(config).candidates, None), [b.keys for b in buckets]
        return self.table
