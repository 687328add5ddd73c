"""Worker functions for the OneBitAdam multi-process tests (module level, so they can be pickled)."""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
import torch.nn as nn

from gradcompress.optim import OneBitAdam

HYPER = dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)
IN, OUT = 64, 10


def make_model(seed: int = 0, dtype: torch.dtype = torch.float32) -> nn.Module:
    """About 85k parameters (three weight matrices, three biases)."""
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(IN, 256), nn.Tanh(), nn.Linear(256, 256), nn.Tanh(), nn.Linear(256, OUT))
    return model.to(dtype)


def numel(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def batch(rank: int, step: int, n: int = 32, dtype: torch.dtype = torch.float32):
    """Rank- and step-specific data (each rank its own shard)."""
    g = torch.Generator().manual_seed(10_000 * step + rank)
    return torch.randn(n, IN, generator=g).to(dtype), torch.randint(0, OUT, (n,), generator=g)


def backward(model: nn.Module, rank: int, step: int) -> float:
    dtype = next(model.parameters()).dtype
    x, y = batch(rank, step, dtype=dtype)
    loss = nn.functional.cross_entropy(model(x).float(), y)
    loss.backward()
    return loss.item()


def average_by_hand(model: nn.Module, world: int) -> None:
    """The gradients averaged by one all-reduce of their concatenation (as the optimizer's dense exchange
    does it, so gloo sums in the same order), divided by the world size, written back."""
    grads = torch.cat([p.grad.reshape(-1) for p in model.parameters()])
    dist.all_reduce(grads)
    grads.div_(world)
    offset = 0
    for p in model.parameters():
        p.grad.copy_(grads[offset : offset + p.numel()].view(p.shape))
        offset += p.numel()


def flat(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1).clone() for p in model.parameters()])


def train(model: nn.Module, opt: OneBitAdam, rank: int, first: int, last: int) -> list[int]:
    """Steps ``first .. last - 1``; returns the wire bytes each step sent."""
    sent = []
    for step in range(first, last):
        before = opt.bytes_sent()
        opt.zero_grad()
        backward(model, rank, step)
        opt.step()
        sent.append(opt.bytes_sent() - before)
    return sent


# --------------------------------------------------------------------------- one launch, many checks
def main_checks(rank: int, world: int, warmup: int, compressed: int, ckpt: tuple | None = None) -> dict:
    """Warm-up vs torch.optim.Adam, bytes per step, replicas identical, fp16/bf16, a group of size 1.

    ``ckpt``: ``(total, cut, warmup, directory)``: also run :func:`ckpt_first` (its
    uninterrupted parameters are ``out["ckpt_full"]``).
    """
    out: dict = {}
    if ckpt is not None:
        out["ckpt_full"] = ckpt_first(rank, world, *ckpt)

    # warm-up equals torch.optim.Adam on the all-reduced gradient; then compressed steps
    model, ref = make_model(), make_model()
    opt = OneBitAdam(model.parameters(), warmup_steps=warmup, **HYPER)
    ref_opt = torch.optim.Adam(ref.parameters(), **HYPER)
    diffs, sent = [], []
    for step in range(warmup):
        before = opt.bytes_sent()
        for m, o in ((model, opt), (ref, ref_opt)):
            o.zero_grad()
            backward(m, rank, step)
        # the reference's average: one all-reduce of the concatenated gradients, as the
        # optimizer does it (so gloo sums in the same order), then divide by the world size
        average_by_hand(ref, world)
        opt.step()
        ref_opt.step()
        sent.append(opt.bytes_sent() - before)
        diffs.append(max((a - b).abs().max().item() for a, b in zip(model.parameters(), ref.parameters())))
    out["warmup_max_diff"] = max(diffs)
    out["warmup_bytes"] = sent
    out["compressed_bytes"] = train(model, opt, rank, warmup, warmup + compressed)
    out["numel"] = numel(model)
    out["params"] = flat(model)
    out["stats"] = opt.stats()
    state = opt.state[next(model.parameters())]
    out["state_dtypes"] = {k: str(v.dtype) for k, v in state.items()}
    out["server_numel"] = state["server_error"].numel()

    # float16 / bfloat16 parameters: run through warm-up and compression, stay finite
    for dtype in (torch.float16, torch.bfloat16):
        m = make_model(dtype=dtype)
        o = OneBitAdam(m.parameters(), warmup_steps=2, lr=1e-3)
        before = flat(m)
        train(m, o, rank, 0, 6)
        out[str(dtype)] = {
            "finite": all(bool(torch.isfinite(p).all()) for p in m.parameters()),
            "dtypes": sorted({str(p.dtype) for p in m.parameters()}),
            "state_dtypes": sorted({str(v.dtype) for s in o.state.values() for v in s.values()}),
            "changed": not torch.equal(before, flat(m)),
            "params": flat(m),
            "compressed_steps": o.stats()["compressed_steps"],
        }

    # a process group of size 1 behaves as a single process (no collectives, same algorithm)
    if world == 2:
        groups = [dist.new_group([r]) for r in range(world)]
        m = make_model()
        o = OneBitAdam(m.parameters(), warmup_steps=2, process_group=groups[rank], **HYPER)
        train(m, o, rank, 0, 5)
        out["solo_params"] = flat(m)
        out["solo_bytes"] = o.bytes_sent()
    return out


def single_process_run(rank: int, warmup: int, steps: int) -> torch.Tensor:
    """The ``solo`` run of :func:`main_checks` without torch.distributed (called in the test process)."""
    m = make_model()
    o = OneBitAdam(m.parameters(), warmup_steps=warmup, **HYPER)
    train(m, o, rank, 0, steps)
    return flat(m)


# --------------------------------------------------------------------------- checkpoint / resume
def ckpt_first(rank: int, world: int, total: int, cut: int, warmup: int, directory: str) -> torch.Tensor:
    """Run ``total`` steps uninterrupted (returned); in a second model run ``cut`` steps and save."""
    model = make_model()
    opt = OneBitAdam(model.parameters(), warmup_steps=warmup, **HYPER)
    train(model, opt, rank, 0, total)
    full = flat(model)

    model = make_model()
    opt = OneBitAdam(model.parameters(), warmup_steps=warmup, **HYPER)
    train(model, opt, rank, 0, cut)
    torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, os.path.join(directory, f"rank{rank}.pt"))
    return full


def ckpt_resume(rank: int, world: int, total: int, cut: int, warmup: int, directory: str) -> torch.Tensor:
    """Fresh processes (and a differently initialised model): load the checkpoint and run to ``total``."""
    model = make_model(seed=123)
    opt = OneBitAdam(model.parameters(), warmup_steps=warmup, **HYPER)
    ckpt = torch.load(os.path.join(directory, f"rank{rank}.pt"), weights_only=True)
    model.load_state_dict(ckpt["model"])
    opt.load_state_dict(ckpt["opt"])
    train(model, opt, rank, cut, total)
    return flat(model)


# --------------------------------------------------------------------------- CompressedAdam (any codec)
def compressed_adam_checks(rank: int, world: int, codecs: list[str], warmup: int, total: int, cut: int,
                           directory: str) -> dict:
    """Per codec: replicas and bytes after compressed steps, and the checkpoint of ``cut`` steps
    (resumed by :func:`compressed_adam_resume`); for ``none`` also the exact reference: the
    gradients all-reduced by hand, then the same optimizer on a group of size 1."""
    from gradcompress.optim import CompressedAdam

    out = {}
    for codec in codecs:
        model = make_model()
        opt = CompressedAdam(model.parameters(), warmup_steps=warmup, codec=codec, **HYPER)
        sent = train(model, opt, rank, 0, total)
        rec = {"params": flat(model), "sent": sent, "stats": opt.stats(),
               "state_keys": sorted(opt.state[model[0].weight])}
        model = make_model()
        opt = CompressedAdam(model.parameters(), warmup_steps=warmup, codec=codec, **HYPER)
        train(model, opt, rank, 0, cut)
        torch.save({"model": model.state_dict(), "opt": opt.state_dict()},
                   os.path.join(directory, f"{codec}-rank{rank}.pt"))
        out[codec] = rec
    if "none" in codecs:  # exact: the momentum of the averaged gradient, Adam's update with the frozen variance
        groups = [dist.new_group([r]) for r in range(world)]
        solo = groups[rank]
        model = make_model()
        opt = CompressedAdam(model.parameters(), warmup_steps=warmup, codec="none", process_group=solo, **HYPER)
        for step in range(total):
            opt.zero_grad()
            backward(model, rank, step)
            average_by_hand(model, world)
            opt.step()
        out["reference"] = flat(model)
    return out


def compressed_adam_resume(rank: int, world: int, codecs: list[str], warmup: int, total: int, cut: int,
                           directory: str) -> dict:
    from gradcompress.optim import CompressedAdam

    out = {}
    for codec in codecs:
        model = make_model(seed=123)
        opt = CompressedAdam(model.parameters(), warmup_steps=warmup, codec=codec, **HYPER)
        ckpt = torch.load(os.path.join(directory, f"{codec}-rank{rank}.pt"), weights_only=True)
        model.load_state_dict(ckpt["model"])
        opt.load_state_dict(ckpt["opt"])
        train(model, opt, rank, cut, total)
        out[codec] = flat(model)
    return out
