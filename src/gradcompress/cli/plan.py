"""``gradcompress plan``: predict the step time of every scheme on a given network, before running anything.

The model is :mod:`gradcompress.costmodel`: the bytes and rounds of collectives each scheme
sends, recorded from one real step of the Compressor on the model's tensors in DDP's buckets
(``costmodel.record_step``: a recording stand-in for the group, so ``plan`` and ``stats()``
count the same bytes), timed with alpha-beta costs, communication overlapping the backward
pass. Its per-element codec
costs come from a short calibration on this machine with ``--threads`` torch threads (1,
as ``netbench``'s workers on 2 cores): our Compressor's exchange of the model's own tensors
in its DDP buckets with the collectives replaced by local stand-ins, timed phase by phase
(the hook's work, the work after each round; the fastest of 3 steps after one), per
compressed element; and, for the pass-count fallback and the PyTorch hooks, ``encode`` /
``decode`` of each codec on ``--calibration-numel`` elements and one elementwise pass,
scaled linearly. ``--calibration FILE`` saves it (or reuses a saved one). Prints,
per scheme, the bytes each worker sends per step, communication and codec time, the
predicted step time and the speed-up over uncompressed DDP, and which schemes pay off; every number with its unit.
``--auto``: the plan the autopilot would keep (:func:`gradcompress.costmodel.predict_auto`) and its steady step timed
as the fixed rows, so a plan of one codec reads that codec's row; its one-off measuring steps are stated apart.

The model's tensors: ``--model`` (a ``netbench`` model, exact shapes) or ``--params P``
(P elements as ``--matrix-side`` square matrices, 2048 by default, smaller for a model that does not hold one:
the largest square it holds; the table's first line states the shapes assumed). ``--compute-ms``: one step of one worker
without communication, best measured under DDP with a hook that sends nothing (``netbench``
reports it), so that DDP's own copies are in it; 2/3 of it is the backward pass that
communication can hide under. ``--per-message-us``: the software cost of one message step
(``netbench`` measures a 4-byte all-reduce, 2(W-1) steps). ``--cores K``:
the workers share K cores (as in ``netbench`` on one machine), so codec work is slowed
by max(1, workers x threads / K), and the calibration runs in min(K, workers) processes at
once (busy cores also share memory bandwidth and caches).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import statistics
import sys
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from .common import RATE_HELP, CLIError, _checked, human_bytes, one_line, positive_float, positive_int, split_schemes, table_lines

if TYPE_CHECKING:
    from ..costmodel import AutoPrediction, Prediction, Speeds

CALIBRATION_NUMEL = 4 * 1024 * 1024
MATRIX_ROWS = 2048
#: ``--params``: the side of the square matrices assumed (smaller where the model holds fewer parameters)
MATRIX_SIDE = 2048


_nonnegative_float = _checked(float, lambda v: v >= 0, "a number >= 0")


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> argparse.ArgumentParser:
    from ..costmodel import DEFAULT_SCHEMES, FRAMING_EFFICIENCY, INTRA_NODE_RATE_BIT, SOFTWARE_ALPHA
    from ..testbed.models import MODELS
    from .common import rate as _rate
    from .netbench import _duration

    p = sub.add_parser(
        "plan", help="predict step time per scheme for a model size, worker count and network (alpha-beta model)",
        description="Predict, per scheme, the bytes each worker sends, the communication and codec time and the "
                    "step time of data-parallel training, with an alpha-beta model of the collectives each scheme "
                    "uses and codec speeds measured on this machine by a short calibration; say which schemes "
                    "pay off against uncompressed DDP and by how much.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="examples:\n"
               "  gradcompress plan --params 25e6 --workers 8 --bandwidth 10gbit --latency 50us --compute-ms 120\n"
               "  gradcompress plan --model mlp --workers 4 --bandwidth 1gbit --compute-ms 60 --cores 2\n"
               "  gradcompress plan --params 25e6 --nodes 4 --workers-per-node 8 --bandwidth 10gbit --compute-ms 120\n"
               "Schemes as in 'gradcompress netbench' (ddp, torch-fp16, torch-powersgd[:rank=R], or codec specs, "
               "';'-separated). Default: " + "; ".join(DEFAULT_SCHEMES))
    size = p.add_mutually_exclusive_group(required=True)
    size.add_argument("--params", type=positive_float, metavar="P", help="number of parameters (e.g. 12.6e6)")
    size.add_argument("--model", choices=MODELS, help="a netbench model (its exact tensor shapes)")
    layout = p.add_mutually_exclusive_group(required=True)
    layout.add_argument("--workers", type=positive_int, default=None, metavar="N",
                        help="data-parallel workers, each behind its own link (required, or give --nodes)")
    layout.add_argument("--nodes", type=positive_int, default=None, metavar="N",
                        help="nodes of --workers-per-node workers sharing one uplink (--bandwidth); plan then shows "
                             "each scheme flat and hierarchical and says which pays")
    p.add_argument("--workers-per-node", type=positive_int, default=None, metavar="G",
                   help="workers per node with --nodes (default 1)")
    p.add_argument("--intra-bandwidth", type=_rate, default=INTRA_NODE_RATE_BIT, metavar="RATE",
                   help=f"with --nodes: the link between the workers of a node, per direction (default "
                        f"{INTRA_NODE_RATE_BIT / 1e9:g}gbit = {INTRA_NODE_RATE_BIT / 8e9:g} GB/s, NVLink-class; "
                        "PCIe 4.0 x16 is about 250gbit)")
    p.add_argument("--bandwidth", type=_rate, required=True, metavar="RATE",
                   help=f"link rate per worker (with --nodes: per node uplink) and direction, in {RATE_HELP}")
    p.add_argument("--latency", type=_duration, default=0.0, metavar="TIME",
                   help="one-way latency, e.g. 1ms (default 0); each message step also costs "
                        f"--per-message-us (default {SOFTWARE_ALPHA * 1e6:g} us)")
    p.add_argument("--compute-ms", type=_nonnegative_float, default=100.0, metavar="C",
                   help="one training step without communication, ms: forward + backward + optimizer step, "
                        "ideally under DDP with a hook that sends nothing (netbench reports it) (default 100)")
    p.add_argument("--schemes", action="extend", nargs="+", metavar="SPEC", help="schemes (default: the list below)")
    p.add_argument("--cores", type=positive_int, default=None, metavar="K",
                   help="the workers share K CPU cores (netbench on one machine): codec work x workers*threads/K")
    p.add_argument("--contention", type=positive_float, default=None, metavar="X",
                   help="with --cores: the measured slowdown of work when all workers run at once (netbench "
                        "reports it) instead of workers*threads/cores; the calibration then runs alone")
    p.add_argument("--threads", type=positive_int, default=1, help="torch threads per worker (default 1)")
    p.add_argument("--matrix-side", type=positive_int, default=MATRIX_SIDE,
                   help=f"with --params: the tensors are square matrices of this side (default {MATRIX_SIDE}; "
                        "smaller when the model holds fewer parameters: the largest square it holds), the rest one "
                        "matrix of that many rows and a vector; the output states the shapes assumed")
    p.add_argument("--per-message-us", type=_nonnegative_float, default=SOFTWARE_ALPHA * 1e6,
                   help=f"software cost per message step, us (default {SOFTWARE_ALPHA * 1e6:g})")
    p.add_argument("--efficiency", type=positive_float, default=FRAMING_EFFICIENCY,
                   help=f"payload share of the link rate (default {FRAMING_EFFICIENCY:.3f}: TCP/IP/Ethernet headers "
                        "at MTU 1500)")
    p.add_argument("--host-limit", type=_rate, default=None, metavar="RATE",
                   help="the most payload a host's CPU moves through TCP, same notation as --bandwidth (e.g. "
                        "4.5gbit; netbench's 8 MB all-reduce measures it); the link is capped at it (default: none)")
    p.add_argument("--calibration", metavar="FILE", default=None,
                   help="read the codec calibration from FILE (JSON) if it exists and covers the schemes and "
                        "worker count; otherwise calibrate and write it there")
    p.add_argument("--calibration-numel", type=positive_int, default=CALIBRATION_NUMEL,
                   help=f"elements timed per codec in the calibration (default {CALIBRATION_NUMEL})")
    p.add_argument("--auto", nargs="?", const="auto", default=None, metavar="SPEC",
                   help="add the plan 'auto' (or an auto:... spec, e.g. auto:budget=any) would keep per DDP bucket "
                        "for these numbers (its model's plan and its selection among it, dense and one codec "
                        "everywhere, on the fixed rows' costs) and that plan's steady step, timed as the fixed rows "
                        "(a plan of one codec reads that codec's row); the one-off cost of its measuring steps is "
                        "shown apart")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.set_defaults(run=run)
    return p


# --------------------------------------------------------------------------- calibration
def _min_time(fn, repeats: int = 3) -> float:
    """The fastest of ``repeats`` runs after a warm-up (the least disturbed by anything else on the machine)."""
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def calibrate(codecs: list, numel: int = CALIBRATION_NUMEL, threads: int = 1, repeats: int = 3) -> Speeds:
    """Per-element encode/decode costs of ``codecs`` and of one elementwise pass, on this machine."""
    import torch

    from ..costmodel import Speeds

    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        g = torch.Generator().manual_seed(0)
        x = torch.randn(numel, generator=g) * 1e-3
        y = torch.randn(numel, generator=g) * 1e-3
        z = torch.empty_like(x)
        ew = _min_time(lambda: torch.add(x, y, out=z), repeats) / numel
        enc, dec = {}, {}
        for codec in codecs:
            if codec.spec in enc:
                continue
            t = x
            if codec.name == "powersgd":
                cols = max(1, numel // MATRIX_ROWS)
                t = x[: MATRIX_ROWS * cols].view(MATRIX_ROWS, cols)
            payload = codec.encode(t, seed=0)
            # the lambdas are timed at once, in this iteration: no late binding
            enc[codec.spec] = _min_time(lambda: codec.encode(t, seed=0), repeats) / t.numel()  # noqa: B023 - timed now
            dec[codec.spec] = _min_time(lambda: codec.decode(payload), repeats) / t.numel()  # noqa: B023 - timed now
        return Speeds(elementwise=ew, encode=enc, decode=dec)
    finally:
        torch.set_num_threads(old)


def calibrate_phases(codecs: list, workers: int, shapes: list, threads: int = 1, steps: int = 4) -> dict:
    """Seconds per compressed element of each phase of our Compressor's exchange (the hook's work, then the
    work after each round), measured on the model's own tensors (``shapes``) grouped in its DDP buckets,
    with the collectives replaced by local stand-ins: the fastest of ``steps - 1`` steps (after one
    without a residual), summed over the buckets, divided by the elements compressed. Keys:
    ``costmodel.phase_key(codec, workers)``. Drives the Compressor's public step protocol with
    :class:`gradcompress.collectives.LocalCollectives`; a codec whose run fails is left out (pass counts
    are used)."""
    import torch

    import gradcompress
    from .. import collectives
    from .. import costmodel as cm

    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    out = {}
    try:
        grads = cm.gradients(shapes)  # the data the model records the step's bytes on
        for codec in codecs:
            key = cm.phase_key(codec, workers)
            if key in out:
                continue
            scheme = cm.Scheme(codec.spec, "ours", codec)
            buckets = cm.buckets_for(scheme, shapes)
            try:
                comp = gradcompress.Compressor(codec, warmup_steps=0, seed=0)
                local = collectives.LocalCollectives(workers)
                runs = []
                for _ in range(steps):
                    per_bucket = []
                    step = comp.begin_step(local)
                    for bucket in buckets:
                        gs = [grads[i].clone() for i in bucket]
                        job = step.exchange(list(bucket), gs)
                        phases, start = [], time.perf_counter()
                        while True:
                            try:
                                next(job)
                            except StopIteration:
                                phases.append(time.perf_counter() - start)
                                break
                            phases.append(time.perf_counter() - start)
                            start = time.perf_counter()
                        per_bucket.append(phases)
                    step.end()
                    longest = max(len(p) for p in per_bucket)
                    runs.append([sum(p[k] for p in per_bucket if len(p) == longest) for k in range(longest)])
                n = sum(cm.numel_of(shapes[i]) for b in buckets for i in b if cm._compressible(scheme, shapes[i]))
                runs = runs[1:]  # the first step has no residual yet
                out[key] = [min(r[k] for r in runs) / max(1, n) for k in range(len(runs[0]))]
            except Exception as err:  # any failure: a calibration, not a test: fall back to pass counts
                print(f"plan: could not time the Compressor with {codec.spec} ({type(err).__name__}: {err}); "
                      "using encode/decode pass counts", file=sys.stderr)
        return out
    finally:
        torch.set_num_threads(old)


def _calibrate_one(codec_specs: list[str], workers: int, numel: int, threads: int, shapes: list):
    import gradcompress

    codecs = [gradcompress.make(c) for c in codec_specs]
    speeds = calibrate(codecs, numel, threads)
    return dataclasses.replace(speeds, phases=calibrate_phases(codecs, workers, shapes, threads))


def calibrate_all(codecs: list, workers: int, numel: int, threads: int, shapes: list, busy: int = 1) -> Speeds:
    """:func:`calibrate` and :func:`calibrate_phases`; with ``busy`` > 1, in that many processes at once
    (workers sharing cores also share the memory bandwidth and caches) and averaged."""
    specs = [c.spec for c in codecs]
    if busy <= 1:
        return _calibrate_one(specs, workers, numel, threads, shapes)
    import concurrent.futures as cf
    import multiprocessing as mp

    with cf.ProcessPoolExecutor(busy, mp_context=mp.get_context("spawn")) as pool:
        runs = list(pool.map(_calibrate_one, *zip(*[(specs, workers, numel, threads, shapes)] * busy)))

    def mean(dicts):
        return {k: statistics.fmean(d[k] for d in dicts) for k in dicts[0]}

    phases = {k: [statistics.fmean(r.phases[k][i] for r in runs) for i in range(len(runs[0].phases[k]))]
              for k in runs[0].phases if all(k in r.phases for r in runs)}
    return dataclasses.replace(runs[0], elementwise=statistics.fmean(r.elementwise for r in runs),
                               encode=mean([r.encode for r in runs]), decode=mean([r.decode for r in runs]),
                               phases=phases)


def _load_calibration(path: str, codecs: list, workers: int):
    """The Speeds saved in ``path`` when they cover ``codecs`` at ``workers``; None otherwise."""
    import os

    from ..costmodel import Speeds, phase_key

    if not os.path.exists(path):
        return None
    try:
        with open(path) as f:
            data = json.load(f)
        speeds = Speeds(elementwise=float(data["elementwise"]), encode=dict(data["encode"]),
                        decode=dict(data["decode"]), phases=dict(data.get("phases", {})))
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise CLIError(f"cannot read --calibration {path!r}: {' '.join(str(err).split())}") from None
    if all(c.spec in speeds.encode and phase_key(c, workers) in speeds.phases for c in codecs):
        print(f"plan: calibration read from {path}", file=sys.stderr)
        return speeds
    return None


# --------------------------------------------------------------------------- run
def run(args: argparse.Namespace) -> int:
    from .. import costmodel as cm
    from ..testbed.models import model_shapes
    from .schemes import check_schemes

    schemes = [cm.modelled_scheme(s) for s in check_schemes(split_schemes(args.schemes) if args.schemes
                                                              else list(cm.DEFAULT_SCHEMES))]
    if not schemes:
        raise CLIError("--schemes is empty")
    _check_layout(args)
    if args.params is not None:
        params = int(round(args.params))
        if params < 1:
            raise CLIError("--params must be at least 1")
        shapes = cm.square_shapes(params, args.matrix_side)
        size_text = f"{params:,} parameters, assumed as {describe_shapes(shapes)} (--model for a model's own shapes)"
    else:
        shapes = model_shapes(args.model)
        size_text = f"model {args.model} ({sum(cm.numel_of(s) for s in shapes):,} parameters)"
    if args.auto is not None:
        _check_auto(args.auto, args.nodes)
    for s in schemes:
        if s.kind == "auto":
            raise CLIError("plan: give auto with --auto (e.g. --auto auto:budget=any), not in --schemes")
        if s.kind == "ours" and s.codec.name == "threshold":
            raise CLIError("threshold sends a data-dependent number of values; plan cannot predict it")
    if args.contention is not None and not args.cores:
        raise CLIError("--contention goes with --cores (the workers share that many cores)")
    contention = max(1.0, args.workers * args.threads / args.cores) if args.cores else 1.0
    if args.contention is not None:
        contention = args.contention
    timed = schemes + (cm.auto_candidates(args.auto) if args.auto is not None else [])  # auto's plan: timed as these
    codecs = [c for c in (cm.speed_codec(s) for s in timed) if c is not None]
    busy = min(args.cores, args.workers) if args.cores and args.contention is None else 1
    speeds = _load_calibration(args.calibration, codecs, args.workers) if args.calibration else None
    if speeds is None:
        print(f"plan: calibrating {len({c.spec for c in codecs})} codec(s) on {args.calibration_numel:,} elements "
              f"({args.threads} thread(s), {busy} process(es) at once)...", file=sys.stderr)
        speeds = calibrate_all(codecs, args.workers, args.calibration_numel, args.threads, shapes, busy)
        if args.calibration:
            try:
                with open(args.calibration, "w") as f:
                    json.dump(dataclasses.asdict(speeds), f, indent=1)
            except OSError as err:
                raise CLIError(f"cannot write --calibration {args.calibration!r}: {err.strerror or err}") from None
    if args.nodes is not None:
        return _run_nodes(args, schemes, shapes, size_text, speeds, contention)
    preds = [cm.predict(s, shapes, args.workers, args.bandwidth, args.compute_ms / 1e3, speeds,
                        latency_s=args.latency, contention=contention, efficiency=args.efficiency,
                        software_alpha=args.per_message_us / 1e6,
                        host_limit=None if args.host_limit is None else args.host_limit / 8)
             for s in schemes]
    auto = None
    if args.auto is not None:
        auto = cm.predict_auto(args.auto, shapes, args.workers, args.bandwidth, args.compute_ms / 1e3, speeds,
                               latency_s=args.latency, contention=contention, efficiency=args.efficiency,
                               software_alpha=args.per_message_us / 1e6,
                               host_limit=None if args.host_limit is None else args.host_limit / 8)
        preds.append(auto.prediction)
    preds = cm.with_speedups(preds)
    result = {
        "workers": args.workers, "bandwidth_bit": args.bandwidth, "latency_s": args.latency,
        "compute_s": args.compute_ms / 1e3, "params": sum(cm.numel_of(s) for s in shapes), "size": size_text,
        "contention": contention, "threads": args.threads, "per_message_s": args.per_message_us / 1e6,
        "efficiency": args.efficiency, "host_limit_bit": args.host_limit,
        "calibration": {"numel": args.calibration_numel, "elementwise_s_per_elem": speeds.elementwise,
                        "encode_s_per_elem": speeds.encode, "decode_s_per_elem": speeds.decode,
                        "compressor_phase_s_per_elem": speeds.phases},
        "predictions": [dataclasses.asdict(p) for p in preds],
    }
    if auto is not None:
        result["auto"] = auto_summary(auto)
    return emit(result, args.json, format_plan)


#: ``plan --auto``: the steps over which auto's one-off measuring is spread in the table's note
AMORTISED_STEPS = 1000


def auto_summary(auto: AutoPrediction) -> dict:
    """``plan --auto``'s JSON ``auto``: the plan it keeps per bucket and its steady step (``step_s``, the table's row);
    what it runs before: its dense measuring steps and the plans its selection runs (``proposals``, each with its
    predicted step), and their one-off cost over the kept plan's step, in all and spread over
    :data:`AMORTISED_STEPS` steps."""
    return {"scheme": auto.prediction.scheme, "plan": list(auto.plan), "step_s": auto.prediction.step_s,
            "measuring_steps": auto.measuring_steps, "measuring_step_s": auto.dense.step_s,
            "proposals": [{"plan": list(p), "step_s": t} for p, t in auto.proposals],
            "selection_steps_per_plan": auto.selection_steps, "one_off_s": auto.one_off_s,
            "amortised_over_steps": AMORTISED_STEPS, "amortised_s_per_step": auto.one_off_s / AMORTISED_STEPS}


def describe_shapes(shapes: list) -> str:
    """``[(2048, 2048)] * 5 + [(2048, 1967), (64,)]``: "5 matrices 2048x2048, 1 matrix 2048x1967 and a vector of 64"
    (runs of equal shapes counted)."""
    runs: list[list] = []
    for s in shapes:
        if runs and runs[-1][0] == tuple(s):
            runs[-1][1] += 1
        else:
            runs.append([tuple(s), 1])
    parts = []
    for shape, n in runs:
        if len(shape) == 1:
            parts.append(f"{n} vectors of {shape[0]:,}" if n > 1 else f"a vector of {shape[0]:,}")
        else:
            parts.append(f"{n} {'matrices' if n > 1 else 'matrix'} {'x'.join(str(d) for d in shape)}")
    return parts[0] if len(parts) == 1 else ", ".join(parts[:-1]) + " and " + parts[-1]


def _check_auto(spec: str, nodes) -> None:
    """``CLIError`` (one line) for an ``--auto`` value that is not an auto spec, or a bad one."""
    from ..config import Config, is_auto

    if not is_auto(spec):
        raise CLIError(f"--auto takes an auto spec (auto, auto:budget=any, ...), got {spec!r}")
    if nodes is not None:
        raise CLIError("--auto predicts flat exchanges; it does not combine with --nodes")
    try:
        Config.parse(spec, {})
    except ValueError as err:
        raise CLIError(one_line(err)) from None


def _check_layout(args: argparse.Namespace) -> None:
    """Fill ``args.workers`` from ``--nodes`` x ``--workers-per-node``; ``CLIError`` for a missing or mixed layout."""
    if args.nodes is None:
        if args.workers_per_node is not None:
            raise CLIError("--workers-per-node goes with --nodes")
        if args.workers is None:
            raise CLIError("give --workers (one link each) or --nodes with --workers-per-node")
        return
    if args.workers is not None:
        raise CLIError("give either --workers or --nodes with --workers-per-node, not both")
    args.workers_per_node = args.workers_per_node or 1
    args.workers = args.nodes * args.workers_per_node


def node_predictions(args: argparse.Namespace, schemes: list, shapes: list, speeds: Speeds,
                     contention: float) -> list[Prediction]:
    """Per scheme the flat prediction and, where the scheme has one, the hierarchical; speed-ups over flat DDP."""
    from .. import costmodel as cm

    preds = []
    for s in schemes:
        for hierarchical in (False, True) if cm.hierarchical_supported(s) else (False,):
            preds.append(cm.predict_nodes(s, shapes, args.nodes, args.workers_per_node, args.bandwidth,
                                          args.compute_ms / 1e3, speeds, hierarchical,
                                          intra_rate_bit=args.intra_bandwidth, latency_s=args.latency,
                                          contention=contention, efficiency=args.efficiency,
                                          software_alpha=args.per_message_us / 1e6))
    base = next((p for p in preds if p.scheme == "ddp"), None) or \
        next((p for p in preds if p.scheme == "none" and p.topology == "flat"), None)
    if base is None:
        return preds
    return [dataclasses.replace(p, speedup=base.step_s / p.step_s if p.step_s > 0 else None) for p in preds]


def which_pays(preds: list[dict]) -> list[str]:
    """One line per scheme run both ways: hierarchical or flat, by predicted step time and uplink bytes."""
    lines = []
    by: dict[str, dict] = {}
    for p in preds:
        by.setdefault(p["scheme"], {})[p["topology"]] = p
    for name, two in by.items():
        if len(two) < 2:
            continue
        f, h = two["flat"], two["hierarchical"]
        faster = "hierarchical" if h["step_s"] < f["step_s"] else "flat"
        lines.append(f"{name}: {faster} pays ({1e3 * h['step_s']:.1f} ms hierarchical vs {1e3 * f['step_s']:.1f} ms "
                     f"flat; uplink {h['wire_bytes'] / f['wire_bytes']:.2f}x flat's bytes)" if f["wire_bytes"] else
                     f"{name}: {faster} pays")
    return lines


def _run_nodes(args: argparse.Namespace, schemes: list, shapes: list, size_text: str, speeds, contention: float) -> int:
    """``plan --nodes``: every scheme flat and hierarchical on N nodes of G workers; the table or JSON."""
    preds = [dataclasses.asdict(p) for p in node_predictions(args, schemes, shapes, speeds, contention)]
    result = {"nodes": args.nodes, "workers_per_node": args.workers_per_node, "workers": args.workers,
              "bandwidth_bit": args.bandwidth, "intra_bandwidth_bit": args.intra_bandwidth, "latency_s": args.latency,
              "compute_s": args.compute_ms / 1e3, "params": sum(math.prod(s) for s in shapes), "size": size_text,
              "contention": contention, "predictions": preds, "which_pays": which_pays(preds)}
    return emit(result, args.json, format_plan_nodes)


def emit(result: dict, as_json: bool, fmt: Callable[[dict], str]) -> int:
    """Print ``result`` as JSON or as ``fmt(result)``; the exit code 0."""
    print(json.dumps(result, indent=1, allow_nan=False) if as_json else fmt(result))
    return 0


def format_plan_nodes(result: dict) -> str:
    """``plan --nodes``'s table: per scheme and topology the uplink bytes per node, the bytes one worker sends
    inside its node, the times and the speed-up over flat DDP, then which topology pays per scheme."""
    from ..costmodel import format_rate

    base = "DDP" if any(p["scheme"] == "ddp" for p in result["predictions"]) else "none"
    rows = [("scheme", "topology", "uplink/node", "intra/worker", "comm (ms/step)", "codec (ms/step)", "step (ms)",
             f"speed-up (x flat {base})")]
    for p in result["predictions"]:
        rows.append((p["scheme"], p["topology"], human_bytes(p["wire_bytes"]), human_bytes(p["intra_bytes"]),
                     f"{1e3 * p['comm_s']:.1f}", f"{1e3 * p['codec_s']:.1f}", f"{1e3 * p['step_s']:.1f}",
                     "n/a" if p["speedup"] is None else f"{p['speedup']:.2f}x"))
    lines = [f"{result['nodes']} nodes x {result['workers_per_node']} workers, uplink "
             f"{format_rate(result['bandwidth_bit'])} per node, inside a node {format_rate(result['intra_bandwidth_bit'])}; "
             f"{result['size']}; compute {1e3 * result['compute_s']:g} ms/step"]
    lines += table_lines(rows)
    lines += result["which_pays"]
    lines.append("uplink/node: bytes one node's uplink carries per step (flat: gloo's rings in rank order and direct "
                 "all-to-all); intra/worker: bytes one worker sends inside its node per step; comm, codec: ms per "
                 f"step; step: the predicted step, ms; speed-up: flat {base}'s step time / the row's")
    return "\n".join(lines)


def bucket_plan_text(plan: list[str]) -> str:
    """Auto's plan, the scheme per DDP bucket in the order the gradients are ready: "int4 on 4 buckets", "dense on
    bucket 1, int4 on buckets 2-4"."""
    if len(set(plan)) == 1:
        return f"{'dense' if plan[0] == 'none' else plan[0]} on {len(plan)} bucket{'s' if len(plan) > 1 else ''}"
    runs: list[list] = []
    for b, spec in enumerate(plan, 1):
        if runs and runs[-1][0] == spec:
            runs[-1][2] = b
        else:
            runs.append([spec, b, b])
    return ", ".join(f"{'dense' if spec == 'none' else spec} on bucket{f' {lo}' if lo == hi else f's {lo}-{hi}'}"
                     for spec, lo, hi in runs)


def speedup_verdict(speedup: float | None) -> str:
    if speedup is None:
        return "n/a"
    if speedup >= 1.05:
        return f"pays off ({speedup:.2f}x)"
    if speedup > 0.95:
        return "about even"
    return f"slower ({1 / speedup:.2f}x the time)"


def format_plan(result: dict) -> str:
    from ..costmodel import format_rate

    preds = result["predictions"]
    base = "DDP" if any(p["scheme"] == "ddp" for p in preds) else "none"
    head = ("scheme", "sent/step", "comm (ms/step)", "codec (ms/step)", "step (ms)", f"speed-up (x {base})", "verdict")
    rows = [head]
    for p in result["predictions"]:
        rows.append((p["scheme"], human_bytes(p["wire_bytes"]), f"{1e3 * p['comm_s']:.1f}", f"{1e3 * p['codec_s']:.1f}",
                     f"{1e3 * p['step_s']:.1f}", "n/a" if p["speedup"] is None else f"{p['speedup']:.2f}x",
                     speedup_verdict(p["speedup"]) if p["scheme"] != "ddp" else "baseline"))
    lat = f", {result['latency_s'] * 1e3:g} ms latency" if result["latency_s"] else ""
    lines = [f"{result['workers']} workers at {format_rate(result['bandwidth_bit'])}{lat}; {result['size']}; "
             f"compute {1e3 * result['compute_s']:g} ms/step"
             + (f"; codec work x{result['contention']:.2f} (shared cores)" if result["contention"] > 1 else "")]
    lines += table_lines(rows)
    ranked = sorted((p for p in result["predictions"] if p["speedup"] is not None), key=lambda p: -p["speedup"])
    if ranked:
        best = ranked[0]
        pay = [p["scheme"] for p in ranked if p["speedup"] >= 1.05 and p["scheme"] != "ddp"]
        name = "uncompressed DDP" if base == "DDP" else "ours none (dense)"
        lines.append(f"best: {best['scheme']}, {best['speedup']:.2f}x {name}'s speed; pay off (>= 5%): "
                     f"{', '.join(pay) if pay else 'none'}")
    if result.get("auto"):
        a = result["auto"]
        tried = (f", then runs {len(a['proposals'])} plans {a['selection_steps_per_plan']} steps each ("
                 + "; ".join(f"{bucket_plan_text(p['plan'])}: {1e3 * p['step_s']:.1f} ms" for p in a["proposals"])
                 + ") and keeps the fastest") if a["proposals"] else ""
        lines.append(f"auto: its row is the steady step of the plan it keeps ({bucket_plan_text(a['plan'])}), timed as the "
                     f"fixed rows. Before: {a['measuring_steps']} dense steps of {1e3 * a['measuring_step_s']:.1f} "
                     f"ms{tried}: +{1e3 * a['one_off_s']:.1f} ms once, +{1e3 * a['amortised_s_per_step']:.2f} ms/step "
                     f"over {a['amortised_over_steps']} steps (its later checks' link probes, about 1 % more bytes, "
                     "not counted)")
    lines.append(f"sent/step: bytes each worker transmits per step (ring count); comm: ms per step the collectives "
                 f"take on the link (part of it hidden under the backward pass); codec: ms per step of "
                 f"encode/decode/error-feedback work; step: the predicted step, ms; speed-up: {base}'s step time / "
                 f"the row's")
    return "\n".join(lines)


