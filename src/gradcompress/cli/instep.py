"""``gradcompress bench --in-step``: one whole Compressor step against a dense all-reduce.

What is measured, per scheme, on ``--workers`` local gloo processes over loopback (so the
network is as fast as this machine's memory and the overhead of the step shows):

* ``step``: the median over ``--repeats`` steps (after one untimed first step, which
  allocates the state) of :meth:`gradcompress.Compressor.synchronize` on ``--matrices``
  float32 gradients of ``--size`` x ``--size`` (library defaults: error feedback
  ``"auto"``, so on for int8, sign, topk, powersgd), rank 0's time;
* ``dense``: the median of a plain ``all_reduce`` + divide of the same gradients (one
  call per tensor), timed in the same processes, interleaved with the scheme's steps;
* ``held``: memory the compressor keeps between steady steps (residuals, factors, reused
  buffers; ``state``: what the first step left), and ``peak``:
  the highest memory during a steady-state step above what was held before it, both as
  multiples of the gradients' bytes, from a second launch (the third step after the first: by then
  every recycled buffer exists). Measured from the process's resident set (Linux:
  ``VmHWM`` reset through ``/proc/self/clear_refs``; the workers run with glibc's
  ``MALLOC_MMAP_THRESHOLD_=65536`` so freed tensors leave the resident set); elsewhere
  they are ``None``;
* ``host syncs``: host synchronisations of one more, untimed step (:class:`gradcompress.testbed.host_syncs.HostSyncs`:
  ``.item()``, ``bool(tensor)``, ``tolist()``, ``nonzero`` and the other ops after which the host waits for a GPU),
  with the CPU's fused kernels off: the path a CUDA step takes (on the CPU nothing waits).
"""

from __future__ import annotations

import statistics
import time
from typing import Any, cast

from .common import fmt as f
from .common import text_table

MMAP_ENV = "MALLOC_MMAP_THRESHOLD_"


def _rss_kb(field: str) -> int | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


def _reset_peak() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # resets VmHWM to the current RSS
        return True
    except OSError:
        return False


def _host_syncs(comp, params) -> int:
    """Host synchronisations of one step on the path CUDA takes (the CPU's fused kernels off)."""
    from ..codecs import fast
    from ..testbed.host_syncs import HostSyncs

    with fast.use(False), HostSyncs() as syncs:
        comp.synchronize(params)
    return syncs.count


def in_step_worker(rank: int, world: int, specs: list[str], size: int, matrices: int, repeats: int,
                   seed: int, memory: bool) -> dict:
    """``launch.run`` target: time every scheme's steps and the dense all-reduce (``memory``: measure the
    memory instead, in processes whose freed blocks leave the resident set); rank 0's figures."""
    import torch
    import torch.distributed as dist

    import gradcompress

    g = torch.Generator().manual_seed(seed * 1000 + rank)
    grads = [torch.randn(size, size, generator=g) * 1e-3 for _ in range(matrices)]
    grad_bytes = sum(t.numel() * t.element_size() for t in grads)
    params = [torch.nn.Parameter(torch.zeros(size, size)) for _ in range(matrices)]

    def fresh():
        for p, t in zip(params, grads):
            if p.grad is None:
                p.grad = t.clone()
            else:
                p.grad.copy_(t)

    def dense():
        for p in params:
            dist.all_reduce(p.grad)
            p.grad.div_(world)

    def timed(fn):
        fresh()
        dist.barrier()
        start = time.perf_counter()
        fn()
        return time.perf_counter() - start

    out: dict[str, Any] = {"grad_bytes": grad_bytes, "schemes": []}
    dense_times = []
    for spec in specs:
        comp = gradcompress.Compressor(spec)
        fresh()
        dist.barrier()
        before = _rss_kb("VmRSS")
        comp.synchronize(params)  # the first step: allocates the state
        state_kb = None if before is None or not memory else cast(int, _rss_kb("VmRSS")) - before  # read before
        times, peaks, helds = [], [], []
        for _ in range(repeats):
            dense_times.append(timed(dense))
            fresh()
            dist.barrier()
            held = _rss_kb("VmRSS") if memory else None
            tracked = held is not None and _reset_peak()
            start = time.perf_counter()
            comp.synchronize(params)
            times.append(time.perf_counter() - start)
            if tracked:  # /proc/self/status was read (held and before are numbers)
                peaks.append(cast(int, _rss_kb("VmHWM")) - cast(int, held))
                helds.append(cast(int, held) - cast(int, before))
        fresh()
        syncs = None if memory else _host_syncs(comp, params)
        out["schemes"].append({
            "scheme": spec, "error_feedback": comp.error_feedback, "step_seconds": statistics.median(times),
            "state_x": None if state_kb is None else max(0, state_kb) * 1024 / grad_bytes,
            "peak_x": peaks[-1] * 1024 / grad_bytes if peaks else None,  # the last: buffers are recycled by then
            "held_x": max(0, helds[-1]) * 1024 / grad_bytes if helds else None,
            "wire_bytes_per_step": comp.stats()["wire_bytes"] / comp.stats()["steps"],
            "host_syncs_per_step": syncs,
        })
        del comp
    out["dense_seconds"] = statistics.median(dense_times)
    return out


def run_in_step(specs: list[str], workers: int, size: int, matrices: int, repeats: int, seed: int) -> dict:
    import os

    from ..testbed import launch

    timeout = 120 + 30 * len(specs) * repeats
    r = launch.run(in_step_worker, workers, specs, size, matrices, repeats, seed, False, timeout=timeout,
                   collective_timeout=120)[0]
    # memory, in a second launch: glibc then serves large blocks from mmap and returns them when freed, so
    # the resident set is live memory (that slows allocation, hence not in the timed launch)
    saved = os.environ.get(MMAP_ENV)
    os.environ[MMAP_ENV] = str(1 << 16)
    try:
        mem = launch.run(in_step_worker, workers, specs, size, matrices, 3, seed, True, timeout=timeout,
                         collective_timeout=120)[0]
    finally:
        if saved is None:
            os.environ.pop(MMAP_ENV, None)
        else:
            os.environ[MMAP_ENV] = saved
    for row, m in zip(r["schemes"], mem["schemes"]):
        row["state_x"], row["peak_x"], row["held_x"] = m["state_x"], m["peak_x"], m["held_x"]
    for row in r["schemes"]:
        row["vs_dense"] = row["step_seconds"] / r["dense_seconds"] if r["dense_seconds"] else None
    return {"workers": workers, "size": size, "matrices": matrices, "repeats": repeats, **r}


def format_in_step(result: dict) -> str:
    head = ("scheme", "step ms", "x dense", "held x grad", "peak x grad", "sent/step", "host syncs/step")
    rows = [head] + [(r["scheme"], f(1000 * r["step_seconds"], ".1f"), f(r["vs_dense"], ".2f"), f(r["held_x"], ".2f"),
                      f(r["peak_x"], ".2f"), f"{r['wire_bytes_per_step'] / 1e6:.1f} MB", f(r["host_syncs_per_step"], "d"))
                     for r in result["schemes"]]
    title = (f"{result['workers']} gloo workers on loopback, {result['matrices']} float32 gradients of "
             f"{result['size']} x {result['size']} ({result['grad_bytes'] / 1e6:.1f} MB), median of "
             f"{result['repeats']} steps; dense all_reduce of the same gradients: "
             f"{1000 * result['dense_seconds']:.1f} ms")
    return text_table(title, rows, "step: Compressor.synchronize (library defaults); x dense: step / dense all_reduce "
                      "time; held: memory the compressor keeps between steady steps (state and reused buffers); peak: "
                      "highest extra memory during a steady step (the 4th) above that; both in multiples of the "
                      "gradients' bytes (resident set, Linux); host syncs: "
                      "of one more step, ops after which a GPU step's host waits (.item(), tolist(), nonzero...), "
                      "counted on the path CUDA takes")


# --------------------------------------------------------------------------- against PyTorch's own DDP hooks
#: (label, how) of the DDP variants timed side by side: plain DDP, PyTorch's hooks, ours
DDP_VARIANTS = (("DDP (no hook)", None), ("torch fp16_compress_hook", "torch:fp16"),
                ("torch powerSGD_hook rank 4", "torch:powersgd"), ("fp16", "fp16"), ("powersgd:rank=4", "powersgd:rank=4"),
                ("int8", "int8"))


def ddp_worker(rank: int, world: int, size: int, layers: int, batch: int, repeats: int, seed: int) -> dict:
    """``launch.run`` target: the backward of ``layers`` bias-free size x size linear layers under DDP (one bucket),
    per variant the median step time (zero_grad, forward, backward with the hook), interleaved round by round."""
    import torch
    import torch.distributed as dist
    import torch.nn as nn
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook

    import gradcompress

    torch.manual_seed(seed)
    base = nn.Sequential(*[nn.Linear(size, size, bias=False) for _ in range(layers)])
    x = torch.randn(batch, size, generator=torch.Generator().manual_seed(seed * 1000 + rank))
    models = []
    for _, how in DDP_VARIANTS:
        model = nn.Sequential(*[nn.Linear(size, size, bias=False) for _ in range(layers)])
        model.load_state_dict(base.state_dict())
        ddp = nn.parallel.DistributedDataParallel(model, bucket_cap_mb=4 * size * size * layers / 2**20 + 1)
        if how == "torch:fp16":
            ddp.register_comm_hook(None, default_hooks.fp16_compress_hook)
        elif how == "torch:powersgd":  # start_powerSGD_iter=2: compress from the third step, as ours after warm-up
            state = powerSGD_hook.PowerSGDState(process_group=None, matrix_approximation_rank=4, start_powerSGD_iter=2)
            ddp.register_comm_hook(state, powerSGD_hook.powerSGD_hook)
        elif how is not None:
            gradcompress.register_ddp_hook(ddp, how)
        models.append(ddp)

    def step(ddp) -> float:
        dist.barrier()
        start = time.perf_counter()
        ddp.zero_grad(set_to_none=False)
        ddp(x).square().mean().backward()
        return time.perf_counter() - start

    for ddp in models:  # warm-up: dense steps of the schedules, state allocation
        for _ in range(3):
            step(ddp)
    times: list[list[float]] = [[] for _ in models]
    for _ in range(repeats):
        for i, ddp in enumerate(models):
            times[i].append(step(ddp))
    return {"variants": [{"variant": label, "step_seconds": statistics.median(t)}
                         for (label, _), t in zip(DDP_VARIANTS, times)]}


def run_ddp_versus_torch(workers: int, size: int, layers: int, batch: int, repeats: int, seed: int) -> dict:
    from ..testbed import launch

    r = launch.run(ddp_worker, workers, size, layers, batch, repeats, seed, timeout=300 + 20 * repeats,
                   collective_timeout=120)[0]
    base = r["variants"][0]["step_seconds"]
    for v in r["variants"]:
        v["vs_ddp"] = v["step_seconds"] / base if base else None
    return {"workers": workers, "size": size, "layers": layers, "batch": batch, "repeats": repeats, **r}


def format_ddp_versus_torch(result: dict) -> str:
    rows = [("variant", "step ms", "x DDP")] + [(v["variant"], f"{1000 * v['step_seconds']:.1f}", f"{v['vs_ddp']:.2f}")
                                                for v in result["variants"]]
    title = (f"{result['workers']} gloo workers on loopback, DDP (one bucket) over {result['layers']} bias-free "
             f"{result['size']} x {result['size']} linear layers, batch {result['batch']}, median of "
             f"{result['repeats']} steps (zero_grad + forward + backward), variants interleaved")
    return text_table(title, rows, "x DDP: step time / plain DDP's; ours with library defaults (error feedback off "
                      "for fp16, on for powersgd and int8); torch's powerSGD_hook with start_powerSGD_iter=2, error "
                      "feedback and warm start")
