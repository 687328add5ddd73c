"""The checks of :class:`~gradcompress.optim.onebit_adam.CompressedAdam`'s arguments (Adam's hyperparameters, the
local steps' schedule, the momentum codec), each a ``ValueError`` that names the optimizer."""

from __future__ import annotations

import math
import numbers

from typing import TYPE_CHECKING

from ..spec import make

if TYPE_CHECKING:
    from ..codecs.base import Codec
    from ..config import Spec


def _real(name: str, value, who: str = "OneBitAdam") -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ValueError(f"{who}: {name} must be a number, got {value!r}")
    return float(value)


def check_hyperparameters(lr: float, betas: tuple[float, float], eps: float, weight_decay: float, warmup_steps: int,
                          who: str = "OneBitAdam") -> None:
    lr_f = _real("lr", lr, who)
    if not (math.isfinite(lr_f) and lr_f >= 0):
        raise ValueError(f"{who}: lr must be a finite number >= 0, got {lr!r}")
    if isinstance(betas, (str, bytes)) or not isinstance(betas, (tuple, list)) or len(betas) != 2:
        raise ValueError(f"{who}: betas must be a pair (beta1, beta2), got {betas!r}")
    for i, b in enumerate(betas):
        b_f = _real(f"betas[{i}]", b, who)
        if not 0.0 <= b_f < 1.0:
            raise ValueError(f"{who}: betas[{i}] must be in [0, 1), got {b!r}")
    eps_f = _real("eps", eps, who)
    if not (math.isfinite(eps_f) and eps_f > 0):
        raise ValueError(f"{who}: eps must be a finite number > 0, got {eps!r}")
    wd = _real("weight_decay", weight_decay, who)
    if not (math.isfinite(wd) and wd >= 0):
        raise ValueError(f"{who}: weight_decay must be a finite number >= 0, got {weight_decay!r}")
    if isinstance(warmup_steps, bool) or not isinstance(warmup_steps, numbers.Integral) or warmup_steps < 0:
        raise ValueError(f"{who}: warmup_steps must be an integer >= 0, got {warmup_steps!r}")


def check_schedule(sync_every: int, sync_ramp_steps: int, who: str) -> tuple[int, int]:
    for name, value, lo in (("sync_every", sync_every, 1), ("sync_ramp_steps", sync_ramp_steps, 0)):
        if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < lo:
            raise ValueError(f"{who}: {name} must be an integer >= {lo}, got {value!r}")
    return int(sync_every), int(sync_ramp_steps)


def momentum_codec(codec: Spec, who: str) -> Codec:
    """The momentum codec; refuses codecs that keep their own momentum (dgc) and unknown specs."""
    try:
        c = make(codec)
    except (ValueError, TypeError) as err:
        raise ValueError(f"{who}: codec: {err}") from None
    if c.carries_momentum:
        raise ValueError(f"{who}: codec {c.spec!r} keeps its own momentum, but Adam's momentum is what is sent; "
                         "use its plain sparsifier (topk) instead")
    return c


__all__ = ["check_hyperparameters", "check_schedule", "momentum_codec"]
