"""Digits accuracy of schemes over several seeds, in the configuration of tests/test_convergence.py.

4 gloo workers, SGD lr 0.1 with momentum 0.9 (the Compressor's momentum correction replaces it where a
scheme sets ``momentum``), no warm-up, every tensor compressed, library defaults; one launch per seed,
data and initial weights from that seed. Prints test accuracy / final train loss / bytes per step; with ``--json``
one JSON object instead (``python benchmarks/record.py NAME -- python benchmarks/convergence_seeds.py ... --json``
keeps it as a result file).

    python benchmarks/convergence_seeds.py --seeds 5 --steps 200 \\
        --schemes "none;randomk:ratio=0.25,scale=false;randomk:ratio=0.25,scale=false,momentum=0.9"
"""

from __future__ import annotations

import argparse
import json

from gradcompress.testbed import launch
from gradcompress.cli import task


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--schemes", default="none;randomk:ratio=0.25,scale=false")
    p.add_argument("--seeds", type=int, default=5)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--json", action="store_true", help="print one JSON object instead of a line per seed")
    args = p.parse_args()
    schemes = args.schemes.split(";")
    runs = []
    for seed in range(args.seeds):
        data = task.load_data(seed=seed)
        configs = [task.RunConfig(scheme=s, steps=args.steps, lr=0.1, momentum=0.9, warmup_steps=0, min_numel=0,
                                  seed=seed) for s in schemes]
        records = launch.run(task.demo_worker, 4, data, configs, timeout=900)
        cells = []
        for i, cfg in enumerate(configs):
            r = task.summarize([rec[i] for rec in records], cfg, 4)
            runs.append({"seed": seed, "scheme": cfg.scheme, "test_accuracy": r["test_accuracy"],
                         "final_train_loss": r["final_train_loss"], "bytes_per_step": r["bytes_per_step"]})
            cells.append(f"{cfg.scheme}={r['test_accuracy']:.2f}%/{r['final_train_loss']:.4f}/"
                         f"{r['bytes_per_step'] / 1000:.1f}KB")
        if not args.json:
            print(seed, " ".join(cells), flush=True)
    if args.json:
        print(json.dumps({"benchmark": "convergence_seeds", "task": "digits", "workers": 4, "steps": args.steps,
                          "optimizer": "SGD(lr=0.1, momentum=0.9)", "schemes": schemes, "runs": runs}, indent=1))


if __name__ == "__main__":
    main()
