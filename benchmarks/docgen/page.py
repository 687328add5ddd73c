"""A generated page written, or checked against what is committed (``--check``): document.py's BENCHMARKS.md and
api_reference.py's docs/api.md."""

from __future__ import annotations

import difflib
import os
import sys

from .common import ROOT


def differences(expected: str, found: str, path: str, script: str, unit: str, rerun: str = "") -> str:
    """What differs: the ``unit`` (the headings above each change), the first lines of a diff and the command that
    rewrites it (``rerun``: its extra arguments)."""
    exp, got = expected.splitlines(), found.splitlines()
    headings: list[str] = []
    for tag, i1, _i2, _, _ in difflib.SequenceMatcher(a=exp, b=got, autojunk=False).get_opcodes():
        if tag != "equal":
            heading = next((s.lstrip("# ") for s in reversed(exp[:max(i1, 1)]) if s.startswith("#")), "(top)")
            headings += [heading] if heading not in headings else []
    diff = list(difflib.unified_diff(got, exp, fromfile=path, tofile=f"what {script} writes", lineterm="", n=1))
    shown = "\n".join(diff[:40]) + ("\n..." if len(diff) > 40 else "")
    return (f"{path} is not what benchmarks/{script} writes; {unit} that differ: {'; '.join(headings)}\n"
            f"{shown}\nrun: python benchmarks/{script}{rerun}")


def write_or_check(text: str, output: str, default: str, script: str, unit: str, check: bool) -> int:
    """Write ``text`` to ``output``, or (``check``) compare them: 1 with what differs on stderr, else 0. ``default``:
    the script's own page (another ``output`` is named in the command that rewrites it)."""
    shown = os.path.relpath(output, ROOT) if os.path.abspath(output).startswith(ROOT) else output
    rerun = "" if os.path.abspath(output) == os.path.abspath(default) else f" --output {shown}"
    if check:
        try:
            with open(output, encoding="utf-8") as f:
                found = f.read()
        except FileNotFoundError:
            print(f"{shown} does not exist; run: python benchmarks/{script}{rerun}", file=sys.stderr)
            return 1
        if found != text:
            print(differences(text, found, shown, script, unit, rerun), file=sys.stderr)
            return 1
        print(f"{shown} is what benchmarks/{script} writes ({len(text.splitlines())} lines)")
        return 0
    with open(output, "w", encoding="utf-8") as f:
        f.write(text)
    print(f"wrote {shown} ({len(text.splitlines())} lines)")
    return 0
