"""The Python snippets of README.md and of every page under docs/ run as tests (extracted from the pages, so they
cannot rot); the demo tables are what ``benchmarks/readme_tables.py`` prints from the committed results; the
README's first two shell commands are the ones CI runs; relative links between the pages resolve.

A snippet preceded by ``<!-- not run: REASON -->`` is skipped with that reason. Snippets that talk to a process
group run on 2 gloo workers (``gradcompress.testbed.launch.run``) with placeholders from ``readme_workers``;
snippets under torchft bring their own lighthouse and Manager and run alone in a fresh interpreter.
"""

from __future__ import annotations

import glob
import importlib.util
import os
import re
import subprocess
import sys

import pytest

import readme_workers  # tests/ is on sys.path (conftest.py), so the spawned workers import it too
from gradcompress.testbed import launch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
README = os.path.join(ROOT, "README.md")
PAGES = [README] + sorted(glob.glob(os.path.join(ROOT, "docs", "*.md")))  # every page whose snippets run
FENCE = re.compile(r"^```python\n(.*?)^```$", re.S | re.M)
NOT_RUN = re.compile(r"<!--\s*not run:\s*([^>]*?)\s*-->\s*\Z")
GROUP = re.compile(r"init_process_group|DistributedDataParallel|fully_shard|synchronize\(|register_|get_rank")
STANDALONE = re.compile(r"^from torchft|^import torchft", re.M)  # its own lighthouse, Manager and store
TIMEOUT = 120  # seconds, a deadlock guard for launch.run and the subprocess (the file takes 20-50 s on 2 cores)
# The README's first two shell commands: the main job and the tests (.ci/run and CI look for them verbatim).
COMMANDS = ["pip install torch==2.13.0 && pip install -e '.[demo]' && gradcompress demo",
            "pip install torch==2.13.0 && pip install -e '.[test]' && python -m pytest -q -p no:cacheprovider"]


def relative(page: str) -> str:
    return os.path.relpath(page, ROOT)


def snippets() -> list:
    """Every ```python block of every page, in page order (README first), named ``PAGE:LINE``."""
    out = []
    for page in PAGES:
        text = open(page).read()
        for m in FENCE.finditer(text):
            line = text.count("\n", 0, m.start()) + 1
            skip = NOT_RUN.search(text[:m.start()])
            marks = [pytest.mark.skip(reason=skip.group(1))] if skip else []
            name = f"{relative(page)}:{line}"
            out.append(pytest.param(name, m.group(1), marks=marks, id=name))
    return out


SNIPPETS = snippets()


def test_the_pages_have_snippets_and_few_are_skipped():
    assert len(SNIPPETS) >= 6
    assert sum(bool(p.marks) for p in SNIPPETS) <= 3
    front = [p for p in SNIPPETS if p.values[0].startswith("README.md:")]
    assert len(front) >= 3 and not any(p.marks for p in front)  # DDP, FSDP2, the custom loop: all of them run


def test_the_readme_is_a_front_page():
    """At most 250 lines: the measured tables and long explanations live in docs/."""
    assert len(open(README).read().splitlines()) <= 250


def test_the_readme_starts_with_the_two_commands():
    blocks = re.findall(r"^```(?:bash|sh|shell)\n(.*?)^```$", open(README).read(), re.S | re.M)
    assert [b.strip() for b in blocks[:2]] == COMMANDS


@pytest.fixture(scope="module")
def group_results(tmp_path_factory):
    """Every snippet that needs a process group, run in page order on one pair of workers (one start-up)."""
    todo = [(p.values[0], p.values[1]) for p in SNIPPETS
            if not p.marks and GROUP.search(p.values[1]) and not STANDALONE.search(p.values[1])]
    workdir = tmp_path_factory.mktemp("readme")
    results = launch.run(readme_workers.run_snippets, 2, todo, launch.free_port(), str(workdir), timeout=TIMEOUT)
    return {name: ([r[i] for r in results], workdir / str(i)) for i, (name, _) in enumerate(todo)}


@pytest.mark.parametrize("name,code", SNIPPETS)
def test_snippet_runs(name, code, group_results):
    if STANDALONE.search(code):
        pytest.importorskip("torchft")
        proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=TIMEOUT)
        assert proc.returncode == 0, proc.stderr[-3000:]
        return
    if not GROUP.search(code):
        exec(compile(code, name, "exec"), {})
        return
    results, workdir = group_results[name]
    for r in results:
        assert "error" not in r, r["error"]
    if results[0]["steps"] is None:  # a whole program on its own group: what it sent, if it synced
        for r in results:
            if r["stats"] and r["stats"].get("syncs"):
                assert r["stats"]["wire_bytes"] > 0, r  # a sync between the workers, not one alone
        return
    for r in results:
        assert r["steps"][1] == r["steps"][0] + 1, results  # the snippet's compressor takes the next step
    if results[0]["grad_sum"] is not None:  # replicated model: every rank holds the same averaged gradient
        assert results[0]["grad_sum"] == results[1]["grad_sum"], results
    if "for x, y in loader" in code:
        assert results[0]["steps"][0] == 3  # one step per batch of the placeholder loader
    if "torch.save" in code:
        assert sorted(os.listdir(workdir)) == ["ckpt.0", "ckpt.1"]


def _readme_tables():
    spec = importlib.util.spec_from_file_location("readme_tables", os.path.join(ROOT, "benchmarks", "readme_tables.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("results", ["demo-results.json", "lm-demo-results.json"])
def test_the_demo_table_is_what_the_committed_results_print(results):
    """Exactly one page holds the table (found by its header line, wherever it lives), and it is what
    ``readme_tables.py --check`` accepts."""
    import json

    tables = _readme_tables()
    with open(os.path.join(ROOT, "docs", results)) as f:
        header = tables.block(json.load(f)).split("\n")[1]
    holders = []
    for page in PAGES:
        try:
            tables.find_block(open(page).read(), header)
            holders.append(page)
        except ValueError:
            pass
    assert len(holders) == 1, f"{results}: pages holding its table: {[relative(p) for p in holders]}; want one"
    cmd = [sys.executable, os.path.join(ROOT, "benchmarks", "readme_tables.py"),
           os.path.join(ROOT, "docs", results), "--check", holders[0]]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=TIMEOUT,
                          env={**os.environ, "PYTHONPATH": os.path.join(ROOT, "src")})
    assert done.returncode == 0, done.stdout + done.stderr


LINK = re.compile(r"\]\(([^)\s]+)\)")


def anchors(page: str) -> set:
    """The anchors GitHub gives the page's headings (outside code blocks)."""
    text = re.sub(r"^```.*?^```$", "", open(page).read(), flags=re.S | re.M)
    out = set()
    for heading in re.findall(r"^#{1,6}\s+(.*?)\s*$", text, re.M):
        out.add(re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-"))
    return out


@pytest.mark.parametrize("page", PAGES, ids=relative)
def test_relative_links_resolve(page):
    text = re.sub(r"^```.*?^```$", "", open(page).read(), flags=re.S | re.M)
    broken = []
    for target in LINK.findall(text):
        if re.match(r"[a-z]+:", target):  # http:, https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        file = os.path.normpath(os.path.join(os.path.dirname(page), path)) if path else page
        if not os.path.exists(file):
            broken.append(target)
        elif anchor and file.endswith(".md") and anchor not in anchors(file):
            broken.append(target)
    assert not broken, f"{relative(page)}: links that lead nowhere: {broken}"
