"""gradcompress under torchft (``pip install 'gradcompress[torchft]'``): compressed averaging that keeps training
when replicas die and come back.

* :class:`DistributedDataParallel` ``(manager, module, spec, **options)``: torchft's DDP with gradcompress's hook;
* :func:`managed_compressor` ``(spec, manager, **options)`` (also published as ``Compressor``): a
  :class:`gradcompress.Compressor` under the Manager, for custom loops (``synchronize``) and DiLoCo
  (``gradcompress.optim.DiLoCo(..., manager=manager)`` builds one);
* :class:`ManagedCollectives`: the collectives on the Manager's quorum (errors reported to the Manager);
* :class:`Lighthouse`: torchft's lighthouse server on 127.0.0.1 (tests, CLI, demo).

Semantics (each tested with real processes, a real lighthouse and SIGKILL): every collective runs on the current
quorum, an error is reported to the Manager (the step is then discarded on every replica that saw it); the mean
divides by the live participants; a healing replica sends zeros and keeps its residuals; the compressor's state
commits only when ``manager.should_commit()`` agrees; the schedule follows the Manager's committed step; a
rejoining replica receives the shared state (step, PowerSGD factors, momentum correction; DiLoCo's anchor and
outer state) and starts with zero residuals; server residuals restart when the quorum changes.
"""

from .collectives import ManagedCollectives
from .compressor import STATE_KEY, Compressor, managed_compressor
from .ddp import DistributedDataParallel
from .lighthouse import Lighthouse

__all__ = ["Compressor", "DistributedDataParallel", "Lighthouse", "ManagedCollectives", "STATE_KEY",
           "managed_compressor"]
