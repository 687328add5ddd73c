"""``gradcompress netbench``: step time and real interface bytes per scheme over emulated, shaped links (root).

The command line of the netbench runner (:mod:`gradcompress.testbed.netbench`, where what is measured and how is
described): the arguments; every scheme checked before anything starts (:func:`gradcompress.cli.schemes.
check_schemes`); the environment checked (root, iproute2, netem for ``--latency``; namespaces a killed run left
behind are removed first); then :func:`gradcompress.testbed.netbench.bench` and its result as JSON or as a table:
per host (``--workers``), per node (``--nodes N --workers-per-node G``: each node's uplink bytes next to the node's
workers' ``inter_node_bytes`` and the ratios to ``ddp``, ``torch-fp16`` and the scheme's ``topology=flat`` twin) or,
with ``--fsdp --nodes``, FSDP2 across nodes (the ratios to dense FSDP and HSDP; schemes:
:mod:`gradcompress.testbed.netbench_fsdp`).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys

from ..scheme import parse_scheme
from ..testbed.models import MODELS
from ..testbed.models import checked as checked_model
from ..testbed.netbench import (COMPRESSOR_WARMUP, FSDP_BASELINE, FSDP_SCHEMES, MIN_WARMUP, NODE_SCHEMES, NOSEND,
                                bench)
from ..testbed.netbench_fsdp import NODE_FSDP_SCHEMES, split_fsdp_scheme
from .common import RATE_HELP, CLIError, human_bytes, positive_int, rate, split_schemes, table_lines
from .demo import scheme_label
from .schemes import check_schemes

#: --nodes x --workers-per-node at most
MAX_NODE_WORKERS = 16


# --------------------------------------------------------------------------- arguments
def _workers(text: str) -> int:
    v = positive_int(text)
    if not 2 <= v <= 8:
        raise argparse.ArgumentTypeError(f"expected 2 to 8 workers, got {text!r}")
    return v


def _change(text: str) -> tuple[int, float]:
    """``STEP:RATE`` of ``--change``: a timed step (an integer >= 0) and a rate."""
    step, sep, value = str(text).partition(":")
    if not sep or not step.strip().isdigit():
        raise argparse.ArgumentTypeError(f"--change must be STEP:RATE (e.g. 10:100mbit), got {text!r}")
    return int(step), rate(value)


def _duration(text: str) -> float:
    from ..costmodel import parse_duration

    try:
        return parse_duration(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> argparse.ArgumentParser:
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
               "Models: mlp (12.6M parameters, communication-bound), mlp8m (8.4M), cnn (0.39M, compute-bound), "
               "tiny (85K), lm (the 0.47M byte-level transformer); families by size: mlp:W (1024-W-W-1024), "
               "conv:C (cnn is conv:32), transformer:D (lm is transformer:128).")
    p.add_argument("--workers", type=_workers, default=None,
                   help="emulated hosts, one worker each: 2 to 8 (default 4; not with --nodes)")
    p.add_argument("--nodes", type=_workers, default=None, metavar="N",
                   help="emulated nodes (2 to 8), each a namespace with one shaped uplink and --workers-per-node "
                        "workers talking over the namespace's loopback")
    p.add_argument("--workers-per-node", type=positive_int, default=None, metavar="G",
                   help=f"workers per node with --nodes (default 1; N x G at most {MAX_NODE_WORKERS})")
    p.add_argument("--bandwidth", type=rate, default=rate("1gbit"), metavar="RATE",
                   help=f"link rate per host and direction, in {RATE_HELP} (default 1gbit)")
    p.add_argument("--latency", type=_duration, default=0.0, metavar="TIME",
                   help="one-way delay added on each host's egress with netem, e.g. 1ms (default 0: none; "
                        "needs the netem qdisc in the kernel)")
    p.add_argument("--model", type=checked_model, default="mlp", metavar="MODEL",
                   help=f"model: {', '.join(MODELS)}, or a family by size: mlp:W, conv:C, transformer:D "
                        "(default mlp)")
    p.add_argument("--schemes", action="extend", nargs="+", metavar="SPEC",
                   help="schemes (';'-separated and/or repeated); default: the list below")
    p.add_argument("--steps", type=positive_int, default=10, help="timed steps per scheme (default 10)")
    p.add_argument("--warmup", type=positive_int, default=MIN_WARMUP,
                   help=f"untimed steps before them, at least {MIN_WARMUP} (default {MIN_WARMUP}; the first "
                        f"{COMPRESSOR_WARMUP} are dense)")
    p.add_argument("--fixed-warmup", type=positive_int, default=None, metavar="N",
                   help="untimed steps for the schemes that are not auto (default: --warmup): a fixed scheme is "
                        "steady after its dense steps, auto after its decision")
    p.add_argument("--batch-size", type=positive_int, default=32, help="examples per worker per step (default 32)")
    p.add_argument("--threads", type=positive_int, default=None,
                   help="torch threads per worker (default: CPU cores / workers, at least 1)")
    p.add_argument("--timeout", type=positive_int, default=900,
                   help="seconds before the whole run is stopped (default 900)")
    p.add_argument("--fsdp", action="store_true",
                   help="FSDP2 mode: the model sharded with fully_shard (every layer and the root); the baseline "
                        "'fsdp' is uncompressed FSDP, codec specs compress its reduce-scatter "
                        "(gradcompress.register_fsdp). Default schemes: " + "; ".join(FSDP_SCHEMES))
    p.add_argument("--change", type=_change, default=None, metavar="STEP:RATE",
                   help="reshape every host's uplink to RATE with tc before timed step STEP (a link that drops or "
                        "recovers mid-run; e.g. 10:100mbit; RATE read as --bandwidth); back to --bandwidth after each scheme")
    p.add_argument("--accelerator", action="store_true",
                   help="emulate an accelerator: each step's forward and backward are a timed wait of the compute "
                        "time measured alone (the CPU left idle, as on a GPU) and the real gradients, so the codecs "
                        "and collectives do not compete with the compute for the cores")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.set_defaults(run=run)
    return p


# --------------------------------------------------------------------------- the parent
def run(args: argparse.Namespace) -> int:
    from ..costmodel import DEFAULT_SCHEMES
    from ..testbed import netns
    from ..testbed.hosts import TestbedError

    why = netns.problem()
    if why:
        raise CLIError(why)
    hosts, per_node = host_layout(args)
    nodes = per_node > 1
    defaults = (NODE_FSDP_SCHEMES if nodes else FSDP_SCHEMES) if args.fsdp else \
        NODE_SCHEMES if args.nodes else DEFAULT_SCHEMES
    schemes = check_schemes(split_schemes(args.schemes) if args.schemes else list(defaults), args.fsdp, nodes)
    if not schemes:
        raise CLIError("--schemes is empty")
    for flag, value in (("--warmup", args.warmup), ("--fixed-warmup", args.fixed_warmup)):
        if value is not None and value < MIN_WARMUP:
            raise CLIError(f"{flag} must be at least {MIN_WARMUP} (2 dense steps, then at least one compressed "
                           f"step before timing), got {value}")
    stale = netns.cleanup_stale()
    if stale:
        print(f"netbench: removed {len(stale)} namespace(s) left by a crashed run: {', '.join(stale)}",
              file=sys.stderr)
    if args.latency > 0 and not netns.netem_available():
        raise CLIError("--latency needs the netem qdisc, which this kernel lacks (CONFIG_NET_SCH_NETEM); "
                       "run without --latency")
    try:
        result = bench(schemes, hosts, args.bandwidth, args.latency, args.model, args.steps, args.warmup,
                       args.batch_size, args.threads, args.timeout, args.fsdp, per_node, args.change,
                       args.accelerator, args.fixed_warmup)
    except TestbedError as err:
        raise CLIError(str(err)) from None
    if args.json:
        print(json.dumps(result, indent=1, allow_nan=False))
    else:
        print(format_netbench(result))
    return 0


def host_layout(args: argparse.Namespace) -> tuple[int, int]:
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


# --------------------------------------------------------------------------- the report
def _fmt_rate(bit: float) -> str:
    from ..costmodel import format_rate

    return format_rate(bit)


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


def format_netbench_nodes(result: dict) -> str:
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


def format_netbench(result: dict) -> str:
    """The report of :func:`gradcompress.testbed.netbench.bench`'s result: per host, per node, or FSDP on nodes."""
    if result.get("workers_per_node", 1) > 1 and result.get("fsdp"):
        return format_fsdp_node_table(result)
    if result.get("workers_per_node", 1) > 1:
        return format_netbench_nodes(result)
    head = ("scheme", "step ms", "speed-up", "iface B/step", "wire B/step", "iface/wire", "codec ms", "wait ms",
            "buckets")
    rows = [head]
    for r in result["schemes"]:
        wire = human_bytes(r["wire_bytes_per_step"]) + (" (model)" if r["wire_bytes_source"] == "model" else "")
        label = scheme_label({"scheme": r["scheme"], "plan": (r.get("auto") or {}).get("plan")})  # auto's plan
        rows.append((label, f"{1e3 * r['median_step_s']:.1f}",
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


def fsdp_node_ratios(result: dict) -> dict:
    """--fsdp --nodes: per scheme, its uplink bytes over dense FSDP's and dense HSDP's (None where that row was not
    run)."""
    up = {r["scheme"]: r["uplink_tx_bytes_per_step"] for r in result["schemes"]}

    def over(name, base):
        return up[name] / up[base] if up.get(base) else None

    return {name: {"x_fsdp": over(name, "fsdp"), "x_hsdp": over(name, "hsdp")} for name in up}


def format_fsdp_node_table(result: dict) -> str:
    """The --fsdp --nodes report: per scheme its layout, step time, speed-up, each node's uplink bytes next to the
    gradient and parameter counters, and the uplink ratios to dense FSDP and HSDP."""
    got = fsdp_node_ratios(result)

    def f(v, spec=".3f"):
        return "-" if v is None else format(v, spec)

    rows = [("scheme", "layout", "step ms", "speed-up", "uplink B/node/step", "grad inter_node B/node",
             "param B/worker", "x fsdp", "x hsdp")]
    for r in result["schemes"]:
        codec, layout, params = split_fsdp_scheme(r["scheme"])
        inter = r["inter_node_bytes_per_step_by_node"]
        rows.append((r["scheme"], layout + (f" + {params} params" if params else ""), f"{1e3 * r['median_step_s']:.0f}",
                     "n/a" if r["speedup"] is None else f"{r['speedup']:.2f}x",
                     " / ".join(human_bytes(b) for b in r["uplink_tx_bytes_per_step_by_node"]),
                     "n/a" if inter[0] is None else human_bytes(statistics.fmean(inter)),
                     "-" if r.get("param_bytes_per_step") is None else human_bytes(r["param_bytes_per_step"]),
                     f(got[r["scheme"]]["x_fsdp"]), f(got[r["scheme"]]["x_hsdp"])))
    lines = [f"FSDP2, {result['nodes']} nodes x {result['workers_per_node']} workers, uplinks at "
             f"{_fmt_rate(result['bandwidth_bit'])}; "
             f"model {result['model']} ({result['params']:,} parameters), batch {result['batch_size']}; median of "
             f"{result['steps']} steps after {result['warmup']}; {result['threads_per_worker']} thread(s) per worker "
             f"on {result['cpu_count']} CPUs; compute alone {1e3 * result['compute_s']:.0f} ms/step"]
    lines += table_lines(rows)
    lines.append("uplink: bytes each node's veth transmitted per step (gradients and parameters; one value per "
                 "node); grad inter_node: the node's workers' Compressor.stats()['inter_node_bytes'] summed; param: "
                 "one worker's stats()['param_bytes'] (its compressed all-gathers, inside and between nodes); "
                 "speed-up over fsdp; x fsdp / x hsdp: uplink bytes over the dense fsdp / hsdp rows'")
    return "\n".join(lines)
