"""What it keeps of accuracy, FSDP and HSDP, nodes: hierarchical against flat."""

from __future__ import annotations

from .common import (Results, code, fewer, ms, netbench_table, pct, pending, plan_text, rate, rendered, run, scheme,
                     size, sources, table, times, tuned_ddp, uplink)


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
