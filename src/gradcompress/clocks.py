"""Where the autopilot's times come from: the host's clock, or CUDA events on the stream the work runs on.

A clock gives *marks* (:meth:`mark`) and the seconds between two of them (:meth:`seconds`). On a CPU (gloo) a
collective's ``Work.wait()`` returns when the data has arrived, so host time around it is the time spent waiting on
it, and host time between two steps' starts is the step: :class:`HostClock`, read at once. Under NCCL ``wait()``
only makes the current stream wait and returns at once, so the host clock books the communication as compute (and a
step's time is right only where the loop synchronises). :class:`EventClock` records a CUDA event on the current
stream at each mark: the seconds between two marks are that stream's, known only once the later event has completed
(``asynchronous``: the autopilot resolves its marks at its check steps, where it synchronises anyway, never in
between).
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch


class HostClock:
    """``now`` (default ``time.perf_counter``) at each mark; the difference at once."""

    asynchronous = False

    def __init__(self, now: Callable[[], float] = time.perf_counter) -> None:
        self.now = now

    def mark(self) -> float:
        return self.now()

    def seconds(self, a: float, b: float) -> float:
        return b - a


class EventClock:
    """A CUDA event recorded on ``device``'s current stream at each mark; the seconds between two marks wait for the
    later one to complete (call it where a synchronisation costs nothing: at a check)."""

    asynchronous = True

    def __init__(self, device: torch.device | str | int) -> None:
        self.device = torch.device(device)

    def mark(self) -> torch.cuda.Event:
        # torch.cuda.Event's constructor (its __new__) carries no annotations
        event = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
        event.record(torch.cuda.current_stream(self.device))
        return event

    def seconds(self, a: torch.cuda.Event, b: torch.cuda.Event) -> float:
        b.synchronize()
        milliseconds: float = a.elapsed_time(b)  # elapsed_time is unannotated: milliseconds, a float
        return milliseconds / 1e3


def for_device(device: torch.device | str | int | None) -> HostClock | EventClock:
    """The clock that sees the work on ``device``: CUDA events on a GPU, the host's clock elsewhere."""
    device = torch.device(device or "cpu")
    return EventClock(device) if device.type == "cuda" else HostClock()


__all__ = ["EventClock", "HostClock", "for_device"]
