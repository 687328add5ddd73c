"""Codec work per step: the per-element costs measured on a machine (:class:`Speeds`), the passes each scheme
makes over its elements by phase (:func:`codec_passes`), and the buckets of a flat step as the timing takes them
(:func:`bucket_work`) (:mod:`gradcompress.costmodel`)."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from typing import TYPE_CHECKING

from ..spec import Scheme
from ..timing import BucketWork, Round, round_seconds
from .recording import record_step
from .sizes import _compressible, buckets_for, numel_of

if TYPE_CHECKING:
    from ..codecs.base import Codec


@dataclasses.dataclass(frozen=True)
class Speeds:
    """Per-element costs in seconds measured on a machine (see ``gradcompress plan``'s calibration).

    ``elementwise``: one pass over float32 elements (an add or a copy); ``encode`` / ``decode``:
    by codec spec (canonical, ``codec.spec``), seconds per input element (PowerSGD: per element
    of the matrix, at its rank).
    """

    elementwise: float
    encode: dict
    decode: dict
    #: measured Compressor work per compressible element, by phase (hook, after round 1, ...), keyed by
    #: :func:`phase_key`; when present it replaces the pass counts of :func:`codec_passes`
    phases: dict = dataclasses.field(default_factory=dict)

    def enc(self, codec: Codec) -> float:
        return self.encode.get(codec.spec, 0.0)

    def dec(self, codec: Codec) -> float:
        return self.decode.get(codec.spec, 0.0)


def codec_passes(scheme: Scheme, workers: int, error_feedback: bool = True) -> list[dict]:
    """Codec work per compressible element, by phase: ``[hook, after round 1, after round 2...]``.

    Each phase is a dict of pass counts: ``{"ew": elementwise passes, "enc": encodes,
    "dec": decodes}`` (per element of the compressed tensors; PowerSGD's encode is split
    into its two matrix products, half before each round).
    """
    W = workers
    if scheme.kind == "ddp":  # the default hook divides the bucket (DDP's own copies are part of the compute)
        return [{"ew": 1}, {}]
    if scheme.kind == "torch-fp16":  # cast to fp16 and divide; decompress into the bucket
        return [{"ew": 2}, {"ew": 1}]
    ef = 1 if error_feedback else 0
    if scheme.kind == "torch-powersgd":  # bucket copy, EF add, clone, M Q | (uncompressed) | M^T P | P Q^T, error, copy
        return [{"ew": 3, "enc": 0.5}, {}, {"enc": 0.5}, {"dec": 1, "ew": 3}]
    if scheme.codec.exact:  # a plain all-reduce and a divide, as DDP's default hook
        return [{"ew": 1}, {}]
    agg = scheme.codec.aggregation.value
    # hook, every codec: input (x + residual, or a clone), the finiteness flag's sum; residual = x - delivered
    base = {"ew": 2 + ef}
    if agg == "sum":
        return [{**base, "ew": base["ew"] + 1, "enc": 1, "dec": 1}, {"dec": 1, "ew": 2}]
    if agg == "gather":  # variable sizes (dgc, threshold): the sizes' round first
        sizes: list[dict] = [] if scheme.codec.fixed_layout else [{}]
        return [{**base, "enc": 1, "dec": 1}, *sizes, {"dec": W, "ew": W + 2}]
    if agg == "requantize":
        if W == 1:
            return [{**base, "enc": 1, "dec": 1}]
        return [{**base, "enc": 1, "dec": 1}, {"dec": 1, "ew": 1, "enc": 1 / W}, {"dec": 1, "ew": 2}]
    # lowrank: M Q in the hook; M^T P, delivered P Q^T, residual after round 1; P Q^T, copy after round 2
    return [{"ew": 2, "enc": 0.5}, {"enc": 0.5, "dec": 1, "ew": ef}, {"dec": 1, "ew": 1}]


def phase_key(codec: Codec, workers: int) -> str:
    return f"{codec.spec}@{workers}"


def speed_codec(scheme: Scheme) -> Codec | None:
    """The codec whose measured speed stands for the scheme's codec work (None: copies only)."""
    if scheme.kind == "ours":
        return scheme.codec
    if scheme.kind == "torch-powersgd":
        from ..spec import make

        return make(f"powersgd:rank={scheme.rank}")
    return None


def _phase_seconds(phase: dict, codec, speeds: Speeds, numel: int) -> float:
    enc = speeds.enc(codec) if codec is not None else 0.0
    dec = speeds.dec(codec) if codec is not None else 0.0
    return numel * (phase.get("ew", 0) * speeds.elementwise + phase.get("enc", 0) * enc + phase.get("dec", 0) * dec)


def bucket_work(scheme: Scheme, shapes: Sequence[Sequence[int]], workers: int, bandwidth: float, alpha: float,
                speeds: Speeds, contention: float = 1.0, error_feedback: bool = True,
                bucket_cap: int | None = None) -> list[BucketWork]:
    """The buckets of one step of ``scheme``, in the order their gradients become ready: each round of the
    recorded step (:func:`record_step`) timed by :func:`round_seconds`, then the codec work after it."""
    buckets = buckets_for(scheme, shapes, bucket_cap)
    recorded = record_step(scheme, shapes, workers, bucket_cap).buckets
    total = sum(numel_of(s) for s in shapes) or 1
    out, done = [], 0
    for b, rounds in zip(buckets, recorded):
        done += sum(numel_of(shapes[i]) for i in b)
        if scheme.kind == "ours":
            n = sum(numel_of(shapes[i]) for i in b if _compressible(scheme, shapes[i]))
            codec = scheme.codec
        else:
            n, codec = sum(numel_of(shapes[i]) for i in b), speed_codec(scheme)
        # measured phases of our Compressor (torch-powersgd: ours at the same rank stands in for it, with nothing
        # to do after the hook's first round, its uncompressed tensors' all-reduce)
        measured = speeds.phases.get(phase_key(codec, workers)) if codec is not None else None
        if n and measured is not None:
            secs = [contention * n * m for m in measured]
            if scheme.kind == "torch-powersgd":
                secs = secs[:1] + [0.0] + secs[1:]
        else:
            phases = codec_passes(scheme, workers, error_feedback) if n else [{}]
            secs = [contention * _phase_seconds(p, codec, speeds, n) for p in phases]
        secs += [0.0] * (len(rounds) + 1 - len(secs))
        comm = [round_seconds(r, bandwidth, alpha) for r in rounds]
        out.append(BucketWork(ready=done / total, hook_s=secs[0],
                              rounds=tuple(Round(c, a) for c, a in zip(comm, secs[1:]))))
    return out


__all__ = ["Speeds", "bucket_work", "codec_passes", "phase_key", "speed_codec"]
