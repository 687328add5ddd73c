"""PowerSGD's codec cost and int8's in-step cost, side by side for one or more source trees, interleaved.

    git worktree add /tmp/before <commit>
    python benchmarks/codec_speed.py /tmp/before/src src [--rounds 3]

Each round runs, from each source tree in turn (before, after, before, after, ...), a fresh interpreter that measures:

* ``powersgd:rank=4 (4096 x 6103) x fp16``: ``codec.encode`` + ``codec.decode`` of PowerSGD rank 4 on the first
  4096 x 6103 elements of a 25M-element float32 tensor (N(0, 1e-3^2)), as ``gradcompress bench`` views it, over
  a float16 round trip ``x.half().float()`` of the whole tensor; the same on a 5000 x 5000 matrix;
* ``powersgd exchange (5000 x 5000) x fp16``: the codec work of one step of the low-rank exchange on one rank (world
  1): ``product`` (P = M Q), ``orthonormalize_``, ``transposed_product`` (Q = M^T P), the residual ``addmm_`` and
  the decode ``matmul`` into the gradient's buffer, over the same float16 round trip;
* ``int8 in-step x dense``: ``gradcompress bench --in-step``'s timed launch (2 gloo workers, 3 float32 gradients
  of 2048 x 2048, library defaults, median of ``--steps`` steps, interleaved with a dense all-reduce of the same
  gradients): step time / dense time.

The codec figures are the minimum of ``--repeats`` timings, the fp16 round trip and the codec alternating; each is
a ratio measured in one process. Prints per quantity and tree the median over rounds (and the range), and each
tree / the first. Ratios, not times: the machine is shared and noisy.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

NUMEL = 25_000_000


def _min_interleaved(fns: dict, repeats: int) -> dict:
    for fn in fns.values():
        fn()  # warm-up (kernel build, MKL's first call)
    best = {k: float("inf") for k in fns}
    for _ in range(repeats):
        for k, fn in fns.items():
            start = time.perf_counter()
            fn()
            best[k] = min(best[k], time.perf_counter() - start)
    return best


def measure_codecs(repeats: int) -> dict:
    import torch

    import gradcompress
    from gradcompress.codecs.lowrank import initial_q, orthonormalize_, product, transposed_product

    x = torch.randn(NUMEL, generator=torch.Generator().manual_seed(0)) * 1e-3
    bench = x[: 4096 * 6103].view(4096, 6103)
    square = x.view(5000, 5000)
    codec = gradcompress.make("powersgd:rank=4")
    residual = square.clone()
    grad = torch.empty_like(square)
    q = initial_q(5000, 4, 1, x.device)

    def codec_trip(mat):
        return lambda: codec.decode(codec.encode(mat, seed=0))

    def exchange_step():
        p = orthonormalize_(product(square, q))
        qq = transposed_product(square, p)
        residual.copy_(square)  # the exchange's copy of the sent matrix into the residual buffer, then addmm_
        residual.addmm_(p, qq.T, alpha=-1)
        torch.matmul(p, qq.T, out=grad)

    t = _min_interleaved({"fp16": lambda: x.half().float(), "bench": codec_trip(bench),
                          "square": codec_trip(square), "exchange": exchange_step}, repeats)
    return {"threads": torch.get_num_threads(), "fp16 round trip ms": 1000 * t["fp16"],
            "powersgd:rank=4 (4096 x 6103) x fp16": t["bench"] / t["fp16"],
            "powersgd:rank=4 (5000 x 5000) x fp16": t["square"] / t["fp16"],
            "powersgd exchange step (5000 x 5000) x fp16": t["exchange"] / t["fp16"]}


def measure_in_step(steps: int) -> dict:
    try:
        from gradcompress.testbed import launch
    except ImportError:  # trees from before the testbed package
        from gradcompress import launch
    from gradcompress.cli.instep import in_step_worker

    r = launch.run(in_step_worker, 2, ["int8"], 2048, 3, steps, 0, False, timeout=600, collective_timeout=120)[0]
    return {"int8 in-step x dense": r["schemes"][0]["step_seconds"] / r["dense_seconds"]}


def child(args) -> None:
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    out = {}
    if "codecs" in args.parts:
        out.update(measure_codecs(args.repeats))
    if "instep" in args.parts:
        out.update(measure_in_step(args.steps))
    print(json.dumps(out))


def run_tree(src: str, args) -> dict:
    env = dict(os.environ, PYTHONPATH=os.path.abspath(src))
    cmd = [sys.executable, os.path.abspath(__file__), "--child", "--repeats", str(args.repeats), "--steps",
           str(args.steps), "--parts", args.parts, "--threads", str(args.threads)]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if out.returncode:
        raise SystemExit(f"{src}: {out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("trees", nargs="*", default=["src"], help="source trees (the folder holding gradcompress/)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=10, help="timings per codec quantity (the minimum is kept)")
    ap.add_argument("--steps", type=int, default=6, help="in-step: timed steps per launch (the median is kept)")
    ap.add_argument("--parts", default="codecs,instep", help="codecs, instep or both (comma-separated)")
    ap.add_argument("--threads", type=int, default=0, help="codecs: torch threads (default: torch's own)")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child(args)
        return
    runs: dict[str, list[dict]] = {t: [] for t in args.trees}
    for r in range(args.rounds):
        for tree in args.trees:
            runs[tree].append(run_tree(tree, args))
            print(f"round {r + 1} {tree}: {json.dumps(runs[tree][-1])}", file=sys.stderr)
    first = args.trees[0]
    print(f"median (min-max) of {args.rounds} interleaved rounds; trees: " + ", ".join(args.trees))
    print("| quantity | " + " | ".join(args.trees) + " | " + " | ".join(f"{t} / {first}" for t in args.trees[1:]) + " |")
    print("|---" * (1 + 2 * len(args.trees) - 1) + "|")
    for key in runs[first][0]:
        cells, meds = [], []
        for tree in args.trees:
            vals = [r[key] for r in runs[tree]]
            meds.append(statistics.median(vals))
            cells.append(f"{meds[-1]:.2f} ({min(vals):.2f}-{max(vals):.2f})")
        print(f"| {key} | " + " | ".join(cells) + " | " + " | ".join(f"{m / meds[0]:.2f}" for m in meds[1:]) + " |")


if __name__ == "__main__":
    main()
