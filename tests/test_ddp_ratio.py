"""One ratio everywhere (issue 48): "x fewer bytes per step than DDP", DDP's ring all-reduce of the same gradients
(2 (W-1)/W of their bytes per worker) over what the scheme's worker sent, so dense reads 1.0x for any W; in
``Compressor.stats()``, ``DiLoCo.stats()`` and the demo's and train's tables (with ms/step and auto's plan)."""

from __future__ import annotations

import json
import re

import pytest

from gradcompress.cli import main
from gradcompress.collectives import ddp_bytes, x_fewer_than_ddp
from gradcompress.testbed import launch

from ratio_workers import compressor_stats, diloco_stats

#: the digits task's MLP 64-256-256-10: its float32 gradients' bytes
DIGITS_GRADIENT_BYTES = 4 * (64 * 256 + 256 + 256 * 256 + 256 + 256 * 10 + 10)
COLUMN = "x fewer bytes than DDP"


# --------------------------------------------------------------------------- the formula
@pytest.mark.parametrize("world", [2, 3, 4, 8])
def test_a_dense_all_reduce_reads_one_for_any_world(world):
    raw = 340008
    sent = 2 * (world - 1) * raw / world  # a ring all-reduce, per rank
    assert ddp_bytes(raw, world) == pytest.approx(sent)
    assert x_fewer_than_ddp(raw, sent, world) == pytest.approx(1.0)
    assert x_fewer_than_ddp(raw, sent / 8, world) == pytest.approx(8.0)


def test_the_formula_at_its_edges():
    assert ddp_bytes(1000, 4) == 1500 and ddp_bytes(1000, 2) == 1000 and ddp_bytes(1000, 1) == 0
    assert x_fewer_than_ddp(1000, 0, 1) == 1.0  # one worker: neither sends anything
    assert x_fewer_than_ddp(0, 0, 4) == 1.0  # nothing yet
    assert x_fewer_than_ddp(1000, 0, 4) == float("inf")  # DiLoCo before its first send
    assert x_fewer_than_ddp(1000, 125, 4) == 12.0


# --------------------------------------------------------------------------- stats()
@pytest.mark.parametrize("world", [2, 4])
def test_compressor_stats_dense_reads_one_and_int8_its_bytes(world):
    for spec in ("none", "int8"):
        st = launch.run(compressor_stats, world, spec, 3)[0]["stats"]
        assert st["ddp_bytes"] == pytest.approx(2 * (world - 1) / world * st["raw_bytes"])
        assert st["x_fewer_than_ddp"] == pytest.approx(st["ddp_bytes"] / st["wire_bytes"])
        if spec == "none":
            assert st["x_fewer_than_ddp"] == pytest.approx(1.0)
            assert st["ratio"] == pytest.approx(world / (2 * (world - 1)))  # raw / wire keeps its meaning
        else:
            assert st["x_fewer_than_ddp"] > 2.5


def test_diloco_figure_matches_the_bytes_counted():
    """Per step, averaged over the run: DDP would all-reduce every step's gradients; DiLoCo sends every H steps."""
    world, steps = 2, 8
    runs = {(codec, h): launch.run(diloco_stats, world, codec, h, steps)[0]
            for codec, h in (("none", 1), ("none", 4), ("int4", 4))}
    for (codec, h), r in runs.items():
        st, grads = r["stats"], r["gradient_bytes"]
        ddp = 2 * (world - 1) / world * grads * steps
        assert st["steps"] == steps and st["syncs"] == steps // h
        assert st["ddp_bytes"] == pytest.approx(ddp)
        assert st["x_fewer_than_ddp"] == pytest.approx(ddp / st["wire_bytes"]), (codec, h)
    assert runs["none", 1]["stats"]["x_fewer_than_ddp"] == pytest.approx(1.0)  # DDP's very bytes
    assert runs["none", 4]["stats"]["x_fewer_than_ddp"] == pytest.approx(4.0)
    assert runs["int4", 4]["stats"]["x_fewer_than_ddp"] > 4 * 4


# --------------------------------------------------------------------------- the tables a user reads
def _table(text: str) -> dict[str, dict[str, str]]:
    """The table under its header line: {scheme cell: {column: cell}} (cells are 2+ spaces apart)."""
    lines = text.splitlines()
    at = next(i for i, line in enumerate(lines) if line.startswith("scheme ") and COLUMN in line)
    head = re.split(r"\s{2,}", lines[at].strip())
    rows = {}
    for line in lines[at + 2:]:
        cells = re.split(r"\s{2,}", line.strip())
        if len(cells) != len(head):
            break
        rows[cells[0]] = dict(zip(head, cells))
    return rows


def test_demo_on_four_workers_reads_one_for_none_and_names_autos_plan(tmp_path, capsys):
    out = tmp_path / "report"
    rc = main(["demo", "--workers", "4", "--steps", "12", "--no-progress", "--out", str(out),
               "--schemes", "none;auto"])
    assert rc == 0
    printed = capsys.readouterr().out
    rows = _table(printed)
    assert rows["none"][COLUMN] == "1.0x", printed
    assert float(rows["none"]["ms/step"]) > 0, printed
    runs = {r["scheme"]: r for r in json.loads((out / "results.json").read_text())["runs"]}
    plan = runs["auto"]["stats"]["auto"]["plan"]
    label = "auto \u2192 " + ", ".join(f"{c} x{n}" for c, n in sorted(plan.items(), key=lambda kv: (-kv[1], kv[0])))
    assert label in rows, (label, printed)
    assert runs["none"]["x_fewer_than_ddp"] == pytest.approx(1.0)
    assert runs["none"]["ddp_bytes_per_step"] == pytest.approx(1.5 * DIGITS_GRADIENT_BYTES)
    assert "2(W-1)/W = 1.50x the gradient bytes on 4 workers" in printed, printed


def test_train_on_two_workers_reads_one_for_none(capsys):
    assert main(["train", "--schemes", "none", "--workers", "2", "--steps", "10"]) == 0
    printed = capsys.readouterr().out
    assert _table(printed)["none"][COLUMN] == "1.0x", printed
    assert "2(W-1)/W = 1.00x the gradient bytes on 2 workers" in printed, printed


def test_train_diloco_prints_the_bytes_it_counted(tmp_path, capsys):
    """The README's DiLoCo kind of run: the printed figure is DDP's bytes over the run / the bytes counted."""
    workers, steps = 2, 12
    assert main(["train", "--schemes", "int4", "--diloco", "4", "--workers", str(workers), "--steps", str(steps),
                 "--out", str(tmp_path)]) == 0
    printed = capsys.readouterr().out
    run = json.loads((tmp_path / "results.json").read_text())["runs"][0]
    sent = run["stats"]["wire_bytes"]
    want = 2 * (workers - 1) / workers * DIGITS_GRADIENT_BYTES * steps / sent
    assert run["x_fewer_than_ddp"] == pytest.approx(want) and run["stats"]["x_fewer_than_ddp"] == pytest.approx(want)
    assert _table(printed)["int4"][COLUMN] == f"{want:.1f}x", printed
    assert want > 4 * 4  # every 4th step, int4


def test_train_names_the_plan_auto_ended_with(tmp_path, capsys):
    assert main(["train", "--schemes", "auto", "--workers", "2", "--steps", "12", "--out", str(tmp_path)]) == 0
    printed = capsys.readouterr().out
    plan = json.loads((tmp_path / "results.json").read_text())["runs"][0]["plan"]
    assert plan, printed
    label = "auto \u2192 " + ", ".join(f"{c} x{n}" for c, n in sorted(plan.items(), key=lambda kv: (-kv[1], kv[0])))
    assert label in _table(printed), (label, printed)
