"""``DistributedDataParallel(manager, module, spec)``: torchft's DDP, averaging each bucket with gradcompress.

Like torchft's own ``torchft.ddp.DistributedDataParallel``: DDP is built on a one-rank dummy group (its
construction-time broadcast and bucket bookkeeping stay local; torchft's ``init_sync`` makes the replicas start
equal), with ``find_unused_parameters=True`` so the buckets are never rebuilt (a healed replica's buckets must
match its peers'), and every bucket goes through a communication hook: ours, a
:class:`~.compressor.Compressor` on the Manager's quorum (torchft's own hook is not installed: DDP takes one).
"""

from __future__ import annotations

from torch import nn
from torch.nn import parallel

from ...adapters.ddp_hook import hook
from ...compressor import Compressor as _Core
from .compressor import Compressor


class DistributedDataParallel(parallel.DistributedDataParallel):
    """``module`` under torchft's ``manager``, its gradients averaged over the live replicas with ``spec``
    (a codec spec, or a :class:`~.compressor.Compressor` built on the same manager); ``compressor_options``:
    the Compressor's options (``warmup_steps``, ``error_feedback``, ``seed``...). ``.compressor``: the
    Compressor (``stats()``, ``state_dict()``). Step the optimizer only when ``manager.should_commit()`` agrees
    (torchft's ``OptimizerWrapper`` does that)."""

    def __init__(self, manager, module: nn.Module, spec="none", **compressor_options):
        from torchft.process_group import ProcessGroupDummy

        super().__init__(module, process_group=ProcessGroupDummy(0, 1), find_unused_parameters=True)
        if isinstance(spec, _Core):
            if compressor_options or getattr(spec.coordinator, "manager", None) is not manager:
                raise ValueError("gradcompress: pass either a Compressor built on this manager, or a spec and "
                                 "its options")
            self.compressor = spec
        else:
            self.compressor = Compressor(spec, manager, **compressor_options)
        self.compressor.index_parameters(module.parameters())
        self.register_comm_hook(self.compressor, hook)


__all__ = ["DistributedDataParallel"]
