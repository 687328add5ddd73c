"""The autopilot's decision: for each bucket, the candidate codec that minimises the predicted step time.

**What each candidate costs on a bucket** (:func:`record`): the real exchange of the bucket (the Compressor's own,
with the autopilot's configuration: error feedback, ``min_numel``) runs once per candidate on
:class:`~gradcompress.collectives.RecordingCollectives` with gradients of the bucket's shapes: the collectives of
each round and their bytes are recorded (what ``stats()`` will count), and the time of the run (the faster of two)
is the codec's cost on this device, for these shapes (the calibration; every rank measures it, the slowest counts).

**The step** (:func:`predicted_step_s`): the cost model's (:func:`gradcompress.timing.simulate_step`): forward (1/3 of
the compute time), then backward; a bucket is handed over when its share of the backward pass is done (in the order the
step saw them), its codec work delays the backward pass, its first round overlaps the rest of it, later rounds
follow; the link carries one collective at a time, ``bytes / B + alpha`` per message step. How much of the backward
pass the exchange hides behind is ``overlap`` (1 under the DDP hook, less where measured so; 0 without the hook:
``synchronize`` runs after the backward pass).

**The step as measured** (:func:`fit_link`): the probes time collectives alone; in the step they share the CPU (and
maybe the link) with the backward pass. The time of the dense steps (the measuring steps, and any later all-dense
step) is the in-step probe: the overlap with the backward pass, then the share of the probed bandwidth, are taken
as what makes the predicted dense step take that long.

**The choice** (:func:`choose`): from all-dense, greedily, the single change of one bucket's codec that shortens
the predicted step most, until none does; compression is kept only if it beats the all-dense step by 2 % (else
dense: an all-reduce like DDP's own, bit for bit its result, nothing but the measuring added).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

import torch

from ..codecs.base import Aggregation
from ..collectives import Issued, RecordingCollectives
from ..exchanges.layout import split
from ..monitor import Telemetry
from ..schedule import Plan
from ..session import Session
from ..spec import make
from ..state import State
from ..step import Step
from ..terms import Terms
from ..timing import BACKWARD_SHARE, BucketWork, Round, round_seconds, simulate_step
from .calibration import Cache, key as cache_key

if TYPE_CHECKING:
    from ..config import Config
    from ..terms import Seen

#: compression must beat dense by this share of the predicted step to be chosen
MIN_GAIN = 0.02


@dataclasses.dataclass(frozen=True)
class Option:
    """A candidate codec (``spec``, ``"none"``: dense) on a bucket: its recorded rounds and codec seconds."""

    spec: str
    rounds: tuple[tuple[Issued, ...], ...]
    codec_s: float


@dataclasses.dataclass(frozen=True)
class Link:
    """Payload bandwidth (bytes/s) and latency per message step (s)."""

    bandwidth: float
    alpha: float


def _numel(shapes) -> int:
    return sum(int(torch.Size(s).numel()) for s in shapes)


def record(config: Config, world: int, buckets: Iterable[Seen], candidates: Sequence[str],
           cache: Cache | None = None) -> list[list[Option]]:
    """``[bucket][candidate]`` :class:`Option` of each candidate spec on each bucket ``(keys, shapes, device)``;
    ``cache`` (:class:`~.calibration.Cache`): entries found there are not run, those run are added to it."""
    gen = torch.Generator().manual_seed(config.seed)
    config = dataclasses.replace(config, monitor_every=0)  # the recording is not a monitored step
    out, new = [], {}
    for seen in buckets:
        flat = torch.randn(_numel(seen.shapes), generator=gen).to(seen.device or "cpu")
        row = []
        for spec in candidates:
            entry = cache_key(config, world, seen, spec) if cache is not None and allowed(spec, seen) else None
            found = cache.get(entry) if entry is not None and cache is not None else None  # (entry: cache given)
            option = Option(spec, *found) if found else _record_one(config, world, seen, flat, spec)
            if entry is not None and not found:
                new[entry] = (option.rounds, option.codec_s)
            row.append(option)
        out.append(row)
    if cache is not None:
        cache.put(new)
    return out


def allowed(spec: str, seen: Seen) -> bool:
    """Whether candidate ``spec`` can carry the group ``seen`` (FSDP's flat buffers, reduce-scatter or HSDP's
    shards: no PowerSGD)."""
    return seen.kind == "exchange" or make(spec).aggregation is not Aggregation.LOWRANK


def _record_one(config, world: int, seen, flat: torch.Tensor, spec: str) -> Option:
    """The candidate's exchange of the group, run twice: the rounds of the first, the time of the faster."""
    if not allowed(spec, seen):
        return Option(spec, (), float("inf"))
    runs = [_run_once(config, world, seen, flat, make(spec)) for _ in range(2)]
    return Option(spec, runs[0][0], min(r[1] for r in runs))


def _run_once(config, world: int, seen, flat: torch.Tensor, codec) -> tuple[tuple, float]:
    if seen.kind == "replicas":  # HSDP's replica exchange compresses every shard, whatever its size
        config = dataclasses.replace(config, min_numel=0)
    comm = RecordingCollectives(world)
    session = Session(config)
    session.open(comm)
    buffer = flat.clone()
    step = Step(config, session, State(), Telemetry(False), {}, Terms(Plan(None if codec.exact else codec)))
    start = time.perf_counter()
    if seen.kind == "reduce_scatter":
        out = torch.empty(seen.out, device=buffer.device)
        job = step.reduce_scatter(seen.keys[0], buffer.view(seen.shapes[0]), out, seen.scale)
    else:
        job = step.exchange(list(seen.keys), split(buffer, [torch.Size(s) for s in seen.shapes]), buffer)
    step.drive([job])
    if buffer.is_cuda:
        torch.cuda.synchronize(buffer.device)
    seconds = time.perf_counter() - start
    step.end()
    return tuple(comm.take_rounds()), seconds


def predicted_step_s(choice: Sequence[int], options: Sequence[Sequence[Option]], sizes: Sequence[int], link: Link,
                     compute_s: float, overlap: float, costs: Sequence[Sequence[float]] | None = None) -> float:
    """Predicted step time with candidate ``choice[b]`` on bucket b (``costs[b][c]``: codec seconds, default the
    recorded ones). ``overlap`` in [0, 1]: how much of the backward pass a bucket's exchange can hide behind (1: from
    the moment its gradients are ready, as on a GPU with its own copy engines and NICs; 0: none, every bucket waits
    for the end of the backward pass, as ``synchronize``)."""
    total = sum(sizes) or 1
    done, work = 0, []
    for b, c in enumerate(choice):
        done += sizes[b]
        option = options[b][c]
        codec_s = option.codec_s if costs is None else costs[b][c]
        rounds = tuple(Round(round_seconds(r, link.bandwidth, link.alpha)) for r in option.rounds)
        work.append(BucketWork(ready=1.0 - overlap * (1.0 - done / total), hook_s=codec_s, rounds=rounds))
    return simulate_step(compute_s * (1 - BACKWARD_SHARE), compute_s * BACKWARD_SHARE, work).step_s


def _solve(f, lo: float, hi: float, target: float, log: bool = False) -> float:
    """x in [lo, hi] with f(x) = target, f decreasing (bisection, geometric with ``log``; hi if f(hi) >= target, lo
    if f(lo) < target)."""
    if f(hi) >= target:
        return hi
    if f(lo) < target:
        return lo
    for _ in range(40):
        mid = (lo * hi) ** 0.5 if log else (lo + hi) / 2
        lo, hi = (mid, hi) if f(mid) >= target else (lo, mid)
    return hi


def fit_link(options: Sequence[Sequence[Option]], sizes: Sequence[int], link: Link, compute_s: float, overlap: float,
             costs: Sequence[Sequence[float]] | None, dense_step_s: float) -> tuple[float, float]:
    """(overlap, share): how the step's own dense exchange did against the prediction. Measured dense steps
    (``dense_step_s``) longer than predicted: first the overlap with the backward pass is taken as smaller (down to
    none; the collectives share the CPU with the backward pass), then the link as a share of the probed bandwidth
    (another job shares it). Shorter than predicted: the probes underrated the link (a fast link's probe is within
    the noise of the ranks' arrival): the share grows, up to 1000. ``(overlap, 1.0)`` without dense steps."""
    dense = [0] * len(options)

    def time_at(o: float, share: float) -> float:
        return predicted_step_s(dense, options, sizes, Link(share * link.bandwidth, link.alpha), compute_s, o, costs)

    if dense_step_s <= 0:
        return overlap, 1.0
    if time_at(overlap, 1.0) >= dense_step_s:
        return overlap, _solve(lambda f: time_at(overlap, f), 1.0, 1e3, dense_step_s, log=True)
    if time_at(0.0, 1.0) >= dense_step_s:
        return _solve(lambda o: time_at(o, 1.0), 0.0, overlap, dense_step_s), 1.0
    return 0.0, _solve(lambda f: time_at(0.0, f), 1e-3, 1.0, dense_step_s, log=True)


def choose(options: Sequence[Sequence[Option]], sizes: Sequence[int], link: Link, compute_s: float, overlap: float,
           costs: Sequence[Sequence[float]] | None = None,
           allowed: Iterable[int] | None = None) -> tuple[list[int], float, float]:
    """(candidate index per bucket, its predicted step time, the all-dense one); index 0 is dense; ``allowed``:
    the candidate indices it may choose (default all)."""
    n = len(options)
    allowed = set(range(len(options[0])) if options else ()) if allowed is None else set(allowed) | {0}

    def time_of(choice):
        return predicted_step_s(choice, options, sizes, link, compute_s, overlap, costs)

    choice = [0] * n
    dense = best = time_of(choice)
    while True:
        move = None
        for b in range(n):
            for c in range(len(options[b])):
                if c != choice[b] and c in allowed:
                    t = time_of(choice[:b] + [c] + choice[b + 1:])
                    if t < best * (1 - 1e-3):
                        best, move = t, (b, c)
        if move is None:
            break
        choice[move[0]] = move[1]
    if best > dense * (1 - MIN_GAIN):
        return [0] * n, dense, dense
    return choice, best, dense


__all__ = ["Link", "MIN_GAIN", "Option", "allowed", "choose", "fit_link", "predicted_step_s", "record"]
