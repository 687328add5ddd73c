"""The benchmark models of ``gradcompress netbench`` (and of ``plan --model``), each with its fixed batches and loss.

``mlp`` 12.6M parameters (1024-2048-2048-2048-1024, communication-bound), ``mlp8m`` 8.4M (1024-2048-2048-1024),
``cnn`` a small convolutional net on 3x32x32 inputs (0.39M, compute-bound), ``tiny`` 85K (tests) and ``lm`` the
byte-level transformer of :mod:`gradcompress.testbed.lm` (0.47M). The families by size (the held-out cases of
``../shared/tools/heldout.py``): ``mlp:W`` (1024-W-W-1024), ``conv:C`` (the CNN's layout with C, 2C, 4C, 8C
channels; ``cnn`` is ``conv:32``) and ``transformer:D`` (the LM's transformer, width D, 2 blocks; ``lm`` is
``transformer:128``). A batch is random data drawn from a generator seeded by the rank: the same on every run,
different on every worker.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch
    import torch.nn as nn

MODELS = ("mlp", "mlp8m", "cnn", "tiny", "lm")
#: the families by size: ``family:size``
FAMILIES = ("mlp", "conv", "transformer")
#: the MLPs' layer widths
MLP_DIMS = {"mlp": (1024, 2048, 2048, 2048, 1024), "mlp8m": (1024, 2048, 2048, 1024)}


def kind(name: str) -> tuple[str, int | None]:
    """(``mlp``, ``conv``, ``transformer`` or ``tiny``; its size or None) of a model name, checked."""
    if name in MLP_DIMS:
        return "mlp", None
    if name in ("cnn", "lm", "tiny"):
        return {"cnn": "conv", "lm": "transformer", "tiny": "tiny"}[name], None
    family, _, size = name.partition(":")
    if family in FAMILIES and size.isdigit() and int(size) > 0 and (family != "transformer" or int(size) % 4 == 0):
        return family, int(size)
    raise ValueError(f"unknown model {name!r}; models: {', '.join(MODELS)}, or mlp:W, conv:C, transformer:D (a "
                     "positive size; D a multiple of 4)")


def checked(name: str) -> str:
    """``name`` if it is a model (argparse's type), else a clear error."""
    import argparse

    try:
        kind(name)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None
    return name


def build_model(name: str, seed: int = 0) -> nn.Module:
    """The benchmark model ``name`` (see the module's docstring), its weights from ``seed``."""
    import torch
    import torch.nn as nn

    family, size = kind(name)
    torch.manual_seed(seed)
    if family == "mlp":
        dims = MLP_DIMS[name] if size is None else (1024, size, size, 1024)
        layers = []
        for a, b in zip(dims, dims[1:]):
            layers += [nn.Linear(a, b), nn.ReLU()]
        return nn.Sequential(*layers[:-1])
    if family == "tiny":
        return nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 10))
    if family == "transformer":
        from .lm import WIDTH, ByteGPT

        return ByteGPT(width=size or WIDTH)
    c = size or 32
    return nn.Sequential(
        nn.Conv2d(3, c, 3, padding=1), nn.ReLU(),
        nn.Conv2d(c, 2 * c, 3, stride=2, padding=1), nn.ReLU(),
        nn.Conv2d(2 * c, 4 * c, 3, stride=2, padding=1), nn.ReLU(),
        nn.Conv2d(4 * c, 8 * c, 3, stride=2, padding=1), nn.ReLU(),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8 * c, 10))


def model_shapes(name: str) -> list[tuple[int, ...]]:
    """Parameter shapes of a benchmark model, in model order (what ``plan --model`` uses)."""
    return [tuple(p.shape) for p in build_model(name).parameters()]


def batch(name: str, batch_size: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(inputs, targets) of rank ``rank``: the same every time it is asked for."""
    import torch

    family, _ = kind(name)
    g = torch.Generator().manual_seed(1000 + rank)
    if family == "mlp":
        return torch.randn(batch_size, 1024, generator=g), torch.randn(batch_size, 1024, generator=g)
    if family == "tiny":
        return torch.randn(batch_size, 64, generator=g), torch.randint(0, 10, (batch_size,), generator=g)
    if family == "transformer":
        from .lm import CONTEXT

        data = torch.randint(0, 256, (batch_size // 2 or 1, CONTEXT + 1), generator=g)
        return data[:, :-1], data[:, 1:]
    return torch.randn(batch_size, 3, 32, 32, generator=g), torch.randint(0, 10, (batch_size,), generator=g)


def loss(name: str, out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """The model's training loss: cross-entropy (transformers: per byte), mean squared error for the MLPs."""
    import torch.nn.functional as F

    family, _ = kind(name)
    if family == "transformer":
        return F.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1))
    return F.mse_loss(out, y) if family == "mlp" else F.cross_entropy(out, y)


__all__ = ["FAMILIES", "MLP_DIMS", "MODELS", "batch", "build_model", "checked", "kind", "loss", "model_shapes"]
