"""``auto`` on held-out cases nobody chose (issue 39): each case drawn by ``../shared/tools/heldout.py`` from a commit
hash, run unchanged on the namespace testbed next to the five fixed schemes, in one netbench run per case.

    python benchmarks/record.py auto_heldout -- python benchmarks/auto_heldout.py --seed COMMIT --n 6 --json

A case: model family and size (``mlp:W``, ``conv:C``, ``transformer:D``), batch per worker, workers, link rate,
latency (emulated with netem where the kernel has it; else dropped, and the case says so) and whether the compute
leaves the CPU idle (``--accelerator``). Each case: DDP, torch-fp16, fp16, int8, int4 and auto, 20 untimed steps
then the median of 5 (``--warmup``, ``--steps``). Prints one JSON object: the seed, the cases and each case's
netbench result (``runs``); ``benchmarks/document.py`` renders auto against the best fixed scheme per case.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HELDOUT = os.path.join(ROOT, "..", "shared", "tools", "heldout.py")
SCHEMES = "ddp;torch-fp16;fp16;int8;int4;auto"


def draw(seed: str, n: int) -> list[dict]:
    """The cases of ``heldout.py`` for ``seed``."""
    if not os.path.exists(HELDOUT):
        raise SystemExit(f"auto_heldout: {HELDOUT} not found (the shared tools sit next to the checkout)")
    spec = importlib.util.spec_from_file_location("heldout", HELDOUT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.draw(seed, n)


def netbench_args(case: dict, steps: int, warmup: int, netem: bool) -> list[str]:
    """The netbench command line of one case (the latency only where netem is there)."""
    args = ["--workers", str(case["workers"]), "--bandwidth", case["rate"], "--model",
            f"{case['family']}:{case['width']}", "--batch-size", str(case["batch"]), "--steps", str(steps),
            "--warmup", str(warmup), "--schemes", SCHEMES, "--timeout", "3000", "--json"]
    if netem and case["latency_ms"]:
        args += ["--latency", f"{case['latency_ms']}ms"]
    return args + (["--accelerator"] if case["accelerator"] else [])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seed", required=True, help="the draw's seed (a commit hash)")
    p.add_argument("--n", type=int, default=6, help="cases (default 6)")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--json", action="store_true", help="print the JSON object (the only output format)")
    args = p.parse_args(argv)
    from gradcompress.testbed import netns

    netem = netns.netem_available()
    cases, runs = draw(args.seed, args.n), []
    for i, case in enumerate(cases):
        command = [sys.executable, "-m", "gradcompress", "netbench", *netbench_args(case, args.steps, args.warmup,
                                                                                    netem)]
        print(f"auto_heldout: case {i + 1}/{len(cases)}: {' '.join(command[3:])}", file=sys.stderr, flush=True)
        done = subprocess.run(command, capture_output=True, text=True, cwd=ROOT)
        if done.returncode != 0:
            runs.append({"case": case, "error": done.stderr.strip().splitlines()[-1:] or ["failed"]})
            continue
        runs.append({"case": case, "latency_emulated": netem or not case["latency_ms"],
                     "result": json.loads(done.stdout)})
    print(json.dumps({"seed": args.seed, "n": args.n, "schemes": SCHEMES, "netem": netem, "runs": runs}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
