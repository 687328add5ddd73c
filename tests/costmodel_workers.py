"""Worker functions for tests/test_costmodel.py: the real step on gloo processes, its bytes as ``stats()`` counts them
(ours) or as PyTorch's hooks issue them (the baselines: their ``dist.all_reduce`` calls, ring-counted as
``Collectives`` counts them).

Every rank steps on the cost model's own gradients (``costmodel.gradients``), the same on every rank and at every
step, as the model records them.
"""

from __future__ import annotations

import threading

import torch
import torch.distributed as dist
import torch.nn as nn

import gradcompress
from gradcompress import costmodel as cm
from gradcompress.exchanges.layout import split

#: tiny tensors: a matrix and a vector compressed, two vectors below min_numel dense, a second matrix
SHAPES = [(48, 64), (2000,), (10,), (33, 40), (700,)]
#: DDP's cap that cuts SHAPES into three buckets (two with a dense tensor beside compressed ones)
BUCKET_CAP = 8000


def _per_step(before: dict, after: dict) -> dict:
    return {k: after[k] - before[k] for k in ("wire_bytes", "inter_node_bytes", "intra_node_bytes")}


def ours(rank: int, world: int, cases: list, steps: int) -> dict:
    """For each ``(name, scheme text, Compressor options)``: ``steps`` steps of a fresh Compressor (no warm-up), one
    exchange per bucket of ``costmodel.buckets_for(..., BUCKET_CAP)``, each bucket a flat buffer with the gradients
    as views of it (as DDP hands a bucket to the hook). Returns per case the per-step deltas of ``stats()``'s
    ``wire_bytes``, ``inter_node_bytes``, ``intra_node_bytes`` and the topology."""
    grads = cm.gradients(SHAPES)
    out = {}
    for name, text, options in cases:
        comp = gradcompress.Compressor(text, warmup_steps=0, seed=0, **options)
        buckets = cm.buckets_for(cm.parse_scheme(text), SHAPES, BUCKET_CAP)
        rows, before = [], comp.stats()
        for _ in range(steps):
            with comp.step() as step:
                for bucket in buckets:
                    buffer = torch.cat([grads[i].reshape(-1) for i in bucket])
                    views = split(buffer, [SHAPES[i] for i in bucket])
                    step.drive([step.exchange(list(bucket), views, buffer)])
            after = comp.stats()
            rows.append(_per_step(before, after))
            before = after
        out[name] = {"steps": rows, "topology": before["topology"]}
    return out


class _Model(nn.Module):
    """Parameters of SHAPES; the loss sum(p * g) makes each gradient the cost model's g."""

    def __init__(self):
        super().__init__()
        self.ps = nn.ParameterList([nn.Parameter(torch.zeros(s)) for s in SHAPES])
        self.targets = cm.gradients(SHAPES)

    def forward(self, x):
        return x * sum((p * g).sum() for p, g in zip(self.ps, self.targets))


class _CountAllReduce:
    """``dist.all_reduce`` wrapped while in use: the bytes of every call, ring-counted (2 (W-1)/W of the buffer),
    from any thread (PyTorch's PowerSGD hook issues its later rounds from future callbacks)."""

    def __init__(self, world: int):
        self.world, self.sent, self.lock, self.real = world, 0, threading.Lock(), dist.all_reduce

    def __call__(self, tensor, *args, **kwargs):
        with self.lock:
            self.sent += 2 * (self.world - 1) * tensor.numel() * tensor.element_size() // self.world
        return self.real(tensor, *args, **kwargs)

    def __enter__(self):
        dist.all_reduce = self
        return self

    def __exit__(self, *exc):
        dist.all_reduce = self.real


def _ddp(kind: str, rank_r: int):
    """DDP over :class:`_Model` with PyTorch's hook for ``kind`` (``ddp``: ``allreduce_hook``, DDP's own all-reduce
    as a Python hook, so that its calls are counted), or ours (a scheme text: ``register_ddp_hook``)."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook

    model = nn.parallel.DistributedDataParallel(_Model())
    comp = None
    if kind == "ddp":
        model.register_comm_hook(None, default_hooks.allreduce_hook)
    elif kind == "torch-fp16":
        model.register_comm_hook(None, default_hooks.fp16_compress_hook)
    elif kind == "torch-powersgd":
        state = powerSGD_hook.PowerSGDState(process_group=None, matrix_approximation_rank=rank_r, start_powerSGD_iter=2)
        model.register_comm_hook(state, powerSGD_hook.powerSGD_hook)
    else:
        comp = gradcompress.register_ddp_hook(model, kind, warmup_steps=0, seed=0)
    return model, comp


def through_ddp(rank: int, world: int, kinds: list, steps: int) -> dict:
    """For each scheme of ``kinds`` (``ddp``, ``torch-fp16``, ``torch-powersgd:rank=R`` or one of ours), ``steps``
    DDP steps on :class:`_Model` (one bucket: the tensors are below DDP's first 1 MiB); per step the bytes PyTorch's
    hook all-reduced, or ours' ``stats()["wire_bytes"]``."""
    out = {}
    for text in kinds:
        scheme = cm.parse_scheme(text)
        model, comp = _ddp(scheme.kind if scheme.kind != "ours" else text, scheme.rank)
        rows = []
        for _ in range(steps):
            before = comp.stats()["wire_bytes"] if comp else 0
            with _CountAllReduce(world) as count:
                model(torch.ones(())).backward()
            rows.append(comp.stats()["wire_bytes"] - before if comp else count.sent)
            model.zero_grad()
        out[text] = rows
    return out


def run(rank: int, world: int, cases: list, kinds: list, steps: int) -> dict:
    """One launch for the whole comparison: :func:`ours` for ``cases``, then :func:`through_ddp` for ``kinds``."""
    return {"ours": ours(rank, world, cases, steps), "ddp": through_ddp(rank, world, kinds, steps)}
