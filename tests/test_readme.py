"""The README's Python snippets run as tests (extracted from README.md, so they cannot rot), and its demo
table is the one ``benchmarks/readme_tables.py`` prints from the committed results.

A snippet preceded by ``<!-- not run: REASON -->`` is skipped with that reason. Snippets that talk to a process
group run on 2 gloo workers (``gradcompress.launch.run``) with placeholders from ``readme_workers``.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

import readme_workers  # tests/ is on sys.path (conftest.py), so the spawned workers import it too
from gradcompress import launch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
README = os.path.join(ROOT, "README.md")
FENCE = re.compile(r"^```python\n(.*?)^```$", re.S | re.M)
NOT_RUN = re.compile(r"<!--\s*not run:\s*([^>]*?)\s*-->\s*\Z")
GROUP = re.compile(r"init_process_group|DistributedDataParallel|fully_shard|synchronize\(|register_|get_rank")
TIMEOUT = 120  # seconds, a deadlock guard for launch.run and the subprocess (the file takes 20-50 s on 2 cores)


def snippets() -> list:
    text = open(README).read()
    out = []
    for m in FENCE.finditer(text):
        line = text.count("\n", 0, m.start()) + 1
        skip = NOT_RUN.search(text[:m.start()])
        marks = [pytest.mark.skip(reason=skip.group(1))] if skip else []
        out.append(pytest.param(f"README.md:{line}", m.group(1), marks=marks, id=f"line{line}"))
    return out


SNIPPETS = snippets()


def test_the_readme_has_snippets_and_few_are_skipped():
    assert len(SNIPPETS) >= 6
    assert sum(bool(p.marks) for p in SNIPPETS) <= 3


@pytest.fixture(scope="module")
def group_results(tmp_path_factory):
    """Every snippet that needs a process group, run in README order on one pair of workers (one start-up)."""
    todo = [(p.values[0], p.values[1]) for p in SNIPPETS if not p.marks and GROUP.search(p.values[1])]
    workdir = tmp_path_factory.mktemp("readme")
    results = launch.run(readme_workers.run_snippets, 2, todo, launch.free_port(), str(workdir), timeout=TIMEOUT)
    return {name: ([r[i] for r in results], workdir / str(i)) for i, (name, _) in enumerate(todo)}


@pytest.mark.parametrize("name,code", SNIPPETS)
def test_snippet_runs(name, code, group_results):
    if not GROUP.search(code):
        exec(compile(code, name, "exec"), {})
        return
    results, workdir = group_results[name]
    for r in results:
        assert "error" not in r, r["error"]
        assert r["steps"][1] == r["steps"][0] + 1, results  # the snippet's compressor takes the next step
    if results[0]["grad_sum"] is not None:  # replicated model: every rank holds the same averaged gradient
        assert results[0]["grad_sum"] == results[1]["grad_sum"], results
    if "for x, y in loader" in code:
        assert results[0]["steps"][0] == 3  # one step per batch of the placeholder loader
    if "torch.save" in code:
        assert sorted(os.listdir(workdir)) == ["ckpt.0", "ckpt.1"]


@pytest.mark.parametrize("results", ["demo-results.json", "lm-demo-results.json"])
def test_the_readme_demo_table_is_what_the_committed_results_print(results):
    cmd = [sys.executable, os.path.join(ROOT, "benchmarks", "readme_tables.py"),
           os.path.join(ROOT, "docs", results), "--check", README]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=TIMEOUT,
                          env={**os.environ, "PYTHONPATH": os.path.join(ROOT, "src")})
    assert done.returncode == 0, done.stdout + done.stderr
