"""``gradcompress demo``: every scheme on the same task, side by side.

Starts ``--workers`` local processes (gloo on loopback, :func:`gradcompress.testbed.launch.run`)
once and trains the task of :mod:`gradcompress.cli.task` once per scheme in them, each
run from the same initial weights and the same minibatches. Prints a table, and writes
``results.json`` and ``report.png`` into ``--out``.

Default schemes, each with the library's defaults (error feedback ``"auto"``: on for
the biased codecs, off for ``none``, ``fp16`` and the unbiased ``qsgd``/``terngrad``;
5 dense warm-up steps; SGD lr 0.05, momentum 0.9):

* ``none``, ``fp16``                    dense baselines (fp16 halves the bytes);
* ``int8``, ``int4``                    uniform quantisation, 512-element buckets, error feedback;
* ``qsgd``, ``terngrad``                unbiased stochastic quantisers, without error feedback
  (fed back, their variance would grow without bound);
* ``sign:momentum=0.9``                 scaled sign (1 bit + a scale per bucket), error feedback,
  with momentum correction in the compressor and SGD without momentum: error-fed sign
  under heavy optimizer momentum is unstable, compressing the momentum is not;
* ``topk:ratio=0.01``                   1 % of the values + their int32 positions, error feedback;
* ``randomk:ratio=0.25,scale=false,momentum=0.9``  a quarter of the values at shared random
  positions, not rescaled (a contraction, so error feedback applies), with momentum correction
  and SGD without momentum: error-fed random-k under optimizer momentum 0.9 collapsed on some
  seeds (BENCHMARKS.md, "random-k");
* ``dgc:ratio=0.01``                    Deep Gradient Compression (sampled top-k, its own momentum
  correction and factor masking in the compressor), SGD without momentum;
* ``powersgd:rank=2``                   rank-2 PowerSGD with warm-started Q, error feedback;
* ``topk:ratio=0.01,values=int8``       top-k whose kept values are sent as int8;
* ``onebitadam``                        1-bit Adam (dense Adam warm-up for the first 20 % of
  the steps, then sign-compressed momentum with error feedback), lr 1e-3, default eps
  (``--lr`` does not apply to it; set ``onebitadam:lr=...,eps=...,warmup_steps=...``).
* ``decoupled``                         (not in the default list) DeMo, decoupled momentum
  (:class:`gradcompress.optim.DeMo`: top-32 DCT coefficients per 64 x 64 block of each worker's momentum
  all-gathered, sign steps), the paper's defaults, lr 1e-3 (lm 3e-3, AdamW's); ``--lr`` does not apply to it:
  set ``decoupled:lr=...,topk=...,chunk=...,momentum_decay=...,sign=...,weight_decay=...,values=...``.
* ``<codec>:compressed_adam=true``       (not in the default list) the same optimizer with that codec for
  the momentum, :class:`gradcompress.optim.CompressedAdam` (e.g. ``topk:ratio=0.01,compressed_adam=true``).

A scheme's options may set the Compressor's as well as the codec's (``sign:momentum=0.9``,
``int4:server_error_feedback=true``); see :data:`gradcompress.cli.task.COMPRESSOR_OPTIONS`.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
from typing import Any, TextIO

from ..collectives import ddp_bytes
from ..scheme import DECOUPLED, ONEBITADAM, scheme_name
from .common import (CLIError, check_out_dir, human_bytes, nonnegative_int, positive_float, positive_int,
                     progress_bars, split_schemes, table_lines)
from .report import plot
from .schemes import check, onebitadam_problem
from ..testbed.lm import TEXTS as LM_TEXTS, shape as lm_shape
from .task import TASK_NAMES, TASKS, LMTask, RunConfig, demo_worker, summarize

DEFAULT_SCHEMES = (
    "none",
    "auto",
    "fp16",
    "int8",
    "int4",
    "qsgd",
    "terngrad",
    "sign:momentum=0.9",
    "topk:ratio=0.01",
    "randomk:ratio=0.25,scale=false,momentum=0.9",
    "dgc:ratio=0.01",
    "powersgd:rank=2",
    "topk:ratio=0.01,values=int8",
    "onebitadam",
)
DEFAULT_STEPS = 250
#: the demo's telemetry: every 10th step the exact average too (plotted; its bytes are not in bytes/step)
MONITOR_EVERY = 10
DEFAULT_OUT = "./gradcompress-report/"
#: seconds a step may take per scheme before the launch gives up, by the lm task's size (digits: as small)
def lm_step_bound(size: str) -> float:
    """Seconds a step of the lm model of ``size`` may take at most in the timeout: 1 for the small model, scaled by
    blocks x width^2 x context (8 for the large one)."""
    s, small = lm_shape(size), lm_shape("small")
    return max(1.0, (s.layers * s.width ** 2 * s.context) / (small.layers * small.width ** 2 * small.context))


# --------------------------------------------------------------------------- arguments
def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> argparse.ArgumentParser:
    p = sub.add_parser(
        "demo", help="train a task once per scheme on local workers (digits MLP, or --task lm); table, "
                     "results.json, report.png",
        description="Train a task once per compression scheme, on --workers local processes (gloo, loopback), and "
                    "compare bytes sent, codec time, loss and test accuracy. Two tasks: --task digits (default), "
                    "a small MLP on scikit-learn's digits with SGD; --task lm, a byte-level transformer on Python's "
                    "documentation with AdamW (validation loss). Writes results.json and report.png into --out. "
                    "Defaults took 140 s on 2 CPU cores shared with other jobs (README).",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="Schemes are codec specs (see 'gradcompress bench' for the codecs), 'auto' (the autopilot chooses per bucket), 'onebitadam' or 'decoupled' "
               "(DeMo). A spec "
               "contains commas, so separate schemes with ';' or repeat the option:\n"
               "  gradcompress demo --schemes 'none;topk:ratio=0.01,values=int8'\n"
               "  gradcompress demo --schemes none --schemes topk:ratio=0.01,values=int8\n"
               "  gradcompress demo --schemes none int8 powersgd:rank=2\n"
               "Default schemes: " + "; ".join(DEFAULT_SCHEMES) + "\n"
               "Every option at the library's default (error feedback 'auto': on for biased codecs, off for none, "
               "fp16/bf16 and the unbiased ones); Compressor options may follow a codec's "
               "(sign:momentum=0.9), and int4:diloco=25 runs DiLoCo with int4 outer gradients; every run starts "
               "from the same "
               "weights and sees the same minibatches. results.json holds the table's figures plus the per-step "
               "loss and cumulative bytes.")
    p.add_argument("--schemes", action="extend", nargs="+", metavar="SPEC",
                   help="schemes to run (';'-separated and/or repeated); default: all of the list below")
    p.add_argument("--workers", type=positive_int, default=4, help="number of local worker processes (default 4)")
    p.add_argument("--steps", type=positive_int, default=DEFAULT_STEPS,
                   help=f"training steps per scheme (default {DEFAULT_STEPS})")
    p.add_argument("--task", choices=TASK_NAMES, default="digits",
                   help="digits: the MLP on scikit-learn's digits with SGD (default); lm: a byte-level transformer "
                        "on Python's documentation text with AdamW and cosine decay, where compression can fail")
    p.add_argument("--lm-size", default="small", metavar="SIZE",
                   help="the lm task's model: small (2 blocks of width 128, context 64, 0.47M parameters; default), "
                        "large (4 blocks of width 256, 3.3M parameters, about 7x the steps' compute) or any "
                        "'layers=L,width=W,context=C' (what is left out is small's)")
    p.add_argument("--lm-text", choices=LM_TEXTS, default="python-docs",
                   help="the lm task's text: python-docs (Python's documentation topics; default), "
                        "stdlib-docstrings (the standard library's docstrings) or licenses (the license files of the "
                        "installed packages)")
    p.add_argument("--batch-size", type=positive_int, default=None,
                   help="minibatch per worker (default 32 digits, 16 windows of 64 bytes for lm)")
    p.add_argument("--lr", type=positive_float, default=None,
                   help="learning rate (default 0.05 SGD for digits, 3e-3 AdamW for lm; onebitadam uses 1e-3 "
                        "(lm 3e-3) unless its spec sets lr, e.g. onebitadam:lr=0.002; so does decoupled)")
    p.add_argument("--warmup-steps", type=nonnegative_int, default=5,
                   help="dense steps before compression starts (Compressor warmup_steps, default 5)")
    p.add_argument("--seed", type=nonnegative_int, default=0,
                   help="seed of the data split, initial weights, minibatches and codecs (default 0)")
    p.add_argument("--eval-every", type=nonnegative_int, default=0,
                   help="evaluate every N steps on rank 0 (lm: validation loss; digits: test accuracy), kept in "
                        "results.json as eval_history (default 0: at the end only)")
    p.add_argument("--out", default=DEFAULT_OUT, help=f"output folder (default {DEFAULT_OUT})")
    p.add_argument("--no-progress", action="store_true",
                   help="no progress bars (none either when stderr is not a terminal: a redirected log)")
    p.add_argument("--faults", action="store_true",
                   help="instead: the fault scenario under torchft (digits, 3 replicas, int8 and powersgd:rank=2, "
                        "each without and with a replica SIGKILLed at step 30 and restarted at step 60); writes "
                        "faults.json and faults.png; needs pip install 'gradcompress[torchft]'")
    p.set_defaults(run=run)
    return p


# --------------------------------------------------------------------------- progress
class Progress:
    """One tqdm bar per run, fed from a queue that rank 0 writes ``(run index, steps done)`` to."""

    def __init__(self, names: list[str], steps: int, enabled: bool = True):
        import torch.multiprocessing as mp

        self.queue = mp.get_context("spawn").Queue()
        self.names, self.steps, self.enabled = names, steps, enabled
        self.bars: dict[int, Any] = {}  # tqdm bars
        self.width = max(len(n) for n in names)
        self.thread = threading.Thread(target=self._loop, daemon=True)

    def __enter__(self) -> Progress:
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.queue.put(None)
        self.thread.join(timeout=10)
        for bar in self.bars.values():
            bar.close()

    def _bar(self, i: int):
        from tqdm import tqdm

        if i not in self.bars:
            for j, bar in self.bars.items():
                if j < i and bar.n < self.steps:
                    bar.close()
            self.bars[i] = tqdm(total=self.steps, desc=self.names[i].ljust(self.width), unit="step",
                                leave=True, file=sys.stderr, disable=not self.enabled, dynamic_ncols=True)
        return self.bars[i]

    def _loop(self) -> None:
        while True:
            item = self.queue.get()
            if item is None:
                return
            i, done = item
            bar = self._bar(i)
            bar.update(done - bar.n)
            if done >= self.steps:
                bar.close()


# --------------------------------------------------------------------------- run
def run(args: argparse.Namespace) -> int:
    from .. import __version__
    from ..testbed import launch

    if args.faults:
        from . import faults

        return faults.demo(args)
    schemes = split_schemes(args.schemes) if args.schemes else list(DEFAULT_SCHEMES)
    if not schemes:
        raise CLIError("--schemes is empty")
    for s in schemes:
        check(s)
    out_dir = check_out_dir(args.out)

    skipped = []
    if any(scheme_name(s) == ONEBITADAM for s in schemes):
        problem = onebitadam_problem()
        if problem:
            print(f"gradcompress demo: skipping onebitadam: {problem}", file=sys.stderr)
            skipped = [{"scheme": s, "reason": problem} for s in schemes if scheme_name(s) == ONEBITADAM]
            schemes = [s for s in schemes if scheme_name(s) != ONEBITADAM]
    if not schemes:
        raise CLIError("no scheme left to run")

    batch_size = args.batch_size or (16 if args.task == "lm" else 32)
    configs = [RunConfig(scheme=s, steps=args.steps, batch_size=batch_size,
                         lr=None if scheme_name(s) in (ONEBITADAM, DECOUPLED) else args.lr,  # their own lr
                         warmup_steps=args.warmup_steps, seed=args.seed, task=args.task,
                         monitor_every=MONITOR_EVERY, eval_every=args.eval_every, lm_size=args.lm_size)
               for s in schemes]
    if args.lm_text != "python-docs" and args.task != "lm":
        raise CLIError(f"--lm-text {args.lm_text} is the lm task's text (--task lm), not {args.task}'s")
    data = LMTask().load(args.seed, args.lm_text) if args.task == "lm" else TASKS[args.task].load(args.seed)
    sizes = (f"digits: {len(data['x_train'])} train / {len(data['x_test'])} test" if args.task == "digits" else
             f"lm: {len(data['train'])} train / {len(data['val'])} validation bytes")
    print(f"gradcompress demo: {len(configs)} schemes x {args.steps} steps on {args.workers} workers "
          f"({sizes}, batch {batch_size} per worker)", file=sys.stderr)
    start = time.perf_counter()
    with Progress(schemes, args.steps, enabled=not args.no_progress and progress_bars()) as progress:
        per_rank = launch.run(demo_worker, args.workers, data, configs, progress.queue,
                              timeout=120 + lm_step_bound(args.lm_size) * args.steps * len(configs))
    runs = [summarize([r[i] for r in per_rank], cfg, args.workers) for i, cfg in enumerate(configs)]
    wall = time.perf_counter() - start

    _versus_none(runs, args.task)
    print(printable(format_demo(runs, args.workers)))
    result = {
        "gradcompress": __version__,
        "task": {**_task_info(args.task, data, args.lm_size, args.lm_text), "workers": args.workers, "steps": args.steps,
                 "batch_size_per_worker": batch_size, "warmup_steps": args.warmup_steps, "seed": args.seed},
        "wall_seconds": wall,
        "runs": runs,
        "skipped": skipped,
    }
    json_path = os.path.join(out_dir, "results.json")
    with open(json_path, "w") as f:
        json.dump(result, f, indent=1, allow_nan=False)
    png_path = os.path.join(out_dir, "report.png")
    plot(runs, png_path, args.workers)
    for skip in skipped:
        print(f"skipped {skip['scheme']}: {skip['reason']}")
    print(f"wrote {json_path} and {png_path} ({wall:.0f} s)")
    return 0


def _versus_none(runs: list[dict], task: str) -> None:
    """Each run's figures next to the ``none`` run's (None without one): validation loss (lm) or test accuracy, bytes."""
    base = next((r for r in runs if r["scheme"] == "none"), None)
    for r in runs:
        if task == "lm":
            r["val_loss_vs_none_pct"] = 100 * (r["val_loss"] / base["val_loss"] - 1) if base else None
        else:
            r["accuracy_delta_vs_none"] = r["test_accuracy"] - base["test_accuracy"] if base else None
        r["bytes_vs_none"] = (base["bytes_per_step"] / r["bytes_per_step"]
                              if base and base["bytes_per_step"] and r["bytes_per_step"] else None)


#: what results.json calls each lm text
LM_DATASETS = {"python-docs": "pydoc_data.topics (Python's documentation text), bytes",
               "stdlib-docstrings": "the standard library's docstrings, bytes",
               "licenses": "the installed packages' license files, bytes"}


def _task_info(task: str, data: dict, lm_size: str = "small", lm_text: str = "python-docs") -> dict:
    """What results.json says about the task: its data set, model and sizes."""
    if task == "lm":
        s = lm_shape(lm_size)
        params = sum(p.numel() for p in TASKS["lm"].make_model(RunConfig(task="lm", lm_size=lm_size)).parameters())
        info = {"name": "lm", "dataset": LM_DATASETS[lm_text],
                "model": f"byte-level transformer, {s.layers} blocks, width {s.width}, context {s.context} "
                         f"({params / 1e6:.2f}M parameters)", "size": lm_size,
                "train_bytes": len(data["train"]), "val_bytes": len(data["val"])}
        return info if lm_text == "python-docs" else {**info, "text": lm_text}
    return {"name": "digits", "dataset": "sklearn digits", "model": "MLP 64-256-256-10",
            "train_examples": len(data["x_train"]), "test_examples": len(data["x_test"])}


# --------------------------------------------------------------------------- output
ARROW = "\u2192"  # auto's row: "auto \u2192 int4 x6"


def scheme_label(run: dict) -> str:
    """The scheme as the tables name it: ``auto`` with the plan it ended with (``auto \u2192 int4 x6``)."""
    plan = run.get("plan")
    if plan is None:
        plan = ((run.get("stats") or {}).get("auto") or {}).get("plan")
    if not plan:
        return run["scheme"]
    parts = sorted(plan.items(), key=lambda kv: (-kv[1], kv[0]))
    return f"{run['scheme']} {ARROW} " + ", ".join(f"{codec} x{count}" for codec, count in parts)


def x_fewer(run: dict, workers: int) -> float | None:
    """``run``'s x fewer bytes per step than DDP (``summarize``'s ``x_fewer_than_ddp``; results written before it
    existed: from their gradient bytes per step, :func:`gradcompress.collectives.ddp_bytes`)."""
    if "x_fewer_than_ddp" in run:
        return run["x_fewer_than_ddp"]
    raw, sent = run.get("raw_bytes_per_step"), run.get("bytes_per_step")
    if raw is None or sent is None:
        return None
    reference = ddp_bytes(raw, workers)
    return reference / sent if sent else 1.0 if not reference else None


def ddp_footnote(workers: int) -> str:
    """What "x fewer bytes than DDP" compares with, for the tables' legends."""
    if workers < 2:
        return ("x fewer bytes than DDP: DDP's all-reduce of the same gradients / bytes/step (1 worker: neither sends "
                "anything, 1.0x)")
    share = 2 * (workers - 1) / workers
    return (f"x fewer bytes than DDP: what DDP's ring all-reduce of the same gradients sends per worker and step "
            f"(2(W-1)/W = {share:.2f}x the gradient bytes on {workers} workers) / bytes/step, so dense none reads "
            f"1.0x (stats()['x_fewer_than_ddp']; DiLoCo sends every H steps: averaged over the run)")


def printable(text: str, stream: TextIO | None = None) -> str:
    """``text`` as ``stream`` (default stdout) can encode it (the arrow as '->' on an ASCII terminal)."""
    encoding = getattr(stream or sys.stdout, "encoding", None) or "utf-8"
    try:
        text.encode(encoding)
        return text
    except (UnicodeEncodeError, LookupError):
        return text.replace(ARROW, "->").encode("ascii", "replace").decode("ascii")


def format_demo(runs: list[dict], workers: int, versus_none: bool = True) -> str:
    """The demo's table (``versus_none=False``: without the comparison with ``none``, as ``train`` prints it)."""
    def f(v, fmt, none="n/a"):
        return none if v is None else format(v, fmt)

    lm = any(r.get("val_loss") is not None for r in runs)
    head = ("scheme", "bytes/step", "x fewer bytes than DDP", "ms/step", "codec %", "train loss",
            "val loss" if lm else "test acc") + (("vs none",) if versus_none else ())
    rows = [head]
    for r in runs:
        metric = f(r["val_loss"], ".4f") if lm else f(r["test_accuracy"], ".2f") + "%"
        delta = f(r.get("val_loss_vs_none_pct"), "+.1f", "") + ("%" if r.get("val_loss_vs_none_pct") is not None
                                                                else "") if lm else \
            f(r.get("accuracy_delta_vs_none"), "+.2f", "")
        fewer = x_fewer(r, workers)
        step = r.get("step_seconds")
        rows.append((scheme_label(r), human_bytes(r["bytes_per_step"]),
                     "n/a" if fewer is None else f"{fewer:.1f}x",
                     f(None if step is None else 1000 * step, ".1f"),
                     f(None if r["codec_share"] is None else 100 * r["codec_share"], ".1f"),
                     f(r["final_train_loss"], ".4f"), metric) + ((delta,) if versus_none else ()))
    lines = [line.rstrip() for line in table_lines(rows)]
    lines.append("bytes/step: bytes each worker transmitted per step (ring-counted, warm-up included); "
                 + ddp_footnote(workers))
    lines.append("ms/step: wall time of a training step (mean over steps and workers); codec %: encode/decode/state "
                 "time (stats()['codec_seconds']) as a share of the step time; " + (
                     "train loss: mean of the last 20 minibatches; val loss: next-byte cross-entropy (nats) on the "
                     "held-out split" + ("; vs none: validation loss difference in %" if versus_none else "") if lm
                     else "train loss: over the whole training split after the last step" +
                     ("; vs none: test accuracy difference in points" if versus_none else "")))
    if any(scheme_label(r) != r["scheme"] for r in runs):
        lines.append(f"auto {ARROW} PLAN: the plan auto ended with, each codec x its count as "
                     "stats()['auto']['plan'] gives it")
    return "\n".join(lines)
