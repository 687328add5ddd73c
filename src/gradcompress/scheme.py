"""Scheme strings: a codec spec plus the options of what runs it, parsed and validated in one place.

A *scheme* names what one training run or benchmark row uses to average gradients::

    "int8"                                          a codec spec (our Compressor with that codec)
    "sign:momentum=0.9"                             ... plus Compressor options by name
    "int4:diloco=25"                                DiLoCo, H = 25, int4 outer gradients
    "none:diloco=50,outer=sparseloco"               DiLoCo, H = 50, SparseLoCo's outer gradients (its codec)
    "int4:diloco=50,fragments=4,delay=5"            streaming DiLoCo: 4 fragments in turn, each applied 5 steps on
    "int2:diloco=100,inner=muon"                    DiLoCo with Muon inside (MuLoCo), int2 outer gradients + EF
    "topk:ratio=0.01,values=int8,compressed_adam=true"   CompressedAdam (Adam's momentum through the codec)
    "onebitadam:warmup_steps=30"                    OneBitAdam with its own options
    "onebitadam:sync_every=4"                       ... with local steps: a sync every 4th step after the freeze
    "decoupled:topk=32,chunk=64"                    DeMo (decoupled momentum) with its own options
    "ddp", "torch-fp16", "torch-powersgd:rank=4"    PyTorch's baselines (netbench, plan, the cost model)

:func:`parse_scheme` reads any of them into one frozen :class:`Scheme`; every mistake is
one ``ValueError`` naming the option and what is allowed. An option the codec has is the
codec's (``dgc:momentum=0.9`` is DGC's own momentum); otherwise it may be one of the
Compressor's options a scheme can set (:data:`SCHEME_COMPRESSOR_OPTIONS`) or a scheme
option (:data:`SCHEME_OPTIONS`).

:func:`split_compressor_options` is the same grammar for ``Compressor(spec)``: a codec spec
whose options may also set any Compressor option (:data:`COMPRESSOR_OPTIONS`), e.g.
``"topk:ratio=0.01,momentum=0.9,warmup_steps=10"``; :func:`merge_compressor_options`
joins those with the keywords given to the Compressor (an option set in both is an error).

This module is library level: it imports nothing from :mod:`gradcompress.cli`.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping

from .spec import make, parse, read

ONEBITADAM = "onebitadam"
#: ``auto[:bandwidth=..,budget=..,every=..]``: the autopilot chooses the codec of each bucket (:mod:`gradcompress.autopilot`)
AUTO = "auto"
#: options a ``onebitadam:key=value,...`` scheme may set (passed to OneBitAdam; numbers); ``sync_every`` and
#: ``sync_ramp_steps``: local steps after the freeze (0/1 Adam's idea, :class:`gradcompress.optim.CompressedAdam`)
ONEBITADAM_OPTIONS = ("lr", "warmup_steps", "weight_decay", "eps", "sync_every", "sync_ramp_steps")
DECOUPLED = "decoupled"
#: options a ``decoupled:key=value,...`` scheme may set (passed to :class:`gradcompress.optim.DeMo`): numbers,
#: ``sign`` true/false, ``values`` a codec for the kept values (``bf16``)
DECOUPLED_OPTIONS = ("lr", "momentum_decay", "chunk", "topk", "sign", "weight_decay", "values")
#: PyTorch's own DDP schemes (netbench runs them, the cost model predicts them)
BASELINES = ("ddp", "torch-fp16", "torch-powersgd")
#: options of a scheme itself: ``diloco=H`` (DiLoCo, H inner steps per sync), ``compressed_adam=true`` and
#: ``outer=nesterov|sparseloco`` and ``outer_lr=`` (DiLoCo's outer update and its learning rate, with ``diloco=H``),
#: ``inner=`` (DiLoCo's inner optimizer, with ``diloco=H``)
SCHEME_OPTIONS = ("diloco", "compressed_adam", "outer", "outer_lr", "fragments", "delay", "mix", "inner")
#: streaming DiLoCo's options (with ``diloco=H``): :mod:`gradcompress.optim.streaming`
STREAMING_OPTIONS = ("fragments", "delay", "mix")
#: DiLoCo's outer updates (``outer=``): its own outer SGD with Nesterov momentum, and SparseLoCo's
DILOCO_OUTERS = ("nesterov", "sparseloco")
#: DiLoCo's inner optimizers (``inner=``): the task's own (``adamw`` on the LM, SGD on digits) or
#: :func:`gradcompress.optim.muon` (Muon on the hidden layers, AdamW on the rest: MuLoCo)
DILOCO_INNERS = ("task", "muon")
#: every keyword option of :class:`gradcompress.Compressor` a spec string may set (``Compressor(spec)``)
COMPRESSOR_OPTIONS = ("error_feedback", "server_error_feedback", "momentum", "warmup_steps", "min_numel", "seed",
                      "schedule", "ramp_steps", "residual_dtype", "monitor_every", "topology", "intra_node")
#: the Compressor options a scheme may set (``sign:momentum=0.9``); the CLI sets warm-up, seed and telemetry itself
SCHEME_COMPRESSOR_OPTIONS = ("momentum", "error_feedback", "server_error_feedback", "min_numel", "schedule",
                             "ramp_steps", "topology", "intra_node")
#: ``residual_dtype=NAME`` in a spec string: the torch dtype names it may give
RESIDUAL_DTYPE_NAMES = ("float32", "bfloat16", "float16")


@dataclasses.dataclass(frozen=True)
class Scheme:
    """One parsed scheme (see the module docstring); build it with :func:`parse_scheme`.

    ``kind`` is ``"ours"`` (a codec for our Compressor, DiLoCo or CompressedAdam), ``"auto"`` (the autopilot),
    ``"onebitadam"``, ``"decoupled"``, ``"ddp"``, ``"torch-fp16"`` or ``"torch-powersgd"``.
    """

    text: str  # the scheme as given, stripped
    kind: str
    codec: Any = None  # ours: the codec
    rank: int = 1  # torch-powersgd: matrix_approximation_rank
    options: tuple = ()  # ours: the Compressor options given in the scheme, as (name, value) in the given order
    diloco: int | None = None  # ours: DiLoCo's H (inner steps per sync), None: no DiLoCo
    compressed_adam: bool = False  # ours: train with CompressedAdam (the codec carries Adam's momentum)
    adam_options: tuple = ()  # onebitadam: OneBitAdam's options given in the scheme, as (name, value)
    outer: str | None = None  # ours with diloco: DiLoCo's outer update (DILOCO_OUTERS), None: not given (nesterov)
    outer_lr: float | None = None  # ours with diloco: DiLoCo's outer learning rate, None: the outer's default
    demo_options: tuple = ()  # decoupled: DeMo's options given in the scheme, as (name, value)
    stream_options: tuple = ()  # ours with diloco: streaming DiLoCo's fragments/delay/mix, as (name, value)
    inner: str | None = None  # ours with diloco: DiLoCo's inner optimizer (DILOCO_INNERS), None: the task's

    @property
    def label(self) -> str:
        """The scheme as reports name it (``ours int8``, ``ddp``)."""
        return self.text if self.kind != "ours" else f"ours {self.text}"

    @property
    def compressor(self) -> dict:
        """The Compressor options given in the scheme, by name."""
        return dict(self.options)

    @property
    def adam(self) -> dict:
        """OneBitAdam's options given in the scheme, by name."""
        return dict(self.adam_options)

    @property
    def demo(self) -> dict:
        """DeMo's options given in the scheme, by name."""
        return dict(self.demo_options)

    @property
    def stream(self) -> dict:
        """Streaming DiLoCo's options given in the scheme (``fragments``, ``delay``, ``mix``), by name."""
        return dict(self.stream_options)

    def canonical(self) -> str:
        """The scheme with the codec's every option spelled out (``int4:bucket=512,stochastic=false,diloco=25``);
        ``compressed_adam=false`` is dropped. Other kinds: the text as given."""
        if self.kind != "ours":
            return self.text
        extra = list(self.options)
        if self.diloco is not None:
            extra.append(("diloco", self.diloco))
        if self.compressed_adam:
            extra.append(("compressed_adam", True))
        if self.outer is not None:
            extra.append(("outer", self.outer))
        if self.outer_lr is not None:
            extra.append(("outer_lr", self.outer_lr))
        extra.extend(self.stream_options)
        if self.inner is not None:
            extra.append(("inner", self.inner))
        if not extra:
            return self.codec.spec
        joined = ",".join(f"{k}={str(v).lower() if isinstance(v, bool) else v}" for k, v in extra)
        return self.codec.spec + (":" if ":" not in self.codec.spec else ",") + joined


# --------------------------------------------------------------------------- reading schemes
def scheme_name(text: str) -> str:
    """The name before the first ``:`` (``"topk"`` for ``"topk:ratio=0.01"``)."""
    return str(text).strip().partition(":")[0].strip()


def parse_scheme(text: str) -> Scheme:
    """Read and check a scheme string (see the module docstring); ``ValueError`` (one clear line) if it is wrong."""
    text = str(text).strip()
    name = scheme_name(text)
    if name in ("ddp", "torch-fp16"):
        if text != name:
            raise ValueError(f"{name} takes no options, got {text!r}")
        return Scheme(text, name)
    if name == "torch-powersgd":
        return _torch_powersgd(text)
    if name == ONEBITADAM:
        return _onebitadam(text)
    if name == DECOUPLED:
        return _decoupled(text)
    if name == AUTO:  # its options are checked where it runs: Compressor("auto:...")
        return Scheme(text, AUTO)
    return _ours(text)


def _torch_powersgd(text: str) -> Scheme:
    """``torch-powersgd[:rank=R]``: PyTorch's powerSGD_hook with matrix_approximation_rank R (default 1)."""
    opts = parse(text)
    opts.pop("name")
    rank = opts.pop("rank", 1)
    if opts or isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
        raise ValueError(f"torch-powersgd takes one option, rank (an integer >= 1), got {text!r}")
    return Scheme(text, "torch-powersgd", rank=rank)


def _onebitadam(text: str) -> Scheme:
    """``onebitadam[:lr=..,warmup_steps=..,weight_decay=..,eps=..]``: every option a number."""
    opts = parse(text)
    opts.pop("name")
    bad = [k for k in opts if k not in ONEBITADAM_OPTIONS]
    if bad:
        raise ValueError(f"onebitadam: unknown option {bad[0]!r}; options of onebitadam: "
                         f"{', '.join(ONEBITADAM_OPTIONS)}")
    for k, v in opts.items():
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            raise ValueError(f"onebitadam: {k} must be a number, got {v!r}")
    return Scheme(text, ONEBITADAM, adam_options=tuple(opts.items()))


def _decoupled(text: str) -> Scheme:
    """``decoupled[:lr=..,momentum_decay=..,chunk=..,topk=..,sign=..,weight_decay=..,values=..]`` (DeMo)."""
    opts = parse(text)
    opts.pop("name")
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
    return Scheme(text, DECOUPLED, demo_options=tuple(opts.items()))


def _ours(text: str) -> Scheme:
    """A codec spec with Compressor options and scheme options (``diloco``, ``compressed_adam``)."""
    opts = parse(text)
    name = opts.pop("name")
    codec, compressor, extra = _split(name, opts, SCHEME_COMPRESSOR_OPTIONS, SCHEME_OPTIONS)
    compressed_adam = _compressed_adam(extra, codec, compressor)
    diloco = check_diloco(extra["diloco"]) if "diloco" in extra else None
    outer = check_scheme_outer(extra["outer"], diloco) if "outer" in extra else None
    outer_lr = _outer_lr(extra["outer_lr"], diloco) if "outer_lr" in extra else None
    inner = check_scheme_inner(extra["inner"], diloco) if "inner" in extra else None
    return Scheme(text, "ours", codec, options=tuple(compressor.items()), diloco=diloco,
                  compressed_adam=compressed_adam, outer=outer, outer_lr=outer_lr,
                  stream_options=_streaming(extra, diloco), inner=inner)


def _streaming(extra: dict, diloco: int | None) -> tuple:
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


def check_scheme_outer(value: Any, diloco: int | None) -> str:
    """``outer=nesterov|sparseloco``: one of :data:`DILOCO_OUTERS`, and only next to ``diloco=H``."""
    if value not in DILOCO_OUTERS:
        raise ValueError(f"outer must be one of {', '.join(DILOCO_OUTERS)} (DiLoCo's outer update), got {value!r}")
    if diloco is None:
        raise ValueError(f"outer={value} is DiLoCo's outer update; give it with diloco=H (e.g. "
                         f"none:diloco=50,outer={value})")
    return value


def check_scheme_inner(value: Any, diloco: int | None) -> str:
    """``inner=task|muon``: one of :data:`DILOCO_INNERS`, and only next to ``diloco=H``."""
    if value not in DILOCO_INNERS:
        raise ValueError(f"inner must be one of {', '.join(DILOCO_INNERS)} (DiLoCo's inner optimizer), got {value!r}")
    if diloco is None:
        raise ValueError(f"inner={value} is DiLoCo's inner optimizer; give it with diloco=H (e.g. "
                         f"int2:diloco=100,inner={value})")
    return value


def check_diloco(value: Any) -> int:
    """``diloco=H``: H must be an integer >= 1 (inner steps per sync); ``ValueError`` otherwise."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"diloco must be an integer >= 1 (inner steps per sync), got {value!r}")
    return value


def _compressed_adam(extra: dict, codec: Any, compressor: dict) -> bool:
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


def _split(name: str, opts: dict, compressor_names: tuple, scheme_names: tuple = ()) -> tuple[Any, dict, dict]:
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


def unknown_option_message(name: str, key: str, fields: list[str], compressor_names: tuple,
                           scheme_names: tuple = ()) -> str:
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


def split_compressor_options(spec: "str | Mapping[str, Any]") -> tuple[str, dict]:
    """``Compressor(spec)``'s grammar: ``"topk:ratio=0.01,momentum=0.9,warmup_steps=10"`` ->
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
    return codec.spec, compressor


def merge_compressor_options(from_spec: Mapping[str, Any], keywords: Mapping[str, Any], spec: Any = None) -> dict:
    """The Compressor options of the spec string and those given as keywords, together; ``ValueError``
    for an option given in both places (``spec``: the spec, for the message)."""
    both = [k for k in from_spec if k in keywords]
    if both:
        where = f" ({spec!r})" if spec is not None else ""
        raise ValueError(f"Compressor: {both[0]} is given both in the spec{where} and as a keyword; "
                         "set it in one place")
    return {**from_spec, **keywords}


__all__ = ["STREAMING_OPTIONS", "AUTO", "BASELINES", "COMPRESSOR_OPTIONS", "DECOUPLED", "DECOUPLED_OPTIONS", "DILOCO_INNERS", "DILOCO_OUTERS", "check_scheme_inner", "check_scheme_outer", "ONEBITADAM", "ONEBITADAM_OPTIONS", "RESIDUAL_DTYPE_NAMES",
           "SCHEME_COMPRESSOR_OPTIONS", "SCHEME_OPTIONS", "Scheme", "check_diloco", "codec_options",
           "compressor_value", "merge_compressor_options", "parse_scheme", "scheme_name",
           "split_compressor_options", "unknown_option_message"]
