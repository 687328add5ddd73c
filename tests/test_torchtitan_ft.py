"""gradcompress under torchtitan's fault-tolerant trainer (issue 47, point 4's second bullet and point 5), for real.

torchtitan 0.3.0's ``FaultTolerantTrainer`` (``--config llama3_torchft_debugmodel --fault_tolerance.enable``) on CPU
with gloo, through ``tests/torchtitan_launcher.py`` (the CPU shims): a torchft lighthouse in this process
(``min_replicas=1``), 2 replica groups of 1 process each (one torchrun per group; FSDP over the group's own 1-rank
mesh, as torchtitan builds it), ``--module gradcompress.integrations.torchtitan`` with a codec (int8: the
cross-group all-reduce is gradcompress's on the Manager's quorum) and with DiLoCo (int2 + Muon, gradcompress's
DiLoCo with the Manager). Group 1 is SIGKILLed mid-run and restarted; group 0 trains on alone (a quorum of one
in its log), then waits before a fixed step until the restarted group has asked for its first quorum (test
instrumentation, ``tests/torchtitan_launcher.py``: a fresh torchtitan takes ~20 s to start here, and torchft's
lighthouse forms a quorum of the previous members at once when they all ask before a newcomer); the restarted
group heals from group 0 at that step (its log says so, with group 0's step) and both finish the run. Each rank dumps its local parameter shards (and DiLoCo's anchors) at
close: equal across the groups where they must be. Every launch has a timeout; a hang kills it and fails the test.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch

pytest.importorskip("torchtitan", reason="torchtitan is not installed (pip install -e '.[torchtitan]')")
pytest.importorskip("torchft", reason="torchft is not installed (pip install -e '.[torchtitan]')")
pytest.importorskip("tokenizers", reason="tokenizers is not installed (pip install -e '.[torchtitan]')")
pytest.importorskip("torchtitan.experiments.torchft.trainer", reason="torchtitan without its torchft experiment")

import torchtitan_harness as harness

from gradcompress.integrations.torchft.lighthouse import Lighthouse

MODULE = "gradcompress.integrations.torchtitan"
TIMEOUT = 300  # seconds per torchrun (a 12-step group takes about a minute on 2 loaded cores)
STEP_LINE = r"step:\s+{}\s+loss:\s+([-\d.]+)"


@pytest.fixture(scope="module")
def assets(tmp_path_factory: pytest.TempPathFactory) -> harness.Assets:
    return harness.build_assets(tmp_path_factory.mktemp("torchtitan_ft_assets"))


def losses(text: str) -> dict[int, float]:
    return {int(s): float(v) for s, v in re.findall(r"step:\s+(\d+)\s+loss:\s+([-\d.]+)", text)}


def quorum_sizes(text: str) -> list[int]:
    """The number of replica groups in each quorum torchft's Manager logged (``got lighthouse quorum``)."""
    return [line.count("QuorumMember {") for line in text.splitlines() if "got lighthouse quorum" in line]


class Scenario:
    """2 replica groups under one lighthouse; group 1 killed at ``kill_at`` (its step) and restarted, group 0
    waiting at ``wait_at`` for the restarted group's trainer."""

    def __init__(self, assets: harness.Assets, root: Path, spec: str, steps: int, lighthouse: str) -> None:
        self.assets, self.root, self.spec, self.steps, self.lighthouse = assets, root, spec, steps, lighthouse
        self.started = time.monotonic()

    def launch(self, replica: int, name: str, env: dict[str, str]) -> subprocess.Popen:
        args = ["--module", MODULE, "--config", "llama3_torchft_debugmodel", "--fault_tolerance.enable",
                "--fault_tolerance.replica_id", str(replica), "--fault_tolerance.group_size", "2",
                "--fault_tolerance.process_group", "gloo", "--gradcompress.scheme", self.spec,
                "--dataloader.dataset", "c4_test", "--profiler.no-enable_profiling",
                *harness.small_run_args(self.assets, self.root / f"dump_{name}", self.steps)]
        pids = self.root / f"pids_{name}"
        pids.mkdir()
        return harness.launch(args, self.root / f"{name}.log", nproc=1, params=self.root / f"params_{name}",
                              env={"TORCHFT_LIGHTHOUSE": self.lighthouse, "TORCHTITAN_TEST_PIDS": str(pids), **env})

    def wait_for_step(self, name: str, step: int, proc: subprocess.Popen) -> None:
        log = self.root / f"{name}.log"
        end = time.monotonic() + TIMEOUT
        while not re.search(STEP_LINE.format(step), log.read_text()):
            if proc.poll() is not None or time.monotonic() > end:
                self.kill(name, proc)
                raise AssertionError(f"{name} never logged step {step}:\n{log.read_text()[-4000:]}")
            time.sleep(0.1)

    def kill(self, name: str, proc: subprocess.Popen) -> None:
        """SIGKILL the run's workers (each in its own session under torchrun) and torchrun."""
        for pid_file in (self.root / f"pids_{name}").glob("pid*"):
            try:
                os.kill(int(pid_file.read_text()), signal.SIGKILL)
            except ProcessLookupError:
                pass
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait()

    def finish(self, name: str, proc: subprocess.Popen) -> harness.Run:
        try:
            return harness.finish(proc, self.root / f"{name}.log", TIMEOUT, self.started)
        except subprocess.TimeoutExpired:
            self.kill(name, proc)
            raise

    def run(self, kill_at: int, wait_at: int) -> tuple[harness.Run, harness.Run, harness.Run]:
        """(survivor, killed, restarted): both groups started, each waiting before its first step until the other
        is about to train its own (a slow start would otherwise leave one group asking for a quorum alone: group 1
        alone trained steps 1-2 while group 0 still started, seen under load; or group 1 asking alone while group 0
        waits at ``wait_at``, a quorum torchft's lighthouse never forms), group 1 killed once it logged
        ``kill_at`` and restarted at once; group 0 waits before its step ``wait_at`` for the restarted group's first
        quorum request."""
        announce, ready = self.root / "restarted", self.root / "killed_ready"
        survivor_ready = self.root / "survivor_ready"  # each first group waits for the other's: neither asks alone
        survivor = self.launch(0, "survivor", {"TORCHTITAN_TEST_WAIT": f"1:{ready},{wait_at}:{announce}",
                                               "TORCHTITAN_TEST_READY": str(survivor_ready)})
        first = self.launch(1, "killed", {"TORCHTITAN_TEST_READY": str(ready),
                                          "TORCHTITAN_TEST_WAIT": f"1:{survivor_ready}"})
        try:
            self.wait_for_step("killed", kill_at, first)
            self.kill("killed", first)
            killed = harness.Run(first.returncode, (self.root / "killed.log").read_text(), 0.0)
            restarted = self.launch(1, "restarted", {"TORCHTITAN_TEST_ANNOUNCE": str(announce)})
            try:
                return self.finish("survivor", survivor), killed, self.finish("restarted", restarted)
            finally:
                if restarted.poll() is None:
                    self.kill("restarted", restarted)
        finally:
            for name, proc in (("survivor", survivor), ("killed", first)):
                if proc.poll() is None:
                    self.kill(name, proc)

    def params(self, name: str) -> dict[str, torch.Tensor]:
        return torch.load(self.root / f"params_{name}" / "rank0.pt")


def check_kill_and_heal(survivor: harness.Run, killed: harness.Run, restarted: harness.Run, kill_at: int,
                        wait_at: int, steps: int) -> int:
    """What every scenario must show; returns the step the restarted group healed at (``wait_at``)."""
    assert survivor.returncode == 0, survivor.output[-4000:]
    assert restarted.returncode == 0, restarted.output[-4000:]
    assert killed.returncode != 0 and kill_at in losses(killed.output)  # it trained, then was killed
    assert steps not in losses(killed.output)
    # the survivor trained on alone: a quorum of its group only, and every step logged
    assert 1 in quorum_sizes(survivor.output), quorum_sizes(survivor.output)
    assert set(losses(survivor.output)) == set(range(1, steps + 1))
    # the restarted group healed from the survivor, at the survivor's step (past where it waited), and finished
    healed = [int(s) for s in re.findall(r"gradcompress: healed from a peer replica group at step (\d+)",
                                         restarted.output)]
    assert healed == [wait_at], (healed, restarted.output[-4000:])
    assert max(losses(restarted.output)) == steps
    assert min(losses(restarted.output)) <= healed[0]  # the restarted group started from its own step 1
    for run in (survivor, restarted):
        final = losses(run.output)[steps]
        assert torch.isfinite(torch.tensor(final)) and final < losses(survivor.output)[1], final
    return healed[0]


@pytest.mark.slow
def test_int8_a_killed_group_heals_and_the_groups_end_equal(assets: harness.Assets, tmp_path: Path) -> None:
    """int8 (the cross-group all-reduce is gradcompress's on the Manager's quorum), 12 steps: group 1 killed after
    step 3 and restarted; group 0 trains on alone (a quorum of one) and waits before step 7; the restarted group
    heals at step 7 (step, schedulers, shards, AdamW state) and from then the groups' parameter shards are equal
    bit for bit to the end."""
    steps, kill_at, wait_at = 12, 3, 7
    with Lighthouse(min_replicas=1, join_timeout_ms=10000, heartbeat_timeout_ms=1000) as lighthouse:
        scenario = Scenario(assets, tmp_path, "int8", steps, lighthouse.address)
        survivor, killed, restarted = scenario.run(kill_at, wait_at)
    healed = check_kill_and_heal(survivor, killed, restarted, kill_at, wait_at, steps)
    print(f"int8: healed at step {healed}; {time.monotonic() - scenario.started:.1f} s; final loss "
          f"{losses(survivor.output)[steps]:.5f} / {losses(restarted.output)[steps]:.5f}")
    assert "int8 compresses the gradient all-reduce across the torchft replica groups" in survivor.output
    ours, theirs = scenario.params("survivor"), scenario.params("restarted")
    assert ours.keys() == theirs.keys() and len(ours) > 10
    assert all(torch.equal(ours[n], theirs[n]) for n in ours)


@pytest.mark.slow
def test_diloco_a_killed_group_heals_from_its_peers_anchors(assets: harness.Assets, tmp_path: Path) -> None:
    """``int2:diloco=4,inner=muon`` across the 2 groups, 14 steps: group 1 killed after step 6 and restarted;
    group 0 syncs alone at step 8 and waits before its sync step 12 until the restarted group (at its own first
    sync, step 4) has asked for a quorum; the restarted group heals there (anchors, outer state, counters, step 12). The run ends 2 inner steps after that last sync: the
    groups' DiLoCo anchors are equal bit for bit and their parameters are not (each trained on its own data since)."""
    steps, kill_at, wait_at = 14, 6, 12
    spec = "int2:diloco=4,inner=muon"
    with Lighthouse(min_replicas=1, join_timeout_ms=10000, heartbeat_timeout_ms=1000) as lighthouse:
        scenario = Scenario(assets, tmp_path, spec, steps, lighthouse.address)
        survivor, killed, restarted = scenario.run(kill_at, wait_at)
    healed = check_kill_and_heal(survivor, killed, restarted, kill_at, wait_at, steps)
    print(f"DiLoCo: healed at step {healed}; {time.monotonic() - scenario.started:.1f} s; final loss "
          f"{losses(survivor.output)[steps]:.5f} / {losses(restarted.output)[steps]:.5f}")
    assert f"DiLoCo {spec} across the 2 torchft replica groups" in survivor.output
    ours, theirs = scenario.params("survivor"), scenario.params("restarted")
    anchors = [n for n in ours if n.startswith("diloco.anchor.")]
    params = [n for n in ours if not n.startswith("diloco.anchor.")]
    assert ours.keys() == theirs.keys() and len(anchors) == len(params) > 10
    assert all(torch.equal(ours[n], theirs[n]) for n in anchors)
    assert not all(torch.equal(ours[n], theirs[n]) for n in params)


def ft_config(scheme: str, **fault_tolerance: object) -> object:
    """``llama3_torchft_debugmodel`` through this module, fault tolerance on, the scheme set."""
    from gradcompress.integrations import torchtitan as titan

    config = titan.llama3_torchft_debugmodel()
    config.gradcompress = titan.GradcompressConfig(scheme=scheme)
    config.fault_tolerance.enable, config.fault_tolerance.group_size = True, 2
    for name, value in fault_tolerance.items():
        setattr(config.fault_tolerance, name, value)
    return config


def test_the_torchft_experiment_configs_reach_the_section() -> None:
    """torchtitan's ConfigManager finds ``llama3_torchft_debugmodel`` here; torchtitan's default semi-sync method
    (``diloco``) is cleared: the gradcompress scheme replaces it."""
    from torchtitan.config import ConfigManager

    config = ConfigManager().parse_args(["--module", MODULE, "--config", "llama3_torchft_debugmodel",
                                         "--fault_tolerance.enable", "--fault_tolerance.replica_id", "1",
                                         "--fault_tolerance.group_size", "2", "--gradcompress.scheme", "int8"])
    assert type(config).__name__ == "GradcompressFaultTolerantTrainerConfig"
    assert (config.gradcompress.scheme, config.fault_tolerance.replica_id) == ("int8", 1)
    assert config.fault_tolerance.semi_sync_method is None
    assert type(config)._owner.__name__ == "GradcompressFaultTolerantTrainer"


@pytest.mark.parametrize("scheme, options, message", [
    ("int2:diloco=4,inner=muon", {"semi_sync_method": "diloco"}, "replaces torchtitan's --fault_tolerance.semi_sync"),
    ("int8", {"semi_sync_method": "local_sgd"}, "replaces torchtitan's --fault_tolerance.semi_sync_method"),
    ("auto", {}, "not supported under torchft"),
])
def test_unsupported_combinations_under_torchft_are_refused(scheme: str, options: dict, message: str) -> None:
    from gradcompress.integrations import torchtitan as titan

    with pytest.raises(ValueError, match=re.escape(message)):
        titan.check_config(ft_config(scheme, **options))


def test_replicas_inside_a_group_are_refused_under_torchft() -> None:
    from gradcompress.integrations import torchtitan as titan

    config = ft_config("int8")
    config.parallelism.data_parallel_replicate_degree = 2  # type: ignore[attr-defined]
    with pytest.raises(ValueError, match="keep --parallelism.data_parallel_replicate_degree at 1"):
        titan.check_config(config)


def test_torchfts_own_semi_sync_method_runs_with_scheme_none() -> None:
    from gradcompress.integrations import torchtitan as titan

    titan.check_config(ft_config("none", semi_sync_method="diloco"))
    titan.check_config(ft_config("int2:diloco=4,inner=muon"))  # DiLoCo needs no replicate degree under torchft
