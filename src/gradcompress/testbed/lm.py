"""The language-model task (``--task lm`` of ``demo`` and ``train``, netbench's ``--model lm``): a small byte-level
causal transformer on real English text.

A task where compression can fail: trained with AdamW, where aggressive schemes that look
harmless on digits lose validation loss.

* Data: the text of Python's own documentation topics (``pydoc_data.topics``: the
  language reference and library chapters that ``help()`` shows; ~465 KB of English with
  code examples), shipped with every CPython, no download. Bytes (vocabulary 256); the
  last 10 % is the held-out validation split.
* Model: a GPT-style decoder, 2 blocks, width 128, 4 heads, context 64, pre-LayerNorm,
  learned positions, untied output layer: about 0.47M parameters (``size="small"``, the default);
  ``size="large"`` has 4 blocks of width 256 (4 heads of 64): about 3.3M parameters, 7x as many,
  to see how a scheme's gap to DDP moves with the model's size.
* Training: every worker draws its own random windows of the training split (seeded by
  rank); AdamW (lr 3e-3, weight decay 0.01, betas 0.9/0.95) with cosine decay to 10 %;
  the validation loss is the mean cross-entropy (nats per byte) over fixed windows that
  cover the validation split.
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn

CONTEXT, WIDTH, HEADS, LAYERS, VOCAB = 64, 128, 4, 2, 256
#: the model sizes of ``make_model``: name -> (blocks, width); 4 heads in both
SIZES = {"small": (LAYERS, WIDTH), "large": (4, 256)}
LR, WEIGHT_DECAY, BETAS = 3e-3, 0.01, (0.9, 0.95)


def load_text(val_fraction: float = 0.1) -> dict[str, torch.Tensor]:
    """The bytes of ``pydoc_data.topics`` as uint8 tensors: ``train`` and ``val`` (the last ``val_fraction``)."""
    import pydoc_data.topics as topics

    text = "\n\n".join(topics.topics[k] for k in sorted(topics.topics)).encode("utf-8")
    data = torch.frombuffer(bytearray(text), dtype=torch.uint8).clone()
    cut = int(len(data) * (1 - val_fraction))
    return {"train": data[:cut], "val": data[cut:]}


class Block(nn.Module):
    def __init__(self, width: int, heads: int):
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(c, dim=2)
        q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2) for z in (q, k, v))
        att = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(att.transpose(1, 2).reshape(b, t, c))
        return x + self.mlp(self.ln2(x))


class ByteGPT(nn.Module):
    """A small decoder-only transformer over bytes."""

    def __init__(self, context: int = CONTEXT, width: int = WIDTH, heads: int = HEADS, layers: int = LAYERS):
        super().__init__()
        self.tok = nn.Embedding(VOCAB, width)
        self.pos = nn.Parameter(torch.zeros(context, width))
        self.blocks = nn.Sequential(*[Block(width, heads) for _ in range(layers)])
        self.ln = nn.LayerNorm(width)
        self.head = nn.Linear(width, VOCAB, bias=False)
        nn.init.normal_(self.pos, std=0.02)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx) + self.pos[: idx.shape[1]]
        return self.head(self.ln(self.blocks(x)))


def make_model(seed: int = 0, size: str = "small") -> ByteGPT:
    """The task's model of ``size`` (a key of :data:`SIZES`), its weights drawn from ``seed``."""
    if size not in SIZES:
        raise ValueError(f"unknown lm model size {size!r}; sizes: {', '.join(SIZES)}")
    layers, width = SIZES[size]
    torch.manual_seed(seed)
    return ByteGPT(width=width, layers=layers)


def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1))


class Windows:
    """This worker's random training windows: (input bytes, next bytes), ``batch_size`` x ``CONTEXT``."""

    def __init__(self, data: torch.Tensor, rank: int, batch_size: int, seed: int):
        self.data = data.long()
        self.batch_size = batch_size
        self.gen = torch.Generator().manual_seed(seed * 1000 + rank + 1)

    def next(self) -> tuple[torch.Tensor, torch.Tensor]:
        starts = torch.randint(0, len(self.data) - CONTEXT - 1, (self.batch_size,), generator=self.gen)
        idx = starts[:, None] + torch.arange(CONTEXT + 1)
        chunk = self.data[idx]
        return chunk[:, :-1], chunk[:, 1:]


@torch.no_grad()
def validation_loss(model: nn.Module, val: torch.Tensor, max_windows: int = 256) -> float:
    """Mean next-byte cross-entropy (nats) over non-overlapping windows of the validation split."""
    was = model.training
    model.eval()
    data = val.long()
    n = min(max_windows, (len(data) - 1) // CONTEXT)
    step = max(1, ((len(data) - 1) // CONTEXT) // n)
    starts = torch.arange(n) * step * CONTEXT
    idx = starts[:, None] + torch.arange(CONTEXT + 1)
    chunk = data[idx]
    total = 0.0
    for part in chunk.split(64):
        total += loss_fn(model(part[:, :-1]), part[:, 1:]).item() * len(part)
    model.train(was)
    return total / n


def cosine(step: int, steps: int, floor: float = 0.1) -> float:
    """Cosine decay of the learning rate from 1 to ``floor`` over ``steps``."""
    return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * min(step, steps) / max(1, steps)))
