"""gradcompress.optim.muon: Muon on the hidden 2-D weights, AdamW on the rest, one torch Optimizer; under DDP and
as DiLoCo's inner optimizer with int2 outer gradients (MuLoCo) on gloo workers."""

import copy

import pytest
import torch
import torch.nn as nn

import diloco_workers as dw
import muon_workers as mw
from gradcompress.optim import DiLoCo, muon
from gradcompress.optim.muon import split_parameters
from gradcompress.scheme import parse_scheme
from gradcompress.testbed import launch, lm

TIMEOUT = 240


def _toy(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Embedding(50, 24), nn.Linear(24, 40), nn.GELU(), nn.LayerNorm(40), nn.Linear(40, 50))


def _step(model, opt, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, 50, (8, 5), generator=g)
    opt.zero_grad()
    nn.functional.cross_entropy(model(x).reshape(-1, 50), x.reshape(-1)).backward()
    opt.step()


def test_hidden_weights_are_muons_and_the_rest_adamws():
    muons, adamws = split_parameters(lm.make_model(0))
    assert muons == [f"blocks.{b}.{n}.weight" for b in (0, 1) for n in ("qkv", "proj", "mlp.0", "mlp.2")]
    assert {"tok.weight", "pos", "head.weight", "ln.weight", "ln.bias", "blocks.0.qkv.bias"} <= set(adamws)
    assert len(muons) + len(adamws) == len(list(lm.make_model(0).parameters()))
    model = _toy()
    assert split_parameters(model) == (["1.weight"], ["0.weight", "1.bias", "3.weight", "3.bias", "4.weight", "4.bias"])
    assert split_parameters(model, head=["1", "4"])[0] == []  # both Linears named as heads: AdamW's
    tied = nn.Sequential(nn.Embedding(50, 24), nn.Linear(24, 50), nn.Linear(50, 50))
    tied[1].weight = tied[0].weight  # a hidden Linear sharing the embedding's table stays with AdamW
    assert split_parameters(tied) == ([], ["0.weight", "1.bias", "2.weight", "2.bias"])


@pytest.mark.parametrize("kwargs, match", [({"head": "nope"}, "names no module"), ({"lr": -1.0}, "lr must be"),
                                           ({"adamw_lr": float("nan")}, "adamw_lr must be")])
def test_bad_arguments_are_refused(kwargs, match):
    with pytest.raises(ValueError, match=match):
        muon(_toy(), **kwargs)
    with pytest.raises(TypeError, match="expects the model"):
        muon(list(_toy().parameters()))


def test_each_part_steps_by_its_own_rule():
    """One step against torch's Muon alone on the hidden weight and AdamW alone on the rest (bit for bit); and the
    rule itself: Muon's update (lr and RMS scaling removed) is orthogonalised, singular values near 1 whatever the
    gradient's; AdamW's first step moves every coordinate by lr (m / sqrt(v) = +-1)."""
    lr = 0.01
    model, ref = _toy(), _toy()
    opt = muon(model, adamw_lr=lr, weight_decay=0.0, ns_dtype=torch.bfloat16)  # torch's own precision
    hidden = [ref[1].weight]
    rest = [p for n, p in ref.named_parameters() if n != "1.weight"]
    refs = [torch.optim.Muon(hidden, lr=lr, weight_decay=0.0, adjust_lr_fn="match_rms_adamw"),
            torch.optim.AdamW(rest, lr=lr, weight_decay=0.0, betas=(0.9, 0.95))]
    before = copy.deepcopy(model)
    _step(model, opt, 1)
    for o in refs:
        o.zero_grad()
    g = torch.Generator().manual_seed(1)
    x = torch.randint(0, 50, (8, 5), generator=g)
    nn.functional.cross_entropy(ref(x).reshape(-1, 50), x.reshape(-1)).backward()
    grad = ref[1].weight.grad.clone()
    for o in refs:
        o.step()
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), ref.parameters()))
    a, b = model[1].weight.shape
    update = (before[1].weight - model[1].weight).detach() / (lr * 0.2 * max(a, b) ** 0.5)
    sv, gsv = torch.linalg.svdvals(update), torch.linalg.svdvals(grad)
    assert 0.5 < float(sv.min()) and float(sv.max()) < 1.5, sv
    assert float(gsv.max() / gsv.min()) > 5  # the raw gradient is far from orthogonal: the test can fail
    moved = (before[4].weight - model[4].weight).detach().abs()
    assert torch.allclose(moved[moved > 0], torch.full_like(moved[moved > 0], lr), rtol=1e-3)


def test_float32_newton_schulz_is_the_same_rule():
    """The default on CPU (float32 iterations) against torch's bfloat16 ones: the same update up to bfloat16's
    rounding, and still orthogonalised."""
    steps = {}
    for dtype in (None, torch.bfloat16):
        model = _toy()
        before = model[1].weight.detach().clone()
        _step(model, muon(model, adamw_lr=0.01, weight_decay=0.0, ns_dtype=dtype), 1)
        steps[dtype] = before - model[1].weight.detach()
    assert not torch.equal(steps[None], steps[torch.bfloat16])  # really computed apart
    assert float((steps[None] - steps[torch.bfloat16]).norm() / steps[None].norm()) < 0.05
    sv = torch.linalg.svdvals(steps[None] / (0.01 * 0.2 * 40 ** 0.5))
    assert 0.5 < float(sv.min()) and float(sv.max()) < 1.5, sv
    with pytest.raises(ValueError, match="ns_dtype must be"):
        muon(_toy(), ns_dtype="float32")


def test_one_optimizer_to_schedulers_zero_grad_and_checkpoints():
    model = _toy()
    opt = muon(model, adamw_lr=3e-3)
    assert [g["optimizer"] for g in opt.param_groups] == ["muon", "adamw"]
    assert isinstance(opt, torch.optim.Optimizer)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.5 ** s)
    for s in range(3):
        _step(model, opt, s)
        sched.step()
    assert [g["lr"] for g in opt.param_groups] == [3e-3 * 0.125] * 2
    assert opt._muon.param_groups[0]["lr"] == opt._adamw.param_groups[0]["lr"] == 3e-3 * 0.125  # the parts see it
    opt.zero_grad()
    assert all(p.grad is None for p in model.parameters())
    saved = copy.deepcopy((model.state_dict(), opt.state_dict(), sched.state_dict()))
    for s in range(3, 6):
        _step(model, opt, s)
        sched.step()
    again = _toy(seed=5)
    again.load_state_dict(saved[0])
    opt2 = muon(again, adamw_lr=1.0)  # its own lr: the checkpoint's wins
    sched2 = torch.optim.lr_scheduler.LambdaLR(opt2, lambda s: 0.5 ** s)
    opt2.load_state_dict(saved[1])
    sched2.load_state_dict(saved[2])
    assert opt2._muon.state is opt2.state and opt2._muon.param_groups[0] is opt2.param_groups[0]
    for s in range(3, 6):
        _step(again, opt2, s)
        sched2.step()
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), again.parameters()))


def test_single_process_diloco_over_muon_with_int2():
    model = _toy()
    with launch.one_process_group():
        opt = DiLoCo(model, muon(model, adamw_lr=1e-2), sync_every=2, codec="int2")
        for s in range(4):
            _step(model, opt, s)
    assert opt.stats()["syncs"] == 2 and opt.compressor.residual  # int2 is biased: error feedback on
    assert all(torch.equal(p, a) for p, a in zip(opt.params, opt.anchor))


def test_scheme_option_inner():
    s = parse_scheme("int2:diloco=100,inner=muon")
    assert s.inner == "muon" and s.diloco == 100 and s.canonical().endswith("diloco=100,inner=muon")
    assert parse_scheme("int4:diloco=5").inner is None
    with pytest.raises(ValueError, match="give it with diloco=H"):
        parse_scheme("int2:inner=muon")
    with pytest.raises(ValueError, match="inner must be one of task, muon"):
        parse_scheme("int2:diloco=5,inner=lion")


# --------------------------------------------------------------------------- on gloo workers
@pytest.mark.slow
@pytest.mark.parametrize("codec", [None, "int8"])
def test_under_ddp_the_replicas_stay_equal(codec):
    for equal, moved in launch.run(mw.under_ddp, 2, codec, timeout=TIMEOUT):
        assert equal == [True] * 4 and moved > 0


@pytest.mark.slow
def test_muloco_replicas_equal_at_every_sync():
    for equal, stats, residual_keys in launch.run(mw.diloco_replicas, 4, timeout=TIMEOUT):
        assert equal == [False, False, True, False, False, True], equal
        assert stats["syncs"] == 2 and residual_keys  # int2 biased: error feedback kept residuals


@pytest.mark.slow
def test_muloco_error_feedback_invariant_on_the_outer_deltas():
    """sum of outer deltas = sum of what the anchor received + the final residual (one worker: nothing else
    quantises); each residual smaller than what was fed (int2 is a contraction)."""
    gap, scale, contraction, residual = launch.run(mw.diloco_error_feedback, 1, timeout=TIMEOUT)[0]
    assert residual > 0 and scale > 0
    assert gap < 1e-5 * max(1.0, scale), (gap, scale)
    assert all(0 < c < 1 for c in contraction), contraction


@pytest.mark.slow
def test_muloco_resume_mid_interval_is_bit_exact(tmp_path):
    for full, resumed, stats in launch.run(dw.resume, 2, "int2", str(tmp_path / "ck"), 8, 5, 3, "muon",
                                           timeout=TIMEOUT):
        assert all(torch.equal(a, b) for a, b in zip(full, resumed))
        assert stats["syncs"] == 2 and stats["steps"] == 8
