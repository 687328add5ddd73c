"""DiLoCo, streaming DiLoCo, SparseLoCo, DeMo; below 1/1000 of DDP's bytes (with a second model size and the time
to the tuned DDP's loss); torchtitan against gradcompress."""

from __future__ import annotations

from .common import (Results, code, ddp_at, fewer, ms, pct, pending, rate, rendered, run, scheme, size, sources, table,
                     times, tuned_ddp)
from .registry import SIZE_SCHEMES

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


#: ``benchmarks/torchtitan_lm.py``'s result files (issue 47): torchtitan's FSDP first, then the rest by name
TITAN_DP = "torchtitan_dp_300"
TITAN_WINDOW = 10  # steps: the training loss is one batch's; its mean over this many steps is compared


def trailing(x: dict, step: int | None = None) -> float:
    """The mean training loss over the ``TITAN_WINDOW`` steps ending at ``step`` (default: the last)."""
    losses = [loss for s, loss in x["losses"] if step is None or s <= step][-TITAN_WINDOW:]
    return sum(losses) / len(losses)


TITAN_FIRST = (TITAN_DP, "torchtitan_int8_300", "torchtitan_int4_300", "torchtitan_torchft_diloco_300")


def torchtitan_names(r: Results) -> list[str]:
    """torchtitan's FSDP, int8, int4, torchft's DiLoCo, then the other ``torchtitan_*`` results by name."""
    return [n for n in TITAN_FIRST if r.has(n)] + \
        [n for n in r.names if n.startswith("torchtitan_") and n not in TITAN_FIRST]


def torchtitan_summary(r: Results) -> str:
    """Each run's loss (last-10-step mean) and bytes against torchtitan's FSDP."""
    target = trailing(r.get(TITAN_DP))
    parts = [f"{code(x['config'])} ({x['steps']} steps) {pct(trailing(x), target)} at {fewer(x['x_fewer_than_dp'])} "
             "fewer bytes" for x in (r.get(n) for n in torchtitan_names(r)[1:])]
    return ("- **torchtitan** (its llama3 debug model and default loss, 4 processes; training loss against "
            "torchtitan's own FSDP after 300 steps): " + "; ".join(parts) + ".")


def torchtitan_section(r: Results) -> list[str]:
    """torchtitan's llama3 debug model: its own FSDP, gradcompress codecs, torchft's DiLoCo and ours side by side."""
    if not r.has(TITAN_DP):
        return []
    names = torchtitan_names(r)
    dp = r.get(TITAN_DP)
    target = trailing(dp)
    rows = []
    for name in names:
        x = r.get(name)
        reach = next((s for s, _ in x["losses"] if s >= TITAN_WINDOW and trailing(x, s) <= target), None)
        ours = f"{fewer(x['x_fewer'])}" if "x_fewer" in x else "–"
        dirty = "+dirty" if x["commit"].endswith("+dirty") else ""
        rows.append([f"{code(x['config'])} (`{name}`, {x['commit'][:7]}{dirty})", x["layout"], str(x["steps"]),
                     f"{x['final_loss']:.4f}", f"{trailing(x):.4f}", pct(trailing(x), target),
                     "–" if reach is None else str(reach), size(x["bytes_per_step"]), fewer(x["x_fewer_than_dp"]),
                     ours, f"{x['seconds'] / 60:.1f} min"])
    torchft = next((r.get(n) for n in names if r.get(n)["config"] == "torchft"), None)
    ft = (f" torchft's DiLoCo as torchtitan ships it (`llama3_torchft_debugmodel`): sync every "
          f"{torchft['sync_steps']} steps, {torchft['fragments']} fragments, AdamW inside, outer SGD lr 0.7 "
          "Nesterov, float32."
          if torchft else "")
    return ["## torchtitan: its data parallelism against gradcompress", "",
            f"torchtitan 0.3.0's llama3 debug model ({dp['parameters'] / 1e6:.2f}M parameters) with its default "
            "(chunked) loss, 4 processes on CPU (gloo, through `tests/torchtitan_launcher.py`'s CPU shims), seq_len "
            "128, 4 sequences per process, the same seed and text for every run (AdamW lr 8e-4, or with `inner=muon` "
            f"gradcompress's Muon at that lr; torchtitan's schedule over the run's steps).{ft} Loss: torchtitan's logged training loss (no "
            "held-out loss: torchtitan's validator downloads its dataset; 300 steps go over the 225K-token text 2.7 "
            "times, 900 steps 8 times, so a lower loss also means more memorised; under torchft the mean of the two "
            "groups' own logs), "
            f"the last step's and the mean of the last {TITAN_WINDOW}, against torchtitan's FSDP's 300-step mean "
            f"({target:.4f}); `reaches` is the first step whose {TITAN_WINDOW}-step mean is at or below it. Bytes: "
            "gradient bytes each process sends per step (gradcompress: its stats file; torchtitan's runs: float32 "
            "ring collectives computed from the parameter count); `x FSDP`: fewer than torchtitan's FSDP over 4 "
            f"({size(dp['bytes_per_step'])}); `x stats file`: gradcompress's own count, against torchtitan's data "
            "parallelism in the same layout (for DiLoCo: HSDP's all-reduce across the replicas). Targets (issue "
            "47): int8 within 1 % of FSDP's loss; DiLoCo int2 + Muon >= 1000x fewer bytes, reaching FSDP's "
            "300-step loss within 900 steps. Wall: the run's, on the shared 2-core machine (other jobs beside "
            "some runs). Each row: `python benchmarks/record.py NAME -- python benchmarks/torchtitan_lm.py CONFIG "
            "--steps STEPS --json` (the file's `command`).", ""] + table(
        ["config (file, commit)", "layout", "steps", "loss", f"last {TITAN_WINDOW}", "vs FSDP", "reaches",
         "bytes/step", "x FSDP", "x stats file", "wall"], rows, right=set(range(2, 11)))


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
