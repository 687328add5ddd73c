"""The CUDA/NCCL path and the GPU numbers, in one run (``benchmarks/gpu_check.sh``; under 8 minutes on one GPU).

1. every codec's encode+decode throughput on the device, in GB/s of float32 input, next to a device-to-device copy;
2. the autopilot's calibration on the device (``gradcompress.autopilot.decide.record``: each candidate's real
   exchange of a 4096 x 4096 bucket, timed) and what it would choose at 1, 10 and 100 Gbit/s;
3. the DDP hook with NCCL at world size 1 (int8 and auto): steps, stats, finite parameters;
4. the DDP hook with gloo on CUDA tensors at world size 2, both ranks on the same device (int8 and auto): replicas
   equal after every step;
5. ``auto`` without a hint at world size 2 (gloo on CUDA tensors): what its meter read (CUDA events on a GPU) next to
   the step time from CUDA events the loop recorded itself, its plan and what its selection measured.

Without CUDA it runs the same on the CPU (NCCL skipped), which is how CI checks the script itself (``--quick``).
Prints one JSON object per section.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch

CODECS = ["fp16", "bf16", "int8", "int4", "int2", "qsgd", "terngrad", "sign", "topk:ratio=0.01", "randomk:ratio=0.25",
          "dgc:ratio=0.01", "powersgd:rank=4", "dct"]


def _sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _median_time(fn, device, repeats: int) -> float:
    fn()
    _sync(device)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def codec_throughput(device, numel: int, repeats: int) -> dict:
    from gradcompress import make

    x = torch.randn(numel, device=device)
    y = torch.empty_like(x)
    gbytes = x.numel() * 4 / 1e9
    out = {"numel": numel, "copy_GBps": gbytes / _median_time(lambda: y.copy_(x), device, repeats)}
    for spec in CODECS:
        codec = make(spec)
        t = x.view(4096, -1) if spec.startswith("powersgd") else x
        try:
            seconds = _median_time(lambda: codec.decode(codec.encode(t, seed=0)), device, repeats)  # noqa: B023 - timed now
            out[spec] = gbytes / seconds
        except Exception as err:  # a codec that cannot run here is reported, not hidden
            out[spec] = f"{type(err).__name__}: {err}"
    return out


def auto_calibration(device, side: int) -> dict:
    from gradcompress.autopilot.decide import Link, choose, record
    from gradcompress.config import Config
    from gradcompress.step import Seen
    from gradcompress.timing import payload_bandwidth

    config = Config.parse("auto:budget=any", {})
    buckets = [Seen((0,), ((side, side),), device)]
    options = record(config, 4, buckets, config.auto.candidates)
    out = {"bucket": [side, side], "codec_ms": {o.spec: 1e3 * o.codec_s for o in options[0]}}
    for rate in (1e9, 10e9, 100e9):
        choice, step_s, dense_s = choose(options, [side * side], Link(payload_bandwidth(rate), 1e-5), 0.05, 1.0)
        out[f"choice_at_{rate / 1e9:g}gbit"] = {"codec": options[0][choice[0]].spec, "step_s": step_s,
                                                "dense_s": dense_s}
    return out


def _train(ddp, spec: str, device, steps: int, check_equal: bool) -> dict:
    import torch.distributed as dist
    import torch.nn as nn

    import gradcompress

    comp = gradcompress.register_ddp_hook(ddp, spec)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.01)
    equal = True
    for step in range(steps):
        g = torch.Generator(device="cpu").manual_seed(1000 * step + dist.get_rank())
        x = torch.randn(64, 1024, generator=g).to(device)
        opt.zero_grad()
        nn.functional.mse_loss(ddp(x), x).backward()
        opt.step()
        if check_equal:
            s = torch.stack([p.detach().double().sum() for p in ddp.parameters()]).sum().reshape(1).cpu()
            every = [torch.zeros_like(s) for _ in range(dist.get_world_size())]
            dist.all_gather(every, s)
            equal = equal and all(torch.equal(e, every[0]) for e in every)
    finite = all(torch.isfinite(p).all().item() for p in ddp.parameters())
    st = comp.stats()
    return {"spec": spec, "steps": st["steps"], "ratio": st["ratio"], "finite": finite, "replicas_equal": equal,
            "auto_plan": st.get("auto", {}).get("plan")}


def _model(device):
    import torch.nn as nn

    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(1024, 2048), nn.ReLU(), nn.Linear(2048, 1024)).to(device)


def ddp_nccl_world1(steps: int) -> list:
    import torch.distributed as dist

    from gradcompress.testbed.launch import free_port

    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        device = torch.device("cuda", 0)
        out = []
        for spec in ("int8", "auto:bandwidth=1gbit"):
            ddp = torch.nn.parallel.DistributedDataParallel(_model(device), device_ids=[0])
            out.append(_train(ddp, spec, device, steps, check_equal=False))
        return out
    finally:
        dist.destroy_process_group()


def gloo_world2_worker(rank: int, world: int, use_cuda: bool, steps: int) -> list:
    device = torch.device("cuda", 0) if use_cuda else torch.device("cpu")
    out = []
    for spec in ("int8", "auto:bandwidth=1gbit"):
        ids = [0] if use_cuda else None
        ddp = torch.nn.parallel.DistributedDataParallel(_model(device), device_ids=ids)
        out.append(_train(ddp, spec, device, steps, check_equal=True))
    return out


def auto_clocks_worker(rank: int, world: int, use_cuda: bool, steps: int) -> dict:
    """``auto`` without a hint (it probes, measures and selects) on gloo, CUDA tensors where there is a GPU; the
    loop marks each step's start on the current stream (CUDA events: the ground truth) and never synchronises.
    What the autopilot's meter read (its clock, step, wait and compute) next to the events' step time."""
    import torch.distributed as dist
    import torch.nn as nn

    import gradcompress
    from gradcompress.clocks import for_device

    device = torch.device("cuda", 0) if use_cuda else torch.device("cpu")
    ddp = torch.nn.parallel.DistributedDataParallel(_model(device), device_ids=[0] if use_cuda else None)
    comp = gradcompress.register_ddp_hook(ddp, "auto:every=5,cache=off")
    opt = torch.optim.SGD(ddp.parameters(), lr=0.01)
    truth, marks = for_device(device), []
    for step in range(steps):
        marks.append(truth.mark())
        g = torch.Generator(device="cpu").manual_seed(1000 * step + dist.get_rank())
        x = torch.randn(64, 1024, generator=g).to(device)
        opt.zero_grad()
        nn.functional.mse_loss(ddp(x), x).backward()
        opt.step()
    marks.append(truth.mark())
    walls = [truth.seconds(a, b) for a, b in zip(marks, marks[1:])]
    meter = comp.autopilot.meter
    meter.settle()
    auto = comp.stats()["auto"]
    return {"clock": type(meter.clock).__name__, "meter_step_s": meter.step_s(), "meter_wait_s": meter.wait_s(),
            "meter_compute_s": meter.compute_s(), "events_step_s": statistics.median(walls[-5:]),
            "plan": auto["plan"], "bandwidth_bit": auto["bandwidth_bit"], "measured": auto["trial"]}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="small sizes (the CPU check of the script itself)")
    args = p.parse_args(argv)
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    numel, repeats, side, steps = (1 << 20, 3, 512, 6) if args.quick else (1 << 26, 10, 4096, 20)
    report = {"torch": torch.__version__, "device": torch.cuda.get_device_name(0) if cuda else "cpu",
              "cuda": torch.version.cuda, "nccl": ".".join(map(str, torch.cuda.nccl.version())) if cuda else None}
    print(json.dumps({"machine": report}), flush=True)
    print(json.dumps({"codec_throughput_GBps": codec_throughput(device, numel, repeats)}), flush=True)
    print(json.dumps({"auto_calibration": auto_calibration(device, side)}), flush=True)
    if cuda:
        print(json.dumps({"ddp_nccl_world1": ddp_nccl_world1(steps)}), flush=True)
    from gradcompress.testbed import launch

    results = launch.run(gloo_world2_worker, 2, cuda, steps, timeout=300)
    print(json.dumps({"ddp_gloo_world2": results[0], "replicas_equal_every_step": all(
        r["replicas_equal"] for rank in results for r in rank)}), flush=True)
    clocks = launch.run(auto_clocks_worker, 2, cuda, 4 * steps, timeout=300)
    print(json.dumps({"auto_clocks_gloo_world2": clocks}), flush=True)
    return 0


if __name__ == "__main__":
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src"))
    sys.exit(main())
