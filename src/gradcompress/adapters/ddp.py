"""The DistributedDataParallel adapter: ``register_ddp_hook(model, "int8")``.

``register_ddp_hook(model, "int8")`` or ``register_ddp_hook(model, Compressor(...))`` installs the communication hook of
:mod:`gradcompress.adapters.ddp_hook` with the Compressor as its state: for each bucket DDP hands over, the hook
opens the step if none is open, asks the step for the bucket's exchange and launches it (its first round of
collectives is issued now, overlapping the rest of the backward pass); at the last bucket it finishes the step.
The Compressor averages over the DDP model's own ``process_group``; state is keyed by parameter position in
``model.parameters()``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from ..compressor import Compressor
from .ddp_hook import require_ddp, hook, register

if TYPE_CHECKING:
    from ..config import Spec


def register_ddp_hook(ddp_model: torch.nn.parallel.DistributedDataParallel, spec: Spec | Compressor,
                      **options: Any) -> Compressor:
    """Compress DDP's gradient all-reduce: ``compressor = register_ddp_hook(ddp_model, "int8")``.

    Builds a :class:`gradcompress.Compressor` with ``options`` (or takes ``spec`` when it is one) and installs it
    as ``ddp_model``'s communication hook, averaging over the DDP model's own process group. What is sent: each
    bucket's gradients encoded by the codec (``int8``: int8 codes and a float32 scale per 512 elements, 1.008
    bytes per element against float32's 4; ``docs/codecs.md`` gives every codec's size), launched as DDP hands
    the bucket over, overlapping the rest of the backward pass; tensors under ``min_numel`` (1024) elements go
    dense. Bias: the codec's (``int8`` rounds to nearest, biased, unbiased with ``stochastic=true``; ``qsgd`` and
    ``terngrad`` are unbiased; ``topk``, ``sign`` and ``powersgd`` are biased), and error feedback
    (``error_feedback="auto"``: on for the biased lossy codecs) carries what a step left out into the next.
    PowerSGD: `Vogels et al., 2019 <https://arxiv.org/abs/1905.13727>`_; error
    feedback for signs: `Karimireddy et al., 2019 <https://arxiv.org/abs/1901.09847>`_.

    Args:
        ddp_model: a ``torch.nn.parallel.DistributedDataParallel`` model.
        spec: a codec spec (``"int8"``, ``"topk:ratio=0.01,momentum=0.9"``, ``"powersgd:rank=2"``, ``"auto"``;
            :func:`gradcompress.available` lists the codecs), a dict, or a :class:`gradcompress.Compressor`.
        **options: the Compressor's keyword options (``warmup_steps=0``, ``error_feedback="auto"``,
            ``momentum=0.0``, ``seed=0``, ...; see :class:`gradcompress.Compressor`); none with a Compressor.

    Returns:
        The :class:`gradcompress.Compressor` installed (``stats()``, ``state_dict()``, ``load_state_dict()``).

    Raises:
        TypeError: ``ddp_model`` is not ``DistributedDataParallel``, or ``options`` next to a built Compressor.
        ValueError: a bad spec or option (the message names the codec, the option and what is allowed).

    Example::

        >>> import torch, torch.distributed as dist, gradcompress
        >>> dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        >>> model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(64, 32))
        >>> compressor = gradcompress.register_ddp_hook(model, "int8")
        >>> model(torch.ones(3, 64)).sum().backward()     # the weight's gradient averaged in int8
        >>> compressor.stats()["steps"]
        1
        >>> dist.destroy_process_group()

    Several processes: ``examples/ddp.py`` (``torchrun --nproc_per_node 2 examples/ddp.py``).
    """
    require_ddp(ddp_model)
    if isinstance(spec, Compressor):
        if options:
            raise TypeError(f"register_ddp_hook: options ({', '.join(options)}) go to Compressor(...), not next to "
                            "a Compressor that is already built")
        return register(spec, ddp_model)
    return register(Compressor(spec, **options), ddp_model)


__all__ = ["hook", "register", "register_ddp_hook"]
