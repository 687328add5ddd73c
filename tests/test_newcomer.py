"""Issue #24, "what a newcomer hits": each mistake is a clear error naming the fix (real gloo workers).

* ``synchronize`` (every ``Compressor.begin_step``) without ``torch.distributed``: a ``RuntimeError`` naming
  ``init_process_group``, nothing changed; ``LocalCollectives(1)`` passed explicitly is the single-process path;
* replicas that start unequal: the first ``synchronize`` raises on every rank, naming
  ``gradcompress.broadcast_parameters``, which fixes it;
* ``register_ddp_hook`` (with a spec or a Compressor) on a model that is not DDP: a ``TypeError``; ``register_fsdp``
  on one without FSDP modules: its ``ValueError`` ("no FSDP module"), naming ``fully_shard``;
* resume on another world size (4 -> 2, 2 -> 4): the per-rank residuals restart at zero with one warning, the rest
  is kept.

Three launches in all (module fixtures, in order): 4 workers save; 2 workers resume the 4's states, save theirs and
run the other checks; 4 workers resume the 2's states.
"""

from __future__ import annotations

import warnings

import pytest
import torch

import gradcompress
import newcomer_workers as nw
from gradcompress.testbed import launch
from gradcompress.collectives import LocalCollectives

pytestmark = pytest.mark.slow  # multi-process runs: outside the fast lane (pytest -m "not slow")

TIMEOUT = 240


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    return {w: str(tmp_path_factory.mktemp(f"newcomer_w{w}")) for w in (2, 4)}


@pytest.fixture(scope="module")
def four(dirs):
    """4 workers: save the resume cases' states, and every other check."""
    return launch.run(nw.checks, 4, dirs[4], None, timeout=TIMEOUT)


@pytest.fixture(scope="module")
def two(dirs, four):
    """2 workers: resume the 4 workers' states, save their own, every other check."""
    return launch.run(nw.checks, 2, dirs[2], (dirs[4], 4), timeout=TIMEOUT)


@pytest.fixture(scope="module")
def four_resumed(dirs, two):
    """4 workers resume the 2 workers' states (rank r loads rank r % 2's)."""
    return launch.run(nw.checks, 4, None, (dirs[2], 2), False, timeout=TIMEOUT)


@pytest.fixture(params=[2, 4], ids=lambda w: f"world{w}")
def run(request, four, two):
    return request.param, {2: two, 4: four}[request.param]


def _raised(got, kind: str, *phrases: str) -> None:
    """``got`` (a worker's (exception type, message), or None) is a ``kind`` whose message has every phrase."""
    assert got is not None and got[0] == kind, got
    for phrase in phrases:
        assert phrase in got[1], (phrase, got[1])


# --------------------------------------------------------------------------- no torch.distributed
def test_synchronize_without_process_group_is_a_clear_error_and_changes_nothing(run):
    _, results = run
    for r in results:
        n = r["no_group"]
        for what in ("synchronize", "begin_step"):
            _raised(n[what], "RuntimeError", "torch.distributed.init_process_group", "torchrun", "LocalCollectives(1)")
        assert n["grads_unchanged"] and n["steps"] == 0
        _raised(n["broadcast"], "RuntimeError", "init_process_group")
        # the explicit single-process path: runs the codec (lossy), sends nothing
        assert n["explicit_local"] is True and n["explicit_local_lossy"]
        assert n["explicit_local_stats"] == {"steps": 1, "wire_bytes": 0}


def test_synchronize_in_this_process_without_torch_distributed():
    assert not torch.distributed.is_initialized()
    comp = gradcompress.Compressor("int8", min_numel=0)
    p = torch.nn.Parameter(torch.zeros(2000))
    p.grad = torch.randn(2000, generator=torch.Generator().manual_seed(0))
    before = p.grad.clone()
    with pytest.raises(RuntimeError, match=r"torch\.distributed\.init_process_group"):
        comp.synchronize([p])
    assert torch.equal(p.grad, before) and comp.stats()["steps"] == 0
    assert comp.synchronize([p], collectives=LocalCollectives(1)) is True
    assert comp.synchronize([p]) is True  # the collectives given stay the compressor's
    assert comp.stats()["steps"] == 2 and comp.stats()["wire_bytes"] == 0


def test_local_collectives_load_a_state_of_another_world_warns_at_load():
    """A compressor that has stepped knows its world: a state of another world is reconciled at load."""
    comp = gradcompress.Compressor("int8", min_numel=0)
    p = torch.nn.Parameter(torch.zeros(2000))
    p.grad = torch.randn(2000, generator=torch.Generator().manual_seed(0))
    comp.synchronize([p], collectives=LocalCollectives(1))
    state = comp.state_dict()
    assert state["world"] == 1 and state["residual"]
    state["world"] = 4
    with pytest.warns(UserWarning, match=r"saved with 4 workers and resumes with 1") as caught:
        comp.load_state_dict(state)
    assert len(caught) == 1
    assert comp.residual == {} and comp.state_dict()["step"] == 1 and comp.state_dict()["world"] == 1
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        comp.load_state_dict({k: v for k, v in state.items() if k != "world"})  # an old checkpoint: as it is
    assert torch.equal(comp.residual[0], state["residual"]["0"])


def test_another_world_resets_the_momentum_of_fsdp_flat_buffers_too():
    """FSDP's group buffers are W chunks: their momentum cannot be kept at another world; a parameter's can."""
    comp = gradcompress.Compressor("int8", min_numel=0, momentum=0.9)
    p = torch.nn.Parameter(torch.zeros(2000))
    p.grad = torch.randn(2000, generator=torch.Generator().manual_seed(0))
    comp.synchronize([p], collectives=LocalCollectives(1))
    state = comp.state_dict()
    state["momentum"]["fsdp:root"] = torch.ones(4 * 600)  # as register_fsdp keys a group saved at 4 workers
    state["world"] = 4
    with pytest.warns(UserWarning, match="momentum of FSDP's flat buffers") as caught:
        comp.load_state_dict(state)
    assert len(caught) == 1
    momentum = comp.state_dict()["momentum"]
    assert list(momentum) == ["0"] and torch.equal(momentum["0"], state["momentum"]["0"])


def test_broadcast_parameters_needs_torch_distributed():
    with pytest.raises(RuntimeError, match="init_process_group"):
        gradcompress.broadcast_parameters(torch.nn.Linear(2, 2))


# --------------------------------------------------------------------------- replicas that start unequal
def test_unequal_replicas_fail_the_first_synchronize_on_every_rank(run):
    world, results = run
    for r in results:
        u = r["unequal"]
        _raised(u["error"], "RuntimeError", "gradcompress.broadcast_parameters", "parameters differ across ranks")
        assert u["grads_unchanged"] and u["state_empty"]
        assert u["stats"]["steps"] == 0 and u["stats"]["wire_bytes"] == 0


def test_broadcast_parameters_copies_rank0s_parameters_and_buffers(run):
    world, results = run
    rank0 = results[0]["unequal"]["own_tensors"]
    own1 = results[1]["unequal"]["own_tensors"]
    assert not torch.equal(rank0[0], own1[0]) and not torch.equal(rank0[4], own1[4])  # a weight, a running mean
    for r in results:
        got = r["unequal"]["broadcast_tensors"]
        assert len(got) == len(rank0) == 9  # 6 parameters, BatchNorm's running mean, variance and count
        assert all(torch.equal(a, b) for a, b in zip(got, rank0))


def test_after_broadcast_synchronize_works_and_the_check_sends_nothing_counted(run):
    world, results = run
    for r in results:
        u = r["unequal"]
        assert u["first"] is True and u["second"] is True
        first, second = u["wire_per_step"]
        assert first == second > 0  # the first step's check is not in wire_bytes
        assert u["later_step_unchecked"] is True  # checked once per Compressor


def test_broadcast_parameters_src_and_errors(run):
    world, results = run
    for r in results:
        b = r["broadcast"]
        assert b["src_last"] == [[float(world - 1)] * 5, [[10.0 + world - 1] * 2] * 3]
        _raised(b["bad_src"], "ValueError", f"0 to {world - 1}")
        _raised(b["tensor"], "TypeError", "nn.Module")


# --------------------------------------------------------------------------- register on the wrong model
def test_register_on_a_model_that_is_not_ddp_is_a_type_error(run):
    _, results = run
    for r in results:
        g = r["register"]
        for what in ("ddp_hook_plain", "register_plain"):
            _raised(g[what], "TypeError", "torch.nn.parallel.DistributedDataParallel", "got Linear",
                    "DistributedDataParallel(model)")
        assert g["ddp_hook_ddp"] is None


def test_register_fsdp_on_a_model_without_fsdp_names_fully_shard(run):
    _, results = run
    for r in results:
        g = r["register"]
        _raised(g["fsdp_plain"], "NotShardedError", "no FSDP module", "fully_shard", "Linear")
        _raised(g["fsdp_ddp"], "NotShardedError", "register_ddp_hook")
        _raised(g["fsdp_params"], "TypeError", "torch.nn.Module", "got list")


# --------------------------------------------------------------------------- resume on another world size
def _check_saved(results, world):
    for r in results:
        for name, saved in r["saved"].items():
            assert saved["world"] == world
            assert saved["slots"]["residual"] > 0, (name, saved)
            assert saved["same_world_warnings"] == 0 and saved["same_world_equal"], (name, saved)
        assert r["saved"]["int8"]["slots"]["server_residual"] > 0
        assert r["saved"]["powersgd"]["slots"]["q"] > 0 and r["saved"]["int8"]["slots"]["momentum"] > 0


def _check_resumed(results, saved_world, world):
    for r in results:
        for name, res in r["resume"].items():
            assert len(res["warnings"]) == 1, (name, res["warnings"])
            text = res["warnings"][0]
            assert f"saved with {saved_world} workers and resumes with {world}" in text, text
            assert "residual, server_residual" in text and "reset" in text and "kept" in text, text
            assert res["reference_warnings"] == 0
            assert res["pending_world"] == saved_world and res["world_after"] == world
            assert res["saved_step"] == nw.SAVED_STEPS and res["steps_after"] == nw.SAVED_STEPS + 1
            assert res["same_as_reference"], name  # residuals reset, q/p, momentum, step kept
            assert res["kept_state_matters"], name


def test_state_dict_records_the_world_and_resumes_at_the_same_world(four, two):
    _check_saved(four, 4)
    _check_saved(two, 2)


def test_resume_four_workers_state_on_two(two):
    _check_resumed(two, 4, 2)


def test_resume_two_workers_state_on_four(four_resumed):
    _check_resumed(four_resumed, 2, 4)


def test_a_model_fully_shard_has_not_sharded_is_a_type_error():
    from gradcompress.adapters.fsdp import NotShardedError

    assert issubclass(NotShardedError, TypeError) and issubclass(NotShardedError, ValueError)
