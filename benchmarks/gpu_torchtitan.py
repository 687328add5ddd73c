"""torchtitan on CUDA/NCCL with gradcompress (issue 47), for ``benchmarks/gpu_check.sh``.

The llama3 debug model from torchtitan's own command line (``--module gradcompress.integrations.torchtitan``), the
tokenizer and text built locally as the tests build them (``tests/torchtitan_harness.py``), started through
``tests/torchtitan_launcher.py`` with ``TORCHTITAN_DEVICE=cuda`` (no CPU shims; only ``set_timeout`` where this
torch lacks it). Runs: torchtitan's own FSDP and ``int8`` FSDP over 2 GPUs (20 steps: loss and x fewer bytes), and
DiLoCo ``int2:diloco=5,inner=muon`` across 2 replicas (10 steps). NCCL takes one rank per GPU: with fewer than 2
GPUs it prints why it skipped. One JSON object per run on stdout.
"""

from __future__ import annotations

import json
import os
import re
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

import torchtitan_harness as harness  # noqa: E402  # the tests' harness, found through the path above

RUNS = {  # name -> (scheme, extra torchtitan options, steps)
    "fsdp": ("none", [], 20),
    "fsdp_int8": ("int8", [], 20),
    "diloco_int2_muon": ("int2:diloco=5,inner=muon", ["--parallelism.data_parallel_replicate_degree", "2"], 10),
}


def run(name: str, assets: harness.Assets, work: Path) -> dict:
    """One torchrun of 2 processes on 2 GPUs; its last logged loss, its gradcompress stats, its exit status."""
    scheme, extra, steps = RUNS[name]
    dump = work / name
    args = ["--module", "gradcompress.integrations.torchtitan", "--config", "llama3_debugmodel",
            *harness.small_run_args(assets, dump, steps), "--gradcompress.scheme", scheme,
            "--gradcompress.stats_file", "gc.jsonl", *extra]
    os.environ["TORCHTITAN_DEVICE"] = "cuda"
    done = harness.torchrun(args, work / f"{name}.log", nproc=2, timeout=600)
    losses = [float(x) for x in re.findall(r"step:\s*\d+\s+loss:\s*([0-9.]+)", done.output)]
    stats = dump / "gc.jsonl"
    last = json.loads(stats.read_text().splitlines()[-1]) if stats.exists() else {}
    return {"section": "torchtitan", "run": name, "scheme": scheme, "returncode": done.returncode,
            "seconds": round(done.seconds, 1), "final_loss": losses[-1] if losses else None,
            "x_fewer": last.get("gradcompress/x_fewer"), "tail": done.output[-1500:] if done.returncode else ""}


def main() -> None:
    if torch.cuda.device_count() < 2:
        print(json.dumps({"section": "torchtitan", "skipped": f"{torch.cuda.device_count()} GPU(s): FSDP over 2 ranks "
                          "and DiLoCo across 2 replicas need 2 (NCCL takes one rank per GPU)"}))
        return
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        assets = harness.build_assets(work / "assets")
        for name in RUNS:
            print(json.dumps(run(name, assets, work)), flush=True)


if __name__ == "__main__":
    main()
