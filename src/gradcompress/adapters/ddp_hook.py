"""The DistributedDataParallel communication hook itself (:mod:`gradcompress.adapters.ddp` builds on it).

``register_ddp_hook(model, "int8")`` or ``register_ddp_hook(model, compressor)`` installs :func:`hook` with the
Compressor as its state (``ddp_model.register_comm_hook(compressor, hook)`` is the same). For each bucket DDP
hands over, the hook opens the step if none is open, asks the step for the bucket's exchange and launches
it (its first round of collectives is issued now, overlapping the rest of the backward
pass); at the last bucket it finishes the step: every bucket's remaining rounds are
driven in bucket order, the step commits or rolls back, and the futures complete. All
collectives are issued from the thread that runs the hook, in the same order on every
rank, whatever the number of buckets.

The Compressor averages over the DDP model's own ``process_group`` (a model built on a
subgroup averages within that subgroup); passing a different ``process_group`` to the
Compressor is refused. State is keyed by parameter position in ``model.parameters()``.
"""

# no ``from __future__ import annotations``: DDP's register_comm_hook reads the hook's ``bucket`` annotation and
# wants the GradBucket class itself
from typing import TYPE_CHECKING, cast

import torch
import torch.distributed as dist

if TYPE_CHECKING:
    from ..compressor import Compressor


def require_ddp(model: object) -> None:
    """``TypeError`` naming what is required, for a model that is not ``DistributedDataParallel``."""
    if not isinstance(model, torch.nn.parallel.DistributedDataParallel):
        raise TypeError(f"gradcompress: register_ddp_hook needs a "
                        f"torch.nn.parallel.DistributedDataParallel model, got {type(model).__name__}; wrap it: "
                        "DistributedDataParallel(model) (after torch.distributed.init_process_group), or, without "
                        "DDP, call compressor.synchronize(model.parameters()) after each backward")


def register(compressor: "Compressor", ddp_model: object) -> "Compressor":
    """Install ``compressor`` as ``ddp_model``'s communication hook, on the DDP model's process group."""
    require_ddp(ddp_model)
    ddp = cast(torch.nn.parallel.DistributedDataParallel, ddp_model)  # require_ddp refused anything else
    compressor.bind(getattr(ddp, "process_group", None))
    compressor.index_parameters(ddp.module.parameters())
    ddp.register_comm_hook(compressor, hook)
    return compressor


def _future(device: torch.device) -> torch.futures.Future:
    """A future for a bucket on ``device``: on CUDA it records the current streams, as DDP expects."""
    if device.type == "cuda":
        return torch.futures.Future(devices=[device])
    return torch.futures.Future()


def hook(compressor: "Compressor", bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP comm hook: ``ddp_model.register_comm_hook(compressor, hook)``."""
    buffer = bucket.buffer()
    fut = _future(buffer.device)
    step = compressor.current_step
    if step is None:
        step = compressor.begin_step()
    with step.guarded(end=False):  # an error aborts the step (every launched bucket's future gets it)
        keys = compressor.keys_for(cast("list[torch.nn.Parameter]", bucket.parameters()))  # the model's
        job = step.exchange(keys, list(bucket.gradients()), buffer)

        def done(err, fut=fut, buffer=buffer):
            if err is None:
                fut.set_result(buffer)
            elif not fut.done():
                fut.set_exception(err)

        step.launch(job, done)
        if bucket.is_last():
            step.finish()
    return fut


__all__ = ["hook", "register", "require_ddp"]
