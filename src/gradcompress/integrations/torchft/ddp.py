"""``DistributedDataParallel(manager, module, spec)``: torchft's DDP, averaging each bucket with gradcompress.

Like torchft's own ``torchft.ddp.DistributedDataParallel``: DDP is built on a one-rank dummy group (its
construction-time broadcast and bucket bookkeeping stay local; torchft's ``init_sync`` makes the replicas start
equal), with ``find_unused_parameters=True`` so the buckets are never rebuilt (a healed replica's buckets must
match its peers'), and every bucket goes through a communication hook: ours, a
:func:`~.compressor.managed_compressor`'s Compressor on the Manager's quorum (torchft's own hook is not installed:
DDP takes one).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from torch import nn
from torch.nn import parallel

from ...adapters.ddp_hook import hook
from ...compressor import Compressor as _Core
from .compressor import managed_compressor

if TYPE_CHECKING:
    from torchft.manager import Manager

    from ...compressor import Compressor
    from ...config import Spec


class DistributedDataParallel(parallel.DistributedDataParallel):
    """torchft's DDP with gradcompress's hook: ``module``'s gradients averaged over the live replicas, compressed.

    What is sent: each DDP bucket encoded by the codec (its size and bias: :func:`gradcompress.make`), on the
    Manager's current quorum (:func:`~.compressor.managed_compressor`). ``.compressor`` is the Compressor
    (``stats()``, ``state_dict()``). Step the optimizer only when ``manager.should_commit()`` agrees (torchft's
    ``OptimizerWrapper`` does that).

    Args:
        manager: the torchft ``Manager`` of this replica.
        module: the model (an ``nn.Module``), on this replica's device.
        spec: a codec spec (default ``"none"``: dense, in float32), or a Compressor built on the same manager.
        **compressor_options: the Compressor's options (``warmup_steps``, ``error_feedback``, ``seed``...); none
            with a Compressor.

    Raises:
        ValueError: a Compressor with options, or one built on another manager; a bad spec or option.

    Example::

        model = gft.DistributedDataParallel(manager, model, "int8")   # gft: gradcompress.integrations.torchft
        optimizer = torchft.OptimizerWrapper(manager, torch.optim.AdamW(model.parameters()))

    Whole scripts: ``docs/torchft.md``.
    """

    # compressor_options: Any, the Compressor's keywords, each of its own type
    def __init__(self, manager: Manager, module: nn.Module, spec: Spec | Compressor = "none",
                 **compressor_options: Any) -> None:
        from torchft.process_group import ProcessGroupDummy

        super().__init__(module, process_group=ProcessGroupDummy(0, 1), find_unused_parameters=True)
        if isinstance(spec, _Core):
            if compressor_options or getattr(spec.coordinator, "manager", None) is not manager:
                raise ValueError("gradcompress: pass either a Compressor built on this manager, or a spec and "
                                 "its options")
            self.compressor = spec
        else:
            self.compressor = managed_compressor(spec, manager, **compressor_options)
        self.compressor.index_parameters(module.parameters())
        self.register_comm_hook(self.compressor, hook)


__all__ = ["DistributedDataParallel"]
