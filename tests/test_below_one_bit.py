"""Short LM runs of issue #23's schemes through the demo (the full 300/900-step runs are benchmarks: BENCHMARKS.md,
"DiLoCo, streaming DiLoCo, SparseLoCo, DeMo"): DeMo (``decoupled``), 1-bit Adam with local steps, DiLoCo with SparseLoCo's outer
gradients, next to DDP, on 2 gloo workers.

What holds at any length: every run learns (validation loss below the uniform 8 bits = ln 256 nats and finite), and
each sends the byte fraction its arithmetic says: DeMo about 1/30 of DDP per step (k = 32 of 64 per chunk of 1-D
tensors, 32 of 4096 per 2-D block), local steps nothing between syncs, SparseLoCo ~1/64 x int2 of DiLoCo's dense."""

import json
import math

from gradcompress.cli import main
import pytest

pytestmark = pytest.mark.slow  # multi-process runs: outside the fast lane (pytest -m "not slow")

STEPS = 24
SCHEMES = ["none", "decoupled", "onebitadam:warmup_steps=4,sync_every=4", "none:diloco=8",
           "none:diloco=8,outer=sparseloco"]


def test_short_lm_runs_learn_and_send_what_their_arithmetic_says(tmp_path):
    out = tmp_path / "lm"
    rc = main(["demo", "--task", "lm", "--steps", str(STEPS), "--workers", "2", "--no-progress", "--out", str(out),
               "--schemes", ";".join(SCHEMES)])
    assert rc == 0
    runs = {r["scheme"]: r for r in json.loads((out / "results.json").read_text())["runs"]}
    assert set(runs) == set(SCHEMES)
    for r in runs.values():
        assert math.isfinite(r["val_loss"]) and r["val_loss"] < math.log(256), r["scheme"]
    ddp = runs["none"]["bytes_per_step"]
    assert runs["decoupled"]["bytes_per_step"] <= ddp / 25
    local = runs["onebitadam:warmup_steps=4,sync_every=4"]
    per_step = [b - a for a, b in zip([0] + local["cumulative_bytes"][:-1], local["cumulative_bytes"])]
    assert sum(1 for b in per_step[4:] if b == 0) >= (STEPS - 4) // 2  # local steps send nothing
    dense, sparse = runs["none:diloco=8"], runs["none:diloco=8,outer=sparseloco"]
    assert 0 < sparse["cumulative_bytes"][-1] <= dense["cumulative_bytes"][-1] / 100
