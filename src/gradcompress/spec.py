"""Codec specs: parse ``"name:key=value,..."`` strings and dicts into validated codecs.

A spec names a registered codec and sets some of its options::

    "topk:ratio=0.01,values=int8"
    {"name": "topk", "ratio": 0.01, "values": {"name": "int8", "bucket": 128}}

Values in a string are read as int, float, bool (``true``/``false``) or, for options
that hold a codec, a nested codec name. Nothing is evaluated or unpickled. Every
error is a ``ValueError`` that names the codec, the option and what is allowed.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable

_REGISTRY: dict[str, type] = {}


def register(name: str) -> Callable[[type], type]:
    """Class decorator that makes a codec class reachable from :func:`make` under ``name``."""

    def deco(cls: type) -> type:
        if name in _REGISTRY:
            raise ValueError(f"codec name {name!r} registered twice")
        cls.name = name
        _REGISTRY[name] = cls
        return cls

    return deco


def available() -> list[str]:
    """Every registered codec name, sorted (the codec families register themselves when
    :mod:`gradcompress.codecs` is imported, which importing :mod:`gradcompress` does)."""
    return sorted(_REGISTRY)


def is_codec(obj: Any) -> bool:
    """True for a codec object (anything with ``encode``, ``decode`` and an ``aggregation``)."""
    return not isinstance(obj, (str, dict, type)) and all(hasattr(obj, a) for a in ("encode", "decode", "aggregation"))


# --------------------------------------------------------------------------- options
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


def option(default: Any, *, range: Range | None = None, choices: tuple | None = None, doc: str = ""):
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


# --------------------------------------------------------------------------- parsing
def _parse_value(text: str) -> Any:
    low = text.strip().lower()
    if low.startswith("{") and low.endswith("}"):  # a nested codec spec, e.g. {int8:bucket=128,stochastic=true}
        return text.strip()[1:-1].strip()
    if low == "true":
        return True
    if low == "false":
        return False
    try:
        return int(text)
    except ValueError:
        pass
    try:
        return float(text)
    except ValueError:
        return text.strip()


def _split_options(rest: str, name: str) -> list[str]:
    """Split at the commas outside braces, so a nested ``{codec:a=1,b=2}`` value stays whole."""
    items, depth, start = [], 0, 0
    for i, ch in enumerate(rest):
        depth += (ch == "{") - (ch == "}")
        if depth < 0:
            break
        if ch == "," and depth == 0:
            items.append(rest[start:i])
            start = i + 1
    if depth != 0:
        raise ValueError(f"{name}: unbalanced braces in options {rest!r}; write a nested codec as key={{name:a=1,b=2}}")
    items.append(rest[start:])
    return items


def parse(spec: str) -> dict[str, Any]:
    """Split ``"name:key=value,..."`` into ``{"name": name, key: value, ...}`` (values typed)."""
    if not isinstance(spec, str):
        raise ValueError(f"a codec spec must be a string or a dict, got {type(spec).__name__}")
    name, _, rest = spec.strip().partition(":")
    out: dict[str, Any] = {"name": name.strip()}
    if rest.strip():
        for item in _split_options(rest, name):
            key, eq, value = item.partition("=")
            if not eq or not key.strip():
                raise ValueError(f"{name}: cannot read option {item!r}; write options as key=value separated by commas")
            if key.strip() in out:
                raise ValueError(f"{name}: option {key.strip()!r} given twice")
            out[key.strip()] = _parse_value(value)
    return out


def read(spec: "str | dict") -> dict[str, Any]:
    """``{"name": name, key: value, ...}`` of a spec string (:func:`parse`) or a copy of a spec dict."""
    if isinstance(spec, dict):
        options = dict(spec)
        if "name" not in options:
            raise ValueError("a codec dict needs a 'name' key, e.g. {'name': 'topk', 'ratio': 0.01}")
        return options
    return parse(spec)


def make(spec: "str | dict | Any") -> Any:
    """Build a codec from a spec string, a dict ``{"name": ..., **options}`` or a codec (returned as is)."""
    if is_codec(spec):
        return spec
    options = read(spec)
    name = options.pop("name")
    cls = _REGISTRY.get(name)
    if cls is None:
        raise ValueError(f"unknown codec {name!r}; available codecs: {', '.join(available())}")
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    for key in options:
        if key not in fields:
            allowed = ", ".join(fields) or "none"
            raise ValueError(f"{name}: unknown option {key!r}; options of {name}: {allowed}")
    for key, f in fields.items():
        kind = f.type if isinstance(f.type, str) else getattr(f.type, "__name__", "")
        if key in options and "Codec" in kind and not is_codec(options[key]) and options[key] is not None:
            nested = options[key]
            if isinstance(nested, (str, dict)):
                options[key] = make(nested)
            else:
                raise ValueError(f"{name}: {key} must name a codec, got {nested!r}")
    return cls(**options)
