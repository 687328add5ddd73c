"""A codec's options: :func:`option` declares one (a dataclass field with its allowed :class:`Range` or choices),
:func:`validate` checks a codec's values against them. Part of the spec grammar (:mod:`gradcompress.spec`
re-exports these names, which the codecs import from there); it reads no spec text.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any


@dataclasses.dataclass(frozen=True)
class Range:
    """Allowed interval for a numeric option, for checks and error messages."""

    lo: float | None = None
    hi: float | None = None
    lo_open: bool = False
    hi_open: bool = False

    def contains(self, v: float) -> bool:
        if isinstance(v, float) and math.isnan(v):
            return False
        if self.lo is not None and (v <= self.lo if self.lo_open else v < self.lo):
            return False
        if self.hi is not None and (v >= self.hi if self.hi_open else v > self.hi):
            return False
        return True

    def __str__(self) -> str:
        lo = "-inf" if self.lo is None else _fmt(self.lo)
        hi = "inf" if self.hi is None else _fmt(self.hi)
        return f"{'(' if self.lo_open or self.lo is None else '['}{lo}, {hi}{')' if self.hi_open or self.hi is None else ']'}"


def _fmt(v: float) -> str:
    return str(int(v)) if float(v).is_integer() else repr(v)


def option(default: Any, *, range: Range | None = None, choices: tuple[Any, ...] | None = None,
           doc: str = "") -> Any:
    """A codec option: a dataclass field carrying its allowed range or choices."""
    return dataclasses.field(default=default, metadata={"range": range, "choices": choices, "doc": doc})


def validate(codec: Any) -> None:
    """Check every option of a codec dataclass against its declared type and range."""
    for f in dataclasses.fields(codec):
        if not f.init:
            continue
        v = getattr(codec, f.name)
        kind = f.type if isinstance(f.type, str) else getattr(f.type, "__name__", str(f.type))
        where = f"{codec.name}: {f.name}"
        if kind == "bool":
            if not isinstance(v, bool):
                raise ValueError(f"{where} must be true or false, got {v!r}")
        elif kind == "int":
            if isinstance(v, bool) or not isinstance(v, int):
                raise ValueError(f"{where} must be an integer in {f.metadata['range'] or '(-inf, inf)'}, got {v!r}")
        elif kind == "float":
            if isinstance(v, bool) or not isinstance(v, (int, float)):
                raise ValueError(f"{where} must be a number in {f.metadata['range'] or '(-inf, inf)'}, got {v!r}")
            object.__setattr__(codec, f.name, float(v))
        rng: Range | None = f.metadata.get("range")
        if rng is not None and not rng.contains(getattr(codec, f.name)):
            raise ValueError(f"{where} must be in {rng}, got {_show(v)}")
        choices = f.metadata.get("choices")
        if choices is not None and v not in choices:
            raise ValueError(f"{where} must be one of {', '.join(map(str, choices))}, got {v!r}")


def _show(v: Any) -> str:
    return _fmt(v) if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) else repr(v)
