"""``Compressor``: compressed gradient averaging with per-parameter state.

One Compressor owns everything that compression remembers between steps, keyed by
the parameter's position in the model's parameter list (never by DDP bucket, which
DDP regroups after the first iteration and which a resumed run starts afresh):

* ``residual``  error-feedback residual per parameter (float32, whatever the grad dtype):
  residual = input - what this rank's compression delivered, added to the next input;
* ``q`` / ``p``  PowerSGD's warm-started factors (shared by all ranks);
* ``momentum``  DGC's momentum-correction buffer;
* ``step``      synchronising steps so far (drives warm-up and schedules).

A step's state changes are committed only when the step's averaged gradient is
finite on every rank: on an AMP overflow step (Inf/NaN on any rank) every rank's
result is non-finite (so ``GradScaler`` skips the step everywhere) and the state stays
as it was before the step.
"""

from __future__ import annotations

import math
import time
import warnings
from typing import Iterable

import torch
import torch.distributed as dist

from . import exchange
from .codecs.base import Aggregation, Codec
from .codecs.lowrank import initial_q, orthonormalize_
from .schedule import SCHEDULES, codec_at
from .spec import make

COLLECTIVES = ("auto", "allgather")
_MASK64 = (1 << 64) - 1


def mix_seed(*parts: int) -> int:
    """A 62-bit seed from integers (splitmix64 steps), the same on every machine."""
    h = 0x9E3779B97F4A7C15
    for p in parts:
        h = (h ^ (int(p) & _MASK64)) * 0xBF58476D1CE4E5B9 & _MASK64
        h = (h ^ (h >> 31)) * 0x94D049BB133111EB & _MASK64
        h ^= h >> 29
    return h >> 2


def _check_int(name: str, value, lo: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < lo:
        raise ValueError(f"Compressor: {name} must be an integer >= {lo}, got {value!r}")
    return value


class Compressor:
    """Averages gradients across a process group with a codec, error feedback and schedules.

    Args:
        spec: codec spec (``"topk:ratio=0.01"``, a dict, or a codec from :func:`make`).
        process_group: the group to average over (default: the world).
        error_feedback: keep a per-parameter residual and add it to the next gradient.
            Needed for biased codecs (topk, sign, powersgd, int4, dgc). Turn it off for
            unbiased stochastic codecs (qsgd, terngrad, ``stochastic=true``, randomk with
            ``scale=true``): their error can exceed the gradient, and fed back it grows
            without bound (a warning says so).
        warmup_steps: the first steps are all-reduced dense (2 or more with DDP).
        min_numel: tensors with fewer elements (biases, norms) are sent dense, batched
            into one all-reduce per bucket.
        seed: seeds every random choice (randomk positions, PowerSGD's first Q,
            stochastic rounding), mixed with the parameter index and the step.
        collective: ``"auto"`` picks the collective from the codec's algebra;
            ``"allgather"`` gathers every rank's payload whatever the codec.
        schedule: None, or ``"exp"``: ratio/rank ramp over ``ramp_steps`` after warm-up.
    """

    def __init__(self, spec, *, process_group=None, error_feedback: bool = True, warmup_steps: int = 0,
                 min_numel: int = 1024, seed: int = 0, collective: str = "auto", schedule: str | None = None,
                 ramp_steps: int = 0):
        self.codec: Codec = make(spec)
        if collective not in COLLECTIVES:
            raise ValueError(f"Compressor: collective must be one of {', '.join(COLLECTIVES)}, got {collective!r}")
        if schedule not in SCHEDULES:
            raise ValueError(f"Compressor: schedule must be None or 'exp', got {schedule!r}")
        if not isinstance(error_feedback, bool):
            raise ValueError(f"Compressor: error_feedback must be True or False, got {error_feedback!r}")
        self.__name__ = self.__qualname__ = f"gradcompress.Compressor({self.codec.spec})"  # DDP logs hook names
        if error_feedback and self.codec.unbiased:
            warnings.warn(f"gradcompress: error feedback with the unbiased codec {self.codec.name!r} accumulates "
                          "its variance and can diverge; pass error_feedback=False", stacklevel=2)
        self.process_group = process_group
        self.error_feedback = error_feedback
        self.warmup_steps = _check_int("warmup_steps", warmup_steps, 0)
        self.min_numel = _check_int("min_numel", min_numel, 0)
        self.seed = _check_int("seed", seed, 0)
        self.collective = collective
        self.schedule = schedule
        self.ramp_steps = _check_int("ramp_steps", ramp_steps, 0)
        # state (what state_dict() holds)
        self.step = 0
        self.residual: dict[int, torch.Tensor] = {}
        self.q: dict[int, torch.Tensor] = {}
        self.p: dict[int, torch.Tensor] = {}
        self.momentum: dict[int, torch.Tensor] = {}
        # per-step bookkeeping
        self._comm: exchange.Collectives | None = None
        self._checked = False
        self._key_of: dict[int, int] = {}
        self._inflight: list = []
        self._pending: dict[tuple[str, int], torch.Tensor] = {}  # (state name, key) -> value, until _end
        self._bad: list[torch.Tensor] = []
        self._totals = {"steps": 0, "raw_bytes": 0, "codec_seconds": 0.0}

    # ------------------------------------------------------------------ public API
    def register(self, ddp_model) -> "Compressor":
        """Install as ``ddp_model``'s communication hook (``DistributedDataParallel.register_comm_hook``)."""
        from .ddp import hook

        self.index_parameters(ddp_model.module.parameters())
        ddp_model.register_comm_hook(self, hook)
        return self

    def __call__(self, state, bucket):
        """Lets the Compressor itself be passed where a hook is expected, with any state:
        ``DDPStrategy(ddp_comm_hook=compressor)`` (Lightning) or
        ``ddp_model.register_comm_hook(None, compressor)``. (No annotations: DDP checks them.)
        """
        from .ddp import hook

        return hook(self, bucket)

    def index_parameters(self, parameters: Iterable[torch.nn.Parameter]) -> None:
        """Key state by each parameter's position among those that require grad."""
        params = [p for p in parameters if p.requires_grad]
        self._key_of = {id(p): i for i, p in enumerate(params)}

    def synchronize(self, parameters: Iterable[torch.nn.Parameter]) -> None:
        """Average the ``.grad`` of ``parameters`` across the group, in place (custom training loops).

        Pass the same parameters in the same order on every rank and at every step
        (e.g. ``model.parameters()``); state is keyed by position in this list.
        """
        params = [p for p in parameters if p.requires_grad]
        entries = [(i, p.grad) for i, p in enumerate(params) if p.grad is not None]
        for _, g in entries:
            if g.is_sparse:
                raise ValueError("Compressor.synchronize: sparse gradients are not supported")
        self._begin()
        try:
            job = self._group_job([k for k, _ in entries], [g for _, g in entries], None)
            exchange.drive([self._timed(job)], self._comm)
            self._end()
        except BaseException:
            self._abort()
            raise

    def stats(self) -> dict:
        """Counters since the start (or since the checkpoint was taken).

        ``steps``: synchronising steps; ``raw_bytes``: the gradients' own size (numel x
        element size) summed over steps; ``wire_bytes``: bytes this rank transmitted
        through collectives, counted as ring algorithms send them (see
        :mod:`gradcompress.exchange`); ``ratio``: raw / wire; ``codec_seconds``: time in
        encode/decode and state updates; ``comm_seconds``: time waiting on collectives.
        """
        wire = self._comm.wire_bytes if self._comm else 0
        raw = self._totals["raw_bytes"]
        return {
            "steps": self._totals["steps"],
            "raw_bytes": raw,
            "wire_bytes": wire,
            "ratio": raw / wire if wire else float("inf") if raw else 1.0,
            "codec_seconds": self._totals["codec_seconds"],
            "comm_seconds": self._comm.comm_seconds if self._comm else 0.0,
        }

    def state_dict(self) -> dict:
        """Tensors and plain values only (``torch.load(..., weights_only=True)`` reads it)."""
        return {
            "config": self._config(),
            "step": self.step,
            "residual": {str(k): v.clone() for k, v in self.residual.items()},
            "q": {str(k): v.clone() for k, v in self.q.items()},
            "p": {str(k): v.clone() for k, v in self.p.items()},
            "momentum": {str(k): v.clone() for k, v in self.momentum.items()},
        }

    def load_state_dict(self, state: dict) -> None:
        if state.get("config") != self._config():
            raise ValueError(f"Compressor.load_state_dict: the checkpoint was made with {state.get('config')!r}, "
                             f"this compressor is {self._config()!r}")
        self.step = int(state["step"])
        for name in ("residual", "q", "p", "momentum"):
            setattr(self, name, {int(k): v.clone() for k, v in state[name].items()})

    # ------------------------------------------------------------------ step lifecycle
    def _config(self) -> str:
        return (f"{self.codec.spec} error_feedback={self.error_feedback} warmup_steps={self.warmup_steps} "
                f"min_numel={self.min_numel} seed={self.seed} collective={self.collective} "
                f"schedule={self.schedule} ramp_steps={self.ramp_steps}")

    def _begin(self) -> None:
        if self._comm is None:
            self._comm = exchange.Collectives(self.process_group)
        if not self._checked:
            self._check_same_config()
            self._checked = True

    def _check_same_config(self) -> None:
        configs: list = [None] * self._comm.world
        dist.all_gather_object(configs, self._config(), group=self.process_group)
        if len(set(configs)) > 1:
            lines = "; ".join(f"rank {r}: {c}" for r, c in enumerate(configs))
            raise RuntimeError(f"gradcompress: ranks are configured differently, refusing to mix formats: {lines}")

    def _timed(self, job: exchange.Job) -> exchange.Job:
        """Wrap a job so that the time spent in its own code counts as codec time."""
        while True:
            start = time.perf_counter()
            try:
                works = next(job)
            except StopIteration:
                self._totals["codec_seconds"] += time.perf_counter() - start
                return
            self._totals["codec_seconds"] += time.perf_counter() - start
            yield works

    def _end(self) -> None:
        """Commit the step's state changes unless some rank's gradient was non-finite."""
        finite = not self._bad or bool(torch.isfinite(torch.cat(self._bad)).all())
        if finite:
            for (name, key), value in self._pending.items():
                getattr(self, name)[key] = value
        self._pending, self._bad = {}, []
        self.step += 1
        self._totals["steps"] += 1

    def _abort(self) -> None:
        self._pending, self._bad, self._inflight = {}, [], []

    # ------------------------------------------------------------------ one group
    def _group_job(self, keys: list[int], grads: list[torch.Tensor], buffer: torch.Tensor | None) -> exchange.Job:
        """The exchange of one group of gradients (a DDP bucket, or all of synchronize's), in place."""
        comm = self._comm
        self._totals["raw_bytes"] += sum(g.numel() * g.element_size() for g in grads)
        codec = codec_at(self.codec, self.step, self.warmup_steps, self.schedule, self.ramp_steps)
        if codec is None or self.codec.name == "dgc":  # DGC: dense tensors get momentum correction too
            dense_keys = keys if codec is None else [k for k, g in zip(keys, grads) if g.numel() < self.min_numel]
            for k, g in zip(keys, grads):
                if k in dense_keys and self.codec.name == "dgc" and self.codec.momentum > 0:
                    g.copy_(self._momentum_step(self.codec, k, g.detach().float()))
        if codec is None or codec.name == "none":  # none: exact, no state; DDP's own all-reduce
            flat = buffer if buffer is not None else torch.cat([g.reshape(-1) for g in grads]) if grads else None
            if flat is not None:
                yield from exchange.dense_mean(comm, flat)
                if buffer is None:
                    _scatter(flat, grads)
            return
        aggregation = Aggregation.GATHER if self.collective == "allgather" else codec.aggregation
        dense, comp = [], []
        for k, g in zip(keys, grads):
            small = g.numel() < self.min_numel
            if aggregation is Aggregation.LOWRANK and codec.matrix_shape(g.shape) is None:
                small = True
            (dense if small else comp).append((k, g))
        inputs = [self._input(codec, k, g) for k, g in comp]
        dtype = grads[0].dtype if grads else torch.float32
        flag = sum((x.sum() * 0 for x in inputs), torch.zeros((), device=grads[0].device if grads else None))
        dense_flat = torch.cat([g.reshape(-1) for _, g in dense] + [flag.reshape(1).to(dtype)])
        outs = [torch.empty_like(x) for x in inputs]
        jobs = [exchange.dense_mean(comm, dense_flat)]
        if comp:
            jobs.append(self._compressed_job(codec, aggregation, [k for k, _ in comp], inputs, outs))
        yield from _parallel(jobs)
        _scatter(dense_flat[:-1], [g for _, g in dense])
        flag = dense_flat[-1:].float()
        self._bad.append(flag)
        for (k, g), out in zip(comp, outs):
            if not codec.preserves_nonfinite:
                out.view(-1)[:1].add_(flag)
            g.copy_(out.view(g.shape))

    def _input(self, codec: Codec, key: int, grad: torch.Tensor) -> torch.Tensor:
        """The tensor to compress: the gradient (DGC: momentum-corrected) plus the residual, float32."""
        x = grad.detach().float()
        if codec.name == "dgc":
            if codec.clip > 0:
                norm = torch.linalg.vector_norm(x)
                x = x * (codec.clip / (math.sqrt(self._comm.world) * norm + 1e-12)).clamp(max=1.0)
            if codec.momentum > 0:
                x = self._momentum_step(codec, key, x)
        if self.error_feedback and key in self.residual:
            x = x + self.residual[key]
        elif x.data_ptr() == grad.data_ptr():
            x = x.clone()
        return x

    def _momentum_step(self, codec: Codec, key: int, x: torch.Tensor) -> torch.Tensor:
        """DGC momentum correction: u = momentum * u + g (the optimizer then runs without momentum)."""
        u = self.momentum.get(key)
        u = x.clone() if u is None else u * codec.momentum + x
        self._pending["momentum", key] = u
        return u

    def _delivered(self, codec: Codec, key: int, x: torch.Tensor, delivered) -> None:
        """Record what this rank's compression delivered: new residual (and DGC momentum masking).

        ``delivered`` is a callable, evaluated only when some state needs it (without error
        feedback and DGC masking, no extra decode is spent).
        """
        masking = codec.name == "dgc" and codec.momentum > 0 and codec.masking
        if not (self.error_feedback or masking):
            return
        delivered = delivered()
        if self.error_feedback:
            self._pending["residual", key] = (x - delivered.view(x.shape)).float()
        if masking:
            u = self._pending["momentum", key]
            self._pending["momentum", key] = u.masked_fill(delivered.view(u.shape) != 0, 0)

    def _seed(self, key: int, codec: Codec, salt: int = 0) -> int:
        rank = 0 if codec.shared_seed else self._comm.rank
        return mix_seed(self.seed, key, self.step, rank, salt)

    def _compressed_job(self, codec, aggregation, keys, inputs, outs) -> exchange.Job:
        comm = self._comm
        world = comm.world
        if aggregation is Aggregation.SUM:
            payloads = []
            for k, x in zip(keys, inputs):
                p = codec.encode(x / world, seed=self._seed(k, codec))
                self._delivered(codec, k, x, lambda p=p: codec.decode(p).float() * world)
                payloads.append(p)
            yield from exchange.sum_mean(comm, codec, payloads, outs)
        elif aggregation is Aggregation.GATHER:
            payloads = []
            for k, x in zip(keys, inputs):
                p = codec.encode(x, seed=self._seed(k, codec))
                self._delivered(codec, k, x, lambda p=p: codec.decode(p).float())
                payloads.append(p)
            yield from exchange.gather_mean(comm, codec, payloads, outs)
        elif aggregation is Aggregation.REQUANTIZE and world == 1:  # nothing to reduce: no second quantisation
            for k, x, out in zip(keys, inputs, outs):
                delivered = codec.decode(codec.encode(x, seed=self._seed(k, codec))).float()
                self._delivered(codec, k, x, lambda d=delivered: d)
                out.copy_(delivered)
        elif aggregation is Aggregation.REQUANTIZE:
            chunked = []
            for k, x in zip(keys, inputs):
                parts = exchange.split_chunks(x.reshape(-1), world, 8)  # whole packed bytes per chunk
                seed = self._seed(k, codec)
                payloads = [codec.encode(c, seed=mix_seed(seed, j)) for j, c in enumerate(parts)]
                self._delivered(codec, k, x, lambda ps=payloads, n=x.numel():
                                torch.cat([codec.decode(p).float() for p in ps])[:n])
                chunked.append(payloads)

            def reencode(i: int, mean_chunk: torch.Tensor):
                return codec.encode(mean_chunk, seed=self._seed(keys[i], codec, salt=1))

            yield from exchange.two_step_mean(comm, codec, chunked, outs, reencode)
        else:
            yield from self._lowrank_job(codec, keys, inputs, outs)

    # ------------------------------------------------------------------ PowerSGD rounds
    def _basis(self, store: dict, key: int, size: int, rank: int, codec: Codec, device, salt: int) -> torch.Tensor:
        """PowerSGD's warm-started factor for ``key``, drawn from the seed at first use (or on a rank change)."""
        cur = store.get(key)
        if cur is None or cur.shape != (size, rank):
            fresh = initial_q(size, rank, mix_seed(self.seed, key, salt), device)
            if cur is not None and cur.shape[0] == size:
                r = min(rank, cur.shape[1])
                fresh[:, :r] = cur[:, :r]
            cur = orthonormalize_(fresh) if salt else fresh
        return cur

    def _lowrank_job(self, codec, keys, inputs, outs) -> exchange.Job:
        """PowerSGD (Vogels et al. 2019), all matrices of the group batched into one all-reduce per round.

        Default: P = M Q; all-reduce P; orthonormalise; Q = M^T P; all-reduce Q; result
        P Q^T; Q warm-starts the next step. ``alternate=true``: one all-reduce per step,
        even steps reduce P = M Q_hat (result P Q_hat^T), odd steps Q = M^T P_hat (result
        P_hat Q^T), the reduced factor orthonormalised becomes the next step's basis.
        """
        comm, world = self._comm, self._comm.world
        mats = []
        for x in inputs:
            n, m = codec.matrix_shape(x.shape)
            mats.append(x.view(n, m))
        rank_of = [min(codec.rank, *m.shape) for m in mats]
        dev = mats[0].device
        if not codec.alternate:
            qs = [self._basis(self.q, k, m.shape[1], r, codec, dev, 0) for k, m, r in zip(keys, mats, rank_of)]
            ps = torch.cat([(m @ q).reshape(-1) for m, q in zip(mats, qs)])
            yield [comm.all_reduce(ps)]
            p_hat = [orthonormalize_(p) for p in _split(ps, [(m.shape[0], r) for m, r in zip(mats, rank_of)])]
            q_local = [m.T @ p for m, p in zip(mats, p_hat)]
            for k, x, p, q in zip(keys, inputs, p_hat, q_local):
                self._delivered(codec, k, x, lambda p=p, q=q: p @ q.T)
            q_flat = torch.cat([q.reshape(-1) for q in q_local])
            yield [comm.all_reduce(q_flat)]
            q_flat.div_(world)
            for k, p, q, out in zip(keys, p_hat, _split(q_flat, [q.shape for q in q_local]), outs):
                torch.matmul(p, q.T, out=out.view(p.shape[0], q.shape[0]))
                self._pending["q", k] = q.clone()
            return
        p_step = self.step % 2 == 0
        bases = [self._basis(self.q if p_step else self.p, k, m.shape[1] if p_step else m.shape[0], r, codec, dev,
                             1 if p_step else 2) for k, m, r in zip(keys, mats, rank_of)]
        local = [(m @ b) if p_step else (m.T @ b) for m, b in zip(mats, bases)]
        for k, x, b, f in zip(keys, inputs, bases, local):
            self._delivered(codec, k, x, lambda f=f, b=b: f @ b.T if p_step else b @ f.T)
        flat = torch.cat([f.reshape(-1) for f in local])
        yield [comm.all_reduce(flat)]
        flat.div_(world)
        for k, b, f, out in zip(keys, bases, _split(flat, [f.shape for f in local]), outs):
            if p_step:
                torch.matmul(f, b.T, out=out.view(f.shape[0], b.shape[0]))
                self._pending["p", k] = orthonormalize_(f.clone())
            else:
                torch.matmul(b, f.T, out=out.view(b.shape[0], f.shape[0]))
                self._pending["q", k] = orthonormalize_(f.clone())


def _split(flat: torch.Tensor, shapes) -> list[torch.Tensor]:
    out, offset = [], 0
    for shape in shapes:
        n = math.prod(shape)
        out.append(flat[offset : offset + n].view(*shape))
        offset += n
    return out


def _scatter(flat: torch.Tensor, grads: list[torch.Tensor]) -> None:
    offset = 0
    for g in grads:
        g.copy_(flat[offset : offset + g.numel()].view(g.shape))
        offset += g.numel()


def _parallel(jobs: list[exchange.Job]) -> exchange.Job:
    """Run several jobs side by side: each round issues the next collectives of all of them."""
    active = list(jobs)
    while active:
        works, still = [], []
        for job in active:
            try:
                works.extend(next(job))
                still.append(job)
            except StopIteration:
                pass
        if works:
            yield works
        active = still
