"""Worker functions of tests/test_core.py (spawned by ``gradcompress.testbed.launch.run``)."""

from __future__ import annotations

import torch
import torch.distributed as dist

import gradcompress
from gradcompress.adapters.fsdp import CompressedReduceScatter


def _reduce_scatter(rank: int, async_op: bool, wait: bool):
    """One compressed reduce-scatter of a fixed input, called from inside a backward pass (where FSDP calls it):
    (what it returned, the output after the backward, whether its first round was in flight before wait())."""
    comp = gradcompress.Compressor("int8", min_numel=0)
    rs = CompressedReduceScatter(comp, "fsdp:layer")
    g = torch.Generator().manual_seed(rank)
    inp, out = torch.randn(2 * 4096, generator=g), torch.zeros(4096)
    seen = {}

    def hook(grad):
        work = rs(out, inp, dist.group.WORLD, dist.ReduceOp.AVG, async_op=async_op)
        seen["type"] = type(work).__name__ if work is None or not isinstance(work, dist.Work) else "Work"
        seen["launched"] = work is not None and not work.is_completed()
        if wait and work is not None:
            work.wait()
        return grad

    x = torch.ones(1, requires_grad=True)
    y = x * 2
    y.register_hook(hook)
    y.backward()
    assert not comp.current_step, "the step ends with the backward"
    return seen, out.clone()


def async_reduce_scatter(rank: int, world: int) -> dict:
    waited, out_waited = _reduce_scatter(rank, True, True)
    unwaited, out_unwaited = _reduce_scatter(rank, True, False)
    sync, out_sync = _reduce_scatter(rank, False, False)
    return {"types": [waited["type"], unwaited["type"], sync["type"]],
            "waited_equal": torch.equal(out_waited, out_sync), "unwaited_equal": torch.equal(out_unwaited, out_sync),
            "launched_before_wait": waited["launched"] and unwaited["launched"]}
