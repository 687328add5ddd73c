"""Worker functions for the multi-process tests (module level, so they can be pickled)."""

from __future__ import annotations

import warnings

import torch
import torch.distributed as dist
import torch.nn as nn

import gradcompress


def make_model(seed: int = 0) -> nn.Module:
    """A small MLP with tensors above and below min_numel (several DDP buckets at small bucket_cap_mb)."""
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 48), nn.ReLU(), nn.Linear(48, 10))


def batch(rank: int, step: int, n: int = 16):
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(n, 32, generator=g), torch.randint(0, 10, (n,), generator=g)


def ddp_steps(rank, world, spec, steps=3, bucket_cap_mb=0.01, options=None, mode="hook", lr=0.05):
    """Train ``steps`` steps; return per-step averaged grads (list of lists) and final params."""
    options = dict(options or {"min_numel": 256})
    model = make_model()
    if mode == "ddp_default":
        ddp = nn.parallel.DistributedDataParallel(model, bucket_cap_mb=bucket_cap_mb)
        comp = None
    elif mode == "hook":
        ddp = nn.parallel.DistributedDataParallel(model, bucket_cap_mb=bucket_cap_mb)
        comp = gradcompress.register_ddp_hook(ddp, spec, **options)
    else:  # synchronize
        ddp = model
        comp = gradcompress.Compressor(spec, **options)
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    grads = []
    for step in range(steps):
        x, y = batch(rank, step)
        opt.zero_grad()
        nn.functional.cross_entropy(ddp(x), y).backward()
        if mode == "synchronize":
            comp.synchronize(model.parameters())
        grads.append([p.grad.clone() for p in model.parameters()])
        opt.step()
    return {"grads": grads, "params": [p.detach().clone() for p in model.parameters()],
            "stats": comp.stats() if comp else None}


SPECS = ["none", "fp16", "bf16", "int8", "int8:stochastic=true", "int4", "qsgd", "terngrad", "sign", "topk:ratio=0.05",
         "topk:ratio=0.05,values=int8", "randomk:ratio=0.1,scale=true", "threshold:value=0.01", "dgc:ratio=0.05",
         "powersgd:rank=2", "powersgd:rank=1,alternate=true"]


def codec_matrix(rank, world, specs, steps=3):
    """For every spec: the hook with small and large buckets, and synchronize(); plus DDP's default."""
    out = {"ddp_default": ddp_steps(rank, world, "none", steps, 0.01, None, "ddp_default")}
    for spec in specs:
        out[spec] = {
            "small": ddp_steps(rank, world, spec, steps, 0.005),
            "large": ddp_steps(rank, world, spec, steps, 25.0),
            "sync": ddp_steps(rank, world, spec, steps, mode="synchronize"),
        }
    return out


def expected_wire_bytes(world, codec, grads, min_numel):
    """Bytes one synchronize() step (the first) should send, from the payloads' sizes and the ring formulas."""
    from gradcompress.exchanges.layout import chunk_numel
    from gradcompress.codecs.base import Aggregation
    from gradcompress.step import mix_seed

    rank = dist.get_rank()

    def ar(b):
        return 2 * (world - 1) * b // world

    if codec.name == "none":  # exact and stateless: one dense all-reduce of the group, no flag
        return ar(sum(g.numel() * g.element_size() for g in grads))
    small = [g for g in grads if g.numel() < min_numel or
             codec.aggregation is Aggregation.LOWRANK and codec.matrix_shape(g.shape) is None]
    big = [(k, g) for k, g in enumerate(grads) if not any(g is s for s in small)]
    seeds = [mix_seed(0, k, 0, 0 if codec.shared_seed else rank, 0) for k, _ in big]
    big = [g for _, g in big]
    agg = codec.aggregation
    # the dense batch + the non-finite flag (none when nothing is dense and the received data carries a NaN)
    rides = codec.preserves_nonfinite and agg is not Aggregation.LOWRANK
    total = ar((sum(g.numel() for g in small) + 1) * 4) if small or not rides else 0
    if agg is Aggregation.SUM:
        total += ar(sum(codec.encode(g, seed=0).nbytes for g in big))
    elif agg is Aggregation.GATHER and codec.fixed_layout:
        total += (world - 1) * sum(codec.encode(g, seed=0).nbytes for g in big)
    elif agg is Aggregation.GATHER:  # sizes first (int64 per payload tensor + total), then padded to the longest
        payloads = [codec.encode(g, seed=s) for g, s in zip(big, seeds)]
        counts = sum(len(p.tensors) for p in payloads) + 1
        sizes = [None] * world
        dist.all_gather_object(sizes, sum(p.nbytes for p in payloads))
        total += (world - 1) * counts * 8 + (world - 1) * max(sizes)
    elif agg is Aggregation.REQUANTIZE:
        # the group's buckets back to back (each tensor from a bucket edge) in W chunks of whole buckets:
        # all-to-all of W chunk payloads ((W-1)/W of them leave) + all-gather of one re-encoded chunk
        # for tensors whose last bucket pads them by at most 1 %; the others as their own W chunks each
        whole = [g.numel() for g in big if (-g.numel()) % codec.bucket <= 0.01 * g.numel()]
        rest = [g.numel() for g in big if (-g.numel()) % codec.bucket > 0.01 * g.numel()]
        buckets = sum(-(-n // codec.bucket) for n in whole)
        chunk_bytes = codec.wire_nbytes(-(-buckets // world) * codec.bucket) if whole else 0
        chunk_bytes += sum(codec.wire_nbytes(chunk_numel(n, world, 8)) for n in rest)
        total += 2 * (world - 1) * chunk_bytes
    else:  # PowerSGD: one all-reduce of every P (n x r), one of every Q (m x r), float32
        shapes = [codec.matrix_shape(g.shape) for g in big]
        total += ar(sum(n * min(codec.rank, n, m) * 4 for n, m in shapes))
        if not codec.alternate:  # the alternating variant's first step reduces P only
            total += ar(sum(m * min(codec.rank, n, m) * 4 for n, m in shapes))
    return total


def wire_bytes_check(rank, world, specs):
    """One synchronize() step per spec: measured wire_bytes and the payload arithmetic."""
    out = {}
    for spec in specs:
        model = make_model()
        comp = gradcompress.Compressor(spec, min_numel=256)
        x, y = batch(rank, 0)
        nn.functional.cross_entropy(model(x), y).backward()
        grads = [p.grad.clone() for p in model.parameters()]
        comp.synchronize(model.parameters())
        out[spec] = (comp.stats()["wire_bytes"], expected_wire_bytes(world, comp.codec, grads, 256))
    return out


def ef_invariant(rank, world, specs, steps=5):
    """One worker: sum of delivered gradients + final residual vs sum of inputs, per spec."""
    out = {}
    for spec in specs:
        params = [nn.Parameter(torch.zeros(40, 50)), nn.Parameter(torch.zeros(3000))]
        with warnings.catch_warnings():  # forced on for every codec: the invariant is error feedback's
            warnings.simplefilter("ignore")
            comp = gradcompress.Compressor(spec, min_numel=1000, error_feedback=True)
        g = torch.Generator().manual_seed(7)
        inputs = [torch.zeros_like(p) for p in params]
        delivered = [torch.zeros_like(p) for p in params]
        for _ in range(steps):
            for p, acc in zip(params, inputs):
                p.grad = torch.randn(p.shape, generator=g)
                acc += p.grad
            comp.synchronize(params)
            for p, acc in zip(params, delivered):
                acc += p.grad
        residual = [comp.residual.get(i, torch.zeros(p.shape)) for i, p in enumerate(params)]
        out[spec] = (inputs, delivered, residual, [r.dtype for r in comp.residual.values()])
    return out


def train_checkpoint(rank, world, specs, steps, save_at, path, resume):
    """For each spec: DDP + hook; optionally save at ``save_at`` (and stop) or resume; final params."""
    out = {"initial": [p.detach().clone() for p in make_model().parameters()]}
    for i, spec in enumerate(specs):
        out[spec] = _train_checkpoint(rank, spec, steps, save_at, f"{path}.{i}", resume)[0]
    return out


def _train_checkpoint(rank, spec, steps, save_at, path, resume, compressor=None, momentum=0.9):
    """DDP training with a checkpoint cut; ``compressor``: the Compressor to register (default: ``spec``'s)."""
    model = make_model()
    ddp = nn.parallel.DistributedDataParallel(model, bucket_cap_mb=0.005)
    if compressor is None:
        compressor = gradcompress.Compressor(spec, min_numel=256, warmup_steps=1)
    comp = gradcompress.register_ddp_hook(ddp, compressor)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=momentum)
    start = 0
    if resume:
        state = torch.load(f"{path}.{rank}", weights_only=True)
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["optimizer"])
        comp.load_state_dict(state["compressor"])
        start = state["step"]
    for step in range(start, steps):
        if step == save_at and not resume:
            torch.save({"model": model.state_dict(), "optimizer": opt.state_dict(),
                        "compressor": comp.state_dict(), "step": step}, f"{path}.{rank}")
            break
        x, y = batch(rank, step)
        opt.zero_grad()
        nn.functional.cross_entropy(ddp(x), y).backward()
        opt.step()
    return [p.detach().clone() for p in model.parameters()], comp


def nonfinite_steps(rank, world, specs, mode):
    return {spec: nonfinite_step(rank, world, spec, mode) for spec in specs}


def nonfinite_step(rank, world, spec, mode):
    """Rank 1's gradient gets an Inf at step 2: every rank's result must be non-finite, state unchanged."""
    model = make_model()
    if mode == "hook":
        ddp = nn.parallel.DistributedDataParallel(model, bucket_cap_mb=0.005)
        comp = gradcompress.register_ddp_hook(ddp, spec, min_numel=256)
    else:
        ddp = model
        comp = gradcompress.Compressor(spec, min_numel=256)
    poison = {"on": False}
    target = model[2].weight
    target.register_hook(lambda g: g.index_fill(0, torch.tensor([0]), float("inf")) if poison["on"] else g)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    scaler = torch.amp.GradScaler("cpu", init_scale=1.0)
    report = {}
    for step in range(4):
        poison["on"] = step == 2 and rank == 1
        x, y = batch(rank, step)
        opt.zero_grad()
        before = comp.state_dict()
        scaler.scale(nn.functional.cross_entropy(ddp(x), y)).backward()
        if mode == "synchronize":
            comp.synchronize(model.parameters())
        if step == 2:
            after = comp.state_dict()
            report["finite"] = [bool(torch.isfinite(p.grad).all()) for p in model.parameters()]
            report["state_unchanged"] = all(
                torch.equal(before[name][k], after[name][k])
                for name in ("residual", "q", "p", "momentum") for k in before[name]) and \
                all(before[name].keys() == after[name].keys() for name in ("residual", "q", "p", "momentum"))
            report["had_state"] = sum(len(before[name]) for name in ("residual", "q", "p", "momentum")) > 0
        params_before = [p.detach().clone() for p in model.parameters()]
        scaler.step(opt)
        scaler.update()
        if step == 2:
            report["skipped"] = all(torch.equal(a, p) for a, p in zip(params_before, model.parameters()))
    report["params"] = [p.detach().clone() for p in model.parameters()]
    return report


def mismatched_specs(rank, world, specs):
    model = make_model()
    ddp = nn.parallel.DistributedDataParallel(model, bucket_cap_mb=0.005)
    gradcompress.register_ddp_hook(ddp, specs[rank], min_numel=256)
    x, y = batch(rank, 0)
    try:
        nn.functional.cross_entropy(ddp(x), y).backward()
    except Exception as err:  # any failure: the test inspects the message
        return f"{type(err).__name__}: {err}"
    return "no error"


def dead_peer(rank, world, spec):
    """Rank 1 leaves before the first step; rank 0 must fail (not hang) and report the error."""
    if rank == 1:
        return "left"
    comp = gradcompress.Compressor(spec, min_numel=256)
    model = make_model()
    x, y = batch(rank, 0)
    nn.functional.cross_entropy(model(x), y).backward()
    try:
        comp.synchronize(model.parameters())
    except Exception as err:  # any failure: reported to the test
        return f"{type(err).__name__}: {err}"
    return "no error"


def no_sync_accumulation(rank, world, spec):
    """Two micro-batches under no_sync then a synchronising one == one backward over all three."""
    results = []
    for accumulate in (True, False):
        model = make_model()
        ddp = nn.parallel.DistributedDataParallel(model, bucket_cap_mb=0.005)
        comp = gradcompress.register_ddp_hook(ddp, spec, min_numel=256)
        parts = [batch(rank, s) for s in range(3)]
        if accumulate:
            with ddp.no_sync():
                for x, y in parts[:2]:
                    nn.functional.cross_entropy(ddp(x), y).backward()
            x, y = parts[2]
            nn.functional.cross_entropy(ddp(x), y).backward()
        else:
            x = torch.cat([p[0] for p in parts])
            logits = ddp(x)
            loss = sum(nn.functional.cross_entropy(logits[16 * i:16 * (i + 1)], parts[i][1]) for i in range(3))
            loss.backward()
        results.append(([p.grad.clone() for p in model.parameters()], comp.stats()["steps"]))
    return results


def low_precision(rank, world, specs, dtype):
    out = {}
    for spec in specs:
        model = make_model().to(dtype)
        ddp = nn.parallel.DistributedDataParallel(model, bucket_cap_mb=0.005)
        comp = gradcompress.register_ddp_hook(ddp, spec, min_numel=256)
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        for step in range(3):
            x, y = batch(rank, step)
            opt.zero_grad()
            nn.functional.cross_entropy(ddp(x.to(dtype)).float(), y).backward()
            opt.step()
        out[spec] = ([p.detach().clone() for p in model.parameters()],
                     [r.dtype for r in comp.residual.values()])
    return out


def compressor_as_hook(rank, world, spec):
    """PyTorch's state + hook pair (``register_comm_hook(compressor, gradcompress.adapters.ddp.hook)``, what
    Lightning's ``DDPStrategy(ddp_comm_state=..., ddp_comm_hook=...)`` does) against ``register_ddp_hook``."""
    from gradcompress.adapters.ddp import hook

    results = []
    for register in ("state and hook", "register_ddp_hook"):
        model = make_model()
        ddp = nn.parallel.DistributedDataParallel(model, bucket_cap_mb=0.005)
        comp = gradcompress.Compressor(spec, min_numel=256)
        if register == "state and hook":
            ddp.register_comm_hook(comp, hook)
        else:
            gradcompress.register_ddp_hook(ddp, comp)
        for step in range(2):
            x, y = batch(rank, step)
            ddp.zero_grad()
            nn.functional.cross_entropy(ddp(x), y).backward()
        results.append([p.grad.clone() for p in model.parameters()])
    return results
