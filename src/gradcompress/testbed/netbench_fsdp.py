"""The schemes of netbench --fsdp on nodes (``--nodes N --workers-per-node G``): FSDP2 across nodes, dense and
compressed.

A scheme here is ``fsdp`` (FSDP2 over every rank, uncompressed), ``hsdp`` (FSDP2's native HSDP: sharded inside each
node, replicated across nodes, uncompressed), or a codec spec with two netbench options after the codec's:
``layout=hsdp`` (compressed HSDP: sharded over the node, the replicas' all-reduce through the codec,
``register_fsdp(..., mesh=)``; default ``layout=fsdp``: FSDP over every rank, its reduce-scatter hierarchical: dense
inside the node, the codec between) and ``params=int8|bf16`` (the parameter all-gathers compressed). E.g.
``int8:layout=hsdp``, ``int4:params=int8``. The report gives each node's uplink bytes (its veth tx counter) split
nowhere — gradients and parameters together, as the link carries them — with the Compressor's gradient
(``inter_node_bytes``) and parameter (``param_bytes``) counters beside, and the ratios to dense FSDP and dense HSDP.

:func:`split_fsdp_scheme` reads such a scheme; :func:`gradcompress.factory.build` sets it up (``Run(fsdp=True, per_node=G)`` for
``layout=hsdp``), the netbench runner (:mod:`gradcompress.testbed.netbench`) times it and the command line
(:mod:`gradcompress.cli.netbench`) prints the table.
"""

from __future__ import annotations

from ..spec import take_options

BASELINES = ("fsdp", "hsdp")
LAYOUTS = ("fsdp", "hsdp")
#: this module's options next to a codec's (read by :func:`gradcompress.spec.take_options`)
OPTIONS = ("layout", "params")
#: the default schemes of --fsdp --nodes
NODE_FSDP_SCHEMES = ("fsdp", "hsdp", "int8:layout=hsdp", "int4:layout=hsdp", "sign:layout=hsdp", "int4",
                     "int4:params=int8", "none:params=int8")


def split_fsdp_scheme(text: str) -> tuple[str | None, str, str | None]:
    """(codec spec or None for a baseline, layout, params) of a scheme; ``ValueError`` naming what is allowed."""
    text = text.strip()
    if text in BASELINES:
        return None, text, None
    codec, taken = take_options(text, OPTIONS)
    layout, params = "fsdp", None
    for key, value in taken:
        if key == "layout":
            if value not in LAYOUTS:
                raise ValueError(f"{text}: layout must be one of {', '.join(LAYOUTS)}, got {value!r}")
            layout = value
        else:
            if value not in ("int8", "bf16"):
                raise ValueError(f"{text}: params must be int8 or bf16, got {value!r}")
            params = value
    return codec, layout, params


def has_options(text: str) -> bool:
    """True when ``text`` uses this module's ``layout=`` or ``params=`` options."""
    return bool(take_options(text, OPTIONS)[1])


__all__ = ["BASELINES", "LAYOUTS", "NODE_FSDP_SCHEMES", "has_options", "split_fsdp_scheme"]
