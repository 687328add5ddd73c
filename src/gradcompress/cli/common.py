"""Helpers every ``gradcompress`` subcommand shares: the one-line error, argparse number types,
``--schemes`` splitting, output folders and byte formatting."""

from __future__ import annotations

import argparse
import math
import os
from collections.abc import Sequence

from ..timing import rate_argument


class CLIError(Exception):
    """A problem with the command line or the environment: printed as one line, exit code 2."""


def one_line(err: BaseException | str) -> str:
    return " ".join(str(err).split()) or type(err).__name__


def check_out_dir(path: str) -> str:
    """Create ``path`` if needed and check that a file can be written there (before any training)."""
    import tempfile

    path = os.path.abspath(os.path.expanduser(path))
    try:
        os.makedirs(path, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=path, prefix=".gradcompress-write-test-"):
            pass
    except OSError as err:
        reason = err.strerror or one_line(err)
        raise CLIError(f"cannot write to --out {path!r}: {reason}") from None
    return path


def _checked(convert, ok, what: str):
    """An argparse type: ``convert(text)`` that must satisfy ``ok``, else 'expected WHAT, got TEXT'."""

    def parse(text: str):
        try:
            v = convert(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}") from None
        if not ok(v):
            raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}")
        return v

    return parse


positive_int = _checked(int, lambda v: v >= 1, "a positive integer")
nonnegative_int = _checked(int, lambda v: v >= 0, "an integer >= 0")
positive_float = _checked(float, lambda v: v > 0 and math.isfinite(v), "a positive number")


rate = rate_argument  # an argparse type: a link rate in bit/s (gradcompress.timing.parse_rate)


#: the rule every rate option's --help states
RATE_HELP = ("bits per second: 1gbit = 1Gbps = 1G = 1Gbit/s; bytes per second only with a capital B "
             "(125MBps = 125MB/s = 1 Gbit/s)")


def progress_bars() -> bool:
    """Whether to draw progress bars: only on a terminal (they go to stderr; a redirected log gets none)."""
    import sys

    try:
        return sys.stderr.isatty()
    except (AttributeError, ValueError):  # replaced or closed
        return False


def split_schemes(values: list[str] | None) -> list[str]:
    """``--schemes`` values, each possibly a ``;``-separated list, flattened (empty items dropped)."""
    out: list[str] = []
    for v in values or []:
        out.extend(s.strip() for s in v.split(";") if s.strip())
    return out


def human_bytes(n: float | None) -> str:
    if n is None:
        return "n/a"
    for unit in ("B", "KB", "MB", "GB"):
        if abs(n) < 1000 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} GB"


def table_lines(rows: Sequence[tuple[str, ...]]) -> list[str]:
    """A text table: the first row is the header (underlined), the first column left-aligned, the rest right."""
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = []
    for k, row in enumerate(rows):
        lines.append("  ".join([row[0].ljust(widths[0])] + [c.rjust(w) for c, w in zip(row[1:], widths[1:])]))
        if k == 0:
            lines.append("  ".join("-" * w for w in widths))
    return lines


def text_table(title: str, rows: list[tuple[str, ...]], legend: str) -> str:
    """A title line, :func:`table_lines` of ``rows`` (header first), and a legend line."""
    return "\n".join([title, *table_lines(rows), legend])


def fmt(value: object, spec: str) -> str:
    """``format(value, spec)``, or "n/a" for None."""
    return "n/a" if value is None else format(value, spec)
