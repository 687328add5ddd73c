"""The ``"auto"`` spec: its options, parsed and validated (what :mod:`gradcompress.autopilot` runs with).

``"auto"`` takes the autopilot's own options and the Compressor's (``"auto:bandwidth=100mbit,warmup_steps=5"``):

* ``bandwidth=RATE`` (``100mbit``, ``1gbit``; default: measured): the link between workers, as a hint. Given, the
  autopilot does not probe the link (no probe bytes) and uses this rate; a test forces a slow-link decision on
  loopback with it.
* ``budget=safe|any`` (default ``safe``): the **error budget**, which codecs the autopilot may choose. ``safe``:
  ``none`` (dense), ``bf16``, ``int8``, ``int4``, each within 0.5 % of DDP's validation loss on the LM task under
  AdamW at lr 3e-3 with the library's defaults (README's LM table: int8 ±0.0 %, int4 +0.5 %; against DDP at its
  best lr, 1e-2: int4 +0.8 %, int8 +1.4 %, one seed). ``any`` adds PowerSGD rank 4 and
  rank 1, ``sign`` and ``topk:ratio=0.01``, which cut far more bytes but cost 5-11 % there.
* ``allocate=true|adam|false`` (default false): the error budget measured per tensor: where the cost model gives a
  bucket ``int4``, each of its tensors gets ``int8``, ``int4`` or ``int2``, the fewest bytes with the bucket's total
  squared error within ``int4``'s, measured on the gradients of the step before the decision
  (:mod:`gradcompress.autopilot.allocate`, L-GreCo's idea). ``adam``: each tensor's error weighed as an adaptive
  optimizer (Adam, AdamW) weighs it in its update: divided by the tensor's mean squared gradient (the per-tensor
  stand-in for Adam's preconditioner ``1/v``), so a tensor with small gradients counts as much as one with large.
* ``critical=ETA`` (default 0.5; 0: off): Accordion's detector of critical regimes (Agarwal et al. 2021). At each
  check the norm of the gradients of the step before it (each rank's, before the exchange; the ranks' squares
  summed) is compared with the previous check's: a relative change above ETA is a critical regime, in which the
  budget's riskiest codecs are left out (:data:`CRITICAL_DROPS`: ``safe`` drops ``int4``, ``any`` drops PowerSGD,
  sign and top-k) until a check finds the change below ETA again. Such a switch is made for the loss, not the
  speed: it is not tried against the old plan's step time.
* ``every=N`` (default 20): the autopilot re-measures every N steps and re-decides when the link rate or the compute
  time moved by more than 25 % since its last decision.
* ``cache=PATH|off`` (default: ``$GRADCOMPRESS_CACHE``, else the user's cache directory): where the codecs'
  calibration is kept between runs (:mod:`gradcompress.autopilot.calibration`); not part of the configuration text
  (each machine may keep its own).
"""

from __future__ import annotations

import dataclasses

from .timing import format_rate, parse_rate

BUDGETS = {
    "safe": ("none", "bf16", "int8", "int4"),
    "any": ("none", "bf16", "int8", "int4", "powersgd:rank=4", "powersgd:rank=1", "sign", "topk:ratio=0.01"),
}
#: the codecs a budget leaves out in a critical regime (``critical=``)
CRITICAL_DROPS = {"safe": ("int4",), "any": ("powersgd:rank=4", "powersgd:rank=1", "sign", "topk:ratio=0.01")}
OPTIONS = ("bandwidth", "budget", "every", "allocate", "critical", "cache")


@dataclasses.dataclass(frozen=True)
class Auto:
    """The autopilot's options (see the module docstring). ``bandwidth`` in bit/s, or None: measured."""

    bandwidth: float | None = None
    budget: str = "safe"
    every: int = 20
    allocate: bool | str = False  # False, True (squared error) or "adam" (error weighed by 1/v)
    critical: float = 0.5
    cache: str | None = dataclasses.field(default=None, compare=False)

    @property
    def candidates(self) -> tuple[str, ...]:
        """The codec specs the budget allows, ``"none"`` (dense) first."""
        return BUDGETS[self.budget]

    @property
    def critical_candidates(self) -> tuple[str, ...]:
        """The candidates in a critical regime."""
        return tuple(c for c in self.candidates if c not in CRITICAL_DROPS[self.budget])

    def text(self) -> str:
        rate = "measured" if self.bandwidth is None else format_rate(self.bandwidth).replace(" ", "")
        allocate = f",allocate={'true' if self.allocate is True else self.allocate}" if self.allocate else ""
        critical = "" if self.critical == 0.5 else f",critical={self.critical:g}"  # the default unsaid: old texts hold
        return f"auto:bandwidth={rate},budget={self.budget},every={self.every}{critical}{allocate}"


def parse(options: dict) -> Auto:
    """The autopilot's options from ``options`` (``ValueError`` naming the option and what is allowed)."""
    rate = options.get("bandwidth")
    if rate is not None:
        try:
            rate = parse_rate(rate)
        except ValueError as err:
            raise ValueError(f"auto: bandwidth: {err}") from None
    budget = options.get("budget", "safe")
    if budget not in BUDGETS:
        raise ValueError(f"auto: budget must be one of {', '.join(BUDGETS)}, got {budget!r}")
    every = options.get("every", 20)
    if isinstance(every, bool) or not isinstance(every, int) or every < 1:
        raise ValueError(f"auto: every must be an integer >= 1, got {every!r}")
    allocate = options.get("allocate", False)
    if not isinstance(allocate, bool) and allocate != "adam":
        raise ValueError(f"auto: allocate must be true, adam or false, got {allocate!r}")
    critical = options.get("critical", 0.5)
    if isinstance(critical, bool) or not isinstance(critical, (int, float)) or not critical >= 0:
        raise ValueError(f"auto: critical must be a number >= 0 (0: off), got {critical!r}")
    cache = options.get("cache")
    if cache is not None and (not isinstance(cache, str) or not cache.strip()):
        raise ValueError(f"auto: cache must be a file path or off, got {cache!r}")
    return Auto(rate, budget, every, allocate, float(critical), cache)


__all__ = ["Auto", "BUDGETS", "CRITICAL_DROPS", "OPTIONS", "parse"]
