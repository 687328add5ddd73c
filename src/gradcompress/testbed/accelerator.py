"""An emulated accelerator: the compute of a step leaves the CPU idle, as on a GPU.

On this testbed the workers share the CPU cores with gloo, so compression's codec work and the collectives compete
with the backward pass for them; on a GPU they do not. :class:`Emulated` wraps a benchmark model: its forward sleeps
for the forward's share of a measured compute time and returns a loss whose backward writes real gradients (those
of one real backward pass of the model on the worker's batch) into the real parameters, sleeping before each
parameter's gradient for its share of the backward time. The DDP hook fires per bucket as the backward pass goes, in
the real order, and the CPU is free while the "device" computes. What is sent, and so the codecs' work, is real.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch
import torch.nn as nn

#: the forward's share of a step's compute (the backward's the rest: about twice the forward)
FORWARD_SHARE = 1 / 3


class _Delay(torch.autograd.Function):
    """Identity; its backward sleeps ``seconds`` first (the device computing this parameter's gradient)."""

    @staticmethod
    def forward(ctx, p, seconds: float):
        ctx.seconds = seconds
        return p.view_as(p)

    @staticmethod
    def backward(ctx, grad):
        time.sleep(ctx.seconds)
        return grad, None


class Emulated(nn.Module):
    """``model``'s parameters, trained as if on an accelerator taking ``compute_s`` per forward and backward:
    ``grads`` (one per parameter, in order) are what each backward writes."""

    def __init__(self, model: nn.Module, grads: list, compute_s: float):
        super().__init__()
        self.inner = model
        self.grads = [g.detach().clone() for g in grads]
        self.compute_s = compute_s

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x unused: the input's compute is emulated
        time.sleep(FORWARD_SHARE * self.compute_s)
        params = list(self.inner.parameters())
        total = sum(p.numel() for p in params) or 1
        backward_s = (1 - FORWARD_SHARE) * self.compute_s
        loss = torch.zeros(())
        for p, g in zip(params, self.grads):  # the last parameter's term is created last: its backward runs first
            loss = loss + (_Delay.apply(p, backward_s * p.numel() / total) * g).sum()
        return loss


def real_grads(model: nn.Module, loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], x: torch.Tensor,
               y: torch.Tensor) -> list:
    """The gradients of one real backward pass of ``model`` on ``(x, y)`` (``loss_fn(out, y)``), per parameter."""
    model.zero_grad(set_to_none=True)
    loss_fn(model(x), y).backward()
    grads = [p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p) for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    return grads


__all__ = ["Emulated", "FORWARD_SHARE", "real_grads"]
