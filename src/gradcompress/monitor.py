"""Telemetry: how far a compressed step's average is from the exact one (``Compressor(monitor_every=N)``).

Every N-th compressed step, :class:`StepMonitor` keeps what each compressed tensor would have been averaged as
(after clip and momentum correction, before error feedback), all-reduces it exactly (counted in
``monitor_bytes``, not ``wire_bytes``) and records per key the squared error, the squared norms and the dot
product of the delivered average against the exact one, and the residual's squared norm. :class:`Telemetry`
turns a committed monitored step's rows into ``stats()["monitor"]``: relative error, cosine, residual norm,
overall and per parameter key, and a short history.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import Any, Protocol, TypedDict

import torch

from .collectives import Collectives, Job

#: monitored steps kept in ``stats()["monitor"]["history"]``
MONITOR_HISTORY = 50


class Written(Protocol):
    """What a monitor reads of its step's context: the new state written so far, by (slot, key)."""

    @property
    def new(self) -> dict[tuple[str, Hashable], torch.Tensor]: ...


class Summary(TypedDict):
    """How far a delivered average is from the exact one (overall, or one key's): a plain dict at run time."""

    relative_error: float
    cosine: float
    residual_norm: float | None  # None without error feedback


class StepMonitor:
    """The telemetry of one monitored step."""

    def __init__(self, ctx: Written) -> None:
        self.ctx = ctx
        self.refs: dict[Hashable, torch.Tensor] = {}  # key -> what would have been averaged dense
        self.rows: dict[Hashable, torch.Tensor] = {}  # key -> 0-d tensors (err^2, ref^2, dot, out^2, residual^2)

    def reference(self, key: Hashable, x: torch.Tensor, grad: torch.Tensor) -> None:
        """Keep ``x`` (a copy where it is the gradient's own storage, which the result overwrites)."""
        self.refs[key] = x if x.data_ptr() != grad.data_ptr() else x.clone()

    def exact_mean(self, comm: Collectives, flat: torch.Tensor, divisor: int) -> Job:
        """The exact average of ``flat`` (its sum over the group divided by ``divisor``), as a job (counted in
        ``monitor_bytes``)."""
        yield [comm.all_reduce(flat, monitor=True)]
        flat.div_(divisor)

    def record(self, keys: Sequence[Hashable], exact: torch.Tensor, outs: list[torch.Tensor]) -> None:
        """Per key: squared error, squared norms and dot product of the delivered against the exact average."""
        offset = 0
        for k, out in zip(keys, outs):
            ref = exact[offset : offset + out.numel()]
            got = out.reshape(-1)
            offset += out.numel()
            residual = self.ctx.new.get(("residual", k))
            self.rows[k] = torch.stack([
                (got - ref).square().sum(), ref.square().sum(), (got * ref).sum(), got.square().sum(),
                residual.float().square().sum() if residual is not None else torch.zeros((), device=got.device)])

    def record_dense(self, key: Hashable, g: torch.Tensor) -> None:
        """A tensor that travelled dense is exact: it counts with no error."""
        n2 = g.float().square().sum()
        self.rows[key] = torch.stack([torch.zeros_like(n2), n2, n2, n2, torch.zeros_like(n2)])


class Telemetry:
    """``stats()["monitor"]`` of a Compressor: the last committed monitored step and a short history."""

    def __init__(self, error_feedback: bool) -> None:
        self.error_feedback = error_feedback
        self.last: dict[str, Any] | None = None
        self.history: list[tuple[int, float, float]] = []

    def _summary(self, err2: float, ref2: float, dot: float, out2: float, res2: float) -> Summary:
        return {"relative_error": (err2 / ref2) ** 0.5 if ref2 > 0 else (0.0 if err2 == 0 else float("inf")),
                "cosine": dot / (ref2 * out2) ** 0.5 if ref2 > 0 and out2 > 0 else (1.0 if err2 == 0 else 0.0),
                "residual_norm": res2 ** 0.5 if self.error_feedback else None}

    def report(self, index: int, monitor: StepMonitor) -> None:
        """Relative error and cosine of the delivered average against the exact one, overall and per key."""
        rows = {k: v.tolist() for k, v in monitor.rows.items()}
        total = [sum(r[i] for r in rows.values()) for i in range(5)]
        overall = self._summary(*total)
        self.last = {"step": index, **overall, "per_parameter": {k: self._summary(*r) for k, r in rows.items()}}
        self.history = (self.history + [(index, overall["relative_error"], overall["cosine"])])[-MONITOR_HISTORY:]

    def stats(self) -> dict[str, Any] | None:
        return None if self.last is None else {**self.last, "history": list(self.history)}


__all__ = ["MONITOR_HISTORY", "StepMonitor", "Summary", "Telemetry"]
