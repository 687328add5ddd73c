"""Which scheme at my link, how the bytes grow with the number of workers, what compression costs."""

from __future__ import annotations

from .common import Results, code, fewer, ms, pending, rendered, scheme, size, sources, table, times
from .registry import GROWTH_SCHEMES

LINK_RATES = [("10 Gbit/s", "netbench_mlp_10gbit", "auto_any_mlp_10gbit"),
              ("1 Gbit/s", "netbench_mlp_1gbit", "auto_any_mlp_1gbit"),
              ("100 Mbit/s", "netbench_mlp_100mbit", "auto_mlp_100mbit")]


def link_files(r: Results) -> list[tuple[str, str]]:
    return [(label, r.first(fresh, fallback)) for label, fresh, fallback in LINK_RATES]


def fastest_fixed(data: dict) -> dict:
    """The fastest scheme of a run that is not the autopilot."""
    return min((s for s in data["schemes"] if not s["scheme"].startswith("auto")), key=lambda s: s["median_step_s"])


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
