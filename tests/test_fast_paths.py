"""The fast codec paths (fused C++ kernels, :mod:`gradcompress.codecs.fast`) against the reference paths.

Deterministic codecs must give the same codes as the plain-torch reference; stochastic
ones the same distribution (unbiased, the exact variance of stochastic rounding, codes on
the two neighbouring levels), not the same bits. Also: the switch, the fallback without
a compiler (one warning, reference results), non-CPU tensors, small shapes (with
``MIN_NUMEL`` lowered) and the peak memory of an encode.
"""

from __future__ import annotations

import math
import os
import warnings

import pytest
import torch

from fast_common import DETERMINISTIC, N, STOCHASTIC, big_input, decode_ref, encode_both, gen
from gradcompress import make
from gradcompress.codecs import fast
from gradcompress.codecs.packing import pack, unpack



# --------------------------------------------------------------------------- switch and fallback
def test_switch(monkeypatch):
    x = torch.zeros(N)
    monkeypatch.setattr(fast, "_override", None)
    monkeypatch.setenv(fast.ENV_VAR, "0")
    assert not fast.enabled() and not fast.applies(x)
    monkeypatch.setenv(fast.ENV_VAR, "1")
    assert fast.enabled()
    with fast.use(False):
        assert not fast.enabled()
        with fast.use(True):
            assert fast.enabled()
        assert not fast.enabled()
    assert fast.enabled()
    assert not fast.applies(torch.zeros(fast.MIN_NUMEL - 1))  # small tensors: reference path


def test_non_cpu_tensors_take_the_reference_path():
    x = torch.empty(N, device="meta")
    assert not fast.applies(x)
    codes, scale = torch.empty(N, dtype=torch.int8, device="meta"), torch.empty(-(-N // 512), device="meta")
    assert not fast.dequantize_ok(codes, scale, N, 512, 8, torch.int8)


def test_no_compiler_falls_back_with_one_warning(monkeypatch):
    monkeypatch.setattr(fast, "_lib", None)
    monkeypatch.setattr(fast, "_failure", None)
    monkeypatch.setattr(fast, "_compiler", lambda: None)
    x = big_input(wide=False)
    codec = make("int8")
    with fast.use(True):
        with pytest.warns(RuntimeWarning, match="fast codec kernels unavailable"):
            p = codec.encode(x, seed=0)
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # no second warning
            p2 = codec.encode(x, seed=0)
            y = codec.decode(p2)
    assert fast.failure() and "compiler" in fast.failure()
    with fast.use(False):
        ref = codec.encode(x, seed=0)
    assert all(torch.equal(a, b) for a, b in zip(p.tensors, ref.tensors))
    assert torch.equal(y, decode_ref(codec, ref))


def test_failed_build_falls_back(monkeypatch, tmp_path):
    if fast._compiler() is None:
        pytest.skip("no compiler")
    bad = tmp_path / "bad.cpp"
    bad.write_text("this is not C++\n")
    monkeypatch.setattr(fast, "_lib", None)
    monkeypatch.setattr(fast, "_failure", None)
    monkeypatch.setattr(fast, "SOURCE", bad)
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "ext"))
    with pytest.warns(RuntimeWarning, match="fast codec kernels unavailable"):
        assert fast.library() is None
    with fast.use(True):
        assert not fast.applies(big_input(wide=False))
        p = make("topk").encode(big_input(wide=False))
    assert p.tensors[-1].numel() == math.ceil(0.01 * N)


# --------------------------------------------------------------------------- deterministic quantisers


@pytest.mark.parametrize("spec", DETERMINISTIC)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_deterministic_quantisers_same_codes(lib, spec, dtype):
    codec = make(spec)
    x = big_input(dtype=dtype, wide=dtype == torch.float32)
    assert fast.applies(x)
    pf, pr = encode_both(codec, x)
    assert [(t.dtype, t.shape) for t in pf.tensors] == [(t.dtype, t.shape) for t in pr.tensors]
    codes_f, scale_f = pf.tensors
    codes_r, scale_r = pr.tensors
    assert torch.equal(codes_f, codes_r)
    if codec.name == "sign":  # mean |x| summed in float64 here, in float32 by torch
        assert torch.allclose(scale_f, scale_r, rtol=1e-5, atol=0)
    else:
        assert torch.equal(scale_f, scale_r)
    # decode: the same values from the same payload, and the same for both payloads up to the scale
    assert torch.equal(codec.decode(pr), decode_ref(codec, pr))
    assert torch.allclose(codec.decode(pf).float(), decode_ref(codec, pr).float(), rtol=1e-5, atol=0)


# --------------------------------------------------------------------------- fused error feedback
FEEDBACK = ["int8", "int4", "int4:bucket=64", "int8:bucket=7", "sign", "sign:bucket=64", "int8:stochastic=true",
            "qsgd", "terngrad"]


def equal_nan(a: torch.Tensor, b: torch.Tensor) -> bool:
    """The same values (NaN where NaN; -0.0 and +0.0 count as equal, as torch.equal does)."""
    return a.shape == b.shape and torch.equal(torch.nan_to_num(a, nan=7.5), torch.nan_to_num(b, nan=7.5)) and \
        torch.equal(a.isnan(), b.isnan())


@pytest.mark.parametrize("spec", ["int8", "int4", "sign", "int8:stochastic=true"])
@pytest.mark.parametrize("alias", ["fresh", "residual"])
def test_fused_error_feedback_bfloat16_residual(lib, spec, alias):
    """A bfloat16 residual read and written by the kernel == the reference: y = x + r.float(), the new residual
    (y - decode).to(bfloat16) (round to nearest even, NaN kept)."""
    codec = make(spec)
    x = big_input(seed=7)
    x[300:305] = float("nan")
    r = (big_input(seed=8, wide=False) * 0.1).to(torch.bfloat16)
    ref_out = torch.empty(N, dtype=torch.bfloat16)
    ref = type(codec).__mro__[-2].encode_feedback(codec, x.clone(), r.clone(), seed=4, out=ref_out)
    rs = r.clone()
    out = torch.empty(N, dtype=torch.bfloat16) if alias == "fresh" else rs
    got = codec.encode_feedback(x.clone(), rs, seed=4, out=out)
    for a, b in zip(got.tensors, ref.tensors):
        assert equal_nan(a, b)
    assert equal_nan(out.float(), ref_out.float()) and ref_out.isnan().any()


@pytest.mark.parametrize("spec", FEEDBACK)
@pytest.mark.parametrize("alias", ["fresh", "x", "residual"])
@pytest.mark.parametrize("with_residual", [True, False])
def test_fused_error_feedback_is_the_reference(lib, spec, alias, with_residual):
    """``encode_feedback``'s one pass == the reference: y = x + r materialised, encode, full decode, y - decode
    (the same codes and scales, the same new residual bit for bit), wherever ``out`` points."""
    codec = make(spec)
    x = big_input(seed=1)
    x[5000:5010] = float("nan")  # a non-finite bucket: NaN scale, NaN residual in both
    x[9000] = float("inf")
    r = big_input(seed=2, wide=False) * 0.1 if with_residual else None
    ref_out = torch.empty(N)
    ref = type(codec).__mro__[-2].encode_feedback(codec, x.clone(), None if r is None else r.clone(), seed=5,
                                                  out=ref_out)
    xs, rs = x.clone(), None if r is None else r.clone()
    if alias == "residual" and rs is None:
        pytest.skip("no residual to alias")
    out = {"fresh": torch.empty(N), "x": xs, "residual": rs}[alias]
    got = codec.encode_feedback(xs, rs, seed=5, out=out)
    assert len(got.tensors) == len(ref.tensors)
    for a, b in zip(got.tensors, ref.tensors):
        assert a.dtype == b.dtype and equal_nan(a, b)
    assert equal_nan(out, ref_out) and ref_out.isnan().any()


@pytest.mark.parametrize("spec", ["topk:ratio=0.01", "topk:ratio=0.3,values=int8", "topk:ratio=0.6", "topk:ratio=1",
                                  "threshold:value=1.0", "dgc:ratio=0.05,masking=false"])
@pytest.mark.parametrize("alias", ["fresh", "x", "residual", "no residual"])
def test_sparse_error_feedback_is_the_reference(lib, spec, alias):
    """Sparsifiers: y = x + r written once (top-k: in its collection pass), only the kept entries changed
    afterwards == y - dense decode; also through top-k's fallbacks (k > n/2: the exact top-k of all; k = n)."""
    codec = make(spec)
    x, r = big_input(seed=5), big_input(seed=6, wide=False)
    x[100:103] = float("nan")
    if alias == "no residual":
        r = None
    ref_out = torch.empty(N)
    ref = type(codec).__mro__[-2].encode_feedback(codec, x.clone(), None if r is None else r.clone(), seed=2,
                                                  out=ref_out)
    xs, rs = x.clone(), None if r is None else r.clone()
    out = {"fresh": torch.empty(N), "x": xs, "residual": rs, "no residual": torch.empty(N)}[alias]
    got = codec.encode_feedback(xs, rs, seed=2, out=out)
    for a, b in zip(got.tensors, ref.tensors):
        assert a.dtype == b.dtype and equal_nan(a, b)
    assert equal_nan(out, ref_out)


@pytest.mark.parametrize("spec", FEEDBACK)
def test_decode_into_and_accumulate_into(lib, spec):
    codec = make(spec)
    x = big_input(seed=3)
    p = codec.encode(x, seed=1)
    ref = codec.decode(p).float()
    out = torch.full((N,), 3.0)
    codec.decode_into(p, out)
    assert torch.equal(out, ref)
    acc = big_input(seed=4, wide=False)
    want = acc + ref
    codec.accumulate_into(p, acc)
    assert torch.equal(acc, want)


LARGE = (1 << 20) + 37  # a decode or residual of >= 4 MiB: written with streaming stores (fast.cpp's STREAM_MIN_BYTES)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """The same dtype, shape and bits (-0.0 differs from 0.0; NaN payloads compared)."""
    ints = {4: torch.int32, 2: torch.int16, 1: torch.int8}[a.element_size()]
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.contiguous().view(ints), b.contiguous().view(ints))


@pytest.mark.parametrize("spec", ["int8", "int4", "int8:bucket=7", "int8:stochastic=true", "qsgd", "terngrad"])
@pytest.mark.parametrize("alias", ["fresh", "x", "residual", "shifted"])
def test_large_outputs_streamed_are_the_reference(lib, spec, alias):
    """Large residuals and decodes (streaming stores, from any alignment; the int8 encode's own loop) ==
    the reference bit for bit."""
    codec = make(spec)
    x = big_input(LARGE, seed=11)
    x[70000:70003] = float("nan")
    r = big_input(LARGE, seed=12, wide=False) * 0.1
    ref_out = torch.empty(LARGE)
    ref = type(codec).__mro__[-2].encode_feedback(codec, x.clone(), r.clone(), seed=5, out=ref_out)
    xs, rs = x.clone(), r.clone()
    room = torch.zeros(LARGE + 3)
    out = {"fresh": torch.empty(LARGE), "x": xs, "residual": rs, "shifted": room[1 : 1 + LARGE]}[alias]
    got = codec.encode_feedback(xs, rs, seed=5, out=out)
    for a, b in zip(got.tensors, ref.tensors):
        assert same_bits(a, b)
    assert same_bits(out, ref_out)
    with fast.use(False):
        want = codec.decode(ref)
    assert same_bits(codec.decode(got), want)
    into = torch.full((LARGE + 5,), 0.5)
    codec.decode_into(got, into[3 : 3 + LARGE])
    assert same_bits(into[3 : 3 + LARGE], want) and (into[:3] == 0.5).all() and (into[-2:] == 0.5).all()


@pytest.mark.parametrize("spec", FEEDBACK + ["int4:stochastic=true", "qsgd:levels=100"])
@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_mean_into_is_decode_accumulate_divide(lib, spec, world):
    """``mean_into`` (one kernel pass) == decode_into, accumulate_into in order, div_ (the chunk owner's mean)."""
    from gradcompress.codecs.base import Codec

    codec = make(spec)
    payloads = [codec.encode(big_input(seed=20 + i, wide=i % 2 == 0) * 10.0 ** -i, seed=i) for i in range(world)]
    want = torch.full((N,), 0.5)
    Codec.mean_into(codec, payloads, want, world)
    got = torch.full((N,), -1.0)
    codec.mean_into(payloads, got, world)
    assert same_bits(got, want)


@pytest.mark.parametrize("spec", FEEDBACK + ["int4:stochastic=true", "qsgd:levels=100", "int8:bucket=100"])
@pytest.mark.parametrize("world", [1, 2, 3])
@pytest.mark.parametrize("offset", [0, 512 * 3])
def test_encode_mean_piece_is_mean_then_encode(lib, spec, world, offset):
    """``encode_mean_piece`` (the mean made and re-encoded bucket by bucket, never stored) == mean_into a buffer,
    then encode_piece of it: the same codes and scales, stochastic noise at the same element offsets."""
    codec = make(spec)
    if not codec.slices_by_bucket():
        pytest.skip("not a bucket-sliced codec")
    offset = offset // 512 * codec.bucket
    payloads = [codec.encode(big_input(seed=30 + i) * 10.0 ** -i, seed=i) for i in range(world)]
    dtype, count = codec.code_layout(N)
    buckets = -(-N // codec.bucket)
    mean = torch.empty(N)
    codec.mean_into(payloads, mean, world)
    want_codes, want_scales = torch.zeros(count, dtype=dtype), torch.zeros(buckets)
    codec.encode_piece(mean, None, None, want_codes, want_scales, 9, offset)
    codes, scales = torch.ones(count, dtype=dtype), torch.ones(buckets)
    codec.encode_mean_piece([p.tensors for p in payloads], N, world, codes, scales, 9, offset)
    assert same_bits(codes, want_codes) and same_bits(scales, want_scales)
    with fast.use(False):  # the reference composition where no kernel applies
        codes2, scales2 = torch.ones(count, dtype=dtype), torch.ones(buckets)
        codec.encode_mean_piece([p.tensors for p in payloads], N, world, codes2, scales2, 9, offset)
        mean2 = torch.empty(N)
        codec.mean_into(payloads, mean2, world)
        want2_codes, want2_scales = torch.zeros(count, dtype=dtype), torch.zeros(buckets)
        codec.encode_piece(mean2, None, None, want2_codes, want2_scales, 9, offset)
    assert same_bits(codes2, want2_codes) and same_bits(scales2, want2_scales)


def test_empty_outputs_on_huge_pages(monkeypatch):
    """``fast.empty``: an ordinary uninitialised tensor (the advice changes no value); small ones untouched."""
    big = fast.empty((1500, 1031))
    assert big.shape == (1500, 1031) and big.dtype == torch.float32 and big.is_contiguous()
    big.fill_(2.0)
    assert (big == 2.0).all()
    assert fast.empty(10, torch.int8).shape == (10,)
    monkeypatch.setenv(fast.HUGE_ENV_VAR, "0")
    assert fast.empty(3 << 20).numel() == 3 << 20


@pytest.mark.parametrize("spec", ["int8", "int4", "sign", "int8:stochastic=true", "qsgd", "terngrad", "qsgd:levels=100"])
def test_quantisers_nonfinite(lib, spec):
    codec = make(spec)
    x = big_input(wide=False)
    bad_buckets = {3: float("nan"), 7: float("inf"), 11: float("-inf")}
    for b, v in bad_buckets.items():
        x[b * 512 + 17] = v
    y = codec.decode(codec.encode(x, seed=1)).view(-1)
    ref = decode_ref(codec, codec.encode(x, seed=1))
    for b in range(-(-N // 512)):
        yb = y[b * 512 : (b + 1) * 512]
        if b in bad_buckets:
            assert not torch.isfinite(yb).all(), (spec, b)
        else:
            assert torch.isfinite(yb).all(), (spec, b)
            assert torch.equal(yb, ref[b * 512 : (b + 1) * 512])  # decoding the same payload


# --------------------------------------------------------------------------- small shapes (MIN_NUMEL lowered)
SMALL_NS = [1, 2, 5, 7, 8, 9, 63, 511, 512, 513, 1000, 4097]


@pytest.mark.parametrize("spec", DETERMINISTIC + STOCHASTIC)
def test_small_tensors_on_the_fast_path(lib, spec, monkeypatch):
    monkeypatch.setattr(fast, "MIN_NUMEL", 1)
    codec = make(spec)
    for n in SMALL_NS:
        x = torch.randn(n, generator=gen(n))
        assert fast.applies(x)
        pf, pr = encode_both(codec, x)
        assert [(t.dtype, t.shape) for t in pf.tensors] == [(t.dtype, t.shape) for t in pr.tensors], (spec, n)
        if not codec.stochastic:
            assert torch.equal(pf.tensors[0], pr.tensors[0]), (spec, n)
            assert torch.allclose(pf.tensors[1], pr.tensors[1], rtol=1e-5, atol=0)
        y = codec.decode(pf)
        assert y.shape == x.shape and torch.isfinite(y).all()
        assert torch.equal(codec.decode(pr), decode_ref(codec, pr)), (spec, n)
        assert torch.equal(codec.decode(codec.encode(torch.zeros(n))), torch.zeros(n))


# --------------------------------------------------------------------------- sparsifiers
def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equality (NaN included)."""
    ints = {2: torch.int16, 4: torch.int32, 8: torch.int64}
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(ints[a.element_size()]),
                                                                     b.view(ints[b.element_size()]))


def keys(x: torch.Tensor) -> torch.Tensor:
    """Order keys of |x| (float32 bits without the sign; NaN above Inf), as int64."""
    return (x.float().contiguous().view(torch.int32).long() & 0x7FFFFFFF)


def generated(kind: str, n: int, seed: int) -> torch.Tensor:
    g = gen(seed)
    if kind == "gaussian":
        return torch.randn(n, generator=g)
    if kind == "ties":
        return torch.randint(-3, 4, (n,), generator=g).float()
    if kind == "sparse":
        return torch.randn(n, generator=g) * (torch.rand(n, generator=g) < 0.02)
    if kind == "cauchy":
        return torch.empty(n).cauchy_(generator=g)
    if kind == "nonfinite":
        x = torch.randn(n, generator=g)
        x[n // 3], x[n // 2], x[-1] = float("nan"), float("inf"), float("-inf")
        return x
    raise AssertionError(kind)


KINDS = ["gaussian", "ties", "sparse", "cauchy", "nonfinite"]


def check_exact_topk(x: torch.Tensor, idx: torch.Tensor, ref_idx: torch.Tensor, k: int):
    flat = x.reshape(-1)
    assert idx.dtype == torch.int32 and idx.numel() == k
    assert torch.equal(idx, idx.sort().values) and idx.unique().numel() == k  # ascending, no position twice
    kf, kr = keys(flat[idx.long()]), keys(flat[ref_idx.long()])
    assert torch.equal(kf.sort().values, kr.sort().values)  # the same multiset of magnitudes: exact top-k
    if k < flat.numel():
        dropped = torch.ones(flat.numel(), dtype=torch.bool)
        dropped[idx.long()] = False
        assert kf.min() >= keys(flat[dropped]).max()


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("ratio", [1e-4, 0.01, 0.1, 0.5, 0.9, 1.0])
def test_topk_exact(lib, kind, ratio):
    x = generated(kind, N, seed=int(ratio * 1e4))
    codec = make(f"topk:ratio={ratio}")
    pf, pr = encode_both(codec, x)
    k = min(N, max(1, math.ceil(ratio * N)))
    check_exact_topk(x, pf.tensors[1], pr.tensors[1], k)
    assert same(pf.tensors[0], x[pf.tensors[1].long()])  # values as they are, in the input's dtype
    if kind == "gaussian":  # no tie at the k-th magnitude: the very same positions and decode
        assert torch.equal(pf.tensors[1], pr.tensors[1].sort().values.int())
        assert same(codec.decode(pf), decode_ref(codec, pr))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_topk_exact_half_precision(lib, dtype):
    x = generated("cauchy", N, seed=1).to(dtype)  # many equal magnitudes
    pf, pr = encode_both(make("topk:ratio=0.03"), x)
    check_exact_topk(x, pf.tensors[1], pr.tensors[1], math.ceil(0.03 * N))
    assert pf.tensors[0].dtype == dtype


def test_topk_hybrid_values(lib):
    x = generated("gaussian", 4 * N, seed=2)
    codec = make("topk:ratio=0.25,values=int8")
    pf, pr = encode_both(codec, x)
    idx = pf.tensors[-1]
    check_exact_topk(x, idx, pr.tensors[-1], N)
    inner = make("int8").encode(x[idx.long()], seed=0)  # the kept values in ascending position order, int8-coded
    assert all(torch.equal(a, b) for a, b in zip(pf.tensors[:-1], inner.tensors))
    y = codec.decode(pf)
    assert (y[idx.long()] - x[idx.long()]).abs().max() <= x.abs().max() / 127


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("spec", ["dgc", "dgc:ratio=0.1,sample=0.1", "dgc:ratio=0.001,sample=0.001", "dgc:ratio=0.6"])
def test_dgc_selection(lib, kind, spec):
    codec = make(spec)
    x = generated(kind, N, seed=7)
    k = min(N, max(1, math.ceil(codec.ratio * N)))
    for seed in range(3):
        p = codec.encode(x, seed=seed)
        vals, idx = p.tensors
        kept = idx.numel()
        assert k / 2 <= kept <= 2 * k, (kept, k)
        assert torch.equal(idx, idx.sort().values) and idx.unique().numel() == kept
        assert same(vals, x[idx.long()])
        dropped = torch.ones(N, dtype=torch.bool)
        dropped[idx.long()] = False
        if dropped.any():
            assert keys(vals).min() >= keys(x[dropped]).max()
        assert all(same(a, b) for a, b in zip(p.tensors, codec.encode(x, seed=seed).tensors))
        y = codec.decode(p)
        assert same(y[idx.long()], vals) and (y[dropped] == 0).all()


def test_dgc_kept_count_distribution(lib):
    """The sampled threshold: the kept counts of both paths have the same distribution (mean over seeds)."""
    codec = make("dgc:ratio=0.1,sample=0.1")
    x = generated("gaussian", N, seed=8)
    counts = {}
    for path in (True, False):
        with fast.use(path):
            counts[path] = torch.tensor([codec.encode(x, seed=s).tensors[1].numel() for s in range(16)]).double()
    k = math.ceil(0.1 * N)
    for path in (True, False):
        assert abs(counts[path].mean() / k - 1) < 0.05, counts  # about k: relative sd per draw 1/sqrt(700)
    assert abs(counts[True].mean() / counts[False].mean() - 1) < 0.05
    assert abs(counts[True].std() / counts[False].std() - 1) < 1.0


@pytest.mark.parametrize("value", [0.0, 1e-3, 0.5, 1.0 + 1e-9, 2.0, float("inf")])
def test_threshold_same_selection(lib, value):
    codec = make(f"threshold:value={value}")
    x = generated("nonfinite", N, seed=9)
    x[5] = -0.5
    pf, pr = encode_both(codec, x)
    assert all(same(a, b) for a, b in zip(pf.tensors, pr.tensors))
    assert same(codec.decode(pf), decode_ref(codec, pr))
    # float16 input compares in float16 on the reference path: reference there
    xh = x.half()
    assert not fast.applies(xh, (torch.float32,))


@pytest.mark.parametrize("spec", ["topk:ratio=0.01", "topk:ratio=0.3", "topk:ratio=0.01,values=int8", "dgc:ratio=0.1",
                                  "threshold:value=1"])
def test_small_sparse_inputs_on_the_fast_path(lib, spec, monkeypatch):
    monkeypatch.setattr(fast, "MIN_NUMEL", 1)
    codec = make(spec)
    for kind in KINDS:
        for n in SMALL_NS:
            x = generated(kind, n, seed=n)
            pf, pr = encode_both(codec, x)
            idx, ref_idx = pf.tensors[-1], pr.tensors[-1]
            if codec.name == "topk":
                check_exact_topk(x, idx, ref_idx, min(n, max(1, math.ceil(codec.ratio * n))))
            elif codec.name == "threshold":
                assert torch.equal(idx, ref_idx.int())
            y = codec.decode(pf)
            assert y.shape == x.shape
            if codec.values is None:
                assert same(y[idx.long()], x[idx.long()])


# --------------------------------------------------------------------------- packing
@pytest.mark.parametrize("bits", range(1, 9))
def test_pack_fast_path_same_bytes(lib, bits):
    for n in (fast.MIN_NUMEL, N, 3 * N + 5):
        codes = torch.randint(0, 2**bits, (n,), generator=gen(n + bits), dtype=torch.uint8)
        packed = pack(codes, bits)
        with fast.use(False):
            ref = pack(codes, bits)
            assert torch.equal(unpack(ref, bits, n), codes)
        assert torch.equal(packed, ref)
        assert torch.equal(unpack(packed, bits, n), codes)
        assert torch.equal(unpack(packed, bits, n - 3), codes[: n - 3])  # a prefix


# --------------------------------------------------------------------------- peak memory
def _peak_extra_bytes(fn) -> int:
    """Peak resident set growth while fn runs (Linux: VmHWM after resetting it)."""

    def status(field):
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field):
                    return int(line.split()[1]) * 1024
        raise AssertionError(field)

    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset the high-water mark to the current RSS
    before = status("VmRSS:")
    out = fn()
    return status("VmHWM:") - before, out


@pytest.mark.skipif(not os.path.exists("/proc/self/clear_refs"), reason="needs Linux /proc")
@pytest.mark.parametrize("spec", ["int8", "int4:stochastic=true", "qsgd", "terngrad", "sign", "topk:ratio=0.01", "topk:ratio=0.4",
                                  "dgc:ratio=0.01", "topk:ratio=0.01,values=int8", "threshold:value=1"])
def test_encode_peak_memory(lib, spec):
    """An encode needs at most one float32 buffer of the input's size besides its output (here: none)."""
    n = 1 << 24
    x = torch.randn(n, generator=gen(0))
    codec = make(spec)
    codec.encode(x, seed=0)  # warm up
    try:
        extra, p = _peak_extra_bytes(lambda: codec.encode(x, seed=0))
    except OSError:
        pytest.skip("cannot reset the high-water mark")
    assert extra <= p.nbytes + 4 * n, (spec, extra / 4 / n)
