"""The public step protocol: one compressed step, from begin to commit or rollback.

Every adapter (the DDP hook, ``Compressor.synchronize``, 1-bit Adam, the FSDP
reduce-scatter, DiLoCo's outer exchange, ``plan``'s calibration) drives a
:class:`~gradcompress.Compressor` through this lifecycle and nothing else::

    step = compressor.begin_step()                 # schedule position, codec of this step
    job = step.exchange(keys, tensors)             # a generator of collective rounds
    step.drive([job, ...])                         # rounds in the same order on every rank
    committed = step.end()                         # commit new state if every rank was finite

or, to overlap the first round with other work (the backward pass)::

    step.launch(job, done)                         # issue the first round now
    ...
    step.finish()                                  # drive every launched job, end, call done

Inside :meth:`Step.exchange` each compressed tensor goes through the transforms of
:mod:`gradcompress.transforms` (clip, momentum correction, worker error feedback), the
codec, the collective its algebra allows (:mod:`gradcompress.exchange`), server error
feedback at the chunk owner (two-step reduce) and the decode. New states are held in the
step, never written into the Compressor's :class:`State` before :meth:`Step.end`:

* finite on every rank (decided from values every rank has after the collectives: the
  dense results, the received payloads of codecs that carry a NaN/Inf through — the summed
  casts, the quantisers' scales, the sparsifiers' values — and, for the others or when
  tensors travel dense, one flag element that carries each rank's inputs' finiteness):
  every new state is committed and the schedule position advances;
* otherwise every rank's result is non-finite (``GradScaler`` skips the step everywhere)
  and nothing is committed: residuals, PowerSGD factors, momentum and the schedule
  position stay as they were; the next step behaves as if this one never happened.

Host synchronisations the algorithm needs (and no others on this path): the finiteness
decision in :meth:`Step.end` (one per step), and the payload sizes of variable-size
codecs (``threshold``, ``dgc``) before their all-gather.
"""

from __future__ import annotations

import bisect
import math
import time
import zlib
from typing import Callable, Hashable, Sequence

import torch

from . import exchange
from .codecs.base import Aggregation, Codec, Payload
from .codecs.fast import RESIDUAL_DTYPES
from .codecs.lowrank import initial_q, orthonormalize_, product, transposed_product
from .schedule import codec_at
from .transforms import Clip, ErrorFeedback, MomentumCorrection

_MASK64 = (1 << 64) - 1
#: the state slots a Compressor keeps, each a dict key -> tensor
SLOTS = ("residual", "server_residual", "q", "p", "momentum")


def mix_seed(*parts: int) -> int:
    """A 62-bit seed from integers (splitmix64 steps), the same on every machine."""
    h = 0x9E3779B97F4A7C15
    for p in parts:
        h = (h ^ (int(p) & _MASK64)) * 0xBF58476D1CE4E5B9 & _MASK64
        h = (h ^ (h >> 31)) * 0x94D049BB133111EB & _MASK64
        h ^= h >> 29
    return h >> 2


def key_number(key: Hashable) -> int:
    """An integer for a state key (a parameter position, or a string such as an FSDP group's name)."""
    return key if isinstance(key, int) else zlib.crc32(str(key).encode())


class State:
    """Everything compression remembers between steps, in one place.

    ``step``: committed steps (the schedule position); ``slots[name][key]``: per-key
    tensors, with ``name`` one of :data:`SLOTS`: ``residual`` (worker error feedback),
    ``server_residual`` (the chunk owner's, two-step reduce), ``q``/``p`` (PowerSGD's
    warm-started factors), ``momentum`` (momentum correction).
    """

    def __init__(self) -> None:
        self.step = 0
        self.slots: dict[str, dict] = {name: {} for name in SLOTS}
        #: (slot, key) -> the residual a commit replaced, reused as the next step's output buffer (not state)
        self.spare: dict = {}

    def get(self, slot: str, key: Hashable):
        return self.slots[slot].get(key)

    def commit(self, new: dict) -> None:
        for (slot, key), value in new.items():
            old = self.slots[slot].get(key)
            if slot in RECYCLED and old is not None and old is not value and _same_layout(old, value):
                self.spare[slot, key] = old  # nothing else holds it: it becomes the next new residual's buffer
            self.slots[slot][key] = value
        self.step += 1

    def take_spare(self, slot: str, key, shape, dtype, device) -> torch.Tensor | None:
        """A recycled buffer for ``slot``/``key`` of that layout, or None."""
        buf = self.spare.pop((slot, key), None)
        if buf is None or buf.shape != shape or buf.dtype != dtype or buf.device != device:
            return None
        return buf

    def state_dict(self) -> dict:
        out = {"step": self.step}
        for name, values in self.slots.items():
            out[name] = {str(k): v.clone() for k, v in values.items()}
        return out

    def load_state_dict(self, state: dict) -> None:
        self.spare = {}
        self.step = int(state["step"])
        for name in SLOTS:
            self.slots[name] = {_key(k): v.clone() for k, v in state.get(name, {}).items()}


def all_finite(x: torch.Tensor) -> torch.Tensor:
    """0-d bool tensor (no host sync): every element of ``x`` is finite.

    One reduction pass: the minimum and maximum are finite exactly when every element is
    (NaN propagates through both, +-Inf shows in one) — about 20x faster on CPU than
    ``torch.isfinite(x).all()``, which materialises several full-size temporaries.
    """
    if x.numel() == 0 or not x.is_floating_point():
        return torch.ones((), dtype=torch.bool, device=x.device)
    lo, hi = torch.aminmax(x)
    return torch.isfinite(lo) & torch.isfinite(hi)


#: dense tensors of at least this many elements are all-reduced in place (no copy into a flat buffer and back)
IN_PLACE_NUMEL = 1 << 20

#: slots whose replaced tensors are recycled as buffers (their new value never reads the old tensor in place)
RECYCLED = ("residual", "server_residual")


def decode_chunks(codec: Codec, payloads: list, n: int, device) -> torch.Tensor:
    """The first ``n`` values of the chunks' decodes, back to back, in float32 (each chunk decoded into its
    place: no full-size temporaries besides the result)."""
    out = torch.empty(sum(p.numel for p in payloads), dtype=torch.float32, device=device)
    offset = 0
    for p in payloads:
        codec.decode_into(p, out[offset : offset + p.numel])
        offset += p.numel
    return out[:n]


def _same_layout(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and a.device == b.device and a.is_contiguous()


def _key(text: str):
    return int(text) if text.lstrip("-").isdigit() else text


class Step:
    """One step of a :class:`~gradcompress.Compressor` (made by ``Compressor.begin_step``).

    ``codec`` is this step's codec (None on a dense warm-up step); ``comm`` the
    collectives it issues. See the module docstring for the lifecycle.
    """

    def __init__(self, compressor, comm: exchange.Collectives, on_close: Callable):
        self.compressor = compressor
        self._on_close = on_close  # on_close(step, new_state_or_None, counted=True)
        self.comm = comm
        c = compressor
        self.index = c.state.step
        self.codec: Codec | None = codec_at(c.codec, self.index, c.warmup_steps, c.schedule, c.ramp_steps)
        self._momentum: MomentumCorrection | None = c.momentum_correction
        self._clip = Clip(c.clip, comm.world) if c.clip > 0 else None
        self._ef = ErrorFeedback(c.residual_dtype) if c.error_feedback else None
        self._server_ef = ErrorFeedback(c.residual_dtype) if c.server_error_feedback else None
        self._new: dict = {}  # (slot, key) -> new state, committed by end()
        self._owned: dict = {}  # key -> this step's error-fed input, a buffer of ours (the new residual's home)
        self._checks: list[torch.Tensor] = []  # 0-d bools, every rank the same: "this part was finite"
        self._launched: list = []
        every = c.monitor_every
        self.monitoring = every > 0 and self.codec is not None and self.index % every == 0
        self._refs: dict = {}  # key -> what would have been averaged dense (monitoring)
        self.monitor_rows: dict = {}  # key -> 0-d tensors (err^2, ref^2, dot, out^2, residual^2)
        self.raw_bytes = 0
        self.codec_seconds = 0.0
        self.open = True

    # ---------------------------------------------------------------- the protocol
    def exchange(self, keys: Sequence[Hashable], tensors: Sequence[torch.Tensor],
                 buffer: torch.Tensor | None = None, *, dense: bool = False) -> exchange.Job:
        """Average ``tensors`` across the group, in place, as a job of collective rounds.

        ``keys`` name each tensor's state (the same on every rank and in every run);
        ``buffer``: optional flat tensor whose storage holds all of ``tensors`` (DDP's
        bucket), used as the dense all-reduce buffer; ``dense=True`` sends this group
        uncompressed whatever the step (still through momentum correction and the
        finiteness check).
        """
        if not self.open:
            raise RuntimeError("gradcompress: this step has ended; begin a new one with compressor.begin_step()")
        return self._timed(self._group_job(list(keys), list(tensors), buffer, dense))

    def reduce_scatter(self, key: Hashable, input: torch.Tensor, output: torch.Tensor, scale: float) -> exchange.Job:
        """A compressed reduce-scatter, as a job: ``input`` holds one chunk per rank (``world`` x
        ``output.numel()`` elements, chunk j for rank j); ``output`` receives this rank's chunk of the
        sum over ranks, times ``scale`` (1/world for an average).

        The whole local ``input`` goes through the transforms (momentum correction, worker error
        feedback: the residual covers the local unsharded buffer) and is encoded chunk by chunk;
        chunks travel by all-to-all and are decoded and summed by their owner. The output is final,
        so there is no second quantisation (and no server residual). A one-element all-reduce of a
        finiteness flag makes every rank's output non-finite if any rank's input was.
        """
        if not self.open:
            raise RuntimeError("gradcompress: this step has ended; begin a new one with compressor.begin_step()")
        return self._timed(self._reduce_scatter_job(key, input, output, scale))

    def _reduce_scatter_job(self, key, input, output, scale) -> exchange.Job:
        comm, world = self.comm, self.comm.world
        if input.numel() != world * output.numel():
            raise ValueError(f"gradcompress: reduce-scatter input of {input.numel()} elements is not {world} chunks "
                             f"of the output's {output.numel()}")
        self.raw_bytes += input.numel() * input.element_size()
        codec = self.codec
        if codec is None or codec.exact:  # dense: the chunks as they are (an all-to-all is a reduce-scatter)
            x = input.reshape(-1)
            if self._momentum is not None:
                x = self._with_momentum(key, x.clone())
            codec, seeds = self.compressor.dense_codec, [0] * world
        else:
            x = self._input(key, input.reshape(-1))
            seed = self.seed(key, codec)
            seeds = [mix_seed(seed, j) for j in range(world)]
        chunks = x.view(world, -1)
        payloads = [codec.encode(c, seed=s) for c, s in zip(chunks, seeds)]
        flag = torch.where(all_finite(x), 0.0, math.nan).reshape(1).to(torch.float32)  # before x becomes the residual
        if codec is not self.compressor.dense_codec:
            self._delivered(key, x, lambda: decode_chunks(codec, payloads, x.numel(), x.device))
        total = torch.empty(output.numel(), dtype=torch.float32, device=output.device)
        yield from exchange.parallel([exchange.reduce_scatter_sum(comm, codec, payloads, total),
                                      exchange.dense_mean(comm, flag)])
        self.check(all_finite(flag))
        total.mul_(scale)
        total[:1].add_(flag)
        output.copy_(total.view(output.shape))

    def launch(self, job: exchange.Job, done: Callable[[BaseException | None], None] | None = None) -> None:
        """Issue ``job``'s first round now; :meth:`finish` completes it and calls ``done(None)``
        (or ``done(error)`` if the step failed).

        With the compressor's ``overlap`` (off by default), every job launched before this one is then advanced
        by one round: it waits for its works in flight and issues its next round, so later rounds of
        earlier buckets travel while the backward pass still produces later buckets. The order is fixed
        (each launch: the new job's first round, then each earlier job's next round, in launch order), the
        same on every rank, so it stays deadlock-free on gloo and NCCL."""
        running = exchange.Running(exchange.start(job))
        if self.compressor.overlap:
            for earlier, _ in self._launched:
                earlier.advance(self.comm)
        self._launched.append((running, done))

    def finish(self) -> bool:
        """Drive every launched job, end the step, then call each ``done``. Returns :meth:`end`'s result."""
        try:
            self.drive([running.rest() for running, _ in self._launched])
            committed = self.end()
        except BaseException as err:
            self.abort(err)
            raise
        launched, self._launched = self._launched, []
        for _, done in launched:
            if done is not None:
                done(None)
        return committed

    def drive(self, jobs: list[exchange.Job]) -> None:
        """Run jobs to completion, round-robin, in the order given (the same on every rank)."""
        exchange.drive(jobs, self.comm)

    def end(self) -> bool:
        """Commit the step's new state if every rank was finite (one host sync); True if committed."""
        finite = bool(torch.stack(self._checks).all()) if self._checks else True
        self._on_close(self, self._new if finite else None)
        self._new, self._checks, self.open = {}, [], False
        return finite

    def abort(self, error: "BaseException | None" = None) -> None:
        """Drop the step (after an error): nothing is committed; launched jobs' ``done`` get ``error``."""
        if self.open:
            self._on_close(self, None, counted=False)
        launched = self._launched
        self._new, self._checks, self._launched, self.open = {}, [], [], False
        for _, done in launched:
            if done is not None:
                done(error or RuntimeError("gradcompress: the step was aborted"))

    # ---------------------------------------------------------------- state access
    def old(self, slot: str, key: Hashable):
        """The committed state of ``key`` in ``slot`` (None if there is none)."""
        return self.compressor.state.get(slot, key)

    def new(self, slot: str, key: Hashable):
        """This step's new state of ``key`` if set, else the committed one."""
        got = self._new.get((slot, key))
        return self.old(slot, key) if got is None else got

    def put(self, slot: str, key: Hashable, value: torch.Tensor) -> None:
        self._new[slot, key] = value

    def _spare(self, slot: str, key, like: torch.Tensor) -> torch.Tensor | None:
        """The recycled buffer for a new residual shaped like ``like`` (in the residual dtype), or None."""
        return self.compressor.state.take_spare(slot, key, like.shape, self.compressor.residual_dtype, like.device)

    def _new_residual(self, key, like: torch.Tensor) -> torch.Tensor:
        """The buffer this step's new residual of ``key`` is written into: the one the last commit replaced, or new
        (``like``'s shape, the residual dtype)."""
        out = self._spare("residual", key, like)
        if out is None:
            out = torch.empty(like.shape, dtype=self.compressor.residual_dtype, device=like.device)
        return out

    def _work(self, name: str, key, like: torch.Tensor) -> torch.Tensor:
        """A persistent scratch buffer of ``like``'s layout for ``key`` (lives across steps, never state)."""
        work = self.compressor.workspace
        buf = work.get((name, key))
        if buf is None or buf.shape != like.shape or buf.dtype != like.dtype or buf.device != like.device:
            buf = work[name, key] = torch.empty_like(like, memory_format=torch.contiguous_format)
        return buf

    def check(self, flag: torch.Tensor) -> None:
        """Add a 0-d bool (the same on every rank) to the finiteness decision of :meth:`end`."""
        self._checks.append(flag)

    def seed(self, key: Hashable, codec: Codec, salt: int = 0, shared: bool = False) -> int:
        """The seed of ``key``'s encode at this step (shared by every rank for shared-seed codecs, or ``shared``)."""
        rank = 0 if codec.shared_seed or shared else self.comm.rank
        return mix_seed(self.compressor.seed, key_number(key), self.index, rank, salt)

    # ---------------------------------------------------------------- internals
    def _timed(self, job: exchange.Job) -> exchange.Job:
        """The job, with the time spent in its own code counted as codec time."""
        while True:
            start = time.perf_counter()
            try:
                works = next(job)
            except StopIteration:
                self.codec_seconds += time.perf_counter() - start
                return
            self.codec_seconds += time.perf_counter() - start
            yield works

    def _with_momentum(self, key, g: torch.Tensor) -> torch.Tensor:
        """Momentum correction of a tensor that travels dense: g is replaced by u (in place)."""
        u, state = self._momentum.update(g.detach().float(), self.old("momentum", key))
        self.put("momentum", key, state)
        g.copy_(u.view(g.shape))
        return g

    def _group_job(self, keys, grads, buffer, force_dense) -> exchange.Job:
        comm = self.comm
        self.raw_bytes += sum(g.numel() * g.element_size() for g in grads)
        codec = None if force_dense else self.codec
        if codec is None or codec.exact:  # dense: DDP's own all-reduce (plus momentum correction)
            if self._momentum is not None:
                for k, g in zip(keys, grads):
                    self._with_momentum(k, g)
            if buffer is None and not self.monitoring:  # large contiguous tensors are all-reduced where they lie
                where = [g.numel() >= IN_PLACE_NUMEL and g.is_contiguous() for g in grads]
                big = [g for g, w in zip(grads, where) if w]
                if big:
                    rest = [g for g, w in zip(grads, where) if not w]
                    flat = torch.cat([g.reshape(-1) for g in rest]) if rest else None
                    parts = big + ([flat] if flat is not None else [])
                    yield from exchange.parallel([exchange.dense_mean(comm, t) for t in parts])
                    self.check(torch.stack([all_finite(t) for t in parts]).all())
                    if flat is not None:
                        _scatter(flat, rest)
                    return
            flat = buffer if buffer is not None else torch.cat([g.reshape(-1) for g in grads]) if grads else None
            if flat is not None and flat.numel():
                exact = flat.float().clone() if self.monitoring and not force_dense else None
                jobs = [exchange.dense_mean(comm, flat)] + ([self._monitor_mean(exact)] if exact is not None else [])
                yield from exchange.parallel(jobs)
                self.check(all_finite(flat))
                if buffer is None:
                    _scatter(flat, grads)
                if exact is not None:
                    self._record_monitor(keys, exact, [g.float() for g in grads])
            return
        aggregation = Aggregation.GATHER if self.compressor.collective == "allgather" else codec.aggregation
        dense, comp = [], []
        for k, g in zip(keys, grads):
            small = g.numel() < self.compressor.min_numel
            if aggregation is Aggregation.LOWRANK and codec.matrix_shape(g.shape) is None:
                small = True
            (dense if small else comp).append((k, g))
        if self._momentum is not None:
            for k, g in dense:
                self._with_momentum(k, g)
        # summed codecs read their inputs only before the collective, so they may alias the gradients, which
        # then receive the result directly (no temporary output, no final copy); so may inputs whose error
        # feedback is fused into the encode (read once, before the first collective)
        summed = aggregation is Aggregation.SUM
        fused = aggregation is not Aggregation.LOWRANK and self._fuses_feedback(aggregation)
        inputs = [self._input(k, g, private=not (summed or fused), fused=fused) for k, g in comp]
        device = grads[0].device if grads else None
        # codecs that carry a NaN/Inf through to what every rank receives are checked there instead of on the
        # inputs: the casts on the summed buffer, the quantisers and sparsifiers on the received payloads'
        # scales or values (a few floats per bucket), PowerSGD on the summed first factor (a NaN/Inf in a row of
        # M makes that row of P = M Q NaN/Inf under IEEE arithmetic, Inf * 0 included); no pass over the inputs,
        # no flag round when nothing travels dense
        ride = codec.preserves_nonfinite
        ok = ([] if ride else [all_finite(x) for x in inputs]) + [all_finite(g) for _, g in dense]
        flag = torch.where(torch.stack(ok).all(), 0.0, math.nan) if ok else torch.zeros((), device=device)
        dtype = grads[0].dtype if grads else torch.float32
        dense_flat = torch.cat([g.reshape(-1) for _, g in dense] + [flag.reshape(1).to(dtype)])
        # results land in the gradients themselves where nothing reads the inputs after the result is written
        # (inputs are private copies, or read only before the first collective; beyond the summed path only
        # for float32 gradients, so that sums round as before)
        direct = [g.is_contiguous() and (summed or g.dtype == x.dtype) for x, (_, g) in zip(inputs, comp)]
        outs = [g if d else torch.empty_like(x) for d, x, (_, g) in zip(direct, inputs, comp)]
        flagged = bool(dense) or not ride
        jobs = [exchange.dense_mean(comm, dense_flat)] if flagged else []
        if comp:
            jobs.append(self._compressed_job(codec, aggregation, [k for k, _ in comp], inputs, outs, ride))
        exact = None
        if self.monitoring and comp:  # telemetry: the exact average of the same tensors, counted apart
            exact = torch.cat([self._refs.pop(k).reshape(-1) for k, _ in comp])
            jobs.append(self._monitor_mean(exact))
        yield from exchange.parallel(jobs)
        if exact is not None:
            self._record_monitor([k for k, _ in comp], exact, outs)
        _scatter(dense_flat[:-1], [g for _, g in dense])
        if flagged:
            self.check(all_finite(dense_flat))
        if self.monitoring:  # tensors that travelled dense are exact: they count with no error
            for k, g in dense:
                n2 = g.float().square().sum()
                self.monitor_rows[k] = torch.stack([torch.zeros_like(n2), n2, n2, n2, torch.zeros_like(n2)])
        flag = dense_flat[-1:].float()
        for (k, g), out in zip(comp, outs):
            if not codec.preserves_nonfinite:
                out.view(-1)[:1].add_(flag)
            if out is not g:
                g.copy_(out.view(g.shape))

    def _fuses_feedback(self, aggregation: Aggregation) -> bool:
        """Whether this step's worker error feedback takes the fused path: quantisers and sparsifiers
        (``REQUANTIZE``, ``GATHER``) run it inside the encode (``Codec.encode_feedback``: the residual is
        added and the new one written in the codec's pass, x + residual is never stored; float32 or
        bfloat16 residuals in the quantisers' kernel, the reference inside the codec otherwise); PowerSGD
        (``LOWRANK``) computes its float32 residual in place with one ``addmm_``. Not with momentum masking
        (it needs the delivered values): that takes the reference path."""
        dtypes = (torch.float32,) if aggregation is Aggregation.LOWRANK else RESIDUAL_DTYPES
        return (self._ef is not None and aggregation is not Aggregation.SUM
                and self.compressor.residual_dtype in dtypes
                and not (self._momentum is not None and self._momentum.masking))

    def _input(self, key, grad: torch.Tensor, private: bool = True, fused: bool = False) -> torch.Tensor:
        """What gets compressed: clip -> momentum correction -> + residual, float32 and contiguous
        (``private``: never the gradient's own storage; ``fused``: the residual is left for the encode,
        :meth:`_encode_fed`, to add)."""
        x = grad.detach().float().contiguous()
        if self._clip is not None:
            x, _ = self._clip.update(x)
        if self._momentum is not None:
            x, state = self._momentum.update(x, self.old("momentum", key))
            self.put("momentum", key, state)
        if self.monitoring:
            self._refs[key] = x if x.data_ptr() != grad.data_ptr() else x.clone()
        if self._ef is not None and not fused:
            residual = self.old("residual", key)
            if residual is not None:
                # x + residual goes into a buffer of ours: the residual the last commit replaced (float32
                # residuals; the new residual is then computed in place there) or a persistent workspace
                in_place = residual.dtype == x.dtype
                buf = self._spare("residual", key, x) if in_place else None
                if buf is None:
                    buf = torch.empty_like(x) if in_place else self._work("input", key, x)
                x, _ = self._ef.update(x, residual, out=buf)
                if in_place:
                    self._owned[key] = x
        if private and x.data_ptr() == grad.data_ptr():
            x = x.clone()  # the gradient is overwritten with the result while x may still be read
        return x

    def _delivered(self, key, sent: torch.Tensor, delivered: Callable[[], torch.Tensor]) -> None:
        """Record what this rank's compression delivered for ``key``: the new residual and masked momentum.

        ``delivered`` is evaluated once, and only when some state needs it.
        """
        masking = self._momentum is not None and self._momentum.masking
        if self._ef is None and not masking:
            return
        cache: list[torch.Tensor] = []

        def once() -> torch.Tensor:
            if not cache:
                cache.append(delivered())
            return cache[0]

        if self._ef is not None:  # in place where ``sent`` is our own buffer: nothing reads it after this
            out = sent if self._owned.get(key) is sent else self._spare("residual", key, sent)
            self.put("residual", key, self._ef.after(None, sent, once, out=out))
        if masking:
            self.put("momentum", key, self._momentum.after(self.new("momentum", key), sent, once))

    def _delivered_product(self, key, sent: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
        """:meth:`_delivered` of a low-rank delivery ``a @ b.T``: the new residual ``sent - a @ b.T`` computed in
        place by one ``addmm_`` (no n x m product materialised; the same values as the subtraction, which
        stays the path for masked momentum and residuals in another dtype)."""
        if not self._fuses_feedback(Aggregation.LOWRANK) or sent.dtype != torch.float32:
            return self._delivered(key, sent, lambda: a @ b.T)
        out = sent if self._owned.get(key) is sent else self._new_residual(key, sent)
        if out is not sent:
            out.copy_(sent)
        out.view(a.shape[0], b.shape[0]).addmm_(a, b.T, alpha=-1)
        self.put("residual", key, out)

    def _delivered_sparse(self, codec, key, sent: torch.Tensor, payload, world: int) -> bool:
        """:meth:`_delivered` of random-k's mean part: the new residual ``sent - decode(payload) * world`` changes
        only at the k kept positions (elsewhere sent - 0 = sent, bit for bit), so it is written there only.
        False (the dense reference path) with masked momentum or a residual in another dtype."""
        kept = getattr(codec, "kept", None)
        if (kept is None or not payload.tensors or sent.dtype != torch.float32 or not sent.is_contiguous()
                or self.compressor.residual_dtype != torch.float32
                or not self._fuses_feedback(Aggregation.GATHER)):  # the sparsifiers' switch: EF on, no masking
            return False
        out = sent if self._owned.get(key) is sent else self._new_residual(key, sent)
        if out is not sent:
            out.copy_(sent)
        idx, vals = kept(payload)
        flat = out.view(-1)
        flat.index_copy_(0, idx, flat.index_select(0, idx) - vals * world)
        self.put("residual", key, out)
        return True

    def _compressed_job(self, codec, aggregation, keys, inputs, outs, check_sum: bool = False) -> exchange.Job:
        comm = self.comm
        world = comm.world
        if aggregation is Aggregation.SUM:
            dtype = codec.mean_part_dtype(inputs[0]) if inputs else None
            buf = torch.empty(sum(x.numel() for x in inputs), dtype=dtype, device=inputs[0].device) if dtype else None
            payloads, offset = [], 0
            for k, x in zip(keys, inputs):  # casts write straight into one buffer: the all-reduce needs no cat
                part = buf[offset : offset + x.numel()] if buf is not None else None
                offset += x.numel()
                p = codec.encode_mean_part(x, world, seed=self.seed(k, codec), out=part)
                if not self._delivered_sparse(codec, k, x, p, world):
                    self._delivered(k, x, lambda p=p: codec.decode(p).float() * world)
                payloads.append(p)
            yield from exchange.sum_mean(comm, codec, payloads, outs,
                                         (lambda f: self.check(all_finite(f))) if check_sum else None)
        elif aggregation is Aggregation.GATHER:
            payloads = []
            for k, x in zip(keys, inputs):
                if self._fuses_feedback(aggregation):
                    p = self._encode_fed(codec, k, x, [self.seed(k, codec)], 1)[0]
                else:
                    p = codec.encode(x, seed=self.seed(k, codec))
                    self._delivered(k, x, lambda p=p: codec.decode(p).float())
                payloads.append(p)
            yield from exchange.gather_mean(comm, codec, payloads, outs, self._check_payloads if check_sum else None)
        elif aggregation is Aggregation.REQUANTIZE and world == 1:  # nothing to reduce: no second quantisation
            for k, x, out in zip(keys, inputs, outs):
                if self._fuses_feedback(aggregation):
                    p = self._encode_fed(codec, k, x, [self.seed(k, codec)], 1)[0]
                else:
                    p = codec.encode(x, seed=self.seed(k, codec))
                    self._delivered(k, x, lambda p=p: codec.decode(p).float())
                if check_sum:
                    self._check_payloads([p])
                codec.decode_into(p, out)
        elif aggregation is Aggregation.REQUANTIZE:
            # tensors that lie on whole quantisation buckets (or nearly) travel as one payload; the others as
            # their own W chunks each; decided per tensor, so results do not depend on how tensors are grouped
            whole = [self._whole_group(codec, x) for x in inputs]
            parts = [[v for v, w in zip(seq, whole) if w == flag] for flag in (True, False) for seq in (keys, inputs, outs)]
            jobs = []
            if parts[0]:
                jobs.append(self._bucketed_job(codec, *parts[:3], check_sum))
            if parts[3]:
                jobs.append(self._chunked_job(codec, *parts[3:], check_sum))
            yield from exchange.parallel(jobs)
        else:
            yield from self._lowrank_job(codec, keys, inputs, outs, check_sum)

    def _monitor_mean(self, flat: torch.Tensor) -> exchange.Job:
        yield [self.comm.all_reduce(flat, monitor=True)]
        flat.div_(self.comm.world)

    def _record_monitor(self, keys, exact: torch.Tensor, outs: list[torch.Tensor]) -> None:
        """Per key: squared error, squared norms and dot product of the delivered against the exact average."""
        offset = 0
        for k, out in zip(keys, outs):
            ref = exact[offset : offset + out.numel()]
            got = out.reshape(-1)
            offset += out.numel()
            residual = self._new.get(("residual", k))
            self.monitor_rows[k] = torch.stack([
                (got - ref).square().sum(), ref.square().sum(), (got * ref).sum(), got.square().sum(),
                residual.float().square().sum() if residual is not None else torch.zeros((), device=got.device)])

    def encode_chunks(self, codec: Codec, key, x: torch.Tensor) -> list:
        """``x`` cut into one chunk per rank (:func:`exchange.split_chunks`), each encoded."""
        parts = exchange.split_chunks(x.reshape(-1), self.comm.world, exchange.CHUNK_BLOCK)
        seed = self.seed(key, codec)
        return [codec.encode(c, seed=mix_seed(seed, j)) for j, c in enumerate(parts)]

    def _whole_group(self, codec: Codec, x: torch.Tensor) -> bool:
        """Whether ``x`` travels in its group's single payload (:meth:`_bucketed_job`): bucketed quantisers whose
        codes can be cut at bucket edges, without server error feedback (whose residuals are kept per tensor
        chunk, on the per-tensor path), for tensors whose last bucket pads them by at most 1 %
        (:func:`exchange.fills_buckets`). The others take :meth:`_chunked_job`."""
        return (self._server_ef is None and hasattr(codec, "encode_piece") and codec.slices_by_bucket()
                and exchange.fills_buckets(x.numel(), codec.bucket))

    def _chunked_job(self, codec, keys, inputs, outs, check: bool) -> exchange.Job:
        """The per-tensor two-step reduce: each tensor cut into W chunks (:func:`exchange.split_chunks`), each
        chunk its own payload (O(tensors x W) calls; for tensors off the bucket grid and server error feedback)."""
        world = self.comm.world
        chunked = []
        for k, x in zip(keys, inputs):
            if self._fuses_feedback(Aggregation.REQUANTIZE):
                seed = self.seed(k, codec)
                payloads = self._encode_fed(codec, k, x, [mix_seed(seed, j) for j in range(world)], world)
            else:
                payloads = self.encode_chunks(codec, k, x)
                self._delivered(k, x, lambda ps=payloads, n=x.numel(), d=x.device: decode_chunks(codec, ps, n, d))
            chunked.append(payloads)

        def reencode(i: int, mean_chunk: torch.Tensor):
            return self.encode_owned_chunk(codec, keys[i], mean_chunk)

        yield from exchange.two_step_mean(self.comm, codec, chunked, outs, reencode,
                                          self._check_payloads if check else None)

    def _zeroed(self, name: str, key, numel: int, dtype, device) -> torch.Tensor:
        """A persistent zero-initialised buffer (reused across steps; callers write the same positions each step)."""
        work = self.compressor.workspace
        buf = work.get((name, key))
        if buf is None or buf.numel() != numel or buf.dtype != dtype or buf.device != device:
            buf = work[name, key] = torch.zeros(numel, dtype=dtype, device=device)
        return buf

    def _bucketed_job(self, codec, keys, inputs, outs, check: bool) -> exchange.Job:
        """The two-step reduce of a bucketed quantiser over the whole group at once.

        Layout: the tensors' buckets back to back (each tensor starts on a bucket edge, so no bucket holds
        two tensors and the scales are the same as encoding each tensor alone), cut into W chunks of
        ``ceil(buckets / W)`` buckets; codes and scales are two flat buffers in that layout. Each tensor is
        encoded once into its place (with the worker error feedback fused: ``Codec.encode_piece``), the
        chunk owner decodes W payloads and re-encodes its chunk tensor piece by tensor piece, and each
        tensor is decoded once from the gathered buffers straight into its output. Python work per step:
        O(tensors + W) calls, not O(tensors x W). Finiteness: the gathered scales (every rank holds them).
        """
        comm, world = self.comm, self.comm.world
        size, device = codec.bucket, inputs[0].device
        first = [0]  # the first bucket of each tensor, then the total
        for x in inputs:
            first.append(first[-1] + -(-x.numel() // size))
        per_chunk = -(-first[-1] // world)  # buckets per chunk
        code_dtype, chunk_codes = codec.code_layout(per_chunk * size)
        per_bucket = codec.code_layout(size)[1]  # whole code elements per bucket (slices_by_bucket)
        group = tuple(keys)
        codes = self._zeroed("codes", group, world * chunk_codes, code_dtype, device)
        scales = self._zeroed("scales", group, world * per_chunk, torch.float32, device)

        def place(c: torch.Tensor, s: torch.Tensor, bucket: int, numel: int):
            """The codes and scales of ``numel`` elements starting at ``bucket`` (relative to c and s)."""
            at = bucket * per_bucket
            return c[at : at + codec.code_layout(numel)[1]], s[bucket : bucket - (-numel // size)]

        fused = self._fuses_feedback(Aggregation.REQUANTIZE)
        for t, (k, x) in enumerate(zip(keys, inputs)):
            c, s = place(codes, scales, first[t], x.numel())
            seed = self.seed(k, codec)
            if fused:
                residual = self.old("residual", k)
                if residual is not None and residual.shape != x.shape:
                    residual = None
                out = self._new_residual(k, x)
                codec.encode_piece(x, residual, out, c, s, seed)
                self.put("residual", k, out)
            else:
                codec.encode_piece(x, None, None, c, s, seed)
                self._delivered(k, x, lambda c=c, s=s, x=x, seed=seed: codec.decode(
                    Payload((c, s), x.shape, torch.float32, seed, device)).float())
        lo, hi = comm.rank * per_chunk, (comm.rank + 1) * per_chunk

        def reencode(mean: torch.Tensor):
            mine_codes = self._zeroed("owner codes", group, chunk_codes, code_dtype, device)
            mine_scales = self._zeroed("owner scales", group, per_chunk, torch.float32, device)
            for t in range(max(0, bisect.bisect_right(first, lo) - 1), len(inputs)):
                a, b = max(first[t], lo), min(first[t + 1], hi)
                if a >= hi:
                    break
                if a >= b:
                    continue
                start = (a - first[t]) * size
                numel = min(inputs[t].numel(), (b - first[t]) * size) - start
                c, s = place(mine_codes, mine_scales, a - lo, numel)
                m = mean[(a - lo) * size : (a - lo) * size + numel]
                # the noise of an element's re-encode does not depend on which rank owns it (nor on the grouping)
                codec.encode_piece(m, None, None, c, s, self.seed(keys[t], codec, salt=1, shared=True), start)
            return mine_codes, mine_scales

        def finish(all_codes: torch.Tensor, all_scales: torch.Tensor) -> None:
            if check:
                self.check(all_finite(all_scales))
            for t, (x, out) in enumerate(zip(inputs, outs)):
                c, s = place(all_codes, all_scales, first[t], x.numel())
                codec.decode_into(Payload((c, s), x.shape, torch.float32, None, device), out)

        yield from exchange.bucketed_two_step_mean(comm, codec, codes, scales, reencode, finish)

    def _check_payloads(self, payloads: list) -> None:
        """The step's finiteness, read from received payloads that every rank holds alike (see :func:`exchange.floats`)."""
        values = exchange.floats(payloads)
        if values is not None:
            self.check(all_finite(values))

    def _encode_fed(self, codec: Codec, key, x: torch.Tensor, seeds: list[int], parts: int) -> list:
        """Worker error feedback fused into the encode: ``x`` + the committed residual cut into ``parts`` chunks
        (:func:`exchange.split_chunks`'s, one seed each), each encoded by ``Codec.encode_feedback``, whose new
        residual goes straight into the residual buffer of this step (the one the last commit replaced).

        The same payloads and residual as encoding x + residual and subtracting the decode (the reference),
        without materialising x + residual or a full decode."""
        residual = self.old("residual", key)
        if residual is not None and residual.shape != x.shape:
            residual = None
        out = self._new_residual(key, x)
        xs, outs = x.reshape(-1), out.view(-1)
        rs = None if residual is None else residual.reshape(-1)
        n = xs.numel()
        per = exchange.chunk_numel(n, parts) if parts > 1 else n
        payloads = []
        for j, seed in enumerate(seeds):
            lo, hi = min(n, j * per), min(n, (j + 1) * per)
            if hi - lo == per:
                payloads.append(codec.encode_feedback(xs[lo:hi], None if rs is None else rs[lo:hi], seed=seed,
                                                      out=outs[lo:hi]))
                continue
            # the last chunk (and any beyond n), zero-padded to the chunk size, as split_chunks pads
            xp = torch.zeros(per, dtype=xs.dtype, device=xs.device)
            xp[: hi - lo] = xs[lo:hi]
            rp = None
            if rs is not None:
                rp = torch.zeros(per, dtype=rs.dtype, device=rs.device)
                rp[: hi - lo] = rs[lo:hi]
            tmp = torch.empty(per, dtype=outs.dtype, device=xs.device)
            payloads.append(codec.encode_feedback(xp, rp, seed=seed, out=tmp))
            outs[lo:hi] = tmp[: hi - lo]
        self.put("residual", key, out)
        return payloads

    def encode_owned_chunk(self, codec: Codec, key, mean_chunk: torch.Tensor):
        """The chunk owner's re-encode in the two-step reduce, with server error feedback when on."""
        seed = self.seed(key, codec, salt=1)
        if self._server_ef is None:
            return codec.encode(mean_chunk, seed=seed)
        residual = self.old("server_residual", key)
        if residual is not None and residual.numel() != mean_chunk.numel():
            residual = None  # a checkpoint from another world size: restart this residual
        y, _ = self._server_ef.update(mean_chunk, residual)
        payload = codec.encode(y, seed=seed)
        self.put("server_residual", key, self._server_ef.after(None, y, lambda: codec.decode(payload).float(),
                                                               out=self._spare("server_residual", key, y)))
        return payload

    # ---------------------------------------------------------------- PowerSGD rounds
    def _basis(self, slot: str, key, size: int, rank: int, device, salt: int) -> torch.Tensor:
        """PowerSGD's warm-started factor for ``key``, drawn from the seed at first use (or on a rank change)."""
        cur = self.old(slot, key)
        if cur is None or cur.shape != (size, rank):
            fresh = initial_q(size, rank, mix_seed(self.compressor.seed, key_number(key), salt), device)
            if cur is not None and cur.shape[0] == size:
                r = min(rank, cur.shape[1])
                fresh[:, :r] = cur[:, :r]
            cur = orthonormalize_(fresh) if salt else fresh
        return cur

    def _lowrank_job(self, codec, keys, inputs, outs, check: bool = False) -> exchange.Job:
        """PowerSGD (Vogels et al. 2019), all matrices of the group batched into one all-reduce per round.

        Default: P = M Q; all-reduce P; orthonormalise; Q = M^T P; all-reduce Q; result
        P Q^T; Q warm-starts the next step. ``alternate=true``: one all-reduce per step,
        even steps reduce P = M Q_hat (result P Q_hat^T), odd steps Q = M^T P_hat (result
        P_hat Q^T), the reduced factor orthonormalised becomes the next step's basis. ``check``: the step's
        finiteness is read from the first all-reduced factor (every rank holds it).
        """
        comm, world = self.comm, self.comm.world
        mats = []
        for x in inputs:
            n, m = codec.matrix_shape(x.shape)
            mats.append(x.view(n, m))
        rank_of = [min(codec.rank, *m.shape) for m in mats]
        dev = mats[0].device
        if not codec.alternate:
            qs = [self._basis("q", k, m.shape[1], r, dev, 0) for k, m, r in zip(keys, mats, rank_of)]
            ps = torch.cat([product(m, q).reshape(-1) for m, q in zip(mats, qs)])
            yield [comm.all_reduce(ps)]
            if check:
                self.check(all_finite(ps))
            p_hat = [orthonormalize_(p) for p in _split(ps, [(m.shape[0], r) for m, r in zip(mats, rank_of)])]
            q_local = [transposed_product(m, p) for m, p in zip(mats, p_hat)]
            for k, x, p, q in zip(keys, inputs, p_hat, q_local):
                self._delivered_product(k, x, p, q)
            q_flat = torch.cat([q.reshape(-1) for q in q_local])
            yield [comm.all_reduce(q_flat)]
            q_flat.div_(world)
            for k, p, q, out in zip(keys, p_hat, _split(q_flat, [q.shape for q in q_local]), outs):
                torch.matmul(p, q.T, out=out.view(p.shape[0], q.shape[0]))
                self.put("q", k, q.clone())
            return
        p_step = self.index % 2 == 0
        bases = [self._basis("q" if p_step else "p", k, m.shape[1] if p_step else m.shape[0], r, dev,
                             1 if p_step else 2) for k, m, r in zip(keys, mats, rank_of)]
        local = [product(m, b) if p_step else transposed_product(m, b) for m, b in zip(mats, bases)]
        for k, x, b, f in zip(keys, inputs, bases, local):
            self._delivered_product(k, x, f, b) if p_step else self._delivered_product(k, x, b, f)
        flat = torch.cat([f.reshape(-1) for f in local])
        yield [comm.all_reduce(flat)]
        if check:
            self.check(all_finite(flat))
        flat.div_(world)
        for k, b, f, out in zip(keys, bases, _split(flat, [f.shape for f in local]), outs):
            if p_step:
                torch.matmul(f, b.T, out=out.view(f.shape[0], b.shape[0]))
                self.put("p", k, orthonormalize_(f.clone()))
            else:
                torch.matmul(b, f.T, out=out.view(b.shape[0], f.shape[0]))
                self.put("q", k, orthonormalize_(f.clone()))


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


__all__ = ["SLOTS", "State", "Step", "key_number", "mix_seed"]
