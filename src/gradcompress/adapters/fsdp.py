"""FSDP2 (``torch.distributed.fsdp.fully_shard``): a compressed reduce-scatter with error feedback.

``register_fsdp(model, "int8")`` installs a :class:`CompressedReduceScatter` on every FSDP
module inside ``model`` (``FSDPModule.set_custom_reduce_scatter``). FSDP2 calls it once
per parameter group per backward with the group's flat gradient buffer: ``world`` chunks
of one shard each (chunk j is rank j's shard of every parameter of the group, padded) and
the op it wants (AVG, SUM with pre/post divide factors, or PREMUL_SUM).

What happens to it (:mod:`gradcompress.exchanges.reduce_scatter`): the whole local buffer
goes through momentum correction and worker error feedback (the residual covers this
rank's unsharded gradient of the group, so it costs one gradient per rank in
``residual_dtype``: float32 by default, ``residual_dtype=torch.bfloat16`` halves it),
is encoded chunk by chunk, the chunks travel by all-to-all (sizes first for
variable-size codecs), and each rank decodes and sums the W payloads of its own chunk
and applies the op. The output is final: no second quantisation. ``wire_bytes`` counts
the all-to-all ((W-1)/W of the compressed buffer) and a 4-byte finiteness flag.

One Compressor step spans one backward pass: it begins at the first reduce-scatter
and ends when autograd finishes the backward (a queued final callback, after FSDP's
own), committing every group's new state only if every rank's gradients were finite.
``stats()["steps"]`` counts backward passes with a reduce-scatter. State is keyed by
the FSDP module's name in ``model`` (``named_modules``), the same on every rank and in
every run of the same model.

Codecs: every codec but ``powersgd``, which needs each parameter's whole matrix where
FSDP hands over flat dim-0 shards; it is refused at registration. HSDP (a 2-D mesh with
replication): only the reduce-scatter is compressed, the replicas' all-reduce of the
reduced shards stays dense (FSDP issues it itself).

Several nodes (``register_fsdp(model, spec, topology=G)``, or ``"auto"`` under torchrun): when the reduce-scatter's
group spans 2 or more nodes of 2 or more workers each, it is dense inside the node and compressed between
(:class:`gradcompress.exchanges.reduce_scatter.HierarchicalReduceScatter`): each worker compresses 1/G of the buffer
(its node's sum of the chunks of its local rank's peers), and its residual is that 1/G.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..codecs.base import Aggregation
from ..compressor import FSDP_KEY_PREFIX, Compressor

try:
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.fsdp._fully_shard._fsdp_api import ReduceScatter
except ImportError:  # pragma: no cover - torch without FSDP2
    FSDPModule, ReduceScatter = None, object


class NotShardedError(TypeError, ValueError):
    """``register_fsdp`` on a model that ``fully_shard`` has not sharded: the wrong kind of model (a
    ``TypeError``; also a ``ValueError``, what earlier versions raised, so existing handlers keep working)."""


def _scale(op, world: int) -> float:
    """The factor FSDP's ``op`` applies to the sum of the ranks' chunks."""
    kind = getattr(op, "op", op)
    if kind == dist.ReduceOp.AVG:
        return 1.0 / world
    if kind == dist.ReduceOp.SUM:
        return 1.0
    if kind == dist.ReduceOp.PREMUL_SUM and getattr(op, "factor", None) is not None:
        return float(op.factor)
    raise ValueError(f"gradcompress FSDP: cannot compress a reduce-scatter with op {op!r}; "
                     "supported: AVG, SUM, PREMUL_SUM with a scalar factor")


class CompressedReduceScatter(ReduceScatter):
    """FSDP2's ``ReduceScatter`` extension point, backed by a :class:`gradcompress.Compressor` step."""

    def __init__(self, compressor: Compressor, key: str):
        self.compressor = compressor
        self.key = key

    def allocate(self, size, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group, op, async_op: bool = False):
        comp = self.compressor
        if comp.process_group is None:
            comp.process_group = group
        step = comp.current_step
        end_now = False
        if step is None:
            step = comp.begin_step()
            end_now = not _end_after_backward(step)
        with step.guarded(end=end_now):
            if dist.get_world_size(group) != step.comm.world:
                raise ValueError("gradcompress FSDP: the reduce-scatter group differs from the Compressor's "
                                 "process group")
            step.drive([step.reduce_scatter(self.key, input_tensor, output_tensor, _scale(op, step.comm.world))])
        return None


def _end_after_backward(step) -> bool:
    """Queue ``step.end()`` for when autograd finishes the current backward (after FSDP's own final
    callback, queued earlier, which may still reduce-scatter). False outside a backward pass."""
    def end():
        if step.open:
            step.end()

    try:
        torch.autograd.Variable._execution_engine.queue_callback(end)
    except RuntimeError:
        return False
    return True


def check_codec(codec) -> None:
    """Raise ``ValueError`` for a codec that cannot compress FSDP's reduce-scatter (PowerSGD)."""
    if codec.aggregation is Aggregation.LOWRANK:
        raise ValueError(f"gradcompress FSDP: {codec.name} cannot compress FSDP's reduce-scatter: it factors each "
                         "parameter's whole matrix, and FSDP2 hands over flat buffers of dim-0 shards of many "
                         "parameters; use it with DDP, or pick another codec for FSDP (int8, int4, sign, topk, ...)")


def _fsdp_modules(model) -> list:
    """(name, module) of every FSDP module in ``model``; a ``TypeError`` for what is not a module, a
    ``ValueError`` naming the fix for a module without FSDP (a plain or a DDP-wrapped model)."""
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"gradcompress.register_fsdp needs a torch.nn.Module sharded with "
                        f"torch.distributed.fsdp.fully_shard, got {type(model).__name__}")
    modules = [(name or "root", m) for name, m in model.named_modules() if isinstance(m, FSDPModule)]
    if not modules:
        hint = (" (a DistributedDataParallel model takes gradcompress.register_ddp_hook instead)"
                if isinstance(model, torch.nn.parallel.DistributedDataParallel) else "")
        raise NotShardedError(f"gradcompress FSDP: no FSDP module in the model ({type(model).__name__}): "
                         f"register_fsdp needs a model sharded with torch.distributed.fsdp.fully_shard; call "
                         f"fully_shard(...) on its layers and on the model first{hint}")
    return modules


def register_fsdp(model: torch.nn.Module, spec, **options) -> Compressor:
    """One line for FSDP2: ``compressor = gradcompress.register_fsdp(model, "int8")``.

    Installs a compressed reduce-scatter on every FSDP module inside ``model`` (``model``
    itself included), each parameter group with its own state, and returns the
    :class:`gradcompress.Compressor` (``stats()``, ``state_dict()``, ``load_state_dict()``).
    ``options`` are the Compressor's (``error_feedback="auto"``, ``momentum``,
    ``warmup_steps``, ``seed``, ``residual_dtype``, ...) except ``min_numel``, which does not
    apply (a group's buffer is compressed whole) and is refused.
    """
    if FSDPModule is None:
        raise RuntimeError("gradcompress.register_fsdp needs torch.distributed.fsdp.fully_shard (FSDP2)")
    if "min_numel" in options:
        raise ValueError("gradcompress FSDP: min_numel does not apply: FSDP hands over each parameter group's "
                         "gradients as one flat buffer, which is compressed whole")
    modules = _fsdp_modules(model)
    compressor = Compressor(spec, **options)
    check_codec(compressor.codec)
    for name, module in modules:
        module.set_custom_reduce_scatter(CompressedReduceScatter(compressor, f"{FSDP_KEY_PREFIX}{name}"))
    return compressor


__all__ = ["CompressedReduceScatter", "NotShardedError", "check_codec", "register_fsdp"]
