"""Wall time to the lr-tuned DDP's loss on the LM task, at 10 and 100 Mbit/s: one table, one plot, one command.

    sudo python benchmarks/time_to_loss.py --json --plot docs/time-to-loss.png      # ~25 min on 2 cores

What it runs (4 workers each): the LM task (``gradcompress demo --task lm``) with the validation loss every
``--eval-every`` steps, DDP at its tuned lr for 300 steps (its final loss is the target) and every other method for
900; then ``gradcompress netbench --model lm`` on the 4-host testbed at each link rate, for the mean step time of
each method there (DiLoCo's syncs included). A method's time to the target at a link: the first evaluated step at
or below the target, times its step time at that link. The plot draws each method's validation loss against that
wall time (one panel per link). The loss curves come from one run on loopback (the link changes the time, not the
arithmetic); the step times from the testbed. Prints one JSON object with ``--json`` (``benchmarks/record.py``
keeps it), else a table.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

#: (label, the scheme the LM demo trains, the scheme netbench times): DDP's loss comes from our dense hook
#: (``none``: DDP's result bit for bit) at the tuned lr; its time from PyTorch's own DDP
METHODS = [
    ("DDP, lr-tuned", "none", "ddp"),
    ("DiLoCo int4", "int4:diloco=50", "int4:diloco=50"),
    ("SparseLoCo", "none:diloco=50,outer=sparseloco,outer_lr=4", "none:diloco=50,outer=sparseloco,outer_lr=4"),
    ("DeMo", "decoupled:lr=0.01", "decoupled:lr=0.01"),
]
DDP_LR, DDP_STEPS, STEPS = 0.01, 300, 900


def _run(cmd: list[str]) -> str:
    print("time_to_loss: " + " ".join(cmd), file=sys.stderr, flush=True)
    done = subprocess.run(cmd, stdout=subprocess.PIPE, text=True)
    if done.returncode != 0:
        raise SystemExit(f"time_to_loss: {cmd[3]} failed (exit {done.returncode})")
    return done.stdout


def train(methods: list[tuple], eval_every: int, folder: str, seed: int) -> dict:
    """label -> the LM demo's run record (eval_history, val_loss, bytes_per_step)."""
    demo = [sys.executable, "-m", "gradcompress", "demo", "--task", "lm", "--no-progress", "--eval-every",
            str(eval_every), "--seed", str(seed)]
    runs = {}
    for name, steps, lr, chosen in (("ddp", DDP_STEPS, DDP_LR, methods[:1]), ("others", STEPS, None, methods[1:])):
        out = os.path.join(folder, name)
        _run(demo + ["--steps", str(steps), "--out", out, "--schemes", ";".join(m[1] for m in chosen)]
             + (["--lr", str(lr)] if lr else []))
        with open(os.path.join(out, "results.json")) as f:
            by_scheme = {r["scheme"]: r for r in json.load(f)["runs"]}
        runs.update({m[0]: by_scheme[m[1]] for m in chosen})
    return runs


def time_steps(methods: list[tuple], link: str, steps: int) -> dict:
    """label -> the netbench record at ``link`` (mean step seconds for DiLoCo: its syncs included)."""
    out = _run([sys.executable, "-m", "gradcompress", "netbench", "--workers", "4", "--bandwidth", link, "--model",
                "lm", "--steps", str(steps), "--timeout", "3600", "--json", "--schemes", ";".join(m[2] for m in methods)])
    by_scheme = {s["scheme"]: s for s in json.loads(out[out.index("{"):])["schemes"]}
    return {m[0]: by_scheme[m[2]] for m in methods}


def summarise(methods, runs: dict, timed: dict) -> dict:
    target = runs[methods[0][0]]["val_loss"]
    rows = []
    for label, demo_scheme, _ in methods:
        r = runs[label]
        history = r["eval_history"]
        reached = next((step for step, loss in history if loss <= target), None)
        row = {"method": label, "scheme": demo_scheme, "val_loss": r["val_loss"], "steps": r["steps"],
               "bytes_per_step": r["bytes_per_step"], "eval_history": history, "steps_to_target": reached,
               "links": {}}
        for link, by_label in timed.items():
            step_s = by_label[label]["median_step_s"]
            row["links"][link] = {"step_s": step_s, "seconds_to_target": None if reached is None else reached * step_s,
                                  "seconds_run": r["steps"] * step_s,
                                  "tx_bytes_per_step": by_label[label].get("iface_tx_bytes_per_step")}
        rows.append(row)
    return {"target": target, "target_from": f"DDP at lr {DDP_LR:g}, {DDP_STEPS} steps", "methods": rows}


def plot(result: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    links = list(result["methods"][0]["links"])
    fig, axes = plt.subplots(1, len(links), figsize=(6 * len(links), 4.2), squeeze=False)
    for ax, link in zip(axes[0], links):
        for row in result["methods"]:
            step_s = row["links"][link]["step_s"]
            xs = [step * step_s / 60 for step, _ in row["eval_history"]]
            ax.plot(xs, [loss for _, loss in row["eval_history"]], label=row["method"])
        ax.axhline(result["target"], color="grey", linestyle=":", label="tuned DDP, 300 steps")
        ax.set(title=f"LM task, 4 hosts at {link}", xlabel="wall time (minutes)", ylabel="validation loss",
               xscale="log", ylim=(result["target"] - 0.3, result["target"] + 1.0))
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--links", default="10mbit,100mbit")
    p.add_argument("--netbench-steps", type=int, default=100, help="timed steps per scheme (DiLoCo: whole intervals)")
    p.add_argument("--eval-every", type=int, default=25)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--recipe", action="append", default=[], metavar="LABEL=SCHEME",
                   help="a method to add (the low-communication recipe), e.g. 'recipe=int2:diloco=100,inner=muon'")
    p.add_argument("--plot", default=None, help="write the plot here (PNG)")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    methods = METHODS + [(label, scheme, scheme) for label, _, scheme in (r.partition("=") for r in args.recipe)]
    with tempfile.TemporaryDirectory() as folder:
        runs = train(methods, args.eval_every, folder, args.seed)
    timed = {link: time_steps(methods, link, args.netbench_steps) for link in args.links.split(",")}
    result = {"benchmark": "time_to_loss", "workers": 4, "eval_every": args.eval_every, "seed": args.seed,
              **summarise(methods, runs, timed)}
    if args.plot:
        plot(result, args.plot)
        result["plot"] = args.plot
    if args.json:
        print(json.dumps(result, indent=1))
    else:
        for row in result["methods"]:
            times = ", ".join(f"{link} {v['seconds_to_target']}" for link, v in row["links"].items())
            print(f"{row['method']:<16} {row['scheme']:<48} loss {row['val_loss']:.4f}  to target: {times}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
