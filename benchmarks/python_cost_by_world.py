"""The per-step cost of a Compressor step as the number of workers grows, without a network (issue 14).

Every collective is a local stand-in (:class:`gradcompress.collectives.LocalCollectives`, as ``gradcompress
plan`` calibrates): an all-reduce multiplies by W, an all-gather returns W copies, an all-to-all a copy.
So the time measured is the step's own work at W workers: Python, the encodes and the W-way decodes
and sums. 100 float32 gradients of 4096 elements (the issue's case), library defaults, median of
``--repeats`` steps after two untimed ones, one thread.

    python benchmarks/python_cost_by_world.py [--schemes "int8;sign;topk:ratio=0.01"] [--worlds 4 32]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import gradcompress
from gradcompress.collectives import LocalCollectives


def step_seconds(spec: str, world: int, tensors: int, numel: int, repeats: int) -> float:
    g = torch.Generator().manual_seed(0)
    grads = [torch.randn(numel, generator=g) for _ in range(tensors)]
    params = [torch.nn.Parameter(torch.zeros(numel)) for _ in range(tensors)]
    comp = gradcompress.Compressor(spec, min_numel=0)
    local = LocalCollectives(world)
    times = []
    for i in range(repeats + 2):
        for p, t in zip(params, grads):
            p.grad = t.clone()
        step = comp.begin_step(local)
        start = time.perf_counter()
        step.drive([step.exchange(list(range(tensors)), [p.grad for p in params])])
        step.end()
        if i >= 2:
            times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--schemes", default="int8;int4;sign;topk:ratio=0.01;powersgd:rank=4;fp16")
    ap.add_argument("--worlds", type=int, nargs="+", default=[4, 32])
    ap.add_argument("--tensors", type=int, default=100)
    ap.add_argument("--numel", type=int, default=4096)
    ap.add_argument("--repeats", type=int, default=9)
    args = ap.parse_args()
    torch.set_num_threads(1)
    print(f"{args.tensors} float32 tensors of {args.numel} elements, local stand-in collectives, median of "
          f"{args.repeats} steps (ms)")
    print("scheme".ljust(20) + "".join(f"W={w}".rjust(10) for w in args.worlds) + "   ratio")
    for spec in [s for s in args.schemes.split(";") if s]:
        ms = [1000 * step_seconds(spec, w, args.tensors, args.numel, args.repeats) for w in args.worlds]
        print(spec.ljust(20) + "".join(f"{m:10.1f}" for m in ms) + f"   {ms[-1] / ms[0]:.2f}x")


if __name__ == "__main__":
    main()
