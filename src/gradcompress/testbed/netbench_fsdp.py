"""netbench --fsdp on the node testbed (``--nodes N --workers-per-node G``): FSDP2 across nodes, dense and compressed.

A scheme here is ``fsdp`` (FSDP2 over every rank, uncompressed), ``hsdp`` (FSDP2's native HSDP: sharded inside each
node, replicated across nodes, uncompressed), or a codec spec with two netbench options after the codec's:
``layout=hsdp`` (compressed HSDP: sharded over the node, the replicas' all-reduce through the codec,
``register_fsdp(..., mesh=)``; default ``layout=fsdp``: FSDP over every rank, its reduce-scatter hierarchical: dense
inside the node, the codec between) and ``params=int8|bf16`` (the parameter all-gathers compressed). E.g.
``int8:layout=hsdp``, ``int4:params=int8``. The report gives each node's uplink bytes (its veth tx counter) split
nowhere — gradients and parameters together, as the link carries them — with the Compressor's gradient
(``inter_node_bytes``) and parameter (``param_bytes``) counters beside, and the ratios to dense FSDP and dense HSDP.
"""

from __future__ import annotations

import statistics

from .common import CLIError, human_bytes, table_lines

BASELINES = ("fsdp", "hsdp")
LAYOUTS = ("fsdp", "hsdp")
#: the default schemes of --fsdp --nodes
NODE_FSDP_SCHEMES = ("fsdp", "hsdp", "int8:layout=hsdp", "int4:layout=hsdp", "sign:layout=hsdp", "int4",
                     "int4:params=int8", "none:params=int8")


def split(text: str) -> tuple[str | None, str, str | None]:
    """(codec spec or None for a baseline, layout, params) of a scheme; ``ValueError`` naming what is allowed."""
    text = text.strip()
    if text in BASELINES:
        return None, text, None
    name, _, rest = text.partition(":")
    kept, layout, params = [], "fsdp", None
    for item in filter(None, (s.strip() for s in rest.split(","))):
        key, _, value = item.partition("=")
        if key == "layout":
            if value not in LAYOUTS:
                raise ValueError(f"{text}: layout must be one of {', '.join(LAYOUTS)}, got {value!r}")
            layout = value
        elif key == "params":
            if value not in ("int8", "bf16"):
                raise ValueError(f"{text}: params must be int8 or bf16, got {value!r}")
            params = value
        else:
            kept.append(item)
    return (f"{name}:{','.join(kept)}" if kept else name), layout, params


def has_options(text: str) -> bool:
    """True when ``text`` uses this module's ``layout=`` or ``params=`` options."""
    rest = text.partition(":")[2]
    return any(item.strip().partition("=")[0] in ("layout", "params") for item in rest.split(","))


def check(text: str) -> str:
    """``text`` if netbench --fsdp --nodes can run it, else ``CLIError`` (one line)."""
    from ..adapters.fsdp import check_codec
    from ..spec import make

    try:
        codec, _, _ = split(text)
        if codec is not None:
            check_codec(make(codec))
    except (ValueError, TypeError) as err:
        raise CLIError(f"--fsdp: {err}") from None
    return text.strip()


def setup(model, text: str, nodes: int, per_node: int, warmup_steps: int):
    """Shard ``model`` for scheme ``text`` and register the compression: (model, Compressor or None, its error
    feedback)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    import gradcompress

    codec, layout, params = split(text)
    mesh = init_device_mesh("cpu", (nodes, per_node), mesh_dim_names=("replicate", "shard")) \
        if layout == "hsdp" else None
    over = {} if mesh is None else {"mesh": mesh if codec is None else mesh["shard"]}
    for m in list(model.modules())[1:]:
        if any(True for _ in m.parameters(recurse=False)):
            fully_shard(m, **over)
    fully_shard(model, **over)
    if codec is None:
        return model, None, None
    comp = gradcompress.register_fsdp(model, codec, mesh=mesh, params=params, warmup_steps=warmup_steps, seed=0)
    return model, comp, comp.error_feedback


def ratios(result: dict) -> dict:
    """Per scheme: its uplink bytes over dense FSDP's and dense HSDP's (None where that row was not run)."""
    up = {r["scheme"]: r["uplink_tx_bytes_per_step"] for r in result["schemes"]}

    def over(name, base):
        return up[name] / up[base] if up.get(base) else None

    return {name: {"x_fsdp": over(name, "fsdp"), "x_hsdp": over(name, "hsdp")} for name in up}


def format_table(result: dict) -> str:
    """The --fsdp --nodes report (module doc)."""
    got = ratios(result)

    def f(v, spec=".3f"):
        return "-" if v is None else format(v, spec)

    rows = [("scheme", "layout", "step ms", "speed-up", "uplink B/node/step", "grad inter_node B/node",
             "param B/worker", "x fsdp", "x hsdp")]
    for r in result["schemes"]:
        codec, layout, params = split(r["scheme"])
        inter = r["inter_node_bytes_per_step_by_node"]
        rows.append((r["scheme"], layout + (f" + {params} params" if params else ""), f"{1e3 * r['median_step_s']:.0f}",
                     "n/a" if r["speedup"] is None else f"{r['speedup']:.2f}x",
                     " / ".join(human_bytes(b) for b in r["uplink_tx_bytes_per_step_by_node"]),
                     "n/a" if inter[0] is None else human_bytes(statistics.fmean(inter)),
                     "-" if r.get("param_bytes_per_step") is None else human_bytes(r["param_bytes_per_step"]),
                     f(got[r["scheme"]]["x_fsdp"]), f(got[r["scheme"]]["x_hsdp"])))
    lines = [f"FSDP2, {result['nodes']} nodes x {result['workers_per_node']} workers, uplinks at {result['rate_text']}; "
             f"model {result['model']} ({result['params']:,} parameters), batch {result['batch_size']}; median of "
             f"{result['steps']} steps after {result['warmup']}; {result['threads_per_worker']} thread(s) per worker "
             f"on {result['cpu_count']} CPUs; compute alone {1e3 * result['compute_s']:.0f} ms/step"]
    lines += table_lines(rows)
    lines.append("uplink: bytes each node's veth transmitted per step (gradients and parameters; one value per "
                 "node); grad inter_node: the node's workers' Compressor.stats()['inter_node_bytes'] summed; param: "
                 "one worker's stats()['param_bytes'] (its compressed all-gathers, inside and between nodes); "
                 "speed-up over fsdp; x fsdp / x hsdp: uplink bytes over the dense fsdp / hsdp rows'")
    return "\n".join(lines)


__all__ = ["BASELINES", "NODE_FSDP_SCHEMES", "check", "has_options", "format_table", "ratios", "setup", "split"]
