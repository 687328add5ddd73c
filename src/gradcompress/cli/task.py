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

import math
import time
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any, Protocol, cast

import torch
import torch.distributed as dist
import torch.nn as nn

from ..collectives import ddp_bytes
from ..factory import build
from ..optim import DiLoCo
from ..scheme import ONEBITADAM, SCHEME_COMPRESSOR_OPTIONS, SCHEME_OPTIONS
from ..scheme import scheme_name  # noqa: F401  (the tests read it here)
from .common import CLIError
from .run_config import TASK_NAMES, RunConfig

if TYPE_CHECKING:
    from ..compressor import Compressor
    from ..testbed.lm import Windows

IN_FEATURES, CLASSES = 64, 10


class ProgressQueue(Protocol):
    """Where rank 0 reports ``(run index, steps done)``: a (multiprocessing) queue."""

    def put(self, item: tuple[int, int], /) -> None: ...


# --------------------------------------------------------------------------- configuration
#: scheme options that configure the run: ``int4:diloco=25`` trains with DiLoCo, H = 25, int4 outer gradients;
#: ``topk:ratio=0.01,compressed_adam=true`` trains with CompressedAdam (Adam's momentum through the codec)
RUN_OPTIONS = SCHEME_OPTIONS
#: scheme options that configure the Compressor rather than the codec (``sign:momentum=0.9``)
COMPRESSOR_OPTIONS = SCHEME_COMPRESSOR_OPTIONS


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

    def f(a: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(((a - mean) / std).astype(np.float32))

    return {"x_train": f(x_tr), "y_train": torch.from_numpy(y_tr).long(),
            "x_test": f(x_te), "y_test": torch.from_numpy(y_te).long()}


def make_mlp(seed: int = 0, hidden: int = 256) -> nn.Module:
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
              progress: ProgressQueue | None = None, index: int = 0) -> dict[str, Any]:
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
                              "step_seconds": step_times, "stats": stats_of(), "eval_history": history or None,
                              "gradient_bytes": gradient_bytes(model)}
    if cfg.kind() == "sgd":
        record["stats"]["error_feedback"] = cast("Compressor", comp).error_feedback  # sgd: a Compressor
    if rank == 0 or cfg.fsdp:  # an FSDP forward is a collective: every rank evaluates
        record.update(task.evaluate(model, data, losses))
    return record


def gradient_bytes(model: nn.Module) -> int:
    """The bytes of the model's gradients, all of them (sharded parameters: the whole tensors)."""
    return sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)


class DigitsTask:
    """The digits MLP with SGD (momentum 0.9, none when the compressor corrects momentum)."""

    name = "digits"

    def load(self, seed: int) -> dict[str, torch.Tensor]:
        return load_data(seed)

    def make_model(self, cfg: RunConfig) -> nn.Module:
        return make_mlp(cfg.seed, cfg.hidden)

    def batches(self, data: dict[str, torch.Tensor], rank: int, world: int, cfg: RunConfig) -> Batches:
        return Batches(data["x_train"], data["y_train"], rank, world, cfg.batch_size, cfg.seed)

    def optimizer(self, params: Iterable[nn.Parameter], cfg: RunConfig) -> torch.optim.Optimizer:
        return torch.optim.SGD(params, lr=cfg.learning_rate(), momentum=cfg.optimizer_momentum())

    def scheduler(self, optimizer: torch.optim.Optimizer, cfg: RunConfig) -> torch.optim.lr_scheduler.LRScheduler | None:
        return None

    def onebitadam_extra(self) -> dict[str, Any]:
        return {}

    def loss(self, out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return nn.functional.cross_entropy(out, y)

    def shard_units(self, model: nn.Module) -> list[nn.Module]:
        return [m for m in cast(nn.Sequential, model) if isinstance(m, nn.Linear)]  # make_model's Sequential

    def evaluate(self, model: nn.Module, data: dict[str, torch.Tensor], losses: list[float]) -> dict[str, float]:
        train_loss, acc = evaluate(model, data)
        return {"final_train_loss": train_loss, "test_accuracy": acc}

    def metric(self, model: nn.Module, data: dict[str, torch.Tensor]) -> float:
        """What ``eval_every`` records: the test accuracy in percent."""
        return evaluate(model, data)[1]


class LMTask:
    """The byte-level transformer of :mod:`gradcompress.testbed.lm` with AdamW and cosine decay. With momentum
    correction in the compressor (``sign:momentum=0.9``, ``dgc``) AdamW runs with beta1 = 0: its first
    moment is then the compressor's momentum-corrected, error-fed update."""

    name = "lm"

    def load(self, seed: int, text: str = "python-docs") -> dict[str, torch.Tensor]:
        from ..testbed import lm

        return lm.load_text(text=text)

    def make_model(self, cfg: RunConfig) -> nn.Module:
        from ..testbed import lm

        return lm.make_model(cfg.seed, cfg.lm_size)

    def batches(self, data: dict[str, torch.Tensor], rank: int, world: int, cfg: RunConfig) -> Windows:
        from ..testbed import lm

        return lm.Windows(data["train"], rank, cfg.batch_size, cfg.seed, lm.shape(cfg.lm_size).context)

    def optimizer(self, params: Iterable[nn.Parameter], cfg: RunConfig) -> torch.optim.Optimizer:
        from ..testbed import lm

        beta1 = 0.0 if cfg.momentum_corrected() else lm.BETAS[0]
        return torch.optim.AdamW(params, lr=cfg.learning_rate(), betas=(beta1, lm.BETAS[1]),
                                 weight_decay=lm.WEIGHT_DECAY)

    def muon(self, model: nn.Module, cfg: RunConfig) -> torch.optim.Optimizer:
        """``inner=muon``: :func:`gradcompress.optim.muon` with this task's lr, AdamW betas and weight decay (one lr
        for both parts: Muon's update scaled to AdamW's RMS)."""
        from ..optim import muon
        from ..testbed import lm

        return muon(model, adamw_lr=cfg.learning_rate(), betas=lm.BETAS, weight_decay=lm.WEIGHT_DECAY)

    def scheduler(self, optimizer: torch.optim.Optimizer, cfg: RunConfig) -> torch.optim.lr_scheduler.LRScheduler | None:
        from ..testbed import lm

        return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: lm.cosine(s, cfg.steps))

    def onebitadam_extra(self) -> dict[str, Any]:
        from ..testbed import lm

        return {"betas": lm.BETAS}  # as AdamW's here (its weight decay stays off: OneBitAdam's is L2)

    def loss(self, out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        from ..testbed import lm

        return lm.loss_fn(out, y)

    def shard_units(self, model: nn.Module) -> list[nn.Module]:
        return list(cast(nn.ModuleList, model.blocks))  # lm.ByteGPT's blocks

    def evaluate(self, model: nn.Module, data: dict[str, torch.Tensor], losses: list[float]) -> dict[str, float]:
        from ..testbed import lm

        tail = losses[-20:]
        return {"final_train_loss": sum(tail) / len(tail), "val_loss": lm.validation_loss(model, data["val"])}

    def metric(self, model: nn.Module, data: dict[str, torch.Tensor]) -> float:
        """What ``eval_every`` records: the validation loss (rank 0's model: between DiLoCo's syncs, its own)."""
        from ..testbed import lm

        return lm.validation_loss(model, data["val"])


TASKS: dict[str, DigitsTask | LMTask] = {"digits": DigitsTask(), "lm": LMTask()}
assert tuple(TASKS) == TASK_NAMES


def demo_worker(rank: int, world: int, data: dict[str, torch.Tensor], configs: list[RunConfig],
                progress: ProgressQueue | None = None) -> list[dict[str, Any]]:
    """``launch.run`` target: every run of the demo, one after the other, in the same worker processes."""
    out = []
    for i, cfg in enumerate(configs):
        if progress is not None and rank == 0:
            progress.put((i, 0))
        out.append(train_run(rank, world, data, cfg, torch.device("cpu"), progress, i))
        dist.barrier()
    return out


def train_worker(rank: int, world: int, data: dict[str, torch.Tensor], cfg: RunConfig, device: str = "cpu",
                 progress: ProgressQueue | None = None) -> dict[str, Any]:
    """``launch.run`` (or torchrun) target for ``gradcompress train``: one run."""
    return train_run(rank, world, data, cfg, torch.device(device), progress, 0)


# --------------------------------------------------------------------------- summaries
def summarize(records: list[dict], cfg: RunConfig, world: int) -> dict[str, Any]:
    """Combine the ranks' records of one run into the figures the CLI prints and saves.

    ``loss``: per step, mean over ranks; ``cumulative_bytes``: per step, bytes rank 0
    transmitted so far; ``bytes_per_step``: total wire bytes / steps (warm-up included; the gradients', FSDP's
    compressed parameter all-gathers apart in ``param_bytes_per_step``);
    ``bytes_per_step_compressed``: mean over the steps after the warm-up; ``ddp_bytes_per_step``: what DDP's ring
    all-reduce of the model's gradients sends per worker and step (2 (W-1)/W x their bytes,
    :func:`gradcompress.collectives.ddp_bytes`); ``x_fewer_than_ddp``: that / ``bytes_per_step`` (dense: 1.0;
    DiLoCo: averaged over the run); ``plan``: what ``auto`` ended with ({codec: count}; None for other schemes).
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
    per_step = wire / steps if wire is not None and steps else None
    grads = r0.get("gradient_bytes")
    ddp = ddp_bytes(grads, world) if grads is not None else None
    fewer = None if ddp is None or per_step is None else ddp / per_step if per_step else 1.0 if not ddp else None
    return {
        "scheme": cfg.scheme,
        "optimizer": cfg.optimizer_text(),
        "lr": cfg.learning_rate(),
        "workers": world,
        "steps": steps,
        "batch_size": cfg.batch_size,
        "warmup_steps": w,
        "error_feedback": stats.get("error_feedback") if kind == "sgd" else None,
        "bytes_per_step": per_step,
        "bytes_per_step_compressed": steady,
        "param_bytes_per_step": stats.get("param_bytes", 0) / steps if steps else None,
        "raw_bytes_per_step": stats["raw_bytes"] / steps if "raw_bytes" in stats and steps else None,
        "ratio": ratio if ratio is None or math.isfinite(ratio) else None,
        "ddp_bytes_per_step": ddp,
        "x_fewer_than_ddp": fewer,
        "plan": (stats.get("auto") or {}).get("plan"),
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
