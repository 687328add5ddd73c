"""gradcompress.optim.DeMo and its ``dct`` codec: the codec's properties, DeMo with everything extracted against
torch SGD, replicas, bytes, a non-finite step, checkpoints, the ``decoupled`` scheme.

The multi-process checks run in one launch per world size (tests/demo_workers.py), shared through a fixture.
"""

from __future__ import annotations

import copy
import itertools
import math

import pytest
import torch
import torch.nn as nn

import demo_workers as dw
from gradcompress import make
from gradcompress.testbed import launch
from gradcompress.codecs.dct import ChunkLayout, dct_matrix
from gradcompress.optim import DeMo
from gradcompress.scheme import parse_scheme

pytestmark = pytest.mark.slow  # multi-process runs: outside the fast lane (pytest -m "not slow")

STEPS, BAD_STEP = 6, 3
TOTAL, CUT = 7, 4


@pytest.fixture
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


# --------------------------------------------------------------------------- the codec
SHAPES = [(16, 24), (8, 8, 2), (24,), (7,), (6, 8), (3, 5)]  # 2-D blocks, a 3-D block view, 1-D chunks (padded)


def test_dct_matrix_is_the_orthonormal_dct_ii():
    for n in (1, 4, 7, 64):
        d = dct_matrix(n, torch.float64)
        assert torch.allclose(d @ d.T, torch.eye(n, dtype=torch.float64), atol=1e-12)
        x = torch.randn(n, dtype=torch.float64)
        # the DCT-II sum written out: X_k = s_k sum_i x_i cos(pi (2i + 1) k / (2n)), s_0 = sqrt(1/n), else sqrt(2/n)
        direct = torch.tensor([(math.sqrt(1 / n) if k == 0 else math.sqrt(2 / n))
                               * sum(float(x[i]) * math.cos(math.pi * (2 * i + 1) * k / (2 * n)) for i in range(n))
                               for k in range(n)], dtype=torch.float64)
        assert torch.allclose(d @ x, direct, atol=1e-12)


@pytest.mark.parametrize("shape", SHAPES)
def test_chunk_transform_round_trips_and_keeps_energy(shape):
    lay = ChunkLayout.of(shape, 4)
    x = torch.randn(shape, dtype=torch.float64)
    coeffs = lay.forward(x)
    assert coeffs.shape == (lay.blocks, lay.block)
    assert torch.allclose(lay.inverse(coeffs).view(shape), x, atol=1e-12)
    assert math.isclose(coeffs.square().sum().item(), x.square().sum().item(), rel_tol=1e-12)  # Parseval
    assert lay.two_d == (len(shape) >= 2 and shape[0] % 4 == 0 and math.prod(shape[1:]) % 4 == 0)


@pytest.mark.parametrize("shape", SHAPES)
def test_decode_of_encode_is_exact_when_every_coefficient_is_kept(shape):
    codec = make("dct:chunk=4,topk=16")
    x = torch.randn(shape, dtype=torch.float64)
    y = codec.decode(codec.encode(x))
    assert y.shape == x.shape and y.dtype == x.dtype
    assert (y - x).abs().max().item() < 1e-12
    x32 = x.float()
    assert torch.allclose(codec.decode(codec.encode(x32)), x32, atol=1e-6)


@pytest.mark.parametrize("shape", [(16, 24), (40,)])
def test_kept_coefficients_hold_more_energy_than_any_other_k(shape):
    codec = make("dct:chunk=4,topk=3")
    lay = ChunkLayout.of(shape, 4)
    x = torch.randn(shape, dtype=torch.float64)
    coeffs = lay.forward(x)
    pos, vals = codec.kept(codec.encode(x))
    assert torch.equal(vals, coeffs.reshape(-1)[pos])  # what is sent are the coefficients themselves
    blocks = pos // lay.block
    assert torch.equal(torch.bincount(blocks, minlength=lay.blocks), torch.full((lay.blocks,), 3))
    assert pos.unique().numel() == pos.numel()
    kept_energy = torch.zeros(lay.blocks, dtype=torch.float64).index_add_(0, blocks, vals.square())
    best = coeffs.square().sort(1, descending=True).values[:, :3].sum(1)
    assert torch.allclose(kept_energy, best, rtol=1e-12)
    for subset in itertools.islice(itertools.combinations(range(lay.block), 3), 0, None, 7):  # other k-subsets
        assert bool((kept_energy >= coeffs[:, list(subset)].square().sum(1) - 1e-12).all())
    # orthonormal: the error is exactly the energy left out
    err = (x - codec.decode(codec.encode(x))).square().sum().item()
    assert math.isclose(err, coeffs.square().sum().item() - kept_energy.sum().item(), rel_tol=1e-9, abs_tol=1e-12)


@pytest.mark.parametrize("spec", ["dct", "dct:chunk=4,topk=3", "dct:chunk=16,topk=300", "dct:values=bf16"])
@pytest.mark.parametrize("shape", [(128, 64), (64, 128), (100,), (5, 7), (300, 16)])
def test_payload_bytes_are_the_arithmetic(spec, shape):
    codec = make(spec)
    payload = codec.encode(torch.randn(shape))
    lay = ChunkLayout.of(shape, codec.chunk)
    k = min(codec.topk, lay.block)
    index_bytes = 1 if lay.block <= 256 else 2 if lay.block <= 32768 else 4
    value_bytes = 2 if codec.values is not None else 4
    assert payload.nbytes == lay.blocks * k * (value_bytes + index_bytes)
    assert codec.payload_nbytes(math.prod(shape), shape) == payload.nbytes


def test_paper_defaults_send_32_of_4096_coefficients_of_a_matrix():
    codec = make("dct")
    assert (codec.chunk, codec.topk) == (64, 32)
    payload = codec.encode(torch.randn(128, 192))
    assert payload.nbytes == 6 * 32 * (4 + 2)  # six 64 x 64 blocks, int16 positions


def test_nonfinite_input_decodes_nonfinite():
    codec = make("dct:chunk=4,topk=2")
    for shape in ((8, 8), (10,)):
        for bad in (float("inf"), float("-inf"), float("nan")):
            x = torch.randn(shape)
            x.view(-1)[5] = bad
            assert not bool(torch.isfinite(codec.decode(codec.encode(x))).all())
            assert not bool(torch.isfinite(codec.encode(x).tensors[0]).all())  # what the exchange checks


def test_gathered_mean_in_dct_space_equals_mean_of_decodes():
    codec = make("dct:chunk=4,topk=3")
    xs = [torch.randn(8, 12) for _ in range(3)]
    payloads = [codec.encode(x) for x in xs]
    parts = tuple(torch.stack([p.tensors[i] for p in payloads]) for i in range(2))
    out = torch.zeros(8, 12)
    valid = codec.accumulate_gathered(payloads[0], parts, out, 3)
    assert valid is not None and valid.tolist() == [True, True, True]  # handled; every rank's positions in range
    expected = sum(codec.decode(p) for p in payloads) / 3
    assert torch.allclose(out, expected, atol=1e-6)
    assert codec.encode(xs[0]).tensors[1].dtype == torch.uint8


# --------------------------------------------------------------------------- DeMo, one process
def regression(seed: int = 0):
    model = dw.make_model(seed)
    g = torch.Generator().manual_seed(seed)
    return model, torch.randn(32, dw.IN, generator=g), torch.randn(32, dw.OUT, generator=g)


def test_single_process_full_extraction_is_plain_sgd(one_thread):
    model, x, y = regression()
    ref = copy.deepcopy(model)
    opt = DeMo(model.parameters(), lr=dw.LR, momentum_decay=dw.BETA, chunk=dw.CHUNK, topk=dw.FULL, sign=False,
               weight_decay=dw.WD)
    sgd = torch.optim.SGD(ref.parameters(), lr=dw.LR, weight_decay=dw.WD)
    for _ in range(8):
        for m, o in ((model, opt), (ref, sgd)):
            o.zero_grad()
            nn.functional.mse_loss(m(x), y).backward()
            o.step()
        assert (dw.flat(model) - dw.flat(ref)).abs().max().item() < 1e-6
    assert opt.stats()["wire_bytes"] == 0 and opt.stats()["steps"] == 8


def test_single_process_partial_extraction_keeps_the_rest_in_the_momentum(one_thread):
    model, x, y = regression()
    opt = DeMo(model.parameters(), lr=dw.LR, momentum_decay=dw.BETA, chunk=dw.CHUNK, topk=1, sign=False)
    codec = make(f"dct:chunk={dw.CHUNK},topk=1")
    w = model[0].weight
    for step in range(3):
        opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        before_m, before_w = opt.state[w]["momentum"].clone() if step else torch.zeros_like(w), w.detach().clone()
        opt.step()
        m = before_m * dw.BETA + w.grad
        sent = codec.decode(codec.encode(m))
        assert torch.allclose(opt.state[w]["momentum"], m - sent, atol=1e-6)  # m <- m - what was sent
        assert torch.allclose(w.detach(), before_w - dw.LR * sent, atol=1e-6)  # one worker: the mean is its own


def test_sign_step_and_decoupled_weight_decay(one_thread):
    model, x, y = regression()
    opt = DeMo(model.parameters(), lr=0.01, weight_decay=0.5, chunk=dw.CHUNK, topk=dw.FULL)
    before = [p.detach().clone() for p in model.parameters()]
    nn.functional.mse_loss(model(x), y).backward()
    grads = [p.grad.clone() for p in model.parameters()]
    opt.step()
    for p, b, g in zip(model.parameters(), before, grads):
        expected = b * (1 - 0.01 * 0.5) - 0.01 * g.sign()
        assert torch.allclose(p.detach(), expected, atol=1e-6)


def test_nonfinite_step_is_skipped_without_touching_state(one_thread):
    model, x, y = regression()
    opt = DeMo(model.parameters(), chunk=dw.CHUNK, topk=dw.PARTIAL)
    for bad in (False, True, False):
        opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        if bad:
            model[2].bias.grad[1] = float("nan")
        params, state = dw.flat(model), copy.deepcopy(opt.state_dict()["state"])
        opt.step()
        after = opt.state_dict()["state"]
        same = torch.equal(params, dw.flat(model)) and all(torch.equal(state[k][n], after[k][n])
                                                           for k in state for n in state[k])
        assert same == bad
    assert opt.stats()["skipped"] == 1
    assert all(s["step"].item() == 2 for s in opt.state_dict()["state"].values())


def test_low_precision_parameters_keep_float32_momentum(one_thread):
    for dtype in (torch.float16, torch.bfloat16):
        model = dw.make_model().to(dtype)
        opt = DeMo(model.parameters(), lr=1e-2, chunk=dw.CHUNK, topk=dw.PARTIAL)
        before = dw.flat(model)
        for _step in range(2):
            opt.zero_grad()
            x = torch.randn(4, dw.IN, dtype=dtype)
            model(x).float().square().mean().backward()
            opt.step()
        assert {p.dtype for p in model.parameters()} == {dtype}
        assert {s["momentum"].dtype for s in opt.state.values()} == {torch.float32}
        assert not torch.equal(before, dw.flat(model))
        restored = DeMo(model.parameters(), chunk=dw.CHUNK, topk=dw.PARTIAL)
        restored.load_state_dict(opt.state_dict())
        assert {s["momentum"].dtype for s in restored.state.values()} == {torch.float32}


@pytest.mark.parametrize("kwargs, match", [
    ({"lr": -1.0}, "lr must be"),
    ({"lr": float("nan")}, "lr must be"),
    ({"momentum_decay": 1.0}, "momentum_decay must be"),
    ({"weight_decay": -0.1}, "weight_decay must be"),
    ({"sign": 1}, "sign must be True or False"),
    ({"chunk": 0}, "chunk must be an integer >= 1"),
    ({"topk": 2.5}, "topk must be an integer >= 1"),
    ({"values": "nosuchcodec"}, "unknown codec"),
    ({"topology": "ring"}, "topology must be"),
])
def test_invalid_arguments_raise_value_error(kwargs, match):
    with pytest.raises(ValueError, match=match):
        DeMo(dw.make_model().parameters(), **kwargs)


def test_signature_and_paper_defaults():
    import inspect

    params = inspect.signature(DeMo).parameters
    assert list(params)[:2] == ["params", "lr"]
    assert all(params[k].kind is inspect.Parameter.KEYWORD_ONLY for k in list(params)[2:])
    defaults = {k: v.default for k, v in params.items() if k != "params"}
    assert defaults["lr"] == 4e-4
    assert {k: defaults[k] for k in ("momentum_decay", "chunk", "topk", "sign", "weight_decay")} == \
        {"momentum_decay": 0.999, "chunk": 64, "topk": 32, "sign": True, "weight_decay": 0.0}


# --------------------------------------------------------------------------- the scheme
def test_decoupled_scheme_parses_and_checks_its_options():
    s = parse_scheme("decoupled:topk=32,chunk=64")
    assert s.kind == "decoupled" and s.demo == {"topk": 32, "chunk": 64}
    assert parse_scheme("decoupled:values=bf16,sign=false").demo == {"values": "bf16", "sign": False}
    for bad, match in [("decoupled:bogus=1", "unknown option 'bogus'"), ("decoupled:sign=1", "sign must be"),
                       ("decoupled:topk=0", "topk must be"), ("decoupled:lr=fast", "lr must be a number"),
                       ("decoupled:values=nosuch", "values: unknown codec")]:
        with pytest.raises(ValueError, match=match):
            parse_scheme(bad)


def test_decoupled_run_config_uses_demo_with_the_tasks_adam_lr():
    from gradcompress.cli.task import RunConfig

    lm = RunConfig(scheme="decoupled:topk=16", task="lm")
    assert lm.kind() == "decoupled" and lm.learning_rate() == 3e-3 and not lm.momentum_corrected()
    assert lm.demo_options() == {"topk": 16, "lr": 3e-3}
    assert lm.optimizer_text() == ("DeMo(lr=0.003, momentum_decay=0.999, chunk=64, topk=16, sign=True, "
                                   "weight_decay=0, cosine)")
    assert RunConfig(scheme="decoupled:lr=0.01").learning_rate() == 0.01


# --------------------------------------------------------------------------- several processes
@pytest.fixture(scope="module")
def ckpt_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("demo_ckpt")


@pytest.fixture(scope="module", params=[2, 4], ids=lambda w: f"world{w}")
def checks(request, ckpt_dir):
    world = request.param
    ckpt = (TOTAL, CUT, str(ckpt_dir)) if world == 2 else None
    return world, launch.run(dw.main_checks, world, STEPS, BAD_STEP, ckpt, timeout=120)


def test_full_extraction_is_sgd_without_momentum_on_the_mean(checks):
    _, results = checks
    for r in results:
        assert max(r["sgd"]["plain"]) < 1e-6, r["sgd"]["plain"]
        assert max(r["sgd"]["residual"]) < 1e-6  # the momentum is emptied every step
        assert r["sgd"]["momentum"][-1] > 1e-4  # and it is not SGD with momentum (which the test could not tell)


def test_replicas_equal_after_every_step_while_momenta_differ(checks):
    world, results = checks
    for r in results:
        assert r["sign"]["equal"] == [True] * STEPS
        assert not r["sign"]["momenta_all_equal"]


def expected_payload(shape, chunk: int, topk: int) -> int:
    """The paper's chunking, written out: 2-D blocks when both dims of a matrix divide, else 1-D chunks."""
    rows, numel = shape[0], math.prod(shape)
    if len(shape) >= 2 and rows % chunk == 0 and (numel // rows) % chunk == 0:
        blocks, block = numel // chunk**2, chunk**2
    else:
        blocks, block = -(-numel // chunk), chunk
    return blocks * min(topk, block) * (4 + (1 if block <= 256 else 2))


def test_bytes_per_step_are_the_payload_arithmetic(checks):
    world, results = checks
    per_rank = sum(expected_payload(tuple(p.shape), dw.CHUNK, dw.PARTIAL) for p in dw.make_model().parameters())
    for r in results:
        assert r["sign"]["bytes"] == [(world - 1) * per_rank] * STEPS  # the skipped step sent its payload too
        assert r["sign"]["stats"]["wire_bytes"] == STEPS * (world - 1) * per_rank


def test_an_inf_on_one_rank_skips_the_step_everywhere(checks):
    _, results = checks
    for r in results:
        s = r["sign"]
        assert s["changed"] == [step != BAD_STEP for step in range(STEPS)]
        assert s["bad_state_same"]
        assert s["stats"]["skipped"] == 1 and s["stats"]["steps"] == STEPS


def test_checkpoint_resumes_bit_for_bit(checks):
    world, results = checks
    if world != 2:
        pytest.skip("the checkpoint runs on 2 workers")
    for r in results:
        assert r["ckpt"]["params_equal"] and r["ckpt"]["momenta_equal"]
        assert r["ckpt"]["dtypes"] == ["torch.float32"]


def test_hierarchical_topology_is_refused_on_every_rank(checks):
    world, results = checks
    if world < 4:
        pytest.skip("2 nodes of 2 workers need 4")
    for r in results:
        assert "hierarchical" in r["hierarchical"] and "topology='flat'" in r["hierarchical"]
