"""The error budget, measured per tensor: the fewest bytes within the error of one uniform codec (L-GreCo's idea).

Where the cost model gave a bucket ``int4`` (the link wants the most compression the ``safe`` budget allows), the
tensors of that bucket need not all get it: a tensor whose gradient is small adds little error however coarsely it
is sent, a large one much. Each tensor ``k`` gets the level ``c`` of :data:`LEVELS` (int8, int4, int2) that
minimises the bytes sent, ``sum_k bytes(k, c_k)``, subject to the total squared error staying within what ``int4``
everywhere would make, ``sum_k err(k, c_k) <= sum_k err(k, int4)``.

* ``err(k, c)``: ``||x_k - decode(encode(x_k))||^2`` of one round trip of this rank's gradient of tensor k (the
  inputs of the step before a check, :attr:`~gradcompress.step.Step.sample`), summed over the ranks (gathered: every
  rank holds the same table and makes the same allocation);
* ``bytes(k, c)``: the codec's payload for the tensor's size (what the exchange sends is proportional to it).

``allocate=adam`` weighs each tensor's errors by ``numel(k) / ||x_k||^2`` (:func:`preconditioned`): Adam divides each
coordinate's update by ``sqrt(v)``, ``v`` the running mean of its squared gradient, so an error ``e`` in the gradient
moves the update by about ``e / sqrt(v)``; the tensor's mean squared gradient (over the ranks, at the sample) stands in
for ``v``. Under SGD a tensor with small gradients adds little error to the update however coarsely it is sent;
under Adam it adds as much as any other, relative to its gradient (the plain allocation starved such tensors).

Solved by its Lagrangian (:func:`allocate`): for a price ``lam`` each tensor independently takes the level minimising
``bytes + lam * err``; ``lam`` is bisected to the smallest that keeps the error within the budget. An allocation that
would not send fewer bytes than ``int4`` everywhere is not used. Bias: as the codecs' (round to nearest, with error
feedback: their residuals carry the rest).
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Mapping, Sequence

import torch

from ..spec import make

#: the levels a tensor of an int4 bucket may get, and the one whose total error is the budget
LEVELS = ("int8", "int4", "int2")
REFERENCE = "int4"


def errors(sample: Mapping[Hashable, torch.Tensor], keys: Iterable[Hashable]) -> list[float]:
    """This rank's squared error of one round trip of each of :data:`LEVELS` on each tensor ``keys`` of ``sample``,
    flattened key by key (``len(keys) * len(LEVELS)`` numbers)."""
    codecs = [make(spec) for spec in LEVELS]
    out = []
    for key in keys:
        x = sample[key].reshape(-1).float()
        for codec in codecs:
            out.append(float((codec.decode(codec.encode(x)) - x).double().pow(2).sum()))
    return out


def energies(sample: Mapping[Hashable, torch.Tensor], keys: Iterable[Hashable]) -> list[float]:
    """This rank's squared norm of each tensor ``keys`` of ``sample`` (what :func:`preconditioned` divides by)."""
    return [float(sample[key].reshape(-1).double().pow(2).sum()) for key in keys]


def preconditioned(err: torch.Tensor, numels: Sequence[int], energy: torch.Tensor) -> torch.Tensor:
    """``err`` ``[tensors, levels]`` weighed as Adam's update weighs it: each row times ``numel / energy`` (the
    inverse of the tensor's mean squared gradient; ``energy`` summed over the ranks like ``err``). A tensor whose
    gradient is zero everywhere has no error at any level: its weight is 0."""
    numel = torch.as_tensor(numels, dtype=torch.float64)
    energy = energy.double()
    weight = torch.where(energy > 0, numel / energy.clamp_min(1e-300), torch.zeros_like(energy))
    return err.double() * weight[:, None]


def allocate(err: torch.Tensor, nbytes: torch.Tensor, steps: int = 200) -> list[int]:
    """The level (index into :data:`LEVELS`) of each tensor: ``err``/``nbytes`` ``[tensors, levels]``; the fewest
    bytes with the total error within the :data:`REFERENCE` level's (that level everywhere where nothing sends fewer
    bytes)."""
    err, nbytes = err.double(), nbytes.double()
    ref = LEVELS.index(REFERENCE)
    budget = float(err[:, ref].sum())
    uniform = [ref] * err.shape[0]

    def pick(lam: float) -> torch.Tensor:
        return (nbytes + lam * err).argmin(1)

    def total(choice: torch.Tensor) -> float:
        return float(err.gather(1, choice[:, None]).sum())

    lo, hi = 1e-30, 1e30
    if total(pick(hi)) > budget:  # not even the finest levels fit (cannot happen with finer codecs): uniform
        return uniform
    for _ in range(steps):
        mid = (lo * hi) ** 0.5
        lo, hi = (lo, mid) if total(pick(mid)) <= budget else (mid, hi)
    choice = pick(hi)
    if float(nbytes.gather(1, choice[:, None]).sum()) >= float(nbytes[:, ref].sum()):
        return uniform
    return choice.tolist()


def level_bytes(numels: Iterable[int]) -> torch.Tensor:
    """``[tensors, levels]`` payload bytes of each level for tensors of ``numels`` elements."""
    codecs = [make(spec) for spec in LEVELS]
    return torch.tensor([[c.payload_nbytes(n) for c in codecs] for n in numels], dtype=torch.float64)


__all__ = ["LEVELS", "REFERENCE", "allocate", "energies", "errors", "level_bytes", "preconditioned"]
