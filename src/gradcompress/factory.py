"""The one scheme factory: what a scheme becomes on a model — the model as the forward pass runs it, the optimizer
that steps it and the Compressor that averages its gradients.

:func:`build` is the only place that turns a scheme (:func:`gradcompress.scheme.parse_scheme`) into objects;
``gradcompress demo`` and ``train`` (:mod:`gradcompress.cli.task`) and the netbench runner
(:mod:`gradcompress.testbed.netbench`, DDP and FSDP, hosts and nodes) all call it. What a scheme does not say — the
optimizer, the Compressor options a runner sets (warm-up, seed, ...), FSDP or HSDP, the modules to shard — is the
:class:`Run`. By the scheme's kind:

* ``decoupled``: the bare model (every replica starts from rank 0's), DeMo, no Compressor (DeMo exchanges itself);
* ``onebitadam``, ``CODEC,compressed_adam=true``: likewise with CompressedAdam;
* ``CODEC:diloco=H``: the bare model, DiLoCo over ``run.optimizer`` (``inner=muon``: ``run.muon``), DiLoCo's Compressor;
* ``CODEC`` with ``run.fsdp``: the model sharded with FSDP2 (HSDP with ``run.per_node``), ``run.optimizer`` over
  the sharded parameters, the Compressor of ``register_fsdp``;
* ``CODEC``: DistributedDataParallel with our hook (``register_ddp_hook``), ``run.optimizer``, that Compressor;
* ``ddp``, ``torch-fp16``, ``torch-powersgd``: DistributedDataParallel with PyTorch's hook (powerSGD_hook with one
  bucket), ``run.optimizer``, no Compressor;
* None (a runner's uncompressed baseline): DistributedDataParallel, or with ``run.fsdp`` the model sharded (FSDP2's
  own HSDP with ``run.per_node``), ``run.optimizer``, no Compressor.

The process group must be initialised. Library level: imports nothing from :mod:`gradcompress.cli`.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any, cast
from collections.abc import Callable, Iterable, Mapping

import torch
import torch.distributed as dist
import torch.nn as nn

from .adapters.ddp import register_ddp_hook
from .adapters.fsdp import register_fsdp
from .compressor import Compressor
from .optim import CompressedAdam, DeMo, DiLoCo, muon
from .scheme import AUTO, DECOUPLED, ONEBITADAM, Scheme, diloco_options

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

#: Compressor options that do not apply under FSDP (``register_fsdp`` compresses each group's buffer whole and keeps
#: no telemetry); a runner's options may carry them for DDP
NOT_FSDP_OPTIONS = ("min_numel", "monitor_every")
#: PyTorch's powerSGD_hook starts compressing at this step at the earliest (DDP rebuilds its buckets after step 1)
POWERSGD_FIRST_STEP = 2


@dataclasses.dataclass(frozen=True)
class Run:
    """How a runner runs every scheme: what the scheme itself does not say.

    Args:
        optimizer: parameters -> the plain optimizer (DiLoCo's inner one); called after the model is wrapped or
            sharded, so under FSDP it gets the sharded parameters.
        options: the Compressor's keywords, the scheme's own options included (``warmup_steps``, ``seed``,
            ``error_feedback``, ...); DiLoCo takes its ``seed`` and ``error_feedback`` from here.
        exchanging: the keywords of an optimizer that exchanges itself (DeMo for ``decoupled``, CompressedAdam for
            ``onebitadam`` and ``compressed_adam=true``), the scheme's own options included.
        fsdp: shard the model with FSDP2 instead of wrapping it in DDP.
        per_node: with ``fsdp``, HSDP: sharded inside nodes of this many consecutive ranks, replicated across them
            (compressed: the replicas' all-reduce through the codec); 0: FSDP over every rank.
        params: with ``fsdp``, ``register_fsdp``'s ``params=`` (the parameter all-gathers compressed).
        shard_units: with ``fsdp``, model -> the modules sharded before the root (default: every module that holds
            parameters of its own).
        device: where the model lives (DDP's ``device_ids`` on CUDA; the HSDP mesh's device type).
        muon: model -> the inner optimizer of ``inner=muon`` (default: :func:`gradcompress.optim.muon` with its
            defaults); a runner passes its own learning rate and weight decay.
    """

    optimizer: Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer]
    options: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    exchanging: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    fsdp: bool = False
    per_node: int = 0
    params: str | None = None
    shard_units: Callable[[nn.Module], list[nn.Module]] | None = None
    device: torch.device = torch.device("cpu")
    muon: Callable[[nn.Module], torch.optim.Optimizer] | None = None


def build(scheme: Scheme | None, model: nn.Module, run: Run) -> tuple[nn.Module, Any, Compressor | None]:
    """(the model to run the forward pass on, the optimizer to step, the Compressor or None) for ``scheme`` on
    ``model`` (see the module docstring's table); ``scheme`` None: the plain layout, uncompressed."""
    if scheme is not None and (scheme.kind in (DECOUPLED, ONEBITADAM) or scheme.compressed_adam):
        return _exchanging(scheme, model, run)
    if scheme is not None and scheme.diloco:
        return _diloco(scheme, model, run)
    if run.fsdp:
        return _sharded(scheme, model, run)
    return _ddp(scheme, model, run)


def _exchanging(scheme: Scheme, model: nn.Module, run: Run) -> tuple[nn.Module, Any, Compressor | None]:
    """An optimizer that averages what it needs itself: the bare model, every replica starting from rank 0's."""
    for p in model.parameters():  # identical start everywhere (already so by the seed)
        dist.broadcast(p.data, src=0)
    kind = DeMo if scheme.kind == DECOUPLED else CompressedAdam
    return model, kind(model.parameters(), **run.exchanging), None


def _diloco(scheme: Scheme, model: nn.Module, run: Run) -> tuple[nn.Module, Any, Compressor | None]:
    """DiLoCo: H local steps of ``run.optimizer`` on the bare model, the outer gradient through the codec."""
    inner = (run.muon or muon)(model) if scheme.inner == "muon" else run.optimizer(model.parameters())
    opt = DiLoCo(model, inner, sync_every=cast(int, scheme.diloco), seed=run.options.get("seed", 0),
                 **diloco_options(scheme, run.options.get("error_feedback", "auto")))
    return model, opt, opt.compressor


def _sharded(scheme: Scheme | None, model: nn.Module, run: Run) -> tuple[nn.Module, Any, Compressor | None]:
    """FSDP2: ``fully_shard`` every shard unit, then the root; compressed unless ``scheme`` is None. HSDP
    (``run.per_node``): compressed, the model sharded over the node's mesh and the replicas' all-reduce through the
    codec; uncompressed, FSDP2's own HSDP over the 2-D mesh."""
    from torch.distributed.fsdp import fully_shard

    mesh = _hsdp_mesh(run) if run.per_node else None
    # fully_shard's own default mesh is None (every rank) where there is no HSDP mesh
    over = None if mesh is None else (mesh if scheme is None else mesh["shard"])
    for unit in (run.shard_units or units_with_parameters)(model):
        fully_shard(unit, mesh=over)
    fully_shard(model, mesh=over)
    compressor = None
    if scheme is not None:
        options = {k: v for k, v in run.options.items()
                   if k not in NOT_FSDP_OPTIONS and not (mesh is not None and k == "topology")}
        spec = scheme.text if scheme.kind == AUTO else scheme.codec
        compressor = register_fsdp(model, spec, mesh=mesh, params=run.params, **options)
    return model, run.optimizer(model.parameters()), compressor


def _hsdp_mesh(run: Run) -> DeviceMesh:
    """The 2-D mesh of HSDP: dim 0 ``replicate`` (the nodes), dim 1 ``shard`` (the ``run.per_node`` ranks of a node)."""
    from torch.distributed.device_mesh import init_device_mesh

    world = dist.get_world_size()
    return init_device_mesh(run.device.type, (world // run.per_node, run.per_node),
                            mesh_dim_names=("replicate", "shard"))


def units_with_parameters(model: nn.Module) -> list[nn.Module]:
    """The modules below the root that hold parameters of their own (FSDP's default shard units here)."""
    return [m for m in list(model.modules())[1:] if any(True for _ in m.parameters(recurse=False))]


def _ddp(scheme: Scheme | None, model: nn.Module, run: Run) -> tuple[nn.Module, Any, Compressor | None]:
    """DistributedDataParallel with the scheme's hook: ours for a codec, PyTorch's for its baselines (powerSGD_hook
    with one bucket: with several it deadlocks on gloo), none for ``ddp`` or no scheme."""
    kind = "ddp" if scheme is None else scheme.kind
    cap_mb = one_bucket_mb(model) if kind == "torch-powersgd" else None
    ids = [run.device.index] if run.device.type == "cuda" else None
    ddp = nn.parallel.DistributedDataParallel(model, device_ids=ids, bucket_cap_mb=cap_mb)
    compressor = None
    if kind == "torch-fp16":
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

        ddp.register_comm_hook(None, default_hooks.fp16_compress_hook)
    elif kind == "torch-powersgd":
        from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook

        first = max(POWERSGD_FIRST_STEP, run.options.get("warmup_steps", 0))
        rank = cast(Scheme, scheme).rank  # a scheme: its kind is not "ddp"
        state = powerSGD_hook.PowerSGDState(process_group=None, matrix_approximation_rank=rank,
                                            start_powerSGD_iter=first)
        ddp.register_comm_hook(state, powerSGD_hook.powerSGD_hook)
    elif kind in ("ours", AUTO):
        ours = cast(Scheme, scheme)  # a scheme: its kind is not "ddp"
        compressor = register_ddp_hook(ddp, ours.text if kind == AUTO else ours.codec, **run.options)
    return ddp, run.optimizer(model.parameters()), compressor


def one_bucket_mb(model: nn.Module) -> int:
    """A DDP ``bucket_cap_mb`` larger than the model's float32 gradients: one bucket."""
    return int(sum(4 * p.numel() for p in model.parameters()) / 2**20) + 2


__all__ = ["NOT_FSDP_OPTIONS", "Run", "build", "diloco_options", "one_bucket_mb", "units_with_parameters"]
