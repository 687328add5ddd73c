"""The netbench runner: step time and real interface bytes per scheme over emulated, shaped links.

``gradcompress netbench`` (:mod:`gradcompress.cli.netbench`: its arguments, checks and tables) calls :func:`bench`.
It builds ``workers`` test hosts as Linux network namespaces on one bridge, each host's link shaped with ``tc``
(``tbf`` at the rate in each direction, ``netem`` delay for a latency; see :mod:`gradcompress.testbed.netns`), and
starts one worker per host with ``ip netns exec HOST python -m gradcompress.testbed.netbench --worker CONFIG``. The
workers form a gloo process group exactly as a multi-node launch does (``init_method=tcp://HOST0:PORT``,
``GLOO_SOCKET_IFNAME`` the host's veth), so every byte between them crosses the shaped links (the hosts, the workers
and the teardown: :mod:`gradcompress.testbed.hosts`). Needs root and iproute2; everything (namespaces, links,
processes) is removed on exit, on error, on Ctrl-C and on SIGTERM.

Nodes (``per_node`` G > 1): N namespaces, each a node with one shaped uplink and G workers
(ranks in consecutive blocks of G, torchrun's ``GROUP_RANK``/``LOCAL_WORLD_SIZE`` set so that the library's default
``topology="auto"`` runs hierarchical; ``SPEC:topology=flat`` runs today's flat exchange beside it). The G workers
bind to the node's veth address, and a connection to one's own namespace's address goes over its loopback, so
intra-node traffic never reaches the uplink's tx counter (:mod:`gradcompress.testbed.hosts`). Reported per scheme:
the uplink's bytes per node and step next to the node's workers' ``stats()["inter_node_bytes"]`` (the cost model's
uplink count for the PyTorch baselines); ``ddp-nosend`` is DDP with a hook that sends nothing (the limit).

Every scheme is set up by :func:`gradcompress.factory.build` (``ddp-nosend`` here), on the benchmark models of
:mod:`gradcompress.testbed.models`.

In one run, for each scheme, on the same model (same initial weights, fixed per-rank
batches of random data): ``--warmup`` untimed steps, then ``--steps`` timed steps. Our
schemes are a :class:`gradcompress.Compressor` with ``warmup_steps=2`` as the DDP hook
(error feedback on for the biased codecs), so every timed step is a compressed step.
The PyTorch baselines: ``ddp`` (DistributedDataParallel, no hook), ``torch-fp16``
(``default_hooks.fp16_compress_hook``) and ``torch-powersgd[:rank=R]``
(``powerSGD_hook.powerSGD_hook`` with ``PowerSGDState(process_group=None,
matrix_approximation_rank=R, start_powerSGD_iter=2)``); that hook launches its second
all-reduce from a future callback and deadlocks on gloo with more than one bucket, so it
runs with ``bucket_cap_mb`` larger than the model: one bucket.

Reported per scheme: the median over the timed steps of the step time (the slowest
rank's); the bytes each host's interface transmitted per step (``tx_bytes`` of its veth
read inside its namespace before and after the timed steps: payload plus TCP/IP and
Ethernet headers, ACKs, gloo's own messages); ``stats()['wire_bytes']`` per step beside
it (ours; for the baselines the same ring count computed by :mod:`gradcompress.costmodel`,
marked ``model``); their ratio; codec time and time spent waiting on collectives per step
(ours); the speed-up over ``ddp``. Also, with
every worker at once: the compute time of one step without DDP (forward + backward + SGD
step), the same on one worker while the others wait (their ratio: what sharing the cores
costs, ``plan --contention``), the time of a DDP step whose hook sends nothing (the floor of every scheme, what
``plan --compute-ms`` wants), the time of a 4-byte all-reduce (2(W-1) message steps:
``plan --per-message-us``) and the payload bandwidth an 8 MB all-reduce reaches.
"""

from __future__ import annotations

import datetime
import math
import os
import statistics
import subprocess
import sys
import time
from typing import Any, cast

from ..factory import Run, build, one_bucket_mb
from ..scheme import AUTO, DECOUPLED, parse_scheme
from . import hosts, models, netbench_fsdp
from .netns import tbf

MIN_WARMUP = 3  # untimed steps: 2 dense (the Compressor's and powerSGD_hook's warm-up) + 1 compressed
COMPRESSOR_WARMUP = 2
#: FSDP mode: the uncompressed baseline's name and the default schemes
FSDP_BASELINE = "fsdp"
FSDP_SCHEMES = (FSDP_BASELINE, "int8", "int4", "sign", "topk:ratio=0.01")
#: DDP with a hook that sends nothing: the limit of every scheme (a netbench scheme, not a codec)
NOSEND = "ddp-nosend"
#: --nodes mode: the default schemes (each codec hierarchical, the library's default, and flat beside it)
NODE_SCHEMES = ("ddp", "torch-fp16", NOSEND, "int8", "int8:topology=flat", "int4", "int4:topology=flat", "sign",
                "sign:topology=flat", "topk:ratio=0.01", "topk:ratio=0.01,topology=flat")


# --------------------------------------------------------------------------- schemes
def _diloco_h(text: str) -> int:
    """H of a DiLoCo scheme (``int4:diloco=25``), else 0 (``text`` passed netbench's check)."""
    if text in (FSDP_BASELINE, NOSEND) or text in netbench_fsdp.BASELINES or netbench_fsdp.has_options(text):
        return 0
    return parse_scheme(text).diloco or 0


def _decoupled(text: str) -> bool:
    """DeMo (``decoupled:...``): an optimizer that exchanges itself every step (no DDP, no Compressor of its own)."""
    if text in (FSDP_BASELINE, NOSEND) or text in netbench_fsdp.BASELINES or netbench_fsdp.has_options(text):
        return False
    return parse_scheme(text).kind == DECOUPLED


# --------------------------------------------------------------------------- the parent
def bench(schemes: list[str], workers: int, rate_bit: float, latency_s: float, model: str, steps: int, warmup: int,
          batch_size: int, threads: int | None, timeout: float, fsdp: bool = False, per_node: int = 1,
          change: tuple[int, float] | None = None, accelerator: bool = False,
          fixed_warmup: int | None = None) -> dict:
    """Build the testbed (``workers`` hosts, ``per_node`` workers on each), run every scheme on every worker, tear
    everything down; the merged result. ``accelerator``: the compute leaves the CPU idle
    (:mod:`gradcompress.testbed.accelerator`: a timed wait of rank 0's measured compute time, then the real
    gradients). ``fixed_warmup``: the untimed steps of the schemes that are not auto (default ``warmup``).
    :class:`gradcompress.testbed.hosts.TestbedError` when the network cannot be built."""
    threads = threads or max(1, (os.cpu_count() or 1) // (workers * per_node))
    where = f"{workers} nodes x {per_node} workers" if per_node > 1 else f"{workers} hosts"
    print(f"netbench: {where}, {_fmt_rate(rate_bit)}"
          f"{f', {latency_s * 1e3:g} ms delay' if latency_s else ''}, model {model}, "
          f"{len(schemes)} schemes x ({warmup} + {steps}) steps{', emulated accelerator' if accelerator else ''}",
          file=sys.stderr)
    fixed_warmup = warmup if fixed_warmup is None else fixed_warmup
    settings = {"model": model, "schemes": schemes, "steps": steps, "warmup": warmup, "fixed_warmup": fixed_warmup,
                "batch_size": batch_size,
                "threads": threads, "fsdp": fsdp, "collective_timeout": max(60.0, min(timeout, 600.0)),
                "change": None if change is None else [change[0], change[1], rate_bit], "accelerator": accelerator}
    records = hosts.run_workers(
        workers, settings, module="gradcompress.testbed.netbench", rate_bit=rate_bit, delay_s=latency_s,
        timeout=timeout, env={"OMP_NUM_THREADS": str(threads)}, label="netbench",
        timeout_hint=" (raise --timeout, or fewer --steps/--schemes at low --bandwidth)", workers_per_node=per_node)
    result = merge(records, schemes, workers * per_node, rate_bit, latency_s, model, steps, warmup, batch_size,
                   threads, fsdp, per_node)
    result["accelerator"], result["fixed_warmup"] = accelerator, fixed_warmup
    return result


def _fmt_rate(bit: float) -> str:
    from ..costmodel import format_rate

    return format_rate(bit)


# --------------------------------------------------------------------------- the report
def merge(records: list[dict], schemes: list[str], workers: int, rate_bit: float, latency_s: float, model: str,
          steps: int, warmup: int, batch_size: int, threads: int, fsdp: bool = False, per_node: int = 1) -> dict:
    """Every rank's records into the per-scheme figures (see the module docstring); ``workers``: all of them,
    ``per_node`` on each host."""
    shapes = [tuple(s) for s in records[0]["shapes"]]
    rows = [_row(text, [r["schemes"][i] for r in records], shapes, workers, per_node)
            for i, text in enumerate(schemes)]
    base = next((r for r in rows if r["scheme"] in ("ddp", FSDP_BASELINE)), None) or \
        next((r for r in rows if r["scheme"] == "none"), None)
    for r in rows:
        r["speedup"] = base["median_step_s"] / r["median_step_s"] if base and r["median_step_s"] > 0 else None
    return {
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "workers": workers,
        "nodes": workers // per_node,
        "workers_per_node": per_node,
        "bandwidth_bit": rate_bit,
        "latency_s": latency_s,
        "model": model,
        "fsdp": fsdp,
        "params": sum(math.prod(s) for s in shapes),
        "shapes": [list(s) for s in shapes],
        "batch_size": batch_size,
        "steps": steps,
        "warmup": warmup,
        "threads_per_worker": threads,
        "cpu_count": os.cpu_count(),
        "compute_s": statistics.fmean(r["compute_s"] for r in records),
        "ddp_floor_s": max(r["ddp_floor_s"] for r in records),
        "compute_solo_s": records[0]["compute_solo_s"],
        "contention": statistics.fmean(r["compute_s"] for r in records) / records[0]["compute_solo_s"],
        "allreduce_small_s": max(r["allreduce_small_s"] for r in records),
        "alpha_s": max(r["allreduce_small_s"] for r in records) / (2 * (workers - 1)),
        "allreduce_8mb_s": max(r["allreduce_8mb_s"] for r in records),
        "allreduce_payload_bandwidth": _effective_bandwidth(records, workers),
        "baseline": base["scheme"] if base else None,
        "torch_powersgd_bucket_cap_mb": records[0]["one_bucket_cap_mb"],
        "schemes": rows,
    }


def _row(text: str, recs: list[dict], shapes: list[tuple], workers: int, per_node: int = 1) -> dict:
    """One scheme's figures from every rank's record of it (``speedup`` is added by :func:`merge`)."""
    n = len(recs[0]["step_seconds"])  # DiLoCo: whole intervals, maybe more than --steps
    per_step = [max(r["step_seconds"][k] for r in recs) for k in range(n)]
    iface = [r["iface_tx_bytes"] / n for r in recs]
    h = _diloco_h(text)
    kind, model_bytes = _model_wire_bytes(text, h, shapes, workers, recs[0]["bucket_cap_bytes"])
    wire: float | None
    source: str | None
    if recs[0]["wire_bytes"] is not None:
        wire, source = statistics.fmean(r["wire_bytes"] for r in recs) / n, "stats"
    else:
        wire, source = (None, None) if model_bytes is None else (float(model_bytes), "model")
    codec = [r["codec_seconds"] for r in recs if r["codec_seconds"] is not None]
    wait = [r["comm_seconds"] for r in recs if r.get("comm_seconds") is not None]
    return {
        "scheme": text,
        "kind": kind,
        "median_step_s": statistics.fmean(per_step) if h else statistics.median(per_step),
        "step_s": per_step,
        "iface_tx_bytes_per_step": statistics.fmean(iface),
        "iface_tx_bytes_per_step_by_host": iface,
        "wire_bytes_per_step": wire,
        "wire_bytes_source": source,
        "model_wire_bytes_per_step": model_bytes,
        "iface_over_wire": statistics.fmean(iface) / wire if wire else None,
        "codec_s_per_step": statistics.fmean(codec) / n if codec else None,
        "wait_s_per_step": statistics.fmean(wait) / n if wait else None,
        "param_bytes_per_step": None if recs[0].get("param_bytes") is None else recs[0]["param_bytes"] / n,
        "warmup_steps": recs[0].get("warmup"),
        "buckets": recs[0]["buckets"],
        "error_feedback": recs[0]["error_feedback"],
        "final_loss": recs[0]["loss"],
        "auto": recs[0].get("auto"),
        "explain": recs[0].get("explain"),
        "step_wire_bytes": recs[0].get("step_wire_bytes"),
        **_node_figures(text, recs, shapes, workers, per_node, n),
    }


def _node_figures(text: str, recs: list[dict], shapes: list[tuple], workers: int, per_node: int, n: int) -> dict:
    """Per node and step: the uplink's tx bytes (read by the node's local rank 0; every worker of the node reads
    the same counter), the sum of its workers' ``stats()["inter_node_bytes"]`` (ours; for the PyTorch baselines
    the cost model's count of what crosses the uplink, marked ``model``), and the topology ours ran."""
    from ..costmodel import modelled_scheme as cost_scheme, node_uplink_bytes

    nodes = workers // per_node
    uplink = [recs[k * per_node]["iface_tx_bytes"] / n for k in range(nodes)]
    if recs[0].get("inter_node_bytes") is not None:
        inter = [sum(r["inter_node_bytes"] for r in recs[k * per_node:(k + 1) * per_node]) / n for k in range(nodes)]
        source = "stats"
    elif text == NOSEND:
        inter, source = [0.0] * nodes, "model"
    elif _diloco_h(text) or _decoupled(text) or text in netbench_fsdp.BASELINES:
        inter, source = [None] * nodes, None
    else:
        model = node_uplink_bytes(cost_scheme(text), shapes, nodes, per_node, hierarchical=False,
                                  bucket_cap=recs[0]["bucket_cap_bytes"])
        inter, source = [float(model)] * nodes, "model"
    return {"uplink_tx_bytes_per_step_by_node": uplink, "uplink_tx_bytes_per_step": statistics.fmean(uplink),
            "inter_node_bytes_per_step_by_node": inter, "inter_node_bytes_source": source,
            "topology": recs[0].get("topology")}


def _model_wire_bytes(text: str, h: int, shapes: list[tuple], workers: int, bucket_cap: int | None):
    """(kind, the cost model's bytes per step or None) of a scheme: DiLoCo's outer exchange every H steps
    has no model (None); the FSDP baseline's reduce-scatter sends (W-1)/W of the float32 gradient."""
    from ..costmodel import modelled_scheme as cost_scheme, wire_bytes

    if h:
        return "diloco", None
    if _decoupled(text):
        return DECOUPLED, None
    if text == NOSEND:
        return NOSEND, 0
    if text == FSDP_BASELINE:
        return "fsdp", (workers - 1) * 4 * sum(math.ceil(s[0] / workers) * math.prod(s[1:]) for s in shapes)
    if text in netbench_fsdp.BASELINES or netbench_fsdp.has_options(text):  # FSDP on nodes: no model
        return "fsdp", None
    scheme = cost_scheme(text)
    if scheme.kind == AUTO:  # decided at run time: what it sent is in stats
        return AUTO, None
    return scheme.kind, wire_bytes(scheme, shapes, workers, bucket_cap)


def _effective_bandwidth(records: list[dict], workers: int) -> float | None:
    """Payload bytes/s per host implied by the 8 MB all-reduce: 2(W-1)/W M / (t - 2(W-1) alpha)."""
    small = max(r["allreduce_small_s"] for r in records)
    big = max(r["allreduce_8mb_s"] for r in records)
    t = big - small
    return 2 * (workers - 1) / workers * 8 * 2**20 / t if t > 0 else None


# --------------------------------------------------------------------------- the worker
def _no_communication_hook(state, bucket):
    import torch

    fut = torch.futures.Future()
    fut.set_result(bucket.buffer())
    return fut


def _median_step(name, net, opt, x, y, steps: int = 7, skip: int = 2) -> float:
    """Median time of a training step taken by every rank in lockstep (barrier before each), after ``skip``."""
    import torch.distributed as dist

    times = []
    for k in range(steps):
        dist.barrier()
        start = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        models.loss(name, net(x), y).backward()
        opt.step()
        if k >= skip:
            times.append(time.perf_counter() - start)
    return statistics.median(times)


def _worker(cfg: dict) -> None:
    """One host's part of the run: the machine's figures, then every scheme; the result for :func:`merge`."""
    import torch
    import torch.distributed as dist

    rank, world = cfg["rank"], cfg["world"]
    torch.set_num_threads(cfg["threads"])
    dist.init_process_group("gloo", init_method=f"tcp://{cfg['master']}:{cfg['port']}", rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=cfg["collective_timeout"]))
    name = cfg["model"]
    x, y = models.batch(name, cfg["batch_size"], rank)
    model = models.build_model(name)
    shapes = [list(p.shape) for p in model.parameters()]
    one_bucket = one_bucket_mb(model)
    del model
    figures = _machine_figures(name, x, y, rank)
    if cfg.get("accelerator"):  # every rank emulates rank 0's compute time alone (no core shared)
        solo = torch.tensor([figures["compute_solo_s"] or 0.0], dtype=torch.float64)
        dist.broadcast(solo, 0)
        cfg = {**cfg, "emulated_s": solo.item()}
    records = [_scheme_record(cfg, i, text, x, y, one_bucket) for i, text in enumerate(cfg["schemes"])]
    hosts.write_result(cfg, {"rank": rank, **figures, "shapes": shapes, "one_bucket_cap_mb": one_bucket,
                             "schemes": records})
    dist.barrier()
    dist.destroy_process_group()


def _machine_figures(name: str, x, y, rank: int) -> dict:
    """Compute alone (every worker at once, and rank 0 alone), a DDP step that sends nothing, and the
    network as gloo sees it (a 4-byte and an 8 MB all-reduce)."""
    import torch

    model = models.build_model(name)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    compute_s = _median_step(name, model, opt, x, y)  # every worker at once, in lockstep, no communication
    solo_s = _solo_step(name, model, opt, x, y, rank)
    del model, opt
    ddp_floor_s = _ddp_floor(name, x, y)
    small_s, big_s = _allreduce_times()
    return {"compute_s": compute_s, "compute_solo_s": solo_s, "ddp_floor_s": ddp_floor_s,
            "allreduce_small_s": small_s, "allreduce_8mb_s": big_s}


def _solo_step(name: str, model, opt, x, y, rank: int) -> float | None:
    """Median step time on rank 0 alone (the others wait in a barrier): compute_s / this is the slowdown
    that sharing the CPU cores costs (``plan --contention``); None on the other ranks."""
    import torch.distributed as dist

    times = []
    for k in range(5):
        dist.barrier()
        if rank == 0:
            start = time.perf_counter()
            opt.zero_grad(set_to_none=True)
            models.loss(name, model(x), y).backward()
            opt.step()
            if k >= 1:
                times.append(time.perf_counter() - start)
    solo_s = statistics.median(times) if times else None
    dist.barrier()
    return solo_s


def _ddp_floor(name: str, x, y) -> float:
    """The floor of every scheme: a DDP step whose hook sends nothing (DDP's own copies and bookkeeping)."""
    import torch
    import torch.nn as nn

    model = models.build_model(name)
    ddp = nn.parallel.DistributedDataParallel(model)
    ddp.register_comm_hook(None, _no_communication_hook)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    return _median_step(name, ddp, opt, x, y)


def _allreduce_times() -> tuple[float, float]:
    """Median times of a 4-byte all-reduce (2(W-1) message steps) and of an 8 MB one."""
    import torch
    import torch.distributed as dist

    def timed(tensor, rounds: int, skip: int) -> float:
        times = []
        for k in range(rounds):
            dist.barrier()
            start = time.perf_counter()
            dist.all_reduce(tensor)
            if k >= skip:
                times.append(time.perf_counter() - start)
        return statistics.median(times)

    return timed(torch.zeros(1), 12, 2), timed(torch.zeros(2 * 2**20), 3, 0)


def _scheme_record(cfg: dict, i: int, text: str, x, y, one_bucket: int) -> dict:
    """Set up scheme ``text`` on a fresh model, take the warm-up and the timed steps; this rank's record."""
    import torch.distributed as dist

    name = cfg["model"]
    model = models.build_model(name)
    if cfg.get("emulated_s"):
        from .accelerator import Emulated, real_grads

        model = Emulated(model, real_grads(model, lambda out, t: models.loss(name, out, t), x, y), cfg["emulated_s"])
    h = _diloco_h(text)
    net, opt, comp = _setup(cfg, model, text)
    own = h or _decoupled(text)  # DiLoCo and DeMo keep their own counters (streaming: one Compressor per fragment)
    cap_mb = one_bucket if _ddp_kind(cfg, text, h) == "torch-powersgd" else None

    def step() -> float:  # runs before the ``del net, opt`` below (ruff reads the del as unbinding them here)
        opt.zero_grad(set_to_none=True)  # noqa: F821 - bound: see the del below
        loss = net(x) if cfg.get("emulated_s") else models.loss(name, net(x), y)  # noqa: F821 - bound: see the del below
        loss.backward()
        opt.step()  # noqa: F821 - bound: see the del below
        return loss.item()

    auto = comp is not None and comp.autopilot is not None
    warmup, timed = cfg["warmup"] if auto else cfg["fixed_warmup"], cfg["steps"]
    if h:  # whole intervals: one untimed, then the timed steps rounded up to whole intervals
        warmup, timed = h, h * -(-timed // h)
    record = _timed_steps(cfg["ifname"], step, opt if own else comp, warmup, timed, cfg.get("change"))
    record.update(scheme=text, warmup=warmup, buckets=_bucket_count(cfg, model, net, own), auto=comp.stats().get("auto") if comp else None,
                  explain=comp.explain() if comp is not None and comp.autopilot is not None else None,
                  error_feedback=_error_feedback(cfg, text, h, comp),
                  bucket_cap_bytes=None if cap_mb is None else cap_mb * 2**20)
    if cfg["rank"] == 0:
        print(f"netbench: [{i + 1}/{len(cfg['schemes'])}] {text}: "
              f"{1e3 * statistics.median(record['step_seconds']):.1f} ms/step (median), "
              f"{record['iface_tx_bytes'] / timed / 1e6:.2f} MB/step sent by host 0", file=sys.stderr, flush=True)
    del net, comp, opt, model
    dist.barrier()
    return record


def reshape(ifname: str, rate_bit: float) -> None:
    """Set this host's uplink (``ifname``'s egress, in the namespace this process runs in) to ``rate_bit``."""
    subprocess.run(["tc", "qdisc", "change", "dev", ifname, "root", "handle", "1:", *tbf(rate_bit)], check=True)


def _timed_steps(ifname: str, step, comp, warmup: int, timed: int, change: list | None = None) -> dict:
    """``warmup`` untimed steps, then ``timed`` timed ones: their times, the interface's bytes and the
    Compressor's counters over them, the last loss. ``change``: [timed step, rate, the run's rate]: every host's
    uplink is reshaped to that rate before that step (after a barrier) and back after the last."""
    import torch.distributed as dist

    for _ in range(warmup):
        step()
    dist.barrier()  # every earlier byte has crossed the links (peers received it)
    time.sleep(0.05)  # and the last ACKs too
    tx0 = hosts.read_tx_bytes(ifname)
    st0: Any = comp.stats() if comp else None  # read only with comp
    step_times: list[float] = []
    step_wire: Any = []  # per step, then their differences (None without a Compressor)
    loss = float("nan")
    for k in range(timed):
        if change is not None and k == change[0]:
            dist.barrier()
            reshape(ifname, change[1])
        start = time.perf_counter()
        loss = step()
        step_times.append(time.perf_counter() - start)
        if comp is not None:
            step_wire.append(comp.stats()["wire_bytes"])
    st1: Any = comp.stats() if comp else None  # read only with comp
    # a collective is complete here once its bytes are in the socket buffers, not yet through the shaped
    # link: wait until every peer has received everything (a barrier: ~100 bytes) before reading tx_bytes
    dist.barrier()
    time.sleep(0.05)
    tx1 = hosts.read_tx_bytes(ifname)
    if change is not None:
        reshape(ifname, change[2])

    def delta(key):  # DeMo's counters lack some of the Compressor's (param_bytes)
        return None if comp is None or key not in st1 else st1[key] - st0[key]

    step_wire = [b - a for a, b in zip([st0["wire_bytes"]] + step_wire, step_wire)] if comp else None
    return {"step_seconds": step_times, "step_wire_bytes": step_wire, "iface_tx_bytes": tx1 - tx0, "wire_bytes": delta("wire_bytes"),
            "inter_node_bytes": delta("inter_node_bytes"), "intra_node_bytes": delta("intra_node_bytes"),
            "param_bytes": delta("param_bytes"),
            "topology": None if comp is None or not st1.get("topology") else st1["topology"]["kind"],
            "codec_seconds": delta("codec_seconds"), "comm_seconds": delta("comm_seconds"),
            "loss": loss if math.isfinite(loss) else None}


def _bucket_count(cfg: dict, model, net, h: int) -> int:
    """Buckets a step of the scheme sends: DiLoCo and DeMo 0 (their own exchanges, no DDP), FSDP its sharded
    modules, DDP its (rebuilt) buckets."""
    if h:
        return 0
    if cfg.get("fsdp"):
        return sum(1 for m in model.modules() if any(True for _ in m.parameters(recurse=False)))
    logging = net._get_ddp_logging_data()
    sizes = str(logging.get("rebuilt_bucket_sizes") or logging.get("bucket_sizes") or "")
    return len([s for s in sizes.split(",") if s.strip()])


def _setup(cfg: dict, model, text: str | None):  # (given a str: None once split_fsdp_scheme() reads a baseline)
    """(net, optimizer, Compressor or None) of scheme ``text`` on ``model``: ``ddp-nosend`` here, every other scheme
    by :func:`gradcompress.factory.build`, with plain SGD (lr 1e-3) and our Compressor's ``warmup_steps=2``,
    ``seed=0``."""
    import torch

    if text == NOSEND:
        return _nosend(model)
    fsdp, per_node, params = bool(cfg.get("fsdp")), 0, None
    if fsdp and cfg.get("workers_per_node", 1) > 1:  # FSDP on nodes: a codec with layout= and params= (netbench_fsdp)
        text, layout, params = netbench_fsdp.split_fsdp_scheme(cast(str, text))
        per_node = cfg["workers_per_node"] if layout == "hsdp" else 0
    scheme = None if text is None or (fsdp and text == FSDP_BASELINE) else parse_scheme(text)
    options = {"warmup_steps": COMPRESSOR_WARMUP, "seed": 0, **({} if scheme is None else scheme.compressor)}
    exchanging = scheme.demo if scheme is not None and scheme.kind == DECOUPLED else {}
    run = Run(optimizer=lambda parameters: torch.optim.SGD(parameters, lr=1e-3), options=options, fsdp=fsdp,
              per_node=per_node, params=params, exchanging=exchanging)
    return build(scheme, model, run)


def _nosend(model):
    """The limit of every scheme: DDP whose hook sends nothing (DDP's own copies and bookkeeping only)."""
    import torch
    import torch.nn as nn

    ddp = nn.parallel.DistributedDataParallel(model)
    ddp.register_comm_hook(None, _no_communication_hook)
    return ddp, torch.optim.SGD(model.parameters(), lr=1e-3), None


def _ddp_kind(cfg: dict, text: str, h: int) -> str | None:
    """The kind of a DDP scheme (``ddp``, ``torch-powersgd``, ``ours``, ...; :data:`NOSEND`), None under FSDP or
    DiLoCo."""
    if cfg.get("fsdp") or h or _decoupled(text):
        return None
    return NOSEND if text == NOSEND else parse_scheme(text).kind


def _error_feedback(cfg: dict, text: str, h: int, comp) -> bool | None:
    """A record's error feedback: FSDP's and DiLoCo's Compressor's (None: uncompressed), False for ``ddp-nosend``,
    and for the other DDP schemes the default of the scheme's kind (:func:`gradcompress.costmodel.
    default_error_feedback`: what ``error_feedback="auto"`` resolves to, on for PyTorch's PowerSGD hook)."""
    from ..costmodel import default_error_feedback

    kind = _ddp_kind(cfg, text, h)
    if kind is None or (comp is not None and comp.autopilot is not None):
        return None if comp is None else comp.error_feedback
    return False if kind == NOSEND else default_error_feedback(parse_scheme(text))


def worker_main(argv: list[str]) -> int:
    """The worker process's entry point: ``python -m gradcompress.testbed.netbench --worker CONFIG.json``."""
    if len(argv) != 2 or argv[0] != "--worker":
        print("usage: python -m gradcompress.testbed.netbench --worker CONFIG.json (started by gradcompress netbench)",
              file=sys.stderr)
        return 2
    _worker(hosts.worker_config(argv[1]))
    return 0


if __name__ == "__main__":
    sys.exit(worker_main(sys.argv[1:]))
