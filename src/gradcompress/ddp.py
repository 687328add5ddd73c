"""The DistributedDataParallel communication-hook adapter.

``register_ddp_hook(model, "int8")`` or ``Compressor(...).register(model)`` installs
:func:`hook` with the Compressor as its state. For each bucket DDP hands over, the
hook encodes the bucket's gradients parameter by parameter and issues the first round
of collectives asynchronously, so communication overlaps with the rest of the backward
pass; at the last bucket it drives every bucket's remaining rounds in bucket order and
completes the futures. All collectives are issued from the thread that runs the hook,
in the same order on every rank, whatever the number of buckets.

Lightning: ``DDPStrategy(ddp_comm_hook=compressor)`` (a Compressor is itself a valid hook).
State is keyed by parameter position when the Compressor knows the model
(``register`` or ``index_parameters``); otherwise by the order in which DDP's first
iteration hands parameters over, which is the same on every rank and in every run of
the same model (DDP's first buckets follow the model definition), so checkpoints
still resume exactly.
"""

import torch
import torch.distributed as dist

from . import exchange
from .compressor import Compressor


def hook(compressor: Compressor, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP comm hook: ``ddp_model.register_comm_hook(compressor, hook)``."""
    fut = torch.futures.Future()
    try:
        if not compressor._inflight:
            compressor._begin()
        keys = []
        for p in bucket.parameters():
            if id(p) not in compressor._key_of:  # not indexed up front: first-encounter order, which
                compressor._key_of[id(p)] = len(compressor._key_of)  # DDP's first iteration fixes
            keys.append(compressor._key_of[id(p)])
        buffer = bucket.buffer()
        job = compressor._group_job(keys, list(bucket.gradients()), buffer)
        compressor._inflight.append((exchange.start(compressor._timed(job)), fut, buffer))
        if bucket.is_last():
            inflight = compressor._inflight
            exchange.drive([job for job, _, _ in inflight], compressor._comm)
            compressor._inflight = []
            compressor._end()
            for _, f, buf in inflight:
                f.set_result(buf)
    except BaseException as err:
        for _, f, _ in compressor._inflight:
            if not f.done():
                f.set_exception(err)
        compressor._abort()
        raise
    return fut


def register_ddp_hook(ddp_model, spec, **options) -> Compressor:
    """One line: ``compressor = register_ddp_hook(ddp_model, "powersgd:rank=2", warmup_steps=10)``.

    Builds a :class:`Compressor` with ``options`` and installs it as ``ddp_model``'s hook.
    """
    return Compressor(spec, **options).register(ddp_model)
