"""What a decided ``auto`` step costs against the same plan run as a fixed scheme (issue 39): ``auto`` with a
slow-link hint (int4 on every bucket from step 3, nothing left to decide) against ``int4:warmup_steps=3``, 4
loopback gloo workers, the 12.6M MLP, each step timed between barriers after 10 untimed; rounds interleaved; the
last round of each profiled on rank 0 (cProfile, its last 20 steps: Python calls and the top functions).

    python benchmarks/record.py auto_overhead -- python benchmarks/auto_overhead.py --rounds 3 --json
"""

from __future__ import annotations

import argparse
import io
import json
import statistics
import sys
import time

SPECS = ("int4:warmup_steps=3", "auto:bandwidth=10mbit,cache=off")


def worker(rank: int, world: int, spec: str, steps: int, profile: bool) -> dict:
    import cProfile
    import pstats

    import torch
    from torch.nn.parallel import DistributedDataParallel as DDP

    import gradcompress
    from gradcompress.testbed import models

    torch.set_num_threads(1)
    model = DDP(models.build_model("mlp"))
    comp = gradcompress.register_ddp_hook(model, spec)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    x, y = models.batch("mlp", 32, rank)
    times, prof = [], None
    for step in range(steps):
        if profile and rank == 0 and step == steps - 20:
            prof = cProfile.Profile()
            prof.enable()
        torch.distributed.barrier()
        start = time.perf_counter()
        opt.zero_grad()
        models.loss("mlp", model(x), y).backward()
        opt.step()
        times.append(time.perf_counter() - start)
    out = {"median_step_s": statistics.median(times[10:]), "plan": (comp.stats().get("auto") or {}).get("plan")}
    if prof is not None:
        prof.disable()
        text = io.StringIO()
        stats = pstats.Stats(prof, stream=text)
        stats.sort_stats("tottime").print_stats(12)
        out.update(calls=stats.total_calls, profile=text.getvalue())
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=70)
    p.add_argument("--json", action="store_true", help="print the JSON object (the only output format)")
    args = p.parse_args(argv)
    from gradcompress.testbed import launch

    rows: dict = {spec: {"median_step_s": [], "plan": None} for spec in SPECS}
    for r in range(args.rounds):
        for spec in SPECS:
            got = launch.run(worker, 4, spec, args.steps, r == args.rounds - 1, timeout=900)
            rows[spec]["median_step_s"].append(max(g["median_step_s"] for g in got))
            rows[spec]["plan"] = got[0]["plan"]
            if "calls" in got[0]:
                rows[spec].update(calls_20_steps=got[0]["calls"], profile=got[0]["profile"])
    auto, fixed = (statistics.fmean(rows[s]["median_step_s"]) for s in reversed(SPECS))
    print(json.dumps({"workers": 4, "model": "mlp", "steps": args.steps, "rounds": args.rounds, "schemes": rows,
                      "auto_over_fixed": auto / fixed}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
