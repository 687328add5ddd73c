"""``gradcompress plan`` as a user meets it (issue 48: "plan contradicts itself"): the shapes it assumes hold the
parameters it was given and are stated, auto's row is the step of the plan auto keeps (never slower than the fixed
scheme of that plan's own row), and every number in the table has its unit."""

from __future__ import annotations

import math
import re

import pytest

from gradcompress import costmodel as cm
from gradcompress.cli import main

BYTES = re.compile(r"^\d+(\.\d+)? (B|KB|MB|GB|TB)$")


def _table(out: str) -> tuple[str, list[str], dict[str, list[str]]]:
    """(the first line, the header's columns, {scheme: its columns}) of plan's table."""
    lines = out.splitlines()
    rule = next(i for i, line in enumerate(lines) if set(line.replace(" ", "")) == {"-"})
    header = re.split(r"\s{2,}", lines[rule - 1].strip())
    rows = {}
    for line in lines[rule + 1:]:
        cols = re.split(r"\s{2,}", line.strip())
        if len(cols) != len(header):
            break
        rows[cols[0]] = cols
    return lines[rule - 2], header, rows


def _step_ms(header: list[str], row: list[str]) -> float:
    return float(row[header.index("step (ms)")])


def _auto_row(rows: dict) -> tuple[str, list[str]]:
    name = next(k for k in rows if k.startswith("auto"))
    return name, rows[name]


def _named(auto: str) -> list[str]:
    """The fixed schemes auto's row names: "auto -> dense x1, int4 x3" -> ["none", "int4"]."""
    plan = auto.split("->", 1)[1]
    names = [part.strip().rsplit(" x", 1)[0] for part in plan.split(",")]
    return ["none" if n == "dense" else n for n in names]


def _check_units(header: list[str], rows: dict) -> None:
    """Every column of numbers says its unit: bytes in the value, times and the speed-up in the header."""
    assert header[1:6] == ["sent/step", "comm (ms/step)", "codec (ms/step)", "step (ms)", "speed-up (x DDP)"], header
    for cols in rows.values():
        assert BYTES.match(cols[1]), cols
        for c in cols[2:5]:
            float(c)  # a plain number under a header with its unit
        assert re.fullmatch(r"\d+\.\d\dx", cols[5]), cols


def test_small_model_shapes_stated_and_auto_no_slower_than_its_scheme(capsys):
    """A newcomer's 85K-parameter MLP on 2 workers at 10 Gbit/s: no 2048x2048 matrix is assumed (85,000 parameters
    do not hold one); the shapes assumed are stated and hold 85,000; auto's row is no slower than the fixed row of
    the scheme it names; units stated."""
    assert main(["plan", "--params", "85e3", "--workers", "2", "--bandwidth", "10gbit", "--compute-ms", "10",
                 "--auto"]) == 0
    out = capsys.readouterr().out
    assert "2048x2048" not in out and "2048" not in out.splitlines()[0], out
    first, header, rows = _table(out)
    assert "85,000 parameters, assumed as 1 matrix 291x291 and a vector of 319" in first, first
    assert 291 * 291 + 319 == 85_000
    _check_units(header, rows)
    name, auto = _auto_row(rows)
    for scheme in _named(name):
        assert _step_ms(header, auto) <= _step_ms(header, rows[scheme]), (name, scheme, out)
    assert "auto: its row is the steady step of the plan it keeps" in out and "ms once" in out, out


def test_auto_row_is_its_plan_run_as_a_fixed_scheme(capsys):
    """25M parameters on 4 workers at 1 Gbit/s (the issue's: auto's int4 at 358 ms against fixed int4's 254 ms):
    auto's row is the step of the plan it keeps, no slower than each fixed scheme it names (the same when it names
    one), and compressed (1 Gbit/s: dense would take 5x as long); units stated; its one-off measuring apart."""
    assert main(["plan", "--params", "25e6", "--workers", "4", "--bandwidth", "1gbit", "--compute-ms", "100",
                 "--schemes", "ddp;none;bf16;int8;int4", "--auto"]) == 0
    out = capsys.readouterr().out
    first, header, rows = _table(out)
    assert "25,000,000 parameters, assumed as 5 matrices 2048x2048, 1 matrix 2048x1967 and a vector of 64" in first
    assert 5 * 2048 * 2048 + 2048 * 1967 + 64 == 25_000_000
    _check_units(header, rows)
    name, auto = _auto_row(rows)
    named = _named(name)
    for scheme in named:
        assert _step_ms(header, auto) <= _step_ms(header, rows[scheme]), (name, scheme, out)
    assert "none" not in named, out
    if len(named) == 1:
        assert auto[1:5] == rows[named[0]][1:5], out  # its plan's bytes and times, as the fixed row
    assert re.search(r"Before: 3 dense steps of [\d.]+ ms.*\+[\d.]+ ms once, \+[\d.]+ ms/step over 1000 steps", out)


# --------------------------------------------------------------------------- the model under the CLI
SPEEDS = cm.Speeds(elementwise=1e-9, encode={}, decode={})  # pass counts: no calibration, the same on every machine


def test_square_shapes_fit_the_parameters():
    for p in (1, 3, 1023, 85_000, 2048 * 2048 - 1, 25_000_000):
        shapes = cm.square_shapes(p, 2048)
        assert sum(math.prod(s) for s in shapes) == p
        assert all(math.prod(s) <= p for s in shapes)
    assert cm.square_shapes(85_000, 2048) == [(291, 291), (319,)]


@pytest.mark.parametrize("spec", ["none", "int8", "int4"])
def test_a_plan_of_one_scheme_is_that_schemes_prediction(spec):
    shapes = cm.square_shapes(6_000_000, 1024)
    fixed = cm.predict(cm.parse_scheme(spec), shapes, 4, 1e9, 0.05, SPEEDS)
    n = len(cm.buckets_for(cm.parse_scheme(spec), shapes))
    plan = cm.predict_plan([spec] * n, shapes, 4, 1e9, 0.05, SPEEDS)
    assert (plan.step_s, plan.codec_s, plan.comm_s, plan.wire_bytes) == \
        (fixed.step_s, fixed.codec_s, fixed.comm_s, fixed.wire_bytes)


@pytest.mark.parametrize("rate", [10e6, 1e9, 100e9])
def test_auto_keeps_a_plan_no_slower_than_dense_or_the_schemes_it_names(rate):
    shapes = cm.square_shapes(6_000_000, 1024)
    auto = cm.predict_auto("auto", shapes, 4, rate, 0.05, SPEEDS)
    dense = cm.predict(cm.parse_scheme("none"), shapes, 4, rate, 0.05, SPEEDS)
    assert auto.prediction.step_s <= dense.step_s
    for spec in set(auto.plan):
        assert auto.prediction.step_s <= cm.predict(cm.parse_scheme(spec), shapes, 4, rate, 0.05, SPEEDS).step_s
    assert auto.measuring_steps == 3 and auto.one_off_s >= 0
    if rate == 10e6:
        assert set(auto.plan) == {"int4"}  # the link is all that counts
