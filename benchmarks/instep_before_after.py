"""Two checkouts side by side, interleaved in one launch (BENCHMARKS.md, "The exchange redesign: before / after").

    git worktree add /tmp/before <commit before the change>
    python benchmarks/instep_before_after.py /tmp/before/src src [--rounds 3]

Each round runs, from each source tree in turn (before, after, before, after, ...; the same arguments), three
measurements in a fresh interpreter:

* ``gradcompress bench --in-step``'s run: per scheme the step time / a dense all-reduce of the same gradients
  (2 gloo workers, 3 matrices of 2048 x 2048, median of 6 steps);
* ``gradcompress bench --in-step --versus-torch``'s run: DDP with our hooks and PyTorch's, step time / plain DDP;
* the Python cost of a step at W = 4 and W = 32 (``benchmarks/python_cost_by_world.py``'s measurement, local
  stand-in collectives, 100 tensors of 4096 elements).

Prints, per quantity, the median over rounds of each tree and after / before. Ratios, not times, are compared:
the machine is shared and noisy.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

SCHEMES = ["none", "fp16", "int8", "sign", "topk:ratio=0.01", "powersgd:rank=4"]
COST_SCHEMES = ["int8", "sign", "topk:ratio=0.01", "powersgd:rank=4", "fp16"]
HERE = os.path.dirname(os.path.abspath(__file__))
RUN = f"""
import json, sys
sys.path.insert(0, {HERE!r})
from gradcompress.cli.instep import run_in_step, run_ddp_versus_torch
from python_cost_by_world import step_seconds
import torch
if __name__ == '__main__':
    out = {{}}
    r = run_in_step({SCHEMES!r}, 2, 2048, 3, 6, 0)
    for s in r['schemes']:
        out['in-step ' + s['scheme'] + ' (x dense)'] = s['vs_dense']
    r = run_ddp_versus_torch(2, 2048, 3, 64, 6, 0)
    for v in r['variants']:
        out['versus-torch ' + v['variant'] + ' (x DDP)'] = v['vs_ddp']
    torch.set_num_threads(1)
    for spec in {COST_SCHEMES!r}:
        w4, w32 = (step_seconds(spec, w, 100, 4096, 9) for w in (4, 32))
        out['python cost ' + spec + ' (W=32 / W=4)'] = w32 / w4
    print(json.dumps(out))
"""


def measure(src: str) -> dict:
    env = dict(os.environ, PYTHONPATH=os.path.abspath(src))
    path = "/tmp/_instep_before_after_run.py"
    with open(path, "w") as f:
        f.write(RUN)
    out = subprocess.run([sys.executable, path], env=env, capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("before")
    ap.add_argument("after")
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    runs: dict[str, list[dict]] = {"before": [], "after": []}
    for r in range(args.rounds):
        for name, src in (("before", args.before), ("after", args.after)):
            runs[name].append(measure(src))
            print(f"round {r + 1} {name}: done", file=sys.stderr)
    print(f"median of {args.rounds} interleaved rounds")
    print("| quantity | before | after | after / before |")
    print("|---|---|---|---|")
    for key in runs["before"][0]:
        b = statistics.median(r[key] for r in runs["before"])
        a = statistics.median(r[key] for r in runs["after"])
        print(f"| {key} | {b:.2f} | {a:.2f} | {a / b:.2f} |")


if __name__ == "__main__":
    main()
