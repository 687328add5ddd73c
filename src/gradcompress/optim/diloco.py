"""DiLoCo (Douillard et al., 2023): local inner steps, rare compressed outer synchronisation.

Each rank runs ``sync_every`` (H) steps of its own inner optimizer on its own data with no
communication at all. Then every rank computes the *outer gradient* of each parameter,
``anchor - local`` (how far its inner steps moved it from the last synchronised point),
the outer gradients are averaged across the group through a
:class:`gradcompress.Compressor` step (the codec's collective, error feedback on the outer
gradient when the codec is biased), the outer optimizer (SGD with Nesterov momentum by
default, as in the paper) steps the anchor with the average as its ``.grad``, and every
rank continues from the new anchor. What is sent: one (compressed) outer gradient per
parameter every H steps instead of a gradient every step, so H times fewer exchanges,
each as small as the codec makes it (int8 4x, int4 8x, ``topk:values=int8`` 20x+).

When to use it: slow or far-apart links (other buildings, clouds, the internet), where even
1-bit gradients every step wait on the network; compute is local, communication rare. At
equal steps it trails synchronous data parallelism (the replicas drift for H steps); it
catches up with more steps. H of 10 to 100 and ``outer_lr`` 0.7, ``outer_momentum`` 0.9
with Nesterov are the paper's settings; compressing the outer gradient with int8/int4
costs little (it is a sum of H steps, smooth and large).

Bias: with ``codec="none"``, ``sync_every=1``, ``outer_lr=1``, ``outer_momentum=0`` and plain
SGD inside, a sync is exactly one data-parallel SGD step on the averaged gradient.

SparseLoCo (Sarfi, Thérien, Lidin, Belilovsky, 2025, arXiv 2508.15706), ``outer="sparseloco"``: the outer gradient
goes through error feedback with a decay, ``e <- error_decay * e + delta`` (``delta`` = anchor - local), then
``e`` is compressed, by default chunked top-k (64 of every 4096 elements, 1.56 %) with 2-bit values
(:data:`SPARSELOCO_CODEC`), and ``e <- e - delivered`` (what this rank's compression delivered); the workers'
compressed outer gradients are averaged (all-gathered, as top-k always is) and the anchor steps by
``outer_lr`` times that average, by plain SGD *without* an outer momentum: the decayed error-feedback buffer is
the only outer memory (the paper's observation: it stands in for DiLoCo's Nesterov momentum, which on top of
error feedback made our sparse outer gradients 24.8 % worse). What is sent per sync: every worker's payload to
the W-1 others, about 1.78 bytes per kept element (2-bit value, 12-bit offset in its chunk) + 8 bytes per 512
kept values: 0.028 bytes per parameter, 140x less than a dense float32 outer gradient before the gather.
Bias: biased (delayed by error feedback, and the decay forgets ``1 - error_decay`` of the undelivered residual
per sync). Defaults (``error_decay`` 0.95, ``outer_lr`` 1.0, density 1/64 in chunks of 4096): the paper's, as we
read it (:data:`SPARSELOCO_ERROR_DECAY`, :data:`SPARSELOCO_OUTER_LR`); each is an argument. Every tensor is
compressed (``min_numel=0``: no dense small tensors), on the flat topology. When to use it: where even a
compressed dense outer gradient every H steps is too much (the internet); the replicas agree after each sync.

DiLoCo between nodes, DDP inside (torchft's "DiLoCo between groups that train with DDP"): wrap the model in
``DistributedDataParallel`` on the node's own group, and pass the DDP model. Inner steps are then synchronous data
parallelism inside each node (DDP's all-reduce on the fast link), and every ``sync_every`` steps the nodes average
their outer gradients::

    nodes = gradcompress.topology.resolve(G)          # or "auto" under torchrun; G workers per node
    ddp = DistributedDataParallel(model, process_group=nodes.intra)
    opt = DiLoCo(ddp, torch.optim.AdamW(ddp.parameters()), sync_every=50, codec="int8")

The node's workers hold the same outer gradient, so the outer exchange goes hierarchical (``topology`` = the DDP
group's size, :mod:`gradcompress.exchanges.hierarchical`): the intra-node reduce-scatter sums the G equal copies and
divides by G (the node's outer gradient again), each worker sends its 1/G piece between nodes, and an all-gather
inside the node returns the average: a node's uplink carries one outer gradient, not G. The DDP group must be a
block of G consecutive ranks of DiLoCo's group (node i: ranks iG .. iG+G-1, as torchrun numbers them); DDP over
DiLoCo's whole group is refused (there would be nothing left to average).
"""

from __future__ import annotations

import numbers
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any, Literal

import torch
import torch.distributed as dist

from ..collectives import ddp_bytes, x_fewer_than_ddp
from ..compressor import Compressor
from ..config import is_auto
from ..session import default_group
from . import diloco_exchange, diloco_quorum, diloco_shards, streaming
from .diloco_exchange import SPARSELOCO_CODEC
from .diloco_outer import OUTERS, SPARSELOCO_ERROR_DECAY, SPARSELOCO_OUTER_LR, OuterRule, OuterStep, check_outer

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh
    from torchft.manager import Manager

    from ..config import Spec, TopologyOption

#: DiLoCo without torch.distributed, a process_group or a manager: nothing to average over (as
#: ``Compressor.synchronize``'s :data:`gradcompress.session.NOT_INITIALISED`)
NOT_INITIALISED = (
    "DiLoCo: torch.distributed is not initialised, so there is no group to average the outer gradients over; call "
    "torch.distributed.init_process_group(...) first (or launch with torchrun, then init_process_group), or pass "
    "process_group= (a group of it) or manager= (a torchft Manager). One process on its own: "
    "torch.distributed.init_process_group(\"gloo\", store=torch.distributed.HashStore(), rank=0, world_size=1)")


def ddp_nodes(ddp: torch.nn.parallel.DistributedDataParallel, process_group: dist.ProcessGroup | None) -> int:
    """The workers per node G of a model wrapped in DDP on its node's group: the DDP group must be a block of G
    consecutive ranks of DiLoCo's ``process_group`` (not all of it); ``ValueError`` naming the fix otherwise."""
    group = dist.group.WORLD if process_group is None else process_group
    outer = dist.get_process_group_ranks(group)
    inner = dist.get_process_group_ranks(ddp.process_group)
    size = len(inner)
    if size == len(outer):
        raise ValueError("DiLoCo: do not wrap the model in DistributedDataParallel over DiLoCo's whole group: DiLoCo "
                         "averages the parameters itself, every sync_every steps; pass the bare module, or wrap it "
                         "in DDP on the node's own group (gradcompress.topology.resolve(G).intra)")
    if not set(inner) <= set(outer):
        raise ValueError(f"DiLoCo: the DDP model's group (ranks {inner}) is not inside DiLoCo's group")
    local = [outer.index(r) for r in inner]
    if local != list(range(local[0], local[0] + size)) or local[0] % size:
        raise ValueError(f"DiLoCo: the DDP model's group (ranks {inner}) is not a block of {size} consecutive ranks "
                         "of DiLoCo's group (node i: ranks i*G .. i*G+G-1); build the DDP groups that way")
    return size


def _params_of(model_or_params) -> list[torch.nn.Parameter]:
    if isinstance(model_or_params, torch.nn.parallel.DistributedDataParallel):
        model_or_params = model_or_params.module
    if isinstance(model_or_params, torch.nn.Module):
        params = list(model_or_params.parameters())
    else:
        params = list(model_or_params)
        if params and isinstance(params[0], dict):
            raise ValueError("DiLoCo: pass the model or its parameters; parameter groups belong to the inner "
                             "optimizer")
    params = [p for p in params if p.requires_grad]
    if not params:
        raise ValueError("DiLoCo: no parameter that requires grad")
    return params


def _layers_of(model_or_params, params: list) -> list[list[int]]:
    """Positions of ``params`` grouped by owning module (a model), or one group per parameter (a list)."""
    if isinstance(model_or_params, torch.nn.parallel.DistributedDataParallel):
        model_or_params = model_or_params.module
    if not isinstance(model_or_params, torch.nn.Module):
        return [[i] for i in range(len(params))]
    names = {id(p): n for n, p in model_or_params.named_parameters()}
    return streaming.layers_of([names[id(p)] for p in params])


class DiLoCo:
    """Wraps an inner optimizer; every ``sync_every`` steps averages the outer gradient, compressed.

    DiLoCo: `Douillard et al., 2023 <https://arxiv.org/abs/2311.08105>`_; ``outer="sparseloco"``: `SparseLoCo, 2025
    <https://arxiv.org/abs/2508.15706>`_. What is sent: nothing between syncs; at each sync the outer gradient (the
    anchor minus the parameters, H inner steps of progress) encoded by ``codec`` and averaged, so a run sends about
    1/H of what DDP would, times the codec's ratio (``fragments=F``: about 1/F of it at each of F offsets). Bias:
    the codec's (:func:`gradcompress.make`); error feedback (``"auto"``: on for the biased codecs; sparseloco's
    decayed one) carries what a sync left out into the next.

    Args:
        model_or_params: the bare model or its parameters, or the model wrapped in
            ``DistributedDataParallel`` on its node's own group (module doc: DiLoCo between nodes, DDP inside).
        inner_optimizer: any torch optimizer over those parameters (AdamW in the paper).
        sync_every: inner steps between synchronisations (H >= 1).
        codec: codec spec for the outer gradient (``"none"``, ``"int8"``, ``"int4"``,
            ``"topk:ratio=0.03,values=int8"``, ...). Default: ``"none"``; with ``outer="sparseloco"``
            :data:`SPARSELOCO_CODEC` (a lossy codec is required there).
        outer: ``"nesterov"`` (default: DiLoCo's outer SGD with Nesterov momentum, as before) or
            ``"sparseloco"`` (module doc: error feedback with decay as the only outer memory, plain SGD).
        outer_lr, outer_momentum, nesterov: the default outer optimizer, SGD on the anchor (``outer_lr``
            default 0.7; sparseloco: :data:`SPARSELOCO_OUTER_LR`, and no momentum: ``outer_momentum`` and
            ``nesterov`` do not apply).
        error_decay: sparseloco only: the error-feedback decay beta in ``e <- beta e + delta`` (in [0, 1];
            default :data:`SPARSELOCO_ERROR_DECAY`; 1 is plain error feedback).
        outer_optimizer: instead, a callable ``f(anchor_params) -> torch.optim.Optimizer``;
            the averaged outer gradient is set as each anchor's ``.grad`` before its step.
        error_feedback: as the Compressor's (``"auto"``: on for biased codecs).
        process_group: the group to average over (default: the world). Without an initialised
            ``torch.distributed``, no group and no ``manager`` there is nothing to average over: a
            ``RuntimeError`` (:data:`NOT_INITIALISED`) says so, as ``Compressor.synchronize`` does (one process
            of its own: ``init_process_group("gloo", store=torch.distributed.HashStore(), rank=0, world_size=1)``).
            A model sharded with ``fully_shard`` (DTensor parameters) over each replica's own mesh: the group of
            the ranks that hold the same shard in every replica (``mesh.get_group("replicate")``; required), and
            each rank syncs its own shards with them (:mod:`gradcompress.optim.diloco_shards`).
        mesh: instead of ``process_group``, for a sharded model: the 2-D ``DeviceMesh`` (dim 0 replicate, dim 1
            shard; the model sharded over ``mesh["shard"]``), as :func:`gradcompress.register_fsdp` takes it.
            A model sharded natively over the 2-D mesh (``fully_shard(model, mesh=mesh)``, torchtitan's HSDP)
            needs neither (or ``mesh=`` that same mesh): DiLoCo makes its FSDP modules reduce within the shard
            dimension only (the replicas train apart between syncs) and syncs across the mesh's dim 0.
        seed: seeds the codec's random choices.
        topology: the outer exchange's (:mod:`gradcompress.topology`). Default: the DDP group's size G for a
            model wrapped in DDP on its node's group (hierarchical: each worker sends 1/G of the outer
            gradient), else ``"auto"``.
        fragments: streaming DiLoCo (:mod:`gradcompress.optim.streaming`): the parameters in F fragments by
            layer, interleaved; fragment f is sent every ``sync_every`` steps at offset ``f*H // F``, so each sync
            carries about 1/F of the model (default 1: every parameter at once, DiLoCo as before).
        delay: inner steps between a fragment's send and the application of its update (tau, 0 to H-1; default
            0: applied at once). With tau > 0 the exchange runs on a background thread while the inner steps go
            on, and the training thread waits for it only at the apply step.
        mix: the weight of the fresh global fragment when it is applied, ``local <- mix * global + (1 - mix) *
            local`` (in (0, 1]; default 1 with ``delay=0``, DiLoCo's copy, and 0.5 with ``delay > 0``, as in the
            streaming DiLoCo paper).
        manager: a torchft ``Manager`` (fault tolerance, :mod:`gradcompress.quorum`): each sync
            starts a quorum, averages the outer gradients of the live replicas (a rejoining replica sends zeros),
            and applies the outer step only if ``manager.should_commit()`` agrees; a rejoining replica receives
            the anchor, the outer optimizer's state and the step counters. The replicas must start from the same
            parameters (the same seed): nothing is broadcast at construction. Streaming under torchft: each
            fragment's exchange is one torchft step (``delay`` at most ``sync_every // fragments``: applied before
            the next is sent); one that fails (a peer died, the quorum changed) is skipped on every replica and its
            fragment keeps its local parameters: their progress goes into its next exchange (a replica whose
            fragment is non-finite restarts it from its anchor); a replica that joins heals at its first exchange
            (the exchange fails if it sent another fragment than its peers) and restarts every fragment from the
            anchors.

    Raises:
        ValueError: ``sync_every`` < 1, an inner optimizer that is not a ``torch.optim.Optimizer``, parameter
            groups or no trainable parameter, ``codec="auto"``, a DDP model over DiLoCo's whole group, a ``delay``
            that does not fit (with DDP, under torchft), a bad codec or option (the message says which).
        RuntimeError: no initialised ``torch.distributed``, no ``process_group`` and no ``manager``.

    Example::

        >>> import torch, torch.distributed as dist
        >>> from gradcompress.optim import DiLoCo
        >>> dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        >>> model = torch.nn.Linear(64, 32)
        >>> opt = DiLoCo(model, torch.optim.AdamW(model.parameters(), lr=1e-3), sync_every=2, codec="int4")
        >>> for _ in range(4):      # 4 inner steps: 2 syncs of int4 outer gradients
        ...     model(torch.randn(8, 64)).pow(2).mean().backward(); opt.step(); opt.zero_grad()
        >>> opt.stats()["syncs"]
        2
        >>> dist.destroy_process_group()

    At construction every rank starts from rank 0's parameters (one broadcast). ``step()``
    runs the inner optimizer's step and, every ``sync_every`` calls, the sync;
    ``zero_grad()`` forwards to the inner optimizer, and ``param_groups`` is the inner
    optimizer's, so LR schedulers keep working on either.

    Its parts, each with one job: the fragment schedule (:class:`gradcompress.optim.streaming.Schedule`: when to
    send and apply which fragment), the exchange of outer gradients
    (:class:`gradcompress.optim.diloco_exchange.OuterExchange`: compress and average them, one Compressor per
    fragment), the outer step (:class:`gradcompress.optim.diloco_outer.OuterStep`: the anchors and the outer
    optimizer that applies the average) and the quorum (:class:`gradcompress.optim.diloco_quorum.Replicas`: who
    takes part, whether an update applies, torchft's state transfer). Their attributes are DiLoCo's read-only
    properties of the same names as before (``anchor``, ``outer``, ``compressor``, ``compressors``, ``parts``,
    ``inner_steps``, ``flight``, ...).
    """

    def __init__(self, model_or_params: torch.nn.Module | Iterable[torch.nn.Parameter],
                 inner_optimizer: torch.optim.Optimizer, *, sync_every: int, codec: Spec | None = None,
                 outer: str = "nesterov", outer_lr: float | None = None, outer_momentum: float = 0.9,
                 nesterov: bool = True, error_decay: float | None = None,
                 outer_optimizer: Callable[[list[torch.nn.Parameter]], torch.optim.Optimizer] | None = None,
                 error_feedback: bool | Literal["auto"] = "auto", process_group: dist.ProcessGroup | None = None,
                 seed: int = 0, topology: TopologyOption | None = None, manager: Manager | None = None,
                 fragments: int = 1, delay: int = 0, mix: float | None = None,
                 mesh: DeviceMesh | None = None) -> None:
        kind = check_outer(outer)
        _check_inner(sync_every, inner_optimizer)
        rule = OuterRule.of(kind, outer_lr, outer_momentum, nesterov, error_decay, outer_optimizer)
        if isinstance(model_or_params, torch.nn.parallel.DistributedDataParallel):
            per_node = ddp_nodes(model_or_params, process_group)
            topology = per_node if topology is None else topology
        params = _params_of(model_or_params)
        self.inner = inner_optimizer
        self.schedule = streaming.Schedule(sync_every, fragments, delay, mix, _layers_of(model_or_params, params),
                                           isinstance(model_or_params, torch.nn.Module))
        _check_combination(self.schedule, manager, model_or_params, codec)
        # sharded (DTensor) parameters: their local shards, synced across the replicas (None: plain, as before); a
        # model sharded natively over a 2-D mesh is made to reduce within its shards (checked before: a refused
        # DiLoCo leaves it as it was)
        model = model_or_params if isinstance(model_or_params, torch.nn.Module) else None
        self.params, process_group, self.shards = diloco_shards.resolve_shards(params, process_group, mesh,
                                                                               manager, model)
        self.quorum = diloco_quorum.Replicas(manager)
        alone = manager is None and process_group is None and default_group() is None  # refused below
        if self.schedule.delay > 0 and manager is None and not alone:
            process_group = diloco_exchange.own_group(process_group)  # the exchanges in flight: a group of their own
        build = self.quorum.compressors(process_group, topology, self.schedule)
        compressors = diloco_exchange.compressors(build, rule, self.schedule.fragments, codec, error_feedback,
                                                  topology, process_group, seed)  # one per fragment: its residuals
        if alone:  # after every argument's check: a wrong argument is named first
            raise RuntimeError(NOT_INITIALISED)
        self.exchange = diloco_exchange.OuterExchange(compressors, self.quorum, rule.error_decay)
        self.process_group = process_group
        if manager is None:  # under torchft the replicas start alike (same seed) and heal from a peer's state
            self._broadcast_from_rank0()
        self.outer_step = OuterStep(self.params, rule)
        self.syncs = 0
        self.skipped = 0
        if manager is not None:  # a rejoining replica receives the anchor, outer state and counters
            self.quorum.share(self._shared_state, self._load_shared)

    # ------------------------------------------------------------------ the parts, as DiLoCo always named them
    @property
    def compressors(self) -> list[Compressor]:
        """The outer exchange's Compressors, one per fragment."""
        return self.exchange.compressors

    @property
    def compressor(self) -> Compressor:
        """The first fragment's Compressor (``fragments=1``: the one Compressor)."""
        return self.exchange.compressors[0]

    @property
    def anchor(self) -> list[torch.nn.Parameter]:
        """The anchors: the parameters as last synchronised (this rank's shards when sharded)."""
        return self.outer_step.anchor

    @property
    def outer(self) -> torch.optim.Optimizer:
        """The outer optimizer over the anchors."""
        return self.outer_step.optimizer

    @property
    def outer_kind(self) -> str:
        """``outer=``: ``"nesterov"`` or ``"sparseloco"``."""
        return self.outer_step.rule.kind

    @property
    def error_decay(self) -> float:
        """SparseLoCo's error-feedback decay (1.0: none)."""
        return self.outer_step.rule.error_decay

    @property
    def manager(self) -> Manager | None:
        """The torchft ``Manager`` (None: none)."""
        return self.quorum.manager

    @property
    def sync_every(self) -> int:
        return self.schedule.sync_every

    @property
    def fragments(self) -> int:
        return self.schedule.fragments

    @property
    def delay(self) -> int:
        return self.schedule.delay

    @property
    def mix(self) -> float:
        return self.schedule.mix

    @property
    def parts(self) -> list[list[int]]:
        """The parameters' positions by fragment."""
        return self.schedule.parts

    @property
    def inner_steps(self) -> int:
        return self.schedule.steps

    @property
    def flight(self) -> dict[int, streaming.InFlight]:
        """Fragment -> its exchange, sent and not yet applied."""
        return self.exchange.flight

    @property
    def sync_bytes(self) -> list[int]:
        """The wire bytes of each fragment's exchange, in the order they ran."""
        return self.exchange.sync_bytes

    @property
    def wait_seconds(self) -> float:
        """The training thread's waits for exchanges (at apply steps only)."""
        return self.exchange.wait_seconds

    # ------------------------------------------------------------------ optimizer interface
    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self.inner.param_groups

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.inner.zero_grad(set_to_none=set_to_none)

    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        """One inner step; then the fragments whose update is due are applied and those due are sent (the sends
        are collectives: every rank steps alike)."""
        loss = self.inner.step(closure) if closure is not None else self.inner.step()
        self._stream(self.schedule.tick())
        return loss

    @torch.no_grad()
    def sync(self) -> bool:
        """Synchronise every fragment now (send, wait, apply), whatever the schedule; with ``fragments=1`` DiLoCo's
        sync: average the outer gradients (anchor - local), step the outer optimizer, restart from the anchor.

        Returns False when some rank's outer gradient was non-finite (in some fragment): then that fragment's update
        is skipped on every rank and it restarts from its unchanged anchor (``stats()["skipped"]``).
        """
        finite = True
        for f in sorted(self.exchange.flight):  # first: no exchange runs on the courier while the training thread sends
            finite &= self._apply(f)
        for f in range(self.schedule.fragments):
            self._send(f, self.schedule.steps, now=True)
            finite &= self._apply(f)
        return finite

    def _stream(self, t: int) -> None:
        """After inner step ``t``: apply the fragments due (waiting for their exchange), then send those due."""
        for f in self.schedule.applies(self.exchange.flight, t):
            self._apply(f)
        t = self.schedule.steps  # a replica healed at that apply counts as its peers now
        blocking = self.schedule.delay == 0
        for f in self.schedule.sends(t):
            self._send(f, t, now=blocking)
            if blocking:
                self._apply(f)

    @torch.no_grad()
    def _send(self, f: int, t: int, now: bool) -> None:
        """Fragment f's outer gradients (anchor - local), handed to the exchange (``now``: exchanged at once)."""
        apply_at = self.schedule.sent(t)
        self.quorum.start()  # under torchft: who is live now; a rejoining replica heals at the decision
        keys = self.schedule.parts[f]
        self.exchange.send(f, keys, self.outer_step.gradients(keys, self.params), apply_at, now)

    @torch.no_grad()
    def _apply(self, f: int) -> bool:
        """Wait for fragment f's exchange, step its anchors by the average and blend them into the local parameters
        (``mix``). Skipped if some rank was non-finite (the fragment restarts from its anchor) or, under torchft,
        lost (not committed: the fragment keeps its local parameters)."""
        finite, flight = self.exchange.receive(f)
        keys = self.schedule.parts[f]
        self.syncs += 1
        healed = self.quorum.take_healed()
        self.schedule.applied(flight.apply_at)
        if finite:
            self.outer_step.step(keys, flight.grads)
        else:
            self.skipped += 1
        if healed:  # every fragment restarts from the anchors just received
            self.outer_step.land(self.params, range(len(self.params)), 1.0)
        elif finite:
            self.outer_step.land(self.params, keys, self.schedule.mix)
        elif not (flight.lost and self.outer_step.finite(self.params, keys)):  # some rank was non-finite
            self.outer_step.land(self.params, keys, 1.0)  # the fragment restarts from its unchanged anchor
        # else lost under torchft (a peer died in it): the fragment keeps its local parameters, whose progress its
        # next exchange sends (restarting it from its anchor would throw away every inner step since its last apply)
        return finite

    # ------------------------------------------------------------------ reporting and checkpoints
    def stats(self) -> dict:
        """``steps`` (inner), ``syncs`` (fragment syncs applied; with ``fragments=1`` whole syncs), ``skipped``
        (non-finite ones), ``raw_bytes`` (outer gradients' own size, summed over syncs), ``wire_bytes`` (what this
        rank transmitted since the start), ``ratio`` (raw / wire, per sync), ``ddp_bytes`` (what DDP's ring
        all-reduce of these parameters' gradients would have sent from this rank in as many steps: 2 (W-1)/W x their
        bytes x ``steps``, W the group's size), ``x_fewer_than_ddp`` (``ddp_bytes`` / ``wire_bytes``: per step,
        averaged over the run; ``inf`` before the first send), ``codec_seconds``, ``comm_seconds``, the Compressors'
        ``inter_node_bytes``, ``intra_node_bytes`` and ``topology``; ``fragments``, ``delay``, ``mix``,
        ``peak_sync_bytes`` (the most one fragment's exchange sent) and ``wait_seconds`` (the training thread's
        waits for exchanges)."""
        total = self.exchange.totals()
        topology = total.pop("topology")
        wire, raw = total["wire_bytes"], total["raw_bytes"]
        steps, schedule = self.schedule.steps, self.schedule
        grads = steps * sum(a.numel() * a.element_size() for a in self.anchor)  # DDP's, every step
        world = self.compressor.session.world()
        return {"steps": steps, "syncs": self.syncs, "skipped": self.skipped, **total,
                "ratio": raw / wire if wire else float("inf") if raw else 1.0, "topology": topology,
                "ddp_bytes": ddp_bytes(grads, world), "x_fewer_than_ddp": x_fewer_than_ddp(grads, wire, world),
                "fragments": schedule.fragments, "delay": schedule.delay, "mix": schedule.mix,
                "peak_sync_bytes": max(self.exchange.sync_bytes, default=0),
                "wait_seconds": self.exchange.wait_seconds, "param_bytes": 0}

    def state_dict(self) -> dict:
        """The anchor, the outer and inner optimizers' state, the residuals and the step counters
        (tensors and plain values: ``torch.load(..., weights_only=True)`` reads it). Streaming: a fragment whose
        exchange is in flight is waited for first (every rank runs it, whoever saves), and its averaged outer
        gradients are saved with the step they apply at: a resumed run applies them there, exactly (under torchft
        its commit is decided then: save on every replica at the same step). Sharded (DTensor) parameters: the
        anchors and residuals are this rank's shards, and ``"shards"`` their layout, which the load checks (one
        file per rank)."""
        exchange, schedule = self.exchange, self.schedule
        finished = {f: exchange.settled(f) for f in list(exchange.flight)}  # first: their Compressors commit
        state = {"anchor": self.outer_step.anchors(), "outer": self.outer.state_dict(),
                 "inner": self.inner.state_dict(), "compressor": self.compressor.state_dict(),
                 "inner_steps": schedule.steps, "syncs": self.syncs, "skipped": self.skipped}
        if self.shards is not None:  # the local shards' layout, checked at the load
            state["shards"] = self.shards.layout
        if self.outer_kind != "nesterov":  # (the nesterov state dict stays what it always was)
            state["outer_kind"] = self.outer_kind
        if schedule.fragments > 1 or schedule.delay > 0:
            state["streaming"] = {
                "fragments": schedule.fragments, "delay": schedule.delay,
                "compressors": [c.state_dict() for c in exchange.compressors],
                "in_flight": exchange.in_flight_state(finished)}
        return state

    def load_state_dict(self, state: dict) -> None:
        saved = state.get("outer_kind", "nesterov")
        if saved != self.outer_kind:
            raise ValueError(f"DiLoCo: the checkpoint was saved with outer={saved!r}, this DiLoCo has "
                             f"outer={self.outer_kind!r}; resume with the same outer")
        stream = state.get("streaming", {"fragments": 1, "delay": 0})
        fragments, delay = self.schedule.fragments, self.schedule.delay
        if (stream["fragments"], stream["delay"]) != (fragments, delay):
            raise ValueError(f"DiLoCo: the checkpoint was saved with fragments={stream['fragments']}, "
                             f"delay={stream['delay']}; this DiLoCo has fragments={fragments}, "
                             f"delay={delay}; resume with the same")
        diloco_shards.check_shards(self.shards, state.get("shards"))
        self.outer_step.load(state["anchor"], state["outer"])
        self.inner.load_state_dict(state["inner"])
        for comp, saved in zip(self.exchange.compressors, stream.get("compressors", [state["compressor"]])):
            comp.load_state_dict(saved)
        self.exchange.restore(stream.get("in_flight", []))
        self.schedule.resume(int(state["inner_steps"]))
        self.syncs = int(state["syncs"])
        self.skipped = int(state.get("skipped", 0))

    def close(self) -> None:
        """Wait for the exchanges in flight and stop the streaming thread (also done at interpreter exit)."""
        self.exchange.close()

    # ------------------------------------------------------------------ torchft's state transfer
    def _shared_state(self) -> dict:
        """What a rejoining replica receives (from torchft's quorum thread, during this replica's exchange: copies,
        no collective). Nothing else is in flight then (:func:`_check_combination`: one exchange at a time, applied
        before the next send), and the training thread touches the anchors and the outer state only when applying
        this exchange, which waits for the quorum: they are the state before it. The step count is agreed in
        the exchange itself (:meth:`streaming.Schedule.agree`)."""
        return {**self.outer_step.shared_state(), "syncs": self.syncs, "skipped": self.skipped}

    def _load_shared(self, state: dict) -> None:
        """A peer's :meth:`_shared_state` (torchft heals this replica inside ``should_commit``, which the exchange
        asks just before the apply): every fragment restarts from its anchor at that apply."""
        self.outer_step.load(state["anchor"], state["outer"])
        self.syncs, self.skipped = state["syncs"], state["skipped"]

    @torch.no_grad()
    def _broadcast_from_rank0(self) -> None:
        group = self.process_group
        src = dist.get_global_rank(group, 0) if group is not None else 0
        for p in self.params:
            dist.broadcast(p.data, src=src, group=group)


def _check_inner(sync_every, inner_optimizer) -> None:
    """``sync_every`` and the inner optimizer checked."""
    if isinstance(sync_every, bool) or not isinstance(sync_every, numbers.Integral) or sync_every < 1:
        raise ValueError(f"DiLoCo: sync_every must be an integer >= 1, got {sync_every!r}")
    if not isinstance(inner_optimizer, torch.optim.Optimizer):
        raise ValueError(f"DiLoCo: inner_optimizer must be a torch.optim.Optimizer, got "
                         f"{type(inner_optimizer).__name__}")


def _check_combination(schedule: streaming.Schedule, manager, model_or_params, codec) -> None:
    """What DiLoCo refuses to combine, each with the reason."""
    fragments, delay, sync_every = schedule.fragments, schedule.delay, schedule.sync_every
    if manager is not None and delay > sync_every // fragments:
        raise ValueError(f"DiLoCo: under torchft (manager=...) each fragment's exchange is one torchft step, and a "
                         f"Manager runs one step at a time: a fragment must be applied before the next is sent, so "
                         f"delay must be at most sync_every // fragments ({sync_every // fragments}); got "
                         f"delay={delay}")
    if delay > 0 and isinstance(model_or_params, torch.nn.parallel.DistributedDataParallel):
        raise ValueError("DiLoCo: delay > 0 with a model wrapped in DDP is not supported: DDP's all-reduce and "
                         "the overlapped outer exchange would share the node's group; use delay=0")
    if is_auto(codec):
        raise ValueError("DiLoCo: codec='auto' is not supported: the autopilot decides each step's codec from "
                         "the step's own link and compute measurements, and DiLoCo syncs once every sync_every "
                         "steps; name a codec (e.g. 'int4')")


__all__ = ["DiLoCo", "NOT_INITIALISED", "OUTERS", "SPARSELOCO_CODEC", "SPARSELOCO_ERROR_DECAY", "SPARSELOCO_OUTER_LR",
           "check_outer"]
