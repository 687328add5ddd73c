"""What the DDP hook costs when it sends dense: DDP's own all-reduce against ``register_ddp_hook(ddp, "none")`` and
``"auto"``, interleaved, on gloo workers over loopback (no network shaping: the hook's own cost, not the link's).

    python benchmarks/dense_hook_overhead.py --workers 2 --steps 110 --rounds 3

Prints the median step time of each run (the first 10 steps not counted), in milliseconds; with ``--json`` one JSON
object instead (``python benchmarks/record.py dense_hook_overhead -- python benchmarks/dense_hook_overhead.py --json``
keeps it as a result file).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

import gradcompress
from gradcompress.testbed import launch


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 32, 3), nn.ReLU(), nn.Conv2d(32, 64, 3), nn.ReLU(), nn.AdaptiveAvgPool2d(4),
                         nn.Flatten(), nn.Linear(1024, 256), nn.ReLU(), nn.Linear(256, 10))


def run(rank: int, world: int, mode: str, steps: int) -> float | None:
    ddp = DDP(_net())
    if mode != "ddp":
        gradcompress.register_ddp_hook(ddp, mode)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.01)
    x, y = torch.randn(32, 3, 32, 32), torch.randint(0, 10, (32,))
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        opt.zero_grad()
        nn.functional.cross_entropy(ddp(x), y).backward()
        opt.step()
        times.append(time.perf_counter() - start)
    kept = sorted(times[10:])
    return kept[len(kept) // 2] if rank == 0 else None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--steps", type=int, default=110)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--modes", default="ddp,none,auto")
    parser.add_argument("--json", action="store_true", help="print one JSON object (rounds, medians) instead")
    args = parser.parse_args()
    modes = args.modes.split(",")
    rounds = []
    for r in range(args.rounds):
        row = {m: launch.run(run, args.workers, m, args.steps, timeout=600)[0] for m in modes}
        rounds.append(row)
        if not args.json:
            print(f"round {r + 1}: " + ", ".join(f"{m} {1e3 * t:.2f} ms" for m, t in row.items()), flush=True)
    if args.json:
        print(json.dumps({"benchmark": "dense_hook_overhead", "workers": args.workers, "steps": args.steps,
                          "steps_not_counted": 10, "modes": modes, "median_step_s_by_round": rounds,
                          "median_over_rounds_s": {m: statistics.median(row[m] for row in rounds) for m in modes}},
                         indent=1))


if __name__ == "__main__":
    main()
