"""The summary at the top of the page: one line per section, computed from its files."""

from __future__ import annotations

from .autopilot import _matrix_cell, autopilot_ratios
from .common import Results, code, fewer, pct, run, scheme, times, tuned_ddp, uplink
from .diloco import SIZE_RUNS, TITAN_DP, torchtitan_summary
from .registry import PENDING, RECIPE
from .speed import fastest_fixed, link_files


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
    out.append("- **Which scheme at my link** (12.6M MLP, 4 hosts; fastest fixed scheme, x DDP in the same run): "
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
    if r.has(TITAN_DP):
        out.append(torchtitan_summary(r))
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
