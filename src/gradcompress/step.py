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

A step carries a **plan** (:class:`~gradcompress.schedule.Plan`: key -> codec, None for dense); the session
(:class:`~gradcompress.session.Session`) builds the exchange of each codec (:mod:`gradcompress.exchanges`: one per
algebra, each on the step's collectives, all of one signature ``job(ctx, keys, inputs, outputs)``, dividing by the
session's divisor), and the step gives each a :class:`~gradcompress.exchanges.context.Context`, the only writer of
new state, checks and recycled buffers. New states are held there, never written into the
:class:`~gradcompress.state.State` before the end:

* finite on every rank (decided from values every rank has after the collectives) and, where the step was given
  ``should_commit`` (an outside party's decision, e.g. torchft's ``Manager.should_commit``), agreed by it: every
  new state is committed and the schedule position advances;
* otherwise nothing is committed: residuals, PowerSGD factors, momentum and the schedule position stay as they
  were (a non-finite step leaves every rank's result non-finite: ``GradScaler`` skips it everywhere).

Host synchronisations the algorithm needs (and no others on this path): the finiteness decision at the end
(one per step), and the payload sizes of variable-size codecs (``threshold``, ``dgc``) before their all-gather (one
read for every tensor, rank and bucket of the step: :class:`~gradcompress.collectives.HostRead`).
"""

from __future__ import annotations

import contextlib
import types
from collections.abc import Callable, Generator, Hashable, Sequence
from typing import TYPE_CHECKING, cast

import torch

from .collectives import Collectives, Job, Running, drive, finish, one_job
from .codecs.base import Codec, PayloadError
from .exchanges.context import QUIET_SLOTS, Context, all_finite, first_malformed, key_number, mix_seed
from .monitor import Telemetry
from .schedule import Plan
from .state import SLOTS, State
from .terms import Recorder, Seen, StepRecord, Terms

if TYPE_CHECKING:
    from .config import Config
    from .session import Session

#: the state a silent step (a replica being healed) commits: what every rank computes alike from the collectives
SHARED_SLOTS = ("q", "p")
#: what a launched job's ``done`` is called with: None, or the error that failed the step
Done = Callable[[BaseException | None], None]


class Step:
    """One step of a :class:`~gradcompress.Compressor` (made by ``Compressor.step()`` / ``begin_step()``).

    ``terms``: what this step does (:class:`~gradcompress.terms.Terms`: its index, plan, divisor, silent,
    commit decision); ``plan`` is its key -> codec (``codec``: its default, None on a dense warm-up step); ``comm``
    the collectives it issues; ``ctx`` the context its exchanges write through; ``closed``: called with the step
    whenever its outcome changes (ended, decided, aborted), e.g. the coordinator's. See the module docstring for the
    lifecycle. Nothing outside this module assigns a step's attributes; what it measured (kept by its
    :class:`~gradcompress.terms.Recorder`) is :attr:`record`.
    """

    def __init__(self, config: Config, session: Session, state: State, telemetry: Telemetry,
                 workspace: dict[tuple[str, Hashable], torch.Tensor], terms: Terms,
                 closed: Callable[[Step], None] | None = None) -> None:
        self.session, self.state, self.telemetry, self.terms = session, state, telemetry, terms
        self.comm = comm = cast(Collectives, session.comm)  # opened by the compressor before its step
        divisor = session.divisor() if terms.divisor is None else terms.divisor
        every = config.monitor_every
        self.ctx = Context(state, workspace, config.seed, terms.index, comm.rank, config.residual_dtype,
                           divisor=divisor, silent=terms.silent,
                           monitored=every > 0 and self.codec is not None and terms.index % every == 0,
                           transforms=lambda ctx: config.transforms(ctx, comm.world))
        self._closed = closed
        self._recorder = Recorder(terms)  # what the step saw and measured: its record
        self._launched: list[tuple[Running, Done | None]] = []
        self.open = True
        self.finite: bool | None = None
        self.committed: bool | None = None

    @property
    def plan(self) -> Plan:
        """The step's key -> codec."""
        return self.terms.plan

    @property
    def index(self) -> int:
        """The step's schedule position."""
        return self.terms.index

    @property
    def codec(self) -> Codec | None:
        """The plan's default codec (None on a dense warm-up step)."""
        return self.terms.plan.default

    @property
    def deferred(self) -> bool:
        """The commit waits for :meth:`decide` (torchft: ``Manager.should_commit``, asked by the user's loop)."""
        return self.terms.deferred

    @property
    def silent(self) -> bool:
        """This rank takes part in the collectives but contributes zeros and reads none of its own state
        (:data:`QUIET_SLOTS`): a replica that torchft is healing; its new state in them is never committed."""
        return self.terms.silent

    @property
    def codec_seconds(self) -> float:
        return self._recorder.seconds

    @property
    def record(self) -> StepRecord:
        """What this step did so far (:class:`StepRecord`), a snapshot."""
        return self._recorder.record(self.index, self.plan, self.committed, self.finite, self.silent)

    # ---------------------------------------------------------------- exchanges
    def exchange(self, keys: Sequence[Hashable], tensors: Sequence[torch.Tensor],
                 buffer: torch.Tensor | None = None, *, dense: bool = False) -> Job:
        """Average ``tensors`` across the group, in place, as a job of collective rounds.

        ``keys`` name each tensor's state (the same on every rank and in every run); ``buffer``: optional flat
        tensor whose storage holds all of ``tensors`` (DDP's bucket), used as the dense all-reduce buffer;
        ``dense=True`` sends this group uncompressed whatever the plan (still through momentum correction and
        the finiteness check).
        """
        self._require_open()
        keys, tensors = list(keys), list(tensors)
        if self.silent:
            for t in tensors:
                t.zero_()
        shapes = tuple(tuple(t.shape) for t in tensors)
        self._recorder.saw(Seen(tuple(keys), shapes, tensors[0].device if tensors else None), tensors, sampled=True)
        groups = self.plan.groups(keys)
        if len(groups) > 1:
            buffer = None  # the bucket's buffer holds every group's tensors: each group averages its own
        monitored = self.ctx.monitor is not None and not dense
        jobs: list[Job] = []
        for codec, idx in groups:
            ks, ts = [keys[i] for i in idx], [tensors[i] for i in idx]
            exchange = self.session.exchange(None if dense else codec, dense, buffer, monitored, self.plan.flat)
            jobs.append(exchange.job(self.ctx, ks, ts, ts))
        return one_job(jobs)

    def reduce_scatter(self, key: Hashable, input: torch.Tensor, output: torch.Tensor, scale: float) -> Job:
        """A compressed reduce-scatter, as a job (:mod:`gradcompress.exchanges.reduce_scatter`): ``input`` holds
        one chunk per rank; ``output`` receives this rank's chunk of the sum over ranks, times ``scale``."""
        self._require_open()
        seen = Seen((key,), (tuple(input.shape),), input.device, "reduce_scatter", tuple(output.shape), scale)
        self._recorder.saw(seen, [input])
        exchange = self.session.reduce_scatter(self.plan.codec(key), scale, self.plan.flat)
        job: Job = exchange.job(self.ctx, [key], [input], [output])
        return job

    def all_reduce_shard(self, key: Hashable, shard: torch.Tensor) -> Job:
        """HSDP's replica all-reduce, compressed, as a job (:mod:`gradcompress.exchanges.replicas`): ``shard``, this
        worker's shard already reduced inside its node, becomes its mean over the replicas, in place. On a
        hierarchical topology (``Topology.of_groups(shard_group, replicate_group)``) the codec's exchange runs on
        the replicate group and a finiteness flag inside the node; flat (one worker per node) it is :meth:`exchange`."""
        self._require_open()
        exchange = self.session.replicas(self.plan.codec(key))
        if exchange is None:
            return self.exchange([key], [shard.view(-1)])
        self._recorder.saw(Seen((key,), (tuple(shard.shape),), shard.device, "replicas"), [shard])
        job: Job = exchange.job(self.ctx, [key], [shard], [shard])
        return job

    def _require_open(self) -> None:
        if not self.open:
            raise RuntimeError("gradcompress: this step has ended; begin a new one with compressor.step()")

    # ---------------------------------------------------------------- driving
    def launch(self, job: Job, done: Done | None = None) -> Running:
        """Issue ``job``'s first round now; :meth:`finish` completes it and calls ``done(None)``
        (or ``done(error)`` if the step failed). Returns the launched job."""
        running = Running(job, self._recorder.clock)
        self._recorder.overlap()
        self._launched.append((running, done))
        return running

    def finish(self) -> bool | None:
        """Drive every launched job, end the step, then call each ``done``. Returns :meth:`end`'s result."""
        with self:
            finish([running for running, _ in self._launched], self.comm)
        launched, self._launched = self._launched, []
        for _, done in launched:
            if done is not None:
                done(None)
        return self.committed

    def drive(self, jobs: list[Job]) -> None:
        """Run jobs to completion, round-robin, in the order given (the same on every rank); the time spent in
        their own code counts as codec time."""
        drive(jobs, self.comm, self._recorder.clock)

    # ---------------------------------------------------------------- the end
    def end(self) -> bool | None:
        """Commit the step's new state if every rank was finite (one host sync) and the outside decision, if any,
        agrees (asked on every rank, finite or not); True if committed. A :attr:`deferred` step only closes here
        (``finite`` is known, ``committed`` stays None) and commits at :meth:`decide`."""
        self.finite, problem = self._verdict()
        self.open = False
        if problem is not None:  # a peer's payload could not be used: the step fails, everywhere alike
            error = PayloadError(f"gradcompress: {problem}")
            if self.terms.fault is None:
                raise error
            self.terms.fault(error)  # a quorum reports it to its manager; nothing of the step is committed
            self.finite = False
        if self.deferred:
            self._tell()
            return None
        should_commit = self.terms.should_commit
        return self.decide(should_commit() if should_commit is not None else True)

    def _verdict(self) -> tuple[bool, str | None]:
        """(every rank finite, the first malformed payload received or None), read with one host sync."""
        checks, received = self.ctx.checks, self.ctx.received
        if not received:
            return (bool(torch.stack(checks).all()) if checks else True), None
        device = received[0][0].device
        finite = torch.stack(checks).all().reshape(1) if checks else torch.ones(1, dtype=torch.bool, device=device)
        flags = torch.cat([finite] + [f.reshape(-1).to(finite.device) for f, _, _ in received]).tolist()  # one read
        return bool(flags[0]), (first_malformed(received) if not all(flags[1:]) else None)

    def decide(self, agreed: bool) -> bool:
        """The outside decision on a closed step: commit its new state if it agrees and every rank was finite
        (a :attr:`silent` step commits only the state every rank shares, :data:`SHARED_SLOTS`); True if committed."""
        if self.committed is not None or self.open:
            raise RuntimeError("gradcompress: decide() needs a step that has ended and not been decided")
        commit = cast(bool, self.finite) and bool(agreed)  # an ended step: its finiteness is known
        if commit:
            monitor = self.ctx.monitor
            if monitor is not None and monitor.rows:
                self.telemetry.report(self.index, monitor)
            new = self.ctx.new
            if self.silent:
                new = {k: v for k, v in new.items() if k[0] in SHARED_SLOTS}
            self.state.commit(new, self.index)
        self.state.count(commit, self._recorder.raw_bytes, self._recorder.seconds)
        self.ctx.drop()
        self.committed = commit
        self._tell()
        return commit

    def abort(self, error: BaseException | None = None) -> None:
        """Drop the step (after an error): nothing is committed; launched jobs' ``done`` get ``error``."""
        if self.open:
            self.state.count(None, self._recorder.raw_bytes, self._recorder.seconds)
        launched = self._launched
        self.ctx.drop()
        self._launched, self.open = [], False
        for _, done in launched:
            if done is not None:
                done(error or RuntimeError("gradcompress: the step was aborted"))
        self._tell()

    def _tell(self) -> None:
        if self._closed is not None:
            self._closed(self)

    @contextlib.contextmanager
    def guarded(self, end: bool = True) -> Generator[Step, None, None]:
        """A block that aborts the step on an exception (and re-raises it) and, with ``end``, ends it on a clean
        exit (a step that spans several blocks, such as FSDP's backward, passes ``end=False`` until the last)."""
        try:
            yield self
        except BaseException as err:
            self.abort(err)
            raise
        if end and self.open:
            self.end()

    def __enter__(self) -> Step:
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 trace: types.TracebackType | None) -> None:
        """:meth:`guarded`'s block: abort on an exception (which goes on), end on a clean exit."""
        if error is not None:
            self.abort(error)
        elif self.open:
            self.end()


__all__ = ["QUIET_SLOTS", "SHARED_SLOTS", "SLOTS", "Seen", "State", "Step", "StepRecord", "all_finite", "key_number",
           "mix_seed"]
