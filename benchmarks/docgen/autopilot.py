"""The autopilot: against the best fixed scheme per link, its stability, issue 39's matrix, held-out cases, a link
that drops, what it adds to a step, on nodes."""

from __future__ import annotations

import re
import statistics

from .common import Results, code, ms, pending, plan_text, rate, rows_named, scheme, size, sources, table, times, uplink
from .speed import fastest_fixed

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
