"""``gradcompress netbench``: step time and real interface bytes per scheme over emulated, shaped links.

Builds ``--workers`` test hosts as Linux network namespaces on one bridge, each host's link
shaped with ``tc`` (``tbf`` at ``--bandwidth`` in each direction, ``netem`` delay for
``--latency``; see :mod:`gradcompress.netns`), and starts one worker per host with
``ip netns exec HOST python -m gradcompress.cli.netbench --worker CONFIG``. The workers
form a gloo process group exactly as a multi-node launch does (``init_method=
tcp://HOST0:PORT``, ``GLOO_SOCKET_IFNAME`` the host's veth), so every byte between them
crosses the shaped links (the hosts, the workers and the teardown: :mod:`gradcompress.testbed`).
Needs root and iproute2; everything (namespaces, links, processes) is removed on exit, on
error, on Ctrl-C and on SIGTERM, and a namespace left by a run that was killed outright is
removed by the next run.

Nodes (``--nodes N --workers-per-node G``): N namespaces, each a node with one shaped uplink and G workers
(ranks in consecutive blocks of G, torchrun's ``GROUP_RANK``/``LOCAL_WORLD_SIZE`` set so that the library's default
``topology="auto"`` runs hierarchical; ``SPEC:topology=flat`` runs today's flat exchange beside it). The G workers
bind to the node's veth address, and a connection to one's own namespace's address goes over its loopback, so
intra-node traffic never reaches the uplink's tx counter (:mod:`gradcompress.testbed`). Reported per scheme: the
uplink's bytes per node and step next to the node's workers' ``stats()["inter_node_bytes"]`` (the cost model's
uplink count for the PyTorch baselines), and the ratios to ``ddp``, ``torch-fp16`` and the scheme's flat twin;
``ddp-nosend`` is DDP with a hook that sends nothing (the limit).

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

import argparse
import datetime
import json
import math
import os
import statistics
import sys
import time

from ..scheme import DECOUPLED, ONEBITADAM, Scheme, parse_scheme
from . import netbench_fsdp
from .common import CLIError, human_bytes, one_line, positive_int, split_schemes, table_lines

MODELS = ("mlp", "mlp8m", "cnn", "tiny", "lm")
#: the MLPs' layer widths
MLP_DIMS = {"mlp": (1024, 2048, 2048, 2048, 1024), "mlp8m": (1024, 2048, 2048, 1024)}
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
MAX_NODE_WORKERS = 16


# --------------------------------------------------------------------------- models
def build_model(name: str, seed: int = 0):
    """The benchmark models: ``mlp`` 12.6M parameters (1024-2048-2048-2048-1024, communication-bound), ``mlp8m``
    8.4M (1024-2048-2048-1024),
    ``cnn`` a small convolutional net on 3x32x32 inputs (0.39M, compute-bound), ``tiny`` 85K (tests)."""
    import torch
    import torch.nn as nn

    torch.manual_seed(seed)
    if name in MLP_DIMS:
        dims = MLP_DIMS[name]
        layers = []
        for a, b in zip(dims, dims[1:]):
            layers += [nn.Linear(a, b), nn.ReLU()]
        return nn.Sequential(*layers[:-1])
    if name == "tiny":
        return nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 10))
    if name == "lm":
        from .lm import make_model

        return make_model(seed)
    if name == "cnn":
        return nn.Sequential(
            nn.Conv2d(3, 32, 3, padding=1), nn.ReLU(),
            nn.Conv2d(32, 64, 3, stride=2, padding=1), nn.ReLU(),
            nn.Conv2d(64, 128, 3, stride=2, padding=1), nn.ReLU(),
            nn.Conv2d(128, 256, 3, stride=2, padding=1), nn.ReLU(),
            nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(256, 10))
    raise ValueError(f"unknown model {name!r}; models: {', '.join(MODELS)}")


def model_shapes(name: str) -> list[tuple[int, ...]]:
    """Parameter shapes of a benchmark model, in model order (what ``plan --model`` uses)."""
    return [tuple(p.shape) for p in build_model(name).parameters()]


def _batch(name: str, batch_size: int, rank: int):
    import torch

    g = torch.Generator().manual_seed(1000 + rank)
    if name in MLP_DIMS:
        return torch.randn(batch_size, 1024, generator=g), torch.randn(batch_size, 1024, generator=g)
    if name == "tiny":
        return torch.randn(batch_size, 64, generator=g), torch.randint(0, 10, (batch_size,), generator=g)
    if name == "lm":
        from .lm import CONTEXT

        data = torch.randint(0, 256, (batch_size // 2 or 1, CONTEXT + 1), generator=g)
        return data[:, :-1], data[:, 1:]
    return torch.randn(batch_size, 3, 32, 32, generator=g), torch.randint(0, 10, (batch_size,), generator=g)


def _loss(name: str, out, y):
    import torch.nn.functional as F

    if name == "lm":
        return F.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1))
    return F.mse_loss(out, y) if name in MLP_DIMS else F.cross_entropy(out, y)


# --------------------------------------------------------------------------- arguments
def _workers(text: str) -> int:
    v = positive_int(text)
    if not 2 <= v <= 8:
        raise argparse.ArgumentTypeError(f"expected 2 to 8 workers, got {text!r}")
    return v


def _rate(text: str) -> float:
    from ..costmodel import parse_rate

    try:
        return parse_rate(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


def _duration(text: str) -> float:
    from ..costmodel import parse_duration

    try:
        return parse_duration(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


def add_parser(sub) -> argparse.ArgumentParser:
    from ..costmodel import DEFAULT_SCHEMES

    p = sub.add_parser(
        "netbench", help="step time and real interface bytes per scheme over emulated shaped links (root)",
        description="Emulate --workers hosts as network namespaces on a bridge, shape each host's link with tc "
                    "(tbf for --bandwidth, netem for --latency), run one gloo worker per host and measure, per "
                    "scheme: median step time, bytes each host's interface transmitted per step next to "
                    "Compressor.stats() wire bytes, and the speed-up over plain DDP. Needs root and iproute2 "
                    "(ip, tc); removes every namespace, link and process it made on exit, error, Ctrl-C or "
                    "SIGTERM.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="Schemes: ddp (DistributedDataParallel, no hook), torch-fp16 (PyTorch's fp16_compress_hook), "
               "torch-powersgd[:rank=R] (PyTorch's powerSGD_hook, start_powerSGD_iter=2, run with ONE bucket "
               "because it deadlocks on gloo with several), or any gradcompress codec spec (our Compressor as "
               "the DDP hook). Specs contain commas: separate schemes with ';'.\n"
               "Default schemes: " + "; ".join(DEFAULT_SCHEMES) + "\n"
               "examples:\n"
               "  sudo gradcompress netbench --workers 4 --bandwidth 1gbit --model mlp\n"
               "  sudo gradcompress netbench --workers 2 --bandwidth 100mbit --schemes 'ddp;int8;topk:ratio=0.01' "
               "--json\n"
               "  sudo gradcompress netbench --nodes 2 --workers-per-node 4 --bandwidth 100mbit --schemes ddp "
               "torch-fp16 ddp-nosend int8 int8:topology=flat\n"
               "ddp-nosend: DDP with a hook that sends nothing (the limit). With --nodes, codec specs run the "
               "library's default topology (auto: hierarchical across the nodes); add topology=flat for today's "
               "flat exchange. Node-mode default schemes: " + "; ".join(NODE_SCHEMES) + "\n"
               "Models: mlp (12.6M parameters, communication-bound), mlp8m (8.4M), cnn (0.39M, compute-bound), tiny (85K).")
    p.add_argument("--workers", type=_workers, default=None,
                   help="emulated hosts, one worker each: 2 to 8 (default 4; not with --nodes)")
    p.add_argument("--nodes", type=_workers, default=None, metavar="N",
                   help="emulated nodes (2 to 8), each a namespace with one shaped uplink and --workers-per-node "
                        "workers talking over the namespace's loopback")
    p.add_argument("--workers-per-node", type=positive_int, default=None, metavar="G",
                   help=f"workers per node with --nodes (default 1; N x G at most {MAX_NODE_WORKERS})")
    p.add_argument("--bandwidth", type=_rate, default=_rate("1gbit"), metavar="RATE",
                   help="link rate per host and direction, tc notation: 100mbit, 1gbit, 10gbit (default 1gbit)")
    p.add_argument("--latency", type=_duration, default=0.0, metavar="TIME",
                   help="one-way delay added on each host's egress with netem, e.g. 1ms (default 0: none; "
                        "needs the netem qdisc in the kernel)")
    p.add_argument("--model", choices=MODELS, default="mlp", help="model (default mlp)")
    p.add_argument("--schemes", action="extend", nargs="+", metavar="SPEC",
                   help="schemes (';'-separated and/or repeated); default: the list below")
    p.add_argument("--steps", type=positive_int, default=10, help="timed steps per scheme (default 10)")
    p.add_argument("--warmup", type=positive_int, default=MIN_WARMUP,
                   help=f"untimed steps before them, at least {MIN_WARMUP} (default {MIN_WARMUP}; the first "
                        f"{COMPRESSOR_WARMUP} are dense)")
    p.add_argument("--batch-size", type=positive_int, default=32, help="examples per worker per step (default 32)")
    p.add_argument("--threads", type=positive_int, default=None,
                   help="torch threads per worker (default: CPU cores / workers, at least 1)")
    p.add_argument("--timeout", type=positive_int, default=900,
                   help="seconds before the whole run is stopped (default 900)")
    p.add_argument("--fsdp", action="store_true",
                   help="FSDP2 mode: the model sharded with fully_shard (every layer and the root); the baseline "
                        "'fsdp' is uncompressed FSDP, codec specs compress its reduce-scatter "
                        "(gradcompress.register_fsdp). Default schemes: " + "; ".join(FSDP_SCHEMES))
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.set_defaults(run=run)
    return p


# --------------------------------------------------------------------------- schemes
def check_schemes(texts: list[str], fsdp: bool = False, nodes: bool = False) -> list[str]:
    """Every scheme checked (:func:`gradcompress.scheme.parse_scheme`), as the run names it; ``CLIError``
    (one line) for the first that netbench cannot run."""
    return [_check_scheme(t, fsdp, nodes) for t in texts]


def _check_scheme(text: str, fsdp: bool, nodes: bool = False) -> str:
    """One scheme of :func:`check_schemes`: the FSDP baseline, a PyTorch baseline, a codec spec or ``codec:diloco=H``
    (``fsdp`` with ``nodes``: :func:`gradcompress.cli.netbench_fsdp.check`)."""
    if fsdp and nodes:
        return netbench_fsdp.check(text)
    if fsdp and text.strip() == FSDP_BASELINE:
        return FSDP_BASELINE
    if text.strip() == NOSEND:
        if fsdp:
            raise CLIError(f"{NOSEND} is a DDP scheme; it does not combine with --fsdp")
        return NOSEND
    try:
        scheme = parse_scheme(text)
        if scheme.kind in (ONEBITADAM, DECOUPLED):
            raise CLIError(_unknown_scheme(text))
        if scheme.compressed_adam:
            raise ValueError(f"{scheme.text}: compressed_adam=true trains with CompressedAdam, which netbench does "
                             "not run; netbench runs DDP schemes, codec specs and codec:diloco=H")
        if scheme.diloco:
            if fsdp:
                raise ValueError("DiLoCo schemes do not combine with --fsdp")
            if scheme.outer == "sparseloco":
                raise ValueError(f"{scheme.text}: netbench runs DiLoCo with its Nesterov outer update; "
                                 "outer=sparseloco runs in demo and train")
            return scheme.text
        if fsdp:
            _check_fsdp_scheme(scheme)
        return scheme.text
    except (ValueError, TypeError) as err:
        msg = one_line(err)
        raise CLIError(_unknown_scheme(text) if "unknown codec" in msg else msg) from None


def _unknown_scheme(text: str) -> str:
    import gradcompress

    return (f"unknown scheme {text.partition(':')[0].strip()!r}; valid: ddp, torch-fp16, torch-powersgd, "
            f"{', '.join(gradcompress.available())}")


def _check_fsdp_scheme(scheme: Scheme) -> None:
    """In FSDP mode only our codecs (not PowerSGD) and the 'fsdp' baseline apply."""
    from ..adapters.fsdp import check_codec

    if scheme.kind != "ours":
        raise ValueError(f"--fsdp: {scheme.text!r} is a DDP scheme; in FSDP mode the baseline is {FSDP_BASELINE!r} "
                         "and the others are gradcompress codec specs")
    check_codec(scheme.codec)


def _diloco_h(text: str) -> int:
    """H of a DiLoCo scheme (``int4:diloco=25``), else 0 (``text`` passed :func:`check_schemes`)."""
    if text in (FSDP_BASELINE, NOSEND) or text in netbench_fsdp.BASELINES or netbench_fsdp.has_options(text):
        return 0
    return parse_scheme(text).diloco or 0


# --------------------------------------------------------------------------- the parent
def run(args: argparse.Namespace) -> int:
    from .. import netns
    from ..costmodel import DEFAULT_SCHEMES

    why = netns.problem()
    if why:
        raise CLIError(why)
    hosts, per_node = layout(args)
    nodes = per_node > 1
    defaults = (netbench_fsdp.NODE_FSDP_SCHEMES if nodes else FSDP_SCHEMES) if args.fsdp else \
        NODE_SCHEMES if args.nodes else DEFAULT_SCHEMES
    schemes = check_schemes(split_schemes(args.schemes) if args.schemes else list(defaults), args.fsdp, nodes)
    if not schemes:
        raise CLIError("--schemes is empty")
    if args.warmup < MIN_WARMUP:
        raise CLIError(f"--warmup must be at least {MIN_WARMUP} (2 dense steps, then at least one compressed "
                       f"step before timing)")
    stale = netns.cleanup_stale()
    if stale:
        print(f"netbench: removed {len(stale)} namespace(s) left by a crashed run: {', '.join(stale)}",
              file=sys.stderr)
    if args.latency > 0 and not netns.netem_available():
        raise CLIError("--latency needs the netem qdisc, which this kernel lacks (CONFIG_NET_SCH_NETEM); "
                       "run without --latency")
    result = bench(schemes, hosts, args.bandwidth, args.latency, args.model, args.steps, args.warmup,
                   args.batch_size, args.threads, args.timeout, args.fsdp, per_node)
    if args.json:
        print(json.dumps(result, indent=1, allow_nan=False))
    else:
        print(format_table(result))
    return 0


def layout(args: argparse.Namespace) -> tuple[int, int]:
    """(hosts, workers per host) from ``--workers`` or ``--nodes``/``--workers-per-node``; ``CLIError`` (one line)
    for a mix of the two or too many workers."""
    if args.nodes is None:
        if args.workers_per_node is not None:
            raise CLIError("--workers-per-node goes with --nodes")
        return args.workers or 4, 1
    if args.workers is not None:
        raise CLIError("give either --workers (one worker per host) or --nodes with --workers-per-node, not both")
    per_node = args.workers_per_node or 1
    if args.nodes * per_node > MAX_NODE_WORKERS:
        raise CLIError(f"--nodes x --workers-per-node is {args.nodes * per_node}; at most {MAX_NODE_WORKERS} workers")
    return args.nodes, per_node


def bench(schemes: list[str], workers: int, rate_bit: float, latency_s: float, model: str, steps: int, warmup: int,
          batch_size: int, threads: int | None, timeout: float, fsdp: bool = False, per_node: int = 1) -> dict:
    """Build the testbed (``workers`` hosts, ``per_node`` workers on each), run every scheme on every worker, tear
    everything down; the merged result."""
    from .. import testbed

    threads = threads or max(1, (os.cpu_count() or 1) // (workers * per_node))
    where = f"{workers} nodes x {per_node} workers" if per_node > 1 else f"{workers} hosts"
    print(f"netbench: {where}, {_fmt_rate(rate_bit)}"
          f"{f', {latency_s * 1e3:g} ms delay' if latency_s else ''}, model {model}, "
          f"{len(schemes)} schemes x ({warmup} + {steps}) steps", file=sys.stderr)
    settings = {"model": model, "schemes": schemes, "steps": steps, "warmup": warmup, "batch_size": batch_size,
                "threads": threads, "fsdp": fsdp, "collective_timeout": max(60.0, min(timeout, 600.0))}
    try:
        records = testbed.run_workers(
            workers, settings, module="gradcompress.cli.netbench", rate_bit=rate_bit, delay_s=latency_s,
            timeout=timeout, env={"OMP_NUM_THREADS": str(threads)}, label="netbench",
            timeout_hint=" (raise --timeout, or fewer --steps/--schemes at low --bandwidth)", workers_per_node=per_node)
    except testbed.TestbedError as err:
        raise CLIError(str(err)) from None
    return merge(records, schemes, workers * per_node, rate_bit, latency_s, model, steps, warmup, batch_size, threads,
                 fsdp, per_node)


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
        "buckets": recs[0]["buckets"],
        "error_feedback": recs[0]["error_feedback"],
        "final_loss": recs[0]["loss"],
        **_node_figures(text, recs, shapes, workers, per_node, n),
    }


def _node_figures(text: str, recs: list[dict], shapes: list[tuple], workers: int, per_node: int, n: int) -> dict:
    """Per node and step: the uplink's tx bytes (read by the node's local rank 0; every worker of the node reads
    the same counter), the sum of its workers' ``stats()["inter_node_bytes"]`` (ours; for the PyTorch baselines
    the cost model's count of what crosses the uplink, marked ``model``), and the topology ours ran."""
    from ..costmodel import node_uplink_bytes, parse_scheme as cost_scheme

    nodes = workers // per_node
    uplink = [recs[k * per_node]["iface_tx_bytes"] / n for k in range(nodes)]
    if recs[0].get("inter_node_bytes") is not None:
        inter = [sum(r["inter_node_bytes"] for r in recs[k * per_node:(k + 1) * per_node]) / n for k in range(nodes)]
        source = "stats"
    elif text == NOSEND:
        inter, source = [0.0] * nodes, "model"
    elif _diloco_h(text) or text in netbench_fsdp.BASELINES:
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
    from ..costmodel import parse_scheme as cost_scheme, wire_bytes

    if h:
        return "diloco", None
    if text == NOSEND:
        return NOSEND, 0
    if text == FSDP_BASELINE:
        return "fsdp", (workers - 1) * 4 * sum(math.ceil(s[0] / workers) * math.prod(s[1:]) for s in shapes)
    if text in netbench_fsdp.BASELINES or netbench_fsdp.has_options(text):  # FSDP on nodes: no model
        return "fsdp", None
    scheme = cost_scheme(text)
    return scheme.kind, wire_bytes(scheme, shapes, workers, bucket_cap)


def _effective_bandwidth(records: list[dict], workers: int) -> float | None:
    """Payload bytes/s per host implied by the 8 MB all-reduce: 2(W-1)/W M / (t - 2(W-1) alpha)."""
    small = max(r["allreduce_small_s"] for r in records)
    big = max(r["allreduce_8mb_s"] for r in records)
    t = big - small
    return 2 * (workers - 1) / workers * 8 * 2**20 / t if t > 0 else None


def flat_twin(text: str) -> str | None:
    """The ``topology=flat`` variant of a codec scheme (None for the others): what its hierarchical row is set
    beside."""
    if text in (NOSEND, FSDP_BASELINE):
        return None
    scheme = parse_scheme(text)
    if scheme.kind != "ours" or "topology" in scheme.compressor:
        return None
    return text + ("," if ":" in text else ":") + "topology=flat"


def node_ratios(result: dict) -> dict:
    """Per scheme: its uplink bytes over DDP's and over torch-fp16's, and a hierarchical scheme's over its own
    ``topology=flat`` variant's (None where that row was not run)."""
    rows = {r["scheme"]: r for r in result["schemes"]}
    up = {name: r["uplink_tx_bytes_per_step"] for name, r in rows.items()}

    def over(name, base):
        return up[name] / up[base] if base in up and up[base] else None

    return {name: {"x_ddp": over(name, "ddp"), "x_fp16": over(name, "torch-fp16"),
                   "x_flat": over(name, flat_twin(name)) if flat_twin(name) else None} for name in rows}


def format_node_table(result: dict) -> str:
    """The --nodes report: per scheme the topology it ran, step time, speed-up, each node's uplink bytes (its tx
    counter) next to the node's workers' ``inter_node_bytes``, and the uplink ratios to DDP, fp16 and its flat twin."""
    ratios = node_ratios(result)

    def ratio(v):
        return "-" if v is None else f"{v:.3f}"

    rows = [("scheme", "topology", "step ms", "speed-up", "uplink B/node/step", "inter_node_bytes/node",
             "x DDP", "x fp16", "x own flat")]
    for r in result["schemes"]:
        inter = r["inter_node_bytes_per_step_by_node"]
        mark = " (model)" if r["inter_node_bytes_source"] == "model" else ""
        rows.append((r["scheme"], r["topology"] or ("-" if r["kind"] == NOSEND else "flat (DDP)"),
                     f"{1e3 * r['median_step_s']:.0f}", "n/a" if r["speedup"] is None else f"{r['speedup']:.2f}x",
                     " / ".join(human_bytes(b) for b in r["uplink_tx_bytes_per_step_by_node"]),
                     "n/a" if inter[0] is None else human_bytes(statistics.fmean(inter)) + mark,
                     ratio(ratios[r["scheme"]]["x_ddp"]), ratio(ratios[r["scheme"]]["x_fp16"]),
                     ratio(ratios[r["scheme"]]["x_flat"])))
    lines = [f"{result['nodes']} nodes x {result['workers_per_node']} workers, uplinks at "
             f"{_fmt_rate(result['bandwidth_bit'])}; model {result['model']} ({result['params']:,} parameters), batch "
             f"{result['batch_size']}; median of {result['steps']} steps after {result['warmup']}; "
             f"{result['threads_per_worker']} thread(s) per worker on {result['cpu_count']} CPUs; compute alone "
             f"{1e3 * result['compute_s']:.0f} ms/step"]
    lines += table_lines(rows)
    lines.append("uplink: bytes each node's veth transmitted per step (its tx counter; one value per node); "
                 "inter_node_bytes: the node's workers' Compressor.stats()['inter_node_bytes'] summed (flat: every "
                 "byte, also those to the node's own workers, which stay on its loopback); '(model)': the cost "
                 "model's uplink count for a PyTorch baseline; x DDP / x fp16 / x own flat: uplink bytes over "
                 "those of ddp, torch-fp16 and the scheme's topology=flat row")
    return "\n".join(lines)


def format_table(result: dict) -> str:
    if result.get("workers_per_node", 1) > 1 and result.get("fsdp"):
        return netbench_fsdp.format_table({**result, "rate_text": _fmt_rate(result["bandwidth_bit"])})
    if result.get("workers_per_node", 1) > 1:
        return format_node_table(result)
    head = ("scheme", "step ms", "speed-up", "iface B/step", "wire B/step", "iface/wire", "codec ms", "wait ms",
            "buckets")
    rows = [head]
    for r in result["schemes"]:
        wire = human_bytes(r["wire_bytes_per_step"]) + (" (model)" if r["wire_bytes_source"] == "model" else "")
        rows.append((r["scheme"], f"{1e3 * r['median_step_s']:.1f}",
                     "n/a" if r["speedup"] is None else f"{r['speedup']:.2f}x",
                     human_bytes(r["iface_tx_bytes_per_step"]), wire,
                     "n/a" if r["iface_over_wire"] is None else f"{r['iface_over_wire']:.3f}",
                     "-" if r["codec_s_per_step"] is None else f"{1e3 * r['codec_s_per_step']:.1f}",
                     "-" if r.get("wait_s_per_step") is None else f"{1e3 * r['wait_s_per_step']:.1f}",
                     str(r["buckets"])))
    lat = f", {result['latency_s'] * 1e3:g} ms one-way delay" if result["latency_s"] else ""
    mode = "FSDP2 (fully_shard per layer and root), " if result.get("fsdp") else ""
    lines = [f"{mode}{result['workers']} hosts at {_fmt_rate(result['bandwidth_bit'])}{lat}; model {result['model']} "
             f"({result['params']:,} parameters), batch {result['batch_size']}; median of {result['steps']} steps "
             f"after {result['warmup']}; {result['threads_per_worker']} thread(s) per worker on "
             f"{result['cpu_count']} CPUs; compute alone {1e3 * result['compute_s']:.1f} ms/step (one worker alone: "
             f"{1e3 * result['compute_solo_s']:.1f} ms, x{result['contention']:.2f}), DDP with a hook that "
             f"sends nothing {1e3 * result['ddp_floor_s']:.1f} ms/step; 4-byte all-reduce "
             f"{1e3 * result['allreduce_small_s']:.2f} ms; 8 MB all-reduce at "
             f"{human_bytes(result['allreduce_payload_bandwidth'])}/s payload per host"]
    lines += table_lines(rows)
    lines.append(f"speed-up: over {result['baseline'] or 'n/a'}; iface: bytes each host's veth transmitted per "
                 "step (mean over hosts); wire: Compressor.stats() wire_bytes per step, '(model)': the same ring "
                 "count computed for a PyTorch baseline; codec / wait: Compressor.stats() codec_seconds / "
                 "comm_seconds (waiting on collectives after the backward pass) per step")
    if any(r["kind"] == "diloco" for r in result["schemes"]):
        lines.append("DiLoCo schemes (codec:diloco=H): the MEAN step time over whole intervals of H steps (H-1 "
                     "local SGD steps and one with the outer exchange; one untimed interval first); bytes per step "
                     "likewise averaged")
    if any(r["kind"] == "torch-powersgd" for r in result["schemes"]):
        lines.append(f"torch-powersgd ran with ONE bucket (bucket_cap_mb={result['torch_powersgd_bucket_cap_mb']}): "
                     "PyTorch's powerSGD_hook deadlocks on gloo with more than one bucket")
    return "\n".join(lines)


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
        _loss(name, net(x), y).backward()
        opt.step()
        if k >= skip:
            times.append(time.perf_counter() - start)
    return statistics.median(times)


def _worker(cfg: dict) -> None:
    """One host's part of the run: the machine's figures, then every scheme; the result for :func:`merge`."""
    import torch
    import torch.distributed as dist

    from .. import testbed

    rank, world = cfg["rank"], cfg["world"]
    torch.set_num_threads(cfg["threads"])
    dist.init_process_group("gloo", init_method=f"tcp://{cfg['master']}:{cfg['port']}", rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=cfg["collective_timeout"]))
    name = cfg["model"]
    x, y = _batch(name, cfg["batch_size"], rank)
    shapes = [list(p.shape) for p in build_model(name).parameters()]
    one_bucket_mb = int(sum(4 * math.prod(s) for s in shapes) / 2**20) + 2
    figures = _machine_figures(name, x, y, rank)
    records = [_scheme_record(cfg, i, text, x, y, one_bucket_mb) for i, text in enumerate(cfg["schemes"])]
    testbed.write_result(cfg, {"rank": rank, **figures, "shapes": shapes, "one_bucket_cap_mb": one_bucket_mb,
                               "schemes": records})
    dist.barrier()
    dist.destroy_process_group()


def _machine_figures(name: str, x, y, rank: int) -> dict:
    """Compute alone (every worker at once, and rank 0 alone), a DDP step that sends nothing, and the
    network as gloo sees it (a 4-byte and an 8 MB all-reduce)."""
    import torch

    model = build_model(name)
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
            _loss(name, model(x), y).backward()
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

    model = build_model(name)
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


def _scheme_record(cfg: dict, i: int, text: str, x, y, one_bucket_mb: int) -> dict:
    """Set up scheme ``text`` on a fresh model, take the warm-up and the timed steps; this rank's record."""
    import torch
    import torch.distributed as dist

    name = cfg["model"]
    model = build_model(name)
    h = _diloco_h(text)
    net, comp, ef, cap_mb, opt = _setup(cfg, model, text, h, one_bucket_mb)
    opt = opt or torch.optim.SGD(model.parameters(), lr=1e-3)

    def step() -> float:
        opt.zero_grad(set_to_none=True)
        loss = _loss(name, net(x), y)
        loss.backward()
        opt.step()
        return loss.item()

    warmup, timed = cfg["warmup"], cfg["steps"]
    if h:  # whole intervals: one untimed, then the timed steps rounded up to whole intervals
        warmup, timed = h, h * -(-timed // h)
    record = _timed_steps(cfg["ifname"], step, comp, warmup, timed)
    record.update(scheme=text, buckets=_bucket_count(cfg, model, net, h), error_feedback=ef,
                  bucket_cap_bytes=None if cap_mb is None else cap_mb * 2**20)
    if cfg["rank"] == 0:
        print(f"netbench: [{i + 1}/{len(cfg['schemes'])}] {text}: "
              f"{1e3 * statistics.median(record['step_seconds']):.1f} ms/step (median), "
              f"{record['iface_tx_bytes'] / timed / 1e6:.2f} MB/step sent by host 0", file=sys.stderr, flush=True)
    del net, comp, opt, model
    dist.barrier()
    return record


def _timed_steps(ifname: str, step, comp, warmup: int, timed: int) -> dict:
    """``warmup`` untimed steps, then ``timed`` timed ones: their times, the interface's bytes and the
    Compressor's counters over them, the last loss."""
    import torch.distributed as dist

    from ..testbed import read_tx_bytes

    for _ in range(warmup):
        step()
    dist.barrier()  # every earlier byte has crossed the links (peers received it)
    time.sleep(0.05)  # and the last ACKs too
    tx0 = read_tx_bytes(ifname)
    st0 = comp.stats() if comp else None
    step_times = []
    loss = float("nan")
    for _ in range(timed):
        start = time.perf_counter()
        loss = step()
        step_times.append(time.perf_counter() - start)
    st1 = comp.stats() if comp else None
    # a collective is complete here once its bytes are in the socket buffers, not yet through the shaped
    # link: wait until every peer has received everything (a barrier: ~100 bytes) before reading tx_bytes
    dist.barrier()
    time.sleep(0.05)
    tx1 = read_tx_bytes(ifname)

    def delta(key):
        return None if comp is None else st1[key] - st0[key]

    return {"step_seconds": step_times, "iface_tx_bytes": tx1 - tx0, "wire_bytes": delta("wire_bytes"),
            "inter_node_bytes": delta("inter_node_bytes"), "intra_node_bytes": delta("intra_node_bytes"),
            "param_bytes": delta("param_bytes"),
            "topology": None if comp is None else st1["topology"]["kind"],
            "codec_seconds": delta("codec_seconds"), "comm_seconds": delta("comm_seconds"),
            "loss": loss if math.isfinite(loss) else None}


def _bucket_count(cfg: dict, model, net, h: int) -> int:
    """Buckets a step of the scheme sends: DiLoCo 0 (one outer exchange of every parameter per interval),
    FSDP its sharded modules, DDP its (rebuilt) buckets."""
    if h:
        return 0
    if cfg.get("fsdp"):
        return sum(1 for m in model.modules() if any(True for _ in m.parameters(recurse=False)))
    logging = net._get_ddp_logging_data()
    sizes = str(logging.get("rebuilt_bucket_sizes") or logging.get("bucket_sizes") or "")
    return len([s for s in sizes.split(",") if s.strip()])


def _setup(cfg: dict, model, text: str, h: int, one_bucket_mb: int):
    """The model wrapped for scheme ``text``: (net, Compressor or None, error feedback, bucket cap in MB or
    None, optimizer or None for plain SGD)."""
    if cfg.get("fsdp") and cfg.get("workers_per_node", 1) > 1:
        nodes = cfg["world"] // cfg["workers_per_node"]
        return (*netbench_fsdp.setup(model, text, nodes, cfg["workers_per_node"], COMPRESSOR_WARMUP), None, None)
    if cfg.get("fsdp"):
        return (*_fsdp_setup(model, text), None)
    if text == NOSEND:
        return _nosend_setup(model)
    if h:
        return _diloco_setup(model, parse_scheme(text))
    return (*_ddp_setup(model, parse_scheme(text), one_bucket_mb), None)


def _ddp_setup(model, scheme: Scheme, one_bucket_mb: int):
    """DDP with the scheme's hook: PyTorch's for the baselines (powerSGD_hook with one bucket), ours otherwise."""
    import torch.nn as nn

    import gradcompress
    from ..costmodel import default_error_feedback

    cap_mb = one_bucket_mb if scheme.kind == "torch-powersgd" else None
    ddp = nn.parallel.DistributedDataParallel(model, bucket_cap_mb=cap_mb)
    comp = None
    if scheme.kind == "torch-fp16":
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

        ddp.register_comm_hook(None, default_hooks.fp16_compress_hook)
    elif scheme.kind == "torch-powersgd":
        from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook

        state = powerSGD_hook.PowerSGDState(process_group=None, matrix_approximation_rank=scheme.rank,
                                            start_powerSGD_iter=2)
        ddp.register_comm_hook(state, powerSGD_hook.powerSGD_hook)
    elif scheme.kind == "ours":
        comp = gradcompress.Compressor(scheme.codec, **{"warmup_steps": COMPRESSOR_WARMUP,
                                                        "error_feedback": default_error_feedback(scheme),
                                                        "seed": 0, **scheme.compressor})
        comp.register(ddp)
    return ddp, comp, default_error_feedback(scheme), cap_mb


def _nosend_setup(model):
    """The limit of every scheme: DDP whose hook sends nothing (DDP's own copies and bookkeeping only)."""
    import torch.nn as nn

    ddp = nn.parallel.DistributedDataParallel(model)
    ddp.register_comm_hook(None, _no_communication_hook)
    return ddp, None, False, None, None


def _fsdp_setup(model, text: str):
    """FSDP mode: shard every layer that holds parameters, then the root; compress unless the baseline."""
    from torch.distributed.fsdp import fully_shard

    import gradcompress

    for m in list(model.modules())[1:]:
        if any(True for _ in m.parameters(recurse=False)):
            fully_shard(m)
    fully_shard(model)
    if text == FSDP_BASELINE:
        return model, None, None, None
    comp = gradcompress.register_fsdp(model, text, warmup_steps=COMPRESSOR_WARMUP, seed=0)
    return model, comp, comp.error_feedback, None


def _diloco_setup(model, scheme: Scheme):
    """DiLoCo over plain SGD (lr 1e-3, as the other schemes' optimizer), the outer gradient through the codec
    (with the scheme's ``error_feedback``, as ``gradcompress train`` runs it)."""
    import torch

    from ..optim import DiLoCo

    opt = DiLoCo(model, torch.optim.SGD(model.parameters(), lr=1e-3), sync_every=scheme.diloco, codec=scheme.codec,
                 error_feedback=scheme.compressor.get("error_feedback", "auto"))
    return model, opt.compressor, opt.compressor.error_feedback, None, opt


def worker_main(argv: list[str]) -> int:
    from ..testbed import worker_config

    if len(argv) != 2 or argv[0] != "--worker":
        print("usage: python -m gradcompress.cli.netbench --worker CONFIG.json (started by gradcompress netbench)",
              file=sys.stderr)
        return 2
    _worker(worker_config(argv[1]))
    return 0


if __name__ == "__main__":
    sys.exit(worker_main(sys.argv[1:]))
