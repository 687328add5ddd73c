"""``"auto"`` in real gloo processes (issue #29): where ranks must agree — the dense plan bit for bit on a fast link,
compression on a slow one, clocks that disagree, a poisoned cache, switches, relayout, nodes, checkpoints, custom
loops, FSDP — and a real link that drops on the namespace testbed. The decision's pure functions: test_auto.py."""

from __future__ import annotations

import pytest
import torch

import auto_workers
from gradcompress.testbed import launch, netns

# ---------------------------------------------------------------------------- real processes
def test_fast_link_is_dense_bit_for_bit():
    """With a fast link auto sends dense: DDP's own all-reduce, bit for bit the dense Compressor's."""
    auto = launch.run(auto_workers.ddp_train, 4, "auto:bandwidth=100gbit", 8, timeout=240)
    dense = launch.run(auto_workers.ddp_train, 4, "none", 8, timeout=240)
    assert auto[0]["digest"] == dense[0]["digest"]
    assert all(r["stats"]["auto"]["plan"] == {"none": 2} for r in auto)  # buckets (DDP makes 2 here), dense
    assert auto[0]["stats"]["auto"]["decisions"] == 1 and auto[0]["stats"]["auto"]["probe_bytes"] > 0
    assert auto[0]["stats"]["wire_bytes"] == dense[0]["stats"]["wire_bytes"]


def test_slow_link_compresses_and_replicas_stay_equal():
    """On a 10 Mbit/s link auto picks int4 for every bucket after its 3 measured dense steps: then it is, bit for bit
    and byte for byte, ``int4`` with 3 warm-up steps."""
    results = launch.run(auto_workers.ddp_train, 4, "auto:bandwidth=10mbit", 10, timeout=240)
    fixed = launch.run(auto_workers.ddp_train, 4, "int4:warmup_steps=3", 10, timeout=240)
    for r in results:
        assert all(r["equal"]) and all(r["same"])
        assert r["plans"][2] == "[]" and set(eval(r["plans"][3])) == {(k, "int4") for k in range(6)}
    assert results[0]["digest"] == fixed[0]["digest"]
    assert results[0]["stats"]["wire_bytes"] == fixed[0]["stats"]["wire_bytes"]
    assert "bucket 0" in results[0]["explain"] and "int4" in results[0]["explain"]


def test_ranks_decide_alike_when_their_clocks_disagree():
    """Rank 1's clock runs 3x fast (its compute and probe times are 3x): every rank still holds the same plan at
    every step, from the gathered numbers, and the replicas stay equal."""
    results = launch.run(auto_workers.ddp_train, 4, "auto:every=2", 10, {}, 3.0, timeout=240)
    for r in results:
        assert all(r["equal"]) and all(r["same"])
    assert results[0]["stats"]["auto"]["decisions"] >= 1


def test_a_poisoned_cache_on_one_rank_cannot_split_the_ranks(tmp_path):
    """Rank 1's calibration cache says every candidate sends 1000x the bytes it does: the ranks' recorded bytes are
    compared at the check, disagree, and every rank records afresh without its cache: one plan (dense, as the
    100 Gbit/s hint calls for) on every rank at every step, replicas equal."""
    results = launch.run(auto_workers.poisoned_cache, 4, 6, str(tmp_path), timeout=240)
    assert results[1]["poisoned_sent"] > 100 * 10_000  # the poison was there to be read
    for r in results:
        assert all(r["same"]) and all(r["equal"])
        assert r["stats"]["recalibrated"] == 1 and r["stats"]["decisions"] == 1
        assert r["plans"][-1] == "[]"  # dense everywhere


def test_a_switch_keeps_replicas_equal_and_residuals_carry_over():
    at, back = 6, 11
    results = launch.run(auto_workers.switch, 4, 16, at, back, timeout=240)
    for r in results:
        plans = r["plans"]
        assert all(r["equal"])
        assert plans[at - 1] == "[]" or "'none'" in plans[at - 1]  # dense on the fast link
        assert "int4" in plans[at + 2] and "int4" not in plans[-1]  # compressed within 2 steps, then dense again
        assert r["stats"]["switches"] == 2
        first_dense = next(i for i in range(back, 16) if "int4" not in plans[i])
        before, after = r["residuals"][first_dense - 1], r["residuals"][-1]
        assert before and set(before) == set(after)
        assert all(torch.equal(before[k], after[k]) for k in before)  # kept, unchanged, over the dense steps


def test_relayout_keeps_the_error_feedback_invariant():
    """Flat, then hierarchical, then flat again on 2 nodes of 2 (``Session.relayout`` at each change, as the
    autopilot switches layouts): each relayout keeps the workers' mean residual, and at the end what was delivered
    plus the mean residual is the sum of the exact means (error feedback lost nothing across the switches)."""
    results = launch.run(auto_workers.relayout_invariant, 4, 9, 3, 6, timeout=240)
    for r in results:
        assert r["hier"] and r["kept"] == [True, True]
        assert r["gap"] < 1e-4, r["gap"]
        assert r["keys"] == ["0", "1"]  # back on the flat keys: no piece residual left behind


@pytest.mark.parametrize("force", ["hierarchical", "flat"])
def test_on_nodes_auto_measures_flat_against_hierarchical(force):
    """2 nodes of 2 workers, a slow-link hint: int4 at step 3 (flat), its step time measured over the next steps,
    then the same codecs hierarchically for TRIAL_STEPS steps; the layout measured faster stays (forced here by
    the meter's clock). Every rank holds the same plan and layout at every step, the replicas stay equal."""
    from gradcompress.autopilot import TRIAL_STEPS

    results = launch.run(auto_workers.nodes_train, 4, "auto:bandwidth=10mbit", 18, force, timeout=240)
    start = 3 + TRIAL_STEPS  # the decision at 3, measured until its settling step
    for r in results:
        assert all(r["equal"]) and all(r["same"])
        assert r["layouts"][:start] == ["flat"] * start and "int4" in r["plans"][3]
        assert r["layouts"][start:start + TRIAL_STEPS] == ["hierarchical"] * TRIAL_STEPS
        assert r["layouts"][-1] == force and set(r["stats"]["auto"]["layout_step_s"]) == {"flat", "hierarchical"}
        assert r["stats"]["auto"]["layout"] == force and "layout: " + force in r["explain"]
        assert (r["stats"]["intra_node_bytes"] > 0) and r["stats"]["auto"]["switches"] == 1 + (force == "flat")


def test_checkpoint_resume_is_exact():
    straight = launch.run(auto_workers.resume, 2, 10, None, timeout=240)
    resumed = launch.run(auto_workers.resume, 2, 10, 6, timeout=240)
    assert straight == resumed and "int4" in straight[0]


def test_custom_loop_synchronize():
    results = launch.run(auto_workers.custom_loop, 2, "auto:bandwidth=10mbit", 8, timeout=240)
    for r in results:
        assert all(r["equal"]) and "int4" in r["plan"]
        assert r["stats"]["auto"]["decided_at"] == 3


def test_fsdp_reduce_scatter_decides_per_group():
    """register_fsdp(model, "auto"): each FSDP group's reduce-scatter is a bucket; on a slow link every group gets
    int4, then it is bit for bit ``int4`` with 3 warm-up steps; on a fast one, the dense reduce-scatter."""
    slow = launch.run(auto_workers.fsdp_train, 2, "auto:bandwidth=1mbit", 6, timeout=240)
    fixed = launch.run(auto_workers.fsdp_train, 2, "int4:warmup_steps=3", 6, timeout=240)
    assert "int4" in slow[0]["plan"] and "none" not in slow[0]["plan"]
    assert slow[0]["digest"] == fixed[0]["digest"] == slow[1]["digest"]
    fast = launch.run(auto_workers.fsdp_train, 2, "auto:bandwidth=100gbit", 6, timeout=240)
    dense = launch.run(auto_workers.fsdp_train, 2, "none", 6, timeout=240)
    assert "int4" not in fast[0]["plan"] and fast[0]["digest"] == dense[0]["digest"]


# ---------------------------------------------------------------------------- a real link that drops

NETNS_PROBLEM = netns.problem()


@pytest.mark.slow
@pytest.mark.skipif(NETNS_PROBLEM is not None, reason=f"netbench: {NETNS_PROBLEM}")
def test_link_drop_on_four_hosts_is_followed():
    """4 namespaced hosts at 1 Gbit/s, the compute-bound CNN; before timed step 15 (step 20) every uplink is
    reshaped to 25 Mbit/s with tc (at 100 Mbit/s int4 was predicted only 1.2x faster than dense on this CNN, and a
    loaded machine's spread kept dense there once in a fresh-clone run: a drop the rule must follow, not a close
    call). auto (checks every 7 steps from step 3, none while a selection measures: the
    first at 3 ends by step 23) sees the step or its wait move at a check after the drop, probes the new rate,
    decides again and compresses: where it was dense when the link dropped, the probe reads the new rate and it
    decided after the drop; whatever it kept on the fast link, the plan at the end compresses every bucket and most
    of steps 40-49 send less than half of a dense step (a selection may measure dense again)."""
    from gradcompress.testbed.netbench import bench

    result = bench(["auto:every=7"], 4, 1e9, 0.0, "cnn", 45, 5, 32, None, 600, change=(15, 25e6))
    row = result["schemes"][0]
    auto, wire = row["auto"], row["step_wire_bytes"]
    dense = 2 * 3 / 4 * 4 * result["params"]  # a dense step's ring-counted bytes
    if wire[15 - 1] > 0.5 * dense and wire[15 - 2] > 0.5 * dense:  # dense when the link dropped: the step moves
        assert 7.5e6 < auto["bandwidth_bit"] < 50e6, auto  # the probes see the new rate (payload)
        assert auto["decisions"] >= 2 and auto["decided_at"] >= 5 + 15, auto
    late = sorted(wire[40 - 5:])
    assert late[len(late) // 2] < 0.5 * dense, (wire, dense, row["explain"])  # a re-measured dense block may show
    assert "none" not in auto["plan"], row["explain"]
