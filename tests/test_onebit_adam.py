"""gradcompress.optim.OneBitAdam: warm-up = torch Adam, 1-bit bytes, replicas, dtypes, checkpoints.

The multi-process checks are batched: one launch per world size runs every per-step
check (tests/onebit_workers.py), and is shared by the tests through a module fixture.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.nn as nn

import onebit_workers as ow
from gradcompress.testbed import launch
from gradcompress.optim import OneBitAdam

pytestmark = pytest.mark.slow  # multi-process runs: outside the fast lane (pytest -m "not slow")

WARMUP, COMPRESSED = 4, 6
#: checkpoint test: steps in all, the step after which the checkpoint is taken, warm-up
#: (the cut comes after the warm-up, so the error buffers and frozen variance matter)
TOTAL, CUT, CKPT_WARMUP = 9, 5, 3


@pytest.fixture(scope="module")
def ckpt_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("onebit_ckpt")


@pytest.fixture(scope="module", params=[2, 4], ids=lambda w: f"world{w}")
def checks(request, ckpt_dir):
    """One launch per world size runs every multi-process check; the 2-worker one also saves the checkpoint."""
    world = request.param
    ckpt = (TOTAL, CUT, CKPT_WARMUP, str(ckpt_dir)) if world == 2 else None
    return world, launch.run(ow.main_checks, world, WARMUP, COMPRESSED, ckpt, timeout=120)


@pytest.fixture
def one_thread():
    """Single-process tests: one intra-op thread (the machine is shared; oversubscription is slow)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


# --------------------------------------------------------------------------- multi-process
def test_warmup_equals_torch_adam_on_averaged_gradient(checks):
    world, results = checks
    for r in results:
        assert r["warmup_max_diff"] <= 1e-6, r["warmup_max_diff"]
        dense = 2 * (world - 1) * 4 * r["numel"] // world
        assert r["warmup_bytes"] == [dense] * WARMUP


def test_compressed_bytes_at_most_one_25th_of_dense(checks):
    world, results = checks
    for r in results:
        dense = 2 * (world - 1) / world * 4 * r["numel"]
        assert len(r["compressed_bytes"]) == COMPRESSED
        for sent in r["compressed_bytes"]:
            assert 0 < sent <= dense / 25, (sent, dense, dense / sent)
        st = r["stats"]
        assert st["steps"] == WARMUP + COMPRESSED
        assert st["compressed_steps"] == COMPRESSED
        assert st["skipped"] == 0
        assert st["wire_bytes"] == sum(r["warmup_bytes"]) + sum(r["compressed_bytes"])


def test_replicas_identical_after_compressed_steps(checks):
    world, results = checks
    for r in results[1:]:
        assert torch.equal(r["params"], results[0]["params"])
    assert torch.isfinite(results[0]["params"]).all()


def test_state_is_float32_with_chunk_sized_server_residual(checks):
    world, results = checks
    from gradcompress.exchanges.layout import chunk_numel
    from gradcompress.exchanges.layout import CHUNK_BLOCK

    r = results[0]
    assert set(r["state_dtypes"]) == {"step", "exp_avg", "exp_avg_sq", "worker_error", "server_error"}
    assert set(r["state_dtypes"].values()) == {"torch.float32"}
    first_weight = 256 * ow.IN
    assert r["server_numel"] == chunk_numel(first_weight, world, CHUNK_BLOCK)


@pytest.mark.parametrize("dtype", ["torch.float16", "torch.bfloat16"])
def test_low_precision_params_run_and_stay_finite(checks, dtype):
    world, results = checks
    for r in results:
        d = r[dtype]
        assert d["finite"] and d["changed"]
        assert d["dtypes"] == [dtype]
        assert d["state_dtypes"] == ["torch.float32"]
        assert d["compressed_steps"] == 4
    for r in results[1:]:
        assert torch.equal(r[dtype]["params"], results[0][dtype]["params"])


def test_group_of_size_one_is_the_single_process_path(checks, one_thread):
    world, results = checks
    if world != 2:
        pytest.skip("checked in the 2-worker launch")
    for rank, r in enumerate(results):
        assert r["solo_bytes"] == 0
        assert torch.equal(r["solo_params"], ow.single_process_run(rank, 2, 5))


def test_checkpoint_resume_is_bit_identical(checks, ckpt_dir):
    world, results = checks
    if world != 2:
        pytest.skip("checkpoint saved by the 2-worker launch")
    full = [r["ckpt_full"] for r in results]
    resumed = launch.run(ow.ckpt_resume, world, TOTAL, CUT, CKPT_WARMUP, str(ckpt_dir), timeout=90)
    for f, r in zip(full, resumed):
        assert torch.equal(f, r)
    assert torch.equal(full[0], full[1])


# --------------------------------------------------------------------------- single process
def regression(seed=0):
    torch.manual_seed(seed)
    x = torch.randn(256, 16)
    y = (x[:, :4].sum(1, keepdim=True)).sin()
    model = nn.Sequential(nn.Linear(16, 64), nn.Tanh(), nn.Linear(64, 1))
    return model, x, y


def test_single_process_warmup_is_torch_adam_bit_exact_and_loss_decreases(one_thread):
    model, x, y = regression()
    ref = copy.deepcopy(model)
    opt = OneBitAdam(model.parameters(), lr=1e-2, weight_decay=0.01, warmup_steps=10)
    ref_opt = torch.optim.Adam(ref.parameters(), lr=1e-2, weight_decay=0.01)
    losses = []
    for step in range(100):
        for m, o in ((model, opt), (ref, ref_opt)):
            o.zero_grad()
            loss = nn.functional.mse_loss(m(x), y)
            loss.backward()
            o.step()
        if step < 10:
            for a, b in zip(model.parameters(), ref.parameters()):
                assert torch.equal(a, b), step
        losses.append(nn.functional.mse_loss(model(x), y).item())
    assert losses[-1] < 0.5 * losses[0]
    assert opt.stats()["compressed_steps"] == 90 and opt.bytes_sent() == 0


def test_single_process_checkpoint_low_precision_keeps_float32_state(one_thread):
    def run(model, opt, first, last, x, y):
        for _ in range(first, last):
            opt.zero_grad()
            nn.functional.mse_loss(model(x).float(), y).backward()
            opt.step()

    model, x, y = regression()
    model = model.to(torch.bfloat16)
    xb = x.to(torch.bfloat16)
    start = copy.deepcopy(model.state_dict())
    opt = OneBitAdam(model.parameters(), lr=1e-2, warmup_steps=3)
    run(model, opt, 0, 8, xb, y)
    full = [p.clone() for p in model.parameters()]

    model.load_state_dict(start)
    opt = OneBitAdam(model.parameters(), lr=1e-2, warmup_steps=3)
    run(model, opt, 0, 5, xb, y)
    saved = copy.deepcopy({"model": model.state_dict(), "opt": opt.state_dict()})
    model2, _, _ = regression(seed=7)
    model2 = model2.to(torch.bfloat16)
    opt2 = OneBitAdam(model2.parameters(), lr=1e-2, warmup_steps=3)
    model2.load_state_dict(saved["model"])
    opt2.load_state_dict(saved["opt"])
    for s in opt2.state.values():
        assert {str(v.dtype) for v in s.values()} == {"torch.float32"}
    run(model2, opt2, 5, 8, xb, y)
    for a, b in zip(full, model2.parameters()):
        assert torch.equal(a, b)


def test_state_dict_is_a_copy_and_holds_error_buffers():
    model, x, y = regression()
    opt = OneBitAdam(model.parameters(), warmup_steps=1)
    for _ in range(2):
        opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    sd = opt.state_dict()
    assert set(sd["state"][0]) == {"step", "exp_avg", "exp_avg_sq", "worker_error", "server_error"}
    assert sd["state"][0]["step"].item() == 2
    assert sd["param_groups"][0]["warmup_steps"] == 1
    before = sd["state"][0]["exp_avg"].clone()
    opt.step()
    assert torch.equal(sd["state"][0]["exp_avg"], before)


def test_nonfinite_step_is_skipped_without_touching_state():
    model, x, y = regression()
    opt = OneBitAdam(model.parameters(), warmup_steps=1)
    for bad in (False, True, True):
        opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        if bad:
            next(model.parameters()).grad[0, 0] = float("nan")
            params = [p.clone() for p in model.parameters()]
            state = copy.deepcopy(opt.state_dict()["state"])
        opt.step()
        if bad:
            assert all(torch.equal(a, b) for a, b in zip(params, model.parameters()))
            after = opt.state_dict()["state"]
            assert all(torch.equal(state[k][n], after[k][n]) for k in state for n in state[k])
    assert opt.stats()["skipped"] == 2


@pytest.mark.parametrize("kwargs, match", [
    ({"lr": -1.0}, "lr must be"),
    ({"lr": float("nan")}, "lr must be"),
    ({"lr": "0.1"}, "lr must be a number"),
    ({"betas": (1.0, 0.999)}, r"betas\[0\] must be in \[0, 1\)"),
    ({"betas": (0.9, -0.1)}, r"betas\[1\] must be in \[0, 1\)"),
    ({"betas": 0.9}, "betas must be a pair"),
    ({"eps": 0.0}, "eps must be"),
    ({"weight_decay": -0.1}, "weight_decay must be"),
    ({"warmup_steps": -1}, "warmup_steps must be an integer >= 0"),
    ({"warmup_steps": 2.5}, "warmup_steps must be an integer >= 0"),
    ({"warmup_steps": True}, "warmup_steps must be an integer >= 0"),
])
def test_invalid_arguments_raise_value_error(kwargs, match):
    model = nn.Linear(2, 2)
    with pytest.raises(ValueError, match=match):
        OneBitAdam(model.parameters(), **kwargs)


def test_invalid_group_and_dtype():
    model = nn.Linear(2, 2)
    with pytest.raises(ValueError, match="betas"):
        OneBitAdam([{"params": [model.weight], "betas": (0.9, 1.5)}, {"params": [model.bias]}])
    with pytest.raises(ValueError, match="float32, float16, bfloat16"):
        OneBitAdam(nn.Linear(2, 2).double().parameters())


def test_process_group_without_distributed_is_an_error():
    model, x, y = regression()
    opt = OneBitAdam(model.parameters(), process_group=object())
    nn.functional.mse_loss(model(x), y).backward()
    with pytest.raises(RuntimeError, match="not initialised"):
        opt.step()


def test_update_bias_correction_after_warmup():
    """After warm-up: p -= lr / (1 - b1^t) * m / (sqrt(v_frozen) / sqrt(1 - b2^warmup) + eps)."""
    p = nn.Parameter(torch.tensor([1.0, -2.0, 3.0, 0.5]))
    opt = OneBitAdam([p], lr=0.1, betas=(0.5, 0.9), eps=1e-3, warmup_steps=2)
    for g in ([1.0, 2.0, -1.0, 0.5], [0.5, 1.0, -2.0, 1.0]):
        p.grad = torch.tensor(g)
        opt.step()
    st = opt.state[p]
    v = st["exp_avg_sq"].clone()
    before = p.detach().clone()
    p.grad = torch.tensor([1.0, 1.0, 1.0, 1.0])
    opt.step()
    assert torch.equal(st["exp_avg_sq"], v)  # frozen
    m = st["exp_avg"]
    expected = before - 0.1 / (1 - 0.5**3) * m / (v.sqrt() / math.sqrt(1 - 0.9**2) + 1e-3)
    assert torch.allclose(p.detach(), expected, rtol=1e-6, atol=1e-7)


# --------------------------------------------------------------------------- CompressedAdam: any codec
CA_CODECS = ["none", "topk:ratio=0.05,values=int8", "powersgd:rank=2", "int4"]
CA_WARMUP, CA_TOTAL, CA_CUT = 3, 9, 5


@pytest.fixture(scope="module")
def compressed_adam(tmp_path_factory):
    directory = str(tmp_path_factory.mktemp("compressed_adam"))
    args = (CA_CODECS, CA_WARMUP, CA_TOTAL, CA_CUT, directory)
    first = launch.run(ow.compressed_adam_checks, 2, *args, timeout=120)
    resumed = launch.run(ow.compressed_adam_resume, 2, *args, timeout=120)
    return first, resumed


def test_compressed_adam_with_exact_codec_is_frozen_variance_adam_on_the_average(compressed_adam):
    first, _ = compressed_adam
    for r in first:  # the exchange of 'none' averages the momenta: b1 m + (1 - b1) mean(g) = the reference's
        torch.testing.assert_close(r["none"]["params"], r["reference"], rtol=0, atol=1e-6)


@pytest.mark.parametrize("codec", CA_CODECS)
def test_compressed_adam_replicas_bytes_and_resume(compressed_adam, codec):
    first, resumed = compressed_adam
    a, b = first[0][codec], first[1][codec]
    assert torch.equal(a["params"], b["params"]) and torch.isfinite(a["params"]).all()
    dense = a["sent"][0]  # a warm-up step: the dense float32 all-reduce
    assert dense == 2 * (2 - 1) * 4 * ow.numel(ow.make_model()) // 2
    compressed = a["sent"][CA_WARMUP:]
    assert a["stats"]["compressed_steps"] == CA_TOTAL - CA_WARMUP
    if codec != "none":
        assert max(compressed) < dense / 4, (codec, compressed, dense)
        assert "worker_error" in a["state_keys"]
    if codec.startswith("powersgd"):
        assert "lowrank_q" in a["state_keys"]  # the warm-started factor lives in the optimizer (checkpoints)
    for rank in range(2):  # resumed in fresh processes from the checkpoint at CA_CUT: bit for bit
        assert torch.equal(resumed[rank][codec], first[rank][codec]["params"]), codec


def test_compressed_adam_refuses_codecs_with_their_own_momentum():
    from gradcompress.optim import CompressedAdam

    with pytest.raises(ValueError, match="keeps its own momentum"):
        CompressedAdam(nn.Linear(4, 4).parameters(), codec="dgc:ratio=0.1")
    with pytest.raises(ValueError, match="unknown codec 'nope'"):
        CompressedAdam(nn.Linear(4, 4).parameters(), codec="nope")
