"""Compression schedules: which codec a step uses (pure functions of the step number).

* ``warmup_steps`` (every Compressor): the first steps are exchanged dense; at least 2
  is wise with DDP, whose first iteration runs with provisional buckets.
* ``schedule="exp"`` over ``ramp_steps``: after the warm-up, codecs with a ``ratio``
  (topk, randomk, dgc) start dense-ish and tighten exponentially, ratio_t = ratio^(t/T);
  codecs with a ``rank`` (powersgd) start at 8x the rank and come down exponentially.
* a codec's own schedule (:meth:`Codec.at_step`, e.g. DGC's sparsity warm-up) applies
  on top: the denser of the two wins.

A step's codecs are a :class:`Plan` (key -> codec); the schedules above give every key the same one.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Hashable, Mapping, Sequence
from typing import Any, Protocol

from .codecs.base import Codec

SCHEDULES = (None, "exp")


def ramp_ratio(step: int, ramp_steps: int, ratio: float) -> float:
    """Exponential ramp from 1 (keep all) down to ``ratio`` over ``ramp_steps``."""
    if step >= ramp_steps:
        return ratio
    ramped: float = ratio ** (step / ramp_steps)  # a positive ratio to a real power: a float
    return min(1.0, ramped)


def ramp_rank(step: int, ramp_steps: int, rank: int) -> int:
    """Exponential ramp from 8 * rank down to ``rank`` over ``ramp_steps``."""
    if step >= ramp_steps:
        return rank
    return max(rank, int(round(rank * 8 ** (1 - step / ramp_steps))))


def codec_at(codec: Codec, step: int, warmup_steps: int, schedule: str | None, ramp_steps: int) -> Codec | None:
    """The codec step ``step`` uses, or None for a dense (uncompressed) step."""
    if step < warmup_steps:
        return None
    t = step - warmup_steps
    own: Any = codec.at_step(t)  # Any: the knobs below are options of the codecs that name them
    changes = {}
    if schedule == "exp" and ramp_steps > 0:
        knobs = codec.schedule_knobs
        base: Any = codec
        if "ratio" in knobs:
            ratio = max(own.ratio, ramp_ratio(t, ramp_steps, base.ratio))
            if not math.isclose(ratio, own.ratio):
                changes["ratio"] = ratio
        if "rank" in knobs:
            rank = ramp_rank(t, ramp_steps, base.rank)
            if rank != own.rank:
                changes["rank"] = rank
    at: Codec = dataclasses.replace(own, **changes) if changes else own  # ``own``, its ramped knobs changed
    return at


class Scheduled(Protocol):
    """What :func:`plan_at` reads of a Compressor's options (:class:`gradcompress.config.Config`, a layer above)."""

    @property
    def codec(self) -> Codec: ...

    @property
    def warmup_steps(self) -> int: ...

    @property
    def schedule(self) -> str | None: ...

    @property
    def ramp_steps(self) -> int: ...


class Plan:
    """The codec of each state key at one step (None: dense): ``default`` for every key not in ``per_key``.

    Warm-up and the schedules give every key the same codec (:func:`plan_at`); a plan that differs per key (per
    bucket) is what a decision per tensor fills. :meth:`groups` splits a group of keys by codec, in first-seen order
    (the same on every rank for the same plan). ``flat``: the step's groups travel flat even where the session
    has a hierarchical layout (the autopilot measures which of the two is faster; FSDP's HSDP replica all-reduce,
    whose layout is the sharding's, is not affected)."""

    def __init__(self, default: Codec | None, per_key: Mapping[Hashable, Codec | None] | None = None,
                 flat: bool = False) -> None:
        self.default, self.per_key, self.flat = default, dict(per_key or {}), flat

    def codec(self, key: Hashable) -> Codec | None:
        return self.per_key.get(key, self.default)

    @property
    def dense(self) -> bool:
        """Every key travels dense."""
        return self.default is None and all(c is None for c in self.per_key.values())

    def groups(self, keys: Sequence[Hashable]) -> list[tuple[Codec | None, list[int]]]:
        """[(codec, positions in ``keys``)], one entry per distinct codec."""
        if not self.per_key:
            return [(self.default, list(range(len(keys))))]
        out: dict[str | None, tuple[Codec | None, list[int]]] = {}  # codec spec -> (codec, positions)
        for i, k in enumerate(keys):
            codec = self.codec(k)
            out.setdefault(None if codec is None else codec.spec, (codec, []))[1].append(i)
        return list(out.values())


def plan_at(config: Scheduled, step: int) -> Plan:
    """The uniform plan of step ``step`` under ``config``'s codec, warm-up and schedule."""
    return Plan(codec_at(config.codec, step, config.warmup_steps, config.schedule, config.ramp_steps))
