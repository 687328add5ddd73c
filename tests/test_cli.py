"""The ``gradcompress`` command: demo (shortened), train, bench, --help and error handling."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

import gradcompress
from gradcompress.cli import demo as demo_mod
from gradcompress.cli import main
from gradcompress.cli.bench import EXTRA_CODECS

pytest.importorskip("sklearn")
pytest.importorskip("matplotlib")
pytest.importorskip("tqdm")


def _one_error_line(err: str) -> str:
    lines = [ln for ln in err.strip().splitlines() if ln.strip()]
    assert len(lines) == 1, err
    assert "Traceback" not in err
    return lines[0]


# --------------------------------------------------------------------------- help
@pytest.mark.parametrize("argv", [["--help"], ["demo", "--help"], ["train", "--help"], ["bench", "--help"]])
def test_help(argv, capsys):
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: gradcompress")
    if argv[0] == "demo":
        assert "--schemes" in out and "--workers" in out and "--out" in out
    if argv[0] == "train":
        assert "--codec" in out and "torchrun" in out and "--no-error-feedback" in out
    if argv[0] == "bench":
        assert "--numel" in out and "--json" in out and "--codecs" in out


def test_split_schemes_keeps_commas_inside_specs():
    got = demo_mod.split_schemes(["none;topk:ratio=0.01,values=int8", "powersgd:rank=2", " ; int8 ;"])
    assert got == ["none", "topk:ratio=0.01,values=int8", "powersgd:rank=2", "int8"]


# --------------------------------------------------------------------------- demo
def test_short_lm_demo_writes_the_table_and_results(tmp_path, capsys):
    """--task lm: the byte-level transformer, validation loss instead of accuracy, DiLoCo as a scheme."""
    out = tmp_path / "lm"
    rc = main(["demo", "--task", "lm", "--steps", "12", "--workers", "2", "--no-progress", "--out", str(out),
               "--schemes", "none;int8;int4:diloco=4;topk:ratio=0.05,values=int8,compressed_adam=true"])
    assert rc == 0
    table = capsys.readouterr().out
    assert "val loss" in table and "int4:diloco=4" in table
    data = json.loads((out / "results.json").read_text())
    assert data["task"]["name"] == "lm" and data["task"]["steps"] == 12
    runs = {r["scheme"]: r for r in data["runs"]}
    cadam = "topk:ratio=0.05,values=int8,compressed_adam=true"
    assert set(runs) == {"none", "int8", "int4:diloco=4", cadam}
    for r in runs.values():
        assert 0 < r["val_loss"] < 6 and r["test_accuracy"] is None
        assert len(r["loss"]) == 12 and r["cumulative_bytes"][-1] == r["stats"]["wire_bytes"]
        assert r["monitor_history"] is None or all(len(h) == 3 for h in r["monitor_history"])
    assert runs["none"]["val_loss_vs_none_pct"] == 0
    assert runs["int4:diloco=4"]["stats"]["syncs"] == 3  # 12 steps, H = 4
    assert runs["int4:diloco=4"]["bytes_per_step"] < runs["int8"]["bytes_per_step"] / 4
    assert runs[cadam]["optimizer"].startswith("CompressedAdam(codec='topk:")
    assert "ratio=0.05" in runs[cadam]["optimizer"] and "values=int8" in runs[cadam]["optimizer"]
    assert runs[cadam]["warmup_steps"] == 5 and runs[cadam]["stats"]["compressed_steps"] == 7
    assert runs[cadam]["bytes_per_step_compressed"] < runs["int8"]["bytes_per_step_compressed"] / 2
    assert (out / "report.png").stat().st_size > 10000


def test_short_demo_writes_results_and_report(tmp_path, monkeypatch, capsys):
    # pretend 1-bit Adam is missing: the demo must say so and go on with the others
    monkeypatch.setattr(demo_mod, "onebitadam_problem", lambda: "gradcompress.optim.OneBitAdam is not available")
    out = tmp_path / "report"
    rc = main(["demo", "--steps", "30", "--workers", "2", "--no-progress", "--out", str(out),
               "--schemes", "none;topk:ratio=0.01,values=int8", "--schemes", "onebitadam"])
    assert rc == 0
    captured = capsys.readouterr()
    assert "skipping onebitadam" in captured.err
    table = captured.out
    assert "topk:ratio=0.01,values=int8" in table and "test acc" in table

    data = json.loads((out / "results.json").read_text())
    assert data["task"]["workers"] == 2 and data["task"]["steps"] == 30
    assert [s["scheme"] for s in data["skipped"]] == ["onebitadam"]
    runs = {r["scheme"]: r for r in data["runs"]}
    assert set(runs) == {"none", "topk:ratio=0.01,values=int8"}
    for r in runs.values():
        for key in ("bytes_per_step", "ratio", "codec_share", "final_train_loss", "test_accuracy",
                    "accuracy_delta_vs_none", "step_seconds", "loss", "cumulative_bytes", "stats"):
            assert key in r, key
        assert len(r["loss"]) == 30 and len(r["cumulative_bytes"]) == 30
        assert r["cumulative_bytes"] == sorted(r["cumulative_bytes"])
        assert r["cumulative_bytes"][-1] == r["stats"]["wire_bytes"]
        assert 0 <= r["test_accuracy"] <= 100
        assert 0 <= r["codec_share"] <= 1
    assert runs["none"]["accuracy_delta_vs_none"] == 0
    assert runs["none"]["ratio"] == pytest.approx(1.0, rel=1e-3)  # dense all-reduce on 2 workers sends 2 (W-1)/W = 1x
    assert runs["topk:ratio=0.01,values=int8"]["bytes_per_step"] < runs["none"]["bytes_per_step"] / 4
    assert runs["topk:ratio=0.01,values=int8"]["ratio"] > 4
    assert runs["none"]["test_accuracy"] > 50  # learning something after 30 steps
    png = (out / "report.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000


# --------------------------------------------------------------------------- errors
def test_bad_scheme_is_one_line_listing_valid_ones():
    proc = subprocess.run([sys.executable, "-m", "gradcompress", "demo", "--schemes", "none;nosuchcodec"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0
    line = _one_error_line(proc.stderr)
    assert "nosuchcodec" in line
    for name in gradcompress.available() + ["onebitadam"]:
        assert name in line


@pytest.mark.parametrize("argv, needle", [
    (["demo", "--schemes", "topk:ratio=2"], "ratio"),
    (["train", "--codec", "int8:bogus=1"], "bogus"),
    (["demo", "--workers", "0"], "--workers"),
    (["bench", "--codecs", "nosuchcodec"], "nosuchcodec"),
    (["train", "--codec", "powersgd", "--fsdp"], "powersgd cannot compress FSDP"),
    (["train", "--codec", "onebitadam", "--fsdp"], "--fsdp does not apply"),
    (["train", "--codec", "int8", "--diloco", "5", "--fsdp"], "--diloco"),
    (["train", "--codec", "int8", "--diloco", "0"], "--diloco"),
    (["demo", "--schemes", "int4:diloco=0"], "diloco must be an integer >= 1"),
    (["demo", "--schemes", "sign:momentum=1.5"], "momentum must be a number in [0, 1)"),
    (["demo", "--schemes", "dgc:compressed_adam=true"], "dgc keeps its own momentum"),
    (["demo", "--schemes", "topk:compressed_adam=true,momentum=0.9"], "momentum do not apply"),
    (["train", "--codec", "int8:compressed_adam=true", "--fsdp"], "--fsdp does not apply"),
    (["train", "--codec", "int8", "--hsdp"], "--hsdp and --params apply to --fsdp runs"),
    (["train", "--codec", "int8", "--fsdp", "--params", "int4"], "invalid choice"),
    (["train", "--codec", "int8", "--kill-at", "5"], "apply to --fault-tolerant runs"),
    (["train", "--codec", "int8", "--fault-tolerant", "--kill-at", "5", "--restart-at", "3"], "--restart-at needs"),
    (["train", "--codec", "int8", "--fault-tolerant", "--kill-at", "500"], "must be below --steps"),
    (["train", "--codec", "auto", "--fault-tolerant"], "not supported there"),
    (["train", "--codec", "int8", "--fault-tolerant", "--diloco", "5"], "do not apply"),
    (["demo", "--lm-size", "large"], "sizes the lm task's model (--task lm), not digits"),
    (["demo", "--task", "lm", "--lm-size", "huge"], "unknown lm model size 'huge'; sizes: small, large, or"),
])
def test_bad_arguments_are_one_line(argv, needle, capsys, tmp_path):
    rc = main(argv + (["--out", str(tmp_path)] if argv[0] == "demo" else []))
    assert rc != 0
    assert needle in _one_error_line(capsys.readouterr().err)


def test_the_lm_task_has_two_model_sizes():
    """``--lm-size large`` (issue 40's second size): 4 blocks of width 256, about 7x the small model's parameters,
    the same architecture; an unknown size is refused with the sizes there are."""
    from gradcompress.testbed import lm

    small, large = (sum(p.numel() for p in lm.make_model(0, size).parameters()) for size in ("small", "large"))
    assert small == 470528 and 6.5 < large / small < 7.5
    assert len(lm.make_model(0, "large").blocks) == 4 and lm.make_model(0, "large").tok.embedding_dim == 256
    with pytest.raises(ValueError, match="unknown lm model size 'huge'; sizes: small, large"):
        lm.make_model(0, "huge")


def test_unwritable_out_fails_before_training(tmp_path, capsys):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    for cmd in (["demo"], ["train", "--codec", "int8"]):
        rc = main(cmd + ["--out", str(blocker / "report")])
        assert rc != 0
        line = _one_error_line(capsys.readouterr().err)
        assert "cannot write" in line and "--out" in line


@pytest.mark.skipif(os.geteuid() == 0 if hasattr(os, "geteuid") else True, reason="root can write anywhere")
def test_read_only_out(tmp_path, capsys):
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o500)
    assert main(["demo", "--out", str(ro)]) != 0
    assert "cannot write" in _one_error_line(capsys.readouterr().err)


def test_crashing_worker_stops_the_run(capsys):
    rc = main(["train", "--codec", "none", "--lr", "1e30", "--steps", "20", "--workers", "2"])
    assert rc == 1
    err = capsys.readouterr().err
    assert err.splitlines()[0].startswith("gradcompress train: error: worker ")
    assert "training loss became" in err.splitlines()[0]


# --------------------------------------------------------------------------- train, bench
def test_bench_json(capsys):
    rc = main(["bench", "--numel", "100000", "--repeats", "1", "--json"])
    assert rc == 0
    data = json.loads(capsys.readouterr().out)
    names = [r["codec"] for r in data["codecs"]]
    assert names == gradcompress.available() + list(EXTRA_CODECS)
    assert data["numel"] == 100000 and data["fp16_roundtrip_seconds"] > 0
    rows = {r["codec"]: r for r in data["codecs"]}
    assert rows["none"]["relative_error"] == 0 and rows["none"]["compression_ratio"] == pytest.approx(1.0)
    assert rows["fp16"]["compression_ratio"] == pytest.approx(2.0)
    assert rows["int8"]["compression_ratio"] > 3.5 and rows["int8"]["relative_error"] < 0.05
    assert rows["powersgd:rank=4"]["shape"] == [4096, 100000 // 4096]
    for r in data["codecs"]:
        assert r["encode_seconds"] >= 0 and r["decode_seconds"] >= 0 and r["vs_fp16_roundtrip"] is not None


def test_bench_subset_table(capsys):
    rc = main(["bench", "--numel", "50000", "--repeats", "1", "--codecs", "int8;topk:ratio=0.01,values=int8"])
    assert rc == 0
    out = capsys.readouterr().out
    assert "topk:ratio=0.01,values=int8" in out and "int8" in out and "encode GB/s" in out


def test_bench_in_step_json(capsys):
    """--in-step: a whole Compressor step per scheme against a dense all-reduce, with its memory (2 workers)."""
    rc = main(["bench", "--in-step", "--codecs", "none;int8", "--size", "256", "--matrices", "2", "--repeats", "2",
               "--json"])
    assert rc == 0
    data = json.loads(capsys.readouterr().out)
    assert data["workers"] == 2 and data["grad_bytes"] == 2 * 256 * 256 * 4 and data["dense_seconds"] > 0
    rows = {r["scheme"]: r for r in data["schemes"]}
    assert rows["none"]["wire_bytes_per_step"] == data["grad_bytes"]  # 2 workers: a ring all-reduce sends n
    assert rows["int8"]["wire_bytes_per_step"] < data["grad_bytes"] / 3
    assert rows["int8"]["error_feedback"] and not rows["none"]["error_feedback"]
    for r in rows.values():
        assert r["step_seconds"] > 0 and r["vs_dense"] > 0
        assert r["held_x"] is None or r["held_x"] >= 0
        assert r["host_syncs_per_step"] == 1  # the overflow check's one read (tests/test_host_syncs.py)


def test_bench_versus_torch_hooks_json(capsys):
    """--in-step --versus-torch: PyTorch's own DDP hooks and ours in one launch (real DDP, 2 gloo workers)."""
    rc = main(["bench", "--in-step", "--versus-torch", "--size", "128", "--matrices", "2", "--repeats", "2", "--json"])
    assert rc == 0
    data = json.loads(capsys.readouterr().out)
    names = [v["variant"] for v in data["variants"]]
    assert names[0] == "DDP (no hook)" and "torch fp16_compress_hook" in names and "powersgd:rank=4" in names
    assert data["variants"][0]["vs_ddp"] == 1.0
    assert all(v["step_seconds"] > 0 for v in data["variants"])


@pytest.mark.slow
def test_fault_tolerant_train_survives_a_killed_replica(capsys):
    """``train --fault-tolerant``: torchft's lighthouse, 3 replicas, one SIGKILLed at step 10 and restarted at 20:
    the survivors commit every step, the restarted one the steps after it healed, all end equal."""
    pytest.importorskip("torchft")
    rc = main(["train", "--fault-tolerant", "--codec", "int8", "--replicas", "3", "--steps", "30", "--kill-at", "10",
               "--restart-at", "20"])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "replica 0: 30; replica 1: 30; replica 2: " in out and "equal parameters: yes" in out
    healed = 30 - int(out.split("replica 2: ")[1].split(";")[0]) + 10  # it rejoined at step 20 or a little later
    assert 20 <= healed <= 23, out
    assert f"quorum: 3 x 10, 2 x {healed - 9}, 3 x {30 - healed - 1}" in out
