"""Does ``plan`` predict the step, and how these tables are made."""

from __future__ import annotations

from .common import HISTORY, MAIN_MACHINE, Results, code, ms, pending, scheme, sources, table, times
from .registry import PENDING, RECORD


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
           f"and the issues' targets, is in the measurement log git keeps (`git show {HISTORY}:docs/changes.md`); "
           "`benchmarks/MISSING.md` says which results are still missing and how to record one."]
    if unread:
        out += ["", "Result files no table reads yet: " + ", ".join(f"`{n}.json`" for n in unread) + "."]
    return out
