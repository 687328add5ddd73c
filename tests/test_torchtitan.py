"""gradcompress from torchtitan's own command line (issue 47): torchtitan 0.3.0 runs for real, on CPU with gloo.

The multi-process runs (``slow``) start ``torchrun`` on torchtitan's llama3 debug model with torchtitan's default
(chunked) loss, 2 processes, through ``tests/torchtitan_launcher.py`` (the CPU shims) with a tokenizer and text
built here from Python's own docstrings (``tests/torchtitan_harness.py``). Every run has a timeout: a hang kills
its process group and fails the test. Without torchtitan the module is skipped.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

pytest.importorskip("torchtitan", reason="torchtitan is not installed (pip install -e '.[torchtitan]')")
pytest.importorskip("tokenizers", reason="tokenizers is not installed (pip install -e '.[torchtitan]')")

import torchtitan_harness as harness

from gradcompress.integrations import torchtitan as titan

STEPS = 20
TIMEOUT = 240  # seconds per torchrun; a 20-step run takes about a minute on 2 cores
MODULE = "gradcompress.integrations.torchtitan"
DILOCO = "int2:diloco=100,fragments=4,delay=5,inner=muon"
REPLICAS = ["--parallelism.data_parallel_replicate_degree", "2"]  # 2 processes: 2 replicas of 1 shard


@pytest.fixture(scope="session")
def assets(tmp_path_factory: pytest.TempPathFactory) -> harness.Assets:
    """The tokenizer and the text, built once per test session."""
    return harness.build_assets(tmp_path_factory.mktemp("torchtitan_assets"))


def losses(output: str) -> dict[int, float]:
    """Step -> loss from torchtitan's step log lines (``step:  3  loss:  7.94031 ...``)."""
    return {int(s): float(v) for s, v in re.findall(r"step:\s+(\d+)\s+loss:\s+([-\d.]+)", output)}


def run(assets: harness.Assets, tmp_path: Path, name: str, args: list[str], steps: int = STEPS,
        params: Path | None = None, nproc: int = 2) -> harness.Run:
    """A torchrun of ``args`` plus the short-run options (2 processes), its log in ``tmp_path/name.log``."""
    dump = tmp_path / name
    return harness.torchrun([*args, *harness.small_run_args(assets, dump, steps)], tmp_path / f"{name}.log",
                            nproc=nproc, timeout=TIMEOUT, params=params)


def stats(path: Path) -> list[dict]:
    """The records of a ``--gradcompress.stats_file``."""
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.fixture(scope="module")
def torchtitan_run(assets: harness.Assets, tmp_path_factory: pytest.TempPathFactory) -> harness.Run:
    """torchtitan's own run of the debug model (``--module llama3``), 20 steps."""
    own = run(assets, tmp_path_factory.mktemp("torchtitan"), "torchtitan",
              ["--module", "llama3", "--config", "llama3_debugmodel"])
    assert own.returncode == 0, own.output[-4000:]
    print(f"torchtitan's own run: {own.seconds:.1f} s")
    return own


@pytest.mark.slow
def test_without_a_scheme_it_is_torchtitans_own_run(assets: harness.Assets, tmp_path: Path,
                                                    torchtitan_run: harness.Run) -> None:
    """Through the module with no scheme nothing is installed: the first two steps' losses are torchtitan's own to
    the digit (the learning-rate schedule depends on the run's length from step 3 on)."""
    got = run(assets, tmp_path, "none", ["--module", MODULE, "--config", "llama3_debugmodel",
                                         "--gradcompress.stats_file", "gc.jsonl"], steps=2)
    assert got.returncode == 0, got.output[-4000:]
    print(f"scheme none, 2 steps: {got.seconds:.1f} s")
    assert {s: losses(got.output)[s] for s in (1, 2)} == {s: losses(torchtitan_run.output)[s] for s in (1, 2)}
    assert "gradcompress none" not in got.output and "fewer than torchtitan" not in got.output
    assert [(r["step"], "gradcompress/x_fewer" in r) for r in stats(tmp_path / "none" / "gc.jsonl")] == \
        [(1, False), (2, False)]


@pytest.mark.slow
def test_int8_within_one_percent_of_torchtitan_at_four_times_fewer_bytes(assets: harness.Assets, tmp_path: Path,
                                                                          torchtitan_run: harness.Run) -> None:
    """torchtitan's own run and ``--gradcompress.scheme int8``, 20 steps from the same seed: int8's loss within
    1 % of torchtitan's after 20 steps, at >= 3.9x fewer gradient bytes per step than torchtitan's FSDP."""
    own = torchtitan_run
    ours = run(assets, tmp_path, "int8", ["--module", MODULE, "--config", "llama3_debugmodel",
                                          "--gradcompress.scheme", "int8", "--gradcompress.stats_file", "gc.jsonl"])
    assert ours.returncode == 0, ours.output[-4000:]
    print(f"int8: {ours.seconds:.1f} s")
    records = stats(tmp_path / "int8" / "gc.jsonl")
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))
    assert losses(ours.output)[STEPS] == pytest.approx(records[-1]["loss"], abs=1e-5)
    reference, got = losses(own.output)[STEPS], records[-1]["loss"]
    print(f"loss after {STEPS} steps: torchtitan {reference:.5f}, int8 {got:.5f}; "
          f"int8 x fewer: {records[-1]['gradcompress/x_fewer']:.3f}")
    assert abs(got - reference) <= 0.01 * reference
    assert min(r["gradcompress/x_fewer"] for r in records) >= 3.9
    assert "fewer than torchtitan's data parallelism" in ours.output


@pytest.mark.slow
def test_hsdp_int8_compresses_the_replicas_all_reduce(assets: harness.Assets, tmp_path: Path) -> None:
    """torchtitan's HSDP, 2 replicas x 2 shards (4 processes), with int8 and without, 3 steps: the replicas'
    all-reduce compressed, the losses within 0.5 %, >= 3.9x fewer bytes than torchtitan's dense all-reduce."""
    def hsdp(name: str, *args: str) -> harness.Run:
        got = run(assets, tmp_path, name, ["--config", "llama3_debugmodel", *REPLICAS, *args], steps=3, nproc=4)
        assert got.returncode == 0, got.output[-4000:]
        return got

    own = hsdp("hsdp", "--module", "llama3")
    ours = hsdp("hsdp_int8", "--module", MODULE, "--gradcompress.scheme", "int8", "--gradcompress.stats_file",
                "gc.jsonl")
    records, reference = stats(tmp_path / "hsdp_int8" / "gc.jsonl"), losses(own.output)[3]
    print(f"HSDP 2x2, 3 steps: torchtitan {own.seconds:.1f} s, int8 {ours.seconds:.1f} s; loss {reference:.5f} "
          f"and {records[-1]['loss']:.5f}; x fewer {records[-1]['gradcompress/x_fewer']:.3f}")
    assert "int8 compresses the HSDP replicas' gradient all-reduce" in ours.output
    assert abs(records[-1]["loss"] - reference) <= 0.005 * reference
    assert records[-1]["gradcompress/x_fewer"] >= 3.9


@pytest.mark.slow
def test_diloco_with_muon_across_two_replicas(assets: harness.Assets, tmp_path: Path) -> None:
    """``int2:diloco=5,inner=muon`` over 2 replicas (torchtitan's ``data_parallel_replicate_degree 2``), 10 steps:
    Muon inside, a sync every 5 steps, the replicas equal bit for bit after the last sync, the loss down, and at
    least 50x fewer bytes per step than torchtitan's HSDP all-reduce across the replicas."""
    params = tmp_path / "params"
    got = run(assets, tmp_path, "diloco", ["--module", MODULE, "--config", "llama3_debugmodel", *REPLICAS,
                                           "--gradcompress.scheme", "int2:diloco=5,inner=muon",
                                           "--gradcompress.stats_file", "gc.jsonl"], steps=10, params=params)
    assert got.returncode == 0, got.output[-4000:]
    records = stats(tmp_path / "diloco" / "gc.jsonl")
    print(f"DiLoCo int2 + Muon, 10 steps: {got.seconds:.1f} s; loss {records[0]['loss']:.5f} -> "
          f"{records[-1]['loss']:.5f}; x fewer {records[-1]['gradcompress/x_fewer']:.1f}")
    assert "DiLoCo int2:diloco=5,inner=muon across the 2 replicas" in got.output
    assert records[-1]["loss"] < records[0]["loss"] - 0.1
    assert records[-1]["gradcompress/x_fewer"] >= 50
    first, second = (torch.load(params / f"rank{r}.pt") for r in (0, 1))
    assert all(torch.equal(first[n], second[n]) for n in first)


@pytest.mark.slow
def test_an_unsupported_combination_is_one_clear_error_before_the_first_step(assets: harness.Assets,
                                                                             tmp_path: Path) -> None:
    """DiLoCo without replicas fails while torchtitan parses its command line: non-zero exit, the error names the
    option to set, no step is taken."""
    got = run(assets, tmp_path, "diloco", ["--module", MODULE, "--config", "llama3_debugmodel",
                                           "--gradcompress.scheme", DILOCO])
    assert got.returncode != 0
    flat = " ".join(re.sub(r"[│╭╮╰╯─]", " ", got.output).split())
    assert "DiLoCo syncs replicas: set --parallelism.data_parallel_replicate_degree to 2 or more" in flat
    assert not losses(got.output)


@pytest.mark.parametrize("spec, message", [
    ("bogus", "unknown codec 'bogus'"),
    ("int8:foo=1", "unknown option 'foo'"),
    ("powersgd:rank=4", "cannot compress FSDP's reduce-scatter"),
    ("ddp", "unknown codec 'ddp'"),
])
def test_bad_schemes_are_refused_when_the_config_is_made(spec: str, message: str) -> None:
    with pytest.raises(ValueError, match=re.escape(message)):
        titan.GradcompressConfig(scheme=spec)


@pytest.mark.parametrize("spec", ["none", "int8", "int4:warmup_steps=10", "topk:ratio=0.01", "auto", DILOCO])
def test_codec_specs_are_accepted(spec: str) -> None:
    assert titan.GradcompressConfig(scheme=spec).scheme == spec


def test_every_config_function_of_the_registered_models_is_exposed() -> None:
    """Each config function of each importable ``torchtitan.models.<m>.config_registry`` is found here by name
    and returns its own config, of a subclass of its class, with the ``gradcompress`` section at ``none`` (one
    that fails here, for a missing optional dependency such as torchao, fails the same through us)."""
    names = [(module, name) for module in titan._registries() for name in titan._config_functions(module)]
    assert ("torchtitan.models.llama3.config_registry", "llama3_debugmodel") in {(m.__name__, n) for m, n in names}
    for module, name in names:
        try:
            theirs = getattr(module, name)()
        except Exception as err:  # whatever torchtitan raises, we must raise too
            with pytest.raises(type(err)):
                getattr(titan, name)()
            continue
        ours = getattr(titan, name)()
        assert isinstance(ours, type(theirs)) and ours.gradcompress.scheme == "none", name
        assert issubclass(type(ours)._owner, type(theirs)._owner), name
    with pytest.raises(AttributeError, match="no config function"):
        titan.no_such_config  # noqa: B018


def test_the_command_line_reaches_the_section() -> None:
    """torchtitan's ConfigManager imports the module for ``--module`` and tyro parses ``--gradcompress.*``."""
    from torchtitan.config import ConfigManager

    config = ConfigManager().parse_args(["--module", MODULE, "--config", "qwen3_debugmodel",
                                         "--gradcompress.scheme", "int4", "--gradcompress.stats_file", "s.jsonl"])
    assert (config.gradcompress.scheme, config.gradcompress.stats_file) == ("int4", "s.jsonl")
    assert type(config).__name__ == "GradcompressTrainerConfig"


@pytest.mark.parametrize("replicas, checkpoint, message", [
    (1, False, "set --parallelism.data_parallel_replicate_degree to 2 or more"),
    (2, True, "not in torchtitan's checkpoints yet"),
])
def test_diloco_combinations_are_refused(replicas: int, checkpoint: bool, message: str) -> None:
    config = titan.llama3_debugmodel()
    config.gradcompress = titan.GradcompressConfig(scheme=DILOCO)
    config.parallelism.data_parallel_replicate_degree = replicas
    config.checkpoint.enable = checkpoint
    with pytest.raises(ValueError, match=re.escape(message)):
        titan.check_config(config)
