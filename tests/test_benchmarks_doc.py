"""BENCHMARKS.md is what ``benchmarks/document.py`` writes from ``benchmarks/results/*.json`` (issue 37): the page is
current, ``--check`` notices a page or a result that changed, and every result file says how it was made."""

from __future__ import annotations

import glob
import json
import os
import re
import shutil
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOCUMENT = os.path.join(ROOT, "benchmarks", "document.py")
RESULTS = sorted(glob.glob(os.path.join(ROOT, "benchmarks", "results", "*.json")))
TIMEOUT = 60  # seconds; the script reads some JSON files and takes well under one


def document(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, DOCUMENT, *args], capture_output=True, text=True, timeout=TIMEOUT, cwd=ROOT)


def test_benchmarks_md_is_what_document_py_writes():
    done = document("--check")
    assert done.returncode == 0, done.stdout + done.stderr


def test_the_page_stays_within_600_lines():
    with open(os.path.join(ROOT, "BENCHMARKS.md"), encoding="utf-8") as f:
        assert len(f.read().splitlines()) <= 600


def test_check_fails_on_a_page_edited_by_hand(tmp_path):
    page = tmp_path / "BENCHMARKS.md"
    shutil.copy(os.path.join(ROOT, "BENCHMARKS.md"), page)
    assert document("--check", "--output", str(page)).returncode == 0  # the copy is current
    text = page.read_text(encoding="utf-8")
    planted = re.sub(r"^(\| `int8` \| )\d+\.\d", r"\g<1>1.0", text, count=1, flags=re.M)
    assert planted != text
    page.write_text(planted, encoding="utf-8")
    done = document("--check", "--output", str(page))
    assert done.returncode != 0
    assert "Which scheme at my link" in done.stderr, done.stderr  # names the section that differs
    assert document("--output", str(page)).returncode == 0  # writing it makes it current again
    assert document("--check", "--output", str(page)).returncode == 0


def test_check_fails_when_a_result_changes(tmp_path):
    """The numbers come from the result files: a changed measurement makes the committed page out of date."""
    results = tmp_path / "results"
    shutil.copytree(os.path.join(ROOT, "benchmarks", "results"), results)
    path = results / "lm_ddp_lr_sweep_300.json"
    data = json.loads(path.read_text())
    data["runs"][2]["val_loss"] = 1.5  # DDP at lr 1e-2, the tuned baseline every LM row is compared with
    path.write_text(json.dumps(data))
    done = document("--check", "--results", str(results))
    assert done.returncode != 0
    assert "What it keeps of accuracy" in done.stderr, done.stderr


@pytest.mark.parametrize("path", RESULTS, ids=os.path.basename)
def test_every_result_says_how_it_was_made(path):
    with open(path) as f:
        data = json.load(f)
    for field in ("command", "commit", "machine"):
        assert isinstance(data.get(field), str) and data[field].strip(), f"{os.path.basename(path)}: no {field}"
    assert re.fullmatch(r"[0-9a-f]{40}(\+dirty)?", data["commit"]), data["commit"]
