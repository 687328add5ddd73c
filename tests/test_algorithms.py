"""PowerSGD, DGC and compression schedules: properties from the papers, on real gloo workers."""

import math

import pytest
import torch

import algo_workers
from gradcompress import make
from gradcompress.testbed import launch
from gradcompress.codecs.sparse import DGC_STAGES, dgc_density
from gradcompress.schedule import codec_at, ramp_rank, ramp_ratio

TIMEOUT = 180


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("r", [1, 2])
def test_powersgd_exact_on_low_rank_average_and_linear(world, r):
    results = launch.run(algo_workers.powersgd_low_rank, world, r, timeout=TIMEOUT)
    for rank_result in results:
        for step, rec in enumerate(rank_result):
            for got, avg in zip(rec["result"], rec["averaged"]):
                assert torch.allclose(got, avg, rtol=1e-4, atol=1e-5 * float(avg.abs().max())), (step, "exactness")
            if rec["reference"] is not None:  # the averaged result is PowerSGD of the averaged gradient
                for got, ref in zip(rec["result"], rec["reference"]):
                    assert torch.allclose(got, ref, rtol=1e-4, atol=1e-5 * float(ref.abs().max()))
    for a, b in zip(results[0][-1]["result"], results[-1][-1]["result"]):
        assert torch.equal(a, b)


def test_powersgd_many_buckets_no_deadlock():
    specs = ["powersgd:rank=1", "powersgd:rank=2", "powersgd:rank=1,alternate=true"]
    results = launch.run(algo_workers.powersgd_many_buckets, 4, specs, timeout=TIMEOUT)
    for spec in specs:
        params = [r[spec]["params"] for r in results]
        for other in params[1:]:
            assert all(torch.equal(a, b) for a, b in zip(params[0], other)), spec
        assert results[0][spec]["stats"]["ratio"] > 2, spec


def test_dgc_ratio_one_reproduces_sgd_momentum():
    dgc, sgd = launch.run(algo_workers.dgc_vs_sgd_momentum, 1, timeout=TIMEOUT)[0]
    for a, b in zip(dgc, sgd):
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-6)


def test_dgc_density_schedule_pure():
    warm = 8
    assert [dgc_density(t, warm, 0.001) for t in range(10)] == [
        0.25, 0.25, 0.0625, 0.0625, 0.015625, 0.015625, 0.00390625, 0.00390625, 0.001, 0.001]
    assert DGC_STAGES == (0.25, 0.0625, 0.015625, 0.00390625)
    assert dgc_density(0, 4, 0.5) == 0.5  # never below the target ratio
    assert dgc_density(3, 0, 0.01) == 0.01


def test_dgc_density_schedule_on_the_wire():
    densities = launch.run(algo_workers.dgc_density_trace, 1, 8, 10, timeout=TIMEOUT)[0]
    targets = [dgc_density(t, 8, 0.001) for t in range(10)]
    for got, want in zip(densities, targets):
        assert want / 2 <= got <= 2 * want, (densities, targets)


def test_schedules():
    topk = make("topk:ratio=0.01")
    assert codec_at(topk, 0, 3, None, 0) is None and codec_at(topk, 2, 3, None, 0) is None
    assert codec_at(topk, 3, 3, None, 0) is topk
    ratios = [codec_at(topk, 3 + t, 3, "exp", 10).ratio for t in range(12)]
    assert ratios[0] == 1.0 and ratios[-1] == 0.01 and ratios[10] == 0.01
    assert all(a > b for a, b in zip(ratios[:10], ratios[1:11]))  # strictly tightening
    assert math.isclose(ratios[5], 0.1)  # exponential: halfway is the geometric mean
    assert ramp_rank(0, 10, 2) == 16 and ramp_rank(10, 10, 2) == 2
    assert ramp_ratio(0, 0, 0.3) == 0.3
    ranks = [codec_at(make("powersgd:rank=2"), t, 0, "exp", 6).rank for t in range(8)]
    assert ranks[0] == 16 and ranks[-1] == 2 and ranks == sorted(ranks, reverse=True)


@pytest.mark.parametrize("spec", ["qsgd", "terngrad", "int8:stochastic=true", "randomk:scale=true"])
def test_error_feedback_with_unbiased_codec_warns(spec):
    from gradcompress import Compressor

    with pytest.warns(UserWarning, match="error feedback"):
        Compressor(spec, error_feedback=True)
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert Compressor(spec).error_feedback is False  # the default ("auto") resolves off, silently
        Compressor(spec, error_feedback=False)
        Compressor("topk:ratio=0.01")


@pytest.mark.parametrize("spec, expected", [
    ("topk:ratio=0.01", True), ("sign", True), ("int4", True), ("int8", True), ("powersgd:rank=2", True),
    ("dgc:ratio=0.01", True), ("threshold", True), ("randomk:ratio=0.1", True),
    ("terngrad", False), ("qsgd", False), ("qsgd:levels=4", False), ("int8:stochastic=true", False),
    ("randomk:ratio=0.1,scale=true", False), ("none", False), ("fp16", False), ("bf16", False),
])
def test_error_feedback_auto_follows_the_codecs_bias(spec, expected):
    from gradcompress import Compressor

    comp = Compressor(spec)
    assert comp.error_feedback is expected
    assert Compressor(spec, error_feedback="auto").error_feedback is expected
    if expected or Compressor(spec).codec.exact or not Compressor(spec).codec.unbiased:
        assert Compressor(spec, error_feedback=not expected).error_feedback is (not expected)
    else:
        with pytest.warns(UserWarning, match="unbiased codec"):
            assert Compressor(spec, error_feedback=True).error_feedback is True


@pytest.mark.parametrize("bad", [1, "yes", None])
def test_error_feedback_rejects_other_values(bad):
    from gradcompress import Compressor

    with pytest.raises(ValueError, match="error_feedback must be True, False or 'auto'"):
        Compressor("int8", error_feedback=bad)
