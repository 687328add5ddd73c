"""``Compressor(spec, manager, **options)``: a :class:`gradcompress.Compressor` whose steps follow a torchft
``Manager``: quorum, divisor, commit, healing (:mod:`gradcompress.quorum`, the quorum as the steps' coordinator).

Use it for custom loops (``compressor.synchronize(model.parameters())`` after backward, then
``if manager.should_commit(): optimizer.step()``, or torchft's ``OptimizerWrapper``), or let
:class:`~gradcompress.integrations.torchft.DistributedDataParallel` build one.
"""

from __future__ import annotations

from ... import compressor as core
from ...quorum import STATE_KEY, under


def Compressor(spec, manager, *, group=None, state_key: str | None = None, process_group=None,  # noqa: N802
               **options) -> core.Compressor:
    """A :class:`gradcompress.Compressor` under torchft's ``manager``. ``state_key``: the name of its shared state in
    torchft's transfer (default ``"gradcompress"``, then ``"gradcompress.1"``...); ``group``: the replica group's own
    process group, for replica groups of several processes (each process exchanges 1/G of the parameters, then
    broadcasts them inside the group); ``process_group``: the group given to the Manager (default: the one torchft's
    ``ManagedProcessGroup(manager)`` reaches). The options are the Compressor's; ``"auto"`` and hierarchical
    topologies are refused (a quorum changes its members every step)."""
    topology = options.pop("topology", "flat")
    if topology not in ("auto", "flat"):
        raise ValueError(f"gradcompress under torchft: topology must be 'flat' (the replica groups are the "
                         f"quorum's members), got {topology!r}")
    return core.Compressor(spec, topology="flat", coordinator=under(manager, group=group, state_key=state_key,
                                                                    process_group=process_group), **options)


__all__ = ["Compressor", "STATE_KEY"]
