"""Reading result files and formatting: numbers, tables, where a table's numbers come from, and the ``not
re-measured yet`` lines of results no file holds yet."""

from __future__ import annotations

import glob
import json
import math
import os

from .registry import PENDING, UNRENDERED

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
RESULTS = os.path.join(ROOT, "benchmarks", "results")
OUTPUT = os.path.join(ROOT, "BENCHMARKS.md")
HISTORY = "1f5cc69"  # the last commit with docs/changes.md, the measurement log that was BENCHMARKS.md until 2026-12-05


# --------------------------------------------------------------------------- reading
class Results:
    """The result files of one folder, read by name; remembers which were read (the rest are listed at the end)."""

    def __init__(self, folder: str):
        self.folder = folder
        self.names = sorted(os.path.basename(p)[:-5] for p in glob.glob(os.path.join(folder, "*.json")))
        self.read: set[str] = set()
        self.pending_shown: list[str] = []

    def has(self, name: str) -> bool:
        return name in self.names

    def get(self, name: str) -> dict:
        if not self.has(name):
            raise KeyError(f"benchmarks/results/{name}.json is missing")
        self.read.add(name)
        with open(os.path.join(self.folder, name + ".json")) as f:
            return json.load(f)

    def first(self, *names: str) -> str | None:
        """The first of ``names`` that exists (a fresher file before the one it replaces)."""
        return next((n for n in names if self.has(n)), None)


def scheme(data: dict, name: str) -> dict | None:
    """The first row of a netbench result named ``name`` (None when the run did not measure it)."""
    return next((s for s in data.get("schemes", []) if s["scheme"] == name), None)


def rows_named(data: dict, name: str) -> list[dict]:
    return [s for s in data["schemes"] if s["scheme"] == name]


def run(data: dict, name: str) -> dict:
    """The run of a demo result whose scheme is ``name``."""
    return next(r for r in data["runs"] if r["scheme"] == name)


def tuned_ddp(r: Results) -> dict:
    """DDP's best run of the lr sweep (lowest validation loss): the LM task's 'vs DDP'."""
    return min(r.get("lm_ddp_lr_sweep_300")["runs"], key=lambda run_: run_["val_loss"])


def ddp_at(r: Results, lr: float) -> dict:
    return next(x for x in r.get("lm_ddp_lr_sweep_300")["runs"] if math.isclose(x["lr"], lr))


# --------------------------------------------------------------------------- formatting
def ms(seconds: float) -> str:
    return f"{1000 * seconds:.1f}"


def times(ratio: float | None) -> str:
    return "–" if ratio is None else f"{ratio:.2f}x"


def fewer(ratio: float) -> str:
    """How many times fewer bytes: 2 decimals below 10, 1 below 100, whole (rounded down) above."""
    if ratio >= 100:
        return f"{math.floor(ratio)}x"
    return f"{ratio:.1f}x" if ratio >= 10 else f"{ratio:.2f}x"


def pct(value: float, reference: float) -> str:
    change = 100 * (value / reference - 1)
    text = f"{abs(change):.1f}"
    if text == "0.0":
        return "+0.0 %"
    return ("+" if change > 0 else "−") + text + " %"


def size(n: float | None) -> str:
    """Bytes, 1000-based (as the CLI prints them)."""
    if n is None:
        return "–"
    if n >= 1e6:
        return f"{n / 1e6:.2f} MB"
    if n >= 1e3:
        return f"{n / 1e3:.1f} KB"
    return f"{n:.0f} B"


def rate(bit: float) -> str:
    for unit, scale in (("Gbit/s", 1e9), ("Mbit/s", 1e6)):
        if bit >= scale:
            return f"{bit / scale:g} {unit}"
    return f"{bit:g} bit/s"


def code(text: str) -> str:
    return f"`{text}`"


def plan_text(auto: dict | None) -> str:
    """auto's plan at the end of a run: codec x buckets, and the layout where it measured one."""
    if not auto or not auto.get("plan"):
        return "–"
    text = ", ".join(f"{codec} x{n}" for codec, n in sorted(auto["plan"].items(), key=lambda kv: (-kv[1], kv[0])))
    return text.replace("none x", "dense x")


def table(header: list[str], rows: list[list[str]], right: set[int] | None = None) -> list[str]:
    right = right if right is not None else set(range(1, len(header)))
    align = ["---:" if i in right else "---" for i in range(len(header))]
    return ["| " + " | ".join(header) + " |", "|" + "|".join(align) + "|"] + \
        ["| " + " | ".join(row) + " |" for row in rows]


#: the machine most results were measured on: named once, in "How these tables are made"; others beside their file
MAIN_MACHINE = "AMD EPYC, 2 cores, Linux 6.18.44-fc-v1272, Python 3.11.7, torch 2.13.0+cpu"


def sources(r: Results, names: list[str]) -> list[str]:
    """Where a table's numbers come from: each file's command and commit, one line each (and its machine where it
    is not :data:`MAIN_MACHINE`)."""
    lines = ["", "Measured by († = command and commit reconstructed afterwards from the git history):"]
    for name in names:
        data = r.get(name)
        mark = " †" if "provenance" in data and "from git history" in data["provenance"] else ""
        when = f", {data['date'][:10]}" if data.get("date") else ""
        machine = "" if data["machine"] == MAIN_MACHINE else f"; {data['machine'].rstrip('.')}"
        lines.append(f"- `{name}.json` (commit {data['commit'][:7]}{mark}{when}{machine}): `{data['command']}`")
    if len(names) == 1:  # one file: one line
        return ["", ("Measured by († = command and commit reconstructed afterwards from the git history): " if " †" in lines[2] else
                     "Measured by: ") + lines[2][2:]]
    return lines



def pending(r: Results, *names: str) -> list[str]:
    """``not re-measured yet`` lines for the named results that no file holds (and a line for those recorded in a
    format no section renders yet)."""
    out = []
    for name in names:
        if r.has(name):
            if name in UNRENDERED:
                out.append(f"- recorded in `benchmarks/results/{name}.json` (commit {r.get(name)['commit'][:7]}); "
                           "no table renders it yet: add one in `benchmarks/document.py`")
            continue
        command, _, needs = PENDING[name]
        r.pending_shown.append(name)
        out.append(f"- not re-measured yet: `{command}`" + (f" ({needs})" if needs else ""))
    return [""] + out if out else []


def netbench_table(data: dict, names: list[str] | None = None) -> list[str]:
    """A netbench result as it stands: step time, x its baseline, bytes on the wire, codec and waiting time."""
    rows = []
    for s in data["schemes"]:
        if names is not None and s["scheme"] not in names:
            continue
        codec = "–" if s.get("codec_s_per_step") is None else ms(s["codec_s_per_step"])
        wait = "–" if s.get("wait_s_per_step") is None else ms(s["wait_s_per_step"])
        rows.append([code(s["scheme"]), ms(s["median_step_s"]), times(s["speedup"]),
                     size(s.get("wire_bytes_per_step")), codec, wait])
    base = data.get("baseline") or "ddp"
    columns = ["scheme", "ms/step", f"x {base}", "wire bytes per host per step", "codec ms/step", "wait ms/step"]
    if data.get("baseline") is None and all(s.get("speedup") is None for s in data["schemes"]):
        columns, rows = columns[:2] + columns[3:], [row[:2] + row[3:] for row in rows]  # no baseline in that run
    return table(columns, rows)


def rendered(r: Results, name: str, render_one) -> list[str]:
    """``render_one(data)`` of the result ``name`` where it exists (else nothing: :func:`pending` says so)."""
    return render_one(r.get(name)) if r.has(name) else []


def uplink(s: dict) -> float:
    """Bytes a node's uplink sent per step (its veth's tx counter), mean over the nodes."""
    by_node = s["uplink_tx_bytes_per_step_by_node"]
    return sum(by_node) / len(by_node)
