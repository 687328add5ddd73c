"""The documentation's demo tables from a demo's ``results.json``, so pages and results cannot drift (issue 24).

Prints the table ``gradcompress demo`` printed for that run (the demo's own
:func:`gradcompress.cli.demo.format_demo`, digits or ``--task lm`` alike) in a fenced block, after
the run's figures as the page's heading gives them (workers, steps, seconds). The digits table lives in
``docs/demo.md``, the LM table in ``docs/accuracy.md`` (they were the README's until the README became a
front page; ``tests/test_readme.py`` finds whichever page holds each)::

    python benchmarks/readme_tables.py docs/demo-results.json                       # print
    python benchmarks/readme_tables.py docs/demo-results.json --check docs/demo.md  # exit 1 if the page differs
    python benchmarks/readme_tables.py docs/lm-demo-results.json --write docs/accuracy.md  # replace its block

The page's block is the fenced block whose first line has the table's header words (the digits and
the LM tables differ there: ``test acc`` / ``val loss``); the figures must appear in the heading above it.
"""

from __future__ import annotations

import argparse
import json
import re
import sys

from gradcompress.cli.demo import format_demo

FENCE = "```"
BLOCKS = re.compile(r"^```\w*\n(.*?)^```$", re.S | re.M)


def figures(result: dict) -> str:
    """The run as the page's heading names it, e.g. ``4 workers, 250 steps, 140 s``."""
    task = result["task"]
    return f"{task['workers']} workers, {task['steps']} steps, {result['wall_seconds']:.0f} s"


def block(result: dict) -> str:
    return f"{FENCE}\n{format_demo(result['runs'], result['task']['workers'])}\n{FENCE}"


def find_block(text: str, header: str) -> tuple[int, int]:
    """Start and end offsets of the fenced block whose first line has ``header``'s words (whatever the column
    widths); ValueError if none."""
    for m in BLOCKS.finditer(text):
        if m.group(1).split("\n", 1)[0].split() == header.split():
            return m.start(), m.end()
    raise ValueError(f"no fenced block starting with the header line {header!r}")


def problems(text: str, result: dict) -> list[str]:
    """What in ``text`` (the page holding the table) disagrees with ``result``; empty if nothing."""
    want = block(result)
    try:
        start, end = find_block(text, want.split("\n")[1])
    except ValueError as e:
        return [str(e)]
    out = []
    if text[start:end] != want:
        out.append(f"the table differs from what the results print:\n{want}")
    heading = text.rfind("\n#", 0, start)
    if figures(result) not in text[heading:start]:
        out.append(f"the heading above the table does not say {figures(result)!r}")
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("results", help="a results.json written by gradcompress demo")
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--check", metavar="PAGE", help="exit 1 if the page's table or heading differs")
    mode.add_argument("--write", metavar="PAGE", help="replace the page's table with the results' one")
    args = p.parse_args(argv)
    with open(args.results) as f:
        result = json.load(f)
    if args.check:
        found = problems(open(args.check).read(), result)
        for line in found:
            print(f"{args.check}: {line}", file=sys.stderr)
        return 1 if found else 0
    if args.write:
        text = open(args.write).read()
        want = block(result)
        start, end = find_block(text, want.split("\n")[1])
        with open(args.write, "w") as f:
            f.write(text[:start] + want + text[end:])
        print(f"wrote the table into {args.write}; its heading should say {figures(result)!r}")
        return 0
    print(figures(result))
    print(block(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
