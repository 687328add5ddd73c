"""The benchmark models of ``gradcompress netbench`` (and of ``plan --model``), each with its fixed batches and loss.

``mlp`` 12.6M parameters (1024-2048-2048-2048-1024, communication-bound), ``mlp8m`` 8.4M (1024-2048-2048-1024),
``cnn`` a small convolutional net on 3x32x32 inputs (0.39M, compute-bound), ``tiny`` 85K (tests) and ``lm`` the
byte-level transformer of :mod:`gradcompress.testbed.lm` (0.47M). A batch is random data drawn from a generator
seeded by the rank: the same on every run, different on every worker.
"""

from __future__ import annotations

MODELS = ("mlp", "mlp8m", "cnn", "tiny", "lm")
#: the MLPs' layer widths
MLP_DIMS = {"mlp": (1024, 2048, 2048, 2048, 1024), "mlp8m": (1024, 2048, 2048, 1024)}


def build_model(name: str, seed: int = 0):
    """The benchmark models: ``mlp`` 12.6M parameters (1024-2048-2048-2048-1024, communication-bound), ``mlp8m``
    8.4M (1024-2048-2048-1024),
    ``cnn`` a small convolutional net on 3x32x32 inputs (0.39M, compute-bound), ``tiny`` 85K (tests)."""
    import torch
    import torch.nn as nn

    torch.manual_seed(seed)
    if name in MLP_DIMS:
        dims = MLP_DIMS[name]
        layers = []
        for a, b in zip(dims, dims[1:]):
            layers += [nn.Linear(a, b), nn.ReLU()]
        return nn.Sequential(*layers[:-1])
    if name == "tiny":
        return nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 10))
    if name == "lm":
        from .lm import make_model

        return make_model(seed)
    if name == "cnn":
        return nn.Sequential(
            nn.Conv2d(3, 32, 3, padding=1), nn.ReLU(),
            nn.Conv2d(32, 64, 3, stride=2, padding=1), nn.ReLU(),
            nn.Conv2d(64, 128, 3, stride=2, padding=1), nn.ReLU(),
            nn.Conv2d(128, 256, 3, stride=2, padding=1), nn.ReLU(),
            nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(256, 10))
    raise ValueError(f"unknown model {name!r}; models: {', '.join(MODELS)}")


def model_shapes(name: str) -> list[tuple[int, ...]]:
    """Parameter shapes of a benchmark model, in model order (what ``plan --model`` uses)."""
    return [tuple(p.shape) for p in build_model(name).parameters()]


def batch(name: str, batch_size: int, rank: int):
    """(inputs, targets) of rank ``rank``: the same every time it is asked for."""
    import torch

    g = torch.Generator().manual_seed(1000 + rank)
    if name in MLP_DIMS:
        return torch.randn(batch_size, 1024, generator=g), torch.randn(batch_size, 1024, generator=g)
    if name == "tiny":
        return torch.randn(batch_size, 64, generator=g), torch.randint(0, 10, (batch_size,), generator=g)
    if name == "lm":
        from .lm import CONTEXT

        data = torch.randint(0, 256, (batch_size // 2 or 1, CONTEXT + 1), generator=g)
        return data[:, :-1], data[:, 1:]
    return torch.randn(batch_size, 3, 32, 32, generator=g), torch.randint(0, 10, (batch_size,), generator=g)


def loss(name: str, out, y):
    """The model's training loss: cross-entropy (lm: per byte), mean squared error for the MLPs."""
    import torch.nn.functional as F

    if name == "lm":
        return F.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1))
    return F.mse_loss(out, y) if name in MLP_DIMS else F.cross_entropy(out, y)


__all__ = ["MLP_DIMS", "MODELS", "batch", "build_model", "loss", "model_shapes"]
