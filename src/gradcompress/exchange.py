"""Collectives chosen by a codec's algebra, driven as rounds, with byte accounting.

This is the only module that issues collectives (the adapters create groups or
broadcast initial parameters, nothing on the step path). An exchange of one group of tensors is a *job*: a generator that
issues asynchronous collectives, yields their work handles, and resumes when they have
completed. :func:`drive` advances several jobs round by round, in the order they were
created, so every rank issues the same collectives in the same order (no collective is
ever launched from a future callback, which is how PyTorch's ``powerSGD_hook``
deadlocks on gloo), while the first round of each job overlaps with whatever the
caller does before driving (the backward pass, in the DDP hook).

Byte accounting (``Collectives.wire_bytes``) counts what this rank transmits under
bandwidth-optimal ring algorithms, for W ranks and a local buffer of B bytes:

* all-reduce: 2 (W-1)/W B (reduce-scatter + all-gather);
* all-gather: (W-1) B (each rank forwards every other rank's block once);
* all-to-all: (W-1)/W B (every block but its own);
* W = 1: nothing.
"""

from __future__ import annotations

import itertools
import time
from typing import Callable, Generator, Iterable, Sequence

import torch
import torch.distributed as dist

from .codecs.base import Aggregation, Codec, Payload

Job = Generator[list, None, None]


# --------------------------------------------------------------------- serialisation
def to_bytes(tensors: Sequence[torch.Tensor], device=None) -> torch.Tensor:
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
    """Asynchronous collectives on one process group, with byte and time accounting."""

    def __init__(self, process_group=None):
        self.group = process_group
        self.world = dist.get_world_size(process_group)
        self.rank = dist.get_rank(process_group)
        self.wire_bytes = 0
        self.monitor_bytes = 0
        self.comm_seconds = 0.0

    def all_reduce(self, t: torch.Tensor, monitor: bool = False):
        """``monitor=True``: telemetry's exact average, counted in ``monitor_bytes``, not ``wire_bytes``."""
        sent = 2 * (self.world - 1) * t.numel() * t.element_size() // self.world
        if monitor:
            self.monitor_bytes += sent
        else:
            self.wire_bytes += sent
        return dist.all_reduce(t, group=self.group, async_op=True)

    def all_gather(self, t: torch.Tensor) -> tuple[list[torch.Tensor], object]:
        self.wire_bytes += (self.world - 1) * t.numel() * t.element_size()
        outs = [torch.empty_like(t) for _ in range(self.world)]
        return outs, dist.all_gather(outs, t, group=self.group, async_op=True)

    def all_gather_flat(self, t: torch.Tensor) -> tuple[torch.Tensor, object]:
        """Every rank's ``t`` back to back in one tensor (rank i's at block i)."""
        self.wire_bytes += (self.world - 1) * t.numel() * t.element_size()
        out = torch.empty(self.world * t.numel(), dtype=t.dtype, device=t.device)
        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        return out, gather(out, t.reshape(-1), group=self.group, async_op=True)

    def all_to_all(self, t: torch.Tensor) -> tuple[torch.Tensor, object]:
        """Equal splits: block j of ``t`` goes to rank j; block i of the result came from rank i."""
        self.wire_bytes += (self.world - 1) * t.numel() * t.element_size() // self.world
        out = torch.empty_like(t)
        return out, dist.all_to_all_single(out, t, group=self.group, async_op=True)

    def all_to_all_v(self, t: torch.Tensor, in_splits: list[int], out_splits: list[int]):
        """Uneven all-to-all: ``in_splits[j]`` elements of ``t`` go to rank j, ``out_splits[i]`` come from rank i."""
        self.wire_bytes += (sum(in_splits) - in_splits[self.rank]) * t.element_size()
        out = torch.empty(sum(out_splits), dtype=t.dtype, device=t.device)
        return out, dist.all_to_all_single(out, t, out_splits, in_splits, group=self.group, async_op=True)

    def wait(self, works: list) -> None:
        start = time.perf_counter()
        for w in works:
            w.wait()
        self.comm_seconds += time.perf_counter() - start

    def check_same(self, text: str, who: str) -> None:
        """Raise on every rank unless every rank passes the same ``text`` (a configuration)."""
        texts: list = [None] * self.world
        dist.all_gather_object(texts, text, group=self.group)
        if len(set(texts)) > 1:
            lines = "; ".join(f"rank {r}: {c[:300]}" for r, c in enumerate(texts))
            raise RuntimeError(f"{who}: ranks are configured differently, refusing to mix formats: {lines}")


class Done:
    """A completed work handle."""

    def wait(self) -> bool:
        return True


class LocalCollectives(Collectives):
    """:class:`Collectives` without communication, as if every one of ``world`` ranks held the same
    tensors: an all-reduce multiplies by ``world``, an all-gather repeats, an all-to-all copies.

    ``world=1`` is a single process (nothing sent, nothing counted); larger worlds stand in for a
    group in ``plan``'s calibration, to time the Python and codec work of a step alone.
    """

    def __init__(self, world: int = 1):  # noqa: D107 - no process group, deliberately not Collectives.__init__
        self.group, self.world, self.rank, self.wire_bytes, self.comm_seconds = None, world, 0, 0, 0.0
        self.monitor_bytes = 0

    def all_reduce(self, t, monitor: bool = False):
        if self.world != 1:
            t.mul_(self.world)
        return Done()

    def all_gather(self, t):
        return [t.clone() for _ in range(self.world)], Done()

    def all_gather_flat(self, t):
        return t.reshape(-1).repeat(self.world), Done()

    def all_to_all(self, t):
        return t.clone(), Done()

    def all_to_all_v(self, t, in_splits, out_splits):
        return t.clone(), Done()

    def wait(self, works) -> None:
        pass

    def check_same(self, text: str, who: str) -> None:
        pass


def drive(jobs: list[Job], comm: Collectives) -> None:
    """Run jobs to completion, round-robin: wait a job's pending works, resume it, next job."""
    pending = []
    for job in jobs:
        try:
            pending.append((job, next(job)))
        except StopIteration:
            pass
    while pending:
        still = []
        for job, works in pending:
            comm.wait(works)
            try:
                still.append((job, job.send(None)))
            except StopIteration:
                pass
        pending = still


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


def start(job: Job) -> Job:
    """Run a job up to its first collective (issued asynchronously) and return a job that resumes it."""
    try:
        first = next(job)
    except StopIteration:
        first = None

    def resumed() -> Job:
        if first is None:
            return
        works = first
        while True:
            yield works
            try:
                works = job.send(None)
            except StopIteration:
                return

    return resumed()


class Running:
    """A job launched with :func:`start`: the works of its current round are in flight.

    :meth:`advance` waits for them and runs the job to its next round (whose collectives are then
    in flight); :meth:`rest` is a job that continues from wherever it stands.
    """

    def __init__(self, job: Job):
        self.job = job
        self.works = next(job, None)

    def _resume(self) -> None:
        """Run the job to its next round (its works, or None when it has finished)."""
        try:
            self.works = self.job.send(None)
        except StopIteration:
            self.works = None

    def advance(self, comm: "Collectives") -> None:
        if self.works is None:
            return
        comm.wait(self.works)
        self._resume()

    def rest(self) -> Job:
        while self.works is not None:
            yield self.works
            self._resume()


# --------------------------------------------------------------------- exchange rounds
Encoder = Callable[[torch.Tensor, int], Payload]


def dense_mean(comm: Collectives, flat: torch.Tensor) -> Job:
    """All-reduce ``flat`` in place and divide by the world size."""
    if flat.numel():
        yield [comm.all_reduce(flat)]
        flat.div_(comm.world)


def sum_mean(comm: Collectives, codec: Codec, payloads: list[Payload], outs: list[torch.Tensor],
             summed: Callable[[torch.Tensor], None] | None = None) -> Job:
    """Summable payloads (already encoded from x / W): one all-reduce, decode into ``outs``.
    ``summed(flat)`` is called with each all-reduced flat buffer (the step checks finiteness there)."""
    groups: dict[torch.dtype, list[torch.Tensor]] = {}
    for p in payloads:
        for t in p.tensors:
            groups.setdefault(t.dtype, []).append(t)
    flats = {dt: _joined(ts) for dt, ts in groups.items()}
    yield [comm.all_reduce(f) for f in flats.values()]
    if summed is not None:
        for f in flats.values():
            summed(f)
    offsets = dict.fromkeys(flats, 0)
    for p, out in zip(payloads, outs):
        summed = []
        for t in p.tensors:
            o = offsets[t.dtype]
            summed.append(flats[t.dtype][o : o + t.numel()].view(t.shape))
            offsets[t.dtype] = o + t.numel()
        codec.decode_into(p.replace(tuple(summed)), out)


def _joined(ts: list[torch.Tensor]) -> torch.Tensor:
    """The tensors as one flat tensor: a view when they already lie back to back in one buffer, else a copy."""
    first = ts[0]
    if all(t.is_contiguous() and t.untyped_storage().data_ptr() == first.untyped_storage().data_ptr() for t in ts):
        offset = first.storage_offset()
        for t in ts:
            if t.storage_offset() != offset:
                break
            offset += t.numel()
        else:
            base = torch.empty(0, dtype=first.dtype, device=first.device).set_(first.untyped_storage())
            return base[first.storage_offset() : offset]
    return torch.cat([t.reshape(-1) for t in ts])


def gather_mean(comm: Collectives, codec: Codec, payloads: list[Payload], outs: list[torch.Tensor],
                received: Callable[[list[Payload]], None] | None = None) -> Job:
    """All-gather every rank's payloads (sizes first if they vary), decode each, average into ``outs``.
    ``received(payloads)`` is called with every rank's payloads (the same on every rank)."""
    local = to_bytes([t for p in payloads for t in p.tensors], outs[0].device if outs else None)
    if codec.fixed_layout:
        layouts = [[layout(p.tensors) for p in payloads]] * comm.world
        gathered, work = comm.all_gather(local)
        yield [work]
    else:
        counts = torch.tensor([t.numel() for p in payloads for t in p.tensors] + [local.numel()], dtype=torch.int64,
                              device=local.device)
        all_counts, work = comm.all_gather(counts)
        yield [work]
        longest = max(int(c[-1]) for c in all_counts)
        padded = torch.zeros(longest, dtype=torch.uint8, device=local.device)
        padded[: local.numel()] = local
        gathered, work = comm.all_gather(padded)
        layouts = []
        for c in all_counts:
            it = iter(c[:-1].tolist())
            layouts.append([[(t.dtype, torch.Size([next(it)])) for t in p.tensors] for p in payloads])
        yield [work]
    for out in outs:
        out.zero_()
    seen, divided = [], set()  # outs already divided by W (where anything was added)
    if codec.fixed_layout and hasattr(codec, "accumulate_gathered") and len(gathered) > 1:
        # every rank's buffer has the same layout: one view per payload tensor with a leading rank dimension,
        # and one accumulate per tensor for all ranks (O(tensors) calls, not O(tensors x W))
        stacked = torch.stack(gathered)
        if stacked.shape[1] % 8:  # rows 8-byte aligned, so that a row's tensors can be viewed in their dtype
            stacked = torch.nn.functional.pad(stacked, (0, 8 - stacked.shape[1] % 8))
        offset = 0
        for p, out in zip(payloads, outs):
            parts = []
            for t in p.tensors:
                size = t.numel() * t.element_size()
                part = stacked[:, offset : offset + size]
                if offset % t.element_size():
                    part = part.clone()
                parts.append(part.view(t.dtype))
                offset += size
            if codec.accumulate_gathered(p, parts, out, comm.world):
                divided.add(id(out))
            else:
                for i in range(len(gathered)):
                    codec.accumulate_into(p.replace(tuple(q[i] for q in parts)), out)
            seen.append(p.replace(tuple(parts)))
        gathered = []
    for buf, rank_layout in zip(gathered, layouts):
        offset = 0
        for p, lay, out in zip(payloads, rank_layout, outs):
            size = sum(s.numel() * d.itemsize for d, s in lay)
            theirs = p.replace(from_bytes(buf[offset : offset + size], lay))
            offset += size
            codec.accumulate_into(theirs, out)
            seen.append(theirs)
    if received is not None:
        received(seen)
    for out in outs:
        if id(out) not in divided:
            out.div_(comm.world)


#: elements per chunk of the two-step reduce are a multiple of this (whole packed bytes for 1-bit codes)
CHUNK_BLOCK = 8


def chunk_numel(numel: int, world: int, block: int = CHUNK_BLOCK) -> int:
    """Elements per rank's chunk in the two-step reduce: ceil(numel / world) rounded up to ``block``."""
    per = -(-numel // world)
    return -(-per // block) * block


def two_step_mean(comm: Collectives, codec: Codec, chunks: list[list[Payload]], outs: list[torch.Tensor],
                  reencode: Callable[[int, torch.Tensor], Payload],
                  received: Callable[[list[Payload]], None] | None = None) -> Job:
    """Two-step reduce of chunked payloads (qgZ / 1-bit Adam's compressed all-reduce).

    ``chunks[k][j]`` is this rank's payload for chunk j of tensor k (every chunk of a
    tensor has the same numel). Round 1: all-to-all, so rank j holds chunk j of every
    rank; it decodes and sums them into one buffer (``decode_into``, then
    ``accumulate_into``: no per-rank temporaries), averages and re-encodes with
    ``reencode(k, mean_chunk)``. Round 2: all-gather of the re-encoded chunks; every rank
    decodes all of them straight into ``outs[k]`` (the last chunk trimmed to its numel).
    ``received(payloads)`` is called with the gathered payloads (the same on every rank).
    Each rank sends about twice its compressed size. Received chunks are decoded with this
    rank's payload as the template (layout, seed): the codec must have a fixed layout and a
    decode that does not depend on the seed.
    """
    if not codec.fixed_layout:
        raise ValueError(f"two-step reduce needs a fixed-layout codec, {codec.name} is not")
    if not chunks:
        return
    world = comm.world
    send = to_bytes([t for j in range(world) for per_tensor in chunks for t in per_tensor[j].tensors])
    received_bytes, work = comm.all_to_all(send)
    yield [work]
    block_bytes = received_bytes.numel() // world
    lays = [layout(per_tensor[comm.rank].tensors) for per_tensor in chunks]
    sizes = [nbytes(per_tensor[comm.rank].tensors) for per_tensor in chunks]
    offsets = [0, *itertools.accumulate(sizes)]
    mine = []
    for k, per_tensor in enumerate(chunks):
        template = per_tensor[comm.rank]
        total = torch.empty(template.numel, dtype=torch.float32, device=received_bytes.device)
        for i in range(world):
            start_at = i * block_bytes + offsets[k]
            theirs = template.replace(from_bytes(received_bytes[start_at : start_at + sizes[k]], lays[k]))
            (codec.accumulate_into if i else codec.decode_into)(theirs, total)
        mine.append(reencode(k, total.div_(world)))
    gathered, work = comm.all_gather(to_bytes([t for p in mine for t in p.tensors]))
    yield [work]
    lays2 = [layout(p.tensors) for p in mine]
    sizes2 = [nbytes(p.tensors) for p in mine]
    offsets2 = [0, *itertools.accumulate(sizes2)]
    seen = []
    for k, out in enumerate(outs):
        flat = out.reshape(-1)
        per = mine[k].numel
        for i, buf in enumerate(gathered):
            start_at = offsets2[k]
            theirs = mine[k].replace(from_bytes(buf[start_at : start_at + sizes2[k]], lays2[k]))
            seen.append(theirs)
            lo = i * per
            hi = min(flat.numel(), lo + per)
            if hi - lo == per:
                codec.decode_into(theirs, flat[lo:hi].view(mine[k].shape))
            elif hi > lo:
                flat[lo:hi].copy_(codec.decode(theirs).reshape(-1)[: hi - lo])
        if not out.is_contiguous() or flat.data_ptr() != out.data_ptr():
            out.copy_(flat.view(out.shape))
    if received is not None:
        received(seen)


#: a tensor joins its group's single payload while its last bucket pads it by at most this fraction
WHOLE_GROUP_SLACK = 0.01


def fills_buckets(numel: int, bucket: int) -> bool:
    """Whether a tensor of ``numel`` elements travels in the whole-group payload (its last bucket pads it by
    at most :data:`WHOLE_GROUP_SLACK`): every multiple of the bucket, and anything over 100 buckets."""
    return numel > 0 and (-numel) % bucket <= WHOLE_GROUP_SLACK * numel


def whole_group_elements(numels: Sequence[int], bucket: int, world: int) -> int:
    """Elements one rank's whole-group payload holds: the tensors' buckets back to back (each tensor from a
    bucket edge) in ``world`` chunks of whole buckets."""
    buckets = sum(-(-n // bucket) for n in numels)
    return world * -(-buckets // world) * bucket


def bucketed_two_step_mean(comm: Collectives, codec: Codec, codes: torch.Tensor, scales: torch.Tensor,
                           reencode: Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]],
                           finish: Callable[[torch.Tensor, torch.Tensor], None]) -> Job:
    """The two-step reduce of a whole group's payload at once (bucketed quantisers, ``Codec.encode_piece``).

    ``codes`` and ``scales`` are this rank's payload of the group: W equal chunks of whole buckets, chunk j
    for rank j. Round 1: two all-to-alls (codes, scales; no copies into a byte buffer), so this rank holds
    its chunk from every rank; it decodes the first into one buffer and adds the others into it
    (``decode_into`` / ``accumulate_into``: W calls, whatever the number of tensors), averages, and
    ``reencode(mean_chunk)`` gives its chunk's codes and scales. Round 2: two all-gathers into flat
    tensors, which are then the group's payload in the same layout: ``finish(codes, scales)`` decodes it.
    Each rank sends about twice its compressed size.
    """
    world = comm.world
    got_codes, w1 = comm.all_to_all(codes)
    got_scales, w2 = comm.all_to_all(scales)
    yield [w1, w2]
    cn, sn = codes.numel() // world, scales.numel() // world
    per = sn * codec.bucket
    total = torch.empty(per, dtype=torch.float32, device=codes.device)
    shape = torch.Size([per])
    for i in range(world):
        theirs = Payload((got_codes[i * cn : (i + 1) * cn], got_scales[i * sn : (i + 1) * sn]), shape,
                         torch.float32, None, codes.device)
        (codec.accumulate_into if i else codec.decode_into)(theirs, total)
    mine_codes, mine_scales = reencode(total.div_(world))
    all_codes, w1 = comm.all_gather_flat(mine_codes)
    all_scales, w2 = comm.all_gather_flat(mine_scales)
    yield [w1, w2]
    finish(all_codes, all_scales)


def reduce_scatter_sum(comm: Collectives, codec: Codec, payloads: list[Payload], out: torch.Tensor) -> Job:
    """A compressed reduce-scatter: ``payloads[j]`` is this rank's payload of chunk j (every chunk has
    ``out``'s numel). All-to-all (sizes first if the codec's payload size varies), so this rank holds
    every rank's payload of its own chunk; they are decoded one by one and summed into ``out``.
    Each rank sends (W-1)/W of its compressed buffer. Received payloads are read with this rank's own
    payload of its chunk as the template (layout, seed): the decode must not depend on a per-rank seed.
    """
    world, rank = comm.world, comm.rank
    parts = [to_bytes(p.tensors, out.device) for p in payloads]
    template = payloads[rank]
    if codec.fixed_layout:
        received, work = comm.all_to_all(torch.cat(parts))
        yield [work]
        lays = [layout(template.tensors)] * world
        pieces = list(received.split(parts[rank].numel()))
    else:
        counts = torch.tensor([[t.numel() for t in p.tensors] for p in payloads], dtype=torch.int64,
                              device=out.device)
        got, work = comm.all_to_all(counts.reshape(-1))
        yield [work]
        got = got.view(world, -1).tolist()
        lays = [[(t.dtype, torch.Size([n])) for t, n in zip(template.tensors, row)] for row in got]
        sizes = [sum(n * t.element_size() for t, n in zip(template.tensors, row)) for row in got]
        received, work = comm.all_to_all_v(torch.cat(parts), [q.numel() for q in parts], sizes)
        yield [work]
        pieces = list(received.split(sizes))
    out.zero_()
    for piece, lay in zip(pieces, lays):
        out.add_(codec.decode(template.replace(from_bytes(piece, lay))).float().reshape(out.shape))


def split_chunks(flat: torch.Tensor, world: int, block: int = CHUNK_BLOCK) -> list[torch.Tensor]:
    """``flat`` zero-padded to ``world`` equal chunks of :func:`chunk_numel` elements."""
    per = chunk_numel(flat.numel(), world, block)
    if per * world != flat.numel():
        flat = torch.nn.functional.pad(flat, (0, per * world - flat.numel()))
    return list(flat.view(world, per))


__all__ = ["Aggregation", "CHUNK_BLOCK", "Collectives", "Done", "LocalCollectives", "Running", "drive", "parallel",
           "start",
           "dense_mean", "sum_mean", "gather_mean", "two_step_mean", "bucketed_two_step_mean",
           "fills_buckets", "whole_group_elements", "reduce_scatter_sum", "split_chunks", "chunk_numel", "to_bytes",
           "from_bytes"]
