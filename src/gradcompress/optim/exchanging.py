"""What the optimizers that exchange themselves (CompressedAdam/OneBitAdam, DeMo) share: their shell
(:class:`ExchangingOptimizer`: the step, the Compressor that carries the exchange, the check that every rank has
the same configuration, the exchange's counters), whether ``torch.distributed`` is up, the collectives of their
documented single-process mode, and the text of their configuration that the first step checks."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.distributed as dist

from ..collectives import LocalCollectives
from ..compressor import Compressor


def initialised() -> bool:
    return dist.is_available() and dist.is_initialized()


def local_collectives(who: str, process_group: dist.ProcessGroup | None) -> LocalCollectives | None:
    """None (use the process group) when ``torch.distributed`` is initialised; else the single process's
    collectives (the same code, nothing sent), or a ``RuntimeError`` if a ``process_group`` was given."""
    if initialised():
        return None
    if process_group is not None:
        raise RuntimeError(f"{who}: a process_group was given but torch.distributed is not initialised")
    return LocalCollectives(1)


def refuse_manager(who: str, manager: object) -> None:
    """These optimizers exchange inside ``optimizer.step()``, after torchft's ``should_commit()`` has decided the
    step (torchft's ``OptimizerWrapper`` asks it first): a failed exchange could no longer be discarded, so a
    torchft ``manager`` is refused with that reason (DDP with a codec, or DiLoCo, run under torchft)."""
    if manager is not None:
        raise ValueError(f"{who}: not supported under torchft (manager=...): it exchanges inside optimizer.step(), "
                         "after torchft's should_commit() has decided the step, so a failed exchange could not be "
                         "discarded; use gradcompress.integrations.torchft.DistributedDataParallel with a codec, or "
                         "DiLoCo(..., manager=manager)")


def params_text(params: Iterable[torch.Tensor]) -> str:
    """Each parameter's shape and dtype, for the configuration check across ranks."""
    return ",".join(f"{tuple(p.shape)}:{str(p.dtype).replace('torch.', '')}" for p in params)


class ExchangingOptimizer(torch.optim.Optimizer):
    """The shell of an optimizer that exchanges inside :meth:`step`: each step opens a step of the
    :class:`gradcompress.Compressor` that carries the exchange (made at the first step by :meth:`_make_compressor`;
    without ``torch.distributed``, the documented single process: the same code, nothing sent), checks at its first
    step that every rank has the same configuration (:meth:`_config`), runs :meth:`_exchange_and_update` inside it
    and counts its time. The optimizer sets ``codec``, ``process_group``, ``topology`` and the runtime
    (``_compressor`` None, ``_local``, ``_checked`` False, ``_counters`` with ``"seconds"`` and ``"raw_bytes"``)."""

    codec: Any
    process_group: Any
    topology: Any
    _compressor: Compressor | None
    _local: LocalCollectives | None
    _checked: bool
    _counters: dict

    # ------------------------------------------------------------------ what each optimizer says
    def _make_compressor(self) -> Compressor:
        """The Compressor that carries the exchange (made at the first step)."""
        raise NotImplementedError

    def _exchange_and_update(self, step, loss):
        """The step's exchange and update inside the open ``step``; returns ``loss``."""
        raise NotImplementedError

    def _group_text(self, group: dict) -> str:
        """A parameter group's hyperparameters, for the configuration check across ranks."""
        raise NotImplementedError

    def _schedule_text(self) -> str:
        """The schedule's part of the configuration check ("" where there is none to say)."""
        return ""

    def _check_layout(self, step) -> None:
        """Refuse the exchange's layout at a step's opening (``step.abort()`` then raise); all are fine here."""

    # ------------------------------------------------------------------ public API
    def bytes_sent(self) -> int:
        """``stats()["wire_bytes"]``: bytes this rank has transmitted so far."""
        return self._compressor.stats()["wire_bytes"] if self._compressor else 0

    def state_dict(self) -> dict:
        """``torch.optim.Optimizer``'s state dict, with copies of the state tensors (not live references)."""
        sd = super().state_dict()
        sd["state"] = {k: {n: v.clone() if isinstance(v, torch.Tensor) else v for n, v in s.items()}
                       for k, s in sd["state"].items()}
        return sd

    def _exchange_stats(self) -> dict:
        """The exchange's part of ``stats()``: ``raw_bytes``, ``wire_bytes``, ``ratio`` (raw / wire),
        ``comm_seconds``, ``codec_seconds`` (the rest of the time in :meth:`step`) and the Compressor's
        ``inter_node_bytes`` / ``intra_node_bytes`` / ``topology``."""
        exchanged: dict[str, Any] = self._compressor.stats() if self._compressor else {
            "wire_bytes": 0, "comm_seconds": 0.0, "inter_node_bytes": 0, "intra_node_bytes": 0, "topology": None}
        wire, comm_s = exchanged["wire_bytes"], exchanged["comm_seconds"]
        raw = self._counters["raw_bytes"]
        return {
            "raw_bytes": raw,
            "wire_bytes": wire,
            "ratio": raw / wire if wire else float("inf") if raw else 1.0,
            "comm_seconds": comm_s,
            "codec_seconds": max(0.0, self._counters["seconds"] - comm_s),
            "inter_node_bytes": exchanged["inter_node_bytes"],
            "intra_node_bytes": exchanged["intra_node_bytes"],
            "topology": exchanged["topology"],
        }

    # ------------------------------------------------------------------ the step
    # ignore[override] below: torch.optim.Optimizer.step is overloaded (None -> None, a closure -> float)
    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        """One optimizer step on every rank of the group (a collective call: every rank must make it)."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        started = time.perf_counter()
        with self._begin() as step:
            loss = self._exchange_and_update(step, loss)
        self._counters["seconds"] += time.perf_counter() - started
        return loss

    def _begin(self):
        """Open a step of the Compressor that carries the exchange (made at the first step)."""
        who = type(self).__name__
        if self._compressor is None:
            # without torch.distributed: the documented single process (the same code, nothing sent)
            self._local = local_collectives(who, self.process_group)
            self._compressor = self._make_compressor()
        step = self._compressor.begin_step(self._local)
        self._check_layout(step)
        if not self._checked:
            step.comm.check_same(self._config(), f"{who} (parameters or hyperparameters)")
            self._checked = True
        return step

    def _config(self) -> str:
        """What every rank must share (checked at the first step): the codec, the schedule, and per group its
        hyperparameters and its parameters' shapes and dtypes."""
        groups = [f"{self._group_text(g)} params=[{params_text(g['params'])}]" for g in self.param_groups]
        return f"{self.codec.spec}; {self._schedule_text()}" + "; ".join(groups)


__all__ = ["ExchangingOptimizer", "initialised", "local_collectives", "params_text", "refuse_manager"]
