"""The codec contract, checked for every registered codec (and a few non-default specs).

encode(x, *, seed) -> Payload; decode(payload) -> tensor of x's shape and dtype, for any
shape (0-d, empty, non-contiguous); same x and seed -> same payload; only real floating
point input; wire sizes within the documented bounds.
"""

from __future__ import annotations

import inspect
import math

import pytest
import torch

import gradcompress
from gradcompress import Aggregation, Codec, Payload, make

EXTRA_SPECS = [
    "topk:ratio=0.01,values=int8",
    "topk:ratio=0.3,values=int4",
    "int8:stochastic=true",
    "int4:stochastic=true",
    "randomk:scale=true",
    "qsgd:levels=4",
    "qsgd:levels=1",
    "qsgd:levels=300",  # int16 codes
    "int8:bucket=7",
    "sign:bucket=5",
    "dgc:ratio=0.1",
    "powersgd:rank=2,min_compression_rate=1",
    "topk:ratio=0.05,chunk=64,values=int2",
    "topk:ratio=0.2,chunk=300",  # 9-bit offsets: a byte and a packed high bit
    "int2:bucket=7",
]
SPECS = gradcompress.available() + EXTRA_SPECS
FLOAT_DTYPES = [torch.float32, torch.float16, torch.bfloat16]
SHAPES = [(), (1,), (5,), (1000,), (33, 17), (64, 48), (4, 3, 5, 7), (8, 4, 3, 3)]
EMPTY_SHAPES = [(0,), (3, 0), (0, 4, 5), (2, 0, 3, 3)]


def randn(shape, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g).to(dtype)


def round_trip(codec, x, seed=0):
    return codec.decode(codec.encode(x, seed=seed))


@pytest.fixture(params=SPECS)
def codec(request):
    return make(request.param)


# --------------------------------------------------------------------------- basics
def test_available_codecs_are_codecs():
    for name in gradcompress.available():
        c = make(name)
        assert isinstance(c, Codec)
        assert isinstance(c.aggregation, Aggregation)
        assert isinstance(c.fixed_layout, bool) and isinstance(c.preserves_nonfinite, bool)


def test_encode_seed_is_keyword_only(codec):
    params = inspect.signature(codec.encode).parameters
    assert params["seed"].kind is inspect.Parameter.KEYWORD_ONLY
    assert params["seed"].default is None
    with pytest.raises(TypeError):
        codec.encode(randn(10), 3)


# --------------------------------------------------------------------------- round trip
@pytest.mark.parametrize("dtype", FLOAT_DTYPES + [torch.float64])
@pytest.mark.parametrize("shape", SHAPES)
def test_round_trip_shape_and_dtype(codec, shape, dtype):
    x = randn(shape, seed=len(shape), dtype=dtype)
    p = codec.encode(x, seed=3)
    assert isinstance(p, Payload)
    assert isinstance(p.tensors, tuple) and all(isinstance(t, torch.Tensor) for t in p.tensors)
    assert p.shape == x.shape and p.dtype == x.dtype
    assert p.nbytes == sum(t.numel() * t.element_size() for t in p.tensors)
    assert p.nbytes > 0
    y = codec.decode(p)
    assert isinstance(y, torch.Tensor)
    assert y.shape == x.shape
    assert y.dtype == x.dtype
    assert y.device == x.device
    assert torch.isfinite(y).all()


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_zero_input_decodes_to_zero(codec, dtype):
    for shape in [(1,), (700,), (64, 48)]:
        x = torch.zeros(shape, dtype=dtype)
        y = round_trip(codec, x, seed=1)
        assert torch.equal(y, x)


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_encode_and_decode_leave_inputs_untouched(codec, dtype):
    x = randn((64, 48), seed=5, dtype=dtype)
    before = x.clone()
    p = codec.encode(x, seed=9)
    saved = tuple(t.clone() for t in p.tensors)
    y1 = codec.decode(p)
    assert torch.equal(x, before)
    assert all(torch.equal(a, b) for a, b in zip(p.tensors, saved))
    y2 = codec.decode(p)  # decoding twice gives the same
    assert torch.equal(y1, y2)


def test_decode_of_received_copies(codec):
    """A payload rebuilt from copies of its tensors (what another rank receives) decodes the same."""
    x = randn((33, 17), seed=2)
    p = codec.encode(x, seed=4)
    q = p.replace(tuple(t.clone() for t in p.tensors))
    assert q.shape == p.shape and q.dtype == p.dtype and q.seed == p.seed
    assert torch.equal(codec.decode(q), codec.decode(p))


def test_exact_codecs():
    x = randn((40, 25), seed=11)
    assert torch.equal(round_trip(make("none"), x), x)
    assert torch.equal(round_trip(make("fp16"), x), x.half().float())
    assert torch.equal(round_trip(make("bf16"), x), x.bfloat16().float())
    for dtype in FLOAT_DTYPES:
        xd = x.to(dtype)
        assert torch.equal(round_trip(make("none"), xd), xd)
    # topk with ratio 1 and threshold 0 keep everything
    assert torch.equal(round_trip(make("topk:ratio=1"), x), x)
    assert torch.equal(round_trip(make("threshold:value=0"), x), x)
    assert torch.equal(round_trip(make("randomk:ratio=1"), x), x)


# --------------------------------------------------------------------------- determinism
@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_same_seed_same_payload(codec, dtype):
    x = randn((64, 48), seed=7, dtype=dtype)
    for seed in (0, 1, 12345, 2**62 + 3):
        p1 = codec.encode(x, seed=seed)
        p2 = codec.encode(x.clone(), seed=seed)
        assert len(p1.tensors) == len(p2.tensors)
        for a, b in zip(p1.tensors, p2.tensors):
            assert a.dtype == b.dtype and a.shape == b.shape
            assert torch.equal(a, b)
        assert torch.equal(codec.decode(p1), codec.decode(p2))


def test_deterministic_codecs_ignore_seed(codec):
    if codec.stochastic or codec.shared_seed:
        pytest.skip("seeded codec")
    x = randn(3000, seed=8)
    ref = codec.encode(x)
    for seed in (None, 0, 99):
        p = codec.encode(x, seed=seed)
        assert all(torch.equal(a, b) for a, b in zip(p.tensors, ref.tensors))


def test_stochastic_codecs_use_the_seed(codec):
    if not (codec.stochastic or codec.shared_seed):
        pytest.skip("deterministic codec")
    x = randn((64, 48), seed=8) * torch.linspace(0.1, 3, 48)  # rank > 2, spread magnitudes
    d1 = round_trip(codec, x, seed=1)
    d2 = round_trip(codec, x, seed=2)
    assert not torch.equal(d1, d2)


def test_seed_none_draws_a_seed(codec):
    x = randn(2000, seed=9)
    p = codec.encode(x)
    if codec.stochastic or codec.shared_seed:
        assert isinstance(p.seed, int)
        # the recorded seed reproduces the payload
        again = codec.encode(x, seed=p.seed)
        assert all(torch.equal(a, b) for a, b in zip(p.tensors, again.tensors))
    y = codec.decode(p)
    assert y.shape == x.shape and torch.isfinite(y).all()


def test_seeded_encode_leaves_global_rng_alone(codec):
    x = randn((64, 48), seed=10)
    state = torch.get_rng_state()
    codec.decode(codec.encode(x, seed=5))
    assert torch.equal(state, torch.get_rng_state())


# --------------------------------------------------------------------------- empty / 0-d
@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("shape", EMPTY_SHAPES)
def test_empty(codec, shape, dtype):
    x = torch.empty(shape, dtype=dtype)
    p = codec.encode(x, seed=1)
    assert p.nbytes == 0
    y = codec.decode(p)
    assert y.shape == x.shape and y.dtype == dtype and y.numel() == 0


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_zero_dim(codec, dtype):
    for value in (0.0, 1.5, -3.25):
        x = torch.tensor(value, dtype=dtype)
        p = codec.encode(x, seed=1)
        y = codec.decode(p)
        assert y.shape == torch.Size([]) and y.dtype == dtype
        assert torch.isfinite(y)
        if codec.name in ("none", "fp16", "bf16", "int8", "int4", "sign", "topk", "dgc", "powersgd"):
            assert y.item() == value  # one element: every one of these is exact on it


# --------------------------------------------------------------------------- non-contiguous
def _non_contiguous(dtype):
    base = randn((48, 64), seed=12, dtype=dtype)
    yield base.t()  # transposed matrix
    yield randn(2001, seed=13, dtype=dtype)[::3]  # strided
    yield randn((5, 1), seed=14, dtype=dtype).expand(5, 300)  # stride 0
    yield randn((8, 4, 3, 3), seed=15, dtype=dtype).to(memory_format=torch.channels_last)
    yield randn((30, 40, 2), seed=16, dtype=dtype)[:, 5:35, 1]  # offset + strides


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_non_contiguous_input(codec, dtype):
    for x in _non_contiguous(dtype):
        assert not x.is_contiguous() or x.stride() != x.contiguous().stride()
        xc = x.contiguous()
        p, pc = codec.encode(x, seed=21), codec.encode(xc, seed=21)
        assert all(torch.equal(a, b) for a, b in zip(p.tensors, pc.tensors))
        y, yc = codec.decode(p), codec.decode(pc)
        assert y.shape == x.shape and y.dtype == dtype
        assert torch.equal(y, yc)


# --------------------------------------------------------------------------- bad input
@pytest.mark.parametrize("dtype", [torch.int32, torch.int64, torch.int8, torch.uint8, torch.bool,
                                   torch.complex64, torch.complex128])
def test_bad_dtype_raises_type_error(codec, dtype):
    x = torch.zeros((4, 6), dtype=dtype)
    with pytest.raises(TypeError) as info:
        codec.encode(x, seed=0)
    msg = str(info.value)
    assert str(dtype).replace("torch.", "") in msg
    assert "float32" in msg  # says what is allowed


@pytest.mark.parametrize("bad", [[1.0, 2.0], 3.0, None])
def test_non_tensor_raises_type_error(codec, bad):
    with pytest.raises(TypeError):
        codec.encode(bad, seed=0)


def test_bad_dtype_even_when_empty(codec):
    with pytest.raises(TypeError):
        codec.encode(torch.zeros(0, dtype=torch.int32), seed=0)
    with pytest.raises(TypeError):
        codec.encode(torch.tensor(True), seed=0)


@pytest.mark.parametrize(
    "spec, needles",
    [
        ("topk:ratio=2", ["topk", "ratio", "(0, 1]", "2"]),
        ("int8:bogus=1", ["int8", "bogus", "bucket", "stochastic"]),
        ("qsgd:levels=0", ["qsgd", "levels", "[1, 32767]", "0"]),
        ("qsgd:levels=1.5", ["qsgd", "levels", "integer", "[1, 32767]"]),
        ("int4:stochastic=2", ["int4", "stochastic", "true or false"]),
        ("randomk:ratio=0", ["randomk", "ratio", "(0, 1]"]),
        ("powersgd:rank=0", ["powersgd", "rank", "[1, inf)"]),
        ("nosuchcodec", ["nosuchcodec", "available"] + gradcompress.available()),
        ({"name": "topk", "ratio": 1.5}, ["topk", "ratio", "(0, 1]"]),
        ({"name": "int8", "bogus": 1}, ["int8", "bogus", "bucket"]),
        ({"name": "nosuchcodec"}, ["nosuchcodec"] + gradcompress.available()),
    ],
)
def test_bad_spec_value_error(spec, needles):
    with pytest.raises(ValueError) as info:
        make(spec)
    msg = str(info.value)
    for needle in needles:
        assert needle in msg, (needle, msg)


# --------------------------------------------------------------------------- wire sizes
def _k(ratio, n):
    return math.ceil(ratio * n)


WIRE_BOUNDS = [
    ("none", lambda n: 4 * n),
    ("fp16", lambda n: 2 * n),
    ("bf16", lambda n: 2 * n),
    ("int8", lambda n: 1.02 * n + 64),
    ("int8:stochastic=true", lambda n: 1.02 * n + 64),
    ("int4", lambda n: 0.52 * n + 64),
    ("int4:stochastic=true", lambda n: 0.52 * n + 64),
    ("qsgd:levels=4", lambda n: 0.51 * n + 64),
    ("qsgd", lambda n: 0.51 * n + 64),  # default 7 levels: 4 bits as well
    ("terngrad", lambda n: 0.27 * n + 64),
    ("sign", lambda n: 0.14 * n + 64),
    ("topk", lambda n: _k(0.01, n) * 8 + 64),
    ("topk:ratio=0.1", lambda n: _k(0.1, n) * 8 + 64),
    ("topk:ratio=0.5", lambda n: _k(0.5, n) * 8 + 64),
    ("topk:ratio=0.01,values=int8", lambda n: _k(0.01, n) * 5.1 + 64),
    ("topk:ratio=0.1,values=int8", lambda n: _k(0.1, n) * 5.1 + 64),
    ("topk:ratio=0.5,values=int8", lambda n: _k(0.5, n) * 5.1 + 64),
    ("randomk", lambda n: _k(0.01, n) * 4 + 64),
    ("randomk:ratio=0.1,scale=true", lambda n: _k(0.1, n) * 4 + 64),
]
WIRE_NS = [1, 7, 513, 10000, 100003]


@pytest.mark.parametrize("spec, bound", WIRE_BOUNDS, ids=[s for s, _ in WIRE_BOUNDS])
def test_wire_size_bounds(spec, bound):
    codec = make(spec)
    for n in WIRE_NS:
        x = randn(n, seed=n)
        p = codec.encode(x, seed=1)
        assert p.nbytes <= bound(n), (spec, n, p.nbytes, bound(n))
        if spec in ("none", "fp16", "bf16"):
            assert p.nbytes == bound(n)
        if codec.fixed_layout:
            assert codec.wire_nbytes(n) == p.nbytes


def test_topk_sends_exactly_k():
    for n in WIRE_NS:
        for ratio in (0.001, 0.01, 0.3, 1.0):
            k = min(n, max(1, math.ceil(ratio * n)))
            p = make(f"topk:ratio={ratio}").encode(randn(n, seed=n), seed=0)
            assert p.nbytes == 8 * k
            values, idx = p.tensors
            assert values.numel() == idx.numel() == k and idx.dtype == torch.int32


def test_wire_size_follows_input_dtype_for_uncompressed_values():
    n = 1000
    assert make("none").encode(randn(n, dtype=torch.float16)).nbytes == 2 * n
    assert make("fp16").encode(randn(n, dtype=torch.float64)).nbytes == 2 * n
    assert make("topk:ratio=0.1").encode(randn(n, dtype=torch.bfloat16)).nbytes == 100 * (2 + 4)


def test_powersgd_wire_size():
    c = make("powersgd:rank=2")
    x = randn((256, 128), seed=3)
    assert c.encode(x, seed=0).nbytes == (256 + 128) * 2 * 4
    conv = randn((64, 32, 3, 3), seed=4)
    assert c.encode(conv, seed=0).nbytes == (64 + 32 * 9) * 2 * 4
    # vectors and matrices too small to gain are sent dense
    assert c.encode(randn(300), seed=0).nbytes == 300 * 4
    assert c.encode(randn((3, 4)), seed=0).nbytes == 12 * 4


@pytest.mark.parametrize("spec", [s for s in SPECS])
def test_fixed_layout_depends_only_on_size(spec):
    codec = make(spec)
    if not codec.fixed_layout:
        pytest.skip("variable layout")
    for shape in [(1,), (513,), (64, 48)]:
        a = codec.encode(randn(shape, seed=1) * 100, seed=1)
        b = codec.encode(randn(shape, seed=2) * 1e-3, seed=2)
        assert [(t.shape, t.dtype) for t in a.tensors] == [(t.shape, t.dtype) for t in b.tensors]
        assert codec.wire_nbytes(math.prod(shape)) == a.nbytes or codec.name == "powersgd"


# --------------------------------------------------------------------------- aggregation
@pytest.mark.parametrize("spec", ["none", "fp16", "bf16", "randomk:ratio=0.2", "randomk:ratio=0.2,scale=true"])
def test_summable_payloads_add_up(spec):
    """Aggregation.SUM: the elementwise sum of payloads decodes to the sum of the decodes."""
    codec = make(spec)
    assert codec.aggregation is Aggregation.SUM
    xs = [randn((40, 30), seed=s) for s in range(4)]
    seed = 77  # randomk: every rank uses the same seed
    payloads = [codec.encode(x, seed=seed) for x in xs]
    summed = tuple(sum(p.tensors[i].float() for p in payloads) for i in range(len(payloads[0].tensors)))
    total = codec.decode(payloads[0].replace(summed))
    expected = sum(codec.decode(p) for p in payloads)
    assert torch.allclose(total, expected, rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("spec", ["topk:ratio=0.05", "topk:ratio=0.05,values=int8", "dgc:ratio=0.05",
                                  "threshold:value=0.5", "int8", "randomk:ratio=0.1"])
def test_accumulate_into_is_adding_the_decode(spec):
    """The gather path adds each rank's payload with accumulate_into: bit for bit ``out += decode(payload)``."""
    codec = make(spec)
    g = torch.Generator().manual_seed(5)
    x = torch.randn(3000, generator=g)
    base = torch.randn(3000, generator=g)
    p = codec.encode(x, seed=11)
    got = base.clone()
    codec.accumulate_into(p, got)
    assert torch.equal(got, base + codec.decode(p))


@pytest.mark.parametrize("n, ratio", [(3000, 0.05), (400_000, 0.3)])
def test_accumulate_gathered_is_adding_each_rank_in_turn(n, ratio):
    """The gather path's one index_add_ for all ranks (payload tensors stacked by rank) gives bit for bit what
    adding each rank's payload in rank order gives, with positions shared by many ranks."""
    codec = make(f"topk:ratio={ratio}")
    g = torch.Generator().manual_seed(6)
    common = torch.randn(n, generator=g)
    payloads = [codec.encode(common + 0.3 * torch.randn(n, generator=g), seed=0) for _ in range(8)]
    parts = [torch.stack([p.tensors[i] for p in payloads]) for i in range(2)]
    got = torch.zeros(n)
    flags = codec.accumulate_gathered(payloads[0], parts, got)
    assert flags.shape == (8,) and bool(flags.all())  # every rank's positions in range
    want = torch.zeros(n)
    for p in payloads:
        assert bool(codec.accumulate_into(p, want))
    assert torch.equal(got, want)
    assert make("topk:values=int8").accumulate_gathered(payloads[0], parts, got) is None  # per rank instead
    for world in (3, 8):  # and the mean, divided only where something was added: bit for bit sum / world
        mean = torch.zeros(n)
        assert bool(codec.accumulate_gathered(payloads[0], parts, mean, world).all())
        assert torch.equal(mean, want / world) and not mean.signbit()[want == 0].any()


@pytest.mark.parametrize("spec", ["none", "fp16", "bf16"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("world", [1, 3, 4])
def test_cast_mean_part_is_the_encode_of_the_mean(spec, dtype, world):
    """encode_mean_part (pieces divided in cache, then cast) sends exactly encode(x / world), with or without a
    caller's buffer, over several pieces and a partial last one, through overflow and NaN."""
    codec = make(spec)
    n = 3 * (1 << 16) + 123
    x = (torch.randn(n, generator=torch.Generator().manual_seed(world)) * 3e4).to(dtype)
    x[5], x[n - 1], x[70_000] = float("nan"), float("inf"), 2e5  # 2e5 / world overflows float16
    want = codec.encode(x / world).tensors[0]
    got = codec.encode_mean_part(x, world).tensors[0]
    assert got.dtype == want.dtype and torch.equal(got.view(-1).float().nan_to_num(7.0),
                                                   want.view(-1).float().nan_to_num(7.0))
    buf = torch.full((n + 10,), 1.0, dtype=codec.mean_part_dtype(x))
    p = codec.encode_mean_part(x, world, out=buf[5 : 5 + n])
    assert p.tensors[0].data_ptr() == buf[5:].data_ptr() and bool((buf[:5] == 1).all() and (buf[5 + n :] == 1).all())
    assert torch.equal(p.tensors[0].float().nan_to_num(7.0), want.view(-1).float().nan_to_num(7.0))


@pytest.mark.parametrize("spec", ["randomk:ratio=0.1", "randomk:ratio=0.3,scale=true"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_randomk_mean_part_is_the_encode_of_the_mean(spec, dtype):
    """random-k divides only its k values: the same payload as encode(x / world), and kept() is its decode."""
    codec = make(spec)
    x = torch.randn(100_003, generator=torch.Generator().manual_seed(1)).to(dtype)
    for world in (1, 3):
        want = codec.encode(x / world, seed=11)
        got = codec.encode_mean_part(x, world, seed=11)
        assert got.seed == want.seed and got.dtype == want.dtype and torch.equal(got.tensors[0], want.tensors[0])
        idx, vals = codec.kept(got)
        dense = torch.zeros(x.numel()).index_copy_(0, idx, vals)
        assert torch.equal(dense, codec.decode(got).float())
