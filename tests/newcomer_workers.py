"""Workers of tests/test_newcomer.py (issue #24, "what a newcomer hits"): each returns a report per rank."""

from __future__ import annotations

import os
import warnings

import torch
import torch.distributed as dist
import torch.nn as nn

import gradcompress
from gradcompress.collectives import LocalCollectives

#: (name, scheme, options) of the resume checks: PowerSGD (q, p, residual) and int8 with server error feedback
#: and momentum correction (residual, server_residual, momentum)
RESUME_CASES = [("powersgd", "powersgd:rank=2", {}),
                ("int8", "int8", {"server_error_feedback": True, "momentum": 0.9})]
SHAPES = [(64, 48), (300,)]
SAVED_STEPS = 3


def _params() -> list[nn.Parameter]:
    return [nn.Parameter(torch.zeros(s)) for s in SHAPES]


def _set_grads(params, rank: int, step: int) -> None:
    g = torch.Generator().manual_seed(100 * step + rank)
    for p in params:
        p.grad = torch.randn(p.shape, generator=g)


def _model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.Linear(16, 4))


def _error(fn) -> tuple[str, str] | None:
    """(exception type, message) of ``fn()``, or None if it returned."""
    try:
        fn()
    except Exception as err:  # any failure: the test reads the type
        return type(err).__name__, str(err)
    return None


# --------------------------------------------------------------------------- replicas that start unequal
def _unequal_replicas(rank: int) -> dict:
    """A model seeded per rank: the first synchronize raises everywhere and changes nothing."""
    model = _model(seed=rank)
    comp = gradcompress.Compressor("topk:ratio=0.05", min_numel=0)
    model(torch.randn(4, 8)).sum().backward()
    before = [p.grad.clone() for p in model.parameters()]
    out = {"error": _error(lambda: comp.synchronize(model.parameters()))}
    out["grads_unchanged"] = all(torch.equal(a, p.grad) for a, p in zip(before, model.parameters()))
    out["stats"] = comp.stats()
    out["state_empty"] = all(not v for v in comp.state.slots.values()) and comp.state_dict()["step"] == 0
    # the fix the error names: rank 0's parameters and buffers (BatchNorm's running statistics) everywhere
    out["own_tensors"] = [t.detach().clone() for t in model.state_dict().values()]
    gradcompress.broadcast_parameters(model)
    out["broadcast_tensors"] = [t.detach().clone() for t in model.state_dict().values()]
    out["first"] = comp.synchronize(model.parameters())
    first = comp.stats()["wire_bytes"]
    out["second"] = comp.synchronize(model.parameters())
    out["wire_per_step"] = (first, comp.stats()["wire_bytes"] - first)
    with torch.no_grad():  # checked once per Compressor: later steps send nothing extra and do not re-check
        next(model.parameters()).add_(float(rank))
    out["later_step_unchecked"] = comp.synchronize(model.parameters())
    return out


def _broadcast_options(rank: int, world: int) -> dict:
    """``src`` picks the rank; a list of parameters works as a module does; a bad ``src`` is a ValueError."""
    params = [torch.full((5,), float(rank)), torch.full((3, 2), 10.0 + rank)]
    gradcompress.broadcast_parameters(params, src=world - 1)
    out = {"src_last": [t.tolist() for t in params]}
    out["bad_src"] = _error(lambda: gradcompress.broadcast_parameters(params, src=world))
    out["tensor"] = _error(lambda: gradcompress.broadcast_parameters(params[0]))
    return out


# --------------------------------------------------------------------------- register on the wrong model
def _registrations() -> dict:
    plain = nn.Linear(4, 4)
    ddp = nn.parallel.DistributedDataParallel(nn.Linear(4, 4))
    return {
        "ddp_hook_plain": _error(lambda: gradcompress.register_ddp_hook(plain, "int8")),
        "register_plain": _error(lambda: gradcompress.register_ddp_hook(plain, gradcompress.Compressor("int8"))),
        "fsdp_plain": _error(lambda: gradcompress.register_fsdp(plain, "int8")),
        "fsdp_ddp": _error(lambda: gradcompress.register_fsdp(ddp, "int8")),
        "fsdp_params": _error(lambda: gradcompress.register_fsdp(list(plain.parameters()), "int8")),
        "ddp_hook_ddp": _error(lambda: gradcompress.register_ddp_hook(ddp, "int8")),  # the right model: no error
    }


# --------------------------------------------------------------------------- no process group
def _without_process_group() -> dict:
    """After ``destroy_process_group``: a clear RuntimeError and nothing changed; explicit local collectives work."""
    dist.destroy_process_group()
    params = _params()
    _set_grads(params, 0, 0)
    before = [p.grad.clone() for p in params]
    comp = gradcompress.Compressor("int8", min_numel=0)
    out = {"synchronize": _error(lambda: comp.synchronize(params)),
           "begin_step": _error(lambda: comp.begin_step()),
           "broadcast": _error(lambda: gradcompress.broadcast_parameters(params))}
    out["grads_unchanged"] = all(torch.equal(a, p.grad) for a, p in zip(before, params))
    out["steps"] = comp.stats()["steps"]
    out["explicit_local"] = comp.synchronize(params, collectives=LocalCollectives(1))
    out["explicit_local_lossy"] = not all(torch.equal(a, p.grad) for a, p in zip(before, params))
    out["explicit_local_stats"] = {k: comp.stats()[k] for k in ("steps", "wire_bytes")}
    return out


# --------------------------------------------------------------------------- resume on another world size
def _file(directory: str, name: str, rank: int) -> str:
    return os.path.join(directory, f"{name}.{rank}")


def _save_states(rank: int, directory: str) -> dict:
    """SAVED_STEPS synchronize steps of every resume case, then each rank saves its state."""
    out = {}
    for name, scheme, options in RESUME_CASES:
        comp = gradcompress.Compressor(scheme, min_numel=0, **options)
        params = _params()
        for step in range(SAVED_STEPS):
            _set_grads(params, rank, step)
            comp.synchronize(params)
        state = comp.state_dict()
        torch.save(state, _file(directory, name, rank))
        out[name] = {"world": state.get("world"), "slots": {k: len(v) for k, v in state.items() if isinstance(v, dict)}}
        reloaded = gradcompress.Compressor(scheme, min_numel=0, **options)
        with warnings.catch_warnings(record=True) as caught:  # the same world: loaded as it is, no warning
            warnings.simplefilter("always")
            reloaded.load_state_dict(torch.load(_file(directory, name, rank), weights_only=True))
            continued, resumed = _step(comp, rank), _step(reloaded, rank)
        out[name]["same_world_warnings"] = len(caught)
        out[name]["same_world_equal"] = _equal(continued, resumed)
    return out


def _step(comp, rank: int) -> tuple[list[torch.Tensor], dict]:
    params = _params()
    _set_grads(params, rank, SAVED_STEPS)
    comp.synchronize(params)
    return [p.grad for p in params], comp.state_dict()


def _equal(a, b) -> bool:
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b))
    return torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b


def _resume_case(rank: int, directory: str, saved_world: int, scheme: str, options: dict, name: str) -> dict:
    """Load the state of rank ``rank % saved_world`` and step once; compare with the same state loaded without
    its per-rank residuals and its ``world`` (the old-checkpoint path: loaded as it is), and with no state."""
    state = torch.load(_file(directory, name, rank % saved_world), weights_only=True)
    make = lambda: gradcompress.Compressor(scheme, min_numel=0, **options)  # noqa: E731
    resumed = make()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        resumed.load_state_dict(state)
        pending_world = resumed.state_dict().get("world")
        got, after = _step(resumed, rank)
    stripped = {k: v for k, v in state.items() if k not in ("world", "residual", "server_residual")}
    reference = make()
    with warnings.catch_warnings(record=True) as reference_caught:
        warnings.simplefilter("always")
        reference.load_state_dict(stripped)
        want, want_after = _step(reference, rank)
    fresh_grads, _ = _step(make(), rank)
    return {"warnings": [str(w.message) for w in caught if issubclass(w.category, UserWarning)],
            "reference_warnings": len(reference_caught), "pending_world": pending_world,
            "world_after": after.get("world"), "steps_after": after["step"], "saved_step": state["step"],
            "same_as_reference": _equal(got, want) and _equal(after, want_after),
            "kept_state_matters": not _equal(got, fresh_grads)}


def _resume(rank: int, directory: str, saved_world: int) -> dict:
    return {name: _resume_case(rank, directory, saved_world, scheme, options, name)
            for name, scheme, options in RESUME_CASES}


def checks(rank: int, world: int, save_dir: str | None, resume_from: tuple[str, int] | None,
           basics: bool = True) -> dict:
    """Every check of one launch: resume first (the saved states of another launch), then save, then the
    newcomer's mistakes; the last, without a process group, destroys it."""
    out = {}
    if resume_from is not None:
        out["resume"] = _resume(rank, *resume_from)
    if save_dir is not None:
        out["saved"] = _save_states(rank, save_dir)
    if basics:
        out["unequal"] = _unequal_replicas(rank)
        out["broadcast"] = _broadcast_options(rank, world)
        out["register"] = _registrations()
        dist.barrier()
        out["no_group"] = _without_process_group()
    return out
