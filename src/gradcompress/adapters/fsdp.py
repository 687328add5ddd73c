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
FSDP hands over flat dim-0 shards; it is refused at registration.

HSDP, compressed (``register_fsdp(model, spec, replicate_group=group)`` or ``mesh=`` a 2-D mesh): the model is
sharded with ``fully_shard`` over the node's own 1-D mesh (``mesh["shard"]``) and ``group`` is the process group
of the same shard on every node (``mesh.get_group("replicate")``). FSDP's reduce-scatter inside the node stays its
own (dense, or its ``reduce_dtype``); the all-reduce of each shard across the replicas — the slow link — is the
codec's (:class:`ReplicaAllReduce` on ``set_all_reduce_hook``, :mod:`gradcompress.exchanges.replicas`), with worker
error feedback on the shard (the residual is 1/G of a gradient) and server error feedback where the codec
re-quantises. A model sharded natively over a 2-D mesh is refused with the recipe: FSDP's own dense all-reduce of
the replicas would run first, and ``set_requires_all_reduce(False)`` would skip the hook too.

HSDP under torchft (``register_fsdp(model, spec, mesh=mesh, manager=manager)``): each replica group shards the
model over its own 1-D mesh (a normal process group inside the group, FSDP's reduce-scatter its own); each shard's
all-reduce across the replica groups is the codec's on the Manager's quorum (:func:`gradcompress.quorum.under`:
divided by the participants, committed when ``should_commit()`` agrees, a healing group silent; each group rank has
its own Manager, as torchft wants). torchft heals a restarted group rank from a peer's state: register the local
shards (``p.to_local()`` of the sharded parameters) with its Manager.

Parameters (``params="int8"`` or ``"bf16"``, default None: exact): the all-gathers of the parameters go through
:class:`gradcompress.adapters.fsdp_params.CompressedAllGather`; ``stats()["param_bytes"]`` counts them.

Several nodes (``register_fsdp(model, spec, topology=G)``, or ``"auto"`` under torchrun): when the reduce-scatter's
group spans 2 or more nodes of 2 or more workers each, it is dense inside the node and compressed between
(:class:`gradcompress.exchanges.reduce_scatter.HierarchicalReduceScatter`): each worker compresses 1/G of the buffer
(its node's sum of the chunks of its local rank's peers), and its residual is that 1/G.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..codecs.base import Aggregation
from ..collectives import finish
from ..compressor import FSDP_KEY_PREFIX, Compressor
from ..quorum import under
from ..topology import Topology
from .fsdp_params import CompressedAllGather, param_codec

from torch.distributed.tensor import DTensor

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
        """Reduce-scatter ``input_tensor`` into ``output_tensor`` through the compressor's step. ``async_op=True``:
        the first round is issued now and the returned ``Work``'s ``wait()`` completes it (so is the step's end,
        whichever comes first); else it completes before returning (None)."""
        comp = self.compressor
        if comp.process_group is None:
            comp.bind(group)
        step, end_now = _backward_step(comp)
        with step.guarded(end=end_now):
            if dist.get_world_size(group) != step.comm.world:
                raise ValueError("gradcompress FSDP: the reduce-scatter group differs from the Compressor's "
                                 "process group")
            job = step.reduce_scatter(self.key, input_tensor, output_tensor, _scale(op, step.comm.world))
            if async_op and not end_now:
                return _LaunchedWork(step, step.launch(job))
            step.drive([job])
        return _LaunchedWork(step, None) if async_op else None


class _LaunchedWork(dist.Work):
    """The ``Work`` of a launched reduce-scatter (``running``; None: already complete): ``wait()`` drives it to
    completion (the same order on every rank: FSDP waits in program order)."""

    def __init__(self, step, running):
        super().__init__()
        self.step, self.running = step, running

    def wait(self, timeout=None) -> bool:
        if not self.is_completed():
            with self.step.guarded(end=False):
                finish([self.running], self.step.comm)
        return True

    def is_completed(self) -> bool:
        return self.running is None or self.running.works is None


class ReplicaAllReduce:
    """FSDP2's all-reduce hook (``set_all_reduce_hook``) of a model sharded over its node: the reduce-scatter's
    output (this rank's shard, the node's mean) becomes its mean over the replicas, through a Compressor step on
    the replicate group (:meth:`gradcompress.step.Step.all_reduce_shard`)."""

    def __init__(self, compressor: Compressor, key: str):
        self.compressor = compressor
        self.key = key

    def __call__(self, output: torch.Tensor) -> None:
        step, end_now = _backward_step(self.compressor)
        with step.guarded(end=end_now):
            step.drive([step.all_reduce_shard(self.key, output)])


def _backward_step(comp: Compressor):
    """(the compressor's step of this backward pass, True if the caller must end it itself): the open step, or a
    new one that ends when autograd finishes the backward."""
    step = comp.current_step
    if step is not None:
        return step, False
    step = comp.begin_step()
    return step, not _end_after_backward(step)


def _end_after_backward(step) -> bool:
    """Queue ``step.end()`` for when autograd finishes the current backward (after FSDP's own final
    callback, queued earlier, which may still reduce-scatter). False outside a backward pass."""
    def end():
        if step.open:
            step.finish()  # drives what was launched (async reduce-scatters not waited for), then ends

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


def register_fsdp(model: torch.nn.Module, spec, *, replicate_group=None, mesh=None, params=None, manager=None,
                  **options) -> Compressor:
    """One line for FSDP2: ``compressor = gradcompress.register_fsdp(model, "int8")``.

    Installs a compressed reduce-scatter on every FSDP module inside ``model`` (``model``
    itself included), each parameter group with its own state, and returns the
    :class:`gradcompress.Compressor` (``stats()``, ``state_dict()``, ``load_state_dict()``).
    ``options`` are the Compressor's (``error_feedback="auto"``, ``momentum``,
    ``warmup_steps``, ``seed``, ``residual_dtype``, ...) except ``min_numel``, which does not
    apply (a group's buffer is compressed whole) and is refused.

    ``replicate_group``: HSDP, compressed (module doc): ``model`` sharded over its node's 1-D mesh, ``group`` the
    process group of the same shard on every node; FSDP's reduce-scatter stays its own and the replicas' all-reduce
    is compressed. ``mesh``: the same from a 2-D ``DeviceMesh`` (dim 0 replicate, dim 1 shard; the model sharded
    over ``mesh[1]``). ``params``: ``"int8"`` or ``"bf16"`` compresses the parameters' all-gathers
    (:mod:`gradcompress.adapters.fsdp_params`: the sharded parameters stay exact); None (default) leaves them exact.
    ``manager``: HSDP under torchft (:func:`_managed_options`): the replicate dimension is the Manager's quorum.
    """
    if FSDPModule is None:
        raise RuntimeError("gradcompress.register_fsdp needs torch.distributed.fsdp.fully_shard (FSDP2)")
    if "min_numel" in options:
        raise ValueError("gradcompress FSDP: min_numel does not apply: FSDP hands over each parameter group's "
                         "gradients as one flat buffer, which is compressed whole")
    gather_codec = param_codec(params)
    modules = _fsdp_modules(model)
    if manager is not None:
        groups, options = None, _managed_options(model, manager, replicate_group, mesh, options)
    else:
        groups = _hsdp_groups(model, replicate_group, mesh, options)
    if groups is not None:
        options = {**options, "process_group": groups[1], "topology": Topology.of_groups(*groups)}
    compressor = Compressor(spec, **options)
    check_codec(compressor.codec)
    for name, module in modules:
        key = f"{FSDP_KEY_PREFIX}{name}"
        if groups is None and manager is None:
            module.set_custom_reduce_scatter(CompressedReduceScatter(compressor, key))
        else:
            module.set_all_reduce_hook(ReplicaAllReduce(compressor, key))
        if gather_codec is not None:
            module.set_custom_all_gather(CompressedAllGather(gather_codec, compressor.count_param_bytes))
    return compressor


def _mesh_of(model):
    """The DeviceMesh ``model``'s parameters are sharded over."""
    for p in model.parameters():
        if isinstance(p, DTensor):  # every parameter fully_shard manages
            return p.device_mesh
    raise NotShardedError("gradcompress FSDP: the model has no sharded parameters")


def _ranks(group) -> list[int]:
    return dist.get_process_group_ranks(group)


def _managed_options(model, manager, replicate_group, mesh, options) -> dict:
    """Compressed HSDP under torchft: ``model`` sharded over its replica group's own 1-D mesh (a normal process
    group inside the group, FSDP's reduce-scatter its own); each shard's all-reduce across the replica groups goes
    through the codec on the Manager's quorum (:func:`gradcompress.quorum.under`: divisor the participants, the
    commit the Manager's, a healing group silent). The Compressor's options with that coordinator; ``ValueError``
    for what does not apply."""
    if replicate_group is not None:
        raise ValueError("gradcompress FSDP: under torchft (manager=...) the replicate dimension is the Manager's "
                         "quorum: replicate_group= does not apply")
    for name in ("topology", "process_group", "coordinator"):
        if name in options:
            raise ValueError(f"gradcompress FSDP: under torchft (manager=...) {name}= does not apply: the replicas "
                             "are the Manager's quorum")
    own = _mesh_of(model)
    if own.ndim != 1 or (mesh is not None and (mesh.ndim != 1 or _ranks(mesh.get_group()) != _ranks(own.get_group()))):
        raise ValueError("gradcompress FSDP: under torchft (manager=...) shard the model over its replica group's "
                         "own 1-D mesh (fully_shard(..., mesh=mesh)) and pass that mesh or none: the replicate "
                         "dimension is the Manager's quorum")
    state_key = options.pop("state_key", None)
    return {**options, "topology": "flat", "coordinator": under(manager, state_key=state_key)}


def _hsdp_groups(model, replicate_group, mesh, options):
    """(shard group, replicate group) of compressed HSDP, or None without ``replicate_group``/``mesh``;
    ``ValueError`` naming the fix for a layout it cannot compress."""
    if replicate_group is None and mesh is None:
        return None
    if replicate_group is not None and mesh is not None:
        raise ValueError("gradcompress FSDP: pass replicate_group= or mesh=, not both")
    for name in ("topology", "process_group"):
        if name in options:
            raise ValueError(f"gradcompress FSDP: {name}= does not combine with HSDP's replicate_group=/mesh=, "
                             "which give the layout (shard group inside the node, replicate group between)")
    own = _mesh_of(model)
    if own.ndim != 1:
        raise ValueError(
            "gradcompress FSDP: the model is sharded over a 2-D mesh (FSDP's native HSDP), whose replica all-reduce "
            "FSDP runs itself, dense; to compress it, shard over the node's mesh and pass the 2-D mesh here: "
            "fully_shard(..., mesh=mesh['shard']); gradcompress.register_fsdp(model, spec, mesh=mesh)")
    if mesh is not None:
        if mesh.ndim != 2:
            raise ValueError(f"gradcompress FSDP: mesh= must be a 2-D DeviceMesh (replicate, shard), got {mesh.ndim}-D")
        replicate_group = mesh.get_group(0)
        if _ranks(mesh.get_group(1)) != _ranks(own.get_group()):
            raise ValueError("gradcompress FSDP: the model is not sharded over mesh= 's shard dimension (dim 1); "
                             "shard it with fully_shard(..., mesh=mesh['shard'])")
    shard_group = own.get_group()
    if set(_ranks(shard_group)) & set(_ranks(replicate_group)) != {dist.get_rank()}:
        raise ValueError("gradcompress FSDP: replicate_group must hold this rank and, of its shard group (the mesh "
                         "the model is sharded over), only this rank: the same shard on every node")
    return shard_group, replicate_group


__all__ = ["CompressedReduceScatter", "NotShardedError", "ReplicaAllReduce", "check_codec", "register_fsdp"]
