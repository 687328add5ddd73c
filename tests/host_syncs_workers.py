"""Worker functions of tests/test_host_syncs.py (spawned by ``gradcompress.testbed.launch.run``): host syncs per step."""

from __future__ import annotations

import dataclasses

import torch
import torch.nn as nn

import gradcompress
from gradcompress.codecs import fast
from gradcompress.codecs.quantize import Int8
from gradcompress.testbed.host_syncs import HostSyncs

#: steps before the counted ones: state allocated, warm-ups (DDP's bucket rebuild, PowerSGD's first factors) done
WARMUP = 3
COUNTED = 2


@dataclasses.dataclass(frozen=True)
class ItemInt8(Int8):
    """int8 that reads a number on the host in every encode: the planted sync the test must catch."""

    def encode(self, x, *, seed=None):
        float(x.abs().max())
        return super().encode(x, seed=seed)


def _grads(rank: int, step: int) -> list[torch.Tensor]:
    """A matrix, a long vector (both compressed) and a bias below ``min_numel`` (sent dense)."""
    g = torch.Generator().manual_seed(100 * step + rank)
    return [torch.randn(128, 96, generator=g) * 1e-3, torch.randn(20000, generator=g) * 1e-3,
            torch.randn(40, generator=g)]


def _synchronize(rank: int, spec) -> list[dict]:
    comp = gradcompress.Compressor(spec)
    params = [nn.Parameter(torch.zeros_like(t)) for t in _grads(0, 0)]
    counted = []
    for step in range(WARMUP + COUNTED):
        for p, t in zip(params, _grads(rank, step)):
            p.grad = t
        with HostSyncs() as syncs:
            comp.synchronize(params)
        counted.append(dict(syncs.ops))
    return counted[WARMUP:]


def _hook(rank: int, spec) -> list[dict]:
    """DDP with our hook (two buckets): the syncs of a whole step, forward and backward."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 96), nn.ReLU(), nn.Linear(96, 10))
    ddp = nn.parallel.DistributedDataParallel(model, bucket_cap_mb=0.04)
    gradcompress.register_ddp_hook(ddp, spec)
    x = torch.randn(16, 64, generator=torch.Generator().manual_seed(rank))
    counted = []
    for _ in range(WARMUP + COUNTED):
        ddp.zero_grad()
        with HostSyncs() as syncs:
            ddp(x).square().mean().backward()
        counted.append(dict(syncs.ops))
    return counted[WARMUP:]


def syncs_per_step(rank: int, world: int, specs: list, hook_specs: list, use_fast: bool) -> dict:
    """Per spec, the syncs (op -> count) of each counted step: ``synchronize`` for ``specs``, the DDP hook for
    ``hook_specs`` (key ``"hook:" + spec``); ``use_fast``: the CPU's fused kernels (CUDA never takes them)."""
    fast.set_enabled(use_fast)
    out = {str(spec): _synchronize(rank, spec) for spec in specs}
    out.update({f"hook:{spec}": _hook(rank, spec) for spec in hook_specs})
    return out
