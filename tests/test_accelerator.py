"""The held-out matrix's testbed parts (issue 39): the model families by size, and the emulated accelerator whose
compute leaves the CPU idle while the gradients, the hook's order and what is sent stay real."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from gradcompress.testbed import accelerator, models
from gradcompress.testbed.accelerator import FORWARD_SHARE, Emulated, real_grads


@pytest.mark.parametrize("name, params", [("mlp:2048", 8_393_728), ("conv:32", 390_986), ("transformer:128", 470_528),
                                          ("conv:16", 98_730)])
def test_the_families_by_size(name, params):
    """``mlp:2048`` is mlp8m, ``conv:32`` the CNN and ``transformer:128`` the LM, parameter for parameter and weight
    for weight; other sizes build and run a step."""
    model = models.build_model(name)
    assert sum(p.numel() for p in model.parameters()) == params
    same = {"mlp:2048": "mlp8m", "conv:32": "cnn", "transformer:128": "lm"}.get(name)
    if same:
        assert all(torch.equal(a, b) for a, b in zip(model.parameters(), models.build_model(same).parameters()))
    x, y = models.batch(name, 4, 0)
    models.loss(name, model(x), y).backward()
    assert all(p.grad is not None for p in model.parameters())


@pytest.mark.parametrize("name", ["mlp:0", "conv:x", "transformer:30", "gpt"])
def test_an_unknown_model_is_one_clear_error(name):
    with pytest.raises(ValueError, match="mlp:W, conv:C, transformer:D"):
        models.kind(name)


def test_the_emulated_accelerator_writes_real_gradients_in_backward_order_with_the_cpu_idle(monkeypatch):
    """The emulated step's gradients are the real backward's, bit for bit; each parameter's gradient arrives in the
    real backward's order (last layer first: the DDP hook's buckets fill as they would); the step's compute time
    is spent asleep, the whole of it and once (the sleeps it asks for are recorded, not timed)."""
    name = "mlp:256"
    model = models.build_model(name)
    x, y = models.batch(name, 8, 0)
    grads = real_grads(model, lambda out, t: models.loss(name, out, t), x, y)
    emulated = Emulated(model, grads, compute_s=0.3)
    order = []
    for i, p in enumerate(model.parameters()):
        p.register_post_accumulate_grad_hook(lambda _, i=i: order.append(i))
    slept: list[float] = []
    monkeypatch.setattr(accelerator.time, "sleep", slept.append)
    emulated(x).backward()
    assert all(torch.equal(p.grad, g) for p, g in zip(model.parameters(), grads))
    assert order == list(reversed(range(len(grads))))
    assert len(slept) == 1 + len(grads) and sum(slept) == pytest.approx(0.3), slept  # the forward, then each grad
    assert FORWARD_SHARE == pytest.approx(1 / 3)


def test_emulated_under_ddp_averages_the_real_gradients():
    """Under DDP (2 gloo workers) the emulated model's gradients are averaged like the real ones."""
    from gradcompress.testbed import launch

    results = launch.run(_ddp_worker, 2, timeout=120)
    assert results[0] == results[1] and results[0]


def _ddp_worker(rank: int, world: int) -> bool:
    name = "mlp:256"
    model = models.build_model(name)
    x, y = models.batch(name, 8, rank)
    grads = real_grads(model, lambda out, t: models.loss(name, out, t), x, y)
    every = [torch.zeros_like(g) for g in grads]
    for g, e in zip(grads, every):
        e.copy_(g)
        torch.distributed.all_reduce(e)
    ddp = nn.parallel.DistributedDataParallel(Emulated(model, grads, compute_s=0.01))
    ddp(x).backward()
    return all(torch.allclose(p.grad, e / world, atol=1e-7) for p, e in zip(model.parameters(), every))
