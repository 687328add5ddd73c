"""gradcompress under torchtitan's fault-tolerant trainer (``torchtitan/experiments/torchft``).

::

    TORCHFT_LIGHTHOUSE=http://HOST:PORT torchrun --nproc_per_node G -m torchtitan.train \\
        --module gradcompress.integrations.torchtitan --config llama3_torchft_debugmodel \\
        --fault_tolerance.enable --fault_tolerance.replica_id K --fault_tolerance.group_size R \\
        --gradcompress.scheme int8

one torchrun per replica group (K = 0 .. R-1). torchtitan's ``FaultTolerantTrainer`` builds one torchft ``Manager``
per process (``experiments/torchft/manager.py``, ``TorchFTManager``) and shards the model with FSDP over the
group's own 1-D mesh. What gradcompress changes there (:class:`GradcompressMixin` calls :func:`prepare_trainer` from the
trainer's ``init_distributed``, then :func:`attach_state` at the end of its construction):

* a codec spec: :func:`gradcompress.register_fsdp` with ``manager=`` replaces torchtitan's cross-group all-reduce
  hook (``TorchFTManager.maybe_set_all_reduce_hook``): each shard's all-reduce across the replica groups is the
  codec's on the Manager's quorum, divided by the live groups, committed when torchft's optimizer wrapper
  (``TorchFTOptimizersContainer``) agrees;
* a DiLoCo spec: :class:`gradcompress.optim.DiLoCo` with ``manager=`` syncs across the replica groups, in place of
  torchtitan's ``semi_sync_method``; the per-step quorum, the all-reduce hook and the cross-group loss all-reduce
  of torchtitan's FT trainer are switched off (``TorchFTManager.use_async_quorum`` read as False, as torchtitan
  does for its own semi-sync methods), each sync starts its own quorum.

A restarted group heals from a live peer (torchft's Manager): gradcompress's own state (the compressor's, DiLoCo's
anchors, outer state and counters) and, unless torchtitan's checkpointer already gives the Manager its state
(``--checkpoint.enable``), what :func:`attach_state` registers: the trainer's step and token count, the
learning-rate schedulers, and with a codec the local parameter shards and the optimizer's state.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from ...spec import Scheme, is_auto

#: the ``config_registry`` modules of torchtitan's experiments whose configs this integration exposes too
EXPERIMENT_REGISTRIES = ("torchtitan.experiments.torchft.llama3.config_registry",)
STATE_KEY = "gradcompress.torchtitan"


def section(config: Any) -> Any:
    """The config's ``fault_tolerance`` section, or None (a trainer without torchtitan's torchft experiment)."""
    return getattr(config, "fault_tolerance", None)


def fault_tolerance_enabled(config: Any) -> bool:
    ft = section(config)
    return ft is not None and bool(ft.enable)


def clear_semi_sync(config: Any) -> None:
    """The gradcompress scheme is the semi-sync method here: torchtitan's default (``llama3_torchft_debugmodel``:
    ``diloco``) is cleared; ``--fault_tolerance.semi_sync_method`` on the command line sets it again (with scheme
    none: torchft's own)."""
    ft = section(config)
    if ft is not None:
        ft.semi_sync_method = None


def check_config(spec: str, scheme: Scheme | None, config: Any) -> None:
    """``ValueError`` for a gradcompress scheme that cannot run under torchtitan's FT trainer (parse time)."""
    if not fault_tolerance_enabled(config) or spec == "none":
        return
    ft = section(config)
    if ft.semi_sync_method is not None:
        raise ValueError(f"--gradcompress.scheme {spec!r} replaces torchtitan's --fault_tolerance.semi_sync_method "
                         f"({ft.semi_sync_method!r}): pass one of them (for gradcompress's DiLoCo: a scheme "
                         "int2:diloco=H,...; for torchft's own: --gradcompress.scheme none)")
    if config.parallelism.data_parallel_replicate_degree != 1:
        raise ValueError(f"--gradcompress.scheme {spec!r} under --fault_tolerance.enable: the replicas are the "
                         "torchft replica groups (--fault_tolerance.group_size); keep "
                         "--parallelism.data_parallel_replicate_degree at 1 (each group one FSDP group)")
    if parallelism_degree(config) > 1:
        raise ValueError(f"--gradcompress.scheme {spec!r} under --fault_tolerance.enable: only FSDP inside each "
                         "replica group is supported (no tensor, context, pipeline or expert parallelism)")
    if ft.group_size < 1:
        raise ValueError(f"--gradcompress.scheme {spec!r} under --fault_tolerance.enable: set "
                         "--fault_tolerance.group_size to the number of replica groups")
    if scheme is None and is_auto(spec):
        raise ValueError(f"--gradcompress.scheme {spec!r}: auto measures a fixed group and is not supported under "
                         "torchft; name a codec (int8, int4, ...)")


def parallelism_degree(config: Any) -> int:
    p = config.parallelism
    return (p.tensor_parallel_degree * p.context_parallel_degree * p.pipeline_parallel_degree
            * p.expert_parallel_degree)


def prepare_trainer(trainer: Any, diloco: bool) -> None:
    """Called right after the FT trainer built its ``TorchFTManager`` (``init_distributed``), before the model, the
    optimizers and the all-reduce hook: under DiLoCo the trainer behaves as under torchtitan's own semi-sync
    methods (no per-step quorum in the optimizer wrapper, no all-reduce hook, no cross-group loss all-reduce)."""
    if diloco:
        trainer.ft_manager.use_async_quorum = False


def manager(trainer: Any) -> Any:
    """The trainer's torchft ``Manager``, or None (no FT trainer, or fault tolerance off)."""
    ft = getattr(trainer, "ft_manager", None)
    return ft.manager if ft is not None and ft.enabled else None


def _local(t: Any) -> Any:
    return t.to_local() if isinstance(t, DTensor) else t


def _optimizers(optimizers: Any) -> list[Any]:
    """The torch optimizers of the trainer's ``optimizers`` (torchtitan's container, or one optimizer)."""
    return list(getattr(optimizers, "optimizers", [optimizers]))


def _optimizer_states(optimizers: Any) -> list[dict[int, dict[str, Any]]]:
    """Each optimizer's per-parameter state, the DTensors' local shards (what a peer holds of the same shard)."""
    found = []
    for opt in _optimizers(optimizers):
        index = {id(p): i for i, p in enumerate(p for g in opt.param_groups for p in g["params"])}
        found.append({index[id(p)]: {k: _local(v) for k, v in state.items()} for p, state in opt.state.items()})
    return found


def _load_optimizer_states(optimizers: Any, states: list[dict[int, dict[str, Any]]]) -> None:
    for opt, state in zip(_optimizers(optimizers), states, strict=True):
        params = [p for g in opt.param_groups for p in g["params"]]
        for i, values in state.items():
            own = opt.state[params[i]]
            for k, v in values.items():
                if isinstance(own.get(k), torch.Tensor):
                    _local(own[k]).copy_(v)
                else:
                    own[k] = v


def attach_state(trainer: Any, with_model: bool, log: Callable[[str], None]) -> None:
    """Register with the Manager what a restarted group needs from a live peer, unless torchtitan's checkpointer
    did (``TorchFTCheckpointManager``, with ``--checkpoint.enable``): the trainer's step and token count and the
    learning-rate schedulers; with ``with_model`` (a codec: every step is synchronous) also the local parameter
    shards (the DTensors as they are now, sharded: during a forward FSDP holds unsharded ones) and the optimizers'
    state. Under DiLoCo the parameters come with DiLoCo's anchors and the inner optimizer's state stays each
    group's own."""
    ft = manager(trainer)
    if ft is None or trainer.checkpointer.enable:
        return
    params = [p for part in trainer.model_parts for p in part.parameters()]

    def save() -> dict[str, Any]:
        state: dict[str, Any] = {"train_state": trainer.state_dict(),
                                 "lr_schedulers": trainer.lr_schedulers.state_dict(),
                                 "lrs": [[g["lr"] for g in opt.param_groups] for opt in _optimizers(trainer.optimizers)]}
        if with_model:
            state["params"] = [_local(p).detach() for p in params]
            state["optimizers"] = _optimizer_states(trainer.optimizers)
        return state

    def load(state: dict[str, Any]) -> None:
        trainer.load_state_dict(state["train_state"])
        trainer.lr_schedulers.load_state_dict(state["lr_schedulers"])
        for opt, lrs in zip(_optimizers(trainer.optimizers), state["lrs"], strict=True):
            for group, lr in zip(opt.param_groups, lrs, strict=True):
                group["lr"] = lr  # the schedulers set it at their next step; this step runs at the peer's
        if with_model:
            with torch.no_grad():
                for p, value in zip(params, state["params"], strict=True):
                    _local(p).copy_(value)
            _load_optimizer_states(trainer.optimizers, state["optimizers"])
        log(f"gradcompress: healed from a peer replica group at step {trainer.step}")

    ft.register_state_dict_fn(STATE_KEY, load, save)


__all__ = ["EXPERIMENT_REGISTRIES", "attach_state", "check_config", "clear_semi_sync",
           "fault_tolerance_enabled", "manager", "prepare_trainer", "section"]
