"""The DistributedDataParallel adapter: ``register_ddp_hook(model, "int8")``.

``register_ddp_hook(model, "int8")`` or ``register_ddp_hook(model, Compressor(...))`` installs the communication hook of
:mod:`gradcompress.adapters.ddp_hook` with the Compressor as its state: for each bucket DDP hands over, the hook
opens the step if none is open, asks the step for the bucket's exchange and launches it (its first round of
collectives is issued now, overlapping the rest of the backward pass); at the last bucket it finishes the step.
The Compressor averages over the DDP model's own ``process_group``; state is keyed by parameter position in
``model.parameters()``.
"""

from ..compressor import Compressor
from .ddp_hook import require_ddp, hook, register


def register_ddp_hook(ddp_model, spec, **options):
    """One line: ``compressor = register_ddp_hook(ddp_model, "powersgd:rank=2", warmup_steps=10)``.

    Builds a :class:`gradcompress.Compressor` with ``options`` (or takes ``spec`` when it is one: then no options)
    and installs it as ``ddp_model``'s hook, averaging over the DDP model's own process group. Returns it.
    """
    require_ddp(ddp_model)
    if isinstance(spec, Compressor):
        if options:
            raise TypeError(f"register_ddp_hook: options ({', '.join(options)}) go to Compressor(...), not next to "
                            "a Compressor that is already built")
        return register(spec, ddp_model)
    return register(Compressor(spec, **options), ddp_model)


__all__ = ["hook", "register", "register_ddp_hook"]
