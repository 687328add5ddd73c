"""BENCHMARKS.md, written from ``benchmarks/results/*.json``: one current table per question a user asks (issue 37).

    python benchmarks/document.py                   # write BENCHMARKS.md
    python benchmarks/document.py --check           # exit 1, naming what differs, if BENCHMARKS.md is not that
    python benchmarks/document.py --output PATH     # write (or, with --check, compare) PATH instead
    python benchmarks/document.py --pending         # the results no file holds yet: NAME<TAB>COMMAND, one a line

Each section is a small function that reads named result files and renders one table, the prose that says what
the table answers and how it was measured, and the ``command`` / ``commit`` / ``machine`` each file records (a file
made with ``benchmarks/record.py`` gets them when it is written). Numbers come only from result files; where a
section's file does not exist yet it prints ``not re-measured yet:`` and the command that would write it
(:data:`PENDING`). The output is deterministic: files are read by name, rows in a fixed order, fixed formatting.
Standard library only (no torch). The measurement log that was BENCHMARKS.md until 2026-12-05 is in
``docs/changes.md``.
"""

from __future__ import annotations

import argparse
import difflib
import glob
import json
import math
import os
import re
import statistics
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(ROOT, "benchmarks", "results")
OUTPUT = os.path.join(ROOT, "BENCHMARKS.md")
HISTORY = "docs/changes.md#measurement-log-moved-from-benchmarksmd-on-2026-12-05"

RECORD = "python benchmarks/record.py"
NETBENCH = "python -m gradcompress netbench"
LM_DEMO = "gradcompress demo --task lm"
ALL_SCHEMES = ("ddp;torch-fp16;torch-powersgd;none;fp16;int8;int4;sign;topk:ratio=0.01;powersgd:rank=1;"
               "powersgd:rank=4;auto;auto:budget=any")
GROWTH_SCHEMES = "ddp;fp16;int8;sign;topk:ratio=0.01;powersgd:rank=1"
#: the configurations tried for a recipe below 1/1000 of DDP's bytes (issue 40)
RECIPE_SCHEMES = ("int2:diloco=100,inner=muon;int2:diloco=100;int2:diloco=100,fragments=4,delay=5,inner=muon;"
                  "int2:diloco=100,fragments=4,delay=5;int4:diloco=200;int4:diloco=200,inner=muon;"
                  "none:diloco=100,outer=sparseloco,inner=muon;int2:diloco=200,inner=muon;int2:diloco=50,inner=muon")
RECIPE = "int2:diloco=100,fragments=4,delay=5,inner=muon"
#: the second model size (issue 40): DDP's lr sweep, the recipe and blocking DiLoCo with AdamW inside
LARGE_LRS = ("0.001", "0.003", "0.01")
SIZE_SCHEMES = f"{RECIPE};int2:diloco=100"
DILOCO_LM = "ddp;int8;int4;int4:diloco=50;int4:diloco=50,fragments=4,delay=5"
DILOCO_MLP = "int4:diloco=50;int4:diloco=50,fragments=4,delay=10"


#: the selection's stability check: the five fixed schemes once, auto ten times, in one run
SELECTION = ";".join(["ddp", "torch-fp16", "fp16", "int8", "int4"] + ["auto"] * 10)


def _netbench(name: str, args: str, minutes: int) -> tuple[str, int, str | None]:
    return f"{RECORD} {name} -- {NETBENCH} {args} --json", minutes, None


# name -> (command that writes benchmarks/results/NAME.json, minutes it should take on the 2-core machine (estimated
# from the measurement log's runs), what must change first or None). netbench needs root (network namespaces).
PENDING: dict[str, tuple[str, int, str | None]] = {
    "netbench_mlp_10gbit": _netbench("netbench_mlp_10gbit", "--workers 4 --bandwidth 10gbit --model mlp --steps 10 "
                                     f"--warmup 10 --timeout 1800 --schemes '{ALL_SCHEMES}'", 3),
    "netbench_mlp_1gbit": _netbench("netbench_mlp_1gbit", "--workers 4 --bandwidth 1gbit --model mlp --steps 10 "
                                    f"--warmup 10 --timeout 1800 --schemes '{ALL_SCHEMES}'", 4),
    "netbench_mlp_100mbit": _netbench("netbench_mlp_100mbit", "--workers 4 --bandwidth 100mbit --model mlp --steps 5 "
                                      f"--warmup 10 --timeout 1800 --schemes '{ALL_SCHEMES}'", 15),
    "auto_selection_mlp_10gbit": _netbench("auto_selection_mlp_10gbit", "--workers 4 --bandwidth 10gbit --model mlp "
                                           f"--steps 5 --warmup 20 --timeout 1800 --schemes '{SELECTION}'", 5),
    "auto_selection_mlp_1gbit": _netbench("auto_selection_mlp_1gbit", "--workers 4 --bandwidth 1gbit --model mlp "
                                          f"--steps 5 --warmup 20 --timeout 1800 --schemes '{SELECTION}'", 5),
    "auto_selection_mlp_100mbit": _netbench("auto_selection_mlp_100mbit", "--workers 4 --bandwidth 100mbit --model "
                                            f"mlp --steps 5 --warmup 20 --timeout 1800 --schemes '{SELECTION}'", 8),
    "auto_matrix_fitted": (f"{RECORD} auto_matrix_fitted --from /tmp/matrix_fitted.json -- python "
                           "benchmarks/auto_matrix.py --half fitted --out /tmp/matrix_fitted.json", 25,
                           "needs root: network namespaces"),
    "auto_matrix_heldout": (f"{RECORD} auto_matrix_heldout --from /tmp/matrix_heldout.json -- python "
                            "benchmarks/auto_matrix.py --half heldout --out /tmp/matrix_heldout.json", 25,
                            "needs root: network namespaces; run after the fitted half, the constants unchanged"),
    "auto_matrix_recheck": (f"{RECORD} auto_matrix_recheck --from /tmp/matrix_recheck.json -- python "
                            "benchmarks/auto_matrix.py --recheck benchmarks/results/auto_matrix_fitted.json "
                            "benchmarks/results/auto_matrix_heldout.json --out /tmp/matrix_recheck.json", 20,
                            "needs root: network namespaces; after both halves"),
    "lm_auto_seed1_lr1e-2_300": (f"{RECORD} lm_auto_seed1_lr1e-2_300 --from /tmp/lm_seed1/results.json -- {LM_DEMO} "
                                 "--steps 300 --lr 1e-2 --seed 1 --schemes 'none;auto:bandwidth=100mbit' "
                                 "--no-progress --out /tmp/lm_seed1", 6, None),
    "auto_heldout": (f"{RECORD} auto_heldout -- python benchmarks/auto_heldout.py --seed $(git rev-parse HEAD) --n 6 "
                     "--json", 60, "the shared tools next to the checkout (../shared/tools/heldout.py)"),
    "netbench_mlp_1gbit_w2": _netbench("netbench_mlp_1gbit_w2", "--workers 2 --bandwidth 1gbit --model mlp --steps 5 "
                                       f"--schemes '{GROWTH_SCHEMES}'", 2),
    "netbench_mlp_1gbit_w8": _netbench("netbench_mlp_1gbit_w8", "--workers 8 --bandwidth 1gbit --model mlp --steps 5 "
                                       f"--schemes '{GROWTH_SCHEMES}'", 5),
    "codec_speed": (f"{RECORD} codec_speed -- python -m gradcompress bench --numel 25000000 --repeats 5 --json", 2,
                    None),
    "instep": (f"{RECORD} instep -- python -m gradcompress bench --in-step --codecs "
               "'none;fp16;int8;sign;topk:ratio=0.01;powersgd:rank=4' --json", 1, None),
    "instep_versus_torch": (f"{RECORD} instep_versus_torch -- python -m gradcompress bench --in-step --versus-torch "
                            "--json", 1, None),
    "dense_hook_overhead": (f"{RECORD} dense_hook_overhead -- python benchmarks/dense_hook_overhead.py "
                            "--modes ddp,none,auto --rounds 3 --json", 3, None),
    "randomk_seeds_200": (f"{RECORD} randomk_seeds_200 -- python benchmarks/convergence_seeds.py --seeds 5 --steps 200 "
                          "--schemes 'none;randomk:ratio=0.25,scale=false;randomk:ratio=0.25,scale=false,momentum=0.9'"
                          " --json", 2, None),
    "lm_auto_any_lr3e-3_300": (f"{RECORD} lm_auto_any_lr3e-3_300 --from /tmp/lm_auto/results.json -- {LM_DEMO} "
                               "--steps 300 --schemes 'none;int4;auto:bandwidth=100mbit;auto:bandwidth=100mbit,"
                               "budget=any' --out /tmp/lm_auto", 6, None),
    "digits_auto_any": (f"{RECORD} digits_auto_any --from /tmp/digits_auto/results.json -- gradcompress demo "
                        "--schemes 'none;auto:bandwidth=100mbit;auto:bandwidth=100mbit,budget=any' "
                        "--out /tmp/digits_auto", 1, None),
    "fsdp_mlp_1gbit": _netbench("fsdp_mlp_1gbit", "--fsdp --workers 4 --bandwidth 1gbit --model mlp --steps 6", 3),
    "fsdp_mlp_100mbit": _netbench("fsdp_mlp_100mbit", "--fsdp --workers 4 --bandwidth 100mbit --model mlp --steps 3 "
                                  "--timeout 1800", 8),
    "hsdp_lm_300": (f"{RECORD} hsdp_lm_300 " + " ".join(f"--from /tmp/hsdp/{n}/results.json" for n in
                                                        ("none", "int8", "int4", "int8p")) +
                    " -- bash -c 'T=\"python -m gradcompress train --task lm --workers 4 --steps 300 --fsdp --hsdp\";"
                    " $T --codec none --out /tmp/hsdp/none && $T --codec int8 --out /tmp/hsdp/int8 &&"
                    " $T --codec int4 --out /tmp/hsdp/int4 && $T --codec int8 --params int8 --out /tmp/hsdp/int8p'",
                    12, None),
    "ftbench_1gbit": (f"{RECORD} ftbench_1gbit -- python -m gradcompress.testbed.ftbench --hosts 4 --rate 1gbit "
                      "--steps 20 --warmup 5 --model mlp --json", 4, None),
    "ftbench_loopback": (f"{RECORD} ftbench_loopback -- python -m gradcompress.testbed.ftbench --hosts 4 --steps 20 "
                         "--warmup 5 --model mlp --json", 3, None),
    "torchft_stall": (f"{RECORD} torchft_stall -- python benchmarks/torchft_stall.py --repeats 3 --json", 3, None),
    "torchft_faults": (f"{RECORD} torchft_faults -- python benchmarks/torchft_faults.py --repeats 3 --json", 10,
                       "needs root for the cut link: network namespaces"),
    "demo_faults": (f"{RECORD} demo_faults --from /tmp/ft/faults.json -- gradcompress demo --faults --out /tmp/ft", 3,
                    None),
    "diloco_lm_10mbit": _netbench("diloco_lm_10mbit", "--workers 4 --bandwidth 10mbit --model lm --steps 100 "
                                  f"--timeout 1800 --schemes '{DILOCO_LM}'", 9),
    "diloco_lm_100mbit": _netbench("diloco_lm_100mbit", "--workers 4 --bandwidth 100mbit --model lm --steps 100 "
                                   f"--schemes '{DILOCO_LM}'", 3),
    "diloco_lm_1gbit": _netbench("diloco_lm_1gbit", "--workers 4 --bandwidth 1gbit --model lm --steps 100 "
                                 f"--schemes '{DILOCO_LM}'", 2),
    "lm_recipe_900": (f"{RECORD} lm_recipe_900 --from /tmp/lm_recipe/results.json -- {LM_DEMO} --steps 900 "
                      f"--eval-every 50 --no-progress --schemes '{RECIPE_SCHEMES}' --out /tmp/lm_recipe", 15, None),
    "lm_recipe_seed1_900": (f"{RECORD} lm_recipe_seed1_900 --from /tmp/lm_recipe1/results.json -- {LM_DEMO} --steps "
                            f"900 --eval-every 50 --no-progress --seed 1 --schemes '{RECIPE}' --out /tmp/lm_recipe1",
                            3, None),
    "time_to_loss": (f"{RECORD} time_to_loss -- python benchmarks/time_to_loss.py --recipe 'recipe={RECIPE}' "
                     "--plot docs/time-to-loss.png --json", 30, "needs root: network namespaces"),
    "lm_large_ddp_lr_sweep_300": (f"{RECORD} lm_large_ddp_lr_sweep_300 " + " ".join(
        f"--from /tmp/lml_{lr}/results.json" for lr in LARGE_LRS) + f" -- bash -c 'for LR in {' '.join(LARGE_LRS)}; "
        f"do {LM_DEMO} --lm-size large --steps 300 --schemes none --lr $LR --no-progress --out /tmp/lml_$LR; done'",
        11, None),
    "lm_large_recipe_900": (f"{RECORD} lm_large_recipe_900 --from /tmp/lml_recipe/results.json -- {LM_DEMO} "
                            f"--lm-size large --steps 900 --eval-every 50 --no-progress --schemes '{SIZE_SCHEMES}' "
                            "--out /tmp/lml_recipe", 30, None),
    "lm_diloco_900": (f"{RECORD} lm_diloco_900 --from /tmp/lm_diloco/results.json -- {LM_DEMO} --steps 900 --schemes "
                      "'none:diloco=25;int4:diloco=25;int4:diloco=50;topk:ratio=0.03,values=int8,diloco=25' "
                      "--out /tmp/lm_diloco", 7, None),
    "diloco_mlp_10mbit": _netbench("diloco_mlp_10mbit", "--workers 4 --bandwidth 10mbit --model mlp --steps 100 "
                                   f"--timeout 1800 --schemes '{DILOCO_MLP}'", 4),
    "diloco_mlp_100mbit": _netbench("diloco_mlp_100mbit", "--workers 4 --bandwidth 100mbit --model mlp --steps 100 "
                                    f"--schemes '{DILOCO_MLP}'", 3),
}


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
    return lines


# Pending results whose format no section renders yet: once recorded, their section says so until one does.
UNRENDERED: set[str] = set()


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


# --------------------------------------------------------------------------- the sections
LINK_RATES = [("10 Gbit/s", "netbench_mlp_10gbit", "auto_any_mlp_10gbit"),
              ("1 Gbit/s", "netbench_mlp_1gbit", "auto_any_mlp_1gbit"),
              ("100 Mbit/s", "netbench_mlp_100mbit", "auto_mlp_100mbit")]


def link_files(r: Results) -> list[tuple[str, str]]:
    return [(label, r.first(fresh, fallback)) for label, fresh, fallback in LINK_RATES]


def fastest_fixed(data: dict) -> dict:
    """The fastest scheme of a run that is not the autopilot."""
    return min((s for s in data["schemes"] if not s["scheme"].startswith("auto")), key=lambda s: s["median_step_s"])


def summary(r: Results) -> list[str]:
    out = ["## Summary", "",
           "All measured on one 2-core CPU machine (torch 2.13, gloo): emulated hosts share the 2 cores, so compute "
           "and codec work are contended and step-time ratios are smaller than on GPUs; bytes are exact. Each line "
           "below is computed from the files of the section it names.", ""]
    fast, runs = [], [(label, r.get(name)) for label, name in link_files(r)]
    counts = [sum(not s["scheme"].startswith("auto") for s in data["schemes"]) for _, data in runs]
    for (label, data), count in zip(runs, counts):
        best = fastest_fixed(data)
        few = f" (of the {count} schemes measured there)" if count < max(counts) else ""
        fast.append(f"{label} {code(best['scheme'])} {times(best['speedup'])}{few}")
    out.append(f"- **Which scheme at my link** (12.6M MLP, 4 hosts; fastest fixed scheme, x DDP in the same run): "
               + "; ".join(fast) + ".")
    auto = [times(ratio) for _, ratio in autopilot_ratios(r)]
    halves = []
    for name, half in (("auto_matrix_fitted", "fitted"), ("auto_matrix_heldout", "held-out")):
        if r.has(name):
            ratios = [x for x in (_matrix_cell(run)[1] for run in r.get(name)["cells"]) if x is not None]
            halves.append(f"{sum(x <= 1.05 for x in ratios)} of {len(ratios)} {half} cells")
    matrix = f"; on issue 39's matrix within 1.05x in {' and '.join(halves)}" if halves else ""
    out.append(f"- **The autopilot** (`auto`) against the best of DDP, torch-fp16, fp16, int8 and int4 at 10 Gbit/s, "
               f"1 Gbit/s, 100 Mbit/s: {', '.join(auto)}{matrix}.")
    tuned = tuned_ddp(r)
    lm = r.get("lm_auto_lr1e-2_300")
    crit = run(r.get("lm_auto_critical_lr1e-2_300"), "auto:bandwidth=100mbit")
    parts = [f"{code(n)} {pct(run(lm, n)['val_loss'], tuned['val_loss'])} at "
             f"{fewer(tuned['bytes_per_step'] / run(lm, n)['bytes_per_step'])} fewer bytes" for n in ("int4", "int8")]
    parts.append(f"`auto` {pct(crit['val_loss'], tuned['val_loss'])} at "
                 f"{fewer(tuned['bytes_per_step'] / crit['bytes_per_step'])}")
    out.append(f"- **Accuracy** (LM task, AdamW, 300 steps, against DDP at its best lr, {tuned['lr']:g}: "
               f"{tuned['val_loss']:.4f}): " + "; ".join(parts) + ".")
    demo = run(r.get("lm_decoupled_lr_sweep_300"), "decoupled:lr=0.01")
    sparse = run(r.get("lm_sparseloco_outer_lr_sweep_900"), "none:diloco=50,outer=sparseloco,outer_lr=4")
    diloco = run(r.get("lm_streaming_diloco_900"), "int4:diloco=50")
    total = tuned["cumulative_bytes"][-1]
    out.append(f"- **Below one bit per coordinate**: DeMo (`decoupled:lr=0.01`) "
               f"{pct(demo['val_loss'], tuned['val_loss'])} at "
               f"{fewer(tuned['bytes_per_step'] / demo['bytes_per_step'])} fewer bytes per step; SparseLoCo "
               f"(outer lr 4) {pct(sparse['val_loss'], tuned['val_loss'])} after 900 steps at "
               f"{fewer(total / sparse['cumulative_bytes'][-1])} fewer bytes in all; `int4:diloco=50` "
               f"{pct(diloco['val_loss'], tuned['val_loss'])} after 900 steps at "
               f"{fewer(total / diloco['cumulative_bytes'][-1])} fewer.")
    nodes = r.get("nodes_2x4_100mbit")
    hier, flat = scheme(nodes, "int4"), scheme(nodes, "int4:topology=flat")
    fsdp = {row["scheme"]: row for row in r.get("fsdp_nodes_2x4_1gbit")["rows"]}
    out.append(f"- **Nodes and FSDP** (2 nodes x 4 workers): hierarchical int4 puts "
               f"{uplink(hier) / uplink(flat):.2f} of its flat bytes on the uplink; HSDP with int8 "
               f"{fsdp['int8:layout=hsdp']['x_hsdp']:.3f} of dense HSDP's, plain FSDP with int4 gradients and int8 "
               f"parameters {fsdp['int4:params=int8']['x_fsdp']:.3f} of dense FSDP's.")
    if r.has("lm_recipe_900"):
        out.append(recipe_summary(r, tuned))
    missing = [n for n in PENDING if not r.has(n)]
    if missing:
        out.append("- **Not measured yet** (no result file; each section gives the command): "
                   + ", ".join(f"`{n}`" for n in missing) + ".")
    return out


def recipe_summary(r: Results, tuned: dict) -> str:
    """The best run of the recipe search at >= 1000x fewer bytes per step than the tuned DDP."""
    runs = [x for x in r.get("lm_recipe_900")["runs"] if tuned["bytes_per_step"] / x["bytes_per_step"] >= 1000]
    best = min(runs, key=lambda x: x["val_loss"])
    line = (f"- **Below 1/1000 of DDP's bytes per step** (LM, 900 steps): the best of {len(runs)} configurations, "
            f"{code(best['scheme'])}, {pct(best['val_loss'], tuned['val_loss'])} against the tuned DDP's 300-step loss "
            f"at {fewer(tuned['bytes_per_step'] / best['bytes_per_step'])} fewer bytes per step")
    if not all(r.has(n) for n in SIZE_RUNS):
        return line + "."
    ddp = min(r.get("lm_large_ddp_lr_sweep_300")["runs"], key=lambda x: x["val_loss"])
    big = run(r.get("lm_large_recipe_900"), best["scheme"]) if best["scheme"] == RECIPE else None
    return line + ("." if big is None else
                   f"; on the 7x larger model {pct(big['val_loss'], ddp['val_loss'])} against its tuned DDP at "
                   f"{fewer(ddp['bytes_per_step'] / big['bytes_per_step'])}.")


def link_table(r: Results) -> list[str]:
    files = link_files(r)
    runs = [(label, r.get(name)) for label, name in files]
    order: list[str] = []
    for _, data in runs:
        order += [s["scheme"] for s in data["schemes"] if s["scheme"] not in order]
    best = {label: fastest_fixed(data)["scheme"] for label, data in runs}
    rows = []
    for name in order:
        cells, sent = [code(name)], []
        for label, data in runs:
            s = scheme(data, name)
            if s is None:
                cells.append("–")
                continue
            cell = f"{ms(s['median_step_s'])} ms, {times(s['speedup'])}"
            cells.append(f"**{cell}**" if name == best[label] else cell)
            if size(s["wire_bytes_per_step"]) not in sent:
                sent.append(size(s["wire_bytes_per_step"]))
        rows.append(cells + [" / ".join(sent)])
    out = ["## Which scheme at my link", "",
           "Step time of each scheme at 10 Gbit/s, 1 Gbit/s and 100 Mbit/s, and how much faster than PyTorch's DDP "
           "in the same run (bold: the fastest fixed scheme at that rate). The 12.6M-parameter MLP "
           "(1024-2048-2048-2048-1024, batch 32 of random data per worker, SGD) on 4 emulated hosts: one Linux "
           "network namespace per host, links shaped with `tc` in both directions, one gloo worker per host, every "
           "byte between workers on the shaped links. Step time: the slowest rank's, median over the timed steps "
           "after the untimed ones (the Compressor's 2 dense warm-up steps among them). Bytes: `Compressor.stats()`'s "
           "`wire_bytes` per host per step (PyTorch's baselines: the same ring count from the cost model). 4 workers "
           "share 2 cores, so compute and codec work are contended: at 10 Gbit/s the step is compute- and "
           "codec-bound. `auto` / `auto:budget=any`: the autopilot, measuring everything itself (section "
           "[The autopilot](#the-autopilot)).", ""]
    out += table(["scheme"] + [label for label, _ in runs] + ["sent per host per step"], rows)
    out += ["", "–: not in that run. Which accuracy each scheme keeps: [What it keeps of accuracy]"
                "(#what-it-keeps-of-accuracy)."]
    out += pending(r, *[fresh for _, fresh, _ in LINK_RATES])
    out += sources(r, [name for _, name in files])
    return out


def growth_table(r: Results) -> list[str]:
    files = [(2, "netbench_mlp_1gbit_w2"), (4, r.first("netbench_mlp_1gbit", "auto_any_mlp_1gbit")),
             (8, "netbench_mlp_1gbit_w8")]
    present = [(w, name, r.get(name)) for w, name in files if r.has(name)]
    names = [n for n in GROWTH_SCHEMES.split(";") if all(scheme(d, n) for _, _, d in present)]
    rows = [[code(n)] + [size(scheme(d, n)["wire_bytes_per_step"]) for _, _, d in present] for n in names]
    out = ["## How the bytes grow with the number of workers", "",
           "Bytes each worker sends per step (`stats()`, ring-counted), 12.6M MLP at 1 Gbit/s. What an all-gather "
           "of sparse payloads sends (top-k, DGC, threshold) grows as W-1; what the two-step reduce (int8, sign) and "
           "the all-reduces (fp16, PowerSGD, DDP) send grows as 2(W-1)/W, below twice the compressed size.", ""]
    out += table(["scheme"] + [f"{w} workers" for w, _, _ in present], rows)
    out += pending(r, "netbench_mlp_1gbit_w2", "netbench_mlp_1gbit_w8")
    out += sources(r, [name for _, name, _ in present])
    return out


def cost_table(r: Results) -> list[str]:
    name = r.first("netbench_mlp_1gbit", "auto_any_mlp_1gbit")
    data = r.get(name)
    rows = []
    for s in data["schemes"]:
        if s.get("codec_s_per_step") is None:
            continue
        rows.append([code(s["scheme"]), ms(s["median_step_s"]), ms(s["codec_s_per_step"]), ms(s["wait_s_per_step"]),
                     f"{100 * s['codec_s_per_step'] / s['median_step_s']:.0f} %"])
    out = ["## What compression costs", "",
           "Where a compressed step's time goes on the 4-host testbed at 1 Gbit/s (12.6M MLP): `stats()`'s codec "
           "time (encode, decode, error feedback) and the time spent waiting on collectives after the backward pass, "
           f"per step, rank 0. In this run the compute alone took {ms(data['compute_s'])} ms per step with all 4 "
           f"workers at once ({ms(data['compute_solo_s'])} ms for one worker alone) and DDP with a hook that sends "
           f"nothing {ms(data['ddp_floor_s'])} ms: no scheme can be faster than that here.", ""]
    out += table(["scheme", "ms/step", "codec ms/step", "wait ms/step", "codec share of the step"], rows)
    out += ["", "The codecs' own speed (encode + decode of a 25M-element tensor against a float16 round trip), one "
                "whole `Compressor` step against a dense all-reduce of the same gradients on 2 loopback workers "
                "(with its memory), our hooks against PyTorch's `fp16_compress_hook` and `powerSGD_hook`, and what "
                "the DDP hook costs when it sends dense:"]
    out += pending(r, "codec_speed", "instep", "instep_versus_torch", "dense_hook_overhead")
    out += rendered(r, "codec_speed", codec_speed_table) + rendered(r, "instep", instep_table)
    out += rendered(r, "instep_versus_torch", versus_torch_table)
    out += rendered(r, "dense_hook_overhead", dense_hook_table)
    out += sources(r, [name] + [n for n in ("codec_speed", "instep", "instep_versus_torch", "dense_hook_overhead")
                                if r.has(n)])
    return out


def rendered(r: Results, name: str, render_one) -> list[str]:
    """``render_one(data)`` of the result ``name`` where it exists (else nothing: :func:`pending` says so)."""
    return render_one(r.get(name)) if r.has(name) else []


def codec_speed_table(data: dict) -> list[str]:
    rows = [[code(c["codec"]), "x".join(str(n) for n in c["shape"]), times(c["vs_fp16_roundtrip"]),
             fewer(c["compression_ratio"]), f"{c['relative_error']:.3f}"] for c in data["codecs"]]
    return ["", f"**The codecs' own speed** (`codec_speed.json`): encode + decode of {data['numel'] / 1e6:g}M "
                f"float32 elements on {data['threads']} CPU threads, median of {data['repeats']}, against a float16 "
                f"round trip of the same tensor ({ms(data['fp16_roundtrip_seconds'])} ms); relative error "
                "||x - decode(encode(x))|| / ||x|| on Gaussian data:", ""] + \
        table(["codec", "shape", "time x fp16 round trip", "smaller by", "relative error"], rows, right={2, 3, 4})


def instep_table(data: dict) -> list[str]:
    rows = [[code(s["scheme"]), "on" if s["error_feedback"] else "off", ms(s["step_seconds"]), times(s["vs_dense"]),
             size(s["wire_bytes_per_step"]), f"{s['held_x']:.2f}", f"{s['peak_x']:.2f}"] for s in data["schemes"]]
    return ["", f"**One whole step** (`instep.json`): `Compressor.synchronize` of {data['matrices']} matrices "
                f"{data['size']}x{data['size']} ({size(data['grad_bytes'])} of float32 gradients) on "
                f"{data['workers']} loopback workers, median of {data['repeats']}, against a dense all-reduce of "
                f"the same gradients ({ms(data['dense_seconds'])} ms); the memory the Compressor keeps between "
                "steady steps and the highest extra memory during one above that (resident set), in multiples of "
                "the gradients' size:", ""] + \
        table(["scheme", "error feedback", "ms/step", "x dense all-reduce", "sent per step", "held x gradients",
               "peak x gradients"], rows, right={2, 3, 4, 5, 6})


def versus_torch_table(data: dict) -> list[str]:
    by = {v["variant"]: v["step_seconds"] for v in data["variants"]}
    rows = [[v["variant"], ms(v["step_seconds"]), times(v["vs_ddp"])] for v in data["variants"]]
    pairs = [("fp16", "torch fp16_compress_hook"), ("powersgd:rank=4", "torch powerSGD_hook rank 4")]
    ours = "; ".join(f"`{a}` {times(by[a] / by[b])} of `{b.split()[1]}`'s step" for a, b in pairs
                     if a in by and b in by)
    return ["", f"**Our hooks against PyTorch's** (`instep_versus_torch.json`): DDP training steps of a "
                f"{data['layers']}-layer MLP of width {data['size']}, batch {data['batch']}, on {data['workers']} "
                f"loopback workers, median of {data['repeats']} (" + ours + "):", ""] + \
        table(["hook", "ms/step", "x DDP"], rows, right={1, 2})


def dense_hook_table(data: dict) -> list[str]:
    modes = data["modes"]
    rounds = data["median_step_s_by_round"]
    median = data["median_over_rounds_s"]
    each = "; ".join(f"{code(m)} {' / '.join(ms(row[m]) for row in rounds)} ms, median {ms(median[m])} "
                     f"({times(median[m] / median['ddp'])})" for m in modes)
    return ["", f"**The DDP hook sending dense** (`dense_hook_overhead.json`): a small CNN on {data['workers']} "
                f"loopback workers, median step time of {data['steps'] - data['steps_not_counted']} steps per run, "
                f"{len(rounds)} rounds with the modes interleaved; `none` and `auto` are `register_ddp_hook(ddp, MODE)`"
                f" (x `ddp` in brackets): {each}."]


def accuracy_tables(r: Results) -> list[str]:
    sweep = r.get("lm_ddp_lr_sweep_300")
    tuned = tuned_ddp(r)
    rows = [[f"{x['lr']:g}", f"{x['val_loss']:.4f}", pct(x["val_loss"], tuned["val_loss"])] for x in sweep["runs"]]
    out = ["## What it keeps of accuracy", "",
           "The LM task (`gradcompress demo --task lm`): a byte-level transformer (2 blocks, width 128, context 64, "
           "0.47M parameters) on Python's documentation text, 4 gloo workers, 16 windows of 64 bytes per worker and "
           "step, AdamW with cosine decay, seed 0, library defaults with 5 dense warm-up steps; validation loss in "
           "nats per byte at step 300. One seed: differences of about 1 % between codecs are within its noise. The "
           "baseline is DDP at the best learning rate of a sweep:", ""]
    out += table(["DDP's AdamW lr", "validation loss", "vs the best"], rows)
    labels = [("lm_auto_lr1e-2_300", "int8", "`int8`"),
              ("lm_auto_lr1e-2_300", "int4", "`int4`"),
              ("lm_auto_critical_lr1e-2_300", "auto:bandwidth=100mbit", "`auto:bandwidth=100mbit` (the defaults)"),
              ("lm_auto_lr1e-2_300", "auto:bandwidth=100mbit",
               "`auto:bandwidth=100mbit`, run before `critical=` existed (as `critical=0`)"),
              ("lm_auto_allocate_lr1e-2_300", "auto:bandwidth=100mbit,allocate=true",
               "`auto:bandwidth=100mbit,allocate=true`"),
              ("lm_auto_allocate_adam_lr1e-2_300", "auto:bandwidth=100mbit,allocate=adam",
               "`auto:bandwidth=100mbit,allocate=adam` (errors weighed by 1/v, issue 39)"),
              ("lm_auto_any_critical_lr1e-2_300", "auto:bandwidth=100mbit,budget=any",
               "`auto:bandwidth=100mbit,budget=any`"),
              ("lm_auto_any_critical_lr1e-2_300", "auto:bandwidth=100mbit,budget=any,critical=0",
               "`auto:bandwidth=100mbit,budget=any,critical=0`")]
    rows = [[f"DDP (`none`, lr {tuned['lr']:g})", f"{tuned['val_loss']:.4f}", "—", size(tuned["bytes_per_step"]),
             fewer(1.0), "–"]]
    for name, scheme_name, label in labels:
        x = run(r.get(name), scheme_name)
        auto = (x.get("stats") or {}).get("auto")
        rows.append([label, f"{x['val_loss']:.4f}", pct(x["val_loss"], tuned["val_loss"]), size(x["bytes_per_step"]),
                     fewer(tuned["bytes_per_step"] / x["bytes_per_step"]), plan_text(auto)])
    out += ["", f"Every scheme at DDP's best lr ({tuned['lr']:g}), against it; `bytes/step` includes the dense "
                "warm-up steps; the autopilot with a bandwidth hint (no probing), so its choice is the 100 Mbit/s "
                "one:", ""]
    out += table(["scheme", "val loss", "vs tuned DDP", "bytes/step", "fewer bytes than DDP", "auto's plan"], rows,
                 right={1, 2, 3, 4})
    adam = r.get("lm_auto_allocate_adam_lr1e-2_300")
    own, hinted = run(adam, "none"), run(adam, "auto:bandwidth=100mbit")
    weighed = run(adam, "auto:bandwidth=100mbit,allocate=adam")["stats"]["auto"]["allocation"]["tensors"]
    out += ["", f"`allocate=adam` ran next to DDP and `auto:bandwidth=100mbit` in one run "
                f"(`lm_auto_allocate_adam_lr1e-2_300.json`): with each tensor's error weighed by its mean squared "
                f"gradient the allocation gave int4 to all {sum(weighed.values())} tensors it may allocate (int2 costs "
                f"about 6x int4's relative error for half its bytes, int8 1/300 of it for twice: nothing to trade), "
                f"so it is the plain autopilot's run bit for bit: {hinted['val_loss']:.4f} against that run's own DDP "
                f"{own['val_loss']:.4f} ({pct(hinted['val_loss'], own['val_loss'])}; DDP's loss in this run and in the sweep differ by "
                f"{pct(own['val_loss'], tuned['val_loss'])}: gloo's reduction order) at "
                f"{fewer(own['bytes_per_step'] / hinted['bytes_per_step'])} fewer bytes. Within 1 % at 8x fewer "
                "bytes is not reached by any allocation of int8/int4/int2 under this budget."]
    if r.has("lm_auto_seed1_lr1e-2_300"):
        second = r.get("lm_auto_seed1_lr1e-2_300")
        base, auto = run(second, "none"), run(second, "auto:bandwidth=100mbit")
        out += ["", f"A second seed (`lm_auto_seed1_lr1e-2_300.json`, `--seed 1`: another split, initial weights and "
                    f"minibatches; DDP and `auto:bandwidth=100mbit` at lr 0.01 in one run): DDP {base['val_loss']:.4f}, "
                    f"auto {auto['val_loss']:.4f} ({pct(auto['val_loss'], base['val_loss'])}) at "
                    f"{fewer(base['bytes_per_step'] / auto['bytes_per_step'])} fewer bytes "
                    f"({plan_text(auto['stats']['auto'])})."]
    else:
        out += pending(r, "lm_auto_seed1_lr1e-2_300")
    digits = r.get("digits_auto_allocate")
    none = run(digits, "none")
    rows = [[code(x["scheme"]), f"{x['test_accuracy']:.2f} %", f"{x['test_accuracy'] - none['test_accuracy']:+.2f}",
             size(x["bytes_per_step"]), fewer(none["bytes_per_step"] / x["bytes_per_step"])] for x in digits["runs"]]
    out += ["", "Digits (`gradcompress demo`: scikit-learn's handwritten digits, an MLP 64-256-256-10, 4 workers, "
                "SGD with momentum, 250 steps) with the same hint:", ""]
    out += table(["scheme", "test accuracy", "points vs `none`", "bytes/step", "fewer bytes"], rows)
    out += ["", "Every scheme of the demo with the library's defaults (digits under SGD, the LM task at lr 3e-3): "
                "[docs/demo.md](docs/demo.md) and [docs/accuracy.md](docs/accuracy.md), tables generated from "
                "`docs/demo-results.json` and `docs/lm-demo-results.json` (`benchmarks/readme_tables.py`). Not "
                "re-measured yet: random-k over 5 seeds ([docs/algorithms.md](docs/algorithms.md)), and the autopilot "
                "with `budget=any` on both tasks at the demo's defaults ([docs/auto.md](docs/auto.md)):"]
    out += pending(r, "randomk_seeds_200", "lm_auto_any_lr3e-3_300", "digits_auto_any")
    out += rendered(r, "lm_auto_any_lr3e-3_300", auto_runs_table) + rendered(r, "digits_auto_any", auto_runs_table)
    out += rendered(r, "randomk_seeds_200", seeds_table)
    out += sources(r, [n for n in ("lm_auto_any_lr3e-3_300", "digits_auto_any", "randomk_seeds_200") if r.has(n)])
    out += sources(r, ["lm_ddp_lr_sweep_300", "lm_auto_lr1e-2_300", "lm_auto_critical_lr1e-2_300",
                       "lm_auto_allocate_lr1e-2_300", "lm_auto_allocate_adam_lr1e-2_300",
                       "lm_auto_any_critical_lr1e-2_300", "digits_auto_allocate"]
                  + [n for n in ("lm_auto_seed1_lr1e-2_300",) if r.has(n)])
    return out


def auto_runs_table(data: dict) -> list[str]:
    """A demo run of ``none`` and the autopilot (with a hint) on one task: its plan, loss or accuracy, bytes."""
    lm = data["task"]["name"] == "lm"
    none = run(data, "none")
    rows = []
    for x in data["runs"]:
        metric = (f"{x['val_loss']:.4f}", pct(x["val_loss"], none["val_loss"])) if lm else \
            (f"{x['test_accuracy']:.2f} %", f"{x['test_accuracy'] - none['test_accuracy']:+.2f}")
        rows.append([code(x["scheme"]), *metric, size(x["bytes_per_step"]),
                     fewer(none["bytes_per_step"] / x["bytes_per_step"]),
                     plan_text((x.get("stats") or {}).get("auto"))])
    what = ("the LM task at the demo's lr 3e-3, 300 steps" if lm else
            f"digits, {data['task']['steps']} steps")
    return ["", f"The autopilot with the hint on {what} (`{'lm_auto_any_lr3e-3_300' if lm else 'digits_auto_any'}"
                ".json`):", ""] + \
        table(["scheme", "val loss" if lm else "test accuracy", "vs `none`" if lm else "points vs `none`",
               "bytes/step", "fewer bytes", "auto's plan"], rows, right={1, 2, 3, 4})


def seeds_table(data: dict) -> list[str]:
    """Digits over seeds: each scheme's test accuracy per seed and its worst distance to ``none``."""
    seeds = sorted({x["seed"] for x in data["runs"]})
    acc = {(x["scheme"], x["seed"]): x["test_accuracy"] for x in data["runs"]}
    rows = []
    for name in data["schemes"]:
        gaps = [acc[(name, s)] - acc[("none", s)] for s in seeds]
        rows.append([code(name), *[f"{acc[(name, s)]:.2f}" for s in seeds], f"{min(gaps):+.2f}"])
    return ["", f"Random-k over seeds (`randomk_seeds_200.json`): digits, 4 workers, {data['optimizer']}, "
                f"{data['steps']} steps, no warm-up; test accuracy in % per seed (data split, weights, batches and "
                "codec seeded alike) and the largest drop below `none`:", ""] + \
        table(["scheme", *[f"seed {s}" for s in seeds], "worst vs `none`"], rows,
              right=set(range(1, len(seeds) + 2)))


def hsdp_lm_table(data: dict) -> list[str]:
    none = data["runs"][0]
    rows = [[code(x["scheme"]), f"{x['val_loss']:.4f}", pct(x["val_loss"], none["val_loss"]),
             size(x["bytes_per_step"]), size(x["param_bytes_per_step"])] for x in data["runs"]]
    return [""] + table(["codec (the replicas' all-reduce)", "val loss", "vs dense HSDP", "gradient bytes/step",
                         "int8 parameter all-gathers (--params int8)"], rows, right={1, 2, 3, 4})


def uplink(s: dict) -> float:
    """Bytes a node's uplink sent per step (its veth's tx counter), mean over the nodes."""
    by_node = s["uplink_tx_bytes_per_step_by_node"]
    return sum(by_node) / len(by_node)


def fsdp_tables(r: Results) -> list[str]:
    out = ["## FSDP and HSDP", "",
           "FSDP2 (`fully_shard` on every layer and the root) with its reduce-scatter compressed "
           "(`register_fsdp(model, spec)`, error feedback on), against PyTorch's own FSDP2, on the 4-host testbed "
           "(12.6M MLP). FSDP2 also all-gathers the parameters twice per step, which gradient compression does not "
           "touch:"]
    fresh = [n for n in ("fsdp_mlp_1gbit", "fsdp_mlp_100mbit") if r.has(n)]
    for name in fresh:
        data = r.get(name)
        out += ["", f"At {rate(data['bandwidth_bit'])}:", ""] + netbench_table(data)
    out += pending(r, "fsdp_mlp_1gbit", "fsdp_mlp_100mbit")
    data = r.get("fsdp_nodes_2x4_1gbit")
    rows = []
    for row in data["rows"]:
        up = row["uplink_mb_per_node"]
        grad = "n/a" if row["grad_inter_node_mb_per_node"] is None else f"{row['grad_inter_node_mb_per_node']:.1f} MB"
        param = "–" if row["param_mb_per_worker"] is None else \
            "0 B" if row["param_mb_per_worker"] == 0 else f"{row['param_mb_per_worker']:.1f} MB"
        rows.append([code(row["scheme"]), row["layout"], f"{row['step_ms']:.0f}", times(row["speedup"]),
                     f"{sum(up) / len(up):.1f} MB", grad, param, f"{row['x_fsdp']:.3f}", f"{row['x_hsdp']:.3f}"])
    out += ["", "**Across nodes** (2 nodes x 4 workers, 1 Gbit/s uplinks, the 8.4M MLP `mlp8m`): `fsdp` is FSDP2 "
                "over all 8 ranks and `hsdp` FSDP2's HSDP (shard inside the node, replicate across), both dense; "
                "`CODEC:layout=hsdp` compressed HSDP (`register_fsdp(model, CODEC, mesh=...)`); `CODEC` plain FSDP "
                "with its reduce-scatter hierarchical; `params=int8` the parameter all-gathers in int8. Uplink: what "
                "left each node per step (gradients and parameters), its veth's counter; the bytes are the result, "
                f"the step times depend on 8 workers sharing 2 cores (compute alone {data['compute_ms']:.0f} ms/step):",
            ""]
    out += table(["scheme", "layout", "ms/step", "speed-up over fsdp", "uplink per node per step",
                  "gradient bytes between nodes", "parameter bytes per worker", "uplink x fsdp", "uplink x hsdp"],
                 rows, right={2, 3, 4, 5, 6, 7, 8})
    out += ["", "The LM task under HSDP (2 nodes x 2 workers, 300 steps; dense, int8, int4, int8 with int8 "
                "parameters):"]
    out += pending(r, "hsdp_lm_300") + rendered(r, "hsdp_lm_300", hsdp_lm_table)
    out += sources(r, fresh + ["fsdp_nodes_2x4_1gbit"] + (["hsdp_lm_300"] if r.has("hsdp_lm_300") else []))
    return out


def nodes_table(r: Results) -> list[str]:
    data = r.get("nodes_2x4_100mbit")
    ddp = uplink(scheme(data, "ddp"))
    rows = []
    for s in data["schemes"]:
        up = uplink(s)
        twin = scheme(data, s["scheme"] + ("," if ":" in s["scheme"] else ":") + "topology=flat")
        inter = s["inter_node_bytes_per_step_by_node"]
        inter_text = size(sum(inter) / len(inter)) + (" (model)" if s["inter_node_bytes_source"] == "model" else "")
        rows.append([code(s["scheme"]), s.get("topology") or "–", size(up), inter_text, f"{up / ddp:.3f}",
                     f"{up / uplink(twin):.3f}" if twin and s.get("topology") == "hierarchical" else "",
                     ms(s["median_step_s"]), times(s["speedup"])])
    out = ["## Nodes: hierarchical against flat", "",
           "2 nodes (network namespaces) x 4 gloo workers, each node's uplink shaped to 100 Mbit/s, the 8.4M MLP "
           "`mlp8m`. Hierarchical (the default on nodes): dense reduce-scatter inside the node, the codec between "
           "nodes on 1/4 of the gradient each, all-gather inside the node; `topology=flat` the exchange over all 8 "
           "ranks. Uplink: each node's veth tx counter per step (headers and gloo's messages included), mean over "
           "the 2 nodes; inter-node bytes: the node's workers' `stats()['inter_node_bytes']` (flat counts every "
           "byte, also to the node's own workers). The bytes are the result: 8 workers on 2 cores make the step "
           f"compute-bound (compute alone {ms(data['compute_s'])} ms/step with all 8 at once, DDP with a hook that "
           f"sends nothing {ms(scheme(data, 'ddp-nosend')['median_step_s'])} ms).", ""]
    out += table(["scheme", "topology", "uplink per node per step", "inter-node bytes per node", "x DDP's uplink",
                  "x its flat twin", "ms/step", "x DDP"], rows, right={2, 3, 4, 5, 6, 7})
    out += sources(r, ["nodes_2x4_100mbit"])
    return out


AUTO_RATES = [("10 Gbit/s", "netbench_mlp_10gbit", "auto_mlp_10gbit", "auto_any_mlp_10gbit"),
              ("1 Gbit/s", "netbench_mlp_1gbit", "auto_mlp_1gbit", "auto_any_mlp_1gbit"),
              ("100 Mbit/s", "netbench_mlp_100mbit", "auto_mlp_100mbit", None)]
FIVE = ["ddp", "torch-fp16", "fp16", "int8", "int4"]


def _auto_files(r: Results, fresh: str, default: str, any_: str | None) -> tuple[str, str | None]:
    if r.has(fresh):
        return fresh, fresh
    return default, (any_ if any_ and r.has(any_) else None)


def autopilot_ratios(r: Results) -> list[tuple[str, float]]:
    out = []
    for label, fresh, default, any_ in AUTO_RATES:
        data = r.get(_auto_files(r, fresh, default, any_)[0])
        best = min((scheme(data, n) for n in FIVE), key=lambda s: s["median_step_s"])
        out.append((label, scheme(data, "auto")["median_step_s"] / best["median_step_s"]))
    return out


def autopilot_tables(r: Results) -> list[str]:
    rows, used = [], []
    for label, fresh, default, any_ in AUTO_RATES:
        name, name_any = _auto_files(r, fresh, default, any_)
        data = r.get(name)
        used.append(name)
        best = min((scheme(data, n) for n in FIVE), key=lambda s: s["median_step_s"])
        auto = scheme(data, "auto")
        row = [label, f"{ms(auto['median_step_s'])} ms", f"{code(best['scheme'])} {ms(best['median_step_s'])} ms",
               f"**{times(auto['median_step_s'] / best['median_step_s'])}**", plan_text(auto["auto"])]
        if name_any:
            any_data = r.get(name_any)
            if name_any not in used:
                used.append(name_any)
            a = scheme(any_data, "auto:budget=any")
            best_all = fastest_fixed(any_data)
            row += [f"{ms(a['median_step_s'])} ms", f"{code(best_all['scheme'])} {ms(best_all['median_step_s'])} ms",
                    f"**{times(a['median_step_s'] / best_all['median_step_s'])}**", plan_text(a["auto"])]
        else:
            row += ["–", "–", "–", "–"]
        rows.append(row)
    out = ["## The autopilot", "",
           "`\"auto\"` measures the link and the compute in the first steps, predicts each candidate codec per DDP "
           "bucket with the cost model, tries the switch and keeps it only if measured faster "
           "([docs/auto.md](docs/auto.md)). Here it measured everything itself (no `bandwidth=` hint), next to "
           "every fixed choice in the same run: the 12.6M MLP on the 4-host testbed as in [Which scheme at my "
           "link](#which-scheme-at-my-link), enough untimed steps that its decision (step 3) and trial (judged at "
           "step 9) come first. The default budget (`safe`) chooses among dense, bf16, int8 and int4 and is "
           "compared with the best of DDP, torch-fp16, fp16, int8 and int4; `budget=any` with the best fixed "
           "scheme of its run (PowerSGD, sign and top-k too).", ""]
    out += table(["link", "`auto`", "best of the five", "auto / best", "auto's plan", "`auto:budget=any`",
                  "best fixed scheme", "any / best", "its plan"], rows, right={1, 2, 3, 5, 6, 7})
    out += pending(r, "netbench_mlp_100mbit")
    out += sources(r, used)
    out += [""] + selection_table(r) + [""] + matrix_tables(r) + [""] + heldout_table(r) + [""] + link_drop(r) + [""] + compute_bound(r) + [""] + auto_nodes(r)
    out += ["", "On the LM task and digits (accuracy, with a bandwidth hint): [What it keeps of accuracy]"
                "(#what-it-keeps-of-accuracy)."]
    return out


SELECTION_RATES = [("10 Gbit/s", "auto_selection_mlp_10gbit"), ("1 Gbit/s", "auto_selection_mlp_1gbit"),
                   ("100 Mbit/s", "auto_selection_mlp_100mbit")]


def selection_table(r: Results) -> list[str]:
    """auto run ten times next to the five fixed schemes (one run per rate): its steady step against the best fixed
    scheme, the spread of its ten steady steps, the plans it kept and how often."""
    rows, used = [], []
    for label, name in SELECTION_RATES:
        if not r.has(name):
            continue
        data = r.get(name)
        used.append(name)
        best = min((scheme(data, n) for n in FIVE), key=lambda s: s["median_step_s"])
        autos = rows_named(data, "auto")
        steps = sorted(a["median_step_s"] for a in autos)
        mid = steps[len(steps) // 2] if len(steps) % 2 else (steps[len(steps) // 2 - 1] + steps[len(steps) // 2]) / 2
        plans: dict = {}
        for a in autos:
            plans[plan_text(a["auto"])] = plans.get(plan_text(a["auto"]), 0) + 1
        kept = "; ".join(f"{p} ({n}/{len(autos)})" for p, n in sorted(plans.items(), key=lambda kv: -kv[1]))
        same = sorted(a["median_step_s"] for a in autos if set((a["auto"] or {}).get("plan") or {}) == {best["scheme"]})
        on_best = (f"{times(same[len(same) // 2] / best['median_step_s'])} ({len(same)} run{'s' * (len(same) > 1)})"
                   if same and
                   best["scheme"] not in ("ddp", "torch-fp16") else "–")
        rows.append([label, f"{code(best['scheme'])} {ms(best['median_step_s'])} ms", f"{ms(mid)} ms",
                     f"{ms(steps[0])}–{ms(steps[-1])} ms", f"{100 * (steps[-1] - steps[0]) / mid:.0f} %",
                     f"**{times(mid / best['median_step_s'])}**", times(steps[-1] / best["median_step_s"]), on_best,
                     kept])
    out = ["### The step decides: stability over ten runs", "",
           "The selection (issue 39: the current plan, the model's, the best uniform plans and dense measured in "
           "palindromic blocks on real steps, the fastest kept): `auto` ten times in one netbench run next to the "
           "five fixed schemes, each 20 untimed steps then the median of 5 (the 12.6M MLP, 4 hosts). The spread "
           "is (slowest − fastest) / median of auto's ten steady steps; \"on the best's plan\": the median of the runs "
           "that kept the best fixed scheme's codec everywhere (the fixed scheme ran once: one sample, this machine's "
           "runs of one configuration vary by 10-15 %); the last column counts the plans kept.", ""]
    if rows:
        out += table(["link", "best fixed", "auto (median of 10)", "auto's range", "spread", "median / best",
                      "slowest / best", "auto on the best's plan / best", "plans kept (runs)"], rows,
                     right={2, 3, 4, 5, 6, 7})
    out += pending(r, *[n for _, n in SELECTION_RATES])
    out += sources(r, used) if used else []
    return out


MATRIX_RATES = ("10gbit", "1gbit", "100mbit", "10mbit")


def _matrix_cell(run: dict) -> tuple[str, float | None, bool | None]:
    """One cell's text (auto / the best fixed scheme, the best's name, auto's plan), the ratio, and whether DDP
    was the best (None where the cell failed)."""
    if "result" not in run:
        return "failed", None, None
    res = run["result"]
    best = min((scheme(res, n) for n in FIVE), key=lambda x: x["median_step_s"])
    auto = scheme(res, "auto")
    ratio = auto["median_step_s"] / best["median_step_s"]
    plan = "+".join(sorted("dense" if c == "none" else c for c in (auto["auto"] or {}).get("plan") or {"none": 1}))
    return f"{times(ratio)} {best['scheme']} / {plan}", ratio, best["scheme"] == "ddp"


def matrix_tables(r: Results) -> list[str]:
    """Issue 39's matrix (``benchmarks/auto_matrix.py``): one table of families and columns by rate, both halves
    (the held-out cells in italics); each cell auto / the best of the five fixed schemes of its run, the best's name
    and auto's plan; a line per half with its counts."""
    names = [n for n in ("auto_matrix_fitted", "auto_matrix_heldout") if r.has(n)]
    out = ["### The matrix: 3 families x 4 rates x 3 columns, and nodes", "",
           "`python benchmarks/auto_matrix.py`: the MLP (`mlp:512`, 1.3M parameters), the CNN (`conv:32`, 0.39M) and "
           "the transformer LM (`transformer:128`, 0.47M) at 4 rates, with batch 16, batch 64 and batch 16 on the "
           "emulated accelerator (the compute a timed wait, the CPU idle), 4 hosts; and 2 nodes of 4 workers. Each "
           "cell is one netbench run: auto (20 untimed steps, then the median of 5) against the best of DDP, "
           "torch-fp16, fp16, int8 and int4 (4 untimed steps, then the median of 5) in the same run, in that order; "
           "a cell reads *auto / best, the best fixed scheme / auto's plan*. The cells are split like a checkerboard: "
           "the fitted half was run first, the held-out half (*in italics*) after it with every constant unchanged. "
           "One sample per scheme: this machine's runs of one configuration vary by 10–15 %.", ""]
    rows: dict = {}
    order = [f"`{m}`, {c}" for m in ("mlp:512", "conv:32", "transformer:128")
             for c in ("batch 16", "batch 64", "batch 16, accelerator", "nodes 2 x 4, batch 16")]
    for name in names:
        data, held = r.get(name), name.endswith("heldout")
        ratios, ddp_best = [], []
        for run in data["cells"]:
            c = run["cell"]
            text, ratio, on_ddp = _matrix_cell(run)
            label = f"`{c['model']}`, {c['column']}"
            rows.setdefault(label, ["·"] * len(MATRIX_RATES))[MATRIX_RATES.index(c["rate"])] = \
                f"*{text}*" if held else text
            if ratio is not None:
                ratios.append(ratio)
                if on_ddp:
                    ddp_best.append(ratio)
        out += [f"- **{'Held out' if held else 'Fitted'}** ({len(data['cells'])} cells): auto ≤ 1.05x the best fixed "
                f"scheme in {sum(x <= 1.05 for x in ratios)} of {len(ratios)}, ≤ 1.10x in "
                f"{sum(x <= 1.10 for x in ratios)}; where DDP was best, ≤ 1.03x DDP in "
                f"{sum(x <= 1.03 for x in ddp_best)} of {len(ddp_best)}; median "
                f"{times(statistics.median(ratios)) if ratios else '–'}, worst {times(max(ratios)) if ratios else '–'}."]
    if rows:
        out += [""] + table(["cell"] + [rate(float(x[:-4]) * (1e9 if x.endswith("gbit") else 1e6))
                                        for x in MATRIX_RATES],
                            [[label] + rows[label] for label in sorted(rows, key=order.index)], right=set())
    out += recheck_line(r)
    out += pending(r, "auto_matrix_fitted", "auto_matrix_heldout", "auto_matrix_recheck")
    names += ["auto_matrix_recheck"] if r.has("auto_matrix_recheck") else []
    out += sources(r, names) if names else []
    return out


def recheck_line(r: Results) -> list[str]:
    """The DDP-best cells re-measured with the drift cancelled (DDP, auto, auto, DDP in one run)."""
    if not r.has("auto_matrix_recheck"):
        return []
    parts, ratios = [], []
    for run in r.get("auto_matrix_recheck")["cells"]:
        c = run["cell"]
        label = f"`{c['model']}` {c['column']} at {c['rate']}"
        if "result" not in run:
            parts.append(f"{label} failed")
            continue
        mean = {n: statistics.fmean(x["median_step_s"] for x in rows_named(run["result"], n)) for n in ("ddp", "auto")}
        ratios.append(mean["auto"] / mean["ddp"])
        parts.append(f"{label} {times(ratios[-1])}")
    return ["", f"**Where DDP was the fastest fixed scheme**, re-measured with the drift cancelled (DDP, auto, auto, DDP "
            f"in one run; the mean of each's two medians): auto ≤ 1.03x DDP in {sum(x <= 1.03 for x in ratios)} of "
            f"{len(ratios)}, ≤ 1.05x in {sum(x <= 1.05 for x in ratios)}: " + "; ".join(parts) + "."]


def heldout_table(r: Results) -> list[str]:
    """auto on the cases ``../shared/tools/heldout.py`` drew (``benchmarks/auto_heldout.py``): per case, auto against
    the best fixed scheme of its run, in one paragraph."""
    name = "auto_heldout"
    out = ["### Held out: cases nobody chose", ""]
    if not r.has(name):
        return out + pending(r, name)
    data = r.get(name)
    parts, within = [], 0
    for run in data["runs"]:
        c = run["case"]
        label = (f"{c['family']}:{c['width']} batch {c['batch']}, {c['workers']} workers, {c['rate']}"
                 f"{', accelerator' if c['accelerator'] else ''}")
        if "result" not in run:
            parts.append(f"{label}: failed")
            continue
        res = run["result"]
        best = min((scheme(res, n) for n in FIVE), key=lambda x: x["median_step_s"])
        auto = scheme(res, "auto")
        ratio = auto["median_step_s"] / best["median_step_s"]
        within += ratio <= 1.05
        parts.append(f"{label}: {times(ratio)} ({best['scheme']} best; auto {plan_text(auto['auto'])})")
    out += [f"Cases drawn by `../shared/tools/heldout.py` from the commit hash `{data['seed'][:12]}` (model family "
            "and size, batch, workers, link, an emulated accelerator; their latencies dropped: no netem here), run "
            "unchanged: `auto` against the best of DDP, torch-fp16, fp16, int8 and int4 in the same netbench run, 20 "
            f"untimed steps then the median of 5. Within 1.05x in {within} of {len(data['runs'])}: "
            + "; ".join(parts) + "."]
    out += sources(r, [name])
    return out


def link_drop(r: Results) -> list[str]:
    name = "auto_cnn_link_drop"
    data = r.get(name)
    change = re.search(r"--change (\d+):(\S+)", data["command"])
    drop = int(change.group(1))
    windows = [(i, min(i + 10, data["steps"])) for i in range(0, data["steps"], 10)]
    rows = []
    for s in data["schemes"]:
        means = " / ".join(ms(sum(s["step_s"][a:b]) / (b - a)) for a, b in windows)
        rows.append(f"{code(s['scheme'])} {means} ms")
    auto = scheme(data, "auto")
    dense = scheme(data, "ddp")["wire_bytes_per_step"]
    wire = auto["step_wire_bytes"]
    before = "dense" if wire[drop - 1] >= 0.5 * dense else "compressing"
    switched = next((i for i in range(drop, len(wire)) if wire[i] < 0.5 * dense), None)
    late = [(statistics.median(x["step_s"][drop + 20:]), x["scheme"])
            for x in data["schemes"] if len(x["step_s"]) > drop + 20]
    best = min((t, n) for t, n in late if n != "auto")
    after = next(t for t, n in late if n == "auto")
    how = ("was compressing already when it dropped" if before == "compressing" else
           f"was dense at the fast rate; its first compressed step after the drop was timed step {switched} (within "
           f"{switched - drop + 1} steps)" if switched is not None else "was dense at the fast rate and stayed dense")
    out = ["### When the link drops mid-run", "",
           f"The compute-bound CNN (0.39M parameters), 4 hosts at {rate(data['bandwidth_bit'])}; before timed step "
           f"{drop} every uplink is reshaped to {change.group(2)} with `tc` (`--change`). Mean step time per 10 "
           f"timed steps ({', '.join(f'{a}–{b - 1}' for a, b in windows)}): {'; '.join(rows)}. `auto` {how}; from "
           f"20 steps after the drop its median step is {times(after / best[0])} the best fixed scheme's "
           f"({code(best[1])}); it probed {size(auto['auto']['probe_bytes'])} in all.", ""]
    out += sources(r, [name])
    return out


def compute_bound(r: Results) -> list[str]:
    """What auto adds to a decided step (``auto_overhead``), and the older compute-bound CNN check in one line."""
    names = ["auto_cnn_10gbit_overhead", "auto_cnn_10gbit_overhead_passive"]
    ratios = []
    for name in names:
        data = r.get(name)
        avg = {label: statistics.fmean(sum(s["step_s"]) / len(s["step_s"]) for s in rows_named(data, label))
               for label in ("ddp", "none", "auto")}
        ratios.append(f"{times(avg['auto'] / avg['ddp'])} DDP, {times(avg['auto'] / avg['none'])} our dense hook")
    out = ["### What auto adds to a step", ""]
    if r.has("auto_overhead"):
        data = r.get("auto_overhead")
        fixed, auto = (data["schemes"][s] for s in ("int4:warmup_steps=3", "auto:bandwidth=10mbit,cache=off"))
        out += [f"A decided `auto` step (a slow-link hint: int4 on every bucket from step 3, nothing left to decide; "
                f"its checks every 20 steps included) against the same plan as a fixed scheme, `int4:warmup_steps=3`: "
                f"{data['workers']} loopback workers, the 12.6M MLP, {data['rounds']} interleaved rounds: "
                f"{' / '.join(ms(x) for x in auto['median_step_s'])} ms against "
                f"{' / '.join(ms(x) for x in fixed['median_step_s'])} ms, **{times(data['auto_over_fixed'])}**; "
                f"Python calls in 20 steps {auto['calls_20_steps']} against {fixed['calls_20_steps']} (the profiles "
                "are in the result file). Before this session's selection, the compute-bound CNN at 10 Gbit/s "
                f"(DDP fastest; 3 interleaved rounds): auto {ratios[0]}; with passive probing {ratios[1]} (not "
                "re-measured since).", ""]
        names = ["auto_overhead"] + names
    else:
        out += pending(r, "auto_overhead")
    if r.has("dense_hook_testbed_mlp512_10gbit"):
        data = r.get("dense_hook_testbed_mlp512_10gbit")
        mean = {n: statistics.fmean(x["median_step_s"] for x in rows_named(data, n))
                for n in ("ddp", "none", "auto:bandwidth=100gbit", "auto")}
        out += [f"Where DDP is fastest, what our hook's dense path costs (`mlp:512`, batch 16, 4 hosts at 10 Gbit/s; "
                "DDP, `none`, `auto:bandwidth=100gbit`, `auto`, `auto`, the hint, `none`, DDP in one run, the mean "
                f"of each's two medians): DDP {ms(mean['ddp'])} ms, our dense hook {ms(mean['none'])} ms "
                f"({times(mean['none'] / mean['ddp'])}), auto with a fast-link hint {ms(mean['auto:bandwidth=100gbit'])}"
                f" ms ({times(mean['auto:bandwidth=100gbit'] / mean['ddp'])}), auto measuring "
                f"{ms(mean['auto'])} ms ({times(mean['auto'] / mean['ddp'])}, dense kept): the gap to DDP where it "
                "is fastest is our hook's own path, not the autopilot (not broken down further: one run, two samples "
                "of each).", ""]
        names = names + ["dense_hook_testbed_mlp512_10gbit"]
    out += sources(r, names)
    return out


def auto_nodes(r: Results) -> list[str]:
    name = "auto_nodes_2x4_100mbit"
    data = r.get(name)
    auto = scheme(data, "auto")
    fixed = min((s for s in data["schemes"] if s["kind"] == "ours"), key=lambda s: s["median_step_s"])
    layouts = auto["auto"].get("layout_step_s") or {}
    measured = ", ".join(f"{k} {ms(v)} ms" for k, v in sorted(layouts.items()))
    others = "; ".join(f"{code(s['scheme'])} {ms(s['median_step_s'])} ms ({s.get('topology') or '–'}, uplink "
                       f"{size(uplink(s))})" for s in data["schemes"] if s is not auto)
    out = ["### On nodes", "",
           "2 nodes x 4 workers at 100 Mbit/s (the 8.4M MLP): `auto` chooses the codecs with the flat cost model, "
           f"then measures flat against hierarchical for 6 steps each and keeps the faster ({measured}: "
           f"{auto['auto']['layout']} kept): {ms(auto['median_step_s'])} ms per step, uplink {size(uplink(auto))} "
           f"per node, against the best fixed choice ({code(fixed['scheme'])}): "
           f"**{times(auto['median_step_s'] / fixed['median_step_s'])}**. The others: {others}.", ""]
    out += sources(r, [name])
    return out


def faults_section(r: Results) -> list[str]:
    out = ["## Faults under torchft", "",
           "Under torchft (`pip install -e '.[torchft]'`, [docs/torchft.md](docs/torchft.md)): what the quorum and "
           "commit cost per step against plain DDP and torchft's own DDP (4 hosts at 1 Gbit/s and on loopback, the "
           "12.6M MLP), the stall from a replica's SIGKILL to the survivors' first commit of a step after the last "
           "one the killed replica committed (3 replicas, a kill between steps or inside the exchange), and the "
           "demo's kill-and-restart scenario (digits, 3 replicas, 120 steps).", ""]
    for name, where in (("ftbench_1gbit", "4 hosts at 1 Gbit/s"), ("ftbench_loopback", "4 processes on loopback")):
        if r.has(name):
            out += _ftbench(r.get(name), where)
    if r.has("torchft_stall"):
        out += _stalls(r.get("torchft_stall"))
    if r.has("demo_faults"):
        out += _demo_faults(r.get("demo_faults"))
    if r.has("torchft_faults"):
        out += _fault_kinds(r.get("torchft_faults"))
    names = [n for n in ("ftbench_1gbit", "ftbench_loopback", "torchft_stall", "demo_faults", "torchft_faults")
             if r.has(n)]
    while out[-1] == "":
        out.pop()
    out += pending(r, "ftbench_1gbit", "ftbench_loopback", "torchft_stall", "demo_faults", "torchft_faults")
    if names:
        out += sources(r, names)
    return out


def _fault_kinds(data: dict) -> list[str]:
    """The stall of each kind of fault, per scheme: kills, a hang, a cut link."""
    rows = [[code(c["scheme"]), c["fault"], ", ".join(f"{x:.2f}" for x in c["stall_seconds"]),
             "yes" if c["replicas_ok"] else "**no**"] for c in data["cases"]]
    return [f"Each kind of fault ({data['replicas']} replicas, the group's timeout {data['pg_timeout_s']:g} s, the "
            f"lighthouse's heartbeat timeout {data['heartbeat_timeout_s']:g} s, {data['repeats']} faults in a row "
            "per row; the stall from the fault to the survivors' first commit of a step after the faulty replica's "
            "last):", ""] + table(["scheme", "fault", "stalls (s)", "survivors equal, nothing failed committed"],
                                   rows, right={2}) + [""]


def _ftbench(data: dict, where: str) -> list[str]:
    """Per-step cost of fault tolerance: each mode's mean step and bytes; ``ft+X`` against ``ddp+X`` (the same
    scheme without torchft) and ``torchft`` against ``ddp``."""
    modes = {m["mode"]: m for m in data["modes"]}
    plain = {"ft+none": "ddp", "torchft": "ddp", "ft+int8": "ddp+int8", "ft+powersgd:rank=4": "ddp+powersgd:rank=4"}
    rows = []
    for m in data["modes"]:
        other = modes.get(plain.get(m["mode"], ""))
        against = f"{m['step_s'] / other['step_s']:.2f}x `{other['mode']}`" if other else "–"
        rows.append([code(m["mode"]), ms(m["step_s"]), times(modes["ddp"]["step_s"] / m["step_s"]) if "ddp" in modes
                     else "–", against, size(m["tx_bytes_per_step_per_host"])])
    return ([f"What it costs per step, {where} ({data['model']}, mean of {data['steps']} steps after "
             f"{data['warmup']}; `x faster than ddp`: DDP's step over the mode's):", ""]
            + table(["mode", "ms/step", "x faster than ddp", "against the same scheme without torchft",
                     "sent per host per step"], rows, right={1, 2, 3, 4}) + [""])


def _stalls(data: dict) -> list[str]:
    parts = []
    for c in data["cases"]:
        stalls = ", ".join(f"{x:.2f}" for x in c["stall_seconds"] if x is not None) or "–"
        parts.append(f"{code(c['scheme'])} killed {c['kill']}: {stalls} s, survivor steps not committed "
                     f"{', '.join(str(x) for x in c['uncommitted_survivor_steps'])}")
    return [f"The stall after a kill ({data['replicas']} replicas, killed at step {data['kill_at']}, "
            f"{data['repeats']} runs each; seconds from the kill to the survivors' first commit of a later step): "
            + "; ".join(parts) + ".", ""]


def _demo_faults(data: dict) -> list[str]:
    sc = data["scenario"]
    rows = [[code(x["spec"]), "killed at %d, restarted at %d" % (sc["kill_at"], sc["restart_at"]) if x["faults"]
             else "none", f"{x['loss']:.4f}", f"{100 * x['accuracy']:.1f} %", "yes" if x["equal"] else "no",
             f"{x['stall_seconds']:.2f}" if x.get("stall_seconds") is not None else "–"] for x in data["runs"]]
    return ([f"`gradcompress demo --faults` ({sc['replicas']} replicas, {sc['steps']} steps; loss and accuracy of "
             "replica 0 on the whole data at the end):", ""]
            + table(["scheme", "fault", "loss", "accuracy", "replicas equal", "stall (s)"], rows, right={2, 3, 5})
            + [""])


BELOW_ONE_BIT = [
    ("lm_decoupled_vs_none_300", "none", "DDP at the task's default lr (3e-3)"),
    ("lm_decoupled_vs_none_300", "decoupled", "DeMo, the paper's defaults"),
    ("lm_decoupled_lr_sweep_300", "decoupled:lr=0.001", "DeMo, lr x0.3"),
    ("lm_decoupled_lr_sweep_300", "decoupled:lr=0.01", "DeMo, lr x3"),
    ("lm_onebitadam_local_steps_300", "onebitadam:warmup_steps=5,sync_every=2", "1-bit Adam, local steps"),
    ("lm_onebitadam_local_steps_300", "onebitadam:warmup_steps=5,sync_every=4", "1-bit Adam, local steps"),
    ("lm_onebitadam_local_steps_300", "onebitadam:warmup_steps=8,sync_every=8", "1-bit Adam, local steps"),
    ("lm_sparseloco_900", "none:diloco=50", "DiLoCo, dense outer gradients"),
    ("lm_streaming_diloco_900", "int4:diloco=50", "DiLoCo, int4"),
    ("lm_streaming_diloco_900", "int4:diloco=50,fragments=4,delay=5", "streaming DiLoCo, int4"),
    ("lm_sparseloco_900", "none:diloco=50,outer=sparseloco", "SparseLoCo, outer lr 1"),
    ("lm_streaming_diloco_900", "none:diloco=50,outer=sparseloco", "SparseLoCo, outer lr 1 (again)"),
    ("lm_streaming_diloco_900", "none:diloco=50,outer=sparseloco,fragments=4,delay=5", "streaming SparseLoCo"),
    ("lm_sparseloco_outer_lr_sweep_900", "none:diloco=50,outer=sparseloco,outer_lr=2", "SparseLoCo, outer lr 2"),
    ("lm_sparseloco_outer_lr_sweep_900", "none:diloco=50,outer=sparseloco,outer_lr=4", "SparseLoCo, outer lr 4"),
]


def diloco_tables(r: Results) -> list[str]:
    tuned = tuned_ddp(r)
    base = ddp_at(r, 0.003)
    total = tuned["cumulative_bytes"][-1]
    rows = []
    for name, scheme_name, what in BELOW_ONE_BIT:
        x = run(r.get(name), scheme_name)
        rows.append([what, code(scheme_name), str(x["steps"]), f"{x['val_loss']:.4f}",
                     pct(x["val_loss"], base["val_loss"]), pct(x["val_loss"], tuned["val_loss"]),
                     size(x["bytes_per_step"]), fewer(total / x["cumulative_bytes"][-1])])
    out = ["## DiLoCo, streaming DiLoCo, SparseLoCo, DeMo", "",
           "Below one bit per coordinate, on the LM task of [What it keeps of accuracy](#what-it-keeps-of-accuracy) "
           "(AdamW inside DiLoCo at lr 3e-3; DeMo and 1-bit Adam are optimizers of their own). Per-step schemes run "
           "DDP's 300 steps, the DiLoCo family 900 (3x: the question is whether they reach DDP's 300-step loss); "
           f"`fewer bytes` compares what the whole run sent with what the tuned DDP sent in 300 steps "
           f"({size(total)}). Validation loss of rank 0's model at the last step (a streamed model holds up to a few "
           "steps of each fragment's local progress blended in). One seed; one learning-rate sweep per method.", ""]
    out += table(["method", "scheme", "steps", "val loss", f"vs DDP lr 3e-3 ({base['val_loss']:.4f})",
                  f"vs the tuned DDP ({tuned['val_loss']:.4f})", "bytes/step", "fewer bytes in all"], rows,
                 right={2, 3, 4, 5, 6, 7})
    out += ["", "DiLoCo with H = 25 and with sparse outer gradients (top-k 3 % + int8 values), the table of "
                "[docs/algorithms.md](docs/algorithms.md#diloco):"]
    out += pending(r, "lm_diloco_900") + rendered(r, "lm_diloco_900", lm_diloco_table)
    out += sources(r, sorted({name for name, _, _ in BELOW_ONE_BIT} | {"lm_ddp_lr_sweep_300"} |
                             ({"lm_diloco_900"} if r.has("lm_diloco_900") else set())))
    out += ["", "### Step time on the testbed", "",
            "Blocking against streaming DiLoCo (`fragments=4`: a quarter of the model per sync, applied `delay` "
            "steps later, overlapped with the inner steps) and DDP with per-step int8 and int4, on the 4-host "
            "testbed at 10 Mbit/s, 100 Mbit/s and 1 Gbit/s (the LM model) and the 12.6M MLP at 10 and 100 Mbit/s; "
            "DiLoCo's step is the mean over whole intervals of H = 50 after an untimed one. With the LM runs above, "
            "these give the wall time to the tuned DDP's 300-step loss."]
    testbed = ("diloco_lm_10mbit", "diloco_lm_100mbit", "diloco_lm_1gbit", "diloco_mlp_10mbit", "diloco_mlp_100mbit")
    fresh = [n for n in testbed if r.has(n)]
    for model in ("lm", "mlp"):
        runs = [r.get(n) for n in fresh if r.get(n)["model"] == model]
        if runs:
            out += [""] + rates_table(runs)
    out += time_to_loss(r)
    out += pending(r, *testbed)
    if fresh:
        out += sources(r, fresh)
    return out


def rates_table(runs: list[dict]) -> list[str]:
    """netbench runs of one model at several link rates, side by side: each scheme's step time (x DDP in that run,
    where it ran) and the training thread's wait per step at each rate, and its bytes per host per step."""
    names: list[str] = []
    for data in runs:
        names += [s["scheme"] for s in data["schemes"] if s["scheme"] not in names]
    rows = []
    for name in names:
        cells, sent = [code(name)], "–"
        for data in runs:
            s = scheme(data, name)
            if s is None:
                cells.append("–")
                continue
            wait = "" if s.get("wait_s_per_step") is None else f", wait {ms(s['wait_s_per_step'])}"
            speed = "" if s.get("speedup") is None else f", {times(s['speedup'])}"
            cells.append(f"{ms(s['median_step_s'])} ms{speed}{wait}")
            sent = size(s.get("wire_bytes_per_step"))
        rows.append(cells + [sent])
    alone = " / ".join(ms(d["compute_s"]) for d in runs)
    return ([f"{runs[0]['model']} (compute alone {alone} ms/step; ms/step, x ddp, the wait for the link in ms/step):",
             ""] + table(["scheme"] + [f"at {rate(d['bandwidth_bit'])}" for d in runs] + ["sent per host per step"],
                         rows))


def lm_diloco_table(data: dict) -> list[str]:
    rows = [[code(x["scheme"]), str(x["steps"]), f"{x['val_loss']:.4f}", size(x["bytes_per_step"])]
            for x in data["runs"]]
    return [""] + table(["scheme", "steps", "val loss", "bytes/step"], rows, right={1, 2, 3})


RECIPE_RUNS = ("lm_recipe_900", "lm_recipe_seed1_900")


def first_below(x: dict, target: float) -> str:
    """The first evaluated step whose validation loss is at or below ``target`` ("–": none)."""
    step = next((s for s, loss in x.get("eval_history") or [] if loss <= target), None)
    return "–" if step is None else str(step)


def recipe_section(r: Results) -> list[str]:
    tuned = tuned_ddp(r)
    out = ["## Below 1/1000 of DDP's bytes", "",
           f"The LM task again, 4 workers, against the lr-tuned DDP's 300-step validation loss "
           f"({tuned['val_loss']:.4f}, lr {tuned['lr']:g}, {size(tuned['bytes_per_step'])} per step): every "
           "DiLoCo-family configuration tried for a recipe at 1000x fewer bytes per step or more, 900 steps each "
           "(3x DDP's), the inner optimizer at the task's lr 3e-3 (AdamW, or `inner=muon`: "
           "`gradcompress.optim.muon`, Muon on the hidden weights, AdamW on the rest, one lr). The validation loss "
           "every 50 steps is rank 0's model (between syncs, its own); `reaches the target at step` is the first of those steps at "
           "or below the target. Every configuration run is here, met or not."]
    rows = []
    for name in [n for n in RECIPE_RUNS if r.has(n)]:
        data = r.get(name)
        rows += [[code(x["scheme"]), f"seed {data['task']['seed']}", f"{x['val_loss']:.4f}",
                  pct(x["val_loss"], tuned["val_loss"]), size(x["bytes_per_step"]),
                  fewer(tuned["bytes_per_step"] / x["bytes_per_step"]), first_below(x, tuned["val_loss"]),
                  "yes" if x["val_loss"] <= tuned["val_loss"] and
                  tuned["bytes_per_step"] / x["bytes_per_step"] >= 1000 else "no"]
                 for x in data["runs"]]
    if rows:
        out += [""] + table(
            ["scheme", "seed", "val loss at 900", "vs the tuned DDP", "bytes/step", "fewer bytes per step than DDP",
             "reaches the target at step", ">= 1000x and at the target"], rows, right={2, 3, 4, 5, 6})
    out += pending(r, *RECIPE_RUNS)
    out += size_table(r, tuned)
    if r.has("time_to_loss"):
        out += time_to_loss_table(r.get("time_to_loss"))
    out += pending(r, "time_to_loss")
    present = [n for n in RECIPE_RUNS + SIZE_RUNS + ("time_to_loss",) if r.has(n)]
    return out + (sources(r, present) if present else [])


SIZE_RUNS = ("lm_large_ddp_lr_sweep_300", "lm_large_recipe_900")


def loss_at(x: dict, step: int) -> float | None:
    """The validation loss a run's ``eval_history`` holds for ``step`` (None: not evaluated there)."""
    return next((loss for s, loss in x.get("eval_history") or [] if s == step), None)


def size_table(r: Results, tuned_small: dict) -> list[str]:
    """The recipe and blocking DiLoCo with AdamW inside against the lr-tuned DDP, at both model sizes: bytes, and
    the loss at DDP's 300 steps and at 900."""
    if not all(r.has(n) for n in SIZE_RUNS):
        return pending(r, *SIZE_RUNS)
    large = r.get("lm_large_ddp_lr_sweep_300")
    sizes = [("small, 0.47M", tuned_small, r.get("lm_recipe_900")),
             (f"large, {large['task']['model'].rsplit('(', 1)[1].split()[0]}",
              min(large["runs"], key=lambda x: x["val_loss"]), r.get("lm_large_recipe_900"))]
    rows = []
    for label, ddp, data in sizes:
        cells = [label, f"{ddp['val_loss']:.4f} (lr {ddp['lr']:g})"]
        for name in SIZE_SCHEMES.split(";"):
            x = run(data, name)
            cells += [f"{pct(loss_at(x, 300), ddp['val_loss'])} / {pct(x['val_loss'], ddp['val_loss'])}",
                      fewer(ddp["bytes_per_step"] / x["bytes_per_step"])]
        rows.append(cells)
    lrs = ", ".join(f"{x['lr']:g}: {x['val_loss']:.4f}" for x in large["runs"])
    recipe, plain = (code(n) for n in SIZE_SCHEMES.split(";"))
    return ["", "### A second model size", "",
            f"The recipe and blocking DiLoCo with AdamW inside on the LM task's `--lm-size large` model "
            f"({large['task']['model']}) and the small one, each against the lr-tuned DDP of its size (its 300-step "
            f"validation loss; the large DDP's lr sweep, 300 steps: {lrs}): the validation loss at step 300 of 900 "
            "(DDP's steps) / at 900, and how many fewer bytes per step than that DDP.", ""] + table(
        ["model", "DDP, 300 steps", f"{recipe}", "fewer bytes", f"{plain}", "fewer bytes "], rows,
        right={2, 3, 4, 5})


def time_to_loss_table(data: dict) -> list[str]:
    links = list(data["methods"][0]["links"])
    rows = []
    for m in data["methods"]:
        cells = [m["method"], code(m["scheme"]), str(m["steps"]), f"{m['val_loss']:.4f}", size(m["bytes_per_step"])]
        for link in links:
            v = m["links"][link]
            cells.append(f"{v['seconds_to_target'] / 60:.1f} min" if v["seconds_to_target"] is not None else
                         f"not reached ({v['seconds_run'] / 60:.1f} min run)")
        rows.append(cells)
    out = ["", "### Time to the tuned DDP's loss", "",
           f"Wall time to the target ({data['target']:.4f}: {data['target_from']}) on the 4-host testbed: the "
           f"first step whose validation loss (every {data['eval_every']} steps, one run on loopback) is at or "
           "below it, times the method's mean step time at that link (netbench, the LM model; DiLoCo's syncs "
           "included). `python benchmarks/time_to_loss.py` runs both and draws the plot:", ""]
    out += table(["method", "scheme", "steps run", "val loss at the end", "bytes/step",
                  *[f"to the target at {link}" for link in links]], rows, right=set(range(2, 5 + len(links))))
    if data.get("plot"):
        out += ["", f"![validation loss against wall time]({data['plot']})"]
    return out


def time_to_loss(r: Results) -> list[str]:
    """Wall time to the tuned DDP's 300-step loss: DDP's 300 steps against DiLoCo's 900 (an upper bound on the steps
    it needs), from the testbed's step times; only where a DiLoCo run's loss at 900 steps is below the tuned DDP's."""
    tuned = tuned_ddp(r)
    lm = r.get("lm_streaming_diloco_900")
    rows = []
    for name in ("diloco_lm_10mbit", "diloco_lm_100mbit"):
        if not r.has(name):
            continue
        data = r.get(name)
        ddp = scheme(data, "ddp")
        ddp_s = ddp["median_step_s"]
        cells = [rate(data["bandwidth_bit"]), f"300 x {ddp_s:.3f} s = {300 * ddp_s:.0f} s"]
        for scheme_name in ("int4:diloco=50", "int4:diloco=50,fragments=4,delay=5"):
            s, x = scheme(data, scheme_name), run(lm, scheme_name)
            if s is None or x["val_loss"] >= tuned["val_loss"]:
                cells.append("–")
                continue
            wall = x["steps"] * s["median_step_s"]
            cells.append(f"{x['steps']} x {s['median_step_s']:.4f} s = {wall:.0f} s "
                         f"(speed-up {times(300 * ddp_s / wall)})")
        rows.append(cells)
    if not rows:
        return []
    return ["", "Wall time to the tuned DDP's 300-step loss (900 steps: an upper bound on what a DiLoCo run needs; "
                "only where its loss at 900 steps is below the tuned DDP's):", ""] + \
        table(["link", "the tuned DDP, 300 steps", "`int4:diloco=50`", "streamed, F=4"], rows)


def plan_section(r: Results) -> list[str]:
    name = r.first("netbench_mlp_1gbit", "auto_any_mlp_1gbit")
    data = r.get(name)
    per_message_us = data["allreduce_small_s"] / (2 * (data["workers"] - 1)) * 1e6
    command = (f"{RECORD} plan_mlp_1gbit -- python -m gradcompress plan --model mlp --workers 4 --bandwidth 1gbit "
               f"--compute-ms {1000 * data['ddp_floor_s']:.1f} --cores 2 --contention {data['contention']:.2f} "
               f"--per-message-us {per_message_us:.0f} --host-limit {data['allreduce_payload_bandwidth'] * 8:.0f}bit "
               "--json")
    PENDING["plan_mlp_1gbit"] = (command, 1, None)
    out = ["## Does `plan` predict the step", "",
           "`gradcompress plan` predicts each scheme's step time from an alpha-beta model of its collectives, DDP's "
           "buckets and overlap with the backward pass, and codec costs calibrated on this machine "
           "([docs/when-it-pays.md](docs/when-it-pays.md)). Compared with a netbench run, given that run's "
           f"measured floor, contention, per-message cost and host payload rate (here `{name}.json`'s):"]
    out += pending(r, "plan_mlp_1gbit")
    if r.has("plan_mlp_1gbit"):
        out += plan_table(r.get("plan_mlp_1gbit"), data) + sources(r, ["plan_mlp_1gbit"])
    return out


def plan_table(plan: dict, measured: dict) -> list[str]:
    rows = []
    for p in plan["predictions"]:
        m = scheme(measured, p["scheme"])
        if m is None:
            continue
        rows.append([code(p["scheme"]), ms(p["step_s"]), ms(m["median_step_s"]),
                     times(p["step_s"] / m["median_step_s"]), times(p["speedup"]), times(m["speedup"])])
    return [""] + table(["scheme", "predicted ms/step", "measured ms/step", "predicted / measured",
                         "predicted x DDP", "measured x DDP"], rows, right={1, 2, 3, 4, 5})


def method_section(r: Results) -> list[str]:
    unread = [n for n in r.names if n not in r.read]
    out = ["## How these tables are made", "",
           "`python benchmarks/document.py` writes this page from `benchmarks/results/*.json`; `--check` fails when "
           "the page is not what it would write (`tests/test_benchmarks_doc.py` runs it). Every result file "
           "records the `command` that produced it, the `commit` measured and the `machine`; "
           "`python benchmarks/record.py NAME -- COMMAND` runs a command and writes its result that way. Files "
           "marked † were measured before this page was generated: their command was added afterwards from the "
           "git history and the old BENCHMARKS.md, and their commit is the last one that changed the file (the "
           "code measured was that commit's or one shortly before it); their `provenance` says so. Unless a file says otherwise, the machine "
           f"was {MAIN_MACHINE}. The step times come from a shared 2-core machine: compare ratios within one run, not milliseconds across runs. "
           "Every earlier table, with the re-runs "
           f"and the issues' targets, is in the [measurement log]({HISTORY}); "
           "`benchmarks/MISSING.md` says which results are still missing and how to record one."]
    if unread:
        out += ["", "Result files no table reads yet: " + ", ".join(f"`{n}.json`" for n in unread) + "."]
    return out


SECTIONS = [link_table, growth_table, cost_table, accuracy_tables, fsdp_tables, nodes_table, autopilot_tables,
            faults_section, diloco_tables, recipe_section, plan_section]


def render(folder: str = RESULTS) -> str:
    r = Results(folder)
    body: list[str] = []
    for section in SECTIONS:
        body += [""] + section(r)
    head = ["# Benchmarks", "",
            "What gradcompress measured, one current table per question. Generated by `benchmarks/document.py` from "
            "`benchmarks/results/*.json`: edit that script or the result files, not this page.", ""]
    text = head + summary(r) + body + [""] + method_section(r)
    return "\n".join(text) + "\n"


# --------------------------------------------------------------------------- the command line
def differences(expected: str, found: str, path: str) -> str:
    """A short description of what differs: the sections, the first lines of a diff."""
    exp, got = expected.splitlines(), found.splitlines()
    sections, heading = [], "(top)"
    matcher = difflib.SequenceMatcher(a=exp, b=got, autojunk=False)
    for tag, i1, i2, _, _ in matcher.get_opcodes():
        if tag == "equal":
            continue
        for line in reversed(exp[:max(i1, 1)]):
            if line.startswith("#"):
                heading = line.lstrip("# ")
                break
        if heading not in sections:
            sections.append(heading)
    diff = list(difflib.unified_diff(got, exp, fromfile=path, tofile="what document.py writes", lineterm="", n=1))
    shown = "\n".join(diff[:40]) + ("\n..." if len(diff) > 40 else "")
    return (f"{path} is not what benchmarks/document.py writes; sections that differ: {'; '.join(sections)}\n"
            f"{shown}\nrun: python benchmarks/document.py" + ("" if path == os.path.relpath(OUTPUT, ROOT)
                                                              else f" --output {path}"))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python benchmarks/document.py", description=__doc__.splitlines()[0])
    p.add_argument("--check", action="store_true", help="exit 1 if the output file is not what this would write")
    p.add_argument("--output", default=OUTPUT, help="the page to write or check (default BENCHMARKS.md)")
    p.add_argument("--results", default=RESULTS, help="the folder of result files (default benchmarks/results)")
    p.add_argument("--pending", action="store_true", help="print the results no file holds yet and their commands")
    args = p.parse_args(argv)
    text = render(args.results)
    if args.pending:
        names = Results(args.results).names
        for name, (command, minutes, needs) in sorted(PENDING.items()):
            if name not in names:
                print(f"{name}\t~{minutes} min\t{command}" + (f"\t(first: {needs})" if needs else ""))
        return 0
    shown = os.path.relpath(args.output, ROOT) if os.path.abspath(args.output).startswith(ROOT) else args.output
    if args.check:
        try:
            with open(args.output, encoding="utf-8") as f:
                found = f.read()
        except FileNotFoundError:
            print(f"{shown} does not exist; run: python benchmarks/document.py", file=sys.stderr)
            return 1
        if found != text:
            print(differences(text, found, shown), file=sys.stderr)
            return 1
        print(f"{shown} is what benchmarks/document.py writes ({len(text.splitlines())} lines)")
        return 0
    with open(args.output, "w", encoding="utf-8") as f:
        f.write(text)
    print(f"wrote {shown} ({len(text.splitlines())} lines)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
