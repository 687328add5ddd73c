"""Streaming DiLoCo's schedule and courier (Douillard et al., 2025): fragments synchronised in turn, overlapped.

The parameters are split into F **fragments** by layer (the module that owns them), interleaved (fragment f
holds layers f, f+F, f+2F, ...: a share of every depth). Fragment f is sent every H inner steps at offset ``f*H // F`` (its first send
after at least H steps: at ``H + offset``); with F = 1 that is DiLoCo's own schedule. A send computes the
fragment's outer gradient and hands its exchange to the :class:`Courier`, a single thread that runs every
fragment's exchange in the order of the sends, the same on every rank (so the collectives pair up whatever each
rank's speed); the fragment's outer update is **applied** ``delay`` (tau) inner steps later, when the training
thread waits for that exchange (the only place it waits) and then blends the new global fragment into the local
one: ``local <- mix * global + (1 - mix) * local``. With ``delay=0`` nothing runs on the thread: the exchange is
done at once, in the training thread, and ``mix=1`` copies the global fragment (DiLoCo's behaviour).
"""

from __future__ import annotations

import concurrent.futures
import numbers
from typing import NamedTuple
from collections.abc import Callable


def fragments_of(layers: list[list[int]], fragments: int) -> list[list[int]]:
    """``layers`` (each a list of parameter positions, in model order) dealt into ``fragments`` interleaved
    fragments: fragment f holds layers f, f+F, f+2F... (a share of every depth), its positions sorted."""
    return [sorted(i for layer in layers[f::fragments] for i in layer) for f in range(fragments)]


def layers_of(names: list[str]) -> list[list[int]]:
    """Parameter positions grouped by the module that owns them (the name up to its last dot), in order of first
    appearance: ``["0.weight", "0.bias", "2.weight"]`` -> ``[[0, 1], [2]]``."""
    groups: dict[str, list[int]] = {}
    for i, name in enumerate(names):
        groups.setdefault(name.rpartition(".")[0], []).append(i)
    return list(groups.values())


def offset(fragment: int, fragments: int, sync_every: int) -> int:
    """Fragment f's offset in the H-step cycle: ``f*H // F``."""
    return fragment * sync_every // fragments


def due(step: int, fragment: int, fragments: int, sync_every: int) -> bool:
    """Whether fragment f is sent after inner step ``step`` (1-based): at ``k*H + offset`` for k >= 1."""
    at = offset(fragment, fragments, sync_every)
    return step >= sync_every + at and (step - at) % sync_every == 0


def check_streaming_options(fragments: int, delay: int, mix: float | None, sync_every: int, layers: int,
          model: bool = True) -> tuple[int, int, float]:
    """The streaming options, validated: ``ValueError`` naming the option and what is allowed. ``layers``: how many
    the model has (``model``; else the parameters were given as a list, each its own layer)."""
    integral = not isinstance(fragments, bool) and isinstance(fragments, numbers.Integral)
    if integral and fragments > layers:
        what = (f"the model has {layers} layer{'s' * (layers != 1)} (modules that own parameters)" if model else
                f"the {layers} parameter{'s' * (layers != 1)} given as a list are {layers} layers")
        raise ValueError(f"DiLoCo: fragments={fragments} is more than the model's layers: {what}, and each fragment "
                         f"is at least one layer; pass fragments={layers} or fewer (1: the whole model at once, no "
                         "streaming)")
    if not integral or not 1 <= fragments:
        raise ValueError(f"DiLoCo: fragments must be an integer from 1 to the number of layers ({layers}: the "
                         f"modules that own parameters), got {fragments!r}")
    if isinstance(delay, bool) or not isinstance(delay, numbers.Integral) or not 0 <= delay < sync_every:
        raise ValueError(f"DiLoCo: delay must be an integer from 0 to sync_every - 1 ({sync_every - 1}): a "
                         f"fragment's update lands before its next send; got {delay!r}")
    if mix is None:
        mix = 1.0 if delay == 0 else 0.5
    if isinstance(mix, bool) or not isinstance(mix, numbers.Real) or not 0 < mix <= 1:
        raise ValueError(f"DiLoCo: mix must be a number in (0, 1] (the weight of the global fragment), got {mix!r}")
    return int(fragments), int(delay), float(mix)


class Schedule:
    """When to sync which fragment (DiLoCo's ``sync_every``, ``fragments``, ``delay`` and ``mix``, checked by
    :func:`check_streaming_options`): the parameters' ``parts`` (positions by fragment, from ``layers``), the inner ``steps`` counted,
    which fragments are sent or applied after a step. Also the schedule as a torchft quorum sees it
    (:func:`gradcompress.quorum.under`'s ``schedule``: :meth:`position` and :meth:`agree`)."""

    def __init__(self, sync_every: int, fragments: int, delay: int, mix: float | None, layers: list[list[int]],
                 model: bool = True) -> None:
        self.sync_every = int(sync_every)
        self.fragments, self.delay, self.mix = check_streaming_options(fragments, delay, mix, self.sync_every,
                                                                       len(layers), model)
        self.parts = fragments_of(layers, self.fragments)
        self.steps = 0  # inner steps
        self.sent_at = 0  # the inner step of the latest send (its position in the schedule)
        self.agreed: int | None = None  # under torchft: the quorum's position for that send (agree)

    def tick(self) -> int:
        """One inner step taken: the count of them."""
        self.steps += 1
        return self.steps

    def resume(self, steps: int) -> None:
        """Count from ``steps`` inner steps (a checkpoint's)."""
        self.steps = steps

    def sends(self, step: int) -> list[int]:
        """The fragments sent after inner step ``step``."""
        return [f for f in range(self.fragments) if due(step, f, self.fragments, self.sync_every)]

    def applies(self, flight: dict, step: int) -> list[int]:
        """The fragments of ``flight`` (fragment -> :class:`InFlight`) whose update is applied after ``step``."""
        return [f for f in range(self.fragments) if f in flight and flight[f].apply_at <= step]

    def sent(self, step: int) -> int:
        """A send after inner step ``step``: the step after which it is applied."""
        self.sent_at = step
        return step + self.delay

    def position(self) -> int:
        """The inner step of the send being exchanged: where the replica is in the fragment schedule."""
        return self.sent_at

    def agree(self, position: int) -> None:
        """The quorum's position for the send being exchanged (its first participating member's): the replica
        counts from it once the exchange is applied (one that joined or missed a quorum, whose sends would not
        pair with its peers', takes up their schedule; the exchange fails if they sent different fragments)."""
        self.agreed = position

    def applied(self, apply_at: int) -> None:
        """A send applied (the one due after ``apply_at``): count as the quorum did, if it agreed a position (its
        send step, plus the steps since this replica's send)."""
        agreed, self.agreed = self.agreed, None
        if agreed is not None:
            self.steps = agreed + self.steps - (apply_at - self.delay)


class InFlight(NamedTuple):
    """A fragment sent and not yet applied: its outer gradients (averaged in place by the exchange), the inner
    step after which it is applied, the exchange's result (a future of "every rank was finite"), and ``lost``:
    under torchft, an exchange that does not apply although every rank was finite (a peer died in it, the quorum
    changed; known once decided), whose fragment keeps its local parameters."""

    fragment: int
    grads: list
    apply_at: int
    result: concurrent.futures.Future
    lost: bool = False


class Courier:
    """One thread that runs the fragments' exchanges one after another, in the order they were sent."""

    def __init__(self):
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None

    def send(self, exchange: Callable[[], bool], now: bool) -> concurrent.futures.Future:
        """Run ``exchange`` on the thread (``now``: here, at once, in the caller's thread); a future of its result."""
        if now:
            done: concurrent.futures.Future = concurrent.futures.Future()
            done.set_result(exchange())
            return done
        if self._pool is None:
            self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="diloco-stream")
        return self._pool.submit(exchange)

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None


def done(value: bool) -> concurrent.futures.Future:
    """A completed future (an exchange finished before a checkpoint, restored from it)."""
    f: concurrent.futures.Future = concurrent.futures.Future()
    f.set_result(value)
    return f


__all__ = ["Courier", "InFlight", "Schedule", "check_streaming_options", "done", "due", "fragments_of", "layers_of", "offset"]
