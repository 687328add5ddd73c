"""What the optimizers that exchange themselves (CompressedAdam/OneBitAdam, DeMo) share: whether
``torch.distributed`` is up, the collectives of their documented single-process mode, and the text of their
configuration that the first step checks is the same on every rank."""

from __future__ import annotations

import torch.distributed as dist

from ..collectives import LocalCollectives


def initialised() -> bool:
    return dist.is_available() and dist.is_initialized()


def local_collectives(who: str, process_group) -> LocalCollectives | None:
    """None (use the process group) when ``torch.distributed`` is initialised; else the single process's
    collectives (the same code, nothing sent), or a ``RuntimeError`` if a ``process_group`` was given."""
    if initialised():
        return None
    if process_group is not None:
        raise RuntimeError(f"{who}: a process_group was given but torch.distributed is not initialised")
    return LocalCollectives(1)


def params_text(params) -> str:
    """Each parameter's shape and dtype, for the configuration check across ranks."""
    return ",".join(f"{tuple(p.shape)}:{str(p.dtype).replace('torch.', '')}" for p in params)


__all__ = ["initialised", "local_collectives", "params_text"]
