"""The values a spec is read into, and the vocabulary of schemes: no spec text is read here.

:mod:`gradcompress.spec` reads every spec string or dict (the one place that does) into a :class:`Scheme` (and, for
``"auto:..."``, an :class:`Auto`); this module holds those frozen values and the names and option tables the reading
checks against (the scheme kinds, the options each kind may set, the autopilot's error budgets). Import them from
:mod:`gradcompress.spec` (or :mod:`gradcompress.scheme`, :mod:`gradcompress.autospec`), which re-export them.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from .units import format_rate


# --------------------------------------------------------------------------- the vocabulary of schemes
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
#: the codecs each error budget of ``auto`` may choose (``budget=``; :mod:`gradcompress.autospec` says why)
BUDGETS = {
    "safe": ("none", "bf16", "int8", "int4"),
    "any": ("none", "bf16", "int8", "int4", "powersgd:rank=4", "powersgd:rank=1", "sign", "topk:ratio=0.01"),
}
#: the codecs a budget leaves out in a critical regime (``critical=``)
CRITICAL_DROPS = {"safe": ("int4",), "any": ("powersgd:rank=4", "powersgd:rank=1", "sign", "topk:ratio=0.01")}
#: the autopilot's own options (``auto:bandwidth=..,budget=..``; :mod:`gradcompress.autospec` documents them)
AUTO_OPTIONS = ("bandwidth", "budget", "every", "allocate", "critical", "cache")

Options = tuple[tuple[str, Any], ...]  # options as (name, value), in the order given


# --------------------------------------------------------------------------- the values
@dataclasses.dataclass(frozen=True)
class Auto:
    """The autopilot's options (:mod:`gradcompress.autospec`). ``bandwidth`` in bit/s, or None: measured."""

    bandwidth: float | None = None
    budget: str = "safe"
    every: int = 20
    allocate: bool | str = False  # False, True (squared error) or "adam" (error weighed by 1/v)
    critical: float = 0.5
    cache: str | None = dataclasses.field(default=None, compare=False)

    @property
    def candidates(self) -> tuple[str, ...]:
        """The codec specs the budget allows, ``"none"`` (dense) first."""
        return BUDGETS[self.budget]

    @property
    def critical_candidates(self) -> tuple[str, ...]:
        """The candidates in a critical regime."""
        return tuple(c for c in self.candidates if c not in CRITICAL_DROPS[self.budget])

    def text(self) -> str:
        """``auto:bandwidth=..,budget=..,every=..[,critical=..][,allocate=..]``: what the configuration text names."""
        rate = "measured" if self.bandwidth is None else format_rate(self.bandwidth).replace(" ", "")
        allocate = f",allocate={'true' if self.allocate is True else self.allocate}" if self.allocate else ""
        critical = "" if self.critical == 0.5 else f",critical={self.critical:g}"  # the default unsaid: old texts hold
        return f"auto:bandwidth={rate},budget={self.budget},every={self.every}{critical}{allocate}"


@dataclasses.dataclass(frozen=True)
class Scheme:
    """One spec, parsed and checked: what :func:`gradcompress.spec.parse_scheme` (a scheme) and
    :func:`gradcompress.spec.parse_compressor` (``Compressor(spec, **keywords)``) build, and what everything else
    reads.

    ``kind`` is ``"ours"`` (a codec for our Compressor, DiLoCo or CompressedAdam), ``"auto"`` (the autopilot),
    ``"onebitadam"``, ``"decoupled"``, ``"ddp"``, ``"torch-fp16"`` or ``"torch-powersgd"``.
    """

    text: str  # the scheme as given, stripped
    kind: str
    codec: Any = None  # ours: the codec; auto: none (dense, until the autopilot decides)
    rank: int = 1  # torch-powersgd: matrix_approximation_rank
    #: the kind's own options as (name, value), in the order given: ours and auto, the Compressor's (by
    #: :func:`gradcompress.spec.parse_compressor`: the spec's and the keywords); onebitadam, OneBitAdam's;
    #: decoupled, DeMo's
    options: Options = ()
    diloco: int | None = None  # ours: DiLoCo's H (inner steps per sync), None: no DiLoCo
    compressed_adam: bool = False  # ours: train with CompressedAdam (the codec carries Adam's momentum)
    outer: str | None = None  # ours with diloco: DiLoCo's outer update (DILOCO_OUTERS), None: not given (nesterov)
    outer_lr: float | None = None  # ours with diloco: DiLoCo's outer learning rate, None: the outer's default
    stream_options: Options = ()  # ours with diloco: streaming DiLoCo's fragments/delay/mix, as (name, value)
    inner: str | None = None  # ours with diloco: DiLoCo's inner optimizer (DILOCO_INNERS), None: the task's
    auto: Auto | None = None  # auto: the autopilot's options

    @property
    def label(self) -> str:
        """The scheme as reports name it (``ours int8``, ``ddp``)."""
        return self.text if self.kind != "ours" else f"ours {self.text}"

    def _own(self, kind: str) -> dict[str, Any]:
        return dict(self.options) if self.kind == kind else {}

    @property
    def compressor(self) -> dict[str, Any]:
        """The Compressor options given in a codec's scheme, by name (auto's stay in its text, read whole)."""
        return self._own("ours")

    @property
    def adam(self) -> dict[str, Any]:
        """OneBitAdam's options given in the scheme, by name."""
        return self._own(ONEBITADAM)

    @property
    def demo(self) -> dict[str, Any]:
        """DeMo's options given in the scheme, by name."""
        return self._own(DECOUPLED)

    @property
    def stream(self) -> dict[str, Any]:
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
        spec: str = self.codec.spec
        if not extra:
            return spec
        joined = ",".join(f"{k}={str(v).lower() if isinstance(v, bool) else v}" for k, v in extra)
        return spec + (":" if ":" not in spec else ",") + joined
