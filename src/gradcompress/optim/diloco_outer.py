"""DiLoCo's outer step: the anchors (the parameters as last synchronised) and the outer optimizer that steps them.

:class:`OuterRule` is how the anchors step, from DiLoCo's keyword arguments ``outer``, ``outer_lr``,
``outer_momentum``, ``nesterov``, ``error_decay`` and ``outer_optimizer``: DiLoCo's SGD with Nesterov momentum,
SparseLoCo's plain SGD (its decayed error feedback is the outer memory, applied by the exchange), or the user's
optimizer over the anchors. :class:`OuterStep` holds the anchors and that optimizer: it computes a fragment's outer
gradients (``anchor - local``), steps the anchors by their average, and lands the result in the local parameters
(copied, or blended by ``mix``).
"""

from __future__ import annotations

import numbers
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import torch

from ..exchanges.context import all_finite
from ..scheme import DILOCO_OUTERS

#: the outer updates DiLoCo knows: DiLoCo's own (SGD with Nesterov momentum) and SparseLoCo's
OUTERS = DILOCO_OUTERS
#: SparseLoCo's error-feedback decay (beta) and outer learning rate (alpha)
SPARSELOCO_ERROR_DECAY = 0.95
SPARSELOCO_OUTER_LR = 1.0
#: DiLoCo's outer learning rate (the paper's)
DILOCO_OUTER_LR = 0.7


def check_outer(outer: object) -> str:
    """``outer=``: one of :data:`OUTERS`; ``ValueError`` naming them otherwise."""
    if not isinstance(outer, str) or outer not in OUTERS:
        raise ValueError(f"DiLoCo: outer must be one of {', '.join(OUTERS)}, got {outer!r}")
    return outer


def _error_decay(value, sparse: bool) -> float:
    """The error-feedback decay: sparseloco's (default :data:`SPARSELOCO_ERROR_DECAY`), in [0, 1]."""
    if value is None:
        return SPARSELOCO_ERROR_DECAY if sparse else 1.0
    if not sparse:
        raise ValueError("DiLoCo: error_decay applies to outer='sparseloco' only")
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not 0 <= value <= 1:  # type: ignore[operator]  # typeshed's numbers ABCs declare no comparisons
        raise ValueError(f"DiLoCo: error_decay must be a number in [0, 1], got {value!r}")
    return float(value)


@dataclass(frozen=True)
class OuterRule:
    """How the anchors step: ``kind`` (one of :data:`OUTERS`), SGD's ``lr``, ``momentum`` and ``nesterov``
    (sparseloco: plain SGD at ``lr``), SparseLoCo's ``error_decay`` (1.0: none), or the user's ``make(anchors)``."""

    kind: str
    lr: float
    momentum: float
    nesterov: bool
    error_decay: float
    make: Callable[[list[torch.nn.Parameter]], torch.optim.Optimizer] | None

    @classmethod
    def of(cls, kind: str, lr: float | None, momentum: float, nesterov: bool, error_decay: float | None,
           make: Callable[[list[torch.nn.Parameter]], torch.optim.Optimizer] | None) -> OuterRule:
        """DiLoCo's outer keyword arguments checked (``kind`` already is), with their defaults."""
        sparse = kind == "sparseloco"
        if lr is None:
            lr = SPARSELOCO_OUTER_LR if sparse else DILOCO_OUTER_LR
        for name, value in (("outer_lr", lr), ("outer_momentum", momentum)):
            if isinstance(value, bool) or not isinstance(value, numbers.Real) or value < 0:
                raise ValueError(f"DiLoCo: {name} must be a number >= 0, got {value!r}")
        return cls(kind, lr, momentum, nesterov, _error_decay(error_decay, sparse), make)

    @property
    def sparse(self) -> bool:
        """SparseLoCo's rule: the exchange compresses with decayed error feedback; no outer momentum."""
        return self.kind == "sparseloco"

    def optimizer(self, anchor: list[torch.nn.Parameter]) -> torch.optim.Optimizer:
        """SparseLoCo's plain SGD, DiLoCo's SGD with Nesterov momentum, or the user's ``make(anchor)``."""
        if self.sparse:  # no outer momentum: the decayed error-feedback buffer is the outer memory
            return torch.optim.SGD(anchor, lr=self.lr, momentum=0.0)
        if self.make is None:
            return torch.optim.SGD(anchor, lr=self.lr, momentum=self.momentum,
                                   nesterov=bool(self.nesterov) and self.momentum > 0)
        outer = self.make(anchor)
        if not isinstance(outer, torch.optim.Optimizer):
            raise ValueError("DiLoCo: outer_optimizer must return a torch.optim.Optimizer over the anchors")
        return outer


class OuterStep:
    """The anchors (copies of ``params`` as given) and the outer optimizer over them (``rule.optimizer``)."""

    def __init__(self, params: Sequence[torch.Tensor], rule: OuterRule):
        self.rule = rule
        self.anchor = [torch.nn.Parameter(p.detach().clone(), requires_grad=False) for p in params]
        self.optimizer = rule.optimizer(self.anchor)

    @torch.no_grad()
    def gradients(self, keys: list[int], params: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """The outer gradients ``anchor - local`` of the parameters at ``keys`` (new tensors, the anchors' dtype)."""
        return [(self.anchor[i].detach() - params[i].detach()).to(self.anchor[i].dtype) for i in keys]

    @torch.no_grad()
    def step(self, keys: list[int], grads: list[torch.Tensor]) -> None:
        """Step the anchors at ``keys`` by ``grads`` (the averaged outer gradients, set as their ``.grad``)."""
        for i, g in zip(keys, grads):
            self.anchor[i].grad = g
        self.optimizer.step()
        for i in keys:
            self.anchor[i].grad = None

    @torch.no_grad()
    def finite(self, params: Sequence[torch.Tensor], keys: Iterable[int]) -> bool:
        """Whether the local parameters at ``keys`` are all finite (one host read)."""
        flags = [all_finite(params[i].detach()) for i in keys]
        return bool(torch.stack(flags).all()) if flags else True

    @torch.no_grad()
    def land(self, params: Sequence[torch.Tensor], keys: Iterable[int], mix: float) -> None:
        """The anchors at ``keys`` into the local parameters: ``local <- mix * anchor + (1 - mix) * local`` (1.0: a
        copy)."""
        for i in keys:
            if mix == 1.0:
                params[i].copy_(self.anchor[i])
            else:
                params[i].mul_(1.0 - mix).add_(self.anchor[i], alpha=mix)

    def anchors(self) -> list[torch.Tensor]:
        """Copies of the anchors."""
        return [a.detach().clone() for a in self.anchor]

    def shared_state(self) -> dict:
        """Copies of the anchors and of the optimizer's state (no collective: torchft's quorum thread reads it)."""
        return {"anchor": self.anchors(), "outer": _cloned(self.optimizer.state_dict())}

    @torch.no_grad()
    def load(self, anchor: list[torch.Tensor], outer: dict) -> None:
        """Take saved anchors and optimizer state."""
        for a, saved in zip(self.anchor, anchor):
            a.copy_(saved)
        self.optimizer.load_state_dict(outer)


def _cloned(value):
    """A copy of a (nested) state dict's tensors."""
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    if isinstance(value, dict):
        return {k: _cloned(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_cloned(v) for v in value)
    return value


__all__ = ["DILOCO_OUTER_LR", "OUTERS", "OuterRule", "OuterStep", "SPARSELOCO_ERROR_DECAY", "SPARSELOCO_OUTER_LR",
           "check_outer"]
