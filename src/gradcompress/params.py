"""Replicas that start equal: ``broadcast_parameters`` and the check of the first ``synchronize``.

Data-parallel training averages gradients, so every rank must hold the same parameters from the start.
``DistributedDataParallel`` broadcasts them when it wraps the model; a custom loop (``Compressor.synchronize``,
Horovod style) does not, so::

    model = Net()
    gradcompress.broadcast_parameters(model)        # rank 0's parameters and buffers on every rank
    compressor = gradcompress.Compressor("topk:ratio=0.01")

The first ``synchronize`` of a Compressor checks it once (:func:`check_same_parameters`: one all-gather of a few
float64 sums per rank, not counted in ``wire_bytes``) and raises on every rank when the replicas differ.
Below the Compressor: :meth:`gradcompress.Compressor.synchronize` uses this module.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
import torch.distributed as dist

#: relative tolerance of the checksum comparison (float64 sums of the same values in another order differ by
#: about 1e-15 of the sum of magnitudes; replicas that differ at all differ by far more than this, in practice)
CHECK_RTOL = 1e-10


def _require_initialised(who: str) -> None:
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError(f"gradcompress.{who}: torch.distributed is not initialised; call "
                           "torch.distributed.init_process_group(...) first (or launch with torchrun)")


def _tensors_of(model_or_params: torch.nn.Module | Iterable[torch.Tensor]) -> list[torch.Tensor]:
    """Parameters (and, for a module, buffers) to broadcast, in a fixed order."""
    if isinstance(model_or_params, torch.nn.parallel.DistributedDataParallel):
        model_or_params = model_or_params.module
    if isinstance(model_or_params, torch.nn.Module):
        return list(model_or_params.parameters()) + list(model_or_params.buffers())
    if isinstance(model_or_params, torch.Tensor):
        raise TypeError("gradcompress.broadcast_parameters: pass a torch.nn.Module or an iterable of parameters "
                        "(e.g. model.parameters()), got a single tensor; wrap it in a list")
    tensors = list(model_or_params)
    for t in tensors:
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"gradcompress.broadcast_parameters: pass a torch.nn.Module or an iterable of "
                            f"parameters (tensors), got an element of type {type(t).__name__}")
    return tensors


@torch.no_grad()
def broadcast_parameters(model_or_params: torch.nn.Module | Iterable[torch.Tensor], src: int = 0,
                         process_group: dist.ProcessGroup | None = None) -> None:
    """Copy rank ``src``'s parameters (and buffers, for an ``nn.Module``) to every rank of ``process_group``.

    Call it on every rank after building the model and before the first step of a custom loop
    (``Compressor.synchronize``; Horovod's ``broadcast_parameters``); ``DistributedDataParallel`` does it itself
    when it wraps the model. A collective: every rank calls it with the same model structure. What is sent: each
    tensor whole, in its own dtype (``dist.broadcast``, uncompressed, exact; not counted in ``wire_bytes``).

    Args:
        model_or_params: an ``nn.Module`` (its parameters, then its buffers; a ``DistributedDataParallel`` model:
            its ``module``'s) or an iterable of tensors (``model.parameters()``), in the same order on every rank.
        src: the rank whose values every rank receives, a rank of ``process_group`` (0 to its size - 1;
            default 0).
        process_group: the group to broadcast over (default None: the world).

    Returns:
        None; the tensors are overwritten in place on every rank but ``src``.

    Raises:
        RuntimeError: ``torch.distributed`` is not initialised.
        TypeError: a single tensor, or an iterable with something that is not a tensor.
        ValueError: ``src`` is not a rank of the group.

    Example::

        >>> import torch, torch.distributed as dist, gradcompress
        >>> dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        >>> model = torch.nn.Linear(4, 2)
        >>> gradcompress.broadcast_parameters(model)   # rank 0's weights on every rank
        >>> dist.destroy_process_group()
    """
    _require_initialised("broadcast_parameters")
    tensors = _tensors_of(model_or_params)
    world = dist.get_world_size(process_group)
    if isinstance(src, bool) or not isinstance(src, int) or not 0 <= src < world:
        raise ValueError(f"gradcompress.broadcast_parameters: src must be a rank of the group, 0 to {world - 1}, "
                         f"got {src!r}")
    root = dist.get_global_rank(process_group, src) if process_group is not None else src
    for t in tensors:
        dist.broadcast(t.data, src=root, group=process_group)


def _checksum(params: list[torch.Tensor]) -> torch.Tensor:
    """(element count, sum, sum of squares, sum of magnitudes) of every parameter, in float64."""
    device = params[0].device
    out = torch.zeros(4, dtype=torch.float64, device=device)
    out[0] = float(sum(p.numel() for p in params))
    for p in params:
        x = p.detach().to(device=device, dtype=torch.float64).reshape(-1)
        out[1:] += torch.stack([x.sum(), (x * x).sum(), x.abs().sum()])
    return out


def _close(a: float, b: float, scale: float) -> bool:
    """Equal up to :data:`CHECK_RTOL` of ``scale`` (equal infinities and NaN on both sides count as equal)."""
    return a == b or (math.isnan(a) and math.isnan(b)) or abs(a - b) <= CHECK_RTOL * scale


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Two ranks' checksums agree: the same count, sums within tolerance of their magnitudes."""
    x: list[float] = a.tolist()
    y: list[float] = b.tolist()
    magnitude, squares = max(abs(x[3]), abs(y[3])), max(abs(x[2]), abs(y[2]))
    return x[0] == y[0] and _close(x[1], y[1], magnitude) and _close(x[2], y[2], squares) \
        and _close(x[3], y[3], magnitude)


def check_same_parameters(params: Iterable[torch.Tensor], process_group: dist.ProcessGroup | None = None) -> None:
    """Raise ``RuntimeError`` on every rank when the ranks' ``params`` differ (a checksum, one all-gather).

    Every rank gathers every rank's checksum, so every rank reaches the same verdict.
    """
    params = list(params)
    world = dist.get_world_size(process_group)
    if world == 1 or not params:
        return
    mine = _checksum(params)
    sums = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(sums, mine, group=process_group)
    for rank, other in enumerate(sums[1:], start=1):
        if not _same(sums[0], other):
            raise RuntimeError(
                f"gradcompress: the parameters differ across ranks (rank 0: {_describe(sums[0])}; rank {rank}: "
                f"{_describe(other)}); data-parallel replicas must start equal: call "
                "gradcompress.broadcast_parameters(model) on every rank after building the model (or seed every "
                "rank the same), before the first synchronize")


def _describe(checksum: torch.Tensor) -> str:
    n, total, squares, _ = (float(v) for v in checksum)
    return f"{int(n)} elements, sum {total:.17g}, sum of squares {squares:.17g}"


__all__ = ["broadcast_parameters", "check_same_parameters"]
