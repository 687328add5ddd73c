"""Timing a step from its collectives: the alpha-beta link model and the step simulation (pure functions).

Shared by the cost model (:mod:`gradcompress.costmodel`, ``gradcompress plan``) and the autopilot
(:mod:`gradcompress.autopilot`), so both predict a step the same way. Units: bytes, seconds; a link's payload
bandwidth ``B`` in bytes/s (:func:`payload_bandwidth` turns a rate in bit/s into it); ``alpha`` the fixed cost of one
message step. The step (:func:`simulate_step`) is described in :mod:`gradcompress.costmodel`.
"""

from __future__ import annotations

import argparse
import dataclasses
import re
from collections.abc import Sequence

from .collectives import Issued
from .units import RATE_RULE, format_rate, parse_rate

#: TCP/IPv4 (with timestamps) + Ethernet headers: 66 bytes per 1448-byte segment at MTU 1500
FRAMING_EFFICIENCY = 1448 / 1514
#: software cost of one message step of a gloo collective over TCP (per alpha term), seconds
SOFTWARE_ALPHA = 100e-6
BACKWARD_SHARE = 2 / 3

# --------------------------------------------------------------------------- units (rates: :mod:`gradcompress.units`)
_TIME_UNITS = {"s": 1.0, "sec": 1.0, "ms": 1e-3, "msec": 1e-3, "us": 1e-6, "usec": 1e-6, "ns": 1e-9}


def rate_argument(text: str) -> float:
    """An argparse type: a link rate in bit/s, read by :func:`parse_rate` (``RATE_RULE`` states the rule)."""
    try:
        return parse_rate(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


def parse_duration(text: str) -> float:
    """A duration in seconds: ``1ms``, ``500us``, ``0.2s``, ``0``."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:e[+-]?\d+)?)\s*([a-z]*)\s*", str(text).lower())
    if not m or (m.group(2) not in _TIME_UNITS and not (m.group(2) == "" and float(m.group(1)) == 0)):
        raise ValueError(f"bad duration {text!r}: expected a number with a unit (s, ms, us), e.g. 1ms, or 0")
    return float(m.group(1)) * _TIME_UNITS.get(m.group(2), 1.0)


def payload_bandwidth(rate_bit: float, efficiency: float = FRAMING_EFFICIENCY) -> float:
    """Payload bytes per second through a link of ``rate_bit`` bit/s."""
    return rate_bit / 8 * efficiency


# --------------------------------------------------------------------------- rounds
MESSAGE_STEPS = {"all_reduce": lambda w: 2 * (w - 1), "all_gather": lambda w: w - 1, "all_to_all": lambda w: w - 1,
                 "all_to_all_v": lambda w: w - 1, "reduce_scatter": lambda w: w - 1}


def message_steps(issued: Sequence[Issued]) -> int:
    """Message steps of a round: its collectives are in flight together, the longest chain counts (a collective
    of no bytes costs none)."""
    return max((MESSAGE_STEPS[c.kind](c.world) for c in issued if c.nbytes), default=0)


def round_seconds(issued: Sequence[Issued], bandwidth: float, alpha: float) -> float:
    """A round on a worker's own link: its collectives' bytes over ``bandwidth``, plus ``alpha`` per message step."""
    return sum(c.sent for c in issued) / bandwidth + alpha * message_steps(issued)


# --------------------------------------------------------------------------- the step
@dataclasses.dataclass(frozen=True)
class Round:
    """One round of a bucket's exchange: its collectives' time on the link, then codec work."""

    comm_s: float
    after_s: float = 0.0


@dataclasses.dataclass(frozen=True)
class BucketWork:
    """A bucket: ready after ``ready`` (0..1) of the backward pass; ``hook_s`` of codec work in the hook."""

    ready: float
    hook_s: float
    rounds: tuple[Round, ...]


@dataclasses.dataclass(frozen=True)
class StepTime:
    step_s: float
    forward_s: float
    backward_s: float
    codec_s: float  # all codec work (hooks and between rounds)
    comm_s: float  # all collectives' time on the link
    exposed_comm_s: float  # step time not explained by compute and codec work


def simulate_step(forward_s: float, backward_s: float, buckets: Sequence[BucketWork]) -> StepTime:
    """Step time of buckets exchanged as described in the module docstring (a pure function)."""
    link = 0.0  # when the link is free, from the start of the backward pass
    hooks = 0.0
    first_done = []
    for b in buckets:
        ready = backward_s * b.ready + hooks + b.hook_s
        hooks += b.hook_s
        if b.rounds:
            start = max(ready, link)
            link = start + b.rounds[0].comm_s
        first_done.append(link if b.rounds else ready)
    t = backward_s + hooks  # end of the backward pass: the last hook has run
    pending = [(b, 0, done) for b, done in zip(buckets, first_done) if b.rounds]
    while pending:
        nxt = []
        for b, k, done in pending:
            t = max(t, done) + b.rounds[k].after_s
            if k + 1 < len(b.rounds):
                start = max(t, link)
                link = start + b.rounds[k + 1].comm_s
                nxt.append((b, k + 1, link))
        pending = nxt
    codec = hooks + sum(r.after_s for b in buckets for r in b.rounds)
    comm = sum(r.comm_s for b in buckets for r in b.rounds)
    step = forward_s + t
    return StepTime(step_s=step, forward_s=forward_s, backward_s=backward_s, codec_s=codec, comm_s=comm,
                    exposed_comm_s=max(0.0, step - forward_s - backward_s - codec))


__all__ = ["BACKWARD_SHARE", "BucketWork", "FRAMING_EFFICIENCY", "MESSAGE_STEPS", "Round", "SOFTWARE_ALPHA",
           "RATE_RULE", "StepTime", "format_rate", "message_steps", "parse_duration", "parse_rate", "payload_bandwidth",
           "round_seconds", "simulate_step"]
