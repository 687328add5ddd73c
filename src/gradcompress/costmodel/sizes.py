"""The cost model's arithmetic of sizes: the alpha-beta time of each collective, the schemes it models and what a
codec's payload weighs, and the DDP buckets a scheme runs with (:mod:`gradcompress.costmodel`)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING

from ..spec import BASELINES, DECOUPLED, ONEBITADAM, Scheme
from ..spec import parse_scheme as _read

if TYPE_CHECKING:
    from ..codecs.base import Codec

DEFAULT_SCHEMES = ("ddp", "torch-fp16", "torch-powersgd", "none", "fp16", "int8", "int4", "sign",
                   "topk:ratio=0.01", "powersgd:rank=1", "powersgd:rank=4")
DDP_BUCKET_BYTES = 25 * 1024 * 1024
DDP_FIRST_BUCKET_BYTES = 1024 * 1024
MIN_NUMEL = 1024  # Compressor's default: smaller tensors travel dense
FLOAT_BYTES = 4

# --------------------------------------------------------------------------- collectives
def allreduce_time(nbytes: float, workers: int, bandwidth: float, alpha: float = 0.0) -> float:
    """Ring all-reduce of ``nbytes``: 2(W-1)/W M/B + 2(W-1) alpha (0 for one worker or no bytes)."""
    if workers <= 1 or nbytes <= 0:
        return 0.0
    return 2 * (workers - 1) / workers * nbytes / bandwidth + 2 * (workers - 1) * alpha


def allgather_time(nbytes: float, workers: int, bandwidth: float, alpha: float = 0.0) -> float:
    """Ring all-gather of ``nbytes`` per rank: (W-1) M/B + (W-1) alpha."""
    if workers <= 1 or nbytes <= 0:
        return 0.0
    return (workers - 1) * nbytes / bandwidth + (workers - 1) * alpha


def alltoall_time(nbytes: float, workers: int, bandwidth: float, alpha: float = 0.0) -> float:
    """All-to-all of ``nbytes`` per rank in W equal blocks: (W-1)/W M/B + (W-1) alpha."""
    if workers <= 1 or nbytes <= 0:
        return 0.0
    return (workers - 1) / workers * nbytes / bandwidth + (workers - 1) * alpha


def two_step_time(nbytes: float, workers: int, bandwidth: float, alpha: float = 0.0) -> float:
    """Two-step reduce of a compressed size Mc: all-to-all of Mc, then all-gather of Mc/W."""
    return alltoall_time(nbytes, workers, bandwidth, alpha) + allgather_time(nbytes / workers, workers, bandwidth,
                                                                             alpha)


# --------------------------------------------------------------------------- schemes and payloads
def modelled_scheme(text: str) -> Scheme:
    """A scheme the cost model predicts: ``ddp``, ``torch-fp16``, ``torch-powersgd[:rank=R]`` or a codec spec
    (:func:`gradcompress.spec.parse_scheme` reads it: Compressor options by name, ``diloco=H``, which the model
    ignores); ``ValueError`` otherwise (and for ``onebitadam`` and ``decoupled``, which it has no model of)."""
    scheme = _read(text)
    if scheme.kind in (ONEBITADAM, DECOUPLED):
        raise ValueError(f"the cost model has no model of {scheme.kind!r} (an optimizer that exchanges its own "
                         f"momentum); schemes: {', '.join(BASELINES)} or a codec spec")
    return scheme


#: the cost model's former name of :func:`modelled_scheme` (callers and tests use it); the grammar's one
#: ``parse_scheme`` is :func:`gradcompress.spec.parse_scheme`
parse_scheme = modelled_scheme


def numel_of(shape: Sequence[int]) -> int:
    return math.prod(shape)


def payload_bytes(codec: Codec, numel: int, shape: Sequence[int] | None = None) -> int:
    """Bytes one ``codec.encode`` of a float32 tensor sends (PowerSGD's factors: pass ``shape``).

    Exact for the fixed-layout codecs; ``dgc`` counts its target k values; ``threshold``
    (data-dependent) raises ``ValueError``.
    """
    n = int(numel)
    return codec.payload_nbytes(n, tuple(shape) if shape is not None else None) if n else 0


def ddp_buckets(nbytes: Sequence[int], cap: int = DDP_BUCKET_BYTES,
                first_cap: int = DDP_FIRST_BUCKET_BYTES) -> list[list[int]]:
    """DDP's (rebuilt) buckets: indices into ``nbytes`` (given in gradient-ready order, i.e. the
    parameters reversed). A bucket closes once it holds at least its cap; the first one's cap is
    ``first_cap`` (1 MiB when DDP's default cap is used, else the cap)."""
    buckets: list[list[int]] = []
    cur: list[int] = []
    size = 0
    for i, b in enumerate(nbytes):
        cur.append(i)
        size += b
        if size >= (first_cap if not buckets else cap):
            buckets.append(cur)
            cur, size = [], 0
    if cur:
        buckets.append(cur)
    return buckets


def buckets_for(scheme: Scheme, shapes: Sequence[Sequence[int]], bucket_cap: int | None = None) -> list[list[int]]:
    """Bucket assignment (indices into ``shapes``, which are in model order) the scheme runs with."""
    order = list(range(len(shapes)))[::-1]
    sizes = [FLOAT_BYTES * numel_of(shapes[i]) for i in order]
    if scheme.kind == "torch-powersgd":
        return [order]
    cap = DDP_BUCKET_BYTES if bucket_cap is None else bucket_cap
    first = DDP_FIRST_BUCKET_BYTES if bucket_cap is None else bucket_cap
    return [[order[j] for j in b] for b in ddp_buckets(sizes, cap, first)]


def _torch_powersgd_compresses(shape: Sequence[int], rank: int) -> tuple[int, int] | None:
    """(n, m) when PyTorch's powerSGD_hook compresses a tensor (ndim >= 2, worth it at rate 2)."""
    if len(shape) < 2:
        return None
    n, m = shape[0], numel_of(shape[1:])
    r = min(n, m, rank)
    return (n, m) if (n + m) * r * 2 < n * m else None


def _compressible(scheme: Scheme, shape: Sequence[int], min_numel: int = MIN_NUMEL) -> bool:
    codec = scheme.codec
    if numel_of(shape) < min_numel:
        return False
    if codec.aggregation.value == "lowrank" and codec.matrix_shape(tuple(shape)) is None:
        return False
    return True


__all__ = ["DDP_BUCKET_BYTES", "DDP_FIRST_BUCKET_BYTES", "DEFAULT_SCHEMES", "FLOAT_BYTES", "MIN_NUMEL", "allgather_time",
           "allreduce_time", "alltoall_time", "buckets_for", "ddp_buckets", "modelled_scheme", "numel_of",
           "parse_scheme", "payload_bytes", "two_step_time"]
