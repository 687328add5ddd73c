"""Robust by default: overflow rollback of every state, DDP subgroups, memory formats, server error
feedback, momentum correction, checkpoints of the new state. Real gloo workers, each launch with a
timeout so a deadlock fails instead of hanging CI."""

import math
import pytest
import torch

import robust_workers as rw
from gradcompress.testbed import launch

pytestmark = pytest.mark.slow  # multi-process runs: outside the fast lane (pytest -m "not slow")

TIMEOUT = 240
OVERFLOW_SCHEMES = ["dgc:ratio=0.05", "topk:ratio=0.05", "powersgd:rank=2", "sign", "int8", "fp16:momentum=0.9",
                    "sign:momentum=0.9,server_error_feedback=true", "int4:server_error_feedback=true"]


@pytest.mark.parametrize("where, warmup", [("bias", 0), ("weight", 0), ("bias", 4)],
                         ids=["dense-bias", "compressed-weight", "during-warmup"])
def test_overflow_anywhere_rolls_back_every_state(where, warmup):
    """Inf on one rank in a tensor that travels dense, a compressed one, or during the dense warm-up:
    non-finite on every rank that step, nothing committed, finite again from the next step."""
    results = launch.run(rw.overflow_runs, 2, OVERFLOW_SCHEMES, where, warmup, timeout=TIMEOUT)
    for scheme in OVERFLOW_SCHEMES:
        for r in results:
            r = r[scheme]
            assert r["finite_per_step"] == [True, True, False, True, True], (scheme, r["finite_per_step"])
            assert r["state_unchanged"], (scheme, "state changed on the overflow step")
            assert r["state_finite"], (scheme, "an Inf reached the compression state")
            assert r["step"] == 4 and r["skipped"] == 1, (scheme, r["step"], r["skipped"])
            if warmup == 0:
                assert r["had_state"], scheme
        a, b = (results[i][scheme]["params"] for i in range(2))
        assert all(torch.equal(x, y) and bool(torch.isfinite(x).all()) for x, y in zip(a, b)), scheme


def test_ddp_on_subgroups_averages_within_each_group():
    results = launch.run(rw.subgroups, 4, ["none", "int8"], timeout=TIMEOUT)
    for rank, r in enumerate(results):
        pair = [rank - rank % 2, rank - rank % 2 + 1]
        local = r["none"]["local"]
        expected = [(local[pair[0]][i] + local[pair[1]][i]) / 2 for i in range(len(local[0]))]
        assert r["none"]["group_size"] == 2
        assert all(torch.allclose(g, e, rtol=1e-5, atol=1e-7) for g, e in zip(r["none"]["grads"], expected))
        world_mean = [sum(local[k][i] for k in range(4)) / 4 for i in range(len(local[0]))]
        assert not all(torch.allclose(g, e, rtol=1e-3) for g, e in zip(r["none"]["grads"], world_mean))
        partner = results[pair[0] if rank % 2 else pair[1]]
        assert all(torch.equal(a, b) for a, b in zip(r["int8"]["grads"], partner["int8"]["grads"]))
        assert "process_group" in r["mismatch"], r["mismatch"]
    other = results[2]["int8"]["grads"]
    assert not all(torch.equal(a, b) for a, b in zip(results[0]["int8"]["grads"], other))


def test_channels_last_gradients_in_synchronize():
    specs = ["powersgd:rank=2", "powersgd:rank=1,alternate=true", "int8", "topk:ratio=0.05", "sign"]
    results = launch.run(rw.memory_formats, 2, specs, timeout=TIMEOUT)
    for r in results:
        for spec in specs:
            (cl, cl_layouts), (contig, contig_layouts) = r[spec]
            assert all(cl_layouts) and not any(contig_layouts), spec  # the test really had channels_last grads
            for a_step, b_step in zip(cl, contig):
                assert all(torch.equal(a, b) for a, b in zip(a_step, b_step)), spec


@pytest.mark.parametrize("codec", ["sign", "int4"])
def test_server_error_feedback_removes_the_bias_of_the_second_quantisation(codec):
    """4 workers, fixed per-rank gradients: with worker and server error feedback the running mean
    of the delivered averages converges to the exact average (error ~ 1/T); with worker error
    feedback alone it stalls at the bias of the chunk owners' re-quantisation."""
    steps = (30, 60, 120)
    results = launch.run(rw.fixed_gradients_pair, 4, [f"{codec}:server_error_feedback=true", codec], 120, steps,
                         timeout=TIMEOUT)
    for a, b in results:
        assert a[120] < a[60] < a[30], a  # still converging
        assert a[120] < 0.5 * b[120], (a, b)
        assert a[120] < {"sign": 0.15, "int4": 0.01}[codec], (a, b)


def test_momentum_correction_sends_the_momentum_of_the_average():
    results = launch.run(rw.momentum_correction, 2, timeout=TIMEOUT)
    for diffs, keys in results:
        assert max(diffs) < 1e-5, diffs
        assert keys == ["0", "1"]


def test_checkpoint_resume_is_exact_with_server_residuals_and_momentum(tmp_path):
    schemes = ["sign:momentum=0.9,server_error_feedback=true", "int4:server_error_feedback=true",
               "topk:ratio=0.05,momentum=0.9"]
    path = str(tmp_path / "ckpt")
    full = launch.run(rw.checkpoint_runs, 2, schemes, 6, -1, path, False, timeout=TIMEOUT)
    launch.run(rw.checkpoint_runs, 2, schemes, 6, 3, path, False, timeout=TIMEOUT)
    resumed = launch.run(rw.checkpoint_runs, 2, schemes, 6, -1, path, True, timeout=TIMEOUT)
    for rank in range(2):
        for scheme in schemes:
            params, sizes = full[rank][scheme]
            assert all(torch.equal(a, b) for a, b in zip(params, resumed[rank][scheme][0])), (scheme, rank)
            assert sizes["residual"] > 0
            if "momentum" in scheme:
                assert sizes["momentum"] > 0, scheme
            if "server" in scheme:
                assert sizes["server_residual"] > 0, scheme


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64])
def test_all_finite_matches_isfinite_all(dtype):
    from gradcompress.step import all_finite

    g = torch.Generator().manual_seed(0)
    assert bool(all_finite(torch.empty(0, dtype=dtype)))
    for n in (1, 7, 1000, 70_000):
        x = (torch.randn(n, generator=g) * 1e4).to(dtype)
        assert bool(all_finite(x)) and all_finite(x).shape == ()
        for bad in (math.nan, math.inf, -math.inf):
            for pos in (0, n // 2, n - 1):
                y = x.clone()
                y[pos] = bad
                assert not bool(all_finite(y)), (dtype, n, bad, pos)
                assert bool(all_finite(y)) == bool(torch.isfinite(y).all())


@pytest.mark.parametrize("spec", ["int8", "sign", "topk:ratio=0.05", "randomk:ratio=0.2", "powersgd:rank=2"])
def test_recycled_buffers_change_nothing(spec):
    """Residuals written into recycled buffers and the persistent input workspace give bit for bit what
    fresh allocations give, through a skipped non-finite step too (single process)."""
    import gradcompress
    from gradcompress.collectives import LocalCollectives

    g = torch.Generator().manual_seed(3)
    steps = [[torch.randn(64, 48, generator=g), torch.randn(300, generator=g)] for _ in range(6)]
    steps[3][0][5, 7] = math.inf
    reused, fresh = gradcompress.Compressor(spec, min_numel=0), gradcompress.Compressor(spec, min_numel=0)
    pa = [torch.nn.Parameter(torch.zeros(64, 48)), torch.nn.Parameter(torch.zeros(300))]
    pb = [torch.nn.Parameter(torch.zeros(64, 48)), torch.nn.Parameter(torch.zeros(300))]
    for grads in steps:
        for params, comp in ((pa, reused), (pb, fresh)):
            for p, t in zip(params, grads):
                p.grad = t.clone()
            comp.synchronize(params, collectives=LocalCollectives(1))  # a single process, explicitly
        fresh.state.spare.clear()
        fresh.workspace.clear()
        for a, b in zip(pa, pb):
            torch.testing.assert_close(a.grad, b.grad, rtol=0, atol=0, equal_nan=True)
        for key, r in fresh.state.slots["residual"].items():
            assert torch.equal(reused.state.slots["residual"][key], r)
    assert reused.stats()["skipped"] == 1 and reused.state.spare  # buffers were recycled


FUSED_SCHEMES = ["int8", "int4", "sign", "sign:bucket=64", "topk:ratio=0.05", "topk:ratio=0.01,values=int8",
                 "threshold:value=1.0", "int8:momentum=0.9", "powersgd:rank=2",
                 "sign:server_error_feedback=true", "int4:bucket=64,server_error_feedback=true",
                 "int8|bf16", "sign:server_error_feedback=true|bf16", "topk:ratio=0.05|bf16",
                 "powersgd:rank=2,alternate=true", "randomk:ratio=0.1", "randomk:ratio=0.1|bf16"]


@pytest.mark.parametrize("world", [3])  # 3: chunks of uneven tensors are padded, one rank owns less
def test_fused_error_feedback_is_bit_for_bit_the_reference(world):
    """Error feedback inside the encode (the default path) against the reference path (x + residual stored,
    a full decode subtracted) on real gloo ranks: the same delivered gradients and residuals bit for bit at
    every step, through a NaN on one rank (the step is skipped on every rank; the finiteness is read from
    the received payloads, not from a flag round)."""
    results = launch.run(rw.fused_versus_reference, world, FUSED_SCHEMES, timeout=TIMEOUT)
    for scheme in FUSED_SCHEMES:
        for r in results:
            assert r[scheme]["agree"], scheme
            assert r[scheme]["finite"] == [True, True, False, True, True], (scheme, r[scheme]["finite"])
            assert r[scheme]["residuals"] == (2 if "powersgd" in scheme else 3), scheme  # vectors go dense


@pytest.mark.parametrize("spec", ["int4"])  # packed codes: the harder layout
def test_whole_group_scales_stay_per_tensor(spec):
    """In the whole-group two-step reduce every tensor starts on a bucket edge: a tiny tensor between two huge
    ones keeps its own scales (error within two quantisation levels of its own range on 3 ranks), where a
    bucket shared with a neighbour would give it an error of the neighbour's size (1e9 times larger)."""
    results = launch.run(rw.mixed_magnitudes, 3, spec, timeout=TIMEOUT)
    levels = 127 if spec == "int8" else 7
    for r in results:
        for err, amax in r:
            assert err <= 2 * amax / levels, (spec, err, amax)
        assert r[1][0] < 1e-6  # the tiny tensor: errors of its own magnitude, not of its neighbours'
