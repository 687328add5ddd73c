"""What the DDP hook costs when it sends dense: DDP's own all-reduce against ``register_ddp_hook(ddp, "none")`` and
``"auto"``, interleaved, on gloo workers over loopback (no network shaping: the hook's own cost, not the link's).

    python benchmarks/dense_hook_overhead.py --workers 2 --steps 110 --rounds 3

Prints the median step time of each run (the first 10 steps not counted), in milliseconds.
"""

from __future__ import annotations

import argparse
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
    args = parser.parse_args()
    for r in range(args.rounds):
        row = {m: launch.run(run, args.workers, m, args.steps, timeout=600)[0] for m in args.modes.split(",")}
        print(f"round {r + 1}: " + ", ".join(f"{m} {1e3 * t:.2f} ms" for m, t in row.items()), flush=True)


if __name__ == "__main__":
    main()
