"""DiLoCo from torchtitan's command line: ``--gradcompress.scheme "int2:diloco=100,fragments=4,delay=5,inner=muon"``
with ``--parallelism.data_parallel_replicate_degree R`` (R >= 2).

torchtitan shards the model natively over its 2-D (dp_replicate, fsdp) mesh. :class:`gradcompress.optim.DiLoCo`
takes that model as it is (``gradcompress.optim.diloco_shards``): FSDP then reduce-scatters within each replica
only, and every ``diloco`` steps each rank averages its shards' outer gradients, compressed, with the same shard
of the other replicas. The inner optimizer is torchtitan's own (``--optimizer.*``), or with ``inner=muon``
:func:`gradcompress.optim.muon` at torchtitan's learning rate and weight decay, under torchtitan's learning-rate
schedule. The trainer's ``optimizers`` becomes :class:`DiLoCoOptimizers`: ``step()`` is DiLoCo's. Under
torchtitan's fault-tolerant trainer (``--fault_tolerance.enable``) the replicas are its torchft replica groups and
DiLoCo gets the trainer's torchft ``Manager`` (:mod:`.ft`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from ...optim import DiLoCo, muon
from ...scheme import Scheme, diloco_options


def check_config(scheme: Scheme, config: Any) -> None:
    """``ValueError`` for what DiLoCo cannot run with, known from the command line alone."""
    parallelism = config.parallelism
    under_torchft = bool(getattr(getattr(config, "fault_tolerance", None), "enable", False))
    if parallelism.data_parallel_replicate_degree < 2 and not under_torchft:
        raise ValueError(f"--gradcompress.scheme {scheme.text!r}: DiLoCo syncs replicas: set "
                         "--parallelism.data_parallel_replicate_degree to 2 or more (each replica an FSDP group of "
                         "--parallelism.data_parallel_shard_degree ranks), or run torchtitan's fault-tolerant "
                         "trainer (--fault_tolerance.enable: across its replica groups)")
    if parallelism.pipeline_parallel_degree > 1:
        raise ValueError(f"--gradcompress.scheme {scheme.text!r}: DiLoCo with pipeline parallelism is not supported")
    if config.checkpoint.enable:
        raise ValueError(f"--gradcompress.scheme {scheme.text!r}: DiLoCo's anchors and outer state are not in "
                         "torchtitan's checkpoints yet: run it without --checkpoint.enable")


class DiLoCoOptimizers:
    """The trainer's ``optimizers`` under DiLoCo: ``step()`` is DiLoCo's (the inner step, then the syncs due),
    ``zero_grad()`` the inner optimizer's; anything else is the inner optimizer's."""

    def __init__(self, diloco: DiLoCo, inner: Any) -> None:
        self.diloco, self.inner = diloco, inner

    def step(self, closure: Callable[[], float] | None = None) -> Any:
        return self.diloco.step(closure)

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.diloco.zero_grad(set_to_none=set_to_none)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def inner_optimizer(scheme: Scheme, trainer: Any) -> Any:
    """torchtitan's optimizers, or with ``inner=muon`` a Muon at their first group's learning rate and weight
    decay, the trainer's learning-rate schedulers rebuilt over it."""
    if scheme.inner != "muon":
        return trainer.optimizers
    group = trainer.optimizers.optimizers[0].param_groups[0]
    lr, weight_decay = group.get("initial_lr", group["lr"]), group.get("weight_decay", 0.0)
    inner = muon(trainer.model_parts[0], adamw_lr=lr, weight_decay=weight_decay)
    trainer.lr_schedulers = trainer.config.lr_scheduler.build(optimizers=[inner],
                                                              training_steps=trainer.config.training.steps)
    return inner


def attach(scheme: Scheme, trainer: Any, manager: Any = None) -> DiLoCo:
    """DiLoCo over the trainer's model part, its ``optimizers`` replaced by :class:`DiLoCoOptimizers`;
    ``manager``: torchft's, under torchtitan's fault-tolerant trainer (the syncs across its replica groups)."""
    if len(trainer.model_parts) != 1:
        raise ValueError(f"--gradcompress.scheme {scheme.text!r}: DiLoCo needs one model part, got "
                         f"{len(trainer.model_parts)}")
    inner = inner_optimizer(scheme, trainer)
    diloco = DiLoCo(trainer.model_parts[0], inner, sync_every=int(scheme.diloco or 0),
                    seed=int(trainer.config.debug.seed or 0), manager=manager, **diloco_options(scheme))
    trainer.optimizers = DiLoCoOptimizers(diloco, inner)
    return diloco


def dense_bytes_per_step(model: torch.nn.Module, replicas: int | None = None) -> float:
    """What torchtitan's HSDP sends per step and rank across the R replicas (``replicas``, default the mesh's
    dim 0; under torchft the configured number of replica groups): a ring all-reduce of the rank's float32
    gradient shards, 2(R-1)/R of them (FSDP's reduce-scatter inside the replica aside)."""
    shard = 0
    mesh_replicas = 1
    for p in model.parameters():
        if isinstance(p, DTensor):
            shard += p.to_local().numel() * 4
            mesh_replicas = p.device_mesh.size(0)
        else:
            shard += p.numel() * 4
    replicas = mesh_replicas if replicas is None else replicas
    return shard * 2 * (replicas - 1) / replicas


def sync_wire_bytes(diloco: DiLoCo) -> int:
    """Bytes this rank sent in DiLoCo's outer syncs so far."""
    return sum(c.stats()["wire_bytes"] for c in diloco.compressors)


__all__ = ["DiLoCoOptimizers", "attach", "check_config", "dense_bytes_per_step", "sync_wire_bytes"]
