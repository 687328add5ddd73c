"""Lightning: a ``DDPStrategy`` that compresses gradients on every device.

Lightning's own ``DDPStrategy(ddp_comm_hook=...)`` registers communication hooks only when
the root device is CUDA: on CPU (gloo) it silently trains uncompressed. This strategy
installs a :class:`gradcompress.Compressor` as the DDP model's hook whatever the device::

    from gradcompress.integrations.lightning import CompressedDDPStrategy

    strategy = CompressedDDPStrategy("powersgd:rank=4", warmup_steps=10, find_unused_parameters=False)
    trainer = lightning.Trainer(accelerator="cpu", devices=4, strategy=strategy)
    trainer.fit(model)
    strategy.compressor.stats()        # steps, wire_bytes, ratio, ...

Options are routed by name: those of :class:`gradcompress.Compressor` (``error_feedback``,
``momentum``, ``warmup_steps``, ``min_numel``, ...) configure the compressor, those of
Lightning's ``DDPStrategy`` and of ``DistributedDataParallel`` (``bucket_cap_mb``,
``find_unused_parameters``, ...) go to the strategy; any other name is an error.
``strategy.compressor`` is the Compressor (its ``state_dict()`` is per rank, as for DDP).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from ..adapters.ddp_hook import register
from ..compressor import Compressor

if TYPE_CHECKING:
    from ..config import Spec

try:
    from lightning.pytorch.strategies import DDPStrategy
except ImportError as err:  # pragma: no cover - depends on the environment
    raise ImportError("gradcompress.integrations.lightning needs Lightning: pip install 'gradcompress[lightning]' "
                      f"(or pip install lightning) ({err})") from err


def _parameters(fn: Callable[..., object]) -> set[str]:
    return {n for n, p in inspect.signature(fn).parameters.items()
            if n != "self" and p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)}


COMPRESSOR_OPTIONS = _parameters(Compressor.__init__) - {"spec"}
STRATEGY_OPTIONS = (_parameters(DDPStrategy.__init__) | _parameters(torch.nn.parallel.DistributedDataParallel.__init__)
                    ) - {"module", "ddp_comm_state", "ddp_comm_hook", "ddp_comm_wrapper", "process_group"}


class CompressedDDPStrategy(DDPStrategy):
    """Lightning's ``DDPStrategy`` whose DDP model averages gradients through a :class:`gradcompress.Compressor`.

    What is sent: what :func:`gradcompress.register_ddp_hook` sends (each bucket through the codec, on any device,
    CPU included); its bias is the codec's (:func:`gradcompress.make`).

    Args:
        spec: a codec spec (``"int8"``, ``"powersgd:rank=4"``, ...), a dict or a codec.
        **options: routed by name: the Compressor's (``error_feedback``, ``momentum``, ``warmup_steps``,
            ``min_numel``, ...) build ``strategy.compressor``; Lightning's ``DDPStrategy``'s and
            ``DistributedDataParallel``'s (``bucket_cap_mb``, ``find_unused_parameters``, ...) go to the strategy.

    Raises:
        ValueError: an option of neither; a bad spec or Compressor option.

    Example::

        >>> from gradcompress.integrations.lightning import CompressedDDPStrategy
        >>> strategy = CompressedDDPStrategy("int8", warmup_steps=10, find_unused_parameters=False)
        >>> strategy.compressor.warmup_steps      # then lightning.Trainer(strategy=strategy, devices=...)
        10
    """

    strategy_name = "gradcompress_ddp"

    # options: Any, each goes to the Compressor's or the strategy's keyword of its own name (and type)
    def __init__(self, spec: Spec, **options: Any) -> None:
        unknown = sorted(set(options) - COMPRESSOR_OPTIONS - STRATEGY_OPTIONS)
        if unknown:
            raise ValueError(f"CompressedDDPStrategy: unknown option {unknown[0]!r}; Compressor options: "
                             f"{', '.join(sorted(COMPRESSOR_OPTIONS))}; or any option of Lightning's DDPStrategy "
                             "or of DistributedDataParallel (the communication hook is the Compressor)")
        compressor_options = {k: options.pop(k) for k in list(options) if k in COMPRESSOR_OPTIONS}
        self.compressor = Compressor(spec, **compressor_options)
        super().__init__(**options)

    def _register_ddp_hooks(self) -> None:
        register(self.compressor, self.model)


__all__ = ["CompressedDDPStrategy"]
