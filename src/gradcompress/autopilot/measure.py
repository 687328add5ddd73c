"""What the autopilot measures on its own rank: the compute time of a step and the link.

* **Compute**: the wall time from one step's start to the next's, less what the step spent waiting on its
  collectives, in its codec work and in the autopilot's own measuring (the median of the current plan's last 8
  steps, its first not counted). Under the DDP
  hook a step starts at the first bucket's hook, so this is the forward and backward pass and the optimizer step.
  The whole time of the last 5 steps of the current plan (its first step not counted) is kept too: on dense steps the
  in-step probe of the link (:func:`.decide.fit_link`); after a switch, what the new plan really costs (the trial).
* **Link**: two probes on the step's own group, at the checks where the autopilot asks (the first, those where the
  plan's step time moved, and every few: ``Autopilot._link``): the all-reduce of 1 KB (three times, the fastest
  kept) gives the per-message latency ``alpha`` = t / 2(W-1); the all-reduce of M bytes (M = 1/300 of what the current
  plan sends between two checks, between 1 MB and 4 MB: about 1 % more bytes for a large model, more for a small
  one, whose link cannot be measured with fewer; twice, the fastest kept) gives the
  payload bandwidth 2(W-1)/W M / (t_M - t_1KB) (at most 2(W-1)/W M / t_1KB: a fast link's M is within the noise).
  Their
  bytes are counted in ``stats()["monitor_bytes"]`` and ``stats()["auto"]["probe_bytes"]``, never in
  ``wire_bytes``. With ``auto:bandwidth=RATE`` nothing is probed.

Each rank measures its own numbers; the autopilot gathers every rank's before deciding (:func:`gather`: one small
all-reduce, the same table on every rank). :class:`Prober` decides when the link is probed again.
"""

from __future__ import annotations

import collections
import dataclasses
import statistics
from typing import TYPE_CHECKING, Any

import torch

from ..clocks import EventClock, HostClock, for_device

if TYPE_CHECKING:
    from ..collectives import Collectives
    from ..terms import StepRecord

SMALL_PROBE_FLOATS = 256
#: the big probe's bounds: at least 1 MB, whose ring messages (M/W) exceed what a link's buffers and token bucket let
#: through at line rate (a smaller probe measured a 100 Mbit/s tbf link at 330 Mbit/s), at most 4 MB
PROBE_BYTES = (1024 * 1024, 4 * 1024 * 1024)
#: the big probe is 1/300 of the traffic between two checks: its two all-reduces send 2 x 2(W-1)/W of it, ~1 %
PROBE_SHARE = 300
#: without a ``bandwidth=`` hint the link is probed at most every this many checks while the current plan's measured
#: step time stays within :data:`MOVED` of what it was (a probe of a slow link costs a small model's step 10 %)
PROBE_EVERY = 5
#: a change of the plan's step time since the last probe that makes the autopilot probe again
MOVED = 0.25
#: a change of the time waiting on collectives counts when it is at least this share of the step too
WAIT_FLOOR = 0.1
#: steps whose marks wait for a check at most (more than the steps between two checks of any sensible ``every``)
PENDING_STEPS = 64
#: a clock's mark (:mod:`gradcompress.clocks`): a float on the host's clock, a CUDA event on a GPU's
Mark = Any


@dataclasses.dataclass(frozen=True)
class Marks:
    """One step's marks, in the meter's clock's terms, resolved at the next check: its start and the next step's,
    the (before, after) marks of its waits on collectives and of the autopilot's own work in it, its codec seconds
    (host time) and its plan."""

    start: Mark
    end: Mark
    waits: tuple
    excluded: tuple
    codec_s: float
    plan: object


class Marker:
    """The marks of the steps not yet resolved, on ``clock`` (:mod:`gradcompress.clocks`): by default the host's,
    CUDA events once the buckets are seen on a GPU (:meth:`seen`); a clock given (a test's skewed or asynchronous
    one) is kept."""

    def __init__(self, clock: HostClock | EventClock | None = None):
        self.clock: HostClock | EventClock = clock if clock is not None else HostClock()
        self.chosen = clock is not None
        #: bounded: where no check ever resolves them (a group of one) the oldest are dropped, not kept forever
        self.pending: collections.deque = collections.deque(maxlen=PENDING_STEPS)
        self.start: Mark = None  # the current step's start mark
        self.excluded: tuple = ()  # the autopilot's own (before, after) marks inside the current step

    def use(self, clock: HostClock | EventClock) -> None:
        """Mark with ``clock`` from now on (the marks so far dropped)."""
        self.chosen, self.clock, self.start = True, clock, None
        self.pending.clear()

    def seen(self, device: torch.device | None) -> None:
        """The buckets live on ``device``: unless a clock was given, the clock of that device from now on."""
        if not self.chosen:
            self.use(for_device(device))

    def step_started(self, comm: Collectives, prev: StepRecord | None) -> None:
        """A step begins; ``prev``: the previous step's record (its marks are kept if it ran)."""
        comm.clock = self.clock
        mark, waits = self.clock.mark(), comm.take_waits()
        if self.start is not None and prev is not None and prev.committed is not None:
            self.pending.append(Marks(self.start, mark, waits, self.excluded, prev.codec_seconds, prev.plan))
        self.start, self.excluded = mark, ()

    def take(self) -> list[Marks]:
        taken = list(self.pending)
        self.pending.clear()
        return taken


class Meter:
    """This rank's measurements. ``marker.clock`` (:class:`Marker`): where the times come from. ``record``: the last
    step's :class:`~gradcompress.step.StepRecord`; ``buckets``/``hooked``: the groups the last step that averaged
    any saw, and whether it launched them early (the DDP hook: the exchange overlaps the backward pass). A step's
    marks are resolved (:meth:`settle`) at once on the host's clock, at the checks on an asynchronous one."""

    def __init__(self, clock: HostClock | EventClock | None = None, norms: int = 1):
        self.marker = Marker(clock)
        #: the squared gradient norms of the last ``norms`` steps that summed them (the steps before a check)
        self.norms: collections.deque = collections.deque(maxlen=norms)
        self.compute: collections.deque = collections.deque(maxlen=8)
        #: the last whole steps of the current plan (not its first step): the in-step probe, and the trial's measure
        self.walls: collections.deque = collections.deque(maxlen=5)
        #: the same steps' time waiting on collectives (what a change of the link moves first)
        self.waits: collections.deque = collections.deque(maxlen=5)
        #: the counted steps since :meth:`start_block` (a selection's block): (step, wait, compute) seconds
        self.block: list = []
        self._plan: object = None  # the plan those steps ran
        self.probe_bytes = 0
        self.record: StepRecord | None = None
        self.buckets: tuple = ()
        self.hooked = False

    @property
    def clock(self) -> HostClock | EventClock:
        return self.marker.clock

    def use(self, clock: HostClock | EventClock) -> None:
        """Measure with ``clock`` from now on (kept whatever the buckets' device)."""
        self.marker.use(clock)

    def closed(self, record: StepRecord) -> None:
        """A step ended (or was aborted): what it measured."""
        self.record = record
        if record.norm_sq is not None:
            self.norms.append(record.norm_sq)  # kept on its device: read at the check (one host sync)
        if record.seen:
            self.buckets, self.hooked = record.seen, record.overlapped
            self.marker.seen(record.seen[0].device)

    def step_started(self, comm: Collectives) -> None:
        """A step begins: the previous one's marks are complete (resolved now on the host's clock)."""
        self.marker.step_started(comm, self.record)
        if not self.clock.asynchronous:
            self.settle()

    def settle(self) -> None:
        """Resolve the steps' marks into times (on a GPU this waits for the last step's events: called at checks)."""
        seconds = self.clock.seconds
        for m in self.marker.take():
            wall = seconds(m.start, m.end) - sum(seconds(a, b) for a, b in m.excluded)
            waited = sum(seconds(a, b) for a, b in m.waits)
            compute = max(wall - waited - m.codec_s, 0.0)
            if m.plan is self._plan:
                self.walls.append(wall)
                self.waits.append(waited)
                self.compute.append(compute)
                self.block.append((wall, waited, compute))
            else:  # a new plan: its first step is not counted (the switch, fresh buffers: a compressed plan's first
                # step allocates its residuals, which would count against compression); on this CPU testbed the
                # compute itself reads differently under another plan (the collectives compete for the cores)
                for kept in (self.walls, self.waits, self.compute):
                    kept.clear()
                self._plan = m.plan

    def norm_sq(self) -> list[float]:
        """The mean squared gradient norm of the steps kept since the last call (every rank the same steps), as a
        gathered field: ``[]`` where none was summed."""
        if not self.norms:
            return []
        mean = float(sum(self.norms)) / len(self.norms)
        self.norms.clear()
        return [mean]

    def compute_s(self) -> float:
        return statistics.median(self.compute) if self.compute else 0.0

    def step_s(self) -> float:
        """The median time of the last steps of the current plan (0: none measured yet)."""
        return statistics.median(self.walls) if self.walls else 0.0

    def wait_s(self) -> float:
        """The median time the same steps waited on their collectives (0: none measured yet)."""
        return statistics.median(self.waits) if self.waits else 0.0

    def start_block(self) -> None:
        self.block = []

    def block_s(self) -> tuple[float, float, float]:
        """The medians of the counted steps since :meth:`start_block`: their time, their wait on the collectives
        and their compute (0: none)."""
        if not self.block:
            return 0.0, 0.0, 0.0
        return tuple(statistics.median(x[i] for x in self.block) for i in range(3))

    def exclude(self, before: Mark, after: Mark) -> None:
        """The autopilot's own work inside the current step (a check), between two marks: not the step's compute."""
        self.marker.excluded = self.marker.excluded + ((before, after),)

    def link(self, comm: Collectives, traffic: int, device: torch.device | None) -> tuple[float, float]:
        """(payload bandwidth in bytes/s, alpha in seconds) probed on ``comm`` (every rank calls it together, with the
        same ``traffic``: the bytes the plan sends between two checks; the probes send about 1 % of it)."""
        w = comm.world
        nbytes = 4 * (min(max(traffic // PROBE_SHARE, PROBE_BYTES[0]), PROBE_BYTES[1]) // 4)
        small = min(self._time(comm, torch.zeros(SMALL_PROBE_FLOATS, device=device)) for _ in range(3))
        big = min(self._time(comm, torch.zeros(nbytes // 4, device=device)) for _ in range(2))
        alpha = small / (2 * (w - 1))
        # a difference below the small probe's own time is noise: the link is at least this fast
        return 2 * (w - 1) / w * nbytes / max(big - small, small, 1e-9), alpha

    def _time(self, comm, t: torch.Tensor) -> float:
        before = comm.monitor_bytes
        start: Mark = self.clock.mark()
        comm.all_reduce(t, monitor=True).wait()  # on a GPU the stream waits: the mark after it sees the end
        self.probe_bytes += comm.monitor_bytes - before
        end: Mark = self.clock.mark()
        return self.clock.seconds(start, end)

    def gather(self, comm: Collectives, fields: dict[str, list[float]], device: torch.device | None
               ) -> dict[str, torch.Tensor]:
        """Every rank's numbers of each named field (name -> this rank's list of floats), as name -> ``[world, n]``
        float64 tables: the same on every rank, bit for bit (one all-reduce of rows that are zero but one's; counted
        as measuring bytes, not ``wire_bytes``)."""
        local = [float(x) for values in fields.values() for x in values]
        table = torch.zeros(comm.world, len(local), dtype=torch.float64, device=device)
        table[comm.rank] = torch.tensor(local, dtype=torch.float64)
        before = comm.monitor_bytes
        comm.all_reduce(table, monitor=True).wait()
        self.probe_bytes += comm.monitor_bytes - before
        parts = table.cpu().split([len(v) for v in fields.values()], dim=1)
        return dict(zip(fields, parts))


class Prober:
    """When the link is probed again (without a ``bandwidth=`` hint): at the first check, then only when the current
    plan's measured step time moved by more than :data:`MOVED` since the last probe, or its time waiting on the
    collectives moved by more than :data:`MOVED` and by more than :data:`WAIT_FLOOR` of the step (a compressed
    plan's step hardly moves when the link drops; its wait does), or every :data:`PROBE_EVERY` checks; in between
    the last probe's numbers stand (the step's own time is the passive probe). ``reference``: the current plan's
    (step, wait) times when the link was last probed (or a selection measured it)."""

    def __init__(self) -> None:
        self.reference: tuple[float, float | None] = (0.0, 0.0)
        self.unprobed = 0  # checks since the last probe
        self.link: tuple[float, float] | None = None  # the last probe's (bandwidth, alpha), combined over ranks

    def steady(self, step_s: float, wait_s: float = 0.0) -> bool:
        """Whether the current plan's step time and its wait are where they were at the last probe (or where a
        selection measured them; a wait not measured yet counts as steady)."""
        ref, ref_wait = self.reference
        steady = ref > 0 and step_s > 0 and abs(step_s - ref) <= MOVED * ref
        if ref_wait is None:
            return steady
        waited = abs(wait_s - ref_wait)
        return steady and not (waited > MOVED * ref_wait and waited > WAIT_FLOOR * step_s)

    def due(self, step_s: float, wait_s: float = 0.0) -> bool:
        """Whether this check probes (every rank alike: ``step_s``, ``wait_s`` are gathered)."""
        steady, self.unprobed = self.steady(step_s, wait_s), self.unprobed + 1
        if self.reference[1] is None:  # measured by a selection: this check's wait is the reference
            self.reference = (self.reference[0], wait_s)
        return not (self.link is not None and steady and self.unprobed < PROBE_EVERY)

    def probed(self, step_s: float, link: tuple[float, float], wait_s: float = 0.0) -> None:
        self.reference, self.unprobed, self.link = (step_s, wait_s), 0, link

    def measured(self, step_s: float, wait_s: float | None = None) -> None:
        """The plan kept after a selection (or a trial) took ``step_s``, ``wait_s`` of it waiting (None: unknown, the
        next check's wait is the reference): what the next checks compare with."""
        self.reference = (step_s, wait_s)


__all__ = ["Marker", "Marks", "Meter", "MOVED", "PROBE_BYTES", "PROBE_EVERY", "Prober", "SMALL_PROBE_FLOATS", "WAIT_FLOOR"]
