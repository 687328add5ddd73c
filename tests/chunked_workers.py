"""Worker functions for tests/test_fsdp_repeated.py: FSDP2 module groups whose gradients are reduce-scattered more
than once per training step — torchtitan's chunked loss (the ``[norm, head]`` group reduce-scatters the head's
gradient in the chunks' own backward and the norm's in the decoder's) and a module called twice in one forward."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.fsdp import FSDPModule, fully_shard

import gradcompress
from gradcompress.cli.schemes import split_scheme

CHUNKS = 4


class Decoder(nn.Module):
    """embedding -> two blocks -> norm (the decoder), and ``head`` (the LM head) applied apart, chunk by chunk."""

    def __init__(self, seed: int = 0):
        super().__init__()
        torch.manual_seed(seed)
        self.embed = nn.Linear(12, 32)
        self.blocks = nn.ModuleList([nn.Sequential(nn.Linear(32, 32), nn.Tanh()) for _ in range(2)])
        self.norm = nn.LayerNorm(32)
        self.head = nn.Linear(32, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        for block in self.blocks:
            h = block(h)
        return self.norm(h)


def sharded(scheme: str | None, seed: int = 0) -> tuple[Decoder, gradcompress.Compressor | None]:
    """torchtitan's layout: each block, the group ``[norm, head]`` and the root sharded; ``scheme`` None: plain."""
    model = Decoder(seed)
    for block in model.blocks:
        fully_shard(block)
    fully_shard([model.norm, model.head])
    fully_shard(model)
    comp = None
    if scheme is not None:
        codec, options = split_scheme(scheme)
        comp = gradcompress.register_fsdp(model, codec, **options)
    return model, comp


def batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 * step + rank)
    return torch.randn(3, 8, 12, generator=g), torch.randint(0, 10, (3, 8), generator=g)


def chunked_loss(model: Decoder, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """torchtitan's ``ChunkedLossWrapper`` (components/loss.py): the decoder's output detached and split along the
    sequence; the head and loss per chunk, each with its own backward (the head's gradient sync only on the last);
    then the decoder's backward from the chunks' accumulated gradient. Returns the loss (already backpropagated)."""
    hidden = model(x)
    chunks = [c.detach().requires_grad_(True) for c in hidden.split(hidden.shape[1] // CHUNKS, dim=1)]
    head = model.head
    assert isinstance(head, FSDPModule)
    head.set_reshard_after_backward(False)
    head.set_requires_gradient_sync(False, recurse=False)
    total = hidden.new_zeros(())
    for i, (h, t) in enumerate(zip(chunks, y.split(y.shape[1] // CHUNKS, dim=1))):
        if i == len(chunks) - 1:
            head.set_requires_gradient_sync(True, recurse=False)
        loss = nn.functional.cross_entropy(head(h).flatten(0, 1), t.flatten()) / CHUNKS
        loss.backward()
        total = total + loss.detach()
    head.set_reshard_after_backward(True)
    head.reshard()
    hidden.backward(torch.cat([c.grad for c in chunks], dim=1))
    return total


def twice_loss(model: Decoder, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """The head called twice in one forward (on the decoder's output and on its half), one backward."""
    hidden = model(x)
    loss = (nn.functional.cross_entropy(model.head(hidden).flatten(0, 1), y.flatten())
            + nn.functional.cross_entropy(model.head(hidden * 0.5).flatten(0, 1), y.flatten()))
    loss.backward()
    return loss.detach()


LOSSES = {"chunked": chunked_loss, "twice": twice_loss}


def repeated_runs(rank: int, world: int, pattern: str, schemes: list[str], steps: int) -> dict:
    """Per scheme (``plain``: FSDP uncompressed): this rank's sharded gradients after each of ``steps`` backward
    passes on one fixed batch (no updates), the compressor's stats and its state's keys and shapes."""
    x, y = batch(rank, 0)
    out: dict = {}
    for scheme in schemes:
        model, comp = sharded(None if scheme == "plain" else scheme)
        grads = []
        for _ in range(steps):
            model.zero_grad()
            LOSSES[pattern](model, x, y)
            grads.append([p.grad.to_local().clone() for p in model.parameters()])
        residuals = {} if comp is None else {str(k): tuple(v.shape) for k, v in comp.residual.items()}
        out[scheme] = {"grads": grads, "stats": None if comp is None else comp.stats(), "residuals": residuals}
    dist.barrier()
    return out


def training_runs(rank: int, world: int, pattern: str, scheme: str, steps: int, cut: int) -> dict:
    """SGD with the ``pattern`` loss: run A straight through ``steps`` steps; run B stops after ``cut`` steps,
    saves the compressor's state, and a fresh compressor loads it and goes on. Both runs' parameters (local shards)
    and losses."""
    runs = []
    for resume in (False, True):
        model, comp = sharded(scheme)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        losses = []
        for step in range(steps):
            if resume and step == cut:
                state = comp.state_dict()
                codec, options = split_scheme(scheme)
                comp = gradcompress.register_fsdp(model, codec, **options)
                comp.load_state_dict(state)
            x, y = batch(rank, step)
            opt.zero_grad()
            losses.append(float(LOSSES[pattern](model, x, y)))
            opt.step()
        runs.append({"params": [p.to_local().detach().clone() for p in model.parameters()], "losses": losses,
                     "stats": comp.stats()})
    return {"straight": runs[0], "resumed": runs[1]}


def whole_loss(model: Decoder, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """The same loss in one forward and one backward (every group reduce-scattered once, whole)."""
    loss = nn.functional.cross_entropy(model.head(model(x)).flatten(0, 1), y.flatten())
    loss.backward()
    return loss.detach()


LOSSES["whole"] = whole_loss


def residual_means(comp: gradcompress.Compressor, model: Decoder, rank: int, world: int) -> dict[str, torch.Tensor]:
    """Per parameter name: the mean over ranks of the residual's part that this rank's chunk covers, shaped like
    the parameter's local shard. A residual is its buffer's layout: ``world`` chunks, chunk j every parameter's
    padded j-th shard in the group's order; a key names its parameters (``[a,b]``) or is the whole group."""
    from gradcompress.adapters.fsdp_keys import group_params

    everyone: list = [None] * world
    dist.all_gather_object(everyone, {str(k): v.float() for k, v in comp.residual.items()})
    names = {id(m): n for n, m in model.named_modules()}
    groups = {f"fsdp:{n or 'root'}": group_params(m, names) for n, m in model.named_modules()
              if isinstance(m, FSDPModule)}
    local = {n: p.to_local() for n, p in model.named_parameters()}
    out: dict[str, torch.Tensor] = {}
    for key in everyone[0]:
        base, _, subset = key.partition("[")
        sizes = dict(groups[base])
        params = subset.rstrip("]").split(",") if subset else [n for n, _ in groups[base]]
        mean = sum(r[key].view(world, -1)[rank] for r in everyone) / world
        offset = 0
        for name in params:
            out[name] = mean[offset : offset + local[name].numel()].view(local[name].shape)
            offset += sizes[name]
    return out


def feedback_runs(rank: int, world: int, pattern: str, scheme: str, steps: int) -> dict:
    """``steps`` backward passes of ``pattern`` on one fixed batch under ``scheme`` and under plain FSDP: per
    parameter, the sum of what was delivered, the exact gradient (plain FSDP's) and the ranks' mean residual."""
    x, y = batch(rank, 0)
    exact_model, _ = sharded(None)
    LOSSES[pattern](exact_model, x, y)
    exact = {n: p.grad.to_local().clone() for n, p in exact_model.named_parameters()}
    model, comp = sharded(scheme)
    delivered = {n: torch.zeros_like(g) for n, g in exact.items()}
    for _ in range(steps):
        model.zero_grad()
        LOSSES[pattern](model, x, y)
        for n, p in model.named_parameters():
            delivered[n] += p.grad.to_local()
    return {"exact": exact, "delivered": delivered, "residual": residual_means(comp, model, rank, world),
            "keys": sorted(str(k) for k in comp.residual), "stats": comp.stats()}
