"""What a new user meets in the first hour (issue 48): no silent traps, errors that say what to do.

Each test runs what a user would run (a script in a fresh interpreter, or the CLI's ``main``) and reads the output.
"""

from __future__ import annotations

import contextlib
import io
import os
import subprocess
import sys
import textwrap
from unittest import mock

import pytest
import torch

from gradcompress.cli import main
from gradcompress.optim import DiLoCo
from gradcompress.testbed import launch

TIMEOUT = 120


def _script(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                          timeout=TIMEOUT)


def _last_line(text: str) -> str:
    return text.strip().splitlines()[-1]


# --------------------------------------------------------------------------- DiLoCo without a process group
def test_diloco_without_a_process_group_is_a_clear_error():
    """The README's recipe run as a plain script, without init_process_group: one error naming the fix (it used
    to train silently as one worker and print '3 0')."""
    r = _script("""
        import torch
        from gradcompress.optim import DiLoCo

        model = torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
        opt = DiLoCo(model, torch.optim.AdamW(model.parameters(), lr=3e-3), sync_every=50, codec="int4",
                     fragments=2, delay=5)
        for step in range(120):
            opt.zero_grad()
            model(torch.randn(8, 32)).pow(2).mean().backward()
            opt.step()
        print(opt.stats()["syncs"], opt.stats()["peak_sync_bytes"])
    """)
    assert r.returncode == 1 and r.stdout == "", (r.stdout, r.stderr)
    last = _last_line(r.stderr)
    assert last.startswith("RuntimeError: DiLoCo: torch.distributed is not initialised"), last
    for fix in ("init_process_group", "torchrun", "process_group=", "manager="):
        assert fix in last, last


@pytest.mark.parametrize("kwargs", [{}, {"outer": "sparseloco"}, {"fragments": 2, "delay": 1}])
def test_every_diloco_flavour_refuses_to_run_alone(kwargs):
    """Plain, SparseLoCo's outer and streaming DiLoCo: the same error, in the style of Compressor.synchronize's."""
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 2))
    with pytest.raises(RuntimeError, match="DiLoCo: torch.distributed is not initialised, so there is no group"):
        DiLoCo(model, torch.optim.SGD(model.parameters(), lr=0.1), sync_every=4, **kwargs)
    import gradcompress

    with pytest.raises(RuntimeError, match="gradcompress: torch.distributed is not initialised, so there is no group"):
        gradcompress.Compressor("int8").synchronize(model.parameters())


def test_diloco_on_a_group_of_one_process_still_runs():
    """What the error suggests for one process on its own: a 1-process gloo group; the syncs run (nothing sent)."""
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 2))
    with launch.one_process_group():
        opt = DiLoCo(model, torch.optim.SGD(model.parameters(), lr=0.1), sync_every=2)
        for _ in range(4):
            opt.zero_grad()
            model(torch.randn(4, 8)).pow(2).mean().backward()
            opt.step()
        assert opt.stats()["syncs"] == 2
        opt.close()


# --------------------------------------------------------------------------- fragments and the model's layers
def test_readme_recipe_on_a_three_layer_model_says_the_bound():
    """The README's recipe (fragments=4) on a 3-layer model: one error naming the 3 layers, the 4 fragments asked
    and what to pass instead."""
    r = _script("""
        import torch
        from gradcompress.optim import DiLoCo, muon

        model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 64),
                                    torch.nn.ReLU(), torch.nn.Linear(64, 4))
        opt = DiLoCo(model, muon(model, adamw_lr=3e-3), sync_every=100, codec="int2", fragments=4, delay=5)
    """)
    assert r.returncode == 1, r.stderr
    last = _last_line(r.stderr)
    assert last.startswith("ValueError: DiLoCo: fragments=4 is more than the model's layers: the model has 3 "
                           "layers"), last
    assert "pass fragments=3 or fewer" in last, last


def test_the_readme_states_the_bound():
    import os

    readme = open(os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "README.md")).read()
    section = readme[readme.index("## DiLoCo"):]
    assert "`fragments` at most the model's layers" in " ".join(section.split())


# --------------------------------------------------------------------------- the command line
def _cli(*argv: str) -> subprocess.CompletedProcess:
    """``gradcompress ARGV`` in a fresh interpreter, as a user types it (output to pipes, as in a log)."""
    return subprocess.run([sys.executable, "-m", "gradcompress", *argv], capture_output=True, text=True,
                          timeout=TIMEOUT)


def _cli_here(*argv: str) -> subprocess.CompletedProcess:
    """``gradcompress ARGV`` through the function the console script calls (``gradcompress.cli.main``), in this
    process, 80 columns wide as in a pipe: for help texts and argument errors, which start nothing (a fresh
    interpreter would spend ~2.5 s of the suite importing torch for each)."""
    out, err = io.StringIO(), io.StringIO()
    with mock.patch.dict(os.environ, {"COLUMNS": "80"}), contextlib.redirect_stdout(out), \
            contextlib.redirect_stderr(err):
        code = main(list(argv))
    return subprocess.CompletedProcess(["gradcompress", *argv], code, out.getvalue(), err.getvalue())


def _flat(text: str) -> str:
    return " ".join(text.split())


def test_top_level_help_lists_every_command():
    r = _cli("--help")
    assert r.returncode == 0, r.stderr
    listed = [line.split()[0] for line in r.stdout.splitlines() if line.startswith("    ") and line[4] != " "]
    assert listed == ["demo", "train", "bench", "netbench", "plan"], r.stdout
    description = _flat(r.stdout.split("positional arguments")[0])
    for command in ("(demo)", "(train)", "(bench)", "(netbench)", "(plan)"):
        assert command in description, description
    assert "--schemes" in r.stdout


@pytest.mark.parametrize("command", ["demo", "train"])
def test_demo_and_train_describe_both_tasks(command):
    r = _cli_here(command, "--help")
    assert r.returncode == 0, r.stderr
    description = _flat(r.stdout.split("options:")[0])
    assert "--task digits" in description and "MLP" in description, description
    assert "--task lm" in description and "transformer" in description, description


@pytest.mark.parametrize("command", ["demo", "train", "bench", "netbench", "plan"])
def test_every_command_takes_schemes(command):
    r = _cli_here(command, "--help")
    assert r.returncode == 0, r.stderr
    assert "--schemes SPEC" in r.stdout, r.stdout


@pytest.mark.parametrize("argv", [["train", "--schemes", "nosuch"], ["train", "--codec", "nosuch"],
                                  ["demo", "--schemes", "nosuch"]])
def test_old_names_still_work_and_the_valid_schemes_include_auto(argv):
    r = _cli_here(*argv)
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert "unknown scheme 'nosuch'; valid schemes: auto, " in r.stderr, r.stderr


def test_bench_schemes_and_its_old_name_codecs(tmp_path):
    import json

    runs = {}
    for option in ("--schemes", "--codecs"):
        r = _cli_here("bench", "--numel", "20000", "--repeats", "1", option, "int8;sign", "--json")
        assert r.returncode == 0, r.stderr
        runs[option] = [row["codec"] for row in json.loads(r.stdout)["codecs"]]
    assert runs["--schemes"] == runs["--codecs"] == ["int8", "sign"]


def test_train_takes_one_scheme():
    r = _cli_here("train", "--schemes", "int8;int4")
    assert r.returncode == 2 and "train runs one scheme, got 2 (int8; int4)" in r.stderr, r.stderr


def test_netbench_lists_auto_among_its_schemes():
    r = _cli_here("netbench", "--schemes", "nosuch")
    assert r.returncode == 2 and "valid: ddp, torch-fp16, torch-powersgd, auto, " in r.stderr, r.stderr


def test_plan_shows_workers_as_required():
    r = _cli_here("plan", "--help")
    assert "(--workers N | --nodes N)" in _flat(r.stdout.split("options:")[0]), r.stdout
    r = _cli_here("plan", "--params", "1e6", "--bandwidth", "1gbit")
    assert r.returncode == 2 and "one of the arguments --workers --nodes is required" in r.stderr, r.stderr


def test_no_progress_bars_in_a_redirected_log(tmp_path):
    """stderr a pipe (a log file, CI): no tqdm bars, neither from bench nor from the demo."""
    r = _cli("bench", "--numel", "20000", "--repeats", "1", "--schemes", "int8;sign")
    assert r.returncode == 0 and r.stderr == "", r.stderr
    r = _cli("demo", "--schemes", "none", "--steps", "3", "--workers", "2", "--out", str(tmp_path))
    assert r.returncode == 0, r.stderr
    assert "\r" not in r.stderr and "step/s" not in r.stderr and "%|" not in r.stderr, r.stderr
