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

import itertools
import numbers
import time

import torch
import torch.distributed as dist

from ..collectives import LocalCollectives
from ..compressor import Compressor
from ..config import is_auto
from ..quorum import under
from ..session import default_group
from ..scheme import DILOCO_OUTERS, split_compressor_options
from ..spec import make
from . import streaming

#: the outer updates DiLoCo knows: DiLoCo's own (SGD with Nesterov momentum) and SparseLoCo's
OUTERS = DILOCO_OUTERS
#: SparseLoCo's outer-gradient codec: chunked top-k, 64 of every 4096 elements (1.5625 %), 2-bit values
SPARSELOCO_CODEC = "topk:ratio=0.015625,chunk=4096,values=int2"
#: SparseLoCo's error-feedback decay (beta) and outer learning rate (alpha)
SPARSELOCO_ERROR_DECAY = 0.95
SPARSELOCO_OUTER_LR = 1.0


def ddp_nodes(ddp, process_group) -> int:
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
            ``torch.distributed`` (and no group given) DiLoCo runs as a single process: its syncs
            run the same code on :class:`gradcompress.collectives.LocalCollectives` and send nothing.
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
            fragment restarts from its anchor; a replica that joins heals at its first exchange (the exchange
            fails if it sent another fragment than its peers) and restarts every fragment from the anchors.

    At construction every rank starts from rank 0's parameters (one broadcast). ``step()``
    runs the inner optimizer's step and, every ``sync_every`` calls, the sync;
    ``zero_grad()`` forwards to the inner optimizer, and ``param_groups`` is the inner
    optimizer's, so LR schedulers keep working on either.
    """

    def __init__(self, model_or_params, inner_optimizer: torch.optim.Optimizer, *, sync_every: int,
                 codec=None, outer: str = "nesterov", outer_lr: float | None = None, outer_momentum: float = 0.9,
                 nesterov: bool = True, error_decay: float | None = None, outer_optimizer=None,
                 error_feedback="auto", process_group=None, seed: int = 0, topology=None, manager=None,
                 fragments: int = 1, delay: int = 0, mix: float | None = None):
        self.outer_kind = check_outer(outer)
        sparse = self.outer_kind == "sparseloco"
        outer_lr = _check_numbers(sync_every, inner_optimizer, outer_lr, outer_momentum, sparse)
        self.error_decay = _error_decay(error_decay, sparse)
        if isinstance(model_or_params, torch.nn.parallel.DistributedDataParallel):
            per_node = ddp_nodes(model_or_params, process_group)
            topology = per_node if topology is None else topology
        self.params = _params_of(model_or_params)
        self.inner = inner_optimizer
        self.sync_every = int(sync_every)
        layers = _layers_of(model_or_params, self.params)
        self.fragments, self.delay, self.mix = streaming.check(fragments, delay, mix, self.sync_every, len(layers))
        _check_combination(self.fragments, self.delay, manager, model_or_params, codec, self.sync_every)
        self.manager = manager
        if self.delay > 0 and manager is None and (process_group is not None or default_group() is not None):
            # the exchanges in flight get a group of their own: collectives the training thread issues meanwhile
            # (a logged loss, a barrier) cannot interleave with them
            process_group = _own_group(process_group)
        build = Compressor if manager is None else _managed(manager, process_group, topology, _Schedule(self))
        if sparse:
            def make():
                return _sparseloco_compressor(codec, outer_optimizer, error_feedback, topology, process_group, seed,
                                              build)
        else:
            def make():
                return build("none" if codec is None else codec, process_group=process_group,
                             error_feedback=error_feedback, seed=seed, topology="auto" if topology is None else topology)
        self.compressors = [make() for _ in range(self.fragments)]  # one per fragment: its own residuals
        self.compressor = self.compressors[0]  # fragments=1: the one Compressor
        self.parts = streaming.fragments_of(layers, self.fragments)
        self.flight: dict[int, streaming.InFlight] = {}  # fragment -> sent, not yet applied
        self.courier = streaming.Courier()
        self.sync_bytes: list[int] = []  # wire bytes of each fragment's exchange, in the order they ran
        self.wait_seconds = 0.0  # the training thread's waits for exchanges (at apply steps only)
        self.process_group = process_group
        # without torch.distributed (and no group): a single process, its syncs on explicit local collectives
        local = manager is None and process_group is None and default_group() is None
        self._local = LocalCollectives(1) if local else None
        if manager is None:  # under torchft the replicas start alike (same seed) and heal from a peer's state
            self._broadcast_from_rank0()
        self.anchor = [torch.nn.Parameter(p.detach().clone(), requires_grad=False) for p in self.params]
        self.outer = _outer_optimizer(self.anchor, sparse, outer_lr, outer_momentum, nesterov, outer_optimizer)
        self.inner_steps = 0
        self.syncs = 0
        self.skipped = 0
        self.sent_at = 0  # the inner step of the latest send (its position in the schedule)
        self.agreed: int | None = None  # under torchft: the quorum's position for that send (_Schedule.agree)
        self.healed = False  # under torchft: this replica took a peer's anchors in the exchange in flight
        if manager is not None:  # a rejoining replica receives the anchor, outer state and counters
            manager.register_state_dict_fn(f"{self.compressor.coordinator.state_key}.diloco", self._load_shared,
                                           self._shared_state)

    # ------------------------------------------------------------------ optimizer interface
    @property
    def param_groups(self):
        return self.inner.param_groups

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.inner.zero_grad(set_to_none=set_to_none)

    def step(self, closure=None):
        """One inner step; then the fragments whose update is due are applied and those due are sent (the sends
        are collectives: every rank steps alike)."""
        loss = self.inner.step(closure) if closure is not None else self.inner.step()
        self.inner_steps += 1
        self._stream(self.inner_steps)
        return loss

    @torch.no_grad()
    def sync(self) -> bool:
        """Synchronise every fragment now (send, wait, apply), whatever the schedule; with ``fragments=1`` DiLoCo's
        sync: average the outer gradients (anchor - local), step the outer optimizer, restart from the anchor.

        Returns False when some rank's outer gradient was non-finite (in some fragment): then that fragment's update
        is skipped on every rank and it restarts from its unchanged anchor (``stats()["skipped"]``).
        """
        finite = True
        for f in sorted(self.flight):  # first: no exchange runs on the courier while the training thread sends
            finite &= self._apply(f)
        for f in range(self.fragments):
            self._send(f, self.inner_steps, now=True)
            finite &= self._apply(f)
        return finite

    def _stream(self, t: int) -> None:
        """After inner step ``t``: apply the fragments due (waiting for their exchange), then send those due."""
        for f in range(self.fragments):
            flight = self.flight.get(f)
            if flight is not None and flight.apply_at <= t:
                self._apply(f)
        t = self.inner_steps  # a replica healed at that apply counts as its peers now
        for f in range(self.fragments):
            if streaming.due(t, f, self.fragments, self.sync_every):
                self._send(f, t, now=self.delay == 0)
                if self.delay == 0:
                    self._apply(f)

    @torch.no_grad()
    def _send(self, f: int, t: int, now: bool) -> None:
        """Fragment f's outer gradients (anchor - local), handed to the courier (``now``: exchanged at once)."""
        self.sent_at = t
        if self.manager is not None:
            self.manager.start_quorum()  # who is live now; a rejoining replica heals at should_commit below
        keys = self.parts[f]
        grads = [(self.anchor[i].detach() - self.params[i].detach()).to(self.anchor[i].dtype) for i in keys]
        comp = self.compressors[f]
        if self.outer_kind == "sparseloco" and self.error_decay != 1.0:
            self._decay_residuals(comp, keys, grads)

        def exchange():
            before = comp.stats()["wire_bytes"]
            with comp.step(self._local) as step:
                step.drive([step.exchange(keys, grads)])
            self.sync_bytes.append(comp.stats()["wire_bytes"] - before)
            return step if self.manager is not None else bool(step.committed)  # torchft: decided at the apply

        self.flight[f] = streaming.InFlight(f, grads, t + self.delay, self.courier.send(exchange, now))

    @torch.no_grad()
    def _apply(self, f: int) -> bool:
        """Wait for fragment f's exchange, step its anchors by the average (skipped if some rank was non-finite),
        blend them into the local parameters (``mix``)."""
        finite = self._settled(f)
        flight = self.flight.pop(f)
        keys = self.parts[f]
        self.syncs += 1
        healed, self.healed = self.healed, False
        agreed, self.agreed = self.agreed, None
        if agreed is not None:  # count as the quorum did (its send step, plus the steps since this one's send)
            self.inner_steps = agreed + self.inner_steps - (flight.apply_at - self.delay)
        if finite:
            for i, g in zip(keys, flight.grads):
                self.anchor[i].grad = g
            self.outer.step()
            for i in keys:
                self.anchor[i].grad = None
        else:
            self.skipped += 1
        for i in range(len(self.params)) if healed else keys:  # healed: every fragment restarts from its anchor
            if self.mix == 1.0 or not finite or healed:  # so does a skipped one
                self.params[i].copy_(self.anchor[i])
            else:
                self.params[i].mul_(1.0 - self.mix).add_(self.anchor[i], alpha=self.mix)
        return finite

    def _settled(self, f: int) -> bool:
        """Fragment f's exchange waited for and, under torchft, decided: whether its update applies. The Manager
        is asked (``should_commit``) here, in the training thread, never in the courier's: healing a replica
        loads the user's state too (the Manager's ``load_state_dict``), which must not run during a backward."""
        flight = self.flight[f]
        start = time.perf_counter()
        outcome = flight.result.result()
        if not isinstance(outcome, bool):  # a step under torchft, closed and waiting for the Manager's decision
            agreed = self.manager.should_commit()
            outcome.decide(agreed)
            outcome = bool(agreed and outcome.finite)
            self.flight[f] = flight._replace(result=streaming.done(outcome))
        self.wait_seconds += time.perf_counter() - start
        return outcome

    # ------------------------------------------------------------------ reporting and checkpoints
    def stats(self) -> dict:
        """``steps`` (inner), ``syncs`` (fragment syncs applied; with ``fragments=1`` whole syncs), ``skipped``
        (non-finite ones), ``raw_bytes`` (outer gradients' own size, summed over syncs), ``wire_bytes`` (what this
        rank transmitted since the start), ``ratio``, ``codec_seconds``, ``comm_seconds``, the Compressors'
        ``inter_node_bytes``, ``intra_node_bytes`` and ``topology``; ``fragments``, ``delay``, ``mix``,
        ``peak_sync_bytes`` (the most one fragment's exchange sent) and ``wait_seconds`` (the training thread's
        waits for exchanges)."""
        every = [c.stats() for c in self.compressors]
        total = {k: sum(st[k] for st in every) for k in ("raw_bytes", "wire_bytes", "codec_seconds",
                                                             "comm_seconds", "inter_node_bytes", "intra_node_bytes")}
        wire, raw = total["wire_bytes"], total["raw_bytes"]
        return {"steps": self.inner_steps, "syncs": self.syncs, "skipped": self.skipped, **total,
                "ratio": raw / wire if wire else float("inf") if raw else 1.0, "topology": every[0]["topology"],
                "fragments": self.fragments, "delay": self.delay, "mix": self.mix,
                "peak_sync_bytes": max(self.sync_bytes, default=0), "wait_seconds": self.wait_seconds,
                "param_bytes": 0}

    def state_dict(self) -> dict:
        """The anchor, the outer and inner optimizers' state, the residuals and the step counters
        (tensors and plain values: ``torch.load(..., weights_only=True)`` reads it). Streaming: a fragment whose
        exchange is in flight is waited for first (every rank runs it, whoever saves), and its averaged outer
        gradients are saved with the step they apply at: a resumed run applies them there, exactly (under torchft
        its commit is decided then: save on every replica at the same step)."""
        finished = {f: self._settled(f) for f in list(self.flight)}  # first: their Compressors commit
        state = {"anchor": [a.detach().clone() for a in self.anchor], "outer": self.outer.state_dict(),
                 "inner": self.inner.state_dict(), "compressor": self.compressor.state_dict(),
                 "inner_steps": self.inner_steps, "syncs": self.syncs, "skipped": self.skipped}
        if self.outer_kind != "nesterov":  # (the nesterov state dict stays what it always was)
            state["outer_kind"] = self.outer_kind
        if self.fragments > 1 or self.delay > 0:
            flights = [self.flight[f] for f in sorted(self.flight)]
            state["streaming"] = {
                "fragments": self.fragments, "delay": self.delay,
                "compressors": [c.state_dict() for c in self.compressors],
                "in_flight": [{"fragment": x.fragment, "apply_at": x.apply_at, "finite": bool(finished[x.fragment]),
                               "grads": [g.clone() for g in x.grads]} for x in flights]}
        return state

    def load_state_dict(self, state: dict) -> None:
        saved = state.get("outer_kind", "nesterov")
        if saved != self.outer_kind:
            raise ValueError(f"DiLoCo: the checkpoint was saved with outer={saved!r}, this DiLoCo has "
                             f"outer={self.outer_kind!r}; resume with the same outer")
        stream = state.get("streaming", {"fragments": 1, "delay": 0})
        if (stream["fragments"], stream["delay"]) != (self.fragments, self.delay):
            raise ValueError(f"DiLoCo: the checkpoint was saved with fragments={stream['fragments']}, "
                             f"delay={stream['delay']}; this DiLoCo has fragments={self.fragments}, "
                             f"delay={self.delay}; resume with the same")
        with torch.no_grad():
            for a, saved in zip(self.anchor, state["anchor"]):
                a.copy_(saved)
        self.outer.load_state_dict(state["outer"])
        self.inner.load_state_dict(state["inner"])
        for comp, saved in zip(self.compressors, stream.get("compressors", [state["compressor"]])):
            comp.load_state_dict(saved)
        self.flight = {x["fragment"]: streaming.InFlight(x["fragment"], [g.clone() for g in x["grads"]],
                                                         x["apply_at"], streaming.done(x["finite"]))
                       for x in stream.get("in_flight", [])}
        self.inner_steps, self.syncs = int(state["inner_steps"]), int(state["syncs"])
        self.skipped = int(state.get("skipped", 0))

    def close(self) -> None:
        """Wait for the exchanges in flight and stop the streaming thread (also done at interpreter exit)."""
        self.courier.close()

    # ------------------------------------------------------------------ torchft's state transfer
    def _shared_state(self) -> dict:
        """What a rejoining replica receives (from torchft's quorum thread, during this replica's exchange: copies,
        no collective). Nothing else is in flight then (:func:`_check_combination`: one exchange at a time, applied
        before the next send), and the training thread touches the anchors and the outer state only when applying
        this exchange, which waits for the quorum: they are the state before it. The step count is agreed in
        the exchange itself (:meth:`agree`)."""
        return {"anchor": [a.detach().clone() for a in self.anchor], "outer": _cloned(self.outer.state_dict()),
                "syncs": self.syncs, "skipped": self.skipped}

    @torch.no_grad()
    def _load_shared(self, state: dict) -> None:
        """A peer's :meth:`_shared_state` (torchft heals this replica inside ``should_commit``, which
        :meth:`_settled` asks just before the apply): every fragment restarts from its anchor at that apply."""
        for a, saved in zip(self.anchor, state["anchor"]):
            a.copy_(saved)
        self.outer.load_state_dict(state["outer"])
        self.syncs, self.skipped = state["syncs"], state["skipped"]
        self.healed = True

    # ------------------------------------------------------------------ internals
    def _decay_residuals(self, comp, keys: list[int], outer_grads: list[torch.Tensor]) -> None:
        """SparseLoCo's ``e <- beta e + delta`` through the Compressor's error feedback, which compresses
        ``x + e``: ``x = delta - (1 - beta) e`` (in place). The committed residuals are only read."""
        residuals = comp.residual
        for key, g in zip(keys, outer_grads):
            e = residuals.get(key)
            if e is not None and e.shape == g.shape:
                g.sub_(e.to(g.dtype), alpha=1.0 - self.error_decay)

    @torch.no_grad()
    def _broadcast_from_rank0(self) -> None:
        group = self.process_group
        if group is None and default_group() is None:
            return  # a single process
        src = dist.get_global_rank(group, 0) if group is not None else 0
        for p in self.params:
            dist.broadcast(p.data, src=src, group=group)


def check_outer(outer) -> str:
    """``outer=``: one of :data:`OUTERS`; ``ValueError`` naming them otherwise."""
    if not isinstance(outer, str) or outer not in OUTERS:
        raise ValueError(f"DiLoCo: outer must be one of {', '.join(OUTERS)}, got {outer!r}")
    return outer


def _error_decay(value, sparse: bool) -> float:
    """The error-feedback decay: sparseloco's (default :data:`SPARSELOCO_ERROR_DECAY`), in [0, 1]."""
    if value is None:
        return SPARSELOCO_ERROR_DECAY if sparse else 1.0
    if not sparse:
        raise ValueError("DiLoCo: error_decay applies to outer='sparseloco' only")
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not 0 <= value <= 1:
        raise ValueError(f"DiLoCo: error_decay must be a number in [0, 1], got {value!r}")
    return float(value)


def _check_numbers(sync_every, inner_optimizer, outer_lr, outer_momentum, sparse: bool) -> float:
    """``sync_every``, the inner optimizer and the outer numbers checked; the outer learning rate (its default)."""
    if isinstance(sync_every, bool) or not isinstance(sync_every, numbers.Integral) or sync_every < 1:
        raise ValueError(f"DiLoCo: sync_every must be an integer >= 1, got {sync_every!r}")
    if not isinstance(inner_optimizer, torch.optim.Optimizer):
        raise ValueError(f"DiLoCo: inner_optimizer must be a torch.optim.Optimizer, got "
                         f"{type(inner_optimizer).__name__}")
    if outer_lr is None:
        outer_lr = SPARSELOCO_OUTER_LR if sparse else 0.7
    for name, value in (("outer_lr", outer_lr), ("outer_momentum", outer_momentum)):
        if isinstance(value, bool) or not isinstance(value, numbers.Real) or value < 0:
            raise ValueError(f"DiLoCo: {name} must be a number >= 0, got {value!r}")
    return outer_lr


def _outer_optimizer(anchor, sparse: bool, lr, momentum, nesterov, make) -> torch.optim.Optimizer:
    """SparseLoCo's plain SGD, DiLoCo's SGD with Nesterov momentum, or the user's ``make(anchor)``."""
    if sparse:  # no outer momentum: the decayed error-feedback buffer is the outer memory
        return torch.optim.SGD(anchor, lr=lr, momentum=0.0)
    if make is None:
        return torch.optim.SGD(anchor, lr=lr, momentum=momentum, nesterov=bool(nesterov) and momentum > 0)
    outer = make(anchor)
    if not isinstance(outer, torch.optim.Optimizer):
        raise ValueError("DiLoCo: outer_optimizer must return a torch.optim.Optimizer over the anchors")
    return outer


def _check_combination(fragments: int, delay: int, manager, model_or_params, codec, sync_every: int) -> None:
    """What DiLoCo refuses to combine, each with the reason."""
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


def _own_group(group):
    """A new process group of ``group``'s ranks (None: the world), created by those ranks only."""
    ranks = dist.get_process_group_ranks(group) if group is not None else list(range(dist.get_world_size()))
    return dist.new_group(ranks, use_local_synchronization=True)


def _cloned(value):
    """A copy of a (nested) state dict's tensors."""
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    if isinstance(value, dict):
        return {k: _cloned(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_cloned(v) for v in value)
    return value


class _Schedule:
    """A DiLoCo's fragment schedule as its quorum sees it (:func:`gradcompress.quorum.under`'s ``schedule``)."""

    def __init__(self, opt: DiLoCo):
        self.opt = opt

    def position(self) -> int:
        """The inner step of the send being exchanged: where the replica is in the fragment schedule."""
        return self.opt.sent_at

    def agree(self, position: int) -> None:
        """The quorum's position for the send being exchanged (its first participating member's): the replica
        counts from it once the exchange is applied (one that joined or missed a quorum, whose sends would not
        pair with its peers', takes up their schedule; the exchange fails if they sent different fragments)."""
        self.opt.agreed = position


def _managed(manager, process_group, topology, schedule):
    """The Compressor class for DiLoCo under torchft's ``manager`` (its outer exchange on the live quorum)."""

    if process_group is not None or topology not in (None, "auto", "flat"):
        raise ValueError("DiLoCo: under torchft (manager=...) the outer exchange runs between the replicas of the "
                         "quorum: process_group and a hierarchical topology do not apply")

    phases = itertools.count()  # fragment f's Compressor is built f-th: its exchanges are phase f

    def build(codec, *, process_group=None, topology=None, **options):
        coordinator = under(manager, phase=next(phases), schedule=schedule)
        return Compressor(codec, topology="flat", coordinator=coordinator, **options)

    return build


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


__all__ = ["DiLoCo", "OUTERS", "SPARSELOCO_CODEC", "SPARSELOCO_ERROR_DECAY", "SPARSELOCO_OUTER_LR", "check_outer"]
