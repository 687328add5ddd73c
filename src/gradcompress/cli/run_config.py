"""What one run of ``gradcompress demo`` / ``train`` is: :class:`RunConfig`, in four small settings by what they
configure (the task trained, the optimizer, the exchange, the output), and what it derives from them (the Compressor
arguments, the optimizer's keywords, the texts the CLI prints)."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any, Protocol, cast

import torch
import torch.nn as nn

from ..factory import Run, diloco_options
from ..scheme import AUTO, DECOUPLED, ONEBITADAM, Scheme
from .common import CLIError
from .schemes import parse_cli_scheme

if TYPE_CHECKING:
    from ..codecs import Codec

TASK_NAMES = ("digits", "lm")


class TrainingTask(Protocol):
    """What :meth:`RunConfig.setting` reads of a task (:class:`gradcompress.cli.task.DigitsTask`, ``LMTask``)."""

    def optimizer(self, params: Any, cfg: RunConfig) -> torch.optim.Optimizer: ...

    def onebitadam_extra(self) -> dict[str, Any]: ...

    def shard_units(self, model: nn.Module) -> list[nn.Module]: ...


class MuonTask(TrainingTask, Protocol):
    """A task that also builds ``inner=muon``'s optimizer (the lm task)."""

    def muon(self, model: nn.Module, cfg: RunConfig) -> torch.optim.Optimizer: ...


@dataclasses.dataclass(frozen=True)
class TaskSettings:
    """What is trained and for how long: the task (``digits``, ``lm``), its model (the MLP's hidden width, the lm's
    size), the seed, the steps and the per-worker batch size."""

    task: str = "digits"
    lm_size: str = "small"  # lm: the model's size (gradcompress.testbed.lm.shape)
    hidden: int = 256
    seed: int = 0
    steps: int = 300
    batch_size: int = 32


@dataclasses.dataclass(frozen=True)
class OptimizerSettings:
    """The task's optimizer: ``lr=None`` picks the default for the scheme's optimiser; SGD's momentum; the dense Adam
    steps of onebitadam / compressed_adam (None: 20 % of the steps); DiLoCo's sync_every (0: no DiLoCo)."""

    lr: float | None = None
    momentum: float = 0.9
    adam_warmup: int | None = None
    diloco: int = 0  # > 0: DiLoCo with this sync_every (inner: the usual optimizer, no DDP)


@dataclasses.dataclass(frozen=True)
class ExchangeSettings:
    """How the gradients are exchanged: the scheme (a codec spec, its options may set the Compressor's), the
    Compressor's error feedback, min_numel, dense warm-up steps and topology, FSDP / HSDP and FSDP's params=."""

    scheme: str = "none"
    error_feedback: bool | str = "auto"
    min_numel: int = 1024
    warmup_steps: int = 5
    topology: Any = "auto"  # the Compressor's / optimizer's topology= (an int G: nodes of G workers)
    fsdp: bool = False
    hsdp: int = 0  # with fsdp, > 0: HSDP over nodes of this many workers (replica all-reduce compressed)
    params: str | None = None  # with fsdp: register_fsdp's params= ("int8", "bf16": the parameter all-gather)


@dataclasses.dataclass(frozen=True)
class OutputSettings:
    """What a run reports while it trains: progress every this many steps, the Compressor's telemetry (the demo
    plots it; 0: off), rank 0's evaluation every this many steps (0: off; lm: validation loss)."""

    progress_every: int = 5
    monitor_every: int = 0
    eval_every: int = 0


@dataclasses.dataclass(frozen=True, init=False)
class RunConfig:
    """One training run. ``lr=None`` picks the default for the scheme's optimiser.

    ``scheme`` is a codec spec whose options may also set the Compressor's
    :data:`gradcompress.cli.task.COMPRESSOR_OPTIONS` (``sign:momentum=0.9`` is the sign codec with momentum
    correction); everything not set there is the library's default.

    Built with the keywords of its settings (``RunConfig(scheme="int8", steps=100, task="lm")``), kept as the four
    settings (:attr:`training`, :attr:`optim`, :attr:`exchange`, :attr:`output`); every keyword reads back as an
    attribute (``cfg.steps``). A ``diloco=H`` in the scheme sets :attr:`diloco`.
    """

    training: TaskSettings
    optim: OptimizerSettings
    exchange: ExchangeSettings
    output: OutputSettings

    def __init__(self, scheme: str = "none", steps: int = 300, batch_size: int = 32, lr: float | None = None,
                 momentum: float = 0.9, warmup_steps: int = 5, error_feedback: bool | str = "auto",
                 min_numel: int = 1024, seed: int = 0, hidden: int = 256, progress_every: int = 5,
                 task: str = "digits", monitor_every: int = 0, fsdp: bool = False, hsdp: int = 0,
                 params: str | None = None, diloco: int = 0, adam_warmup: int | None = None, topology: Any = "auto",
                 eval_every: int = 0, lm_size: str = "small") -> None:
        h = parse_cli_scheme(scheme).diloco if task in TASK_NAMES else None
        parts = {"training": TaskSettings(task, lm_size, hidden, seed, steps, batch_size),
                 "optim": OptimizerSettings(lr, momentum, adam_warmup, diloco if h is None else h),
                 "exchange": ExchangeSettings(scheme, error_feedback, min_numel, warmup_steps, topology, fsdp, hsdp,
                                              params),
                 "output": OutputSettings(progress_every, monitor_every, eval_every)}
        for name, part in parts.items():
            object.__setattr__(self, name, part)  # frozen: set once, here
        self._check()

    # the keywords, read back from their settings
    @property
    def task(self) -> str:
        return self.training.task

    @property
    def lm_size(self) -> str:
        return self.training.lm_size

    @property
    def hidden(self) -> int:
        return self.training.hidden

    @property
    def seed(self) -> int:
        return self.training.seed

    @property
    def steps(self) -> int:
        return self.training.steps

    @property
    def batch_size(self) -> int:
        return self.training.batch_size

    @property
    def lr(self) -> float | None:
        return self.optim.lr

    @property
    def momentum(self) -> float:
        return self.optim.momentum

    @property
    def adam_warmup(self) -> int | None:
        return self.optim.adam_warmup

    @property
    def diloco(self) -> int:
        return self.optim.diloco

    @property
    def scheme(self) -> str:
        return self.exchange.scheme

    @property
    def error_feedback(self) -> bool | str:
        return self.exchange.error_feedback

    @property
    def min_numel(self) -> int:
        return self.exchange.min_numel

    @property
    def warmup_steps(self) -> int:
        return self.exchange.warmup_steps

    @property
    def topology(self) -> Any:
        return self.exchange.topology

    @property
    def fsdp(self) -> bool:
        return self.exchange.fsdp

    @property
    def hsdp(self) -> int:
        return self.exchange.hsdp

    @property
    def params(self) -> str | None:
        return self.exchange.params

    @property
    def progress_every(self) -> int:
        return self.output.progress_every

    @property
    def monitor_every(self) -> int:
        return self.output.monitor_every

    @property
    def eval_every(self) -> int:
        return self.output.eval_every

    def _check(self) -> None:
        if self.task not in TASK_NAMES:
            raise CLIError(f"unknown task {self.task!r}; tasks: {', '.join(TASK_NAMES)}")
        if self.parsed().inner == "muon" and self.task != "lm":
            raise CLIError(f"inner=muon runs on the lm task (--task lm), not {self.task}: the digits MLP trains "
                           "with SGD, whose learning rate is not Muon's")
        self._check_lm_size()

    def _check_lm_size(self) -> None:
        from ..testbed.lm import shape

        try:
            shape(self.lm_size)
        except ValueError as err:
            raise CLIError(str(err)) from None
        if self.lm_size != "small" and self.task != "lm":
            raise CLIError(f"--lm-size {self.lm_size} sizes the lm task's model (--task lm), not {self.task}'s")

    def parsed(self) -> Scheme:
        """The run's scheme, parsed (:func:`gradcompress.scheme.parse_scheme`); ``CLIError`` if it is wrong."""
        return parse_cli_scheme(self.scheme)

    def kind(self) -> str:
        """``"onebitadam"`` (OneBitAdam or CompressedAdam: the optimizer exchanges), ``"decoupled"`` (DeMo, which
        exchanges too) or ``"sgd"`` (a Compressor hook)."""
        scheme = self.parsed()
        if scheme.kind == DECOUPLED:
            return DECOUPLED
        return ONEBITADAM if scheme.kind == ONEBITADAM or scheme.compressed_adam else "sgd"

    def compressor(self) -> tuple[Codec | str, dict[str, Any]]:
        """The :class:`gradcompress.Compressor` arguments of this run: (codec, options)."""
        scheme = self.parsed()
        codec, options = scheme.text if scheme.kind == AUTO else scheme.codec, scheme.compressor
        options.setdefault("error_feedback", self.error_feedback)
        options.setdefault("min_numel", self.min_numel)
        if self.topology != "auto":
            options["topology"] = self.topology
        return codec, dict(options, warmup_steps=self.warmup_steps, seed=self.seed, monitor_every=self.monitor_every)

    def diloco_options(self) -> dict[str, Any]:
        """DiLoCo's ``codec``, ``outer`` and ``error_feedback`` for this run (:func:`gradcompress.factory.
        diloco_options`): ``outer=sparseloco`` with an exact codec (``none:diloco=50,outer=sparseloco``) takes
        SparseLoCo's own codec."""
        return diloco_options(self.parsed(), self.compressor()[1]["error_feedback"])

    def run_scheme(self) -> Scheme:
        """The scheme this run runs: the parsed scheme, with ``--diloco H`` folded in (``diloco=H``)."""
        scheme = self.parsed()
        if self.diloco and scheme.kind == "ours":
            return dataclasses.replace(scheme, diloco=self.diloco)
        return scheme

    def setting(self, task: TrainingTask, device: torch.device) -> Run:
        """What :func:`gradcompress.factory.build` needs beside the scheme: the task's optimizer and shard units,
        the Compressor options (:meth:`compressor`), the keywords of DeMo or CompressedAdam, FSDP / HSDP."""
        kind = self.kind()
        exchanging = self.demo_options() if kind == DECOUPLED else \
            {**task.onebitadam_extra(), **self.onebitadam_options()} if kind == ONEBITADAM else {}
        return Run(optimizer=lambda params: task.optimizer(params, self), options=self.compressor()[1],
                   exchanging=exchanging, fsdp=self.fsdp, per_node=self.hsdp, params=self.params,
                   shard_units=task.shard_units, device=device, muon=lambda model: cast(MuonTask, task).muon(model, self))  # inner=muon: the lm task (_check)

    def momentum_corrected(self) -> bool:
        """True when the Compressor keeps the momentum (the optimizer then runs without it)."""
        if self.kind() != "sgd":
            return False
        codec, options = self.compressor()
        # a codec that carries momentum (DGC) has its momentum factor; the Codec base class does not declare it
        return options.get("momentum", 0) > 0 or (not isinstance(codec, str) and codec.carries_momentum
                                                  and cast(Any, codec).momentum > 0)

    def optimizer_momentum(self) -> float:
        return 0.0 if self.momentum_corrected() else self.momentum

    def onebitadam_options(self) -> dict[str, Any]:
        """Keyword arguments of OneBitAdam, or of CompressedAdam (then with ``codec``)."""
        scheme = self.parsed()
        opts = scheme.adam if scheme.kind == ONEBITADAM else {"codec": scheme.codec.spec}
        opts.setdefault("lr", self.lr if self.lr is not None else (3e-3 if self.task == "lm" else 1e-3))
        opts.setdefault("warmup_steps", self.adam_warmup if self.adam_warmup is not None
                        else max(self.warmup_steps, self.steps // 5))
        if self.topology != "auto":
            opts["topology"] = self.topology
        return opts

    def demo_options(self) -> dict[str, Any]:
        """Keyword arguments of DeMo: the scheme's, with the lr of the task's Adam (3e-3 lm, 1e-3 digits: DeMo's
        sign steps are per-coordinate steps like Adam's) unless the scheme or ``lr`` sets it."""
        opts = self.parsed().demo
        opts.setdefault("lr", self.lr if self.lr is not None else (3e-3 if self.task == "lm" else 1e-3))
        if self.topology != "auto":
            opts["topology"] = self.topology
        return opts

    def learning_rate(self) -> float:
        if self.kind() == ONEBITADAM:
            return float(self.onebitadam_options()["lr"])
        if self.kind() == DECOUPLED:
            return float(self.demo_options()["lr"])
        return self.lr if self.lr is not None else (3e-3 if self.task == "lm" else 0.05)

    def optimizer_text(self) -> str:
        if self.kind() == DECOUPLED:
            return demo_text(self.demo_options(), self.task == "lm")
        if self.kind() == ONEBITADAM:
            o = self.onebitadam_options()
            extra = "".join(f", {k}={o[k]:g}" for k in ("eps", "weight_decay", "sync_every", "sync_ramp_steps")
                            if k in o)
            lm_extra = ", betas=(0.9, 0.95), cosine" if self.task == "lm" else ""
            name = f"CompressedAdam(codec={o['codec']!r}, " if "codec" in o else "OneBitAdam("
            return f"{name}lr={o['lr']:g}, warmup_steps={o['warmup_steps']}{extra}{lm_extra})"
        outer = f"DiLoCo(H={self.diloco}, outer SGD lr 0.7 Nesterov 0.9) over " if self.diloco else ""
        if self.diloco and self.parsed().outer == "sparseloco":
            from ..optim.diloco import SPARSELOCO_ERROR_DECAY, SPARSELOCO_OUTER_LR

            lr = self.parsed().outer_lr or SPARSELOCO_OUTER_LR
            outer = (f"DiLoCo(H={self.diloco}, SparseLoCo outer: error feedback decay {SPARSELOCO_ERROR_DECAY:g}, "
                     f"outer SGD lr {lr:g}, no momentum) over ")
        if self.diloco and self.parsed().inner == "muon":
            from ..testbed import lm

            return (f"{outer}Muon(hidden 2-D weights, lr={self.learning_rate():g} scaled to AdamW's RMS, momentum "
                    f"0.95 Nesterov) + AdamW(the rest, betas=(0.9, 0.95)), weight decay {lm.WEIGHT_DECAY:g}, cosine")
        if self.task == "lm":
            beta1 = 0 if self.momentum_corrected() else 0.9
            return f"{outer}AdamW(lr={self.learning_rate():g}, betas=({beta1:g}, 0.95), cosine)" + \
                ("; momentum correction in the compressor" if self.momentum_corrected() else "")
        if self.momentum_corrected():
            return f"{outer}SGD(lr={self.learning_rate():g}, momentum=0; momentum correction in the compressor)"
        return f"{outer}SGD(lr={self.learning_rate():g}, momentum={self.momentum:g})"


def demo_text(options: dict[str, Any], cosine: bool) -> str:
    """``DeMo(lr=0.003, momentum_decay=0.999, chunk=64, topk=32, sign=True, weight_decay=0)``: every option as the
    run uses it (the scheme's, else DeMo's defaults)."""
    import inspect

    from ..optim import DeMo

    defaults = {k: v.default for k, v in inspect.signature(DeMo).parameters.items() if k != "params"}
    shown = {k: options.get(k, defaults[k]) for k in ("lr", "momentum_decay", "chunk", "topk", "sign", "weight_decay")}
    if options.get("values") is not None:
        shown["values"] = options["values"]
    text = ", ".join(f"{k}={v:g}" if isinstance(v, float) else f"{k}={v}" for k, v in shown.items())
    return f"DeMo({text}{', cosine' if cosine else ''})"
