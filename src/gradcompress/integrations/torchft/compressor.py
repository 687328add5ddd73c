"""``managed_compressor(spec, manager, **options)``: a :class:`gradcompress.Compressor` whose steps follow a torchft
``Manager``: quorum, divisor, commit, healing (:mod:`gradcompress.quorum`, the quorum as the steps' coordinator).
``Compressor`` is the same function under the name it was first published with (``gft.Compressor(spec, manager)``).

Use it for custom loops (``compressor.synchronize(model.parameters())`` after backward, then
``if manager.should_commit(): optimizer.step()``, or torchft's ``OptimizerWrapper``), or let
:class:`~gradcompress.integrations.torchft.DistributedDataParallel` build one.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch.distributed as dist

from ... import compressor as core
from ...quorum import STATE_KEY, under

if TYPE_CHECKING:
    from torchft.manager import Manager

    from ...config import Spec


# options: Any, the Compressor's keywords, each of its own type
def managed_compressor(spec: Spec, manager: Manager, *, group: dist.ProcessGroup | None = None,
                       state_key: str | None = None, process_group: dist.ProcessGroup | None = None,
                       **options: Any) -> core.Compressor:
    """A :class:`gradcompress.Compressor` under torchft's ``manager``: compressed averaging over the live replicas.

    What is sent: the codec's payloads (its size and bias: :func:`gradcompress.make`), on the Manager's current
    quorum; the mean divides by the participants, a healing replica sends zeros and keeps its residuals, and the
    step's state commits only when ``manager.should_commit()`` agrees (``docs/torchft.md``).

    Args:
        spec: a codec spec (``"int8"``, ``"topk:ratio=0.01"``, ...; not ``"auto"``), a dict or a codec.
        manager: the torchft ``Manager`` of this replica (group).
        group: the replica group's own process group, for replica groups of several processes (each process
            exchanges 1/G of the parameters, then broadcasts them inside the group); default None: one process.
        state_key: the name of its shared state in torchft's transfer (default None: ``"gradcompress"``, then
            ``"gradcompress.1"``...).
        process_group: the group given to the Manager (default None: the one ``ManagedProcessGroup(manager)``
            reaches).
        **options: the Compressor's keyword options; ``topology`` may only be ``"flat"`` (or ``"auto"``: flat).

    Returns:
        The :class:`gradcompress.Compressor`; call ``synchronize(model.parameters())`` after each backward.

    Raises:
        ValueError: ``"auto"`` or a hierarchical ``topology`` (a quorum changes its members every step), or a bad
            spec or option.

    Example::

        compressor = gft.managed_compressor("int8", manager)     # manager: a torchft Manager
        loss.backward()
        compressor.synchronize(model.parameters())
        if manager.should_commit():
            optimizer.step()

    Whole scripts: ``docs/torchft.md`` (its snippets run in ``tests/test_readme.py``).
    """
    topology = options.pop("topology", "flat")
    if topology not in ("auto", "flat"):
        raise ValueError(f"gradcompress under torchft: topology must be 'flat' (the replica groups are the "
                         f"quorum's members), got {topology!r}")
    return core.Compressor(spec, topology="flat", coordinator=under(manager, group=group, state_key=state_key,
                                                                    process_group=process_group), **options)


#: the public name it was first published with (it builds a :class:`gradcompress.Compressor`, hence the spelling)
Compressor = managed_compressor

__all__ = ["Compressor", "STATE_KEY", "managed_compressor"]
