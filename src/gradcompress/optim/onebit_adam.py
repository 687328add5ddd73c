"""1-bit Adam (Tang et al., 2021, "1-bit Adam: Communication Efficient Large-Scale
Training with Adam's Convergence Speed"), as in DeepSpeed's ``OnebitAdam``.

Two phases, per parameter, decided by the parameter's own step count:

* **warm-up** (the first ``warmup_steps`` steps): the local gradients are averaged by a
  dense float32 all-reduce and plain Adam runs on the average. This is
  ``torch.optim.Adam`` exactly (same operations, same bias correction, same L2 weight
  decay added to the gradient), so with the same averaged gradient the parameters
  match ``torch.optim.Adam`` up to floating-point rounding of the all-reduce.
* **compression** (afterwards): the variance ``exp_avg_sq`` is frozen. Each rank updates
  the momentum from its *local* gradient, ``m_t = b1 m + (1 - b1) g``, and the momenta
  are averaged by the two-step compressed all-reduce of :func:`gradcompress.exchanges.twostep.two_step_mean`
  with the ``sign`` codec (one bit per element plus one float32 scale per 512
  elements):

  1. worker side: ``x = m_t + worker_error``; ``x`` is cut into ``world`` chunks and
     each chunk is 1-bit encoded; ``worker_error = x - decode(encode(x))``;
  2. all-to-all: rank j receives every rank's chunk j, decodes and averages them,
     adds its server residual ``server_error`` (one per parameter, of the chunk's size,
     :func:`gradcompress.exchanges.layout.chunk_numel`), re-encodes, and keeps
     ``server_error = input - decode(encoded)``;
  3. all-gather of the re-encoded chunks: every rank decodes the same bytes, so the
     averaged momentum, which becomes the new ``exp_avg``, is bit-identical everywhere.

  The update is ``p -= lr / (1 - b1^t) * m / (sqrt(v_frozen) / sqrt(1 - b2^T_w) + eps)``.

Bias correction (a choice, documented): DeepSpeed's ``OnebitAdam`` applies none. Here the
warm-up uses Adam's correction so that it equals ``torch.optim.Adam``; after warm-up
the momentum keeps Adam's ``1 - b1^t`` (t: the parameter's step, so it fades to 1) and
the frozen variance keeps the correction of the step it was frozen at,
``1 - b2^warmup_steps``, i.e. the update continues from exactly the Adam denominator
of the last warm-up step. With ``warmup_steps=0`` the variance is never estimated: it
stays zero, the correction is taken as 1 and the update is ``lr * m / eps`` (1-bit
momentum SGD with learning rate ``lr / eps``); use a warm-up for Adam behaviour.

Bytes: a compressed step sends about ``2 (W-1)/W * (n/8 + 4 n/512)`` bytes for n
momentum elements (plus the rounding of each parameter's chunks to whole bytes), about
1/30 of a dense float32 all-reduce's ``2 (W-1)/W * 4 n``. The codec keeps its default
bucket of 512 elements: that already gives 1/30, and smaller buckets keep the scales
closer to the data than DeepSpeed's one scale per chunk.

Non-finite values: a step whose averaged gradient (warm-up) or averaged momentum
(compression) holds an Inf or NaN is skipped on every rank (every rank sees the same
averaged values, so the decision is the same everywhere): no state changes, no
parameter update, counted in ``stats()["skipped"]``. This keeps the error buffers
from being poisoned for good; it differs from ``torch.optim.Adam``, which would write
the NaN into the parameters.

Coordinates with a tiny or zero frozen variance (the default ``eps`` is safe): the 1-bit
momentum of a coordinate has the size of its bucket's mean |m|, not its own, so a
coordinate whose variance is far below the rest would move by about lr * scale / eps
after the freeze and the run would diverge (digits, 4 workers, lr 2e-3, 30 warm-up steps,
eps 1e-8: the loss is NaN at step 41 without a remedy; 97.33 % with the mask below alone,
97.11 % with the floor alone and with both). At the freeze, positive variances are therefore lifted
to at least ``(VARIANCE_FLOOR * mean sqrt(v))^2`` of their tensor, which bounds every
update to about 1/VARIANCE_FLOOR times a typical one, and coordinates whose variance is
exactly zero (no gradient through the whole warm-up, e.g. weights of constant inputs)
are masked: their momentum is zeroed and they do not move (DeepSpeed's ``exp_avg_mask``
idea, computed instead of configured). With ``warmup_steps=0`` nothing is estimated,
so nothing is floored or masked.

Local steps (0/1 Adam's "1-bit sync", Lu et al., ICLR 2023), ``sync_every=k``: after the freeze each rank
synchronises a parameter only at every k-th compressed step of it (``sync_ramp_steps=R``: 0/1 Adam's growing
schedule instead, the interval 1 for the first R compressed steps, then 2, 4, ... doubling every R steps up to k;
:func:`sync_due`). The schedule is a function of the parameter's step count, so it is the same on every rank.
Between syncs each rank steps with its *local* momentum ``m = b1 m + (1 - b1) g_local``, ``p -= s_t m / d``
(``s_t = lr / (1 - b1^t)``, ``d`` the frozen denominator), nothing sent, and accumulates ``U = sum s_t m_t``;
it keeps the parameters of the last sync (the ``anchor``, one float32 copy). At a sync step T it sends
``M = m_T + U / s_T`` (the interval's updates in units of this step's step size; ``M = m_T`` after no local step)
through the same compressed exchange (error feedback included), and every rank sets
``p = anchor - s_T * mean(M) / d`` and ``m = mean(M) * s_T / S`` (S: the interval's summed step sizes: the
step-size-weighted mean momentum, 0/1 Adam's momentum estimate). The replicas are bit-identical after every sync
(the same anchor, averaged bytes and denominator everywhere); between syncs they differ. With ``sync_every=1``
(the default) every step is a sync with no local step: exactly the compressed step above. Bytes: only sync steps
send (about 1/k of the compressed steps' bytes). A non-finite local momentum on a local step leaves that rank's
momentum and parameter as they were (the step still counts, so the schedule stays the same everywhere); a
non-finite average at a sync skips the step everywhere. When to use it: links so slow that even 1-bit steps
wait; the price is the drift of k local Adam steps between syncs (k 2 to 8 on the LM task, README).

The exchange is a :class:`gradcompress.Compressor` step (:mod:`gradcompress.step`) with
the ``sign`` codec, worker and server error feedback and ``min_numel=0``; the residuals
live in this optimizer's state (``worker_error``, ``server_error``), their only owner: the
Compressor's state slots are views of it (:class:`~.adam_slots.ParamState`), so checkpoints hold them and
a non-finite step commits nothing.
"""

from __future__ import annotations

import warnings
from typing import TYPE_CHECKING, Any
from itertools import chain

import torch

from .. import topology as topology_mod
from ..collectives import LocalCollectives
from ..compressor import Compressor
from ..exchanges.hierarchical import piece_key, piece_numel
from ..exchanges.layout import chunk_numel
from ..spec import make
from .adam_checks import check_hyperparameters, check_schedule, momentum_codec
from .adam_slots import ParamState
from .exchanging import ExchangingOptimizer, refuse_manager

if TYPE_CHECKING:
    import torch.distributed as dist
    from torch.optim.optimizer import ParamsT
    from torchft.manager import Manager

    from ..config import Spec, TopologyOption

#: the momentum codec: one sign bit per element and one float32 scale (mean |x|) per 512 elements
CODEC_SPEC = "sign:bucket=512"
#: at the freeze, positive variances are lifted to at least (this x the tensor's mean sqrt(v))^2
VARIANCE_FLOOR = 0.1
#: parameter dtypes OneBitAdam accepts (the optimizer state is float32 for all of them)
PARAM_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
#: what each parameter's state holds (all float32 tensors; ``lowrank_q``/``lowrank_p`` only with powersgd)
STATE_KEYS = ("step", "exp_avg", "exp_avg_sq", "worker_error", "server_error")
#: what a parameter's state holds between two syncs with local steps (``sync_every > 1``); gone after a sync
LOCAL_STATE_KEYS = ("anchor", "local_update", "local_step_sizes")
#: the exchange's per-parameter state (Compressor slot -> our state key), seen by the Compressor through views
SLOT_STATE = {"residual": "worker_error", "server_residual": "server_error", "q": "lowrank_q", "p": "lowrank_p"}


def sync_due(compressed_step: int, sync_every: int, sync_ramp_steps: int = 0) -> bool:
    """Whether a parameter's ``compressed_step``-th step after the freeze (1, 2, ...) is a sync step.

    Fixed schedule (``sync_ramp_steps=0``): every ``sync_every``-th. Growing (0/1 Adam's): the interval is
    ``min(sync_every, 2 ** ((compressed_step - 1) // sync_ramp_steps))`` and a step syncs when the interval
    divides it (interval 1 for the first ramp steps, then 2, 4, ... up to ``sync_every``)."""
    interval = sync_every
    if sync_ramp_steps > 0:
        doublings = (compressed_step - 1) // sync_ramp_steps
        if doublings < sync_every.bit_length():
            interval = min(sync_every, 2**doublings)
    return compressed_step % interval == 0


# ------------------------------------------------------------------------ the optimizer
class CompressedAdam(ExchangingOptimizer):
    """Adam whose momentum is averaged across ranks through a codec after a dense warm-up.

    ``CompressedAdam(params, codec="sign:bucket=512")`` is 1-bit Adam (:class:`OneBitAdam`);
    any other codec (``"topk:ratio=0.01,values=int8"``, ``"powersgd:rank=4"``, ``"int4"``)
    compresses the momentum instead of the sign: "compress after Adam's preconditioning".
    Why it beats compressing the gradient under Adam: once the variance is frozen the
    update ``m / sqrt(v)`` is linear in the exchanged momentum, so error feedback delivers
    what it delays (as it does for SGD); a compressed *gradient* fed to Adam is instead
    normalised per coordinate, so a coordinate that error feedback sends rarely but large
    moves by about ``lr`` whatever it accumulated.

    See the module documentation for the algorithm, the bias correction and the bytes.

    The optimizer averages the gradients itself, so the model must **not** also be
    averaged by ``DistributedDataParallel``: use the bare module, or call ``backward``
    inside ``ddp_model.no_sync()`` on every step. Every rank calls :meth:`step` at the
    same time, with gradients for the same parameters (a parameter whose ``.grad`` is
    None is skipped, as in ``torch.optim.Adam``, and must be None on every rank), and
    the parameters must start identical on every rank (same seed, or broadcast them).
    The ``.grad`` tensors are left as they were (local gradients)::

        import torch.distributed as dist
        from gradcompress.optim import OneBitAdam

        dist.init_process_group("gloo")            # or nccl; torchrun sets the rest
        model = Net()                              # NOT wrapped in DistributedDataParallel
        for p in model.parameters():
            dist.broadcast(p.data, src=0)          # identical start on every rank
        opt = OneBitAdam(model.parameters(), lr=1e-3, warmup_steps=1000)
        for x, y in loader:                        # each rank its own shard of the data
            opt.zero_grad()
            loss_fn(model(x), y).backward()        # local gradients only
            opt.step()                             # dense Adam, then 1-bit momentum exchange

        # checkpoints: the error buffers differ per rank, so every rank saves its own
        torch.save(opt.state_dict(), f"opt-rank{dist.get_rank()}.pt")

    Args:
        params: parameters or parameter groups (float32, float16 or bfloat16; the state
            is float32 whatever the parameter dtype, the update is written back in the
            parameter's dtype). Groups may override every argument but ``process_group``.
        lr: learning rate (>= 0).
        betas: (beta1, beta2), each in [0, 1).
        eps: added to the denominator (> 0).
        weight_decay: L2 penalty added to the gradient, as in ``torch.optim.Adam``
            (during warm-up and after: after warm-up to the local gradient before the
            momentum, which gives the same result since the parameters are identical).
        warmup_steps: dense Adam steps before the variance is frozen (integer >= 0).
        process_group: the group to average over (default: the world). Without an
            initialised ``torch.distributed`` (and no group given) the optimizer runs as
            a single process; a group of size 1 does the same. A single process sends
            nothing but runs the same code, compression and error feedback included.
        sync_every: local steps (module doc): after the freeze, synchronise each parameter only every
            ``sync_every``-th step (integer >= 1; 1, the default: every step, as without the option).
        sync_ramp_steps: 0 (default): the fixed interval ``sync_every`` from the freeze on; R > 0: 0/1 Adam's
            growing interval, doubling every R compressed steps up to ``sync_every`` (:func:`sync_due`).
        manager: a torchft ``Manager`` is refused (it exchanges inside ``step()``, after torchft's commit
            decision: :func:`gradcompress.optim.exchanging.refuse_manager`).
        topology: the Compressor's (:mod:`gradcompress.topology`): ``"auto"`` (default; flat on one
            machine), ``"flat"``, an ``int`` G or a 2-D ``DeviceMesh``. Hierarchical (2+ nodes of 2+
            workers): the compressed momenta are reduce-scattered dense inside the node and each worker
            exchanges its 1/G piece between nodes (warm-up stays a flat dense all-reduce); ``worker_error``
            is then this rank's piece of the parameter (``ceil(numel / G)`` elements, flat) and
            ``server_error`` its chunk of that piece among the N nodes. PowerSGD keeps whole tensors
            (owned by local ranks). Resume with the same topology; a checkpoint whose residuals do not fit
            the layout restarts them at zero with a warning.

    ``state_dict()`` holds, per parameter, ``step``, ``exp_avg``, ``exp_avg_sq`` (frozen
    after warm-up), ``worker_error`` (the parameter's shape; hierarchical: this rank's piece) and
    ``server_error`` (this rank's chunk, :func:`gradcompress.exchanges.layout.chunk_numel` elements), all float32; so,
    unlike DeepSpeed, a resumed run continues exactly. Loading a ``torch.optim.Adam``
    state dict also works (the error buffers then start at zero). A checkpoint taken
    with another world size has server residuals of another size: they are reset to
    zero with a warning.
    """

    def __init__(self, params: ParamsT, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 0.0, warmup_steps: int = 100,
                 process_group: dist.ProcessGroup | None = None, codec: Spec = CODEC_SPEC,
                 topology: TopologyOption = "auto", sync_every: int = 1, sync_ramp_steps: int = 0,
                 manager: Manager | None = None) -> None:
        who = type(self).__name__
        refuse_manager(who, manager)
        topology_mod.check_topology(topology, "none")
        check_hyperparameters(lr, betas, eps, weight_decay, warmup_steps, who)
        self.codec = momentum_codec(codec, who)
        self.sync_every, self.sync_ramp_steps = check_schedule(sync_every, sync_ramp_steps, who)
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay, warmup_steps=int(warmup_steps))
        super().__init__(params, defaults)
        self.process_group, self.topology = process_group, topology
        self._init_runtime()

    def _init_runtime(self) -> None:
        if not hasattr(self, "codec"):
            self.codec = make(CODEC_SPEC)
        self._compressor: Compressor | None = None
        self._by_key: list = []  # the parameters in key order (refreshed every step)
        self._local: LocalCollectives | None = None  # the collectives of a single process, made with the compressor
        self._checked = False
        self._counters = {"steps": 0, "compressed_steps": 0, "skipped": 0, "raw_bytes": 0, "seconds": 0.0,
                          "local_skipped": 0}

    def __setstate__(self, state: dict) -> None:
        super().__setstate__(state)
        if not hasattr(self, "sync_every"):
            self.sync_every, self.sync_ramp_steps = 1, 0
        if not hasattr(self, "process_group"):
            self.process_group = None
        if not hasattr(self, "topology"):
            self.topology = "auto"
        if not hasattr(self, "_counters"):
            self._init_runtime()

    def add_param_group(self, param_group: dict) -> None:
        values: dict[str, Any] = {k: param_group.get(k, self.defaults.get(k)) for k in
                                  ("lr", "betas", "eps", "weight_decay", "warmup_steps")}
        who = type(self).__name__
        check_hyperparameters(**values, who=who)
        if "process_group" in param_group:
            raise ValueError(f"{who}: process_group is an argument of the optimizer, not of a parameter group")
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        group["betas"] = tuple(group["betas"])
        for p in group["params"]:
            if p.dtype not in PARAM_DTYPES:
                self.param_groups.pop()
                allowed = ", ".join(str(d).replace("torch.", "") for d in PARAM_DTYPES)
                raise ValueError(f"{who}: parameters must be {allowed}; got one of dtype "
                                 f"{str(p.dtype).replace('torch.', '')}")

    # ------------------------------------------------------------------ public API
    def stats(self) -> dict:
        """Counters of this process since the optimizer was built (not saved in checkpoints).

        ``steps``: calls to :meth:`step` that exchanged something; ``compressed_steps``:
        those with at least one parameter past its warm-up; ``skipped``: steps skipped
        for a non-finite average; ``raw_bytes``: the exchanged tensors' float32 size,
        summed over steps; ``wire_bytes``: bytes this rank transmitted, counted as ring
        algorithms send them (:class:`gradcompress.collectives.Collectives`; 0 in a single
        process); ``ratio``: raw / wire; ``comm_seconds``: time waiting on collectives;
        ``codec_seconds``: the rest of the time in :meth:`step` (encode, decode, update);
        ``inter_node_bytes`` / ``intra_node_bytes`` / ``topology``: the Compressor's (:meth:`Compressor.stats`);
        ``local_skipped``: local steps (``sync_every > 1``) of a parameter whose local momentum was non-finite.
        """
        counters = self._counters
        return {"steps": counters["steps"], "compressed_steps": counters["compressed_steps"],
                "skipped": counters["skipped"], **self._exchange_stats(), "local_skipped": counters["local_skipped"]}

    def load_state_dict(self, state_dict: dict) -> None:
        """Load a state dict; the state tensors are kept in float32 (torch would cast them to the param dtype)."""
        super().load_state_dict(state_dict)
        saved_ids = chain.from_iterable(g["params"] for g in state_dict["param_groups"])
        params = chain.from_iterable(g["params"] for g in self.param_groups)
        for sid, p in zip(saved_ids, params):
            saved = state_dict["state"].get(sid)
            if saved is None:
                continue
            self.state[p] = {k: self._as_state(v, p) for k, v in saved.items()}
        for group in self.param_groups:
            group["betas"] = tuple(group["betas"])

    @staticmethod
    def _as_state(value, p: torch.Tensor):
        if not isinstance(value, torch.Tensor):
            return value
        dtype = torch.float32 if value.is_floating_point() else value.dtype
        device = value.device if value.dim() == 0 and value.device.type == "cpu" else p.device
        return value.detach().to(device=device, dtype=dtype).clone()

    # ------------------------------------------------------------------ the step (ExchangingOptimizer.step)
    def _split(self, world: int):
        """(dense, compressed): the parameters with a gradient still in their warm-up, and those past it, each as
        (key, group, parameter, state)."""
        dense: list[tuple] = []
        comp: list[tuple] = []
        key = -1
        self._by_key = [p for group in self.param_groups for p in group["params"]]
        for group in self.param_groups:
            for p in group["params"]:
                key += 1
                if p.grad is None:
                    continue
                if p.grad.is_sparse:
                    raise RuntimeError(f"{type(self).__name__} does not support sparse gradients")
                state = self._state_of(p, world)
                (dense if state["step"].item() < group["warmup_steps"] else comp).append((key, group, p, state))
        return dense, comp

    def _exchange_and_update(self, step, loss):
        dense, comp = self._split(step.comm.world)
        if not dense and not comp:
            step.end()
            return loss
        sync, local = self._due(comp)
        self._counters["steps"] += 1
        self._counters["compressed_steps"] += bool(comp)
        self._counters["raw_bytes"] += 4 * sum(p.numel() for _, _, p, _ in dense + sync)
        jobs = []
        dense_flat = None
        if dense:  # warm-up: the gradients, averaged dense
            dense_flat = torch.cat([p.grad.detach().reshape(-1).float() for _, _, p, _ in dense])
            jobs.append(step.exchange(["warmup"], [dense_flat], dense=True))
        momenta = self._momenta(sync, outgoing=True)
        if sync:  # afterwards: the momenta, 1 bit each, with worker and server error feedback
            jobs.append(step.exchange([k for k, _, _, _ in sync], momenta))
        step.drive(jobs)
        if not step.end():  # some rank's gradient or momentum was non-finite: skip everywhere
            self._counters["skipped"] += 1
            return loss
        offset = 0
        for _, group, p, state in dense:
            n = p.numel()
            self._adam_step(group, p, state, dense_flat[offset : offset + n].view(p.shape))
            offset += n
        for (key, group, p, state), momentum in zip(sync, momenta):
            self._compressed_update(key, group, p, state, momentum)
        for (_key, group, p, state), momentum in zip(local, self._momenta(local)):
            self._local_update(group, p, state, momentum)
        return loss

    def _due(self, comp) -> tuple[list, list]:
        """(sync, local): the parameters past their warm-up whose step syncs (:func:`sync_due`), and the others."""
        if self.sync_every == 1:
            return comp, []
        sync: list[tuple] = []
        local: list[tuple] = []
        for entry in comp:
            _, group, _, state = entry
            c = int(state["step"].item()) - group["warmup_steps"] + 1
            (sync if sync_due(c, self.sync_every, self.sync_ramp_steps) else local).append(entry)
        return sync, local

    def _momenta(self, comp, outgoing: bool = False) -> list[torch.Tensor]:
        """The local momenta (``outgoing``: what a sync sends, ``m_T + U / s_T`` after local steps)."""
        momenta = []
        for _key, group, p, state in comp:
            grad = self._local_grad(group, p, p.grad.detach().float())
            m = state["exp_avg"].lerp(grad, 1 - group["betas"][0])
            if outgoing and "local_update" in state:
                m = m.add_(state["local_update"], alpha=1.0 / self._step_size(group, state, ahead=1))
            momenta.append(m)
        return momenta

    @staticmethod
    def _step_size(group: dict, state: dict, ahead: int = 0) -> float:
        """``lr / (1 - b1^t)`` at the parameter's step t (+ ``ahead``)."""
        return group["lr"] / (1 - group["betas"][0] ** (state["step"].item() + ahead))

    def _compressed_update(self, key, group, p, state, momentum) -> None:
        """The update of a parameter past its warm-up from the averaged momentum (frozen variance); after local
        steps (a sync of ``sync_every > 1``) from the anchor (module doc: local steps)."""
        if state["step"].item() == group["warmup_steps"]:
            _floor_frozen_variance(state["exp_avg_sq"])
        seen = _seen_in_warmup(state["exp_avg_sq"]) if group["warmup_steps"] > 0 else None
        state["exp_avg"].copy_(momentum if seen is None else momentum * seen)
        state["step"] += 1
        beta1, beta2 = group["betas"]
        warm = group["warmup_steps"]
        bc2 = 1 - beta2**warm if warm > 0 else 1.0
        if "anchor" not in state:
            self._update(group, p, state, 1 - beta1 ** state["step"].item(), bc2)
            return
        step_size = self._step_size(group, state)
        anchor, sizes = state.pop("anchor"), state.pop("local_step_sizes")
        del state["local_update"]
        denom = (state["exp_avg_sq"].sqrt() / bc2**0.5).add_(group["eps"])
        p.copy_(anchor.addcdiv_(state["exp_avg"], denom, value=-step_size))
        state["exp_avg"].mul_(step_size / (float(sizes) + step_size))

    def _local_update(self, group, p, state, momentum) -> None:
        """A local step (``sync_every > 1``, between syncs): this rank's own momentum, nothing sent; the update is
        accumulated for the next sync, and the parameters of the last sync are kept (``anchor``)."""
        if state["step"].item() == group["warmup_steps"]:
            _floor_frozen_variance(state["exp_avg_sq"])
        state["step"] += 1
        if not bool(torch.isfinite(momentum).all()):  # this rank's own: it skips alone, the schedule goes on
            self._counters["local_skipped"] += 1
            return
        if group["warmup_steps"] > 0:
            momentum = momentum * _seen_in_warmup(state["exp_avg_sq"])
        if "anchor" not in state:
            state["anchor"] = p.detach().float().clone()
            state["local_update"] = torch.zeros_like(state["exp_avg"])
            state["local_step_sizes"] = torch.tensor(0.0, dtype=torch.float32)
        step_size = self._step_size(group, state)
        state["exp_avg"].copy_(momentum)
        state["local_update"].add_(momentum, alpha=step_size)
        state["local_step_sizes"] += step_size
        beta1, beta2 = group["betas"]
        warm = group["warmup_steps"]
        self._update(group, p, state, 1 - beta1 ** state["step"].item(), 1 - beta2**warm if warm > 0 else 1.0)

    # ------------------------------------------------------------------ internals
    def _make_compressor(self) -> Compressor:
        """The sign (or given) codec's Compressor, its residuals views of this optimizer's state
        (:class:`~.adam_slots.ParamState`)."""
        feedback = self.codec.wants_error_feedback
        return Compressor(self.codec, process_group=self.process_group, error_feedback=feedback,
                          server_error_feedback=feedback, min_numel=0, topology=self.topology,
                          slots={slot: ParamState(self, name) for slot, name in SLOT_STATE.items()})

    def _group_text(self, group: dict) -> str:
        return (f"lr={group['lr']} betas={tuple(group['betas'])} eps={group['eps']} "
                f"weight_decay={group['weight_decay']} warmup_steps={group['warmup_steps']}")

    def _schedule_text(self) -> str:
        return "" if self.sync_every == 1 else f"sync_every={self.sync_every} ramp={self.sync_ramp_steps}; "

    def _pieces(self):
        """(G, this rank's local rank, N) when the exchange cuts parameters into 1/G pieces (hierarchical, not
        PowerSGD's whole tensors), else None. Known once the compressor has opened its first step."""
        h = self._compressor.hierarchy if self._compressor is not None else None
        if h is None or h.owners:
            return None
        return h.topology.workers_per_node, h.topology.local_rank, h.topology.nodes

    def _slot_key(self, key: int):
        """The Compressor's state key of parameter ``key``: the position, or its piece (``"3:0/2"``)."""
        pieces = self._pieces()
        return key if pieces is None else piece_key(key, pieces[1], pieces[0])

    def _residual_sizes(self, p: torch.Tensor, world: int) -> tuple[tuple, int]:
        """(the worker residual's shape, the server residual's numel) of ``p`` under this layout."""
        pieces = self._pieces()
        if pieces is None:
            return tuple(p.shape), chunk_numel(p.numel(), world)
        piece = piece_numel(p.numel(), pieces[0])
        return (piece,), chunk_numel(piece, pieces[2])

    def _state_of(self, p: torch.Tensor, world: int) -> dict:
        """The parameter's state, created (or completed, after loading a torch Adam state) on first use."""
        state = self.state[p]
        shape, chunk = self._residual_sizes(p, world)
        if "step" not in state:
            state["step"] = torch.tensor(0.0, dtype=torch.float32)
        for key in ("exp_avg", "exp_avg_sq"):
            if key not in state:
                state[key] = torch.zeros(p.shape, dtype=torch.float32, device=p.device)
        worker = state.get("worker_error")
        if worker is None or tuple(worker.shape) != shape:
            if worker is not None:  # another layout: its server residual is a chunk of another cut too
                warnings.warn(f"{type(self).__name__}: a worker residual of shape {tuple(worker.shape)} does not fit "
                              f"this layout's {shape} (checkpoint from another topology?); it and the server "
                              "residual restart at zero", stacklevel=3)
                state.pop("server_error", None)
            state["worker_error"] = torch.zeros(shape, dtype=torch.float32, device=p.device)
        server = state.get("server_error")
        if server is None or server.numel() != chunk:
            if server is not None:
                warnings.warn(f"{type(self).__name__}: a server residual of {server.numel()} elements does not fit this "
                              f"group's chunk of {chunk} (checkpoint from another world size?); it restarts at zero",
                              stacklevel=3)
            state["server_error"] = torch.zeros(chunk, dtype=torch.float32, device=p.device)
        return state

    def _local_grad(self, group: dict, p: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
        """``grad`` (float32) plus the L2 term, as ``torch.optim.Adam`` adds it."""
        if group["weight_decay"] != 0:
            grad = grad.add(p.detach().float(), alpha=group["weight_decay"])
        return grad

    def _adam_step(self, group: dict, p: torch.Tensor, state: dict, avg_grad: torch.Tensor) -> None:
        """``torch.optim.Adam``'s single-tensor step on the averaged gradient (float32 state)."""
        beta1, beta2 = group["betas"]
        grad = self._local_grad(group, p, avg_grad)
        state["step"] += 1
        step = state["step"].item()
        state["exp_avg"].lerp_(grad, 1 - beta1)
        state["exp_avg_sq"].mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
        self._update(group, p, state, 1 - beta1**step, 1 - beta2**step)

    @staticmethod
    def _update(group: dict, p: torch.Tensor, state: dict, bias_correction1: float, bias_correction2: float) -> None:
        step_size = group["lr"] / bias_correction1
        denom = (state["exp_avg_sq"].sqrt() / bias_correction2**0.5).add_(group["eps"])
        if p.dtype == torch.float32:
            p.addcdiv_(state["exp_avg"], denom, value=-step_size)
        else:
            p32 = p.detach().float()
            p32.addcdiv_(state["exp_avg"], denom, value=-step_size)
            p.copy_(p32)


def _seen_in_warmup(v: torch.Tensor) -> torch.Tensor:
    """The freeze mask: coordinates that had a gradient during the warm-up (frozen variance > 0)."""
    return v > 0


def _floor_frozen_variance(v: torch.Tensor) -> None:
    """At the freeze: lift each positive variance to at least (VARIANCE_FLOOR x the tensor's mean sqrt(v))^2.

    Why: after the freeze a coordinate's update is lr * m / (sqrt(v) + eps), and the 1-bit
    momentum m of a coordinate is of the size of its bucket's mean |m|, not its own. A
    coordinate whose variance is far below the rest (a rarely active input, a nearly dead
    unit) would move by lr * (bucket scale) / eps, orders of magnitude more than Adam
    would move it, and the run diverges (digits, lr 2e-3, eps 1e-8: 8.6 %). Flooring the
    frozen variance relative to the tensor bounds every update to about lr / VARIANCE_FLOOR
    times the typical one, without changing coordinates of ordinary size. Coordinates
    whose variance is exactly zero (no gradient through the whole warm-up, e.g. weights of
    constant inputs) are masked instead: their momentum is zeroed, so they do not move, as
    with DeepSpeed's ``exp_avg_mask``.
    """
    positive = v > 0
    if bool(positive.any()):
        floor = (VARIANCE_FLOOR * v.sqrt()[positive].mean()) ** 2
        v.copy_(torch.where(positive, v.clamp(min=float(floor)), v))


class OneBitAdam(CompressedAdam):
    """1-bit Adam: :class:`CompressedAdam` with the ``sign`` codec (one bit per element, one scale per 512).

    What is sent: ``warmup_steps`` steps of dense Adam (the gradients all-reduced in float32), then Adam's momentum,
    each element's sign and one float32 scale per 512 elements, through the two-step reduce (worker- and server-side
    error feedback): about 1/30 of the dense bytes. Bias: the frozen variance (taken at the end of the warm-up) and
    the delayed part of the momentum that error feedback carries. Use it where Adam trains well and the link is the
    bottleneck; a warm-up too short freezes a variance that is still moving. Paper: Tang et al., "1-bit Adam"
    (ICML 2021, https://arxiv.org/abs/2102.02888).

    Args:
        params, lr, betas, eps, weight_decay, warmup_steps, process_group, topology, sync_every, sync_ramp_steps,
            manager: as :class:`CompressedAdam` (every argument but ``codec``, which is ``sign``).

    Example::

        >>> import torch, torch.distributed as dist
        >>> from gradcompress.optim import OneBitAdam
        >>> dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        >>> model = torch.nn.Linear(64, 32)
        >>> opt = OneBitAdam(model.parameters(), lr=1e-3, warmup_steps=2)
        >>> for _ in range(4):      # 2 dense warm-up steps, then 2 of 1-bit momentum
        ...     opt.zero_grad(); model(torch.randn(8, 64)).pow(2).mean().backward(); opt.step()
        >>> dist.destroy_process_group()
    """

    def __init__(self, params: ParamsT, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 0.0, warmup_steps: int = 100,
                 process_group: dist.ProcessGroup | None = None, topology: TopologyOption = "auto",
                 sync_every: int = 1, sync_ramp_steps: int = 0, manager: Manager | None = None) -> None:
        super().__init__(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, warmup_steps=warmup_steps,
                         process_group=process_group, codec=CODEC_SPEC, topology=topology, sync_every=sync_every,
                         sync_ramp_steps=sync_ramp_steps, manager=manager)


__all__ = ["CompressedAdam", "OneBitAdam", "sync_due"]
