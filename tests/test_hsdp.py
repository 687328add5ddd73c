"""Compressed HSDP (``register_fsdp(model, spec, mesh=...)``) and the compressed parameter all-gather
(``params="int8"``), on 4 real gloo workers as 2 nodes x 2 (ranks 0, 1 | 2, 3).

Every launch has a timeout: a deadlock fails the test instead of hanging CI."""

import math

import pytest
import torch

import hsdp_workers as hw
from fsdp_workers import shard_rows
from gradcompress import make
from gradcompress.testbed import launch
from gradcompress.cli import task
from gradcompress.adapters.fsdp_params import PARAM_BLOCK

pytestmark = pytest.mark.slow  # multi-process runs: outside the fast lane (pytest -m "not slow")

TIMEOUT = 300
WORLD = hw.NODES * hw.PER_NODE
STEPS = 8
SCHEMES = ["native", "none", "int8", "int4", "topk:ratio=0.05"]
GROUPS = [[(64, 32), (64,)], [(48, 64), (48,)], [(10, 48), (10,)]]  # fully_shard per Linear (tests/workers.py)


@pytest.fixture(scope="module")
def fixed():
    return launch.run(hw.fixed_batch_runs, WORLD, SCHEMES, STEPS, timeout=TIMEOUT)


def _shards(full, rank):
    return [shard_rows(g, rank % hw.PER_NODE, hw.PER_NODE) for g in full]


def _mean(tensors_lists):
    return [sum(ts) / len(tensors_lists) for ts in zip(*tensors_lists)]


def _exact(results, rank):
    """This rank's shard of the average over all ranks of the full gradients."""
    return _shards(_mean(results[0]["everyone"]), rank)


def _node_mean_shards(results, rank):
    """Per node: that node's mean gradient, cut as this rank's shard (what the replica exchange averages)."""
    everyone = results[0]["everyone"]
    return [_shards(_mean(everyone[n * hw.PER_NODE:(n + 1) * hw.PER_NODE]), rank) for n in range(hw.NODES)]


def test_none_equals_fsdps_own_hsdp(fixed):
    for rank, r in enumerate(fixed):
        for got, ref in zip(r["none"]["grads"], r["native"]["grads"]):
            assert all(torch.allclose(a, b, rtol=1e-6, atol=1e-8) for a, b in zip(got, ref))
        exact = _exact(fixed, rank)
        assert all(torch.allclose(a, b, rtol=1e-5, atol=1e-7) for a, b in zip(r["native"]["grads"][0], exact))


@pytest.mark.parametrize("scheme, levels", [("int8", 127), ("int4", 7)])
def test_first_step_within_the_two_step_quantisation_bound(fixed, scheme, levels):
    """Round to nearest, twice (each replica's shard, then the owner's re-encode of their mean): the error is at
    most half a step of each, and the decoded mean is no larger than the replicas' mean absmax, so
    |error| <= mean over replicas of absmax(node-mean shard) / levels."""
    for rank, r in enumerate(fixed):
        nodes = _node_mean_shards(fixed, rank)
        bound = sum(max(float(g.abs().max()) for g in shards) for shards in nodes) / len(nodes) / levels
        err = max(float((a - b).abs().max()) for a, b in zip(r[scheme]["grads"][0], _exact(fixed, rank)))
        assert 0 < err <= bound * (1 + 1e-5), (scheme, err, bound)


def test_error_feedback_invariant_on_the_shards(fixed):
    """top-k (gathered, no re-encode), the same batch every step: what was delivered over the steps plus the
    replicas' mean residual (one shard: 1/G of a gradient) is the steps times the exact shard."""
    scheme = "topk:ratio=0.05"
    for rank, r in enumerate(fixed):
        peers = [fixed[p] for p in range(WORLD) if p % hw.PER_NODE == rank % hw.PER_NODE]
        exact, grads = _exact(fixed, rank), r[scheme]["grads"]
        for g, (layer, shapes) in enumerate(zip((0, 2, 4), GROUPS)):
            key = f"fsdp:{layer}"
            residual = sum(p[scheme]["residual"][key] for p in peers) / len(peers)
            assert residual.numel() == sum(math.prod(s) for s in shapes) // hw.PER_NODE  # the shard, 1/G
            delivered = torch.cat([sum(step[2 * g + i] for step in grads).reshape(-1) for i in range(2)])
            target = STEPS * torch.cat([exact[2 * g + i].reshape(-1) for i in range(2)])
            assert torch.allclose(delivered + residual, target, rtol=1e-4, atol=1e-5 * float(target.abs().max()))
            assert float(residual.abs().max()) > 0  # something was held back


def test_replicas_of_a_shard_receive_equal_gradients(fixed):
    for scheme in SCHEMES:
        for rank in range(WORLD):
            peer = (rank + hw.PER_NODE) % WORLD
            for a, b in zip(fixed[rank][scheme]["grads"], fixed[peer][scheme]["grads"]):
                assert all(torch.equal(x, y) for x, y in zip(a, b)), (scheme, rank)


@pytest.mark.parametrize("scheme, at_most", [("int8", 0.27), ("int4", 0.14), ("topk:ratio=0.05", 0.11)])
def test_bytes_between_nodes_against_dense_hsdp(fixed, scheme, at_most):
    """Dense HSDP all-reduces each shard across the 2 replicas: 2 (N-1)/N x 4 bytes x shard per rank per step
    (what 'none' sends, exactly); inside the node only a 4-byte flag per group per step."""
    shard = sum(math.prod(s) for group in GROUPS for s in group) // hw.PER_NODE
    dense = 2 * (hw.NODES - 1) * 4 * shard // hw.NODES
    flag = 2 * (hw.PER_NODE - 1) * 4 // hw.PER_NODE
    for r in fixed:
        none = r["none"]["stats"]
        assert none["inter_node_bytes"] == STEPS * dense
        assert none["intra_node_bytes"] == r[scheme]["stats"]["intra_node_bytes"] == STEPS * len(GROUPS) * flag
        got = r[scheme]["stats"]
        assert got["topology"] == {"nodes": 2, "workers_per_node": 2, "kind": "hierarchical"}
        assert 0 < got["inter_node_bytes"] <= at_most * STEPS * dense, (scheme, got["inter_node_bytes"] / dense)


@pytest.fixture(scope="module")
def training():
    """int8 with SGD on each rank's own batches: straight, resumed at step 3, rank 3 poisoned at step 2."""
    return launch.run(hw.training_variants, WORLD, "int8", 6, 2, 3, timeout=TIMEOUT)


def test_training_replicas_equal_and_resume_bit_for_bit(training):
    for r in training:
        a, b = r["full"], r["resumed"]
        assert all(a["replicas_equal"]) and all(b["replicas_equal"])
        assert all(a["finite"])
        for ga, gb in zip(a["grads"], b["grads"]):
            assert all(torch.equal(x, y) for x, y in zip(ga, gb))


def test_overflow_on_one_rank_rolls_back_everywhere(training):
    for r in training:
        p = r["poisoned"]
        assert p["finite"] == [True, True, False, True, True, True], p["finite"]
        assert p["unchanged"] is True
        assert p["stats"]["skipped"] == 1 and p["stats"]["steps"] == 6
        assert all(p["replicas_equal"])


@pytest.fixture(scope="module")
def params_runs():
    runs = launch.run(hw.params_variants, WORLD, [None, "int8", "bf16"], 3, timeout=TIMEOUT)
    return {p: [r[str(p)] for r in runs] for p in (None, "int8", "bf16")}


def _rank_inputs(full_params, rank, group):
    """Rank ``rank``'s all-gather input of a parameter group: its dim-0 shards, zero-padded, back to back."""
    parts = []
    for p in group:
        rows = -(-p.shape[0] // WORLD)
        piece = torch.zeros((rows, *p.shape[1:]))
        mine = p[rank * rows:(rank + 1) * rows]
        piece[: mine.shape[0]] = mine
        parts.append(piece.reshape(-1))
    return torch.cat(parts)


def test_int8_parameters_within_half_a_step_of_their_block(params_runs):
    for r in params_runs["int8"]:
        for exact, used in zip(r["exact"], r["used"]):
            for g in range(len(GROUPS)):
                for rank in range(WORLD):
                    e = _rank_inputs(exact[2 * g:2 * g + 2], rank, exact[2 * g:2 * g + 2])
                    u = _rank_inputs(used[2 * g:2 * g + 2], rank, used[2 * g:2 * g + 2])
                    for b in range(0, e.numel(), PARAM_BLOCK):
                        block, got = e[b:b + PARAM_BLOCK], u[b:b + PARAM_BLOCK]
                        half = float(block.abs().max()) / 254
                        assert float((got - block).abs().max()) <= half * (1 + 1e-5)
            assert any(not torch.equal(a, b) for a, b in zip(exact, used))  # quantised, not exact


def test_bf16_parameters_are_the_rounded_ones(params_runs):
    for r in params_runs["bf16"]:
        for exact, used in zip(r["exact"], r["used"]):
            assert all(torch.equal(u, e.bfloat16().float()) for u, e in zip(used, exact))


def test_sharded_parameters_stay_exact_given_the_same_gradients(params_runs):
    for exact_run, int8_run in zip(params_runs[None], params_runs["int8"]):
        for a, b in zip(exact_run["sharded"], int8_run["sharded"]):
            assert all(torch.equal(x, y) for x, y in zip(a, b))
        assert exact_run["loss"] != int8_run["loss"]  # the forward did see quantised parameters


def test_params_none_is_unchanged_and_param_bytes_are_the_payloads(params_runs):
    for r in params_runs[None]:
        assert r["stats"]["param_bytes"] == 0
        for exact, used in zip(r["exact"], r["used"]):
            assert all(torch.equal(u, e) for u, e in zip(used, exact))
    codec = make(f"int8:bucket={PARAM_BLOCK}")
    per_gather = [sum(-(-s[0] // WORLD) * math.prod(s[1:]) for s in group) for group in GROUPS]
    # forward and backward (reshard_after_forward) all-gather every group, each rank sending (W-1) payloads
    expected = 3 * 2 * sum((WORLD - 1) * codec.payload_nbytes(n) for n in per_gather)
    dense = 3 * 2 * sum((WORLD - 1) * 4 * n for n in per_gather)
    for r in params_runs["int8"]:
        assert r["stats"]["param_bytes"] == expected
        assert expected <= 0.26 * dense


#: int4 is left out as in tests/test_fsdp.py: int8's exchange with fewer levels (its two-step bound checked above)
HSDP_DIGITS = [("none", None), ("int8", None), ("topk:ratio=0.01", None), ("int8", "int8")]


def test_digits_as_two_nodes_of_two_with_hsdp():
    """SGD lr 0.1, momentum 0.9, library defaults otherwise; 200 steps: int8, top-k 1 % and int8 with int8
    parameters within 2 points of dense HSDP."""
    data = task.load_data(seed=0)
    configs = [task.RunConfig(scheme=s, steps=200, lr=0.1, momentum=0.9, warmup_steps=0, fsdp=True, hsdp=2,
                              params=p) for s, p in HSDP_DIGITS]
    records = launch.run(task.demo_worker, WORLD, data, configs, timeout=900)
    acc = {(c.scheme, c.params): task.summarize([r[i] for r in records], c, WORLD)["test_accuracy"]
           for i, c in enumerate(configs)}
    dense = acc["none", None]
    assert dense > 90, acc
    for key in HSDP_DIGITS[1:]:
        assert acc[key] >= dense - 2.0, acc


def test_auto_decides_the_replica_all_reduce():
    """register_fsdp(model, "auto", mesh=...): each shard's replica all-reduce is a bucket. On a slow link auto
    measures 3 dense steps (bit for bit dense HSDP's), then gives the two large shards int4 (the small one's bytes
    hide behind the others' codec work in its model: dense); the ranks holding a shard stay equal, fewer bytes
    cross between the nodes than dense HSDP sends, and the gradient norm is measured on the shards."""
    auto = launch.run(hw.training_runs, 4, "auto:bandwidth=1mbit", 6, timeout=240)
    dense = launch.run(hw.training_runs, 4, "none", 6, timeout=240)
    for a, d in zip(auto, dense):
        assert all(a["replicas_equal"]) and all(a["finite"])
        assert all(torch.equal(x, y) for ga, gd in zip(a["grads"][:3], d["grads"][:3]) for x, y in zip(ga, gd))
        pilot = a["stats"]["auto"]
        assert pilot["plan"].get("int4", 0) >= 2 and pilot["decided_at"] == 3 and pilot["grad_norm"] > 0
        assert a["stats"]["inter_node_bytes"] < 0.75 * d["stats"]["inter_node_bytes"]


@pytest.fixture(scope="module")
def native():
    return launch.run(hw.native_runs, WORLD, ["none", "int8", "topk:ratio=0.05"], 3, timeout=TIMEOUT)


@pytest.mark.parametrize("scheme", ["none", "int8", "topk:ratio=0.05"])
def test_native_hsdp_is_compressed_as_the_node_layout(native, scheme):
    """A model sharded over the 2-D mesh itself (torchtitan's HSDP) and registered with no mesh: the same
    compressed exchange, step by step, as the layout sharded over mesh['shard'] with mesh= — the replicas'
    all-reduce through the codec, FSDP's reduce-scatter over the shard group — and replicas of a shard equal."""
    for r in native:
        run = r[scheme]
        for got, ref in zip(run["native"]["grads"], run["layout"]["grads"]):
            assert all(torch.allclose(a, b, rtol=1e-6, atol=1e-7) for a, b in zip(got, ref)), scheme
        assert run["native"]["peers_equal"] and run["summed"]["peers_equal"]
        assert run["native"]["stats"]["wire_bytes"] == run["layout"]["stats"]["wire_bytes"]


def test_native_hsdp_with_a_divide_factor_sums_as_fsdp_would(native):
    """torchtitan sets the gradient divide factor to 1.0 (it normalises the loss itself): FSDP's native HSDP then
    sums over every rank; so does the compressed one (``none``: exactly W times FSDP's own mean)."""
    for r in native:
        for got, ref in zip(r["none"]["summed"]["grads"][0], r["reference"]):
            assert torch.allclose(got, WORLD * ref, rtol=1e-5, atol=1e-6)
