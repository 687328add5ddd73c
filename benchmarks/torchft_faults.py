"""The stall a fault costs the survivors under torchft, for each kind of fault: from the fault to the survivors'
first commit of a step after the last one the faulty replica committed.

``python benchmarks/torchft_faults.py [--repeats 3] [--json]``: 3 replicas of the digits MLP under gradcompress's
torchft DDP (``gradcompress.testbed.chaos``; gloo timeout 3 s, the lighthouse's heartbeat timeout 0.5 s), for
int8, PowerSGD rank 2 and top-k 5 %: a replica SIGKILLed between two steps (after its exchange, before the commit)
or inside its exchange (just after its first collective was issued), stopped with SIGSTOP inside its exchange (it
hangs with its sockets open), and — on the namespace testbed, as root — its link cut both ways inside its
exchange (every packet dropped, no reset). Each fault is repeated ``--repeats`` times in one scenario (a fresh
replica replaces the faulty one each time). ``--json`` prints one object (``python benchmarks/record.py
torchft_faults -- python benchmarks/torchft_faults.py --json`` keeps it as a result file).
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile

from gradcompress.testbed import chaos, netns

SCHEMES = ("int8", "powersgd:rank=2", "topk:ratio=0.05")
#: (name, kind, event): after the exchange (an event no exchange reaches), inside it (just after the first issue)
FAULTS = (("kill between steps", "kill", 99), ("kill inside the exchange", "kill", 2),
          ("hang inside the exchange", "stop", 2), ("cut link inside the exchange", "cut", 2))
PG_TIMEOUT = 3.0


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    say = (lambda *a, **k: None) if args.json else print
    cases, no_netns = [], netns.problem()
    for spec in SCHEMES:
        for name, kind, event in FAULTS:
            plan = [(1, event)] * args.repeats
            where = tempfile.mkdtemp(prefix="faults-")
            if kind == "cut":
                if no_netns:
                    say(f"{spec:<17} {name:<30} skipped: {no_netns}")
                    continue
                result = chaos.run_partition(where, spec, plan, pg_timeout=PG_TIMEOUT)
            else:
                result = chaos.run_family(where, chaos.FAMILIES.get(spec, spec), plan, kind=kind)
            ok = (result["unequal"] == [] and result["failed_committed"] == 0 and result["unhealed"] == []
                  and result["behind"] == [])
            cases.append({"scheme": spec, "fault": name, "stall_seconds": result["stalls"], "replicas_ok": ok,
                          "survivor_exit_codes": result["exit_codes"]["survivors"]})
            say(f"{spec:<17} {name:<30} stall {', '.join(f'{x:.2f}' for x in result['stalls'])} s (median "
                f"{statistics.median(result['stalls']):.2f}); survivors equal, no failed step committed: {ok}",
                flush=True)
    if args.json:
        print(json.dumps({"benchmark": "torchft_faults", "replicas": 3, "pg_timeout_s": PG_TIMEOUT,
                          "heartbeat_timeout_s": 0.5, "repeats": args.repeats, "cases": cases}, indent=1))


if __name__ == "__main__":
    main()
