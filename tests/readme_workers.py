"""Worker for tests/test_readme.py: runs one snippet of README.md or a docs/ page on every rank of a gloo group.

The snippet's placeholders (``model``, ``loader``, ``loss_fn``, ``optimizer``, ``compressor``) are bound to
tiny real objects (:func:`placeholders`).
"""

from __future__ import annotations

import os
import re
import traceback

import torch
import torch.distributed as dist
import torch.nn as nn

import gradcompress
from gradcompress.testbed import launch


class Net(nn.Module):
    """Two Linear layers in ``self.layers`` (the FSDP snippet shards each); the first is big enough (2048
    weights) to be compressed under the default ``min_numel=1024``."""

    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(32, 64), nn.Linear(64, 4)])

    def forward(self, x):
        return self.layers[1](torch.relu(self.layers[0](x)))


def placeholders(rank: int, code: str) -> dict:
    """The names a snippet may leave to the reader. A snippet that builds its own ``compressor`` gets a model from
    another seed on every rank (as replicas are before DDP's or ``broadcast_parameters``' broadcast: the first
    ``synchronize`` raises if they still differ); otherwise ``compressor`` is an int8 Compressor that has taken
    one step on a model from seed 0 on every rank."""
    builds = re.search(r"^compressor = ", code, re.M) is not None
    torch.manual_seed(rank if builds else 0)
    model = Net()
    g = torch.Generator().manual_seed(100 + rank)  # every rank its own batches
    loader = [(torch.randn(16, 32, generator=g), torch.randint(0, 4, (16,), generator=g)) for _ in range(3)]
    loss_fn = nn.CrossEntropyLoss()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    ns = {"model": model, "loader": loader, "loss_fn": loss_fn, "optimizer": optimizer}
    if not builds:
        ns["compressor"] = gradcompress.Compressor("int8")
        x, y = loader[0]
        loss_fn(model(x), y).backward()
        ns["compressor"].synchronize(model.parameters())
        optimizer.step()
        optimizer.zero_grad()
    return ns


def run_snippets(rank: int, world: int, snippets: list, port: int, workdir: str) -> list:
    """Per snippet ``(name, code)``, in order: :func:`run_snippet` in ``workdir/<index>``, or its traceback."""
    out = []
    for i, (name, code) in enumerate(snippets):
        os.makedirs(os.path.join(workdir, str(i)), exist_ok=True)
        os.chdir(os.path.join(workdir, str(i)))
        try:
            out.append(run_snippet(rank, name, code, port))
        except Exception:
            out.append({"error": traceback.format_exc()})
    return out


def run_snippet(rank: int, name: str, code: str, port: int) -> dict:
    """Exec ``code`` with the placeholders bound, then train one more step "as usual" with what it built.

    A snippet that calls ``init_process_group(`` itself gets a world without one (the group is destroyed; the
    snippet's joins on ``port``). Returns the Compressor's step count after the snippet and after the extra
    step, and a checksum of the averaged gradients (equal on every rank unless the model is sharded).
    """
    ns = placeholders(rank, code)
    own_world = "init_process_group(" in code
    if own_world:  # each such snippet a port of its own (rank 0's free port, told to every rank)
        fresh = torch.tensor([launch.free_port() if rank == 0 else 0])
        dist.broadcast(fresh, 0)
        dist.destroy_process_group()
        os.environ["MASTER_PORT"] = str(int(fresh))
    exec(compile(code, name, "exec"), ns)
    if own_world and re.search(r"^compressor = ", code, re.M) is None:
        # a whole program (its own group and optimizer, e.g. DiLoCo): what it reports of itself
        opt = ns.get("opt")
        return {"steps": None, "grad_sum": None, "stats": opt.stats() if hasattr(opt, "stats") else None}
    compressor, model = ns["compressor"], ns["model"]
    after_snippet = compressor.stats()["steps"]
    x, y = ns["loader"][0]
    model.zero_grad()
    ns["loss_fn"](ns.get("ddp", model)(x), y).backward()
    if "register_" not in code:  # the hooks average during backward; otherwise the custom loop's call
        compressor.synchronize(model.parameters())
    grads = [p.grad for p in model.parameters()]
    sharded = any(type(g).__name__ == "DTensor" for g in grads)
    return {"steps": (after_snippet, compressor.stats()["steps"]),
            "grad_sum": None if sharded else float(sum(g.double().abs().sum() for g in grads))}
