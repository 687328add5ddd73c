"""Run a benchmark command and keep what it measured as ``benchmarks/results/NAME.json``, with the command, the
commit and the machine: the fields ``benchmarks/document.py`` renders and ``tests/test_benchmarks_doc.py`` asks of
every result file.

    # the command prints one JSON object (netbench/bench/plan --json, the benchmarks/*.py scripts' --json):
    python benchmarks/record.py NAME -- python -m gradcompress netbench --workers 4 --bandwidth 1gbit --json
    # the command writes its result into files (gradcompress demo/train --out DIR: DIR/results.json):
    python benchmarks/record.py NAME --from /tmp/r/results.json -- gradcompress demo --task lm --out /tmp/r

Several ``--from`` files (a loop of demo or train runs, e.g. under ``bash -c '...'``) become one result: their
``runs`` lists concatenated, the other fields from the first file. Nothing is written when the command fails or
leaves no JSON object. What is added, in front of the measured fields (:func:`provenance`): ``command`` (as typed,
shell-quoted), ``commit`` (``git rev-parse HEAD``, with ``+dirty`` when ``src/`` has uncommitted changes: the code
measured is then not that commit's), ``machine`` (CPU model, cores, OS, Python, torch) and ``recorded`` (UTC time).
Standard library only.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.metadata
import json
import os
import platform
import shlex
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(ROOT, "benchmarks", "results")


def _git(*args: str) -> str:
    done = subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True)
    return done.stdout.strip() if done.returncode == 0 else ""


def commit() -> str:
    """HEAD's hash, ``+dirty`` appended when ``src/`` differs from it (``unknown`` outside a git checkout)."""
    head = _git("rev-parse", "HEAD") or "unknown"
    return head + ("+dirty" if _git("status", "--porcelain", "--", "src") else "")


def machine() -> str:
    """One line: CPU model, cores, OS and kernel, Python, torch (read without importing it)."""
    model = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            names = [line.split(":", 1)[1].strip() for line in f if line.startswith("model name")]
        model = names[0] if names else model
    except OSError:
        pass
    try:
        torch = "torch " + importlib.metadata.version("torch")
    except importlib.metadata.PackageNotFoundError:
        torch = "no torch"
    return (f"{model}, {os.cpu_count()} cores, {platform.system()} {platform.release()}, "
            f"Python {platform.python_version()}, {torch}")


def provenance(command: list[str]) -> dict:
    """The fields every result file starts with."""
    now = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
    return {"command": shlex.join(command), "commit": commit(), "machine": machine(), "recorded": now}


def merge(results: list[dict]) -> dict:
    """One result from several files: the first's fields, every file's ``runs`` concatenated."""
    if len(results) == 1:
        return results[0]
    missing = [i for i, r in enumerate(results) if not isinstance(r.get("runs"), list)]
    if missing:
        raise SystemExit(f"record: --from files must each hold a 'runs' list to be merged; file(s) {missing} do not")
    merged = dict(results[0])
    merged["runs"] = [run for r in results for run in r["runs"]]
    return merged


def last_json_object(stdout: str) -> dict | None:
    """The JSON object the command printed: the whole output, else its last line that parses as an object."""
    try:
        value = json.loads(stdout)
        return value if isinstance(value, dict) else {"results": value}
    except json.JSONDecodeError:
        pass
    for line in reversed(stdout.splitlines()):
        try:
            value = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(value, dict):
            return value
    return None


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if "--" not in argv:
        print("record: give the command after '--' (python benchmarks/record.py NAME -- COMMAND ...)",
              file=sys.stderr)
        return 2
    split = argv.index("--")
    p = argparse.ArgumentParser(prog="python benchmarks/record.py", description=__doc__.splitlines()[0])
    p.add_argument("name", help="the result's name: benchmarks/results/NAME.json")
    p.add_argument("--from", dest="sources", action="append", default=[], metavar="FILE",
                   help="read the result from FILE after the command (repeatable: their runs are concatenated)")
    p.add_argument("--note", default=None, help="a sentence kept as the result's 'note'")
    p.add_argument("--force", action="store_true", help="replace an existing result file")
    args = p.parse_args(argv[:split])
    command = argv[split + 1:]
    if not command:
        p.error("the command after '--' is empty")
    name = args.name[:-5] if args.name.endswith(".json") else args.name
    path = os.path.join(RESULTS, os.path.basename(name) + ".json")
    if os.path.exists(path) and not args.force:
        p.error(f"{os.path.relpath(path, ROOT)} exists; --force replaces it")
    fields = provenance(command)  # the commit before the run: what was measured
    done = subprocess.run(command, stdout=subprocess.PIPE, text=True)  # stderr passes through (progress)
    if done.returncode != 0:
        print(done.stdout, end="")
        print(f"record: the command exited with {done.returncode}; nothing written", file=sys.stderr)
        return done.returncode
    if args.sources:
        results = []
        for source in args.sources:
            with open(source) as f:
                results.append(json.load(f))
        result = merge(results)
    else:
        result = last_json_object(done.stdout)
        if result is None:
            print(done.stdout, end="")
            print("record: the command printed no JSON object (add its --json option, or give --from FILE); "
                  "nothing written", file=sys.stderr)
            return 1
    if args.note:
        fields["note"] = args.note
    out = {**fields, **{k: v for k, v in result.items() if k not in fields}}
    with open(path, "w") as f:
        json.dump(out, f, indent=1, allow_nan=False)
        f.write("\n")
    print(f"record: wrote {os.path.relpath(path, ROOT)} (commit {fields['commit'][:12]})", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
