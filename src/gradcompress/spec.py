"""The spec grammar, in one place: every spec string or dict is read here, once, into one typed, frozen value.

A *codec spec* names a registered codec and sets some of its options::

    "topk:ratio=0.01,values=int8"
    {"name": "topk", "ratio": 0.01, "values": {"name": "int8", "bucket": 128}}

Values in a string are read as int, float, bool (``true``/``false``) or, for options
that hold a codec, a nested codec name. Nothing is evaluated or unpickled. Every
error is a ``ValueError`` that names the codec, the option and what is allowed.

Built on it, and read here too:

* :func:`make`: a codec spec -> the codec;
* :func:`parse_compressor`: ``Compressor(spec, **keywords)``'s spec, whose options may also set the Compressor's
  (``"topk:ratio=0.01,momentum=0.9"``), or ``"auto:..."`` (the autopilot's options, :class:`Auto`) -> a
  :class:`Scheme`;
* :func:`parse_scheme`: a *scheme*, what one training run or benchmark row uses (a codec spec with Compressor and
  scheme options such as ``diloco=H``, ``auto``, ``onebitadam``, ``decoupled``, PyTorch's baselines; the list is
  :mod:`gradcompress.scheme`'s docstring) -> a :class:`Scheme`.

Everything else reads the :class:`Scheme` (and :class:`Auto`); no other module splits spec text. Those values and
the vocabulary of schemes (the kinds, the options each may set, the autopilot's budgets) are defined in
:mod:`gradcompress.spec_values`, which reads no spec text, and re-exported here.
:mod:`gradcompress.scheme` and :mod:`gradcompress.autospec` re-export these names.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Protocol, TypeVar
from collections.abc import Callable, Mapping

from .spec_options import Range as Range, option as option, validate as validate  # a codec's options (re-exported)
from .spec_values import (ONEBITADAM as ONEBITADAM, AUTO as AUTO, ONEBITADAM_OPTIONS as ONEBITADAM_OPTIONS,
                          DECOUPLED as DECOUPLED, DECOUPLED_OPTIONS as DECOUPLED_OPTIONS, BASELINES as BASELINES,
                          SCHEME_OPTIONS as SCHEME_OPTIONS, STREAMING_OPTIONS as STREAMING_OPTIONS,
                          DILOCO_OUTERS as DILOCO_OUTERS, DILOCO_INNERS as DILOCO_INNERS,
                          COMPRESSOR_OPTIONS as COMPRESSOR_OPTIONS,
                          SCHEME_COMPRESSOR_OPTIONS as SCHEME_COMPRESSOR_OPTIONS,
                          RESIDUAL_DTYPE_NAMES as RESIDUAL_DTYPE_NAMES, BUDGETS as BUDGETS,
                          CRITICAL_DROPS as CRITICAL_DROPS, AUTO_OPTIONS as AUTO_OPTIONS, Options as Options,
                          Auto as Auto, Scheme as Scheme)  # the values and the vocabulary (re-exported)
from .units import parse_rate

_REGISTRY: dict[str, type] = {}


class _Named(Protocol):  # what register_codec() needs of a codec class (codecs.base imports this module, not back)
    name: str


_C = TypeVar("_C", bound=type[_Named])


def register_codec(name: str) -> Callable[[_C], _C]:
    """Class decorator that makes a codec class reachable from :func:`make` under ``name``."""

    def deco(cls: _C) -> _C:
        if name in _REGISTRY:
            raise ValueError(f"codec name {name!r} registered twice")
        cls.name = name
        _REGISTRY[name] = cls
        return cls

    return deco


#: the former name of :func:`register_codec` (``@gradcompress.spec.register("name")``), kept for codecs written
#: against it
register = register_codec


def available() -> list[str]:
    """Every registered codec name, sorted: the names :func:`make` accepts.

    The codec families register themselves when :mod:`gradcompress.codecs` is imported, which importing
    :mod:`gradcompress` does. What each codec sends and its bias: ``docs/codecs.md``.

    Returns:
        A new sorted list of names (``"bf16"``, ``"int8"``, ``"powersgd"``, ``"sign"``, ``"topk"``, ...).

    Example::

        >>> import gradcompress
        >>> "int8" in gradcompress.available() and "powersgd" in gradcompress.available()
        True
    """
    return sorted(_REGISTRY)


def is_codec(obj: Any) -> bool:
    """True for a codec object (anything with ``encode``, ``decode`` and an ``aggregation``)."""
    return not isinstance(obj, (str, dict, type)) and all(hasattr(obj, a) for a in ("encode", "decode", "aggregation"))


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


def read(spec: str | dict[str, Any]) -> dict[str, Any]:
    """``{"name": name, key: value, ...}`` of a spec string (:func:`parse`) or a copy of a spec dict."""
    if isinstance(spec, dict):
        options = dict(spec)
        if "name" not in options:
            raise ValueError("a codec dict needs a 'name' key, e.g. {'name': 'topk', 'ratio': 0.01}")
        return options
    return parse(spec)


def take_options(text: str, keys: tuple[str, ...]) -> tuple[str, list[tuple[str, str]]]:
    """The options named ``keys`` taken out of a spec string as written, in the order given (strings: the caller
    checks them), and the spec without them: ``take_options("int8:layout=hsdp,bucket=64", ("layout",))`` is
    ``("int8:bucket=64", [("layout", "hsdp")])``. Items are split at every comma; a key is compared as written."""
    name, _, rest = text.partition(":")
    kept, taken = [], []
    for item in filter(None, (s.strip() for s in rest.split(","))):
        key, _, value = item.partition("=")
        if key in keys:
            taken.append((key, value))
        else:
            kept.append(item)
    return (f"{name}:{','.join(kept)}" if kept else name), taken


def make(spec: str | dict[str, Any] | Any) -> Any:
    """Build a codec from a spec string, a dict ``{"name": ..., **options}`` or a codec (returned as is).

    A codec turns a tensor into a :class:`gradcompress.Payload` (``encode``: what is sent over the wire,
    ``payload.nbytes`` bytes) and back (``decode``); on its own it communicates nothing. Sizes and bias
    (``docs/codecs.md``): ``int8`` 1.008 bytes per element, biased (unbiased with ``stochastic=true``); ``qsgd``
    (`Alistarh et al., 2017 <https://arxiv.org/abs/1610.02132>`_) and ``terngrad`` (`Wen et al., 2017
    <https://arxiv.org/abs/1705.07878>`_) unbiased; ``sign`` (`Bernstein et al., 2018
    <https://arxiv.org/abs/1802.04434>`_), ``topk``, ``dgc`` (`Lin et al., 2018 <https://arxiv.org/abs/1712.01887>`_)
    and ``powersgd`` (`Vogels et al., 2019 <https://arxiv.org/abs/1905.13727>`_) biased: use error feedback.

    Args:
        spec: ``"name"`` or ``"name:key=value,..."`` (``"topk:ratio=0.01,values=int8"``; values are int, float,
            ``true``/``false`` or a nested codec ``{int8:bucket=128}``), a dict (``{"name": "topk", "ratio":
            0.01}``), or a codec. The names: :func:`available`; each codec's options: ``docs/codecs.md``.

    Returns:
        The codec: a frozen dataclass whose fields are its options.

    Raises:
        ValueError: an unknown codec or option, a value of the wrong type or out of range, a malformed string
            or dict; the message names the codec, the option and what is allowed.

    Example::

        >>> import torch, gradcompress
        >>> codec = gradcompress.make("int8")
        >>> codec
        Int8(bucket=512, stochastic=False)
        >>> x = torch.randn(1000)
        >>> payload = codec.encode(x)
        >>> payload.nbytes           # 1000 int8 codes and 2 float32 scales, against float32's 4000 bytes
        1008
        >>> bool((codec.decode(payload) - x).abs().max() <= x.abs().max() / 127)
        True
    """
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


# --------------------------------------------------------------------------- reading a scheme
def scheme_name(text: str) -> str:
    """The name before the first ``:`` (``"topk"`` for ``"topk:ratio=0.01"``)."""
    return str(text).strip().partition(":")[0].strip()


def is_auto(spec: Any) -> bool:
    """Whether ``spec`` is the autopilot's (``"auto"``, ``"auto:..."`` or ``{"name": "auto", ...}``)."""
    if isinstance(spec, str):
        return scheme_name(spec) == AUTO
    return isinstance(spec, dict) and spec.get("name") == AUTO


def parse_scheme(text: str) -> Scheme:
    """Read and check a scheme string (:mod:`gradcompress.scheme` lists them) in one pass; ``ValueError`` (one clear
    line) if it is wrong."""
    text = str(text).strip()
    name = scheme_name(text)
    if name in ("ddp", "torch-fp16"):
        if text != name:
            raise ValueError(f"{name} takes no options, got {text!r}")
        return Scheme(text, name)
    opts = parse(text)
    opts.pop("name")
    if name == "torch-powersgd":
        return _torch_powersgd(text, opts)
    if name == ONEBITADAM:
        return _onebitadam(text, opts)
    if name == DECOUPLED:
        return _decoupled(text, opts)
    if name == AUTO:
        return _auto(text, text, opts, {})
    return _ours(text, name, opts)


def parse_compressor(spec: Any, keywords: Mapping[str, Any] | None = None) -> Scheme:
    """``Compressor(spec, **keywords)``'s grammar, in one pass: a codec spec string or dict whose options may also set
    any Compressor option (:data:`COMPRESSOR_OPTIONS`; ``"topk:ratio=0.01,momentum=0.9"``), an ``auto`` spec (its
    own options and the Compressor's) or a codec (taken as it is). The Scheme's ``options`` are the spec's and the
    keywords' together; ``ValueError`` for an option given in both places, or anything the grammar refuses."""
    given = dict(keywords or {})
    if not isinstance(spec, (str, dict)):
        codec = make(spec)  # a codec as it is; anything else is refused, naming what a spec may be
        return Scheme(codec.spec, "ours", codec, options=tuple(given.items()))
    opts = read(spec)
    name = opts.pop("name")
    text = spec.strip() if isinstance(spec, str) else ""
    if name == AUTO:
        return _auto(text, spec, opts, given)
    codec, compressor, _ = _split(name, opts, COMPRESSOR_OPTIONS)
    options = merge_compressor_options(compressor, given, spec=spec) if compressor else given
    return Scheme(text or codec.spec, "ours", codec, options=tuple(options.items()))


def _auto(text: str, spec: Any, opts: dict[str, Any], given: Mapping[str, Any]) -> Scheme:
    """``auto:bandwidth=100mbit,warmup_steps=5``: the autopilot's options and the Compressor's (merged with
    ``given``, the keywords), the codec dense until the autopilot decides."""
    own = {k: opts.pop(k) for k in list(opts) if k in AUTO_OPTIONS}
    unknown = [k for k in opts if k not in COMPRESSOR_OPTIONS]
    if unknown:
        raise ValueError(unknown_option_message(AUTO, unknown[0], list(AUTO_OPTIONS), COMPRESSOR_OPTIONS))
    from_spec = {k: compressor_value(k, v) for k, v in opts.items()}
    options = merge_compressor_options(from_spec, given, spec=spec)
    auto = parse_auto(own)
    return Scheme(text or auto.text(), AUTO, make("none"), options=tuple(options.items()), auto=auto)


def parse_auto(options: Mapping[str, Any]) -> Auto:
    """The autopilot's options from ``options`` (``ValueError`` naming the option and what is allowed)."""
    rate = options.get("bandwidth")
    if rate is not None:
        try:
            rate = parse_rate(rate)
        except ValueError as err:
            raise ValueError(f"auto: bandwidth: {err}") from None
    budget = options.get("budget", "safe")
    if budget not in BUDGETS:
        raise ValueError(f"auto: budget must be one of {', '.join(BUDGETS)}, got {budget!r}")
    every = options.get("every", 20)
    if isinstance(every, bool) or not isinstance(every, int) or every < 1:
        raise ValueError(f"auto: every must be an integer >= 1, got {every!r}")
    allocate = options.get("allocate", False)
    if not isinstance(allocate, bool) and allocate != "adam":
        raise ValueError(f"auto: allocate must be true, adam or false, got {allocate!r}")
    critical = options.get("critical", 0.5)
    if isinstance(critical, bool) or not isinstance(critical, (int, float)) or not critical >= 0:
        raise ValueError(f"auto: critical must be a number >= 0 (0: off), got {critical!r}")
    cache = options.get("cache")
    if cache is not None and (not isinstance(cache, str) or not cache.strip()):
        raise ValueError(f"auto: cache must be a file path or off, got {cache!r}")
    return Auto(rate, budget, every, allocate, float(critical), cache)


def _torch_powersgd(text: str, opts: dict[str, Any]) -> Scheme:
    """``torch-powersgd[:rank=R]``: PyTorch's powerSGD_hook with matrix_approximation_rank R (default 1)."""
    rank = opts.pop("rank", 1)
    if opts or isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
        raise ValueError(f"torch-powersgd takes one option, rank (an integer >= 1), got {text!r}")
    return Scheme(text, "torch-powersgd", rank=rank)


def _onebitadam(text: str, opts: dict[str, Any]) -> Scheme:
    """``onebitadam[:lr=..,warmup_steps=..,weight_decay=..,eps=..]``: every option a number."""
    bad = [k for k in opts if k not in ONEBITADAM_OPTIONS]
    if bad:
        raise ValueError(f"onebitadam: unknown option {bad[0]!r}; options of onebitadam: "
                         f"{', '.join(ONEBITADAM_OPTIONS)}")
    for k, v in opts.items():
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            raise ValueError(f"onebitadam: {k} must be a number, got {v!r}")
    return Scheme(text, ONEBITADAM, options=tuple(opts.items()))


def _decoupled(text: str, opts: dict[str, Any]) -> Scheme:
    """``decoupled[:lr=..,momentum_decay=..,chunk=..,topk=..,sign=..,weight_decay=..,values=..]`` (DeMo)."""
    bad = [k for k in opts if k not in DECOUPLED_OPTIONS]
    if bad:
        raise ValueError(f"decoupled: unknown option {bad[0]!r}; options of decoupled: {', '.join(DECOUPLED_OPTIONS)}")
    for k, v in opts.items():
        if k == "sign":
            if not isinstance(v, bool):
                raise ValueError(f"decoupled: sign must be true or false, got {v!r}")
        elif k == "values":
            try:
                opts[k] = make(v).spec  # a codec name or {spec}
            except ValueError as err:
                raise ValueError(f"decoupled: values: {err}") from None
        elif k in ("chunk", "topk") and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
            raise ValueError(f"decoupled: {k} must be an integer >= 1, got {v!r}")
        elif isinstance(v, bool) or not isinstance(v, (int, float)):
            raise ValueError(f"decoupled: {k} must be a number, got {v!r}")
    return Scheme(text, DECOUPLED, options=tuple(opts.items()))


def _ours(text: str, name: str, opts: dict[str, Any]) -> Scheme:
    """A codec spec with Compressor options and scheme options (``diloco``, ``compressed_adam``)."""
    codec, compressor, extra = _split(name, opts, SCHEME_COMPRESSOR_OPTIONS, SCHEME_OPTIONS)
    compressed_adam = _compressed_adam(extra, codec, compressor)
    diloco = check_diloco(extra["diloco"]) if "diloco" in extra else None
    outer = check_scheme_outer(extra["outer"], diloco) if "outer" in extra else None
    outer_lr = _outer_lr(extra["outer_lr"], diloco) if "outer_lr" in extra else None
    inner = check_scheme_inner(extra["inner"], diloco) if "inner" in extra else None
    return Scheme(text, "ours", codec, options=tuple(compressor.items()), diloco=diloco,
                  compressed_adam=compressed_adam, outer=outer, outer_lr=outer_lr,
                  stream_options=_streaming(extra, diloco), inner=inner)


def _streaming(extra: dict[str, Any], diloco: int | None) -> Options:
    """``fragments=F``, ``delay=tau``, ``mix=a`` (streaming DiLoCo), only next to ``diloco=H``, checked as
    :class:`gradcompress.optim.DiLoCo` checks them."""
    given = {k: extra[k] for k in STREAMING_OPTIONS if k in extra}
    if not given:
        return ()
    if diloco is None:
        raise ValueError(f"{', '.join(given)} are streaming DiLoCo's options; give them with diloco=H "
                         "(e.g. int4:diloco=50,fragments=4,delay=5)")
    fragments, delay = given.get("fragments", 1), given.get("delay", 0)
    if isinstance(fragments, bool) or not isinstance(fragments, int) or fragments < 1:
        raise ValueError(f"fragments must be an integer >= 1 (streaming DiLoCo's fragments), got {fragments!r}")
    if isinstance(delay, bool) or not isinstance(delay, int) or not 0 <= delay < diloco:
        raise ValueError(f"delay must be an integer from 0 to diloco - 1 ({diloco - 1}), got {delay!r}")
    mix = given.get("mix", 1.0)
    if isinstance(mix, bool) or not isinstance(mix, (int, float)) or not 0 < mix <= 1:
        raise ValueError(f"mix must be a number in (0, 1] (the global fragment's weight), got {mix!r}")
    return tuple(given.items())


def _outer_lr(value: Any, diloco: int | None) -> float:
    """``outer_lr=``: a number > 0, only next to ``diloco=H``."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise ValueError(f"outer_lr must be a number > 0 (DiLoCo's outer learning rate), got {value!r}")
    if diloco is None:
        raise ValueError("outer_lr is DiLoCo's outer learning rate; give it with diloco=H")
    return float(value)


def _diloco_choice(key: str, value: Any, diloco: int | None, allowed: tuple[str, ...], what: str,
                   example: str) -> str:
    """``key=value`` where ``value`` is one of ``allowed`` (DiLoCo's ``what``), and only next to ``diloco=H``."""
    if value not in allowed:
        raise ValueError(f"{key} must be one of {', '.join(allowed)} (DiLoCo's {what}), got {value!r}")
    if diloco is None:
        raise ValueError(f"{key}={value} is DiLoCo's {what}; give it with diloco=H (e.g. {example}{value})")
    return str(value)


def check_scheme_outer(value: Any, diloco: int | None) -> str:
    """``outer=nesterov|sparseloco``: one of :data:`DILOCO_OUTERS`, and only next to ``diloco=H``."""
    return _diloco_choice("outer", value, diloco, DILOCO_OUTERS, "outer update", "none:diloco=50,outer=")


def check_scheme_inner(value: Any, diloco: int | None) -> str:
    """``inner=task|muon``: one of :data:`DILOCO_INNERS`, and only next to ``diloco=H``."""
    return _diloco_choice("inner", value, diloco, DILOCO_INNERS, "inner optimizer", "int2:diloco=100,inner=")


def check_diloco(value: Any) -> int:
    """``diloco=H``: H must be an integer >= 1 (inner steps per sync); ``ValueError`` otherwise."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"diloco must be an integer >= 1 (inner steps per sync), got {value!r}")
    return value


def _compressed_adam(extra: dict[str, Any], codec: Any, compressor: dict[str, Any]) -> bool:
    """``compressed_adam=true|false``; true takes only the codec's own options and a codec without momentum."""
    if "compressed_adam" not in extra:
        return False
    on = extra["compressed_adam"]
    if not isinstance(on, bool):
        raise ValueError(f"compressed_adam must be true or false, got {on!r}")
    if on:
        if compressor or "diloco" in extra:
            names = ", ".join(list(compressor) + (["diloco"] if "diloco" in extra else []))
            raise ValueError(f"compressed_adam=true: CompressedAdam exchanges Adam's momentum itself; the option(s) "
                             f"{names} do not apply (only the codec's own options do)")
        if codec.carries_momentum:
            raise ValueError(f"compressed_adam=true: {codec.name} keeps its own momentum; use topk")
    return on


# --------------------------------------------------------------------------- codec and Compressor options
def codec_options(name: str) -> list[str]:
    """The option names of the codec ``name`` (``ValueError`` listing the codecs if there is none)."""
    return [f.name for f in dataclasses.fields(make(name)) if f.init]


def _split(name: str, opts: dict[str, Any], compressor_names: tuple[str, ...],
           scheme_names: tuple[str, ...] = ()) -> tuple[Any, dict[str, Any], dict[str, Any]]:
    """Options of a spec named ``name`` into (the codec, Compressor options, scheme options).

    An option the codec has is the codec's; scheme options are never the codec's. Values of
    Compressor options are converted (:func:`compressor_value`). ``ValueError`` for an option
    that is none of these, naming every option allowed.
    """
    fields = codec_options(name)
    extra = {k: opts.pop(k) for k in list(opts) if k in scheme_names}
    unknown = [k for k in opts if k not in fields and k not in compressor_names]
    if unknown:
        raise ValueError(unknown_option_message(name, unknown[0], fields, compressor_names, scheme_names))
    compressor = {k: compressor_value(k, opts.pop(k)) for k in list(opts) if k not in fields}
    return make({"name": name, **opts}), compressor, extra


def unknown_option_message(name: str, key: str, fields: list[str], compressor_names: tuple[str, ...],
                           scheme_names: tuple[str, ...] = ()) -> str:
    """``topk: unknown option 'x'; options of topk: ...; Compressor options: ...[; scheme options: ...]``."""
    msg = (f"{name}: unknown option {key!r}; options of {name}: {', '.join(fields) or 'none'}; "
           f"Compressor options: {', '.join(compressor_names)}")
    return msg + (f"; scheme options: {', '.join(scheme_names)}" if scheme_names else "")


def compressor_value(key: str, value: Any) -> Any:
    """A Compressor option's value as read from a string: ``residual_dtype=bfloat16`` becomes
    ``torch.bfloat16``; ``error_feedback`` must be true, false or auto; others as read (the
    Compressor checks them)."""
    if key == "error_feedback" and value not in (True, False, "auto"):
        raise ValueError(f"error_feedback must be true, false or auto, got {value!r}")
    if key == "residual_dtype" and isinstance(value, str):
        if value not in RESIDUAL_DTYPE_NAMES:
            raise ValueError(f"residual_dtype must be one of {', '.join(RESIDUAL_DTYPE_NAMES)}, got {value!r}")
        import torch

        return getattr(torch, value)
    return value


def split_compressor_options(spec: str | Mapping[str, Any]) -> tuple[str, dict[str, Any]]:
    """``Compressor(spec)``'s grammar for a codec: ``"topk:ratio=0.01,momentum=0.9,warmup_steps=10"`` ->
    ``("topk:values=none,ratio=0.01", {"momentum": 0.9, "warmup_steps": 10})``.

    ``spec`` is a spec string or a dict ``{"name": ..., **options}``. Options the codec has
    stay the codec's (``dgc:momentum=0.9``); the others must be :data:`COMPRESSOR_OPTIONS`
    (values converted by :func:`compressor_value`). Returns the codec's canonical spec and
    the Compressor options by name; ``ValueError`` naming the codec's and the Compressor's
    options for anything else.
    """
    opts = read(dict(spec) if isinstance(spec, Mapping) else spec)
    name = opts.pop("name")
    codec, compressor, _ = _split(name, opts, COMPRESSOR_OPTIONS)
    return str(codec.spec), compressor


def merge_compressor_options(from_spec: Mapping[str, Any], keywords: Mapping[str, Any],
                             spec: Any = None) -> dict[str, Any]:
    """The Compressor options of the spec string and those given as keywords, together; ``ValueError``
    for an option given in both places (``spec``: the spec, for the message)."""
    both = [k for k in from_spec if k in keywords]
    if both:
        where = f" ({spec!r})" if spec is not None else ""
        raise ValueError(f"Compressor: {both[0]} is given both in the spec{where} and as a keyword; "
                         "set it in one place")
    return {**from_spec, **keywords}
