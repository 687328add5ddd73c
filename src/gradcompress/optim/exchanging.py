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


def refuse_manager(who: str, manager) -> None:
    """These optimizers exchange inside ``optimizer.step()``, after torchft's ``should_commit()`` has decided the
    step (torchft's ``OptimizerWrapper`` asks it first): a failed exchange could no longer be discarded, so a
    torchft ``manager`` is refused with that reason (DDP with a codec, or DiLoCo, run under torchft)."""
    if manager is not None:
        raise ValueError(f"{who}: not supported under torchft (manager=...): it exchanges inside optimizer.step(), "
                         "after torchft's should_commit() has decided the step, so a failed exchange could not be "
                         "discarded; use gradcompress.integrations.torchft.DistributedDataParallel with a codec, or "
                         "DiLoCo(..., manager=manager)")


def params_text(params) -> str:
    """Each parameter's shape and dtype, for the configuration check across ranks."""
    return ",".join(f"{tuple(p.shape)}:{str(p.dtype).replace('torch.', '')}" for p in params)


__all__ = ["initialised", "local_collectives", "params_text", "refuse_manager"]
