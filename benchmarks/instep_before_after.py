"""In-step overhead of two checkouts side by side (BENCHMARKS.md, "The whole step").

    git worktree add /tmp/before 80e0724
    cp src/gradcompress/cli/instep.py /tmp/before/src/gradcompress/cli/
    python benchmarks/instep_before_after.py /tmp/before/src src

Runs ``gradcompress.cli.instep.run_in_step`` from each source tree in turn (one after the
other, same machine, same arguments) and prints one table row per scheme.
"""

import json
import os
import subprocess
import sys

SCHEMES = ["none", "fp16", "int8", "sign", "topk:ratio=0.01", "powersgd:rank=4"]
RUN = ("import json, sys\n"
       "from gradcompress.cli.instep import run_in_step\n"
       "if __name__ == '__main__':\n"
       f"    print(json.dumps(run_in_step({SCHEMES!r}, 2, 2048, 3, 6, 0)))\n")


def measure(src: str) -> dict:
    env = dict(os.environ, PYTHONPATH=os.path.abspath(src))
    with open("/tmp/_instep_run.py", "w") as f:
        f.write(RUN)
    out = subprocess.run([sys.executable, "/tmp/_instep_run.py"], env=env, capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


if __name__ == "__main__":
    before, after = (measure(s) for s in sys.argv[1:3])
    print(f"dense all_reduce: {before['dense_seconds'] * 1e3:.1f} ms (before), {after['dense_seconds'] * 1e3:.1f} ms (after)")
    for b, a in zip(before["schemes"], after["schemes"]):
        print(f"| `{b['scheme']}` | {b['step_seconds'] * 1e3:.1f} ms ({b['vs_dense']:.2f}x) | {b['held_x']:.2f} + "
              f"{b['peak_x']:.2f} | {a['step_seconds'] * 1e3:.1f} ms ({a['vs_dense']:.2f}x) | {a['held_x']:.2f} + "
              f"{a['peak_x']:.2f} |")
