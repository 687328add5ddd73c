"""torchtitan's llama3 debug model, 4 processes on CPU (gloo): its own data parallelism against gradcompress (issue 47).

    python benchmarks/torchtitan_lm.py CONFIG [--steps 300] [--json]

One configuration per invocation (each takes minutes on 2 cores), the same seed and text for all:

* ``dp``: torchtitan's own run (``--module llama3``), FSDP over the 4 processes;
* ``torchft``: torchtitan's torchft DiLoCo as it ships (``--module torchft.llama3 --config
  llama3_torchft_debugmodel``: ``semi_sync_method diloco``, its ``sync_steps`` and fragments, torchft's outer SGD
  at lr 0.7 with Nesterov), 2 replica groups of 2 processes under a torchft lighthouse on 127.0.0.1;
* any other word: a gradcompress scheme (``int8``, ``int4``, ``int2:diloco=100,fragments=4,delay=5,inner=muon``)
  through ``--module gradcompress.integrations.torchtitan``; a DiLoCo scheme runs on 2 replicas x 2 shards.

torchtitan runs through ``tests/torchtitan_launcher.py`` (the CPU shims) with the tokenizer and text of
``tests/torchtitan_harness.py`` (built locally), seq_len 128, 4 sequences per process, torchtitan's default loss.
Prints the loss of every step, the final loss, the gradient bytes each process sends per step (gradcompress: its
stats file; torchtitan's own runs: computed from the parameter count, see :func:`dense_bytes`) and the wall time;
``--json``: one JSON object (``python benchmarks/record.py torchtitan_dp -- python benchmarks/torchtitan_lm.py dp
--json``).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests"))

import torchtitan_harness as harness  # noqa: E402

PROCESSES, REPLICAS = 4, 2
MODULE = "gradcompress.integrations.torchtitan"
TORCHFT_CONFIG = ["--module", "torchft.llama3", "--config", "llama3_torchft_debugmodel", "--dataloader.dataset",
                  "c4_test", "--fault_tolerance.process_group", "gloo", "--profiler.no-enable_profiling",
                  "--fault_tolerance.group_size", str(PROCESSES // REPLICAS)]


def losses(output: str, ranks: int) -> dict[int, float]:
    """Step -> loss, the mean of the values the torchtitan logs in ``output`` print for that step (each of
    ``ranks`` processes prints its line; under torchft each replica group its own loss)."""
    found: dict[int, list[float]] = {}
    for step, value in re.findall(r"step:\s+(\d+)\s+loss:\s+([-\d.]+)", output):
        found.setdefault(int(step), []).append(float(value))
    return {s: sum(v) / len(v) for s, v in sorted(found.items()) if len(v) == ranks}


def parameters(output: str) -> int:
    """The model's parameter count, from torchtitan's ``Model llama3 debugmodel size: N total parameters``."""
    return int(re.search(r"size: ([\d,]+) total parameters", output).group(1).replace(",", ""))  # type: ignore[union-attr]


def dense_bytes(params: int, shards: int, replicas: int, every: int = 1) -> float:
    """Gradient bytes one process sends per step, float32, ring collectives: FSDP's reduce-scatter over ``shards``
    processes ((W-1)/W of the model), or with ``replicas`` the all-reduce of each process's 1/shards of the model
    across the replicas (2(R-1)/R of it) once every ``every`` steps (torchft DiLoCo's pseudo-gradients)."""
    if replicas == 1:
        return 4 * params * (shards - 1) / shards
    return 4 * params / shards * 2 * (replicas - 1) / replicas / every


def torchrun(args: list[str], log: Path, nproc: int, env: dict[str, str]) -> subprocess.Popen:
    """``torch.distributed.run`` of the launcher (the CPU shims) with torchtitan's ``args``, output to ``log``."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc), "--rdzv_backend", "c10d",
           "--rdzv_endpoint", "localhost:0", str(harness.LAUNCHER), *args]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1",
           "TOKENIZERS_PARALLELISM": "false", "PYTHONUNBUFFERED": "1", **env}
    with open(log, "w") as out:
        return subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)


def wait(procs: list[subprocess.Popen], logs: list[Path], timeout: float) -> str:
    """Wait for every run; the output of all, or SystemExit with the tail of the first failed one."""
    end = time.monotonic() + timeout
    for proc, log in zip(procs, logs):
        try:
            code = proc.wait(timeout=max(1.0, end - time.monotonic()))
        except subprocess.TimeoutExpired:
            for p in procs:
                os.killpg(p.pid, 9)
            raise SystemExit(f"timed out after {timeout:.0f} s; log: {log}") from None
        if code != 0:
            for p in procs:
                if p.poll() is None:
                    os.killpg(p.pid, 9)
            raise SystemExit(f"exit {code}; log {log}:\n" + log.read_text()[-3000:])
    return "".join(log.read_text() for log in logs)


def run(config: str, steps: int, work: Path, timeout: float) -> dict:
    assets = harness.build_assets(work / "assets")
    dump = work / config.replace(":", "_").replace(",", "_").replace("=", "")
    dump.mkdir(parents=True, exist_ok=True)
    base = harness.small_run_args(assets, dump, steps)
    start = time.monotonic()
    result: dict = {"config": config, "steps": steps, "processes": PROCESSES}
    if config == "torchft":
        from gradcompress.integrations.torchft import Lighthouse

        with Lighthouse(min_replicas=REPLICAS) as lighthouse:
            logs = [dump / f"replica{r}.log" for r in range(REPLICAS)]
            procs = [torchrun([*base, *TORCHFT_CONFIG, "--fault_tolerance.enable", "--fault_tolerance.replica_id",
                               str(r)], logs[r], PROCESSES // REPLICAS, {"TORCHFT_LIGHTHOUSE": lighthouse.address})
                     for r in range(REPLICAS)]
            output = wait(procs, logs, timeout)
        result["torchtitan_args"] = [*TORCHFT_CONFIG, "--fault_tolerance.enable", *base]
        from torchtitan.experiments.torchft.llama3.config_registry import llama3_torchft_debugmodel

        ft = llama3_torchft_debugmodel().fault_tolerance
        result.update(layout=f"{REPLICAS} torchft replica groups x {PROCESSES // REPLICAS} (FSDP)",
                      sync_steps=ft.sync_steps, fragments=ft.num_fragments,
                      bytes_per_step=dense_bytes(parameters(output), PROCESSES // REPLICAS, REPLICAS, ft.sync_steps),
                      bytes_from="computed: torchft's float32 all-reduce of each process's shard across the replica "
                                 "groups, once per sync_steps")
    else:
        ours = config != "dp"
        diloco = ours and "diloco=" in config
        args = ["--module", MODULE if ours else "llama3", "--config", "llama3_debugmodel"]
        if ours:
            args += ["--gradcompress.scheme", config, "--gradcompress.stats_file", "gc.jsonl"]
        if diloco:
            args += ["--parallelism.data_parallel_replicate_degree", str(REPLICAS)]
        result["torchtitan_args"] = [*args, *base]
        log = dump / "run.log"
        output = wait([torchrun([*base, *args], log, PROCESSES, {})], [log], timeout)
        result["layout"] = f"{REPLICAS} replicas x {PROCESSES // REPLICAS} (HSDP mesh)" if diloco else \
            f"FSDP over {PROCESSES}"
        if ours:
            last = json.loads((dump / "gc.jsonl").read_text().splitlines()[-1])
            result.update(bytes_per_step=last["gradcompress/bytes_per_step"],
                          dense_bytes_per_step=last["gradcompress/dense_bytes_per_step"],
                          x_fewer=last["gradcompress/x_fewer"], bytes_from="the stats file (--gradcompress.stats_file)")
        else:
            result.update(bytes_per_step=dense_bytes(parameters(output), PROCESSES, 1),
                          bytes_from="computed: FSDP's float32 ring reduce-scatter of the gradients")
    result["seconds"] = time.monotonic() - start
    curve = losses(output, PROCESSES)
    params = parameters(output)
    result.update(parameters=params, dp_bytes_per_step=dense_bytes(params, PROCESSES, 1),
                  final_loss=curve[max(curve)], losses=[[s, v] for s, v in curve.items()])
    result["x_fewer_than_dp"] = result["dp_bytes_per_step"] / result["bytes_per_step"]
    return result


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("config", help="dp, torchft, or a gradcompress scheme (int8, int2:diloco=100,...)")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--work", type=Path, default=Path("/tmp/torchtitan_lm"), help="assets, logs and dumps")
    p.add_argument("--timeout", type=float, default=7200, help="seconds before the run is killed")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    args = p.parse_args()
    result = {"benchmark": "torchtitan_lm", **run(args.config, args.steps, args.work, args.timeout)}
    if args.json:
        print(json.dumps(result, indent=1))
        return
    for step, loss in result["losses"]:
        print(f"step {step:4}  loss {loss:.5f}")
    print(f"{args.config}: final loss {result['final_loss']:.5f}, {result['bytes_per_step'] / 2**20:.4f} MiB sent per "
          f"step and process ({result['x_fewer_than_dp']:.1f}x fewer than torchtitan's FSDP), "
          f"{result['seconds']:.0f} s")


if __name__ == "__main__":
    main()
