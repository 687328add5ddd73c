"""Worker functions for tests/test_robust.py (module level, so they can be pickled).

A scheme here is a CLI scheme string: a codec spec whose options may also set the
Compressor's (``sign:momentum=0.9,server_error_feedback=true``), read by
:func:`gradcompress.cli.task.split_scheme`.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn

import gradcompress
from gradcompress.cli.schemes import split_scheme
from workers import _train_checkpoint, batch, make_model


def compressor(scheme: str, **extra) -> gradcompress.Compressor:
    codec, options = split_scheme(scheme)
    return gradcompress.Compressor(codec, **{**options, **extra})


def _state_equal(a: dict, b: dict) -> bool:
    if a["step"] != b["step"]:
        return False
    for name in ("residual", "server_residual", "q", "p", "momentum"):
        if a[name].keys() != b[name].keys():
            return False
        if not all(torch.equal(a[name][k], b[name][k]) for k in a[name]):
            return False
    return True


def overflow_runs(rank, world, schemes, where, warmup):
    return {s: overflow_run(rank, world, s, where, warmup) for s in schemes}


def overflow_run(rank, world, scheme, where, warmup, steps=5, bad_step=2):
    """DDP + hook; rank 1's gradient of ``where`` ("bias": travels dense; "weight": compressed) gets an
    Inf at ``bad_step`` (during the dense warm-up when ``warmup`` > ``bad_step``)."""
    model = make_model()
    ddp = nn.parallel.DistributedDataParallel(model, bucket_cap_mb=0.005)
    comp = compressor(scheme, min_numel=256, warmup_steps=warmup)
    gradcompress.register_ddp_hook(ddp, comp)
    poison = {"on": False}
    target = model[2].bias if where == "bias" else model[2].weight
    target.register_hook(lambda g: g.index_fill(0, torch.tensor([0]), float("inf")) if poison["on"] else g)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    scaler = torch.amp.GradScaler("cpu", init_scale=1.0)
    report = {"finite_per_step": []}
    for step in range(steps):
        poison["on"] = step == bad_step and rank == 1
        x, y = batch(rank, step)
        opt.zero_grad()
        before = comp.state_dict()
        scaler.scale(nn.functional.cross_entropy(ddp(x), y)).backward()
        report["finite_per_step"].append(all(bool(torch.isfinite(p.grad).all()) for p in model.parameters()))
        if step == bad_step:
            report["state_unchanged"] = _state_equal(before, comp.state_dict())
            report["had_state"] = sum(len(before[n]) for n in ("residual", "q", "p", "momentum")) > 0
        scaler.step(opt)
        scaler.update()
    final = comp.state_dict()
    report["state_finite"] = all(bool(torch.isfinite(v).all()) for n in ("residual", "server_residual", "q", "p",
                                                                           "momentum") for v in final[n].values())
    report["step"] = final["step"]
    report["skipped"] = comp.stats()["skipped"]
    report["params"] = [p.detach().clone() for p in model.parameters()]
    return report


def subgroups(rank, world, specs):
    """Ranks {0, 1} and {2, 3} each train their own DDP model on their own group."""
    groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    mine = groups[rank // 2]
    out = {}
    for spec in specs:
        model = make_model()
        ddp = nn.parallel.DistributedDataParallel(model, process_group=mine, bucket_cap_mb=0.005)
        comp = gradcompress.register_ddp_hook(ddp, spec, min_numel=256)
        x, y = batch(rank, 0)
        local = make_model()
        nn.functional.cross_entropy(local(x), y).backward()
        nn.functional.cross_entropy(ddp(x), y).backward()
        everyone = [None] * world
        dist.all_gather_object(everyone, [p.grad.clone() for p in local.parameters()])
        out[spec] = {"grads": [p.grad.clone() for p in model.parameters()], "local": everyone,
                     "group_size": dist.get_world_size(comp.process_group)}
    try:  # a Compressor on another group than the DDP model's is refused
        ddp = nn.parallel.DistributedDataParallel(make_model(), process_group=mine)
        gradcompress.register_ddp_hook(ddp, gradcompress.Compressor(
            "int8", process_group=groups[1 - rank // 2] if rank < 2 else dist.group.WORLD))
        out["mismatch"] = "no error"
    except ValueError as err:
        out["mismatch"] = str(err)
    return out


def conv_model() -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(8, 32, 3), nn.ReLU(), nn.Conv2d(32, 32, 3), nn.Flatten(), nn.LazyLinear(10))
    model(torch.zeros(1, 8, 10, 10))
    return model


def memory_formats(rank, world, specs, steps=3):
    """synchronize() on the same gradients stored channels_last and contiguous: identical results."""
    model = conv_model()
    g = torch.Generator().manual_seed(rank)
    per_step = []
    for _ in range(steps):
        model.zero_grad()
        model(torch.randn(4, 8, 10, 10, generator=g)).square().mean().backward()
        per_step.append([p.grad.clone() for p in model.parameters()])
    out = {}
    for spec in specs:
        results = []
        for channels_last in (True, False):
            params = [nn.Parameter(torch.zeros_like(p)) for p in model.parameters()]
            comp = gradcompress.Compressor(spec, min_numel=256)
            grads, layouts = [], []
            for grads_now in per_step:
                for p, gr in zip(params, grads_now):
                    p.grad = gr.clone(memory_format=torch.channels_last) if channels_last and gr.dim() == 4 \
                        else gr.clone()
                layouts.append(not params[0].grad.is_contiguous())
                comp.synchronize(params)
                grads.append([p.grad.contiguous().clone() for p in params])
            results.append((grads, layouts))
        out[spec] = results
    return out


def fixed_gradients_pair(rank, world, schemes, steps, checkpoints):
    return [fixed_gradients(rank, world, s, steps, checkpoints) for s in schemes]


def fixed_gradients(rank, world, scheme, steps, checkpoints):
    """Every step the same per-rank gradient; the running mean of what synchronize() delivers.

    Returns the exact average of the ranks' gradients and the relative error of the running
    mean of the delivered averages at each step in ``checkpoints``."""
    g = torch.Generator().manual_seed(100 + rank)
    local = [torch.randn(4096, generator=g), torch.randn(64, 96, generator=g) * 3]
    exact = [t.clone() for t in local]
    for t in exact:
        dist.all_reduce(t)
        t /= world
    params = [nn.Parameter(torch.zeros_like(t)) for t in local]
    comp = compressor(scheme, min_numel=0)
    total = [torch.zeros_like(t) for t in local]
    errors = {}
    for step in range(1, steps + 1):
        for p, t in zip(params, local):
            p.grad = t.clone()
        comp.synchronize(params)
        for acc, p in zip(total, params):
            acc += p.grad
        if step in checkpoints:
            num = sum(float((acc / step - e).square().sum()) for acc, e in zip(total, exact))
            den = sum(float(e.square().sum()) for e in exact)
            errors[step] = (num / den) ** 0.5
    return errors


def momentum_correction(rank, world, steps=4):
    """``none`` with momentum=0.9: what synchronize() delivers is the momentum of the averaged gradient."""
    params = [nn.Parameter(torch.zeros(3000)), nn.Parameter(torch.zeros(20))]
    comp = gradcompress.Compressor("none", momentum=0.9)
    g = torch.Generator().manual_seed(rank)
    u = [torch.zeros_like(p) for p in params]
    diffs = []
    for _ in range(steps):
        grads = [torch.randn(p.shape, generator=g) for p in params]
        for i, (p, gr) in enumerate(zip(params, grads)):
            p.grad = gr.clone()
            avg = gr.clone()
            dist.all_reduce(avg)
            avg /= world
            u[i] = u[i] * 0.9 + avg
        comp.synchronize(params)
        diffs.append(max(float((p.grad - m).abs().max()) for p, m in zip(params, u)))
    return diffs, sorted(comp.state_dict()["momentum"])


def checkpoint_runs(rank, world, schemes, steps, save_at, path, resume):
    """DDP + hook per scheme; optionally save at ``save_at`` (and stop) or resume; final params, state sizes."""
    out = {}
    for i, scheme in enumerate(schemes):
        torch.manual_seed(0)
        params, comp = _train_checkpoint(rank, scheme, steps, save_at, f"{path}.{i}", resume,
                                         compressor(scheme, min_numel=256), momentum=0.0)
        out[scheme] = (params, {n: len(v) for n, v in comp.state_dict().items() if isinstance(v, dict)})
    return out


def telemetry(rank, world, specs, steps=3, every=2):
    """synchronize() with and without monitor_every on the same gradients; the monitored step's figures
    against a direct computation from every rank's gradients."""
    out = {}
    for spec in specs:
        runs = {}
        for every_n in (0, every):
            torch.manual_seed(0)
            params = [nn.Parameter(torch.zeros(64, 80)), nn.Parameter(torch.zeros(300))]
            comp = gradcompress.Compressor(spec, monitor_every=every_n, min_numel=1000)
            g = torch.Generator().manual_seed(rank)
            direct = None
            for step in range(steps):
                local = [torch.randn(p.shape, generator=g) for p in params]
                for p, t in zip(params, local):
                    p.grad = t.clone()
                comp.synchronize(params)
                if step % every == 0 and every_n:
                    exact = [t.clone() for t in local]
                    for t in exact:
                        dist.all_reduce(t)
                        t /= world
                    err2 = sum(float((p.grad - e).square().sum()) for p, e in zip(params, exact))
                    ref2 = sum(float(e.square().sum()) for e in exact)
                    dot = sum(float((p.grad * e).sum()) for p, e in zip(params, exact))
                    out2 = sum(float(p.grad.square().sum()) for p in params)
                    direct = {"relative_error": (err2 / ref2) ** 0.5, "cosine": dot / (ref2 * out2) ** 0.5,
                              "first": float((params[0].grad - exact[0]).norm() / exact[0].norm())}
            runs[every_n] = {"stats": comp.stats(), "direct": direct}
        out[spec] = runs
    return out


def fused_versus_reference(rank, world, schemes, steps=5, bad_step=2):
    """Per scheme: the same gradients through a Compressor whose error feedback runs inside the encode (the
    default) and one forced onto the reference path (x + residual stored, full decode, subtraction); whether
    every delivered gradient and every residual agreed bit for bit, through a skipped non-finite step."""
    from unittest import mock

    from gradcompress.transforms import Transforms  # where the fused-or-reference choice is made

    shapes = [(300, 257), (70001,), (64, 48)]  # fast kernels; uneven chunks (padded last chunk); small
    out = {}
    for scheme in schemes:
        spec, _, option = scheme.partition("|")  # "int8|bf16": bf16 residuals
        extra = {"min_numel": 0, **({"residual_dtype": torch.bfloat16} if option == "bf16" else {})}
        fused, ref = compressor(spec, **extra), compressor(spec, **extra)
        pf = [nn.Parameter(torch.zeros(s)) for s in shapes]
        pr = [nn.Parameter(torch.zeros(s)) for s in shapes]
        g = torch.Generator().manual_seed(7 + rank)
        agree, finite = True, []
        for step in range(steps):
            grads = [torch.randn(s, generator=g) * 10.0 ** (step % 3 - 1) for s in shapes]
            if step == bad_step and rank == world - 1:
                grads[0].view(-1)[12345] = float("nan")
            for p, t in zip(pf + pr, grads + grads):
                p.grad = t.clone()
            finite.append(fused.synchronize(pf))
            with mock.patch.object(Transforms, "fuses", lambda self, aggregation: False):
                ref.synchronize(pr)
            for a, b in zip(pf, pr):
                agree &= bool(torch.equal(a.grad.nan_to_num(nan=7.0), b.grad.nan_to_num(nan=7.0)))
                agree &= bool(torch.equal(a.grad.isnan(), b.grad.isnan()))
            agree &= _state_equal(fused.state_dict(), ref.state_dict())
        out[scheme] = {"agree": agree, "finite": finite, "residuals": len(fused.state.slots["residual"])}
    return out


def mixed_magnitudes(rank, world, spec):
    """A group of a tiny-valued tensor between two huge ones (sizes off the 512-element bucket grid), averaged
    by the whole-group two-step reduce: the largest error of each tensor and its values' largest magnitude."""
    g = torch.Generator().manual_seed(rank)
    sizes, scales = [51300, 46300, 35000], [1e3, 1e-6, 1e3]  # off the grid, padded by < 1 %: one payload
    params = [nn.Parameter(torch.zeros(n)) for n in sizes]
    grads = [torch.randn(n, generator=g) * s for n, s in zip(sizes, scales)]
    exact = [t.clone() for t in grads]
    for t in exact:
        dist.all_reduce(t)
        t /= world
    for p, t in zip(params, grads):
        p.grad = t.clone()
    comp = compressor(spec, min_numel=0, error_feedback=False)
    comp.synchronize(params)
    amax = [t.abs().max() for t in grads]
    for a in amax:
        dist.all_reduce(a, op=dist.ReduceOp.MAX)
    return [(float((p.grad - e).abs().max()), float(a)) for p, e, a in zip(params, exact, amax)]
