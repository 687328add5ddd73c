"""Faults under torchft: the per-step cost, the stall after a kill, the demo's scenario, each kind of fault."""

from __future__ import annotations

from .common import Results, code, ms, pending, size, sources, table, times


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
            + ["", "The stall after the kill is the scenario's lighthouse join timeout, 1 s since 2026-12-07 (was 200 "
               "ms, 0.24 s of stall): the survivors' quorum waits that long for the killed replica, which still "
               "heartbeats; with 200 ms, two survivors woken apart under load were split in the quorum that takes "
               "the restarted replica back (`gradcompress.testbed.faults.kill_and_restart`, `join_ms`). The "
               "stall benchmark above (no restart) runs with a 200 ms join timeout.", ""])
