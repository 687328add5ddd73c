"""Multi-process behaviour of the exchange layer on real gloo workers (2 and 4 ranks).

Every launch has a timeout: a deadlock fails the test instead of hanging CI.
"""

import os

import pytest
import torch

import workers
from gradcompress.testbed import launch

TIMEOUT = 240


@pytest.fixture(scope="module", params=[2, 4], ids=["2workers", "4workers"])
def matrix(request):
    world = request.param
    return world, launch.run(workers.codec_matrix, world, workers.SPECS, timeout=TIMEOUT)


def _close(a, b, rtol=1e-4, atol=1e-6, scale_atol=False):
    """allclose per tensor; with scale_atol the absolute tolerance is rtol * max|y| (rounding of summands)."""
    return all(torch.allclose(x, y, rtol=rtol, atol=rtol * float(y.abs().max()) if scale_atol else atol)
               for x, y in zip(a, b))


def test_none_equals_ddp_default_allreduce(matrix):
    world, results = matrix
    for rank in range(world):
        ref = results[rank]["ddp_default"]
        for mode in ("small", "large", "sync"):
            got = results[rank]["none"][mode]
            for step, (g, r) in enumerate(zip(got["grads"], ref["grads"])):
                assert _close(g, r, rtol=1e-5, atol=1e-7), (mode, step)


@pytest.mark.parametrize("spec", workers.SPECS)
def test_replicas_identical_with_many_buckets(matrix, spec):
    world, results = matrix
    for mode in ("small", "large", "sync"):
        base = results[0][spec][mode]["params"]
        for rank in range(1, world):
            other = results[rank][spec][mode]["params"]
            assert all(torch.equal(a, b) for a, b in zip(base, other)), (spec, mode, rank)
        assert all(bool(torch.isfinite(p).all()) for p in base)


@pytest.mark.parametrize("spec", workers.SPECS)
def test_result_independent_of_buckets_and_path(matrix, spec):
    """Per-parameter compression: bucket_cap_mb and hook-vs-synchronize do not change results."""
    world, results = matrix
    # 16-bit payloads are summed in 16 bits, in an order that depends on the offset in the
    # all-reduce buffer (ring chunks) once there are more than 2 ranks: allow their rounding.
    rtol = {"fp16": 2 ** -9, "bf16": 2 ** -6}.get(spec, 1e-4)
    kw = {"rtol": rtol, "scale_atol": spec in ("fp16", "bf16")}
    for rank in range(world):
        r = results[rank][spec]
        for step in range(len(r["small"]["grads"])):
            assert _close(r["small"]["grads"][step], r["large"]["grads"][step], **kw), (spec, "bucket", step)
            assert _close(r["small"]["grads"][step], r["sync"]["grads"][step], **kw), (spec, "sync", step)


def test_compression_changes_the_result(matrix):
    """Guard against a path that silently sends dense: lossy codecs must differ from DDP's average."""
    world, results = matrix
    ref = results[0]["ddp_default"]["grads"][0]
    for spec in ("int4", "sign", "topk:ratio=0.05", "powersgd:rank=2"):
        got = results[0][spec]["sync"]["grads"][0]
        assert not _close(got, ref, rtol=1e-3, atol=1e-5), spec


@pytest.mark.parametrize("world", [2, 4])
def test_wire_bytes_match_payload_arithmetic(world):
    results = launch.run(workers.wire_bytes_check, world, workers.SPECS, timeout=TIMEOUT)
    for rank_result in results:
        for spec, (measured, expected) in rank_result.items():
            assert measured == expected, spec
    # the gather path grows with the world size, the two-step and all-reduce paths do not
    assert results[0]["none"][0] > 0


def test_error_feedback_invariant_one_worker():
    specs = [s if not s.startswith("dgc") else s + ",momentum=0" for s in workers.SPECS]
    result = launch.run(workers.ef_invariant, 1, specs, timeout=TIMEOUT)[0]
    for spec, (inputs, delivered, residual, dtypes) in result.items():
        for i, d, r in zip(inputs, delivered, residual):
            assert torch.allclose(d + r, i, rtol=1e-5, atol=1e-4 * float(i.abs().max())), spec
        assert all(dt == torch.float32 for dt in dtypes), spec
        if spec not in ("none",):
            assert any(float(r.abs().max()) > 0 for r in residual) or spec in ("fp16", "bf16", "threshold:value=0.01")


CHECKPOINT_SPECS = ["powersgd:rank=2", "topk:ratio=0.05", "dgc:ratio=0.05", "randomk:ratio=0.1",
                    "int8:stochastic=true", "powersgd:rank=1,alternate=true"]


def test_checkpoint_resume_is_exact(tmp_path):
    path = str(tmp_path / "ckpt")
    full = launch.run(workers.train_checkpoint, 2, CHECKPOINT_SPECS, 6, -1, path, False, timeout=TIMEOUT)
    launch.run(workers.train_checkpoint, 2, CHECKPOINT_SPECS, 6, 3, path, False, timeout=TIMEOUT)
    assert os.path.exists(path + ".0.0")
    resumed = launch.run(workers.train_checkpoint, 2, CHECKPOINT_SPECS, 6, -1, path, True, timeout=TIMEOUT)
    for rank in range(2):
        for spec in CHECKPOINT_SPECS:
            assert all(torch.equal(a, b) for a, b in zip(full[rank][spec], resumed[rank][spec])), (spec, rank)
            # and the run really moved: a resumed run that ignored the checkpoint would differ
            assert not all(torch.equal(a, b) for a, b in zip(full[rank][spec], full[rank]["initial"]))


INF_SPECS = ["int8", "sign", "topk:ratio=0.05", "randomk:ratio=0.1", "powersgd:rank=2", "dgc:ratio=0.05",
             "threshold:value=0.01"]


@pytest.mark.parametrize("mode", ["hook", "synchronize"])
def test_inf_on_one_rank_is_seen_everywhere_and_state_kept(mode):
    results = launch.run(workers.nonfinite_steps, 2, INF_SPECS, mode, timeout=TIMEOUT)
    for spec in INF_SPECS:
        for r in results:
            r = r[spec]
            assert not all(r["finite"]), (spec, "a rank's averaged gradient stayed finite on an overflow step")
            assert r["had_state"] and r["state_unchanged"], spec
            assert r["skipped"], (spec, "GradScaler did not skip the overflow step")
        assert all(torch.equal(a, b) for a, b in zip(results[0][spec]["params"], results[1][spec]["params"]))


def test_mismatched_specs_fail_on_every_rank():
    messages = launch.run(workers.mismatched_specs, 2, ["int8", "int4"], timeout=TIMEOUT)
    for msg in messages:
        assert "configured differently" in msg and "int8" in msg and "int4" in msg


def test_dead_rank_makes_others_fail_not_hang():
    messages = launch.run(workers.dead_peer, 2, "int8", timeout=60, collective_timeout=5)
    assert messages[1] == "left"
    assert messages[0] != "no error" and "Error" in messages[0]


def test_no_sync_accumulation_compresses_once():
    results = launch.run(workers.no_sync_accumulation, 2, "topk:ratio=0.05", timeout=TIMEOUT)
    for (acc_grads, acc_steps), (ref_grads, ref_steps) in results:
        assert acc_steps == ref_steps == 1
        assert _close(acc_grads, ref_grads, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_low_precision_buckets(dtype):
    specs = ["int8", "topk:ratio=0.05", "powersgd:rank=2", "fp16", "sign"]
    results = launch.run(workers.low_precision, 2, specs, dtype, timeout=TIMEOUT)
    for spec in specs:
        a, dtypes = results[0][spec]
        b, _ = results[1][spec]
        assert all(torch.equal(x, y) for x, y in zip(a, b)), spec
        assert all(x.dtype == dtype and bool(torch.isfinite(x).all()) for x in a), spec
        assert all(d == torch.float32 for d in dtypes), spec
        assert bool(dtypes) == (spec != "fp16"), spec  # the 16-bit cast keeps no residual by default


def test_the_state_and_hook_pair_equals_register_ddp_hook():
    results = launch.run(workers.compressor_as_hook, 2, "topk:ratio=0.05", timeout=TIMEOUT)
    for as_object, as_method in results:
        assert _close(as_object, as_method)
