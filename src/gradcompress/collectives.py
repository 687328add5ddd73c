"""Collectives on one process group, driven as rounds, with byte accounting. Never imports a codec.

An exchange of tensors is a *job*: a generator that issues asynchronous collectives, yields their work handles,
and resumes when they have completed. :func:`drive` advances several jobs round by round, in the order they were
created, so every rank issues the same collectives in the same order (no collective is ever launched from a
future callback, which is how PyTorch's ``powerSGD_hook`` deadlocks on gloo), while the first round of each job
overlaps with whatever the caller does before driving (the backward pass, in the DDP hook). :func:`parallel` runs
several jobs as one; :class:`Running` is a job launched early (its first round in flight), timed.

Byte accounting (``Collectives.wire_bytes``) counts what this rank transmits under
bandwidth-optimal ring algorithms, for W ranks and a local buffer of B bytes:

* all-reduce: 2 (W-1)/W B (reduce-scatter + all-gather);
* all-gather: (W-1) B (each rank forwards every other rank's block once);
* all-to-all: (W-1)/W B (every block but its own);
* reduce-scatter: (W-1)/W B (the first half of the ring all-reduce);
* W = 1: nothing.

The reference a user compares with (:func:`ddp_bytes`, :func:`x_fewer_than_ddp`, ``stats()["x_fewer_than_ddp"]``):
DDP's ring all-reduce of the same gradients, 2 (W-1)/W of their bytes per rank, so a dense exchange reads 1.0x
for any W.

:class:`LocalCollectives` stands in for a group without communication (a single process, or ``plan``'s
calibration of a W-rank step's own work).
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any, NamedTuple, Protocol, cast
from collections.abc import Generator, Iterable, Sequence

import torch
import torch.distributed as dist

if TYPE_CHECKING:
    from .clocks import EventClock, HostClock
    from .codecs.base import Payload
    from .topology import Topology


class Handle(Protocol):
    """A collective's work handle: ``wait()`` returns once it has completed (torch's ``Work``, :class:`Done`)."""

    def wait(self) -> object: ...


Job = Generator[list[Handle], None, None]


# --------------------------------------------------------------------- the reference: DDP's all-reduce
def ddp_bytes(raw_bytes: float, world: int) -> float:
    """What one rank of DDP transmits to all-reduce ``raw_bytes`` of gradients over ``world`` ranks (ring-counted:
    2 (W-1)/W of them; nothing for W = 1)."""
    return 2 * (world - 1) / world * raw_bytes if world > 1 else 0.0


def x_fewer_than_ddp(raw_bytes: float, wire_bytes: float, world: int) -> float:
    """How many times fewer bytes than DDP one rank transmitted: :func:`ddp_bytes` of the gradients exchanged
    (``raw_bytes``, their own size) / the bytes it sent (``wire_bytes``, ring-counted alike). A dense all-reduce
    reads 1.0 for any ``world``; nothing sent and nothing to send (W = 1, or no step yet): 1.0; nothing sent where
    DDP would have sent: ``inf``."""
    reference = ddp_bytes(raw_bytes, world)
    if wire_bytes:
        return reference / wire_bytes
    return float("inf") if reference else 1.0


# --------------------------------------------------------------------- serialisation
def to_bytes(tensors: Sequence[torch.Tensor], device: torch.device | str | None = None) -> torch.Tensor:
    """Concatenate tensors as one flat uint8 buffer (their raw bytes); empty on ``device`` if none."""
    if not tensors:
        return torch.empty(0, dtype=torch.uint8, device=device)
    return torch.cat([t.contiguous().reshape(-1).view(torch.uint8) for t in tensors])


def layout(tensors: Sequence[torch.Tensor]) -> list[tuple[torch.dtype, torch.Size]]:
    return [(t.dtype, t.shape) for t in tensors]


def from_bytes(buf: torch.Tensor, spec: Sequence[tuple[torch.dtype, torch.Size]]) -> tuple[torch.Tensor, ...]:
    """Inverse of :func:`to_bytes` for a known layout ``[(dtype, shape), ...]``: views of ``buf`` where the
    bytes are aligned for their dtype, copies where not (e.g. float32 scales after an odd number of code bytes)."""
    out, offset = [], 0
    for dtype, shape in spec:
        numel = 1
        for s in shape:
            numel *= s
        size = dtype.itemsize
        part = buf[offset : offset + numel * size]
        if (buf.storage_offset() + offset) % size:
            part = part.clone()
        out.append(part.view(dtype).reshape(shape))
        offset += numel * size
    return tuple(out)


def floats(payloads: Iterable[Payload]) -> torch.Tensor | None:
    """The floating-point tensors of ``payloads`` (scales, norms, kept values) as one flat tensor, or None.

    For codecs that preserve non-finite values (``Codec.preserves_nonfinite``) a payload decodes to
    something non-finite exactly when one of these is: the finiteness of a step can be read here.
    """
    parts = [t.reshape(-1) for p in payloads for t in p.tensors if t.is_floating_point()]
    return torch.cat(parts) if parts else None


def nbytes(tensors: Iterable[torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


# --------------------------------------------------------------------- collectives
class Collectives:
    """Asynchronous collectives on one process group, with byte and time accounting. ``clock``: where set (the
    autopilot's meter sets its own, :mod:`gradcompress.clocks`), :meth:`wait` keeps its marks before and after each
    wait (:meth:`take_waits`): on a GPU, CUDA events on the stream that waits."""

    clock: HostClock | EventClock | None = None
    _waits: tuple[tuple[object, object], ...] = ()

    def __init__(self, process_group: dist.ProcessGroup | None = None) -> None:
        self.group = process_group
        self.world = dist.get_world_size(process_group)
        self.rank = dist.get_rank(process_group)
        self.wire_bytes = 0
        self.monitor_bytes = 0
        self.comm_seconds = 0.0

    def all_reduce(self, t: torch.Tensor, monitor: bool = False) -> Handle:
        """``monitor=True``: telemetry's exact average, counted in ``monitor_bytes``, not ``wire_bytes``."""
        self.count_all_reduce(t, monitor)
        work: Handle = dist.all_reduce(t, group=self.group, async_op=True)  # async_op=True: a Work, never None
        return work

    def count_all_reduce(self, t: torch.Tensor, monitor: bool) -> None:
        """Count an all-reduce of ``t``: in ``monitor_bytes`` (telemetry's) or ``wire_bytes``."""
        sent = 2 * (self.world - 1) * t.numel() * t.element_size() // self.world
        if monitor:
            self.monitor_bytes += sent
        else:
            self.wire_bytes += sent

    def all_gather(self, t: torch.Tensor) -> tuple[list[torch.Tensor], Handle]:
        self.wire_bytes += (self.world - 1) * t.numel() * t.element_size()
        outs = [torch.empty_like(t) for _ in range(self.world)]
        return outs, dist.all_gather(outs, t, group=self.group, async_op=True)

    def all_gather_flat(self, t: torch.Tensor) -> tuple[torch.Tensor, Handle]:
        """Every rank's ``t`` back to back in one tensor (rank i's at block i)."""
        self.wire_bytes += (self.world - 1) * t.numel() * t.element_size()
        out = torch.empty(self.world * t.numel(), dtype=t.dtype, device=t.device)
        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        return out, gather(out, t.reshape(-1), group=self.group, async_op=True)

    def reduce_scatter(self, t: torch.Tensor) -> tuple[torch.Tensor, Handle]:
        """Equal splits: rank i receives block i of the sum over ranks of ``t`` (summed in ``t``'s dtype)."""
        self.wire_bytes += (self.world - 1) * t.numel() * t.element_size() // self.world
        out = torch.empty(t.numel() // self.world, dtype=t.dtype, device=t.device)
        scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
        return out, scatter(out, t.reshape(-1), group=self.group, async_op=True)

    def all_to_all(self, t: torch.Tensor) -> tuple[torch.Tensor, Handle]:
        """Equal splits: block j of ``t`` goes to rank j; block i of the result came from rank i."""
        self.wire_bytes += (self.world - 1) * t.numel() * t.element_size() // self.world
        out = torch.empty_like(t)
        return out, dist.all_to_all_single(out, t, group=self.group, async_op=True)

    def all_to_all_v(self, t: torch.Tensor, in_splits: list[int], out_splits: list[int]) -> tuple[torch.Tensor, Handle]:
        """Uneven all-to-all: ``in_splits[j]`` elements of ``t`` go to rank j, ``out_splits[i]`` come from rank i."""
        self.wire_bytes += (sum(in_splits) - in_splits[self.rank]) * t.element_size()
        out = torch.empty(sum(out_splits), dtype=t.dtype, device=t.device)
        return out, dist.all_to_all_single(out, t, out_splits, in_splits, group=self.group, async_op=True)

    def wait(self, works: Iterable[Handle]) -> None:
        clock, start = self.clock, time.perf_counter()
        mark = clock.mark() if clock is not None else None
        for w in works:
            w.wait()
        self.comm_seconds += time.perf_counter() - start
        if clock is not None:
            self._waits = self._waits + ((mark, clock.mark()),)

    def take_waits(self) -> tuple[tuple[object, object], ...]:
        """The (before, after) marks of the waits since the last call, in :attr:`clock`'s terms."""
        taken, self._waits = self._waits, ()
        return taken

    def check_same(self, text: str, who: str, extra: object = None) -> list[Any]:
        """Raise on every rank unless every rank passes the same ``text`` (a configuration); returns every rank's
        ``extra`` (a small picklable value, e.g. its node), in rank order, gathered in the same round."""
        # list[Any]: each rank's ``extra``, of whatever type the caller passes (e.g. node keys, str)
        slots: list[object] = [None] * self.world
        dist.all_gather_object(slots, (text, extra), group=self.group)
        pairs = cast("list[tuple[str, Any]]", slots)  # every slot now holds a rank's (text, extra)
        texts = [p[0] for p in pairs]
        if len(set(texts)) > 1:
            lines = "; ".join(f"rank {r}: {c[:300]}" for r, c in enumerate(texts))
            raise RuntimeError(f"{who}: ranks are configured differently, refusing to mix formats: {lines}")
        return [p[1] for p in pairs]


class Done:
    """A completed work handle."""

    def wait(self) -> bool:
        return True


class LocalCollectives(Collectives):
    """:class:`Collectives` without communication, as if every one of ``world`` ranks held the same
    tensors: an all-reduce multiplies by ``world``, an all-gather repeats, an all-to-all copies.

    ``world=1`` is a single process (nothing sent, nothing counted); larger worlds stand in for a
    group in ``plan``'s calibration, to time the Python and codec work of a step alone.
    ``topology``: None here (a :class:`RecordingCollectives` may carry a node layout to record).
    """

    topology: Topology | None = None

    def __init__(self, world: int = 1) -> None:  # no process group: deliberately not Collectives.__init__
        self.group, self.world, self.rank, self.wire_bytes, self.comm_seconds = None, world, 0, 0, 0.0
        self.monitor_bytes = 0

    def all_reduce(self, t: torch.Tensor, monitor: bool = False) -> Handle:
        if self.world != 1:
            t.mul_(self.world)
        return Done()

    def all_gather(self, t: torch.Tensor) -> tuple[list[torch.Tensor], Handle]:
        return [t.clone() for _ in range(self.world)], Done()

    def all_gather_flat(self, t: torch.Tensor) -> tuple[torch.Tensor, Handle]:
        return t.reshape(-1).repeat(self.world), Done()

    def all_to_all(self, t: torch.Tensor) -> tuple[torch.Tensor, Handle]:
        return t.clone(), Done()

    def reduce_scatter(self, t: torch.Tensor) -> tuple[torch.Tensor, Handle]:
        return t.reshape(self.world, -1)[0] * self.world, Done()

    def all_to_all_v(self, t: torch.Tensor, in_splits: list[int], out_splits: list[int]) -> tuple[torch.Tensor, Handle]:
        return t.clone(), Done()

    def wait(self, works: Iterable[Handle]) -> None:
        pass

    def check_same(self, text: str, who: str, extra: object = None) -> list[Any]:
        return [extra] * self.world


def one_job(jobs: list[Job]) -> Job:
    """The jobs as one: the job itself when there is one (no wrapper level), :func:`parallel` for two or more."""
    if len(jobs) == 1:
        return jobs[0]
    return parallel(jobs)


class Stopwatch:
    """Seconds added up (a step's time in its exchanges' own code: encode, decode, state updates)."""

    def __init__(self) -> None:
        self.seconds = 0.0

    def add(self, seconds: float) -> None:
        self.seconds += seconds


class HostRead:
    """Integers a job must read on the host once a round's collectives have completed (``parts``: int64 tensors on
    the device, read back to back), put among that round's works. A driver that knows it (:func:`finish`) reads those
    of every job it holds at once, one host sync, into :attr:`values`; for any other it is a completed work, and the
    job reads them itself (:meth:`result`)."""

    def __init__(self, parts: Sequence[torch.Tensor]) -> None:
        self.parts = list(parts)
        self.values: list[int] | None = None

    def wait(self) -> bool:
        return True

    def result(self) -> list[int]:
        """The integers: read by the driver, or here (a host sync of its own)."""
        if self.values is None:
            self.values = torch.cat([p.reshape(-1) for p in self.parts]).tolist()
        return self.values


def read_at_once(reads: Sequence[HostRead]) -> None:
    """Every read's integers with one host sync."""
    flat = torch.cat([p.reshape(-1).to(torch.int64) for r in reads for p in r.parts]).tolist()
    at = 0
    for r in reads:
        n = sum(p.numel() for p in r.parts)
        r.values, at = flat[at : at + n], at + n


class Running:
    """A launched job: made from a job, it runs the job to its first round (whose collectives are then in flight).

    :meth:`advance` waits for them and runs the job to its next round. ``timer``: a :class:`Stopwatch` that
    receives the time spent in the job's own code (encode, decode, state updates)."""

    def __init__(self, job: Job, timer: Stopwatch | None = None) -> None:
        self.job, self.timer = job, timer
        self.works: list[Handle] | None = None
        self.held = False  # its round has completed, its host reads (:class:`HostRead`) wait for the others'
        self._resume()

    def _resume(self) -> None:
        """Run the job to its next round (its works, or None when it has finished)."""
        start = time.perf_counter()
        try:
            self.works = self.job.send(None)
        except StopIteration:
            self.works = None
        if self.timer is not None:
            self.timer.add(time.perf_counter() - start)

    def advance(self, comm: Collectives) -> None:
        """Wait for the round's works and run the job to its next round; held instead where the round has host
        reads still to make (:meth:`reads`)."""
        if self.works is None or self.held:
            return
        comm.wait(self.works)
        self.held = bool(self.reads())
        if not self.held:
            self._resume()

    def reads(self) -> list[HostRead]:
        """The round's host reads not yet made."""
        return [w for w in self.works or () if isinstance(w, HostRead) and w.values is None]

    def release(self) -> None:
        """Resume a held job (its reads made)."""
        self.held = False
        self._resume()


def finish(running: list[Running], comm: Collectives) -> None:
    """Run launched jobs to completion, round-robin: wait a job's pending works, resume it, next job. A job whose
    round asks host reads (:class:`HostRead`) is held until every job left is held: their reads are then made at
    once (one host sync for all: e.g. every DDP bucket's payload sizes), and they go on."""
    pending = [r for r in running if r.works is not None]
    while pending:
        for r in pending:
            r.advance(comm)
        pending = [r for r in pending if r.works is not None]
        if pending and all(r.held for r in pending):
            start = time.perf_counter()
            read_at_once([h for r in pending for h in r.reads()])
            if pending[0].timer is not None:
                pending[0].timer.add(time.perf_counter() - start)
            for r in pending:
                r.release()
            pending = [r for r in pending if r.works is not None]


def drive(jobs: list[Job], comm: Collectives, timer: Stopwatch | None = None) -> None:
    """Run jobs to completion: each issues its first round, in the order given, then :func:`finish`."""
    finish([Running(job, timer) for job in jobs], comm)


def parallel(jobs: list[Job]) -> Job:
    """Run several jobs side by side as one: each round issues the next collectives of all of them."""
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


# --------------------------------------------------------------------- recording (the cost model's)


class Issued(NamedTuple):
    """One collective a :class:`RecordingCollectives` issued: ``kind`` (the method: ``all_reduce``, ``all_gather``,
    ``all_to_all``, ``all_to_all_v``, ``reduce_scatter``), ``nbytes`` (the local buffer's bytes), ``sent`` (the bytes
    this rank transmits, counted as :class:`Collectives` counts them), ``world`` (the group's size) and ``link``
    (which group: ``"world"``, or ``"intra"``/``"inter"`` for a node layout's groups)."""

    kind: str
    nbytes: int
    sent: int
    world: int
    link: str


class RecordingCollectives(LocalCollectives):
    """:class:`LocalCollectives` that counts ``wire_bytes`` exactly as :class:`Collectives` does and records every
    collective it issues (:class:`Issued`), grouped in rounds: a round ends when the driver waits for its works
    (:func:`drive`, ``Step.drive``). What the cost model runs the real step on (:mod:`gradcompress.costmodel`).

    Every rank holds the same tensors, and this one is rank ``rank`` of ``world``: an all-reduce multiplies by
    ``world``, an all-gather repeats, a reduce-scatter returns block ``rank`` of the sum, an all-to-all block
    ``rank`` of every rank. :meth:`sub` makes the collectives of a sub-group (a node's workers, ``link="intra"``;
    the workers of one local rank on every node, ``"inter"``) that record into this one's rounds; with a
    ``topology`` (a :class:`gradcompress.topology.Topology` whose ``intra``/``inter`` are such sub-groups) a
    Compressor stepping on this runs its hierarchical exchange on them.
    """

    def __init__(self, world: int = 1, rank: int = 0, *, link: str = "world", topology: Topology | None = None,
                 into: RecordingCollectives | None = None) -> None:
        super().__init__(world)
        self.rank, self.link, self.topology = rank, link, topology
        self.root = self if into is None else into  # whose rounds this one records into
        self.rounds: list[tuple[Issued, ...]] = []
        self.issued: list[Issued] = []

    def sub(self, world: int, rank: int, link: str) -> RecordingCollectives:
        """The collectives of a sub-group of ``world`` ranks (this rank is ``rank`` there), recording into these."""
        return RecordingCollectives(world, rank, link=link, into=self.root)

    def take_rounds(self) -> list[tuple[Issued, ...]]:
        """The rounds recorded since the last call (the open one closed), in the order they were issued."""
        self.root._close()
        rounds, self.root.rounds = self.root.rounds, []
        return rounds

    def _close(self) -> None:
        if self.issued:
            self.rounds.append(tuple(self.issued))
            self.issued = []

    def _count(self, kind: str, t: torch.Tensor, sent: int) -> None:
        self.wire_bytes += sent
        self.root.issued.append(Issued(kind, t.numel() * t.element_size(), sent, self.world, self.link))

    def all_reduce(self, t: torch.Tensor, monitor: bool = False) -> Handle:
        sent = 2 * (self.world - 1) * t.numel() * t.element_size() // self.world
        if monitor:  # telemetry's exact average: not wire bytes, not recorded
            self.monitor_bytes += sent
        else:
            self._count("all_reduce", t, sent)
        return super().all_reduce(t)

    def all_gather(self, t: torch.Tensor) -> tuple[list[torch.Tensor], Handle]:
        self._count("all_gather", t, (self.world - 1) * t.numel() * t.element_size())
        return super().all_gather(t)

    def all_gather_flat(self, t: torch.Tensor) -> tuple[torch.Tensor, Handle]:
        self._count("all_gather", t, (self.world - 1) * t.numel() * t.element_size())
        return super().all_gather_flat(t)

    def reduce_scatter(self, t: torch.Tensor) -> tuple[torch.Tensor, Handle]:
        self._count("reduce_scatter", t, (self.world - 1) * t.numel() * t.element_size() // self.world)
        return t.reshape(self.world, -1)[self.rank] * self.world, Done()

    def all_to_all(self, t: torch.Tensor) -> tuple[torch.Tensor, Handle]:
        self._count("all_to_all", t, (self.world - 1) * t.numel() * t.element_size() // self.world)
        mine = t.reshape(self.world, -1)[self.rank]
        return mine.repeat(self.world).view(t.shape), Done()

    def all_to_all_v(self, t: torch.Tensor, in_splits: list[int], out_splits: list[int]) -> tuple[torch.Tensor, Handle]:
        self._count("all_to_all_v", t, (sum(in_splits) - in_splits[self.rank]) * t.element_size())
        start = sum(in_splits[: self.rank])
        return t[start : start + in_splits[self.rank]].repeat(self.world), Done()

    def wait(self, works: Iterable[Handle]) -> None:
        """The driver waits for a round: it is complete (recorded even without collectives: a padded round)."""
        root = self.root
        root.rounds.append(tuple(root.issued))
        root.issued = []


__all__ = ["Collectives", "Done", "Handle", "HostRead", "Issued", "Job", "LocalCollectives", "RecordingCollectives",
           "Running", "Stopwatch", "ddp_bytes", "drive", "finish", "floats", "from_bytes", "layout", "nbytes",
           "one_job", "parallel", "read_at_once", "to_bytes", "x_fewer_than_ddp"]
