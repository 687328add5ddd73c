"""The stall after a kill under torchft: from a replica's SIGKILL to the survivors' next committed step.

``python benchmarks/torchft_stall.py [--repeats 3]``: 3 replicas on loopback (torchft's lighthouse, heartbeat
timeout 1 s, join timeout 0.2 s, gloo timeout 5 s), the digits MLP; the last replica is killed at step 10, either
between two steps or inside the exchange (after its first collective round), with int8 and PowerSGD rank 2; prints
the stall and the steps the survivors did not commit. The kill writes its time to a file just before SIGKILL.
``--json`` prints one JSON object instead of the table (``python benchmarks/record.py torchft_stall -- python
benchmarks/torchft_stall.py --json`` keeps it as a result file).
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile

from gradcompress.testbed import faults


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    args = p.parse_args()
    say = (lambda *a, **k: None) if args.json else print
    cases = []
    say("scheme            kill            stall after the kill (s), each run     uncommitted survivor steps")
    for spec in ("int8", "powersgd:rank=2"):
        for inside in (False, True):
            stalls, lost = [], []
            for _ in range(args.repeats):
                where = tempfile.mkdtemp(prefix="stall-")
                # the lighthouse its result file measured (no restart here: no rejoining quorum to split)
                rows = faults.kill_and_restart(where, spec, steps=20, kill_at=10, restart_at=None, inside=inside,
                                               join_ms=200, min_replicas=1)
                summary = faults.summarize_scenario(rows, 3, faults.killed_at(where))
                stalls.append(summary["stall_seconds"])
                lost.append(sum(not r["committed"] for r in rows if r["replica"] < 2))
            cases.append({"scheme": spec, "kill": "inside the exchange" if inside else "between two steps",
                          "stall_seconds": stalls, "uncommitted_survivor_steps": lost})
            text = ", ".join(f"{x:.2f}" for x in stalls)
            say(f"{spec:<17} {'inside exchange' if inside else 'between steps':<15} {text:<26} (median "
                f"{statistics.median(stalls):.2f})   {lost}", flush=True)
    if args.json:
        print(json.dumps({"benchmark": "torchft_stall", "replicas": 3, "steps": 20, "kill_at": 10,
                          "repeats": args.repeats, "cases": cases}, indent=1))


if __name__ == "__main__":
    main()
