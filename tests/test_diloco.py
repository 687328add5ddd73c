"""gradcompress.optim.DiLoCo on real gloo workers (2 and 4 ranks), each launch with a timeout."""

import pytest
import torch

import diloco_workers as dw
from gradcompress import make
from gradcompress.testbed import launch

pytestmark = pytest.mark.slow  # multi-process runs: outside the fast lane (pytest -m "not slow")

TIMEOUT = 240


@pytest.mark.parametrize("world", [2, 4])
def test_one_step_sync_with_plain_sgd_is_ddp(world):
    for diffs in launch.run(dw.equals_ddp, world, timeout=TIMEOUT):
        assert max(diffs) < 1e-6, diffs


@pytest.mark.parametrize("world, codec", [(2, "none"), (4, "int8"), (2, "topk:ratio=0.1,values=int8")])
def test_replicas_equal_after_each_sync_and_differ_between(world, codec):
    results = launch.run(dw.replicas, world, codec, timeout=TIMEOUT)
    for same, stats in results:
        assert same == [False, False, True, False, False, True], same
        assert stats["steps"] == 6 and stats["syncs"] == 2


def test_resume_mid_interval_is_bit_exact(tmp_path):
    for full, resumed, stats in launch.run(dw.resume, 2, "int4", str(tmp_path / "ck"), timeout=TIMEOUT):
        assert all(torch.equal(a, b) for a, b in zip(full, resumed))
        assert stats["syncs"] == 2 and stats["steps"] == 8


def test_wire_bytes_match_the_payload_arithmetic():
    """Per sync: tensors under min_numel (1024) in one dense all-reduce with the finiteness flag, the
    others by the codec's collective (int8/int4: the two-step reduce)."""
    from gradcompress.exchanges.layout import chunk_numel

    world, syncs, codecs = 2, 3, ["none", "int8", "int4"]
    for result in launch.run(dw.wire_bytes, world, codecs, 2, syncs, timeout=TIMEOUT):
        for codec in codecs:
            stats, shapes = result[codec]
            c = make(codec)
            numels = [torch.Size(s).numel() for s in shapes]
            if c.exact:
                per_sync = 2 * (world - 1) * 4 * sum(numels) // world
            else:
                dense = sum(n for n in numels if n < 1024) + 1
                per_sync = 2 * (world - 1) * 4 * dense // world
                per_sync += 2 * (world - 1) * sum(c.payload_nbytes(chunk_numel(n, world)) for n in numels
                                                  if n >= 1024)
            assert stats["syncs"] == syncs and stats["wire_bytes"] == syncs * per_sync, (codec, stats)


def test_bad_arguments_give_one_clear_error():
    for r in launch.run(dw.bad_arguments, 2, timeout=TIMEOUT):
        assert "sync_every must be an integer >= 1" in r["sync_every"]
        assert "unknown codec 'int9'" in r["codec"]
        assert "do not wrap the model in DistributedDataParallel" in r["ddp"]
