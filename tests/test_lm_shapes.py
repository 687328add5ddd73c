"""The lm task's shapes and texts (issue 48: held-out LMs for a rule that must transfer, drawn by
``../shared/tools/heldout.py --kind lm`` as depth, width, context, batch and text)."""

from __future__ import annotations

import json

import pytest
import torch

from gradcompress.cli import main
from gradcompress.testbed import lm


def test_a_shape_is_a_size_or_its_fields():
    assert lm.shape("small") == lm.Shape(2, 128, 64) and lm.shape("large") == lm.Shape(4, 256, 64)
    assert lm.shape("layers=6,width=96,context=32") == lm.Shape(6, 96, 32)
    assert lm.shape("context=128") == lm.Shape(2, 128, 128)  # the rest: the small model's


@pytest.mark.parametrize("size, problem", [("huge", "sizes: small, large"), ("layers=0", "positive integers"),
                                           ("depth=3", "layers=L,width=W,context=C"),
                                           ("layers=2,layers=3", "each at most once"),
                                           ("width=66", "a multiple of the 4 heads"), ("", "sizes: small")])
def test_a_wrong_shape_names_what_is_allowed(size, problem):
    with pytest.raises(ValueError, match=problem):
        lm.shape(size)


def test_the_model_windows_and_validation_follow_the_context():
    model = lm.make_model(0, "layers=3,width=64,context=96")
    assert len(model.blocks) == 3 and model.tok.embedding_dim == 64 and model.pos.shape == (96, 64)
    data = lm.load_text()
    x, y = lm.Windows(data["train"], 0, 4, 0, context=96).next()
    assert x.shape == y.shape == (4, 96) and torch.equal(x[:, 1:], y[:, :-1])
    for m in (model, lm.make_model(0, "layers=1,width=32,context=16")):  # windows of its context, not 64
        loss = lm.validation_loss(m, data["val"][:5000])
        assert 5.0 < loss < 6.0  # untrained: about ln 256 = 5.55 nats per byte


def test_the_default_model_and_text_are_unchanged():
    """The small model and Python's documentation, as every earlier result measured them."""
    import pydoc_data.topics as topics

    assert sum(p.numel() for p in lm.make_model(0).parameters()) == 470528
    data = lm.load_text()
    text = "\n\n".join(topics.topics[k] for k in sorted(topics.topics)).encode("utf-8")
    assert bytes(torch.cat([data["train"], data["val"]]).numpy()) == text


@pytest.mark.parametrize("text", lm.TEXTS)
def test_every_text_is_real_english_of_some_size(text):
    data = lm.load_text(text=text)
    assert len(data["train"]) > 100_000 and len(data["val"]) > 10_000
    sample = bytes(data["train"][:20000].numpy()).decode("utf-8", errors="replace")
    assert sum(w in sample.lower().split() for w in ("the", "of", "to", "and")) == 4
    with pytest.raises(ValueError, match="texts: python-docs, stdlib-docstrings, licenses"):
        lm.load_text(text="wikipedia")


def test_demo_trains_a_drawn_shape_on_another_text(tmp_path, capsys):
    out = tmp_path / "lm"
    rc = main(["demo", "--task", "lm", "--lm-size", "layers=1,width=32,context=16", "--lm-text", "licenses",
               "--steps", "3", "--workers", "2", "--batch-size", "4", "--no-progress", "--schemes", "none",
               "--out", str(out)])
    assert rc == 0, capsys.readouterr().err
    task = json.loads((out / "results.json").read_text())["task"]
    assert "1 blocks, width 32, context 16" in task["model"] and task["text"] == "licenses"
    assert task["dataset"] == "the installed packages' license files, bytes"


@pytest.mark.parametrize("args, problem", [(["--task", "lm", "--lm-size", "layers=2,width=30"], "multiple of the 4"),
                                           (["--lm-text", "licenses"], "the lm task's text (--task lm)")])
def test_demo_refuses_a_wrong_shape_or_text_in_one_line(tmp_path, capsys, args, problem):
    rc = main(["demo", *args, "--steps", "1", "--workers", "1", "--no-progress", "--out", str(tmp_path / "x")])
    assert rc != 0
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(err) == 1 and problem in err[0], err
