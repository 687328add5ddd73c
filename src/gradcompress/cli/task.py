"""The task that ``gradcompress demo`` and ``gradcompress train`` run: an MLP on handwritten digits.

* Data: scikit-learn's 8x8 digits (``load_digits``: 1797 images, bundled, no download),
  a stratified held-out test split (25 %), features standardised with the training
  split's mean and standard deviation.
* Model: a 64 -> 256 -> 256 -> 10 ReLU MLP. Its three weight matrices (16384, 65536 and
  2560 elements) are above the Compressor's ``min_numel=1024`` and get compressed; the
  biases travel dense.
* Training: every worker owns a shard of the training split (every W-th example of a
  seeded permutation) and draws its own shuffled minibatches from it. The model is
  wrapped in ``DistributedDataParallel`` with a :class:`gradcompress.Compressor` as its
  communication hook and trained with SGD with momentum; ``dgc`` schemes use SGD
  without momentum because DGC's momentum correction lives in the compressor. The
  scheme ``onebitadam`` uses :class:`gradcompress.optim.OneBitAdam` on the bare model
  (it averages gradients itself, so no DDP); ``decoupled`` uses :class:`gradcompress.optim.DeMo` the same way.
* Recorded per step: the minibatch loss, the cumulative ``stats()['wire_bytes']`` and
  the step's wall time; at the end: the loss over the whole training split and the
  test accuracy (rank 0).

Everything a worker needs is passed in (data tensors, a :class:`RunConfig`), so the
worker functions here can be pickled to ``gradcompress.testbed.launch.run`` processes. What a run's scheme becomes
(the model wrapped, the optimizer, the Compressor) is :func:`gradcompress.factory.build`'s: :meth:`RunConfig.setting`
says what the scheme does not (the task's optimizer, the Compressor options, FSDP).
"""

from __future__ import annotations

import dataclasses
import math
import time
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

from ..factory import Run, build, diloco_options
from ..optim import DiLoCo
from ..scheme import AUTO, DECOUPLED, ONEBITADAM, SCHEME_COMPRESSOR_OPTIONS, SCHEME_OPTIONS, Scheme
from ..scheme import scheme_name  # noqa: F401  (the tests read it here)
from .common import CLIError
from .schemes import parse

IN_FEATURES, CLASSES = 64, 10


# --------------------------------------------------------------------------- configuration
#: scheme options that configure the run: ``int4:diloco=25`` trains with DiLoCo, H = 25, int4 outer gradients;
#: ``topk:ratio=0.01,compressed_adam=true`` trains with CompressedAdam (Adam's momentum through the codec)
RUN_OPTIONS = SCHEME_OPTIONS
TASK_NAMES = ("digits", "lm")
#: scheme options that configure the Compressor rather than the codec (``sign:momentum=0.9``)
COMPRESSOR_OPTIONS = SCHEME_COMPRESSOR_OPTIONS


@dataclasses.dataclass
class RunConfig:
    """One training run. ``lr=None`` picks the default for the scheme's optimiser.

    ``scheme`` is a codec spec whose options may also set the Compressor's
    :data:`COMPRESSOR_OPTIONS` (``sign:momentum=0.9`` is the sign codec with momentum
    correction); everything not set there is the library's default.
    """

    scheme: str = "none"
    steps: int = 300
    batch_size: int = 32
    lr: float | None = None
    momentum: float = 0.9
    warmup_steps: int = 5
    error_feedback: bool | str = "auto"
    min_numel: int = 1024
    seed: int = 0
    hidden: int = 256
    progress_every: int = 5
    task: str = "digits"
    monitor_every: int = 0  # Compressor telemetry (the demo plots it)
    fsdp: bool = False
    hsdp: int = 0  # with fsdp, > 0: HSDP over nodes of this many workers (replica all-reduce compressed)
    params: str | None = None  # with fsdp: register_fsdp's params= ("int8", "bf16": the parameter all-gather)
    diloco: int = 0  # > 0: DiLoCo with this sync_every (inner: the usual optimizer, no DDP)
    adam_warmup: int | None = None  # onebitadam / compressed_adam: dense Adam steps (None: 20 % of the steps)
    topology: Any = "auto"  # the Compressor's / optimizer's topology= (an int G: nodes of G workers)
    eval_every: int = 0  # > 0: rank 0 evaluates every this many steps (lm: validation loss), kept in eval_history
    lm_size: str = "small"  # lm: the model's size (gradcompress.testbed.lm.SIZES)

    def __post_init__(self) -> None:
        if self.task not in TASK_NAMES:
            raise CLIError(f"unknown task {self.task!r}; tasks: {', '.join(TASK_NAMES)}")
        h = self.parsed().diloco
        if h is not None:
            self.diloco = h
        if self.parsed().inner == "muon" and self.task != "lm":
            raise CLIError(f"inner=muon runs on the lm task (--task lm), not {self.task}: the digits MLP trains "
                           "with SGD, whose learning rate is not Muon's")
        self._check_lm_size()

    def _check_lm_size(self) -> None:
        from ..testbed.lm import SIZES

        if self.lm_size not in SIZES:
            raise CLIError(f"unknown lm model size {self.lm_size!r}; sizes: {', '.join(SIZES)}")
        if self.lm_size != "small" and self.task != "lm":
            raise CLIError(f"--lm-size {self.lm_size} sizes the lm task's model (--task lm), not {self.task}'s")

    def parsed(self) -> Scheme:
        """The run's scheme, parsed (:func:`gradcompress.scheme.parse_scheme`); ``CLIError`` if it is wrong."""
        return parse(self.scheme)

    def kind(self) -> str:
        """``"onebitadam"`` (OneBitAdam or CompressedAdam: the optimizer exchanges), ``"decoupled"`` (DeMo, which
        exchanges too) or ``"sgd"`` (a Compressor hook)."""
        scheme = self.parsed()
        if scheme.kind == DECOUPLED:
            return DECOUPLED
        return ONEBITADAM if scheme.kind == ONEBITADAM or scheme.compressed_adam else "sgd"

    def compressor(self):
        """The :class:`gradcompress.Compressor` arguments of this run: (codec, options)."""
        scheme = self.parsed()
        codec, options = scheme.text if scheme.kind == AUTO else scheme.codec, scheme.compressor
        options.setdefault("error_feedback", self.error_feedback)
        options.setdefault("min_numel", self.min_numel)
        if self.topology != "auto":
            options["topology"] = self.topology
        return codec, dict(options, warmup_steps=self.warmup_steps, seed=self.seed, monitor_every=self.monitor_every)

    def diloco_options(self) -> dict:
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

    def setting(self, task, device: torch.device) -> Run:
        """What :func:`gradcompress.factory.build` needs beside the scheme: the task's optimizer and shard units,
        the Compressor options (:meth:`compressor`), the keywords of DeMo or CompressedAdam, FSDP / HSDP."""
        kind = self.kind()
        exchanging = self.demo_options() if kind == DECOUPLED else \
            {**task.onebitadam_extra(), **self.onebitadam_options()} if kind == ONEBITADAM else {}
        return Run(optimizer=lambda params: task.optimizer(params, self), options=self.compressor()[1],
                   exchanging=exchanging, fsdp=self.fsdp, per_node=self.hsdp, params=self.params,
                   shard_units=task.shard_units, device=device, muon=lambda model: task.muon(model, self))

    def momentum_corrected(self) -> bool:
        """True when the Compressor keeps the momentum (the optimizer then runs without it)."""
        if self.kind() != "sgd":
            return False
        codec, options = self.compressor()
        return options.get("momentum", 0) > 0 or (not isinstance(codec, str) and codec.carries_momentum and codec.momentum > 0)

    def optimizer_momentum(self) -> float:
        return 0.0 if self.momentum_corrected() else self.momentum

    def onebitadam_options(self) -> dict:
        """Keyword arguments of OneBitAdam, or of CompressedAdam (then with ``codec``)."""
        scheme = self.parsed()
        opts = scheme.adam if scheme.kind == ONEBITADAM else {"codec": scheme.codec.spec}
        opts.setdefault("lr", self.lr if self.lr is not None else (3e-3 if self.task == "lm" else 1e-3))
        opts.setdefault("warmup_steps", self.adam_warmup if self.adam_warmup is not None
                        else max(self.warmup_steps, self.steps // 5))
        if self.topology != "auto":
            opts["topology"] = self.topology
        return opts

    def demo_options(self) -> dict:
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


def demo_text(options: dict, cosine: bool) -> str:
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


# --------------------------------------------------------------------------- data and model
def load_data(seed: int = 0, test_size: float = 0.25) -> dict[str, torch.Tensor]:
    """Digits split into train/test (stratified, seeded), standardised with the training statistics."""
    import numpy as np

    try:
        from sklearn.datasets import load_digits
        from sklearn.model_selection import train_test_split
    except ImportError:
        raise CLIError("the digits task needs scikit-learn: pip install 'gradcompress[demo]' "
                       "(or use --task lm)") from None

    x, y = load_digits(return_X_y=True)
    x_tr, x_te, y_tr, y_te = train_test_split(x, y, test_size=test_size, random_state=seed, stratify=y)
    mean, std = x_tr.mean(axis=0), x_tr.std(axis=0)
    std = np.where(std > 0, std, 1.0)  # a few border pixels are always 0
    f = lambda a: torch.from_numpy(((a - mean) / std).astype(np.float32))  # noqa: E731
    return {"x_train": f(x_tr), "y_train": torch.from_numpy(y_tr).long(),
            "x_test": f(x_te), "y_test": torch.from_numpy(y_te).long()}


def make_model(seed: int = 0, hidden: int = 256) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(IN_FEATURES, hidden), nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU(),
                         nn.Linear(hidden, CLASSES))


class Batches:
    """This worker's shard of the training split, served as shuffled minibatches, epoch after epoch."""

    def __init__(self, x: torch.Tensor, y: torch.Tensor, rank: int, world: int, batch_size: int, seed: int):
        order = torch.randperm(len(x), generator=torch.Generator().manual_seed(seed))
        shard = order[rank::world]
        self.x, self.y = x[shard], y[shard]
        self.batch_size = min(batch_size, len(shard))
        self.gen = torch.Generator().manual_seed(seed * 1000 + rank + 1)
        self.perm, self.pos = torch.empty(0, dtype=torch.long), 0

    def next(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self.pos + self.batch_size > len(self.perm):
            self.perm, self.pos = torch.randperm(len(self.x), generator=self.gen), 0
        idx = self.perm[self.pos : self.pos + self.batch_size]
        self.pos += self.batch_size
        return self.x[idx], self.y[idx]


@torch.no_grad()
def evaluate(model: nn.Module, data: dict[str, torch.Tensor]) -> tuple[float, float]:
    """(loss over the whole training split, test accuracy in percent)."""
    was = model.training
    model.eval()
    loss = nn.functional.cross_entropy(model(data["x_train"]), data["y_train"]).item()
    acc = (model(data["x_test"]).argmax(1) == data["y_test"]).float().mean().item() * 100
    model.train(was)
    return loss, acc


# --------------------------------------------------------------------------- one run
def train_run(rank: int, world: int, data: dict[str, torch.Tensor], cfg: RunConfig, device: torch.device,
              progress=None, index: int = 0) -> dict[str, Any]:
    """Train one scheme on this rank (the process group must be initialised); return this rank's record.

    ``progress``: a queue that rank 0 feeds with ``(index, steps_done)`` every
    ``cfg.progress_every`` steps. Rank 0's record also holds the final evaluation.
    """
    data = {k: v.to(device) for k, v in data.items()}
    task = TASKS[cfg.task]
    model = task.make_model(cfg).to(device)
    batches = task.batches(data, rank, world, cfg)
    if cfg.fsdp and cfg.hsdp and world % cfg.hsdp:
        raise CLIError(f"--hsdp: {cfg.hsdp} workers per node do not divide the {world} workers")
    net, opt, comp = build(cfg.run_scheme(), model, cfg.setting(task, device))
    scheduler = task.scheduler(opt.inner if isinstance(opt, DiLoCo) else opt, cfg)  # lm: cosine decay
    stats_of = opt.stats if comp is None or cfg.diloco else comp.stats

    losses, cum_bytes, step_times, history = [], [], [], []
    for step in range(cfg.steps):
        x, y = batches.next()
        start = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        loss = task.loss(net(x), y)
        loss.backward()
        opt.step()
        if scheduler is not None:
            scheduler.step()
        value = loss.item()  # also waits for the device
        step_times.append(time.perf_counter() - start)
        losses.append(value)
        st = stats_of()
        cum_bytes.append(st.get("wire_bytes") if st else None)
        if not math.isfinite(value):
            raise FloatingPointError(f"{cfg.scheme}: the training loss became {value} at step {step}; "
                                     "lower --lr or change the scheme's options")
        if progress is not None and rank == 0 and ((step + 1) % cfg.progress_every == 0 or step + 1 == cfg.steps):
            progress.put((index, step + 1))
        if cfg.eval_every and rank == 0 and not cfg.fsdp and (step + 1) % cfg.eval_every == 0:
            history.append([step + 1, task.metric(model, data)])
    record: dict[str, Any] = {"rank": rank, "loss": losses, "cumulative_bytes": cum_bytes,
                              "step_seconds": step_times, "stats": stats_of(), "eval_history": history or None}
    if cfg.kind() == "sgd":
        record["stats"]["error_feedback"] = comp.error_feedback
    if rank == 0 or cfg.fsdp:  # an FSDP forward is a collective: every rank evaluates
        record.update(task.evaluate(model, data, losses))
    return record


class DigitsTask:
    """The digits MLP with SGD (momentum 0.9, none when the compressor corrects momentum)."""

    name = "digits"

    def load(self, seed: int):
        return load_data(seed)

    def make_model(self, cfg):
        return make_model(cfg.seed, cfg.hidden)

    def batches(self, data, rank, world, cfg):
        return Batches(data["x_train"], data["y_train"], rank, world, cfg.batch_size, cfg.seed)

    def optimizer(self, params, cfg):
        return torch.optim.SGD(params, lr=cfg.learning_rate(), momentum=cfg.optimizer_momentum())

    def scheduler(self, optimizer, cfg):
        return None

    def onebitadam_extra(self) -> dict:
        return {}

    def loss(self, out, y):
        return nn.functional.cross_entropy(out, y)

    def shard_units(self, model):
        return [m for m in model if isinstance(m, nn.Linear)]

    def evaluate(self, model, data, losses):
        train_loss, acc = evaluate(model, data)
        return {"final_train_loss": train_loss, "test_accuracy": acc}

    def metric(self, model, data) -> float:
        """What ``eval_every`` records: the test accuracy in percent."""
        return evaluate(model, data)[1]


class LMTask:
    """The byte-level transformer of :mod:`gradcompress.testbed.lm` with AdamW and cosine decay. With momentum
    correction in the compressor (``sign:momentum=0.9``, ``dgc``) AdamW runs with beta1 = 0: its first
    moment is then the compressor's momentum-corrected, error-fed update."""

    name = "lm"

    def load(self, seed: int):
        from ..testbed import lm

        return lm.load_text()

    def make_model(self, cfg):
        from ..testbed import lm

        return lm.make_model(cfg.seed, cfg.lm_size)

    def batches(self, data, rank, world, cfg):
        from ..testbed import lm

        return lm.Windows(data["train"], rank, cfg.batch_size, cfg.seed)

    def optimizer(self, params, cfg):
        from ..testbed import lm

        beta1 = 0.0 if cfg.momentum_corrected() else lm.BETAS[0]
        return torch.optim.AdamW(params, lr=cfg.learning_rate(), betas=(beta1, lm.BETAS[1]),
                                 weight_decay=lm.WEIGHT_DECAY)

    def muon(self, model, cfg):
        """``inner=muon``: :func:`gradcompress.optim.muon` with this task's lr, AdamW betas and weight decay (one lr
        for both parts: Muon's update scaled to AdamW's RMS)."""
        from ..optim import muon
        from ..testbed import lm

        return muon(model, adamw_lr=cfg.learning_rate(), betas=lm.BETAS, weight_decay=lm.WEIGHT_DECAY)

    def scheduler(self, optimizer, cfg):
        from ..testbed import lm

        return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: lm.cosine(s, cfg.steps))

    def onebitadam_extra(self) -> dict:
        from ..testbed import lm

        return {"betas": lm.BETAS}  # as AdamW's here (its weight decay stays off: OneBitAdam's is L2)

    def loss(self, out, y):
        from ..testbed import lm

        return lm.loss_fn(out, y)

    def shard_units(self, model):
        return list(model.blocks)

    def evaluate(self, model, data, losses):
        from ..testbed import lm

        tail = losses[-20:]
        return {"final_train_loss": sum(tail) / len(tail), "val_loss": lm.validation_loss(model, data["val"])}

    def metric(self, model, data) -> float:
        """What ``eval_every`` records: the validation loss (rank 0's model: between DiLoCo's syncs, its own)."""
        from ..testbed import lm

        return lm.validation_loss(model, data["val"])


TASKS = {"digits": DigitsTask(), "lm": LMTask()}
assert tuple(TASKS) == TASK_NAMES


def demo_worker(rank: int, world: int, data: dict, configs: list[RunConfig], progress=None) -> list[dict]:
    """``launch.run`` target: every run of the demo, one after the other, in the same worker processes."""
    out = []
    for i, cfg in enumerate(configs):
        if progress is not None and rank == 0:
            progress.put((i, 0))
        out.append(train_run(rank, world, data, cfg, torch.device("cpu"), progress, i))
        dist.barrier()
    return out


def train_worker(rank: int, world: int, data: dict, cfg: RunConfig, device: str = "cpu", progress=None) -> dict:
    """``launch.run`` (or torchrun) target for ``gradcompress train``: one run."""
    return train_run(rank, world, data, cfg, torch.device(device), progress, 0)


# --------------------------------------------------------------------------- summaries
def summarize(records: list[dict], cfg: RunConfig, world: int) -> dict[str, Any]:
    """Combine the ranks' records of one run into the figures the CLI prints and saves.

    ``loss``: per step, mean over ranks; ``cumulative_bytes``: per step, bytes rank 0
    transmitted so far; ``bytes_per_step``: total wire bytes / steps (warm-up included; the gradients', FSDP's
    compressed parameter all-gathers apart in ``param_bytes_per_step``);
    ``bytes_per_step_compressed``: mean over the steps after the warm-up.
    """
    r0 = records[0]
    steps = len(r0["loss"])
    loss = [sum(r["loss"][i] for r in records) / len(records) for i in range(steps)]
    stats = r0["stats"] or {}
    wire = stats.get("wire_bytes")
    step_seconds = sum(sum(r["step_seconds"]) for r in records) / len(records)
    codec = stats.get("codec_seconds")
    cum = r0["cumulative_bytes"]
    kind = cfg.kind()
    w = cfg.warmup_steps if kind == "sgd" else cfg.onebitadam_options()["warmup_steps"] if kind == ONEBITADAM else 0
    steady = None
    if wire is not None and cum and None not in cum and steps > w:
        steady = (cum[-1] - (cum[w - 1] if w > 0 else 0)) / (steps - w)
    ratio = stats.get("ratio")
    return {
        "scheme": cfg.scheme,
        "optimizer": cfg.optimizer_text(),
        "lr": cfg.learning_rate(),
        "workers": world,
        "steps": steps,
        "batch_size": cfg.batch_size,
        "warmup_steps": w,
        "error_feedback": stats.get("error_feedback") if kind == "sgd" else None,
        "bytes_per_step": wire / steps if wire is not None and steps else None,
        "bytes_per_step_compressed": steady,
        "param_bytes_per_step": stats.get("param_bytes", 0) / steps if steps else None,
        "raw_bytes_per_step": stats["raw_bytes"] / steps if "raw_bytes" in stats and steps else None,
        "ratio": ratio if ratio is None or math.isfinite(ratio) else None,
        "step_seconds": step_seconds / steps if steps else None,
        "codec_seconds": codec,
        "codec_share": codec / step_seconds if codec is not None and step_seconds > 0 else None,
        "final_train_loss": r0["final_train_loss"],
        "test_accuracy": r0.get("test_accuracy"),
        "val_loss": r0.get("val_loss"),
        "eval_history": r0.get("eval_history"),
        "task": cfg.task,
        "loss": loss,
        "cumulative_bytes": cum if None not in cum else None,
        "stats": {k: (v if not isinstance(v, float) or math.isfinite(v) else None) for k, v in stats.items()
                  if k != "monitor"},
        "monitor_history": (stats.get("monitor") or {}).get("history"),
    }
