"""Local steps for the frozen-variance Adam family (0/1 Adam's idea): CompressedAdam/OneBitAdam(sync_every=k).

After the warm-up a parameter is synchronised only at every k-th compressed step (or on 0/1 Adam's growing
schedule); between syncs each rank steps with its own momentum and sends nothing. Checked on gloo workers (each
launch with a timeout): the schedule is the same on every rank and the one specified, bytes only on sync steps
(as many as a compressed step without the option), replicas bit-identical after each sync and apart between,
sync_every=1 equal to a run without the option bit for bit, resume bit for bit between two syncs.
"""

import pytest
import torch

import localsteps_workers as lw
from gradcompress.testbed import launch
from gradcompress.optim import CompressedAdam, OneBitAdam
from gradcompress.optim.onebit_adam import sync_due
from gradcompress.scheme import parse_scheme

pytestmark = pytest.mark.slow  # multi-process runs: outside the fast lane (pytest -m "not slow")

TIMEOUT = 120


@pytest.fixture(scope="module")
def two_workers(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("localsteps") / "ck")
    return launch.run(lw.two_worker_checks, 2, path, timeout=TIMEOUT)


def _check_schedule(result, warmup, synced_steps):
    """``synced_steps``: the compressed steps (1, 2, ... after the warm-up) that sync, as specified."""
    local, plain, patterns = result["local"], result["plain"], result["patterns"]
    assert all(p == patterns[0] for p in patterns)  # the same schedule on every rank
    for i, ((sent, equal), (plain_sent, _)) in enumerate(zip(local, plain)):
        c = i - warmup + 1
        if c < 1 or c in synced_steps:  # warm-up (dense) or a sync: as many bytes as without the option
            assert sent > 0 and sent == plain_sent, (i, sent, plain_sent)
            assert equal, i  # replicas bit-identical after each sync
        else:  # a local step: nothing sent, the replicas apart
            assert sent == 0 and not equal, (i, sent)
    syncs = [i - warmup + 1 for i, (sent, _) in enumerate(local) if sent > 0 and i >= warmup]
    assert syncs == [c for c in synced_steps if c <= len(local) - warmup]
    assert result["stats"]["local_skipped"] == 0


def test_fixed_schedule_four_workers():
    warmup, steps, every = 4, 20, 4
    for result in launch.run(lw.schedule, 4, warmup, steps, every, 0, timeout=TIMEOUT):
        _check_schedule(result, warmup, synced_steps=[4, 8, 12, 16])


def test_growing_schedule_two_workers(two_workers):
    # sync_every=8, sync_ramp_steps=3: interval 1 for compressed steps 1-3, 2 for 4-6, 4 for 7-9, then 8
    for result in two_workers:
        _check_schedule(result["ramp"], 2, synced_steps=[1, 2, 3, 4, 6, 8, 16])


def test_sync_every_step_is_todays_compressed_adam_bit_for_bit(two_workers):
    for result in two_workers:
        assert len(result["today"]) == 4
        for name, (same_params, same_state, same_bytes) in result["today"].items():
            assert same_params and same_state and same_bytes, name


def test_resume_between_syncs_is_bit_exact(two_workers):
    for result in two_workers:
        full, resumed, in_state = result["resume"]
        assert torch.equal(full, resumed)
        assert {"anchor", "local_update", "local_step_sizes"} <= set(in_state)  # saved between two syncs


def test_sync_due_is_the_documented_rule():
    assert [c for c in range(1, 13) if sync_due(c, 3)] == [3, 6, 9, 12]
    assert all(sync_due(c, 1) for c in range(1, 10)) and all(sync_due(c, 1, 4) for c in range(1, 10))
    assert [c for c in range(1, 70) if sync_due(c, 16, 4)] == [1, 2, 3, 4, 6, 8, 12, 16, 32, 48, 64]


@pytest.mark.parametrize("kwargs, match", [
    ({"sync_every": 0}, r"sync_every must be an integer >= 1, got 0"),
    ({"sync_every": 2.5}, r"sync_every must be an integer >= 1, got 2.5"),
    ({"sync_every": True}, r"sync_every must be an integer >= 1, got True"),
    ({"sync_ramp_steps": -1}, r"sync_ramp_steps must be an integer >= 0, got -1"),
])
def test_bad_schedule_arguments(kwargs, match):
    for cls in (OneBitAdam, CompressedAdam):
        with pytest.raises(ValueError, match=match):
            cls(torch.nn.Linear(3, 2).parameters(), **kwargs)


def test_scheme_options():
    from gradcompress.cli.task import RunConfig

    s = parse_scheme("onebitadam:sync_every=4,sync_ramp_steps=10")
    assert s.adam == {"sync_every": 4, "sync_ramp_steps": 10}
    opts = RunConfig(scheme="onebitadam:sync_every=4", task="lm", steps=300).onebitadam_options()
    assert opts["sync_every"] == 4 and opts["warmup_steps"] == 60
    with pytest.raises(ValueError, match="options of onebitadam: .*sync_every, sync_ramp_steps"):
        parse_scheme("onebitadam:local_steps=4")
