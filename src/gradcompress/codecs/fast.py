"""Fused CPU kernels for the codecs (issue 7), with the plain-torch code as the reference.

Every codec keeps its plain-torch implementation (the *reference path*); on large CPU
tensors it takes a *fast path* instead: one fused pass per bucket in a small C++ library
(``csrc/fast.cpp``), close to memory bandwidth. The payload format and the codec
semantics are the same on both paths:

* deterministic codecs (``int8``, ``int4``, ``sign``, ``topk``, ``threshold``) give the
  same codes (``sign``'s scale and ``qsgd``'s norm are summed in float64, so they may
  differ from the reference's float32 sums in the last bits; top-k breaks ties among
  equal magnitudes by position, ``torch.topk`` in its own order);
* stochastic codecs (stochastic rounding, ``qsgd``, ``terngrad``, ``dgc``'s sample) draw
  their noise from a counter-based hash of (seed, element index) instead of
  ``torch.rand``: the same distribution, deterministic for a seed, other bits. The
  quantisers' noise is a 32-bit hash that vectorises (``uniform32`` in ``csrc/fast.cpp``:
  two multiply-xorshift rounds of the element index keyed by :func:`stream_key`, 24 bits
  of it as the uniform), so element i's noise does not depend on how the tensor is cut.

Memory traffic (none of it changes a value): outputs of 4 MiB and more that nothing reads back in the same call
(a decode, the new residual of the fused error feedback) are written with streaming stores, which skip reading
each destination line first; fresh decode outputs come from :func:`empty` (huge pages); the chunk owner's mean
of W payloads is one pass (``Codec.mean_into``) and can be re-encoded without being stored
(``Bucketed.encode_mean_piece``).

When the fast path is taken: :func:`enabled` (the environment variable
``GRADCOMPRESS_FAST=0`` turns it off, :func:`set_enabled` / :func:`use` override it), the
tensor is on the CPU and has at least :data:`MIN_NUMEL` elements (and fewer than 2**31),
and the library could be built. It is compiled (about a second; any C++17 compiler,
``$CXX`` or ``c++``) by :func:`build_kernels`, which a :class:`gradcompress.Compressor` calls when it
is constructed on a machine without CUDA — before training, not inside a step while other
ranks wait — or else at the first large encode. Without a compiler, or when the build
fails, every codec stays on the reference path and one warning says why. Other devices
(CUDA) always take the reference path.

The cache, and what is loaded from it (owned by the current user, writable by no one else): see
:mod:`gradcompress.codecs.fast_build`. A folder that fails the check is skipped with the reason in :func:`failure`.
"""

from __future__ import annotations

import contextlib
import ctypes
import math
import os
import sys
import threading
import warnings
from collections.abc import Iterator, Sequence
from pathlib import Path

import torch

# the library's build and the outputs' memory, in modules of their own; their public names are this module's too
from .fast_build import CACHE_ENV as CACHE_ENV
from .fast_build import build_library, declare
from .fast_build import cache_root as cache_root
from .fast_build import check_private as check_private
from .fast_build import compiler as _compiler
from .fast_memory import HUGE_ENV_VAR as HUGE_ENV_VAR
from .fast_memory import HUGE_MIN_BYTES as HUGE_MIN_BYTES
from .fast_memory import empty as empty

#: Smallest tensor (in elements) that takes the fast path; smaller ones gain little and
#: stay on the reference path (so tests of small tensors never trigger a build).
MIN_NUMEL = 1 << 16

ENV_VAR = "GRADCOMPRESS_FAST"
SOURCE = Path(__file__).with_name("csrc") / "fast.cpp"
_VERSION = 10  # gc_version() of the source this module drives

FAST_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
#: residual storage the fused error feedback reads and writes
RESIDUAL_DTYPES = (torch.float32, torch.bfloat16)

_override: bool | None = None
_lib: ctypes.CDLL | None = None
_failure: str | None = None
_lock = threading.Lock()


# ----------------------------------------------------------------------------- switch
def enabled() -> bool:
    """Whether codecs may take the fast path (the override, else ``GRADCOMPRESS_FAST`` != 0)."""
    if _override is not None:
        return _override
    return os.environ.get(ENV_VAR, "1").strip().lower() not in ("0", "false", "no", "off")


def set_enabled(flag: bool | None) -> None:
    """Force the fast path on (True) or off (False); None goes back to the environment variable."""
    global _override
    _override = None if flag is None else bool(flag)


@contextlib.contextmanager
def use(flag: bool) -> Iterator[None]:
    """``with fast.use(False): ...`` runs the reference path (restores the previous setting after)."""
    global _override
    before = _override
    _override = bool(flag)
    try:
        yield
    finally:
        _override = before


def applies(t: torch.Tensor, dtypes: tuple[torch.dtype, ...] = FAST_DTYPES) -> bool:
    """True when an encode of ``t`` takes the fast path (builds the library on the first call)."""
    return (t.device.type == "cpu" and MIN_NUMEL <= t.numel() < 2**31 and t.dtype in dtypes
            and enabled() and library() is not None)


def kernels_available() -> bool:
    """True when the library is built and loaded (builds it if needed)."""
    return library() is not None


def failure() -> str | None:
    """Why the library could not be built or loaded (None when it was, or was not tried)."""
    return _failure


# ----------------------------------------------------------------------------- build
def _build(cxx: str) -> Path:
    """The built library's path (:func:`fast_build.build_library` of :data:`SOURCE`)."""
    return build_library(cxx, SOURCE)


def build_kernels() -> ctypes.CDLL:
    """Build (or find in the cache) and load the kernel library now; ``RuntimeError`` saying why if it cannot.

    Call it before training (a :class:`gradcompress.Compressor` does on machines without
    CUDA) so that the compile does not happen inside the first step.
    """
    lib = library()
    if lib is None:
        raise RuntimeError(f"gradcompress: fast codec kernels unavailable: {_failure}")
    return lib


#: the former name of :func:`build_kernels` (``gradcompress.codecs.fast.build()``), kept for the callers of it
build = build_kernels


def prepare() -> None:
    """:func:`library` if the fast path is enabled and the machine has no CUDA (else the first encode builds it)."""
    if enabled() and not torch.cuda.is_available():
        library()


def library() -> ctypes.CDLL | None:
    """The loaded kernel library, building it on first use; None when unavailable (one warning)."""
    global _lib, _failure
    if _lib is not None or _failure is not None:
        return _lib
    with _lock:
        if _lib is not None or _failure is not None:
            return _lib
        try:
            if sys.platform == "win32":
                raise RuntimeError("the fast path is built for POSIX platforms only")
            cxx = _compiler()
            if cxx is None:
                raise RuntimeError("no C++ compiler found (set $CXX or install g++ or clang++)")
            lib = ctypes.CDLL(str(_build(cxx)))
            declare(lib)
            if lib.gc_version() != _VERSION:
                raise RuntimeError(f"library version {lib.gc_version()}, expected {_VERSION}")
            _lib = lib
        except Exception as err:  # any failure (compiler, loader, kernel) means: reference path
            _failure = f"{type(err).__name__}: {err}"
            warnings.warn(f"gradcompress: fast codec kernels unavailable, using the plain torch codecs "
                          f"(slower on large tensors): {_failure}", RuntimeWarning, stacklevel=3)
    return _lib


def _kernels() -> ctypes.CDLL:
    """The loaded library, for a kernel call (its caller checked :func:`applies` or :func:`kernels_available`):
    :func:`build_kernels`, ``RuntimeError`` saying why when there is none."""
    return build_kernels()


# ----------------------------------------------------------------------------- helpers
_MASK64 = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15


def _mix64(z: int) -> int:
    z &= _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


def stream_key(seed: int, salt: int) -> int:
    """The 64-bit key of the noise stream of ``seed`` for one use (``salt``)."""
    return _mix64(_mix64((int(seed) & _MASK64) + _GOLDEN) ^ (salt * 0xD1B54A32D192ED03))


def _threads(n: int) -> int:
    return max(1, min(torch.get_num_threads(), n // 32768 or 1))


def as_float32(flat: torch.Tensor) -> torch.Tensor:
    """A contiguous float32 view or copy of a 1-D tensor."""
    return flat.detach().to(torch.float32).contiguous()


def _ptr(t: torch.Tensor) -> int:
    return t.data_ptr()


# ----------------------------------------------------------------------------- quantisers
UNIFORM, QSGD, TERNGRAD, SIGN = 0, 1, 2, 3
_SALT_NOISE = 1


def quantize(x: torch.Tensor, bucket: int, kind: int, bits: int, qmax: int = 0, seed: int | None = None,
             stochastic: bool = False, *, residual: torch.Tensor | None = None,
             residual_out: torch.Tensor | None = None, decoding: tuple[bool, int, int, float] = (False, 1, 0, 1.0),
             codes_out: torch.Tensor | None = None, scale_out: torch.Tensor | None = None, index0: int = 0
             ) -> tuple[torch.Tensor, torch.Tensor]:
    """Fused scale + codes + packing of a float32 1-D tensor: (codes, one float32 scale per bucket).

    codes: int8 (``UNIFORM`` with 8 bits), else uint8 packed to ceil(n * bits / 8) bytes.
    Needs ``bits == 8`` or ``bucket % 8 == 0``.

    Fused error feedback: with ``residual`` (float32, x's size) the codes are those of
    ``x + residual``; ``residual_out`` (float32, x's size; may be x or residual itself)
    receives ``(x + residual) - decode(codes)`` in the same pass (both residuals float32, or both
    bfloat16: read exactly, written rounded to nearest even as ``.to(torch.bfloat16)``), the decode being
    :func:`dequantize` with ``decoding = (signed, mul, offset, div)``. ``codes_out`` /
    ``scale_out``: write into these (contiguous, of the sizes above) instead of new tensors.
    ``index0``: element i draws the noise of index ``index0 + i`` of the seed's stream (a piece of a
    tensor that starts at element ``index0`` gets the noise the whole tensor's encode would give it);
    the index is a 32-bit counter: ``index0 + x.numel()`` must not exceed 2**32.
    """
    lib = _kernels()
    n = x.numel()
    nb = -(-n // bucket)
    signed = kind == UNIFORM and bits == 8
    code_dtype = torch.int8 if signed else torch.uint8
    codes = torch.empty((n * bits + 7) // 8, dtype=code_dtype) if codes_out is None else codes_out
    scale = torch.empty(nb, dtype=torch.float32) if scale_out is None else scale_out
    if (codes.numel() != (n * bits + 7) // 8 or codes.dtype != code_dtype or not codes.is_contiguous()
            or scale.numel() != nb or scale.dtype != torch.float32 or not scale.is_contiguous()):
        raise ValueError("fast.quantize: codes_out / scale_out do not have the payload's layout")
    if not 0 <= index0 <= 2**32 - n:
        raise ValueError(f"fast.quantize: index0 + numel = {index0 + n} is beyond the 32-bit noise counter")
    key = stream_key(seed or 0, _SALT_NOISE)
    res_dtypes = {t.dtype for t in (residual, residual_out) if t is not None}
    for t in (residual, residual_out):
        if t is not None and (t.dtype not in RESIDUAL_DTYPES or t.numel() != n or not t.is_contiguous()
                              or len(res_dtypes) > 1):
            raise ValueError("fast.quantize: the residuals must be contiguous, of x's size, both float32 or both "
                             "bfloat16")
    is_signed, mul, offset, div = decoding
    rc = lib.gc_quantize(_ptr(x), None if residual is None else _ptr(residual), n, bucket, kind, bits, qmax,
                         int(stochastic), key, _ptr(codes), _ptr(scale),
                         None if residual_out is None else _ptr(residual_out), int(is_signed), mul, offset,
                         float(div), int(index0), int(torch.bfloat16 in res_dtypes), _threads(n))
    if rc:
        raise ValueError(f"fast.quantize: unsupported bits={bits}, bucket={bucket}")
    return codes, scale


def dequantize(codes: torch.Tensor, scale: torch.Tensor, n: int, bucket: int, bits: int, *, signed: bool = False,
               mul: int = 1, offset: int = 0, div: float = 1.0, out: torch.Tensor | None = None,
               accumulate: bool = False) -> torch.Tensor:
    """float32 ``(code * mul - offset) * (scale[bucket] / div)`` for the n codes (packed when bits < 8),
    written into ``out`` (contiguous float32 of n; ``accumulate``: added to it) when given."""
    lib = _kernels()
    if out is None:
        out = empty(n)
    elif out.dtype != torch.float32 or out.numel() != n or not out.is_contiguous():
        raise ValueError("fast.dequantize: out must be contiguous float32 of n elements")
    rc = lib.gc_dequantize(_ptr(codes), _ptr(scale), n, bucket, bits, int(signed), mul, offset, float(div),
                           int(accumulate), _ptr(out), _threads(n))
    if rc:
        raise ValueError(f"fast.dequantize: unsupported bits={bits}, bucket={bucket}")
    return out


def dequantize_mean(payloads: Sequence[tuple[torch.Tensor, ...]], n: int, bucket: int, bits: int, divisor: float,
                    out: torch.Tensor, *, signed: bool = False, mul: int = 1, offset: int = 0,
                    div: float = 1.0) -> torch.Tensor:
    """``out`` = the float32 mean of W payloads (``payloads``: (codes, scale) pairs, each as :func:`dequantize`
    reads it): the decode of the first, the others added in order, then divided by ``divisor`` in float32 — the
    values of :func:`dequantize` into ``out``, W - 1 accumulating :func:`dequantize` calls and ``out.div_(divisor)``,
    in one pass that writes ``out`` once."""
    lib = _kernels()
    if out.dtype != torch.float32 or out.numel() != n or not out.is_contiguous():
        raise ValueError("fast.dequantize_mean: out must be contiguous float32 of n elements")
    world = len(payloads)
    code_ptrs = (ctypes.c_void_p * world)(*[_ptr(c) for c, _ in payloads])
    scale_ptrs = (ctypes.c_void_p * world)(*[_ptr(s) for _, s in payloads])
    rc = lib.gc_dequantize_mean(code_ptrs, scale_ptrs, world, n, bucket, bits, int(signed), mul, offset, float(div),
                                float(divisor), _ptr(out), _threads(n))
    if rc:
        raise ValueError(f"fast.dequantize_mean: unsupported bits={bits}, bucket={bucket}")
    return out


def quantize_mean(payloads: Sequence[tuple[torch.Tensor, ...]], divisor: float, n: int, bucket: int, kind: int,
                  bits: int, qmax: int = 0, seed: int | None = None, stochastic: bool = False, *,
                  decoding: tuple[bool, int, int, float], codes_out: torch.Tensor, scale_out: torch.Tensor,
                  index0: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`quantize` (no residuals) of the mean of W payloads of the same codec, into ``codes_out`` and
    ``scale_out``: the codes and scales of :func:`dequantize_mean` into a buffer followed by :func:`quantize` of
    it, without the buffer (each bucket's mean is made and encoded while it is in the cache). ``payloads``:
    (codes, scale) pairs of n elements each, laid out as :func:`dequantize` reads them; ``decoding`` =
    (signed, mul, offset, div) decodes them and the codes written."""
    lib = _kernels()
    nb = -(-n // bucket)
    code_dtype = torch.int8 if kind == UNIFORM and bits == 8 else torch.uint8
    if (codes_out.numel() != (n * bits + 7) // 8 or codes_out.dtype != code_dtype or not codes_out.is_contiguous()
            or scale_out.numel() != nb or scale_out.dtype != torch.float32 or not scale_out.is_contiguous()):
        raise ValueError("fast.quantize_mean: codes_out / scale_out do not have the payload's layout")
    if not 0 <= index0 <= 2**32 - n:
        raise ValueError(f"fast.quantize_mean: index0 + numel = {index0 + n} is beyond the 32-bit noise counter")
    world = len(payloads)
    code_ptrs = (ctypes.c_void_p * world)(*[_ptr(c) for c, _ in payloads])
    scale_ptrs = (ctypes.c_void_p * world)(*[_ptr(s) for _, s in payloads])
    is_signed, mul, offset, div = decoding
    rc = lib.gc_quantize_mean(code_ptrs, scale_ptrs, world, float(divisor), n, bucket, kind, bits, qmax,
                              int(stochastic), stream_key(seed or 0, _SALT_NOISE), _ptr(codes_out), _ptr(scale_out),
                              int(is_signed), mul, offset, float(div), int(index0), _threads(n))
    if rc:
        raise ValueError(f"fast.quantize_mean: unsupported bits={bits}, bucket={bucket}")
    return codes_out, scale_out


def dequantize_ok(codes: torch.Tensor, scale: torch.Tensor, n: int, bucket: int, bits: int,
                  code_dtype: torch.dtype, any_size: bool = False) -> bool:
    """Whether received payload tensors have the layout :func:`dequantize` reads (else: reference path);
    ``any_size``: also below :data:`MIN_NUMEL` (decodes are the same values on both paths)."""
    return (codes.device.type == "cpu" and scale.device.type == "cpu" and (any_size or MIN_NUMEL <= n) and n < 2**31
            and codes.dtype == code_dtype and scale.dtype == torch.float32
            and codes.is_contiguous() and scale.is_contiguous()
            and codes.numel() == (n * bits + 7) // 8 and scale.numel() == -(-n // bucket)
            and (bits == 8 or bucket % 8 == 0) and enabled() and library() is not None)


def pack(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """packing.pack of contiguous uint8 codes."""
    n = codes.numel()
    out = torch.empty((n * bits + 7) // 8, dtype=torch.uint8)
    _kernels().gc_pack(_ptr(codes), n, bits, _ptr(out), _threads(n))
    return out


def unpack(packed: torch.Tensor, bits: int, n: int) -> torch.Tensor:
    """packing.unpack of a contiguous uint8 tensor of at least ceil(n * bits / 8) bytes."""
    out = torch.empty(n, dtype=torch.uint8)
    _kernels().gc_unpack(_ptr(packed), n, bits, _ptr(out), _threads(n))
    return out


# ----------------------------------------------------------------------------- sparsifiers
_SALT_DGC = 2
_SALT_TOPK = 3
TOPK_SAMPLE = 1 << 16  # sampled magnitudes behind top-k's candidate threshold


def abs_key(value: float) -> int:
    """The order key of |value| as float32 (NaN above +Inf)."""
    return int(torch.tensor([value], dtype=torch.float32).view(torch.int32).item()) & 0x7FFFFFFF


def sampled_key(x: torch.Tensor, m: int, r: int, key: int) -> int:
    """The r-th largest |x| key among m positions drawn uniformly (with replacement) from the stream of key."""
    keys = torch.empty(m, dtype=torch.int32)
    lib = _kernels()
    lib.gc_sample_keys(_ptr(x), x.numel(), m, key, _ptr(keys), _threads(m))
    return int(lib.gc_kth_largest(_ptr(keys), m, r))  # a Python int already (c_uint32 result)


def collect(x: torch.Tensor, tkey: int) -> torch.Tensor:
    """Ascending int32 positions i with !(|x_i| < t), t the float32 of key tkey (NaN always kept)."""
    lib = _kernels()
    handle = lib.gc_collect(_ptr(x), x.numel(), tkey, _threads(x.numel()))
    if not handle:
        raise MemoryError("fast.collect: out of memory")
    out = torch.empty(lib.gc_collected_size(handle), dtype=torch.int32)
    lib.gc_collected_finish(handle, _ptr(out))
    return out


def select_top(x: torch.Tensor, cand: torch.Tensor | None, k: int) -> torch.Tensor:
    """Exact top-k by |x| among ascending candidates (all of x when None); ties by position; ascending int32."""
    c = x.numel() if cand is None else cand.numel()
    k = min(k, c)
    out = torch.empty(k, dtype=torch.int32)
    got = _kernels().gc_select_top(_ptr(x), None if cand is None else _ptr(cand), c, k, _ptr(out))
    if got < 0:
        raise MemoryError("fast.select_top: out of memory")
    return out[:got]


def topk_indices(x: torch.Tensor, k: int) -> torch.Tensor:
    """Exact top-k by magnitude (NaN largest) of a float32 1-D tensor: k ascending int32 positions.

    A threshold from a sample (the magnitude with a few standard deviations more than the
    expected count of sampled values above it), every element at or above it collected in
    one pass (almost always k to 1.2 k of them), then the exact top-k among those. If the
    sample misled (fewer than k collected, or more than n/2 with ties), the exact top-k over all.
    """
    n = x.numel()
    if k >= n:
        return torch.arange(n, dtype=torch.int32)
    m = min(n, TOPK_SAMPLE)
    mu = m * k / n
    r = math.ceil(mu + 4 * math.sqrt(mu) + 8)
    if r < m:
        tkey = sampled_key(x, m, r, stream_key(n, _SALT_TOPK))
        if tkey > 0:
            cand = collect(x, tkey)
            if k <= cand.numel() <= n // 2:  # candidates + their keys: at most one float32 buffer
                return select_top(x, cand, k)
            del cand
    return select_top(x, None, k)


_SALT_RANDOMK = 4
_RANDK_ROUNDS = 6  # RANDK_ROUNDS of the kernel


def _signed64(v: int) -> int:
    return v - (1 << 64) if v >= 1 << 63 else v


def _mix64_tensor(z: torch.Tensor) -> torch.Tensor:
    """_mix64 on int64 tensors (two's complement wrap-around; shifts made logical by masking)."""
    z = (z ^ ((z >> 30) & ((1 << 34) - 1))) * _signed64(0xBF58476D1CE4E5B9)
    z = (z ^ ((z >> 27) & ((1 << 37) - 1))) * _signed64(0x94D049BB133111EB)
    return z ^ ((z >> 31) & ((1 << 33) - 1))


def _random_positions_torch(n: int, k: int, key: int, device: torch.device) -> torch.Tensor:
    """gc_random_positions in torch integer operations (any device; the same values), without a host sync: the
    permutation of one span of inputs [0, s), the first k of its outputs below n kept (``nonzero_static``). A prefix
    of s inputs holds about s n / 2^b such outputs; s is the expected need + 16 standard deviations + 1024 (a
    shortfall, some 1e-57 likely, stops the run: ``_assert_async``), at most 2^b (which holds exactly n)."""
    b = max(1, (n - 1).bit_length())
    lo = b // 2
    mlo, mhi = (1 << lo) - 1, (1 << (b - lo)) - 1
    keys = [_signed64(_mix64(key + (r + 1) * _GOLDEN)) for r in range(_RANDK_ROUNDS)]
    need = -(-k * (1 << b) // n)
    span = min(1 << b, need + 16 * math.isqrt(need) + 1024)
    i = torch.arange(span, dtype=torch.int64, device=device)
    hi, low = i >> lo, i & mlo
    for r in range(0, _RANDK_ROUNDS, 2):
        low = low ^ (_mix64_tensor(hi + keys[r]) & mlo)
        hi = hi ^ (_mix64_tensor(low + keys[r + 1]) & mhi)
    p = (hi << lo) | low
    below = p < n
    torch._assert_async(below.sum() >= k, "fast.random_positions: too few positions in the span")
    return torch.sort(p[torch.nonzero_static(below, size=k).view(-1)]).values


def random_positions(n: int, k: int, seed: int, device: torch.device | str | None = None) -> torch.Tensor:
    """k distinct int64 positions in [0, n) drawn from ``seed``, ascending, the same on every machine and device.

    The first k values below n of a keyed pseudo-random permutation of [0, 2^b), 2^b the least
    power of two >= n (a 6-round Feistel network whose round function is SplitMix64's mix),
    applied to 0, 1, 2, ...: about 2k hashes, no O(n) ``randperm``; then put in ascending order (an
    n-bit map), so that gathering and scattering the kept values streams through memory.
    """
    if not 0 <= k <= n:
        raise ValueError(f"random_positions: need 0 <= k <= n, got k={k}, n={n}")
    key = stream_key(seed, _SALT_RANDOMK)
    device = torch.device("cpu") if device is None else torch.device(device)
    lib = library() if device.type == "cpu" and enabled() else None
    if lib is not None:
        out = torch.empty(k, dtype=torch.int64)
        if k and lib.gc_random_positions(n, k, key, _ptr(out), _threads(k)) < 0:
            raise MemoryError("fast.random_positions: out of memory")
        return out
    return _random_positions_torch(n, k, key, device)


def dgc_indices(x: torch.Tensor, k: int, m: int, kth: int, seed: int) -> torch.Tensor:
    """DGC's selection (see :class:`gradcompress.codecs.sparse.DGC`) with the sample drawn from the seed's stream."""
    n = x.numel()
    tkey = sampled_key(x, m, kth, stream_key(seed, _SALT_DGC))
    if tkey == 0:  # every element is at or above the threshold (and n > 2k): the top-k of all
        return select_top(x, None, k)
    cand = collect(x, tkey)
    if cand.numel() > 2 * k:
        if cand.numel() > n // 2:  # the same k (all above the threshold), with less memory
            del cand
            return select_top(x, None, k)
        return select_top(x, cand, k)
    if 2 * cand.numel() < k:
        return topk_indices(x, k)
    return cand
