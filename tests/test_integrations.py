"""Integrations in real runs of the real packages, 2 CPU processes (gloo): Lightning's Trainer with
CompressedDDPStrategy, and Hugging Face Accelerate with register_ddp_hook (examples/)."""

import os
import subprocess
import sys

import pytest
import torch

from gradcompress.testbed.launch import free_port

pytestmark = pytest.mark.slow  # multi-process runs: outside the fast lane (pytest -m "not slow")

EXAMPLES = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples")


def test_compressed_ddp_strategy_compresses_on_cpu(tmp_path):
    pytest.importorskip("lightning", reason="lightning is not installed (pip install 'gradcompress[lightning]')")
    script = os.path.join(EXAMPLES, "lightning_ddp.py")
    env = dict(os.environ, PYTHONUNBUFFERED="1", MASTER_ADDR="127.0.0.1")
    proc = subprocess.run([sys.executable, script, str(tmp_path), "topk:ratio=0.05"], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=True) for r in range(2)]
    for r in ranks:
        assert r["stats"]["steps"] == 6, r["stats"]  # every training step went through the Compressor
        assert r["stats"]["wire_bytes"] > 0 and r["stats"]["ratio"] > 1.5, r["stats"]
        assert r["error_feedback"] is True
    assert all(torch.equal(a, b) for a, b in zip(ranks[0]["params"], ranks[1]["params"]))


def test_options_are_routed_by_name():
    pytest.importorskip("lightning", reason="lightning is not installed (pip install 'gradcompress[lightning]')")
    from gradcompress.integrations.lightning import CompressedDDPStrategy

    s = CompressedDDPStrategy("int8", warmup_steps=3, momentum=0.9, find_unused_parameters=True, bucket_cap_mb=5)
    assert s.compressor.warmup_steps == 3 and s.compressor.momentum == 0.9
    assert s._ddp_kwargs == {"find_unused_parameters": True, "bucket_cap_mb": 5}
    with pytest.raises(ValueError, match="unknown option 'warmup'"):
        CompressedDDPStrategy("int8", warmup=3)
    with pytest.raises(ValueError, match="unknown codec"):
        CompressedDDPStrategy("int9")


def test_accelerate_recipe_compresses(tmp_path):
    pytest.importorskip("accelerate", reason="accelerate is not installed (pip install 'gradcompress[accelerate]')")
    script = os.path.join(EXAMPLES, "accelerate_ddp.py")
    env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", str(free_port()),
           script, str(tmp_path), "int8"]
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=True) for r in range(2)]
    for r in ranks:
        assert r["ddp"] == "DistributedDataParallel"
        assert r["steps"] == 8 and r["stats"]["steps"] == 8, r  # 256 examples / 2 ranks / batch 16
        assert r["stats"]["ratio"] > 2.5, r["stats"]  # int8 after one dense step
    assert all(torch.equal(a, b) for a, b in zip(ranks[0]["params"], ranks[1]["params"]))
