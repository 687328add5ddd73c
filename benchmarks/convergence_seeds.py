"""Digits accuracy of schemes over several seeds, in the configuration of tests/test_convergence.py.

4 gloo workers, SGD lr 0.1 with momentum 0.9 (the Compressor's momentum correction replaces it where a
scheme sets ``momentum``), no warm-up, every tensor compressed, library defaults; one launch per seed,
data and initial weights from that seed. Prints test accuracy / final train loss / bytes per step.

    python benchmarks/convergence_seeds.py --seeds 5 --steps 200 \\
        --schemes "none;randomk:ratio=0.25,scale=false;randomk:ratio=0.25,scale=false,momentum=0.9"
"""

from __future__ import annotations

import argparse

from gradcompress.testbed import launch
from gradcompress.cli import task


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--schemes", default="none;randomk:ratio=0.25,scale=false")
    p.add_argument("--seeds", type=int, default=5)
    p.add_argument("--steps", type=int, default=200)
    args = p.parse_args()
    schemes = args.schemes.split(";")
    for seed in range(args.seeds):
        data = task.load_data(seed=seed)
        configs = [task.RunConfig(scheme=s, steps=args.steps, lr=0.1, momentum=0.9, warmup_steps=0, min_numel=0,
                                  seed=seed) for s in schemes]
        records = launch.run(task.demo_worker, 4, data, configs, timeout=900)
        cells = []
        for i, cfg in enumerate(configs):
            r = task.summarize([rec[i] for rec in records], cfg, 4)
            cells.append(f"{cfg.scheme}={r['test_accuracy']:.2f}%/{r['final_train_loss']:.4f}/"
                         f"{r['bytes_per_step'] / 1000:.1f}KB")
        print(seed, " ".join(cells), flush=True)


if __name__ == "__main__":
    main()
