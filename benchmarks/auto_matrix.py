"""``auto`` on issue 39's evaluation matrix: 3 model families x 4 link rates x (batch 16, batch 64, batch 16 on an
emulated accelerator), and nodes 2 x 4, each cell one netbench run of auto next to DDP, torch-fp16, fp16, int8
and int4 on the namespace testbed (4 hosts; 2 nodes of 4 workers).

    python benchmarks/auto_matrix.py --half fitted --out /tmp/matrix_fitted.json
    python benchmarks/auto_matrix.py --half heldout --out /tmp/matrix_heldout.json

The cells are split in two halves like a checkerboard over (family, rate, column), so each half has every family,
rate and column: the rules' constants may be fixed on the ``fitted`` half; the ``heldout`` half is run unchanged
after and reported apart. auto: 20 untimed steps (its decision at step 3 and its selection come first), then the
median of 5; a fixed scheme: 4 untimed steps (its 2 dense ones, then 2 compressed), then the median of 5.
Writes the JSON object (the cells run so far, each with its netbench result or its error) to ``--out`` after each
cell, and prints it at the end.

    python benchmarks/auto_matrix.py --recheck FITTED.json HELDOUT.json --out /tmp/matrix_recheck.json

re-measures the cells of those results where DDP was the fastest fixed scheme, drift cancelled: DDP, auto, auto,
DDP in one netbench run (one sample of each, in a row, is what a machine whose speed drifts within a run reads
wrong; the mean of the two of each is compared).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCHEMES = "ddp;torch-fp16;fp16;int8;int4;auto"
FAMILIES = (("mlp", "mlp:512"), ("conv", "conv:32"), ("transformer", "transformer:128"))
RATES = ("10gbit", "1gbit", "100mbit", "10mbit")
#: (label, batch per worker, emulated accelerator)
COLUMNS = (("batch 16", 16, False), ("batch 64", 64, False), ("batch 16, accelerator", 16, True))
#: the nodes cells: (family, rate, half)
NODES = (("mlp", "1gbit", "fitted"), ("mlp", "100mbit", "heldout"))
WARMUP, FIXED_WARMUP, STEPS = 20, 4, 5
#: the re-check of a DDP-best cell: each twice, mirrored
RECHECK = "ddp;auto;auto;ddp"


def cells() -> list[dict]:
    """Every cell of the matrix, each with its half."""
    out = []
    for i, (family, model) in enumerate(FAMILIES):
        for j, rate in enumerate(RATES):
            for k, (column, batch, accelerator) in enumerate(COLUMNS):
                out.append({"family": family, "model": model, "rate": rate, "column": column, "batch": batch,
                            "accelerator": accelerator, "nodes": None,
                            "half": "fitted" if (i + j + k) % 2 == 0 else "heldout"})
    models = dict(FAMILIES)
    for family, rate, half in NODES:
        out.append({"family": family, "model": models[family], "rate": rate, "column": "nodes 2 x 4, batch 16",
                    "batch": 16, "accelerator": False, "nodes": [2, 4], "half": half})
    return out


def netbench_args(cell: dict, schemes: str = SCHEMES) -> list[str]:
    """The netbench command line of one cell."""
    where = (["--nodes", str(cell["nodes"][0]), "--workers-per-node", str(cell["nodes"][1])] if cell["nodes"]
             else ["--workers", "4"])
    return where + ["--bandwidth", cell["rate"], "--model", cell["model"], "--batch-size", str(cell["batch"]),
                    "--steps", str(STEPS), "--warmup", str(WARMUP), "--fixed-warmup", str(FIXED_WARMUP),
                    "--schemes", schemes, "--timeout", "3000", "--json"] + (
        ["--accelerator"] if cell["accelerator"] else [])


def ddp_best(results: list[str]) -> list[dict]:
    """The cells of the result files ``results`` whose fastest fixed scheme was DDP."""
    out = []
    for path in results:
        with open(path) as f:
            for run in json.load(f)["cells"]:
                if "result" in run:
                    fixed = [s for s in run["result"]["schemes"] if s["scheme"] in SCHEMES.split(";")[:-1]]
                    if min(fixed, key=lambda s: s["median_step_s"])["scheme"] == "ddp":
                        out.append(run["cell"])
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--half", choices=("fitted", "heldout", "all"), default="all")
    p.add_argument("--recheck", nargs="+", metavar="RESULT", help="re-measure these results' DDP-best cells")
    p.add_argument("--out", required=True, help="the JSON file written after each cell")
    args = p.parse_args(argv)
    chosen = ddp_best(args.recheck) if args.recheck else [c for c in cells() if args.half in ("all", c["half"])]
    schemes = RECHECK if args.recheck else SCHEMES
    done = {"half": "recheck" if args.recheck else args.half, "schemes": schemes, "warmup": WARMUP,
            "fixed_warmup": FIXED_WARMUP, "steps": STEPS, "cells": []}
    for n, cell in enumerate(chosen):
        command = [sys.executable, "-m", "gradcompress", "netbench", *netbench_args(cell, schemes)]
        print(f"auto_matrix: cell {n + 1}/{len(chosen)}: {' '.join(command[3:])}", file=sys.stderr, flush=True)
        run = subprocess.run(command, capture_output=True, text=True, cwd=ROOT)
        if run.returncode != 0:
            done["cells"].append({"cell": cell, "error": run.stderr.strip().splitlines()[-1:] or ["failed"]})
        else:
            done["cells"].append({"cell": cell, "result": json.loads(run.stdout)})
        with open(args.out, "w") as f:
            json.dump(done, f)
    print(json.dumps(done))
    return 0


if __name__ == "__main__":
    sys.exit(main())
