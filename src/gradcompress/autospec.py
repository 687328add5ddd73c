"""The ``"auto"`` spec: its options, parsed and validated (what :mod:`gradcompress.autopilot` runs with).

``"auto"`` takes the autopilot's own options and the Compressor's (``"auto:bandwidth=100mbit,warmup_steps=5"``):

* ``bandwidth=RATE`` (``100mbit``, ``1gbit``; default: measured): the link between workers, as a hint. Given, the
  autopilot does not probe the link (no probe bytes) and uses this rate; a test forces a slow-link decision on
  loopback with it.
* ``budget=safe|any`` (default ``safe``): the **error budget**, which codecs the autopilot may choose. ``safe``:
  ``none`` (dense), ``bf16``, ``int8``, ``int4``, each within 0.5 % of DDP's validation loss on the LM task under
  AdamW with the library's defaults (README's LM table: int8 ±0.0 %, int4 +0.5 %). ``any`` adds PowerSGD rank 4 and
  rank 1, ``sign`` and ``topk:ratio=0.01``, which cut far more bytes but cost 5-11 % there.
* ``allocate=true|false`` (default false): the error budget measured per tensor: where the cost model gives a
  bucket ``int4``, each of its tensors gets ``int8``, ``int4`` or ``int2``, the fewest bytes with the bucket's total
  squared error within ``int4``'s, measured on the gradients of the step before the decision
  (:mod:`gradcompress.autopilot.allocate`, L-GreCo's idea).
* ``every=N`` (default 20): the autopilot re-measures every N steps and re-decides when the link rate or the compute
  time moved by more than 25 % since its last decision.
"""

from __future__ import annotations

import dataclasses

from .timing import format_rate, parse_rate

BUDGETS = {
    "safe": ("none", "bf16", "int8", "int4"),
    "any": ("none", "bf16", "int8", "int4", "powersgd:rank=4", "powersgd:rank=1", "sign", "topk:ratio=0.01"),
}
OPTIONS = ("bandwidth", "budget", "every", "allocate")


@dataclasses.dataclass(frozen=True)
class Auto:
    """The autopilot's options (see the module docstring). ``bandwidth`` in bit/s, or None: measured."""

    bandwidth: float | None = None
    budget: str = "safe"
    every: int = 20
    allocate: bool = False

    @property
    def candidates(self) -> tuple[str, ...]:
        """The codec specs the budget allows, ``"none"`` (dense) first."""
        return BUDGETS[self.budget]

    def text(self) -> str:
        rate = "measured" if self.bandwidth is None else format_rate(self.bandwidth).replace(" ", "")
        allocate = ",allocate=true" if self.allocate else ""
        return f"auto:bandwidth={rate},budget={self.budget},every={self.every}{allocate}"


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
    if not isinstance(allocate, bool):
        raise ValueError(f"auto: allocate must be true or false, got {allocate!r}")
    return Auto(rate, budget, every, allocate)


__all__ = ["Auto", "BUDGETS", "OPTIONS", "parse"]
