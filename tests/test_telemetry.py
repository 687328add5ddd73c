"""Compression telemetry (``Compressor(monitor_every=N)``) on 2 real gloo workers."""

import math

import pytest

import robust_workers as rw
from gradcompress.testbed import launch

EVERY, STEPS = 2, 3


@pytest.fixture(scope="module")
def runs():
    return launch.run(rw.telemetry, 2, ["none", "topk:ratio=0.01", "int8"], STEPS, EVERY, timeout=240)


def test_none_is_exact(runs):
    for r in runs:
        m = r["none"][EVERY]["stats"]["monitor"]
        assert m["relative_error"] == 0.0 and m["cosine"] == pytest.approx(1.0, abs=1e-6)
        assert m["step"] == 2 and [h[0] for h in m["history"]] == [0, 2]


@pytest.mark.parametrize("spec", ["topk:ratio=0.01", "int8"])
def test_figures_match_a_direct_computation(runs, spec):
    for r in runs:
        m = r[spec][EVERY]["stats"]["monitor"]
        direct = r[spec][EVERY]["direct"]
        assert m["relative_error"] == pytest.approx(direct["relative_error"], rel=1e-4)
        assert m["cosine"] == pytest.approx(direct["cosine"], rel=1e-4)
        assert m["per_parameter"][0]["relative_error"] == pytest.approx(direct["first"], rel=1e-4)
        assert m["per_parameter"][1]["relative_error"] == 0.0  # under min_numel: travels dense, exact
        assert 0 < m["cosine"] < 1 and m["relative_error"] > 0
        assert m["residual_norm"] > 0


def test_topk_is_far_from_exact_and_int8_close(runs):
    for r in runs:
        assert r["topk:ratio=0.01"][EVERY]["stats"]["monitor"]["cosine"] < 0.9
        assert r["int8"][EVERY]["stats"]["monitor"]["relative_error"] < 0.05


@pytest.mark.parametrize("spec", ["none", "topk:ratio=0.01", "int8"])
def test_monitor_bytes_apart_from_wire_bytes(runs, spec):
    world = 2
    for r in runs:
        plain, monitored = r[spec][0]["stats"], r[spec][EVERY]["stats"]
        assert monitored["wire_bytes"] == plain["wire_bytes"]
        assert plain["monitor_bytes"] == 0 and plain["monitor"] is None
        monitored_steps = math.ceil(STEPS / EVERY)
        numel = 64 * 80 + (300 if spec == "none" else 0)  # none: the whole group is one dense buffer
        assert monitored["monitor_bytes"] == monitored_steps * 2 * (world - 1) * 4 * numel // world
