"""The step protocol: one compressed step as a small transaction, from begin to commit or rollback.

Every adapter (the DDP hook, ``Compressor.synchronize``, 1-bit Adam, the FSDP reduce-scatter, DiLoCo's outer
exchange, ``plan``'s calibration) drives a :class:`~gradcompress.Compressor` through this and nothing else::

    with compressor.step() as step:                # schedule position, codec of this step
        step.drive([step.exchange(keys, tensors)]) # jobs of collective rounds, the same order on every rank
    step.committed                                 # True: every rank was finite, new state committed

(commit on a clean exit, rollback on an exception), or, to overlap the first round with other work (the
backward pass)::

    step = compressor.begin_step()
    step.launch(job, done)                         # issue the first round now
    ...
    step.finish()                                  # drive every launched job, end, call done

The step hands out exchanges (:mod:`gradcompress.exchanges`: one per algebra, each on the step's collectives)
and gives each a :class:`~gradcompress.exchanges.context.Context`, the only writer of new state, checks and
recycled buffers. New states are held there, never written into the Compressor's :class:`State` before the end:

* finite on every rank (decided from values every rank has after the collectives): every new state is
  committed and the schedule position advances;
* otherwise every rank's result is non-finite (``GradScaler`` skips the step everywhere) and nothing is
  committed: residuals, PowerSGD factors, momentum and the schedule position stay as they were.

Host synchronisations the algorithm needs (and no others on this path): the finiteness decision at the end
(one per step), and the payload sizes of variable-size codecs (``threshold``, ``dgc``) before their all-gather.
"""

from __future__ import annotations

import contextlib
import time
from typing import Callable, Hashable, Sequence

import torch

from .codecs.base import Aggregation, Codec
from .collectives import Collectives, Job, Running, drive
from .exchanges.context import Context, all_finite, key_number, mix_seed
from .exchanges.dense import DenseExchange
from .exchanges.grouped import GroupExchange, algebra_exchange
from .exchanges.reduce_scatter import HierarchicalReduceScatter, ReduceScatterExchange
from .exchanges.replicas import ReplicaExchange
from .monitor import StepMonitor
from .schedule import codec_at

#: the state slots a Compressor keeps, each a dict key -> tensor
SLOTS = ("residual", "server_residual", "q", "p", "momentum")
#: slots whose replaced tensors are recycled as buffers (their new value never reads the old tensor in place)
RECYCLED = ("residual", "server_residual")


def _same_layout(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and a.device == b.device and a.is_contiguous()


def _key(text: str):
    return int(text) if text.lstrip("-").isdigit() else text


class State:
    """Everything compression remembers between steps, in one place.

    ``step``: committed steps (the schedule position); ``slots[name][key]``: per-key tensors, with ``name`` one
    of :data:`SLOTS`: ``residual`` (worker error feedback), ``server_residual`` (the chunk owner's, two-step
    reduce), ``q``/``p`` (PowerSGD's warm-started factors), ``momentum`` (momentum correction).
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


class Step:
    """One step of a :class:`~gradcompress.Compressor` (made by ``Compressor.step()`` / ``begin_step()``).

    ``codec`` is this step's codec (None on a dense warm-up step); ``comm`` the collectives it issues;
    ``ctx`` the context its exchanges write through. See the module docstring for the lifecycle.
    """

    def __init__(self, compressor, comm: Collectives, on_close: Callable):
        c = self.compressor = compressor
        self._on_close = on_close  # on_close(step, new_state_or_None, counted=True)
        self.comm = comm
        self.index = c.state.step
        self.codec: Codec | None = codec_at(c.codec, self.index, c.warmup_steps, c.schedule, c.ramp_steps)
        self.ctx = Context(c.state, c.workspace, c.seed, self.index, comm.rank, c.residual_dtype)
        every = c.monitor_every
        if every > 0 and self.codec is not None and self.index % every == 0:
            self.ctx.monitor = StepMonitor(self.ctx)
        self.ctx.transforms = c.transforms(self.ctx, comm.world)
        self._launched: list = []
        self.raw_bytes = 0
        self.codec_seconds = 0.0
        self.open = True
        self.committed: bool | None = None

    # ---------------------------------------------------------------- exchanges
    def exchange(self, keys: Sequence[Hashable], tensors: Sequence[torch.Tensor],
                 buffer: torch.Tensor | None = None, *, dense: bool = False) -> Job:
        """Average ``tensors`` across the group, in place, as a job of collective rounds.

        ``keys`` name each tensor's state (the same on every rank and in every run); ``buffer``: optional flat
        tensor whose storage holds all of ``tensors`` (DDP's bucket), used as the dense all-reduce buffer;
        ``dense=True`` sends this group uncompressed whatever the step (still through momentum correction and
        the finiteness check).
        """
        self._require_open()
        return self._timed(self._group_job(list(keys), list(tensors), buffer, dense))

    def reduce_scatter(self, key: Hashable, input: torch.Tensor, output: torch.Tensor, scale: float) -> Job:
        """A compressed reduce-scatter, as a job (:mod:`gradcompress.exchanges.reduce_scatter`): ``input`` holds
        one chunk per rank; ``output`` receives this rank's chunk of the sum over ranks, times ``scale``."""
        self._require_open()

        def job() -> Job:
            self.raw_bytes += input.numel() * input.element_size()
            c = self.compressor
            if c.hierarchy is not None:  # dense inside each node, compressed between
                h = c.hierarchy
                exchange = HierarchicalReduceScatter(h.intra, h.inter, self.codec, c.dense_codec, h.cast)
            else:
                exchange = ReduceScatterExchange(self.comm, self.codec, c.dense_codec)
            yield from exchange.job(self.ctx, key, input, output, scale)

        return self._timed(job())

    def all_reduce_shard(self, key: Hashable, shard: torch.Tensor) -> Job:
        """HSDP's replica all-reduce, compressed, as a job (:mod:`gradcompress.exchanges.replicas`): ``shard``, this
        worker's shard already reduced inside its node, becomes its mean over the replicas, in place. On a
        hierarchical topology (``Topology.of_groups(shard_group, replicate_group)``) the codec's exchange runs on
        the replicate group and a finiteness flag inside the node; flat (one worker per node) it is :meth:`exchange`."""
        self._require_open()
        c = self.compressor
        if c.hierarchy is None:
            return self.exchange([key], [shard.view(-1)])

        def job() -> Job:
            self.raw_bytes += shard.numel() * shard.element_size()
            between = c.hierarchy.between(self.codec, self._aggregation(self.codec), c.seed)
            yield from ReplicaExchange(c.hierarchy.intra, between).job(self.ctx, key, shard)

        return self._timed(job())

    def _aggregation(self, codec: Codec | None) -> Aggregation | None:
        gathered = self.compressor.collective == "allgather"
        return None if codec is None else Aggregation.GATHER if gathered else codec.aggregation

    def _group_job(self, keys, grads, buffer, force_dense: bool) -> Job:
        self.raw_bytes += sum(g.numel() * g.element_size() for g in grads)
        codec = None if force_dense else self.codec
        ctx, c = self.ctx, self.compressor
        aggregation = self._aggregation(codec)
        if c.hierarchy is not None and not force_dense:  # dense inside each node, the codec's exchange between
            yield from c.hierarchy.exchange(codec, aggregation, c.seed, c.min_numel).job(ctx, keys, grads)
            return
        if codec is None or codec.exact:  # dense: DDP's own all-reduce (plus momentum correction)
            if ctx.transforms.momentum is not None:
                for k, g in zip(keys, grads):
                    ctx.transforms.dense(k, g)
            monitored = ctx.monitor is not None and not force_dense
            yield from DenseExchange(self.comm).job(ctx, keys, grads, buffer, monitored)
            return
        inner = algebra_exchange(self.comm, codec, aggregation, c.seed)
        yield from GroupExchange(self.comm, codec, inner, c.min_numel).job(ctx, keys, grads)

    def _timed(self, job: Job) -> Job:
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

    def _require_open(self) -> None:
        if not self.open:
            raise RuntimeError("gradcompress: this step has ended; begin a new one with compressor.step()")

    # ---------------------------------------------------------------- driving
    def launch(self, job: Job, done: Callable[[BaseException | None], None] | None = None) -> None:
        """Issue ``job``'s first round now; :meth:`finish` completes it and calls ``done(None)``
        (or ``done(error)`` if the step failed).

        With the compressor's ``overlap`` (off by default), every job launched before this one is then advanced
        by one round: it waits for its works in flight and issues its next round, so later rounds of
        earlier buckets travel while the backward pass still produces later buckets. The order is fixed
        (each launch: the new job's first round, then each earlier job's next round, in launch order), the
        same on every rank, so it stays deadlock-free on gloo and NCCL."""
        running = Running(job)
        if self.compressor.overlap:
            for earlier, _ in self._launched:
                earlier.advance(self.comm)
        self._launched.append((running, done))

    def finish(self) -> bool:
        """Drive every launched job, end the step, then call each ``done``. Returns :meth:`end`'s result."""
        with self:
            self.drive([running.rest() for running, _ in self._launched])
        launched, self._launched = self._launched, []
        for _, done in launched:
            if done is not None:
                done(None)
        return self.committed

    def drive(self, jobs: list[Job]) -> None:
        """Run jobs to completion, round-robin, in the order given (the same on every rank)."""
        drive(jobs, self.comm)

    # ---------------------------------------------------------------- the end
    def end(self) -> bool:
        """Commit the step's new state if every rank was finite (one host sync); True if committed."""
        checks = self.ctx.checks
        finite = bool(torch.stack(checks).all()) if checks else True
        self._on_close(self, self.ctx.new if finite else None)
        self.ctx.new, self.ctx.checks, self.open, self.committed = {}, [], False, finite
        return finite

    def abort(self, error: "BaseException | None" = None) -> None:
        """Drop the step (after an error): nothing is committed; launched jobs' ``done`` get ``error``."""
        if self.open:
            self._on_close(self, None, counted=False)
        launched = self._launched
        self.ctx.new, self.ctx.checks, self._launched, self.open = {}, [], [], False
        for _, done in launched:
            if done is not None:
                done(error or RuntimeError("gradcompress: the step was aborted"))

    @contextlib.contextmanager
    def guarded(self, end: bool = True):
        """A block that aborts the step on an exception (and re-raises it) and, with ``end``, ends it on a clean
        exit (a step that spans several blocks, such as FSDP's backward, passes ``end=False`` until the last)."""
        try:
            yield self
        except BaseException as err:
            self.abort(err)
            raise
        if end and self.open:
            self.end()

    def __enter__(self) -> "Step":
        self._guard = self.guarded()
        return self._guard.__enter__()

    def __exit__(self, *exc) -> bool:
        return bool(self._guard.__exit__(*exc))


__all__ = ["SLOTS", "State", "Step", "all_finite", "key_number", "mix_seed"]
