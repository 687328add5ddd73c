"""Link rates as people write them (``100mbit``, ``1Gbps``, ``125MBps``) and as the library prints them.

The one reader of every rate (``--bandwidth``, ``auto:bandwidth=``, netbench's ``--change``); a module of its own, below
everything, so that the spec grammar (:mod:`gradcompress.spec`) reads ``auto:bandwidth=`` with it.
:mod:`gradcompress.timing` re-exports these names.
"""

from __future__ import annotations

import re

_RATE_PREFIXES = {"": 1.0, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12}

#: how every link rate in the library is read (``--bandwidth``, ``auto:bandwidth=``, ...), for help texts and errors
RATE_RULE = ("bits per second as links are quoted (100mbit = 100Mbps = 100M = 100Mbit/s; 1gbit = 1Gbps = 1G = "
             "1Gbit/s); bytes per second only with a capital B (125MBps = 125MB/s = 1 Gbit/s)")


def parse_rate(text: str) -> float:
    """A link rate in bit/s, the one parser of every rate the library reads (see :data:`RATE_RULE`).

    A number, an optional prefix ``k``/``M``/``G``/``T`` (either case, decimal), and a unit: ``bit``/``b``/none
    (bits) or ``B`` (bytes, only when spelt with a capital B), optionally followed by ``ps`` or ``/s``. So ``1Gbps``,
    ``1gbit``, ``1G`` and ``1Gbit/s`` are all 1e9 and ``125MBps``/``125MB/s`` are 1e9 too (125 MB/s). A bare number
    is refused: its unit is ambiguous. Note that tc reads ``bps`` as bytes: what is handed to tc is in its ``bit``.
    """
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][+-]?\d+)?)\s*([A-Za-z/]*)\s*", str(text))
    bits = None
    if m and float(m.group(1)) > 0:
        unit = m.group(2)
        for suffix in ("/s", "ps"):
            if unit.lower().endswith(suffix):
                unit = unit[:-len(suffix)]
                break
        prefix = unit[:1].lower() if unit[:1].lower() in _RATE_PREFIXES and unit[:1] not in "bB" else ""
        unit = unit[len(prefix):]
        scale = None
        if unit.lower() in ("bit", "bits") or unit == "b" or (unit == "" and prefix):
            scale = 1.0
        elif unit == "B":
            scale = 8.0
        if scale is not None:
            bits = float(m.group(1)) * _RATE_PREFIXES[prefix] * scale
    if bits is None:
        raise ValueError(f"bad rate {text!r}: expected a positive number with a unit; rates are read in {RATE_RULE}")
    return bits


def format_rate(bit_per_s: float) -> str:
    """``1 Gbit/s``, ``100 Mbit/s``, ``64 kbit/s``, ``12 bit/s``: a rate in bit/s as reports print it."""
    for unit, scale in (("Gbit/s", 1e9), ("Mbit/s", 1e6), ("kbit/s", 1e3)):
        if bit_per_s >= scale:
            return f"{bit_per_s / scale:g} {unit}"
    return f"{bit_per_s:g} bit/s"


__all__ = ["RATE_RULE", "format_rate", "parse_rate"]
