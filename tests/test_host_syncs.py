"""Host synchronisations per step (issue 48): at most one for every fixed scheme, counted by
:class:`gradcompress.testbed.host_syncs.HostSyncs`.

The counter first, op by op (what it counts and what it must not). Then one 2-process gloo launch runs every codec
of the registry (``gradcompress.available()``, with its defaults, and a few variants) through
``Compressor.synchronize`` and through the DDP hook, with the CPU's fused kernels off (the path CUDA takes), and
counts the syncs of each step after the warm-up. A planted ``.item()`` in an encode (``ItemInt8``) must be caught.
``threshold`` and ``dgc`` send a data-dependent number of values: their sizes are read on the host per tensor
(strict xfail: the day they make one sync per step, the marker goes).
"""

from __future__ import annotations

import pytest
import torch

import gradcompress
import host_syncs_workers as workers
from gradcompress.testbed import launch
from gradcompress.testbed.host_syncs import HostSyncs

VARIANTS = ["int8:stochastic=true", "topk:ratio=0.01,chunk=4096", "topk:values=int8", "powersgd:rank=1,alternate=true",
            "randomk:scale=true"]
SPECS = gradcompress.available() + VARIANTS
#: variable payload sizes: every peer's size is read on the host before the gather
VARIABLE = {"threshold", "dgc"}

X = torch.arange(-4.0, 6.0)
COUNTED = {
    "item": lambda: X.sum().item(),
    "bool": lambda: bool((X > 0).any()),
    "int": lambda: int(X[3]),
    "tolist": lambda: X.tolist(),
    "nonzero": lambda: X.nonzero(),
    "where": lambda: torch.where(X > 0),
    "mask index": lambda: X[X > 0],
    "mask assign": lambda: X.clone().__setitem__(X > 0, 0.0),
    "masked_select": lambda: X.masked_select(X > 0),
    "unique": lambda: X.unique(),
    "repeat_interleave": lambda: torch.arange(3).repeat_interleave(torch.tensor([1, 2, 3])),
    "equal": lambda: torch.equal(X, X),
}
NOT_COUNTED = {
    "elementwise": lambda: (X * 2 + 1).abs(),
    "reduction": lambda: X.sum(),
    "topk": lambda: X.abs().topk(3),
    "integer index": lambda: X[torch.tensor([1, 2])],
    "nonzero_static": lambda: torch.nonzero_static(X, size=3),
    "repeat_interleave with output_size": lambda: torch.arange(3).repeat_interleave(torch.tensor([1, 2, 3]),
                                                                                    output_size=6),
    "repeat_interleave by an int": lambda: torch.arange(3).repeat_interleave(2),
    "cpu to cpu": lambda: X.cpu().to("cpu"),
}


@pytest.mark.parametrize("name", COUNTED)
def test_the_counter_counts_each_waiting_op_once(name):
    with HostSyncs() as syncs:
        COUNTED[name]()
    assert syncs.count == 1, dict(syncs.ops)


@pytest.mark.parametrize("name", NOT_COUNTED)
def test_the_counter_leaves_ops_that_do_not_wait(name):
    with HostSyncs() as syncs:
        NOT_COUNTED[name]()
    assert syncs.count == 0, dict(syncs.ops)


def test_the_counter_sees_inside_a_backward_and_restores_tolist():
    x = torch.ones(3, requires_grad=True)
    y = x * 2
    y.register_hook(lambda g: g * len(g.tolist()) * g.sum().item())
    before = torch.Tensor.tolist
    with HostSyncs() as syncs:
        y.sum().backward()
    assert dict(syncs.ops) == {"tolist": 1, "_local_scalar_dense": 1}
    assert torch.Tensor.tolist is before


@pytest.fixture(scope="module")
def counted():
    """rank -> {spec or "hook:" + spec -> [syncs of each counted step]}: one launch for every scheme."""
    specs = SPECS + [workers.ItemInt8()]
    return launch.run(workers.syncs_per_step, 2, specs, gradcompress.available(), False, timeout=600)


def _per_step(counted, key: str) -> list[int]:
    return [sum(ops.values()) for rank in counted for ops in rank[key]]


def _params(specs, variable):
    return [pytest.param(s, marks=pytest.mark.xfail(strict=True, reason="data-dependent sizes read per tensor"))
            if s.split(":")[0] in variable else s for s in specs]


@pytest.mark.parametrize("spec", _params(SPECS, VARIABLE))
def test_at_most_one_host_sync_per_synchronize_step(counted, spec):
    steps = _per_step(counted, spec)
    assert len(steps) == 2 * workers.COUNTED and max(steps) <= 1, counted[0][spec]


@pytest.mark.parametrize("spec", _params(gradcompress.available(), VARIABLE))
def test_at_most_one_host_sync_per_ddp_step(counted, spec):
    steps = _per_step(counted, f"hook:{spec}")
    assert len(steps) == 2 * workers.COUNTED and max(steps) <= 1, counted[0][f"hook:{spec}"]


def test_a_planted_item_is_caught(counted):
    """The negative control: int8 with a ``float(x.abs().max())`` in its encode makes more than one per step."""
    steps = _per_step(counted, str(workers.ItemInt8()))
    assert min(steps) > 1 and min(_per_step(counted, "int8")) == 1
