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
``stats()["steps"]`` counts backward passes with a reduce-scatter (torchtitan's chunked loss makes two per training
step). State is keyed by the FSDP module's name in ``model`` (``named_modules``), the same on every rank and in
every run of the same model, and by what the buffer holds where a group is reduced in parts or more than once in a
step (:mod:`gradcompress.adapters.fsdp_keys`).

Codecs: every codec but ``powersgd``, which needs each parameter's whole matrix where
FSDP hands over flat dim-0 shards; it is refused at registration.

HSDP, compressed (``register_fsdp(model, spec, replicate_group=group)`` or ``mesh=`` a 2-D mesh): the model is
sharded with ``fully_shard`` over the node's own 1-D mesh (``mesh["shard"]``) and ``group`` is the process group
of the same shard on every node (``mesh.get_group("replicate")``). FSDP's reduce-scatter inside the node stays its
own (dense, or its ``reduce_dtype``); the all-reduce of each shard across the replicas — the slow link — is the
codec's (:class:`ReplicaAllReduce` on ``set_all_reduce_hook``, :mod:`gradcompress.exchanges.replicas`), with worker
error feedback on the shard (the residual is 1/G of a gradient) and server error feedback where the codec
re-quantises. A model sharded natively over a 2-D ``(replicate, shard)`` mesh (FSDP's own HSDP, as torchtitan builds
it) takes ``register_fsdp(model, spec)`` with no mesh: its groups are made to reduce-scatter over the shard dimension
only (:mod:`gradcompress.adapters.fsdp_native`) and the replicas' all-reduce is the codec's, the same exchange as
above; where a gradient divide factor is set (torchtitan: 1.0) the replicas are summed, as FSDP would.

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

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from ..codecs.base import Aggregation
from ..collectives import finish
from ..compressor import FSDP_KEY_PREFIX, Compressor
from ..quorum import under
from ..topology import Topology
from .fsdp_keys import GroupKeys, group_params
from .fsdp_native import reduce_within_shards, replica_scale
from .fsdp_params import CompressedAllGather, param_codec

from torch.distributed.tensor import DTensor

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh
    from torchft.manager import Manager

    from ..codecs.base import Codec
    from ..config import Spec

try:
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.fsdp._fully_shard._fsdp_api import ReduceScatter
except ImportError:  # pragma: no cover - torch without FSDP2
    FSDPModule, ReduceScatter = None, object  # type: ignore[misc,assignment]  # the fallbacks without FSDP2


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

    def __init__(self, compressor: Compressor, key: str, keys: GroupKeys | None = None):
        self.compressor = compressor
        self.key = key
        self.keys = keys or GroupKeys(key, [])

    def allocate(self, size: Sequence[int | torch.SymInt], *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
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
            key = self.keys.key(step, output_tensor.numel())
            job = step.reduce_scatter(key, input_tensor, output_tensor, _scale(op, step.comm.world))
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

    def __init__(self, compressor: Compressor, key: str, keys: GroupKeys | None = None,
                 scale: Callable[[], float] | None = None):
        self.compressor = compressor
        self.key = key
        self.keys = keys or GroupKeys(key, [])
        self.scale = scale  # native HSDP: what the mean is multiplied by (fsdp_native.replica_scale)

    def __call__(self, output: torch.Tensor) -> None:
        step, end_now = _backward_step(self.compressor)
        with step.guarded(end=end_now):
            step.drive([step.all_reduce_shard(self.keys.key(step, output.numel()), output)])
        factor = 1.0 if self.scale is None else self.scale()
        if factor != 1.0:
            output.mul_(factor)


def _backward_step(comp: Compressor):
    """(the compressor's step of this backward pass, True if the caller must end it itself): the open step, or a
    new one that ends when autograd finishes the backward."""
    step = comp.current_step
    if step is not None:
        return step, False
    step = comp.begin_step()
    return step, not _end_after_backward(step)


def _end_after_backward(step) -> bool:
    """Queue ``step.end()`` for when autograd finishes the current backward, after every final callback queued
    during it — FSDP's own, which may still reduce-scatter, may have been queued after ours (a group reduced before
    the root's pre-backward hook ran, e.g. a module called twice): the callback queues itself once more when it first
    runs, behind them. False outside a backward pass."""
    queue = torch.autograd.Variable._execution_engine.queue_callback

    def end():
        if step.open:
            step.finish()  # drives what was launched (async reduce-scatters not waited for), then ends

    try:
        queue(lambda: queue(end))
    except RuntimeError:
        return False
    return True


def check_codec(codec: Codec) -> None:
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


def register_fsdp(model: torch.nn.Module, spec: Spec, *, replicate_group: dist.ProcessGroup | None = None,
                  mesh: DeviceMesh | None = None, params: str | None = None, manager: Manager | None = None,
                  **options: Any) -> Compressor:
    """Compress FSDP2's gradient reduce-scatter: ``compressor = gradcompress.register_fsdp(model, "int8")``.

    Installs a compressed reduce-scatter on every FSDP module inside ``model`` (``model`` included), each parameter
    group with its own state. What is sent: the group's flat gradient buffer with momentum correction and error
    feedback, encoded chunk by chunk (one chunk per rank) and exchanged by all-to-all, (W-1)/W of the compressed
    buffer per rank (``int8``: 1.008 bytes per element against float32's 4); each rank decodes and sums its own
    chunk's W payloads, so the result is not quantised twice. Bias: the codec's (``docs/codecs.md``), carried into
    the next step by error feedback where the codec wants it. HSDP: FSDP's reduce-scatter inside the node stays its
    own, the replicas' all-reduce is the codec's (module docstring; several processes: ``docs/fsdp.md``).

    Args:
        model: an ``nn.Module`` sharded with ``torch.distributed.fsdp.fully_shard``.
        spec: a codec spec (``"int8"``, ``"int4"``, ``"sign"``, ``"topk:ratio=0.01"``, ``"auto"``; not
            ``powersgd``), a dict, or a codec from :func:`gradcompress.make`.
        replicate_group: HSDP: the process group of this rank's shard on every node (default None: no HSDP).
        mesh: HSDP from a 2-D ``DeviceMesh`` (dim 0 replicate, dim 1 shard; ``model`` sharded over ``mesh[1]``).
        params: ``"int8"`` or ``"bf16"`` compresses the parameters' all-gathers; None (default) leaves them exact.
        manager: a torchft ``Manager``: HSDP across replica groups on its quorum (default None).
        **options: the Compressor's (``error_feedback="auto"``, ``momentum``, ``warmup_steps``, ``seed``,
            ``residual_dtype``, ``topology``, ...) but ``min_numel`` (a group's buffer is compressed whole).

    Returns:
        The :class:`gradcompress.Compressor` (``stats()``, ``state_dict()``, ``load_state_dict()``).

    Raises:
        NotShardedError: no FSDP module in ``model`` (a ``TypeError``, and a ``ValueError``).
        ValueError: ``powersgd``, ``min_numel``, a bad spec, option or ``params``, HSDP arguments that do not fit
            the model's sharding (the message says which). RuntimeError: a torch without FSDP2.

    Example::

        >>> import torch, torch.distributed as dist, gradcompress
        >>> from torch.distributed.fsdp import fully_shard
        >>> dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        >>> model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 2))
        >>> _ = [fully_shard(layer) for layer in model]
        >>> compressor = gradcompress.register_fsdp(fully_shard(model), "int8")
        >>> type(compressor).__name__
        'Compressor'
        >>> dist.destroy_process_group()
    """
    if FSDPModule is None:
        raise RuntimeError("gradcompress.register_fsdp needs torch.distributed.fsdp.fully_shard (FSDP2)")
    if "min_numel" in options:
        raise ValueError("gradcompress FSDP: min_numel does not apply: FSDP hands over each parameter group's "
                         "gradients as one flat buffer, which is compressed whole")
    gather_codec, modules = param_codec(params), _fsdp_modules(model)  # in this order: params checked first
    if manager is not None:
        groups, options = None, _managed_options(model, manager, replicate_group, mesh, options)
    else:
        groups = _hsdp_groups(model, replicate_group, mesh, options)
    if groups is not None:
        options = {**options, "process_group": groups[1], "topology": Topology.of_groups(*groups)}
    compressor = Compressor(spec, **options)
    check_codec(compressor.codec)
    _install(model, modules, compressor, groups, manager, gather_codec)
    return compressor


def _install(model, modules, compressor: Compressor, groups, manager, gather_codec) -> None:
    """Each FSDP module's reduce-scatter (HSDP, ``groups`` or ``manager`` given: its replicas' all-reduce) through
    ``compressor``, and its parameters' all-gathers through ``gather_codec`` (None: FSDP's own)."""
    native = groups is not None and _mesh_of(model).ndim == 2
    if native:
        reduce_within_shards([m for _, m in modules])
    names = {id(m): name for name, m in model.named_modules()}
    for name, module in modules:
        key = f"{FSDP_KEY_PREFIX}{name}"
        keys = GroupKeys(key, group_params(module, names))
        if groups is None and manager is None:
            module.set_custom_reduce_scatter(CompressedReduceScatter(compressor, key, keys))
        else:
            scale = replica_scale(module, dist.get_world_size(groups[1])) if native and groups else None
            module.set_all_reduce_hook(ReplicaAllReduce(compressor, key, keys, scale))
        if gather_codec is not None:
            module.set_custom_all_gather(CompressedAllGather(gather_codec, compressor.count_param_bytes))


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
    """(shard group, replicate group) of compressed HSDP, or None without ``replicate_group``/``mesh`` on a model
    sharded over a 1-D mesh; ``ValueError`` naming the fix for a layout it cannot compress."""
    own = _mesh_of(model)
    if own.ndim == 2 and replicate_group is None and (mesh is None or mesh == own):
        for name in ("topology", "process_group"):
            if name in options:
                raise ValueError(f"gradcompress FSDP: {name}= does not combine with a model sharded over a 2-D "
                                 "mesh (native HSDP), whose mesh gives the layout (replicate, shard)")
        return own.get_group(1), own.get_group(0)  # native HSDP (fsdp_native): shard, replicate
    if replicate_group is None and mesh is None:
        return None
    if replicate_group is not None and mesh is not None:
        raise ValueError("gradcompress FSDP: pass replicate_group= or mesh=, not both")
    for name in ("topology", "process_group"):
        if name in options:
            raise ValueError(f"gradcompress FSDP: {name}= does not combine with HSDP's replicate_group=/mesh=, "
                             "which give the layout (shard group inside the node, replicate group between)")
    if own.ndim != 1:
        raise ValueError(
            f"gradcompress FSDP: the model is sharded over a {own.ndim}-D mesh: pass no mesh= or replicate_group= "
            "for a model sharded over a 2-D (replicate, shard) mesh (native HSDP: its own mesh gives the layout), "
            "or shard over the node's mesh and pass the 2-D mesh: fully_shard(..., mesh=mesh['shard']); "
            "gradcompress.register_fsdp(model, spec, mesh=mesh)")
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
