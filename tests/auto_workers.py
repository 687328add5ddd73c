"""Worker functions of tests/test_auto.py and tests/test_auto_processes.py (module level: they are pickled into gloo worker processes)."""

from __future__ import annotations

import hashlib
import io
import logging
import time

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

import gradcompress
from gradcompress.clocks import HostClock


def _model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 10))


def _digest(model: nn.Module) -> str:
    h = hashlib.sha256()
    for p in model.parameters():
        h.update(p.detach().contiguous().numpy().tobytes())
    return h.hexdigest()


def _batch(rank: int, step: int):
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(32, 64, generator=g), torch.randint(0, 10, (32,), generator=g)


def _replicas_equal(model: nn.Module) -> bool:
    d = torch.tensor([float(sum(p.detach().double().sum() for p in model.parameters()))], dtype=torch.float64)
    gathered = [torch.zeros_like(d) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, d)
    return all(torch.equal(g, gathered[0]) for g in gathered)


def _train_step(model, opt, rank: int, step: int) -> None:
    x, y = _batch(rank, step)
    opt.zero_grad()
    nn.functional.cross_entropy(model(x), y).backward()
    opt.step()


def _plan_text(compressor) -> str:
    pilot = compressor.autopilot
    return repr(sorted(pilot.choice.chosen.items())) if pilot else compressor.codec.spec


def _hint(compressor, rate: float) -> None:
    """The autopilot's bandwidth hint becomes ``rate`` (a simulated link change)."""
    import dataclasses

    pilot = compressor.autopilot
    auto = dataclasses.replace(pilot.options, bandwidth=rate)
    pilot.config = dataclasses.replace(pilot.config, scheme=dataclasses.replace(pilot.config.scheme, auto=auto))


def _same_everywhere(text: str) -> bool:
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, text)
    return all(o == out[0] for o in out)


def ddp_train(rank: int, world: int, spec: str, steps: int, options: dict | None = None, skew: float = 1.0,
              bucket_cap_mb: float = 0.1, change: tuple | None = None) -> dict:
    """DDP with ``spec`` for ``steps`` steps: the digest of the parameters, the plan at each step, replica
    equality at each step. ``skew``: this rank's clock runs ``skew`` times as fast (rank 1 only);
    ``change``: (step, bandwidth) the autopilot's bandwidth hint becomes at that step (a simulated link change)."""
    model = DDP(_model(), bucket_cap_mb=bucket_cap_mb)
    comp = gradcompress.register_ddp_hook(model, spec, **(options or {}))
    if comp.autopilot is not None and rank == 1 and skew != 1.0:
        comp.autopilot.meter.use(HostClock(lambda: skew * time.perf_counter()))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    plans, equal, same = [], [], []
    for step in range(steps):
        if change is not None and step == change[0]:
            _hint(comp, change[1])
        _train_step(model, opt, rank, step)
        plans.append(_plan_text(comp))
        equal.append(_replicas_equal(model))
        same.append(_same_everywhere(plans[-1]))
    return {"digest": _digest(model), "plans": plans, "equal": equal, "same": same, "stats": comp.stats(),
            "explain": comp.explain()}


def switch(rank: int, world: int, steps: int, at: int, back: int) -> dict:
    """auto with a fast-link hint, re-checking every 2 steps; the hint drops to 1 Mbit/s at step ``at`` and comes
    back at ``back``: residuals of the compressed steps are kept unchanged over the dense ones."""
    model = DDP(_model(), bucket_cap_mb=0.1)
    comp = gradcompress.register_ddp_hook(model, "auto:bandwidth=100gbit,every=2")
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    plans, equal, residuals = [], [], []
    for step in range(steps):
        if step in (at, back):
            _hint(comp, 1e6 if step == at else 100e9)
        _train_step(model, opt, rank, step)
        plans.append(_plan_text(comp))
        equal.append(_replicas_equal(model))
        residuals.append({k: v.clone() for k, v in comp.residual.items()})
    return {"plans": plans, "equal": equal, "residuals": residuals, "stats": comp.stats()["auto"]}


def resume(rank: int, world: int, steps: int, split_at: int | None) -> str:
    """DDP with ``auto:bandwidth=1mbit`` for ``steps`` steps; with ``split_at``, the model, optimizer and compressor
    are checkpointed there, rebuilt from scratch and loaded (weights_only) before going on. The parameters' digest."""
    def build():
        model = DDP(_model(), bucket_cap_mb=0.1)
        comp = gradcompress.register_ddp_hook(model, "auto:bandwidth=1mbit")
        return model, comp, torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)

    model, comp, opt = build()
    for step in range(steps):
        if step == split_at:
            buf = io.BytesIO()
            torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "comp": comp.state_dict()}, buf)
            buf.seek(0)
            saved = torch.load(buf, weights_only=True)
            model, comp, opt = build()
            model.load_state_dict(saved["model"])
            opt.load_state_dict(saved["opt"])
            comp.load_state_dict(saved["comp"])
        x, y = _batch(rank, step)
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    return _digest(model) + " " + _plan_text(comp)


def custom_loop(rank: int, world: int, spec: str, steps: int) -> dict:
    """``Compressor(spec).synchronize`` in a plain loop (no DDP)."""
    model = _model()
    comp = gradcompress.Compressor(spec)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    equal = []
    for step in range(steps):
        x, y = _batch(rank, step)
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        comp.synchronize(model.parameters())
        opt.step()
        equal.append(_replicas_equal(model))
    return {"digest": _digest(model), "plan": _plan_text(comp), "equal": equal, "stats": comp.stats()}


def fsdp_train(rank: int, world: int, spec: str, steps: int) -> dict:
    """FSDP2 (``fully_shard`` per layer) with ``register_fsdp(model, spec)``: the plan, the full parameters' digest
    (gathered) and the stats."""
    from torch.distributed.fsdp import fully_shard

    model = _model()
    for layer in model:
        if any(True for _ in layer.parameters()):
            fully_shard(layer)
    fully_shard(model)
    comp = gradcompress.register_fsdp(model, spec)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    for step in range(steps):
        x, y = _batch(rank, step)
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    full = [p.full_tensor().detach() for p in model.parameters()]
    h = hashlib.sha256()
    for t in full:
        h.update(t.contiguous().numpy().tobytes())
    return {"digest": h.hexdigest(), "plan": _plan_text(comp), "stats": comp.stats()}


def nodes_train(rank: int, world: int, spec: str, steps: int, force: str | None = None) -> dict:
    """DDP with ``spec`` on 2 nodes of 2 workers (``topology=2``): the plan and layout at each step, replica
    equality at each step, the stats. ``force``: the layout trial's outcome ("flat" or "hierarchical": that layout's
    steps after the first decision measure 10x faster on every rank, through the meter's clock)."""
    model = DDP(_model(), bucket_cap_mb=0.1)
    comp = gradcompress.register_ddp_hook(model, spec, topology=2)
    pilot = comp.autopilot
    if force is not None:
        real, offset = time.perf_counter, [0.0]

        def clock():  # steps of the forced layout take a tenth of their time (every rank alike)
            now = real() + offset[0]
            if pilot.choice.layout == force and pilot.ledger.decided_at is not None:
                offset[0] -= 0.9 * (now - clock.last)
                now = real() + offset[0]
            clock.last = now
            return now

        clock.last = real()
        pilot.meter.use(HostClock(clock))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    plans, layouts, equal, same = [], [], [], []
    for step in range(steps):
        _train_step(model, opt, rank, step)
        plans.append(_plan_text(comp))
        layouts.append(pilot.choice.layout)
        equal.append(_replicas_equal(model))
        same.append(_same_everywhere(plans[-1] + layouts[-1]))
    return {"digest": _digest(model), "plans": plans, "layouts": layouts, "equal": equal, "same": same,
            "stats": comp.stats(), "explain": comp.explain()}


def relayout_invariant(rank: int, world: int, steps: int, to_nodes: int, back: int) -> dict:
    """``Compressor("topk:ratio=0.1", topology=2)`` on fixed per-rank gradients, flat until ``to_nodes``, then
    hierarchical until ``back``, then flat (``Session.relayout`` at each change, as the autopilot switches): the
    error-feedback invariant — what was delivered plus the workers' mean residual equals the exact means' sum —
    at the end, and the mean residual kept by each relayout."""
    from gradcompress.schedule import Plan
    from gradcompress.spec import make

    comp = gradcompress.Compressor("topk:ratio=0.1", topology=2, min_numel=16)
    shapes = {0: (40, 30), 1: (37,)}
    codec, delivered, exact = make("topk:ratio=0.1"), {k: torch.zeros(s) for k, s in shapes.items()}, None
    kept = []

    def mean_residual(hierarchical: bool) -> dict:
        out = {}
        for k, shape in shapes.items():
            if hierarchical:  # piece j of the nodes' mean: the workers of local rank j, averaged over nodes
                h = comp.hierarchy
                from gradcompress.exchanges.hierarchical import to_whole
                whole = to_whole(h.intra.world, h.intra.rank, comp.residual, {k: shape})[k]
            else:
                whole = comp.residual[k].clone()
            dist.all_reduce(whole)
            out[k] = whole / world
        return out

    for step in range(steps):
        if step in (to_nodes, back):
            hier = step == to_nodes
            before = mean_residual(not hier)
            comp.session.relayout(comp.state, shapes, hier)
            after = mean_residual(hier)
            kept.append(all(torch.allclose(before[k], after[k], atol=1e-6) for k in shapes))
        flat = not (to_nodes <= step < back)
        g = torch.Generator().manual_seed(100 * step + rank)
        grads = {k: torch.randn(s, generator=g) for k, s in shapes.items()}
        mean = {k: v.clone() for k, v in grads.items()}
        for v in mean.values():
            dist.all_reduce(v)
            v.div_(world)
        exact = mean if exact is None else {k: exact[k] + mean[k] for k in shapes}
        with comp.step(plan=Plan(codec, flat=flat)) as s:
            s.drive([s.exchange(list(shapes), [grads[k] for k in shapes])])
        for k in shapes:
            delivered[k] += grads[k]
    residual = mean_residual(False)
    gap = max(float((delivered[k] + residual[k] - exact[k]).abs().max()) for k in shapes)
    pieces = sorted(str(k) for k in comp.residual)
    return {"gap": gap, "kept": kept, "keys": pieces, "hier": comp.hierarchy is not None}


def regime_train(rank: int, world: int, steps: int, scale_at: int) -> dict:
    """DDP with ``auto:bandwidth=10mbit,every=2``; from step ``scale_at`` the loss is multiplied by 10 on every rank
    (the gradient norm jumps: Accordion's critical regime): the plan at each step, replica equality, the stats."""
    model = DDP(_model(), bucket_cap_mb=0.1)
    comp = gradcompress.register_ddp_hook(model, "auto:bandwidth=10mbit,every=2")
    opt = torch.optim.SGD(model.parameters(), lr=0.001)
    plans, equal, critical = [], [], []
    for step in range(steps):
        x, y = _batch(rank, step)
        opt.zero_grad()
        scale = 10.0 if step >= scale_at else 1.0
        (scale * nn.functional.cross_entropy(model(x), y)).backward()
        opt.step()
        plans.append(_plan_text(comp))
        critical.append(comp.autopilot.regime.critical)
        equal.append(_replicas_equal(model))
    return {"plans": plans, "equal": equal, "critical": critical, "stats": comp.stats()["auto"],
            "explain": comp.explain()}


def poisoned_cache(rank: int, world: int, steps: int, folder: str) -> dict:
    """DDP with ``auto:bandwidth=100gbit`` (dense everywhere, by the model). Rank 1's calibration cache is stale: its
    entries were recorded here, then every byte count in the file was multiplied by 1000 (as a cache from another
    version of the code could say), so by its own numbers rank 1 would compress. The plan at each step and whether
    every rank holds the same."""
    import json

    from gradcompress.autopilot.calibration import Cache
    from gradcompress.autopilot.decide import record
    from gradcompress.autopilot.pilot import Costs

    model = DDP(_model(), bucket_cap_mb=0.1)
    comp = gradcompress.register_ddp_hook(model, "auto:bandwidth=100gbit,cache=off")
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    pilot, plans, same, equal = comp.autopilot, [], [], []
    for step in range(steps):
        if step == 2 and rank == 1:  # the buckets are known (DDP rebuilt them after step 0): poison this cache
            path = f"{folder}/calibration-{rank}.json"
            record(pilot.config, world, pilot.meter.buckets, pilot.options.candidates, Cache(path))
            with open(path) as f:
                entries = json.load(f)
            for entry in entries.values():
                entry["rounds"] = [[[c[0], c[1], 1000 * c[2], c[3], c[4]] for c in r] for r in entry["rounds"]]
            with open(path, "w") as f:
                json.dump(entries, f)
            pilot.costs = Costs(Cache(path))
        _train_step(model, opt, rank, step)
        plans.append(_plan_text(comp))
        same.append(_same_everywhere(plans[-1]))
        equal.append(_replicas_equal(model))
    alone = None
    if rank == 1:  # what this rank's own numbers would decide: the poisoned table, read back from the file
        table = record(pilot.config, world, pilot.meter.buckets, pilot.options.candidates, Cache(path))
        alone = sum(c.sent for row in table for o in row[1:2] for r in o.rounds for c in r)
    return {"plans": plans, "same": same, "equal": equal, "stats": comp.stats()["auto"], "poisoned_sent": alone}


class _Lines(logging.Handler):
    """Collects the formatted lines of the ``gradcompress`` loggers in this process."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.lines: list[tuple[int, str]] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append((record.levelno, record.getMessage()))


def newcomer_mlp(rank: int, steps: int, spec: str) -> None:
    """The newcomer's script (issue 48): an 85K-parameter MLP (64-256-256-10) under DDP with its default buckets,
    ``register_ddp_hook(ddp, spec)``, SGD with momentum, a fixed random task."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 10))
    ddp = DDP(model)
    gradcompress.register_ddp_hook(ddp, spec)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(2048, 64, generator=g)
    y = x[:, :10].argmax(1)
    for _ in range(steps):
        idx = torch.randint(0, 2048, (32,), generator=g)
        opt.zero_grad()
        nn.functional.cross_entropy(ddp(x[idx]), y[idx]).backward()
        opt.step()


def stationary(rank: int, world: int, task: str, steps: int, spec: str = "auto", jitter: tuple | None = None) -> dict:
    """A run whose link (loopback) and compute do not change: ``task`` is ``digits`` or ``lm`` (the library's own
    tasks, as ``gradcompress train --task TASK --schemes SPEC`` runs them) or ``mlp`` (:func:`newcomer_mlp`). The
    plan each step ran (None while a selection measures plans against each other), the autopilot's log lines on
    this rank (every level), its stats and explain(). ``jitter`` (probability, seconds): a loaded machine, seeded
    per rank: a step reads that much longer on the autopilot's clock with that probability, whatever its plan."""
    from gradcompress.autopilot import Autopilot
    from gradcompress.autopilot.probation import Selection

    seen: list = []
    pilots: list = []
    closed = Autopilot.closed

    def record(self, step) -> None:  # the plan this step ran, as the step saw it
        closed(self, step)
        if not pilots:
            pilots.append(self)
            if jitter is not None:
                _jitter(self.meter, rank, *jitter)
        seen.append(None if isinstance(self.probation.state, Selection) else tuple(sorted(self.choice.chosen.items())))

    Autopilot.closed = record  # this worker process only
    handler = _Lines()
    logger = logging.getLogger("gradcompress")
    logger.addHandler(handler)
    logger.setLevel(logging.DEBUG)
    try:
        if task == "mlp":
            newcomer_mlp(rank, steps, spec)
        else:
            from gradcompress.cli.task import TASKS, RunConfig, train_run

            cfg = RunConfig(scheme=spec, steps=steps, task=task, progress_every=10 ** 9)
            train_run(rank, world, TASKS[task].load(cfg.seed), cfg, torch.device("cpu"))
    finally:
        Autopilot.closed = closed
        logger.removeHandler(handler)
    pilot = pilots[0]
    return {"plans": seen, "first": pilot.first, "lines": handler.lines, "stats": pilot.stats(),
            "explain": pilot.explain()}


def _jitter(meter, rank: int, probability: float, seconds: float) -> None:
    """``meter``'s clock from now on: the host's, plus ``seconds`` at the start of a step with ``probability`` (the
    step before reads that much longer: a burst of another process's work)."""
    import random

    offset, draw = [0.0], random.Random(rank)
    meter.use(HostClock(lambda: time.perf_counter() + offset[0]))
    started = meter.step_started

    def step_started(comm) -> None:
        if draw.random() < probability:
            offset[0] += seconds
        started(comm)

    meter.step_started = step_started


def plan_changes(plans: list, first: int) -> int:
    """Changes of the plan kept (the steps a selection measures left out) after the first decision's (the plan kept
    at the end of the first selection, which begins at step ``first``)."""
    kept = [p for p in plans[first:] if p is not None]
    return sum(a != b for a, b in zip(kept, kept[1:]))
