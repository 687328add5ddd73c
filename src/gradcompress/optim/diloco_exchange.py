"""DiLoCo's exchange of outer gradients: compress and average each fragment's, on the courier, until applied.

Each fragment has a :class:`gradcompress.Compressor` of its own (its own residuals), built from DiLoCo's keyword
arguments ``codec``, ``error_feedback``, ``seed``, ``topology`` and its group (:func:`compressors`; SparseLoCo's:
a lossy codec with error feedback on, every tensor compressed, flat). A send hands the fragment's outer gradients to
the :class:`gradcompress.optim.streaming.Courier` (run at once with ``delay=0``), which averages them in place in one
Compressor step; :meth:`OuterExchange.receive` waits for it and asks the quorum
(:class:`gradcompress.optim.diloco_quorum.Replicas`) whether its update applies. SparseLoCo's decay
(``e <- error_decay * e + delta``) is applied to the outer gradients before their step, through the Compressor's
error feedback.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Literal

import torch
import torch.distributed as dist

from ..compressor import Compressor
from ..scheme import split_compressor_options
from ..spec import make
from . import streaming
from .diloco_outer import OuterRule
from .diloco_quorum import Replicas

if TYPE_CHECKING:
    from ..config import Spec, TopologyOption

#: SparseLoCo's outer-gradient codec: chunked top-k, 64 of every 4096 elements (1.5625 %), 2-bit values
SPARSELOCO_CODEC = "topk:ratio=0.015625,chunk=4096,values=int2"
#: the Compressors' counters that DiLoCo's stats() sums over the fragments
TOTALS = ("raw_bytes", "wire_bytes", "codec_seconds", "comm_seconds", "inter_node_bytes", "intra_node_bytes")


class OuterExchange:
    """The fragments' exchanges: ``compressors`` (one per fragment), the ``flight`` (fragment ->
    :class:`streaming.InFlight`: sent, not yet applied), the wire bytes of each exchange in the order they ran
    (``sync_bytes``) and the training thread's waits for them (``wait_seconds``)."""

    def __init__(self, compressors: list[Compressor], quorum: Replicas, error_decay: float = 1.0):
        self.compressors = compressors
        self.quorum = quorum
        self.error_decay = error_decay
        self.courier = streaming.Courier()
        self.flight: dict[int, streaming.InFlight] = {}
        self.sync_bytes: list[int] = []
        self.wait_seconds = 0.0

    def send(self, f: int, keys: list[int], grads: list[torch.Tensor], apply_at: int, now: bool) -> None:
        """Fragment f's outer gradients (of the parameters at ``keys``) averaged in place on the courier (``now``: at
        once), to be applied after inner step ``apply_at``."""
        comp = self.compressors[f]
        if self.error_decay != 1.0:
            _decay_residuals(comp, keys, grads, self.error_decay)

        def exchange():
            before = comp.stats()["wire_bytes"]
            with comp.step() as step:
                step.drive([step.exchange(keys, grads)])
            self.sync_bytes.append(comp.stats()["wire_bytes"] - before)
            return self.quorum.outcome(step)  # torchft: decided at the apply

        self.flight[f] = streaming.InFlight(f, grads, apply_at, self.courier.send(exchange, now))

    def settled(self, f: int) -> bool:
        """Fragment f's exchange waited for and decided (:meth:`Replicas.decide`): whether its update applies."""
        flight = self.flight[f]
        start = time.perf_counter()
        outcome = flight.result.result()
        if not isinstance(outcome, bool):  # a step under torchft, closed and waiting for the Manager's decision
            step, outcome = outcome, self.quorum.decide(outcome)
            lost = not outcome and self.quorum.lost(step)
            self.flight[f] = flight._replace(result=streaming.done(outcome), lost=lost)
        self.wait_seconds += time.perf_counter() - start
        return outcome

    def receive(self, f: int) -> tuple[bool, streaming.InFlight]:
        """Fragment f's exchange settled and taken out of the flight: (whether it applies, its averaged grads)."""
        finite = self.settled(f)
        return finite, self.flight.pop(f)

    def totals(self) -> dict:
        """The Compressors' counters (:data:`TOTALS`) summed, and the first one's ``topology``."""
        every = [c.stats() for c in self.compressors]
        return {**{k: sum(st[k] for st in every) for k in TOTALS}, "topology": every[0]["topology"]}

    def in_flight_state(self, finished: dict[int, bool]) -> list[dict]:
        """The exchanges in flight as a state dict saves them (``finished``: each one's :meth:`settled`)."""
        flights = [self.flight[f] for f in sorted(self.flight)]
        return [{"fragment": x.fragment, "apply_at": x.apply_at, "finite": bool(finished[x.fragment]),
                 "grads": [g.clone() for g in x.grads], **({"lost": True} if x.lost else {})} for x in flights]

    def restore(self, in_flight: list[dict]) -> None:
        """Take the exchanges in flight that :meth:`in_flight_state` saved (done: applied at their step)."""
        self.flight = {x["fragment"]: streaming.InFlight(x["fragment"], [g.clone() for g in x["grads"]],
                                                         x["apply_at"], streaming.done(x["finite"]),
                                                         bool(x.get("lost", False)))
                       for x in in_flight}

    def close(self) -> None:
        """Wait for the exchanges in flight and stop the courier's thread."""
        self.courier.close()


def _decay_residuals(comp: Compressor, keys: list[int], outer_grads: list[torch.Tensor], decay: float) -> None:
    """SparseLoCo's ``e <- beta e + delta`` through the Compressor's error feedback, which compresses ``x + e``:
    ``x = delta - (1 - beta) e`` (in place). The committed residuals are only read."""
    residuals = comp.residual
    for key, g in zip(keys, outer_grads):
        e = residuals.get(key)
        if e is not None and e.shape == g.shape:
            g.sub_(e.to(g.dtype), alpha=1.0 - decay)


def compressors(build: Callable[..., Compressor], rule: OuterRule, count: int, codec: Spec | None,
                error_feedback: bool | Literal["auto"], topology: TopologyOption | None,
                process_group: dist.ProcessGroup | None, seed: int) -> list[Compressor]:
    """``count`` Compressors of the outer gradients, one per fragment (``build``: :class:`Compressor`, or its
    torchft-managed factory, :meth:`Replicas.compressors`)."""
    return [_compressor(build, rule, codec, error_feedback, topology, process_group, seed) for _ in range(count)]


def _compressor(build, rule: OuterRule, codec, error_feedback, topology, process_group, seed: int) -> Compressor:
    """The Compressor of one fragment's outer gradients."""
    if rule.sparse:
        return _sparseloco_compressor(codec, rule.make, error_feedback, topology, process_group, seed, build)
    return build("none" if codec is None else codec, process_group=process_group, error_feedback=error_feedback,
                 seed=seed, topology="auto" if topology is None else topology)


def _sparseloco_compressor(codec, outer_optimizer, error_feedback, topology, process_group, seed,
                           build=Compressor) -> Compressor:
    """SparseLoCo's outer exchange: a lossy codec with error feedback on, every tensor compressed, flat."""
    if outer_optimizer is not None:
        raise ValueError("DiLoCo: outer='sparseloco' steps the anchor by plain SGD (outer_lr); outer_optimizer "
                         "applies to outer='nesterov' only")
    if error_feedback is False:
        raise ValueError("DiLoCo: outer='sparseloco' is error feedback (its only outer memory); "
                         "error_feedback=False does not apply")
    if topology not in (None, "auto", "flat"):
        raise ValueError(f"DiLoCo: outer='sparseloco' runs on the flat topology (its residuals are whole tensors), "
                         f"got topology={topology!r}; a model wrapped in DDP on its node's group is not supported")
    spec = SPARSELOCO_CODEC if codec is None else codec
    name, options = split_compressor_options(spec if isinstance(spec, (str, dict)) else spec.spec)
    if make(name).exact:
        raise ValueError(f"DiLoCo: outer='sparseloco' compresses the outer gradient; codec {make(name).spec!r} is "
                         f"exact (leave codec unset for SparseLoCo's {SPARSELOCO_CODEC!r})")
    if options.get("error_feedback", True) is not True:
        raise ValueError("DiLoCo: outer='sparseloco' is error feedback (its only outer memory); the codec's "
                         f"error_feedback={options['error_feedback']!r} does not apply")
    options.setdefault("min_numel", 0)
    options["error_feedback"] = True
    return build(name, process_group=process_group, seed=seed, topology="flat", **options)


def own_group(group: dist.ProcessGroup | None) -> dist.ProcessGroup:
    """A new process group of ``group``'s ranks (None: the world), created by those ranks only: the exchanges in
    flight get a group of their own, so collectives the training thread issues meanwhile cannot interleave."""
    ranks = dist.get_process_group_ranks(group) if group is not None else list(range(dist.get_world_size()))
    return dist.new_group(ranks, use_local_synchronization=True)


__all__ = ["OuterExchange", "SPARSELOCO_CODEC", "TOTALS", "compressors", "own_group"]
