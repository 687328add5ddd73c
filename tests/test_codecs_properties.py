"""Statistical and structural properties of the codecs.

Every random draw comes from a fixed seed (Monte Carlo runs use seeds 0..N-1, hypothesis
runs are derandomized), so the file is deterministic. Tolerances come from the empirical
standard error of each Monte Carlo estimate; negative controls show each check can fail.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

import gradcompress
from gradcompress.codecs import fast
from gradcompress import make
from gradcompress.codecs import quantize


def hsettings(max_examples: int) -> settings:
    """Deterministic hypothesis runs: fixed example stream, no deadline."""
    return settings(deadline=None, derandomize=True, max_examples=max_examples,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


EXTRA_SPECS = ["topk:ratio=0.01,values=int8", "int8:stochastic=true", "int4:stochastic=true",
               "randomk:scale=true", "qsgd:levels=4", "qsgd:levels=300", "dgc:ratio=0.1"]
ALL_SPECS = gradcompress.available() + EXTRA_SPECS


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def sample_input(n: int = 1124, seed: int = 0) -> torch.Tensor:
    """Gaussian values with magnitudes varying by ~15x; 1124 = two full buckets of 512 + a partial one."""
    g = gen(seed)
    return torch.randn(n, generator=g) * (0.2 + 3 * torch.rand(n, generator=g))


# --------------------------------------------------------------------------- Monte Carlo helpers
def monte_carlo(codec, x: torch.Tensor, n_samples: int, seed0: int = 0):
    """Elementwise mean and (unbiased) variance of decode(encode(x, seed)) over seeds seed0.. (float64)."""
    s = torch.zeros(x.numel(), dtype=torch.float64)
    s2 = torch.zeros_like(s)
    for i in range(n_samples):
        y = codec.decode(codec.encode(x, seed=seed0 + i)).double().reshape(-1)
        s += y
        s2 += y * y
    mean = s / n_samples
    var = (s2 / n_samples - mean * mean).clamp_min(0) * n_samples / (n_samples - 1)
    return mean, var


def bias_ratios(x: torch.Tensor, mean: torch.Tensor, var: torch.Tensor, n_samples: int, chunk: int = 512):
    """Per chunk of ``chunk`` elements: ||mean - x||^2 / (sum of squared standard errors).

    For an unbiased codec ||mean - x||^2 is a sum of ``chunk`` squared errors each with
    expectation var_i / N, so the ratio is about 1 (a chi-square / chunk, standard
    deviation about sqrt(2 / chunk) = 0.06). A small eps (float32 rounding of decode)
    keeps exact-but-rounded codecs from dividing by zero.

    This is the "|mean - x| <= c * stderr" check taken on the norm of each chunk rather
    than elementwise: elementwise z-scores are unreliable for elements whose rounding
    probability is tiny (qsgd:levels=1 sees no round-up in 2000 draws, stderr 0), and an
    elementwise 5-sigma + eps check is too weak to see round-to-nearest int8's bias, which
    this statistic rejects (test_negative_control_random_input_deterministic_codecs).
    """
    xd = x.double().reshape(-1)
    eps = 1e-6 * xd.abs().max().item()
    out = []
    for a in range(0, xd.numel(), chunk):
        b = min(a + chunk, xd.numel())
        err2 = ((mean[a:b] - xd[a:b]) ** 2).sum().item()
        se2 = var[a:b].sum().item() / n_samples + (b - a) * eps**2
        out.append(err2 / se2)
    return out


MAX_RATIO = 2.0  # ~16 standard deviations above the expected 1.0 for a full chunk, ~7 for the 100-element tail
N_MC = 2000


def is_unbiased(codec, x, n_samples=N_MC, seed0=0) -> tuple[bool, list[float]]:
    mean, var = monte_carlo(codec, x, n_samples, seed0)
    ratios = bias_ratios(x, mean, var, n_samples)
    return max(ratios) <= MAX_RATIO, ratios


# --------------------------------------------------------------------------- unbiasedness
UNBIASED = ["qsgd", "qsgd:levels=1", "qsgd:levels=4", "terngrad", "int8:stochastic=true", "int4:stochastic=true",
            "randomk:scale=true", "randomk:ratio=0.2,scale=true", "int4:stochastic=true,bucket=100"]


@pytest.mark.parametrize("spec", UNBIASED)
def test_unbiased(spec):
    x = sample_input()
    ok, ratios = is_unbiased(make(spec), x)
    assert ok, (spec, ratios)


def test_negative_control_deterministic_int4():
    """int4 round-to-nearest is biased: on values sitting at 0.4 of a step it always sends 0."""
    x = torch.full((1124,), 0.4)
    x[::2] *= -1
    x[::512] = 7.0  # abs-max of each bucket: step = 1
    codec = make("int4")
    ok, ratios = is_unbiased(codec, x, n_samples=50)
    assert not ok and min(ratios) > 1e6
    # the same x passes with stochastic rounding
    ok, ratios = is_unbiased(make("int4:stochastic=true"), x)
    assert ok, ratios


def test_negative_control_random_input_deterministic_codecs():
    """Even the small bias of round-to-nearest int8 (at most half a step, random sign) is detected."""
    for spec in ("int8", "int4", "sign"):
        ok, ratios = is_unbiased(make(spec), sample_input(), n_samples=50)
        assert not ok, (spec, ratios)


def test_negative_control_stochastic_but_biased():
    """A stochastic codec with a bias is caught despite its variance: randomk without n/k scaling."""
    ok, ratios = is_unbiased(make("randomk:ratio=0.2"), sample_input())
    assert not ok and min(ratios) > 100, ratios


@pytest.mark.parametrize("spec", ["int8:stochastic=true", "qsgd", "terngrad"])
def test_negative_control_slightly_biased_noise(spec, monkeypatch):
    """Rounding noise drawn from [0, 0.9) instead of [0, 1) (a plausible bug) makes the check fail."""
    original = quantize.uniform_noise
    monkeypatch.setattr(quantize, "uniform_noise", lambda *a, **k: original(*a, **k) * 0.9)
    ok, ratios = is_unbiased(make(spec), sample_input())
    assert not ok, (spec, ratios)


def _buckets_of(x: torch.Tensor, bucket: int) -> torch.Tensor:
    """float64 (n_buckets, bucket), zero padded (not quantize.to_buckets: that one is float32)."""
    flat = x.reshape(-1).double()
    nb = -(-flat.numel() // bucket)
    return torch.nn.functional.pad(flat, (0, nb * bucket - flat.numel())).view(nb, bucket)


# --------------------------------------------------------------------------- QSGD variance
def qsgd_exact_variance(x: torch.Tensor, levels: int, bucket: int) -> torch.Tensor:
    """Per bucket: (norm/s)^2 * sum p_i (1 - p_i), p_i the fractional part of |x_i| s / norm (float64)."""
    xb = _buckets_of(x, bucket)
    norm = torch.linalg.vector_norm(xb, dim=1)
    y = xb.abs() * (levels / torch.where(norm > 0, norm, torch.ones_like(norm)))[:, None]
    frac = y - torch.floor(y)
    return (norm / levels) ** 2 * (frac * (1 - frac)).sum(dim=1)


def _qsgd_inputs():
    """(name, x, whether every element rounds up with a probability high enough for 200 draws to see it)."""
    g = gen(5)
    yield "gaussian", torch.randn(1300, generator=g), True
    yield "equal magnitudes", torch.where(torch.rand(1300, generator=g) < 0.5, -1.0, 1.0), True  # ~tight bound
    spiky = torch.randn(1300, generator=g) * 1e-3
    spiky[::97] = 10.0
    yield "spiky", spiky, False  # rare events: the small values round up with probability ~1e-4
    yield "heavy tailed", torch.empty(1300).cauchy_(generator=g).clamp(-1e4, 1e4), False


@pytest.mark.parametrize("levels", [1, 2, 4, 7, 16, 127])
@pytest.mark.parametrize("bucket", [512, 64])
def test_qsgd_variance_bound(levels, bucket):
    codec = make(f"qsgd:levels={levels},bucket={bucket}")
    n_samples = 200
    for what, x, well_sampled in _qsgd_inputs():
        n = x.numel()
        nb = -(-n // bucket)
        sizes = torch.tensor([min(bucket, n - i * bucket) for i in range(nb)], dtype=torch.float64)
        xb = _buckets_of(x, bucket)
        norm2 = (xb**2).sum(dim=1)
        bound = torch.minimum(sizes / levels**2, sizes.sqrt() / levels) * norm2

        err = torch.zeros(n_samples, nb, dtype=torch.float64)
        for i in range(n_samples):
            d = codec.decode(codec.encode(x, seed=i)).double() - x.double()
            err[i] = _buckets_of(d, bucket).pow(2).sum(dim=1)
        est = err.mean(dim=0)
        se = err.std(dim=0) / math.sqrt(n_samples)
        exact = qsgd_exact_variance(x, levels, bucket)
        slack = 1e-9 * norm2 + 1e-12
        # the theory: the exact variance is within the bound, and the codec's variance is the exact one
        assert (exact <= bound * (1 + 1e-9) + 1e-12).all(), what
        assert (est <= bound + 5 * se + slack).all(), (what, (est / bound).max())
        if well_sampled:
            assert ((est - exact).abs() <= 5 * se + 1e-6 * exact + slack).all(), (what, est, exact)


def test_qsgd_bound_nearly_tight():
    """Equal magnitudes with s = 1: E||Q(x)-x||^2 = (sqrt(n) - 1) ||x||^2 / s, near sqrt(n)/s ||x||^2."""
    x = torch.ones(512)
    codec = make("qsgd:levels=1")
    errs = [((codec.decode(codec.encode(x, seed=i)) - x) ** 2).sum().item() for i in range(400)]
    ratio = np.mean(errs) / (math.sqrt(512) * 512)
    assert 0.9 < ratio <= 1.0 + 5 * np.std(errs) / math.sqrt(400) / (math.sqrt(512) * 512)


# --------------------------------------------------------------------------- top-k / dgc contraction
def _sq(t: torch.Tensor) -> float:
    return float((t.double() ** 2).sum())


def _check_sparsifier(x: torch.Tensor, codec, seed: int):
    p = codec.encode(x, seed=seed)
    idx = p.tensors[-1].long()
    y = codec.decode(p).reshape(-1)
    flat = x.reshape(-1)
    d = flat.numel()
    assert idx.numel() == idx.unique().numel()  # no position twice
    kept_mask = torch.zeros(d, dtype=torch.bool)
    kept_mask[idx] = True
    # kept values are sent exactly, everything else decodes to zero
    assert torch.equal(y[kept_mask], flat[kept_mask].float())
    assert (y[~kept_mask] == 0).all()
    mag = flat.abs().double()
    if (~kept_mask).any():
        assert mag[kept_mask].min() >= mag[~kept_mask].max()
    kept = idx.numel()
    # contraction with the number of values actually kept (and >= that of the guaranteed minimum)
    assert _sq(flat - y) <= (1 - kept / d) * _sq(flat) * (1 + 1e-12) + 1e-300
    return kept


shapes = st.lists(st.integers(1, 24), min_size=0, max_size=4).filter(lambda s: math.prod(s) <= 4000)
BIG32 = float(np.float32(1e30))
finite32 = st.floats(-BIG32, BIG32, allow_nan=False, allow_infinity=False, width=32)


@hsettings(300)
@given(data=st.data(), ratio=st.floats(1e-3, 1.0))
def test_topk_contraction_hypothesis_values(data, ratio):
    shape = tuple(data.draw(shapes, label="shape"))
    arr = data.draw(hnp.arrays(np.float32, shape, elements=finite32), label="x")
    x = torch.from_numpy(np.ascontiguousarray(arr))
    codec = make(f"topk:ratio={ratio}")
    d = x.numel()
    k = min(d, max(1, math.ceil(ratio * d)))
    assert _check_sparsifier(x, codec, seed=0) == k


def _generated(kind: str, n: int, seed: int) -> torch.Tensor:
    g = gen(seed)
    if kind == "gaussian":
        return torch.randn(n, generator=g)
    if kind == "cauchy":
        return torch.empty(n).cauchy_(generator=g)
    if kind == "ties":
        return torch.randint(-3, 4, (n,), generator=g).float()
    if kind == "sparse":
        return torch.randn(n, generator=g) * (torch.rand(n, generator=g) < 0.02)
    if kind == "scaled":
        return torch.randn(n, generator=g) * torch.logspace(-20, 20, n)
    raise AssertionError(kind)


KINDS = st.sampled_from(["gaussian", "cauchy", "ties", "sparse", "scaled"])


@hsettings(120)
@given(kind=KINDS, n=st.integers(1, 50_000), ratio=st.floats(1e-4, 1.0), seed=st.integers(0, 2**31 - 1))
@example(kind="ties", n=10_000, ratio=0.01, seed=0)
def test_topk_contraction_generated(kind, n, ratio, seed):
    x = _generated(kind, n, seed)
    k = min(n, max(1, math.ceil(ratio * n)))
    assert _check_sparsifier(x, make(f"topk:ratio={ratio}"), seed) == k


@hsettings(250)
@given(kind=KINDS, n=st.integers(1, 50_000), ratio=st.floats(1e-4, 1.0), sample=st.floats(1e-3, 1.0),
       seed=st.integers(0, 2**31 - 1))
@example(kind="ties", n=10_000, ratio=0.01, sample=0.01, seed=0)
@example(kind="gaussian", n=100_000, ratio=0.001, sample=0.001, seed=3)
@example(kind="sparse", n=20_000, ratio=0.05, sample=0.01, seed=1)
def test_dgc_keeps_between_half_and_twice_k(kind, n, ratio, sample, seed):
    x = _generated(kind, n, seed)
    k = min(n, max(1, math.ceil(ratio * n)))
    kept = _check_sparsifier(x, make(f"dgc:ratio={ratio},sample={sample}"), seed)
    assert k / 2 <= kept <= 2 * k, (kept, k)


@hsettings(150)
@given(data=st.data(), ratio=st.floats(1e-3, 1.0), seed=st.integers(0, 2**31 - 1))
def test_dgc_hypothesis_values(data, ratio, seed):
    shape = tuple(data.draw(shapes, label="shape"))
    arr = data.draw(hnp.arrays(np.float32, shape, elements=finite32), label="x")
    x = torch.from_numpy(np.ascontiguousarray(arr))
    d = x.numel()
    k = min(d, max(1, math.ceil(ratio * d)))
    kept = _check_sparsifier(x, make(f"dgc:ratio={ratio}"), seed)
    assert k / 2 <= kept <= 2 * k


@hsettings(60)
@given(kind=KINDS, n=st.integers(1, 20_000), value=st.floats(0, 3), seed=st.integers(0, 2**31 - 1))
def test_threshold_keeps_exactly_the_large(kind, n, value, seed):
    x = _generated(kind, n, seed)
    y = make(f"threshold:value={value}").decode(make(f"threshold:value={value}").encode(x))
    keep = x.abs() >= value
    assert torch.equal(y[keep], x[keep]) and (y[~keep] == 0).all()


@hsettings(60)
@given(n=st.integers(1, 20_000), ratio=st.floats(1e-3, 1.0), seed=st.integers(0, 2**62))
def test_randomk_positions_come_from_the_seed(n, ratio, seed):
    codec = make(f"randomk:ratio={ratio}")
    k = min(n, max(1, math.ceil(ratio * n)))
    a = torch.rand(n, generator=gen(1)) + 1  # no zeros: the support is visible
    b = torch.rand(n, generator=gen(2)) + 1
    ya, yb = codec.decode(codec.encode(a, seed=seed)), codec.decode(codec.encode(b, seed=seed))
    assert int((ya != 0).sum()) == k
    assert torch.equal(ya != 0, yb != 0)  # same seed, same positions, whatever the values
    assert torch.equal(ya[ya != 0], a[ya != 0])


@pytest.mark.parametrize("n,k", [(1, 1), (2, 1), (3, 3), (1000, 10), (4097, 4097), (65536, 655), (300_001, 150_000)])
@pytest.mark.parametrize("seed", [0, 2**62 + 5])
def test_randomk_positions_kernel_equals_the_torch_reference(n, k, seed):
    """Every rank and device must draw the same positions: the C++ kernel and the torch integer path agree."""
    with fast.use(False):
        ref = fast.random_positions(n, k, seed)
    assert ref.dtype == torch.int64 and ref.numel() == k
    assert ref.unique().numel() == k and int(ref.min()) >= 0 and int(ref.max()) < n
    if fast.kernels_available():
        assert torch.equal(fast.random_positions(n, k, seed), ref)


def test_randomk_positions_are_uniform_and_pairwise_independent():
    """Over seeds, every position is kept with probability k/n and every pair with k(k-1)/(n(n-1)), as for a
    uniformly random k-subset (an arithmetic progression of positions has the first and fails the second)."""
    n, k, trials = 64, 16, 4000
    hits = torch.zeros(trials, n)
    for s in range(trials):
        hits[s, fast.random_positions(n, k, s)] = 1
    p1, p2 = k / n, k * (k - 1) / (n * (n - 1))
    single = hits.mean(0)
    assert (single - p1).abs().max() <= 5 * math.sqrt(p1 * (1 - p1) / trials)
    pairs = (hits.T @ hits / trials)[torch.triu_indices(n, n, 1).unbind()]
    assert (pairs - p2).abs().max() <= 6 * math.sqrt(p2 * (1 - p2) / trials)


# --------------------------------------------------------------------------- PowerSGD
def low_rank(shape, rank, seed):
    g = gen(seed)
    n, m = shape[0], math.prod(shape[1:])
    mat = torch.randn(n, rank, generator=g, dtype=torch.float64) @ torch.randn(rank, m, generator=g, dtype=torch.float64)
    return mat.float().reshape(shape)


@pytest.mark.parametrize("rank", [1, 2, 4])
@pytest.mark.parametrize("shape", [(64, 48), (48, 64), (200, 30), (32, 16, 3, 3), (16, 8, 5, 5)])
def test_powersgd_exact_on_low_rank(rank, shape):
    codec = make(f"powersgd:rank={rank}")
    assert codec.matrix_shape(torch.Size(shape)) is not None  # really compressed, not sent dense
    for true_rank in range(rank + 1):
        for seed in range(3):
            m = low_rank(shape, true_rank, seed) if true_rank else torch.zeros(shape)
            p = codec.encode(m, seed=seed + 100)
            assert len(p.tensors) == 2
            y = codec.decode(p)
            assert y.shape == m.shape
            scale = m.abs().max().item() + 1e-30
            assert torch.allclose(y, m, rtol=1e-4, atol=1e-4 * scale), (rank, true_rank, shape, seed,
                                                                         (y - m).abs().max().item() / scale)


@pytest.mark.parametrize("rank", [1, 2, 4])
def test_powersgd_factors_are_orthonormal_projection(rank):
    """P has orthonormal columns, so P Q^T = P P^T M is a projection: never larger than M."""
    codec = make(f"powersgd:rank={rank}")
    for seed in range(5):
        m = torch.randn(96, 80, generator=gen(seed))
        p, q = codec.encode(m, seed=seed).tensors
        assert torch.allclose(p.T @ p, torch.eye(rank), atol=1e-4)
        y = codec.decode(codec.encode(m, seed=seed))
        assert torch.linalg.matrix_norm(y) <= torch.linalg.matrix_norm(m) * (1 + 1e-5)
        assert _sq(m - y) <= _sq(m) * (1 + 1e-5)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_powersgd_low_rank_half_precision(dtype):
    m = low_rank((64, 48), 2, seed=0).to(dtype)
    y = make("powersgd:rank=2").decode(make("powersgd:rank=2").encode(m, seed=1))
    assert y.dtype == dtype
    tol = 2e-2 if dtype == torch.bfloat16 else 2e-3
    assert torch.allclose(y.float(), m.float(), rtol=tol, atol=tol * m.float().abs().max().item())


# --------------------------------------------------------------------------- non-finite input
NONFINITE_REQUIRED = ["fp16", "bf16", "int8", "int4", "qsgd", "terngrad", "sign",
                      "int8:stochastic=true", "int4:stochastic=true", "qsgd:levels=4", "qsgd:levels=300"]


def _nonfinite_inputs(dtype):
    for bad in (float("nan"), float("inf"), float("-inf")):
        for shape, pos in (((1,), 0), ((1000,), 7), ((1000,), 999), ((40, 30), 513), ((8, 4, 3, 3), 100)):
            x = torch.randn(shape, generator=gen(pos)).to(dtype)
            x.view(-1)[pos] = bad
            yield x
        yield torch.full((700,), bad, dtype=dtype)  # all non-finite
        yield torch.tensor(bad, dtype=dtype)  # 0-d
    x = torch.randn(1000, generator=gen(0)).to(dtype)
    x[3], x[600], x[900] = float("nan"), float("inf"), float("-inf")
    yield x


@pytest.mark.parametrize("spec", ALL_SPECS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_nonfinite_does_not_raise(spec, dtype):
    codec = make(spec)
    for x in _nonfinite_inputs(dtype):
        y = codec.decode(codec.encode(x, seed=3))
        assert y.shape == x.shape and y.dtype == dtype
        if codec.preserves_nonfinite:
            assert not torch.isfinite(y).all(), (spec, x)


@pytest.mark.parametrize("spec", NONFINITE_REQUIRED)
def test_nonfinite_propagates(spec):
    codec = make(spec)
    assert codec.preserves_nonfinite
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        for x in _nonfinite_inputs(dtype):
            y = codec.decode(codec.encode(x, seed=3))
            assert not torch.isfinite(y).all(), (spec, x)


# --------------------------------------------------------------------------- quantiser error bounds
@hsettings(250)
@given(exponent=st.integers(-45, 30), n=st.integers(1, 3000), bucket=st.sampled_from([1, 7, 64, 512]),
       kind=KINDS, seed=st.integers(0, 2**31 - 1))
@example(exponent=-40, n=600, bucket=512, kind="gaussian", seed=0)  # subnormal values
@example(exponent=-37, n=600, bucket=512, kind="gaussian", seed=0)  # scale = max/127 subnormal
@example(exponent=-25, n=600, bucket=512, kind="gaussian", seed=0)  # squares underflow float32
@example(exponent=20, n=600, bucket=512, kind="gaussian", seed=0)  # squares overflow float32
def test_quantiser_error_bounds_any_magnitude(exponent, n, bucket, kind, seed):
    """Finite input of any magnitude decodes to finite values within one quantisation step.

    int8/int4: |y - x| <= step/2 (round to nearest) or < step (stochastic), step = max|x_b| / qmax;
    terngrad: y in {0, sign(x) max|x_b|}; qsgd: y in sign(x) * {l * ||x_b|| / s}, within one level;
    sign: y = sign(x) * mean|x_b|.
    """
    x64 = _generated(kind, n, seed).double() * 10.0**exponent
    x = x64.float()
    if kind == "scaled":
        x = x.clamp(-1e30, 1e30)
    slack_abs = 1e-42  # float32 subnormal spacing times a few hundred
    for name, qmax, stochastic in (("int8", 127, False), ("int4", 7, False), ("int8", 127, True), ("int4", 7, True)):
        spec = f"{name}:bucket={bucket},stochastic={str(stochastic).lower()}"
        y = make(spec).decode(make(spec).encode(x, seed=seed))
        assert torch.isfinite(y).all(), spec
        xb, yb = _buckets_of(x, bucket), _buckets_of(y, bucket)
        step = xb.abs().amax(dim=1, keepdim=True) / qmax
        limit = step * (1.0 if stochastic else 0.5) + 1e-5 * step + slack_abs
        assert ((yb - xb).abs() <= limit).all(), (spec, ((yb - xb).abs() / step).max().item())

    y = make(f"terngrad:bucket={bucket}").decode(make(f"terngrad:bucket={bucket}").encode(x, seed=seed))
    assert torch.isfinite(y).all(), "terngrad"
    xb, yb = _buckets_of(x, bucket), _buckets_of(y, bucket)
    amax = xb.abs().amax(dim=1, keepdim=True)
    assert ((yb == 0) | ((yb - torch.sign(xb) * amax).abs() <= 1e-6 * amax + slack_abs)).all(), "terngrad"

    for levels in (1, 7):
        codec = make(f"qsgd:levels={levels},bucket={bucket}")
        y = codec.decode(codec.encode(x, seed=seed))
        assert torch.isfinite(y).all(), "qsgd"
        xb, yb = _buckets_of(x, bucket), _buckets_of(y, bucket)
        norm = torch.linalg.vector_norm(xb, dim=1, keepdim=True)
        unit = norm / levels
        assert ((yb - xb).abs() <= unit * (1 + 1e-5) + slack_abs).all(), ("qsgd", ((yb - xb).abs() / unit).max())
        assert ((yb == 0) | (torch.sign(yb) == torch.sign(xb))).all()
        # a bucket with a non-zero value does not decode to all zeros in every draw: its mean is x
        assert (yb.abs().amax(dim=1) <= norm.squeeze(1) * (1 + 1e-5) + slack_abs).all()

    y = make(f"sign:bucket={bucket}").decode(make(f"sign:bucket={bucket}").encode(x))
    assert torch.isfinite(y).all(), "sign"


@pytest.mark.parametrize("exponent", [-30, -25, -20, 0, 20, 25, 30])
def test_qsgd_unbiased_at_extreme_magnitudes(exponent):
    """The bucket norm must neither underflow (all zeros) nor overflow (NaN) for small or large gradients."""
    x = sample_input(600, seed=4) * 10.0**exponent
    ok, ratios = is_unbiased(make("qsgd"), x, n_samples=300)
    assert ok, ratios


# --------------------------------------------------------------------------- other structure
@hsettings(60)
@given(kind=KINDS, n=st.integers(1, 3000), bucket=st.sampled_from([1, 5, 64, 512]), seed=st.integers(0, 2**31 - 1))
def test_sign_keeps_l1_norm_and_signs(kind, n, bucket, seed):
    x = _generated(kind, n, seed).clamp(-1e30, 1e30)
    y = make(f"sign:bucket={bucket}").decode(make(f"sign:bucket={bucket}").encode(x))
    for a in range(0, n, bucket):
        xb, yb = x[a : a + bucket].double(), y[a : a + bucket].double()
        if (xb != 0).any():
            assert torch.equal(yb > 0, xb >= 0)  # bit 1 for x >= 0 (zeros included), decoded as +scale
        else:
            assert (yb == 0).all()
        assert math.isclose(yb.abs().sum().item(), xb.abs().sum().item(), rel_tol=1e-5, abs_tol=1e-30)
        assert (yb.abs() == yb.abs()[0]).all()  # one magnitude per bucket


@hsettings(60)
@given(n=st.integers(1, 3000), levels=st.integers(1, 300), bucket=st.sampled_from([1, 16, 512]),
       seed=st.integers(0, 2**31 - 1))
def test_qsgd_decodes_onto_its_grid(n, levels, bucket, seed):
    x = torch.randn(n, generator=gen(seed))
    codec = make(f"qsgd:levels={levels},bucket={bucket}")
    y = codec.decode(codec.encode(x, seed=seed))
    xb, yb = _buckets_of(x, bucket), _buckets_of(y, bucket)
    unit = torch.linalg.vector_norm(xb, dim=1, keepdim=True) / levels
    q = yb / torch.where(unit > 0, unit, torch.ones_like(unit))
    assert torch.allclose(q, q.round(), atol=1e-3)
    assert (q.abs().round() <= levels).all()
    # stochastic rounding goes to one of the two neighbouring levels
    assert ((q.abs() - xb.abs() / torch.where(unit > 0, unit, torch.ones_like(unit))).abs() < 1 + 1e-3).all()
