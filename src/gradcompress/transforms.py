"""Stateful stages composed around a codec, each a pure pair of functions over explicit state.

A compressed tensor goes through, per parameter::

    grad -> clip -> momentum correction -> + worker residual -> codec -> collective
         -> (chunk owner: + server residual -> re-encode) -> decode -> averaged gradient

Each stage here is a small frozen dataclass in the manner of optax's transformations:
``update(x, state) -> (x', new_state)`` before the codec and, for the stages that
remember what compression delivered, ``after(new_state, sent, delivered) -> new_state``
once the codec has run. Nothing here mutates its inputs or keeps state of its own: the
caller (:class:`gradcompress.step.Step`) holds the new states aside and commits them at
the end of the step only when every rank's gradients were finite, so a rollback is
"do not commit" and no state can be forgotten. State ``None`` means "not yet created";
every state is a float32 tensor (or its ``residual_dtype``).
"""

from __future__ import annotations

import dataclasses
import math

import torch


@dataclasses.dataclass(frozen=True)
class Clip:
    """DGC's local gradient clipping: scale x so that ||x|| <= clip / sqrt(world). Stateless."""

    clip: float
    world: int

    def update(self, x: torch.Tensor, state=None):
        norm = torch.linalg.vector_norm(x)
        return x * (self.clip / (math.sqrt(self.world) * norm + 1e-12)).clamp(max=1.0), None


@dataclasses.dataclass(frozen=True)
class MomentumCorrection:
    """Momentum correction (DGC, Lin et al. 2018), for every codec.

    State u (the momentum buffer): ``u' = momentum * u + g`` and u' is what gets compressed
    (and error-fed), so the optimizer must run *without* momentum: compressing the
    momentum instead of the gradient keeps error-fed aggressive codecs stable where heavy
    optimizer momentum would amplify their delayed updates. ``masking`` (momentum factor
    masking) clears u at the coordinates that were sent, so stale momentum does not push
    them again.
    """

    momentum: float
    masking: bool = False

    def update(self, g: torch.Tensor, u: torch.Tensor | None):
        u = g.clone() if u is None else u * self.momentum + g
        return u, u

    def after(self, u: torch.Tensor, sent: torch.Tensor, delivered) -> torch.Tensor:
        if not self.masking:
            return u
        return u.masked_fill(delivered().view(u.shape) != 0, 0)


@dataclasses.dataclass(frozen=True)
class ErrorFeedback:
    """Error feedback (Seide et al. 2014; Karimireddy et al. 2019): what compression dropped is
    added to the next input.

    ``update``: x' = x + residual. ``after``: residual' = x' - delivered, where delivered is
    what this side's compression actually transmitted. The invariant the tests check:
    sum of inputs = sum of delivered + residual. Used on the worker side (per parameter)
    and on the chunk owner's side of the two-step reduce (per chunk of each parameter,
    ``server`` residuals), with ``dtype`` the residual's storage type.
    """

    dtype: torch.dtype = torch.float32

    def update(self, x: torch.Tensor, residual: torch.Tensor | None, out: torch.Tensor | None = None):
        """x + residual (into ``out`` when given: a buffer of x's shape and dtype that aliases neither)."""
        if residual is None:
            return x, None
        return torch.add(x, residual.to(x.dtype), out=out) if out is not None else x + residual.to(x.dtype), None

    def after(self, state, sent: torch.Tensor, delivered, out: torch.Tensor | None = None) -> torch.Tensor:
        """The new residual, sent - delivered, in ``dtype`` (written into ``out`` when given: the same values)."""
        d = delivered().reshape(sent.shape).to(sent.dtype)
        if out is not None:
            return torch.sub(sent, d, out=out)
        return (sent - d).to(self.dtype)


__all__ = ["Clip", "ErrorFeedback", "MomentumCorrection"]
