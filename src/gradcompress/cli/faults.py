"""``gradcompress train --fault-tolerant`` and ``gradcompress demo --faults``: training that survives killed replicas.

Both run :mod:`gradcompress.testbed.faults`: torchft's own lighthouse on 127.0.0.1 (or ``--lighthouse HOST:PORT``),
``--replicas`` replica processes (one torchft replica group each) training the digits MLP under gradcompress's
torchft DDP; optionally the last replica SIGKILLs itself at ``--kill-at`` and is restarted when the others reach
``--restart-at``. Printed: each replica's committed steps, the quorum size over the steps, the stall after the
kill, whether every replica ended with the same parameters, the final loss and accuracy.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
from typing import Any

from .common import CLIError, check_out_dir

#: the demo's scenario: 3 replicas, 120 steps, replica 2 killed at step 30 and restarted at step 60
DEMO: dict[str, Any] = {"replicas": 3, "steps": 120, "kill_at": 30, "restart_at": 60, "lr": 0.2, "hidden": 64}
DEMO_SCHEMES = ("int8", "powersgd:rank=2")


def _torchft_problem() -> str | None:
    try:
        import torchft  # noqa: F401 - imported only to see that it imports
    except ImportError:
        return "torchft is not installed: pip install 'gradcompress[torchft]' (torchft 0.2.0)"
    return None


def ranges(quorum: dict) -> str:
    """The quorum size over the steps, as ``"3 x 30, 2 x 30, 3 x 60"``."""
    parts, last, count = [], None, 0
    for step in sorted(quorum):
        if quorum[step] != last and count:
            parts.append(f"{last} x {count}")
            count = 0
        last, count = quorum[step], count + 1
    if count:
        parts.append(f"{last} x {count}")
    return ", ".join(parts)


def _check_scheme(args: argparse.Namespace) -> None:
    """A plain codec on DDP: what the fault-tolerant run trains (the spec is checked like any other)."""
    from ..config import is_auto
    from .schemes import check, is_adam_scheme

    check(args.codec)
    if is_auto(args.codec) or is_adam_scheme(args.codec.strip()) or "diloco" in args.codec:
        raise CLIError(f"--fault-tolerant trains a codec on torchft's DDP (e.g. int8, powersgd:rank=2); "
                       f"{args.codec!r} is not supported there")
    if args.fsdp or args.diloco or args.task != "digits":
        raise CLIError("--fault-tolerant runs the digits task on DDP: --fsdp, --diloco and --task lm do not apply")


def run_one(spec: str, where: str, *, kill: bool, lighthouse: str | None = None, **scenario: Any) -> dict:
    from ..testbed import faults

    cfg = dict(scenario)
    if not kill:
        cfg["kill_at"] = None
    rows = faults.kill_and_restart(where, spec, lighthouse=lighthouse, limit=120 + 0.5 * cfg["steps"], **cfg)
    summary = faults.summarize_scenario(rows, cfg["replicas"], faults.killed_at(where))
    summary.update(spec=spec, faults=kill, rows=rows)
    return summary


def line(s: dict) -> str:
    steps = "; ".join(f"replica {i}: {len(v)}" for i, v in s["committed"].items())
    stall = "" if s["stall_seconds"] is None else f", stall after the kill {s['stall_seconds']:.2f} s"
    return (f"{s['spec']:<18} {'kill+restart' if s['faults'] else 'no faults':<12} steps committed: {steps}; "
            f"quorum: {ranges(s['quorum'])}{stall}; equal parameters: {'yes' if s['equal'] else 'NO'}; "
            f"loss {s['loss']:.4f}, accuracy {100 * s['accuracy']:.1f}%")


def train(args: argparse.Namespace) -> int:
    """``gradcompress train --fault-tolerant``."""
    problem = _torchft_problem()
    if problem:
        raise CLIError(problem)
    _check_scheme(args)
    if args.replicas < 2 and args.kill_at is not None:
        raise CLIError("--kill-at needs --replicas 2 or more (a survivor must keep training)")
    if args.restart_at is not None and (args.kill_at is None or args.restart_at <= args.kill_at):
        raise CLIError("--restart-at needs --kill-at and a later step")
    for step in (args.kill_at, args.restart_at):
        if step is not None and step >= args.steps:
            raise CLIError(f"--kill-at/--restart-at must be below --steps ({args.steps}), got {step}")
    where = tempfile.mkdtemp(prefix="gradcompress-faults-")
    summary = run_one(args.codec, where, kill=args.kill_at is not None, lighthouse=args.lighthouse,
                      replicas=args.replicas, steps=args.steps, kill_at=args.kill_at, restart_at=args.restart_at,
                      lr=args.lr or 0.1, seed=args.seed)
    print(line(summary))
    if args.out:
        _save(check_out_dir(args.out), [summary])
    return 0 if summary["equal"] else 1


def demo(args: argparse.Namespace) -> int:
    """``gradcompress demo --faults``: int8 and PowerSGD, each with and without a killed replica."""
    problem = _torchft_problem()
    if problem:
        raise CLIError(problem)
    out_dir = check_out_dir(args.out)
    where = tempfile.mkdtemp(prefix="gradcompress-faults-")
    runs = []
    for spec in DEMO_SCHEMES:
        for kill in (False, True):
            runs.append(run_one(spec, os.path.join(where, f"{spec}-{kill}"), kill=kill, **DEMO))
            print(line(runs[-1]), flush=True)
    _save(out_dir, runs)
    _plot(out_dir, runs)
    return 0 if all(r["equal"] for r in runs) else 1


def _save(out_dir: str, runs: list[dict]) -> None:
    path = os.path.join(out_dir, "faults.json")
    with open(path, "w") as f:
        json.dump({"scenario": DEMO, "runs": [{k: v for k, v in r.items()} for r in runs]}, f, indent=1)
    print(f"wrote {path}")


def _plot(out_dir: str, runs: list[dict]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_q, ax_l) = plt.subplots(1, 2, figsize=(12, 4))
    for r in runs:
        label = f"{r['spec']} ({'kill+restart' if r['faults'] else 'no faults'})"
        ax_q.step(sorted(r["quorum"]), [r["quorum"][s] for s in sorted(r["quorum"])], where="post", label=label)
        for replica in sorted(r["committed"]):
            mine = [x for x in r["rows"] if x["replica"] == replica and x["committed"]]
            ax_l.plot([x["after"] - 1 for x in mine], [x["loss"] for x in mine], lw=1,
                      label=f"{label}, replica {replica}" if r["faults"] else (label if replica == 0 else None))
    ax_q.set(xlabel="committed step", ylabel="replicas in the quorum", title="quorum size")
    ax_l.set(xlabel="committed step", ylabel="loss (all digits)", title="each replica's loss at its commits")
    ax_q.legend(fontsize=7)
    ax_l.legend(fontsize=6)
    fig.tight_layout()
    path = os.path.join(out_dir, "faults.png")
    fig.savefig(path, dpi=110)
    print(f"wrote {path}")


__all__ = ["DEMO", "DEMO_SCHEMES", "demo", "ranges", "train"]
