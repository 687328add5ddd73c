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
  to see how a scheme's gap to DDP moves with the model's size. Any other shape is spelt
  ``"layers=L,width=W,context=C"`` (:func:`shape`; what is left out is the small model's), and the text may be
  ``stdlib-docstrings`` or ``licenses`` (:data:`TEXTS`): held-out cases for a rule that must transfer
  (``../shared/tools/heldout.py --kind lm``).
* Training: every worker draws its own random windows of the training split (seeded by
  rank); AdamW (lr 3e-3, weight decay 0.01, betas 0.9/0.95) with cosine decay to 10 %;
  the validation loss is the mean cross-entropy (nats per byte) over fixed windows that
  cover the validation split.
"""

from __future__ import annotations

import ast
import dataclasses
import math
import sysconfig
from pathlib import Path
from typing import cast

import torch
import torch.nn as nn

CONTEXT, WIDTH, HEADS, LAYERS, VOCAB = 64, 128, 4, 2, 256
#: the model sizes of ``make_model``: name -> (blocks, width); 4 heads in both
SIZES = {"small": (LAYERS, WIDTH), "large": (4, 256)}
LR, WEIGHT_DECAY, BETAS = 3e-3, 0.01, (0.9, 0.95)


@dataclasses.dataclass(frozen=True)
class Shape:
    """The model's blocks, width (4 heads) and context (bytes a window holds)."""

    layers: int = LAYERS
    width: int = WIDTH
    context: int = CONTEXT


def shape(size: str) -> Shape:
    """A size of :data:`SIZES` (``small``, ``large``) or ``"layers=L,width=W,context=C"`` (each optional: the small
    model's otherwise; width a multiple of the 4 heads); ``ValueError`` naming what is allowed otherwise."""
    if size in SIZES:
        layers, width = SIZES[size]
        return Shape(layers, width)
    fields: dict[str, int] = {}
    for item in filter(None, size.split(",")):
        key, _, value = item.partition("=")
        if key not in ("layers", "width", "context") or not value.isdigit() or int(value) < 1 or key in fields:
            raise ValueError(f"unknown lm model size {size!r}; sizes: {', '.join(SIZES)}, or "
                             "'layers=L,width=W,context=C' (positive integers, each at most once)")
        fields[key] = int(value)
    if not fields:
        raise ValueError(f"unknown lm model size {size!r}; sizes: {', '.join(SIZES)}, or 'layers=L,width=W,context=C'")
    out = Shape(**fields)
    if out.width % HEADS:
        raise ValueError(f"lm model size {size!r}: the width must be a multiple of the {HEADS} heads")
    return out


#: the texts of ``load_text``: Python's documentation (the default), the standard library's docstrings, the
#: license texts of the installed packages (what this machine has installed: it differs between machines)
TEXTS = ("python-docs", "stdlib-docstrings", "licenses")


def _python_docs() -> str:
    import pydoc_data.topics as topics

    return "\n\n".join(topics.topics[k] for k in sorted(topics.topics))


def _stdlib_docstrings() -> str:
    """The docstrings of the standard library's top-level modules, their classes and functions, in file order."""
    found = []
    for path in sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py")):
        try:
            tree = ast.parse(path.read_text(encoding="utf-8"))
        except (SyntaxError, UnicodeDecodeError, ValueError):
            continue
        found += [doc for node in ast.walk(tree)
                  if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
                  and (doc := ast.get_docstring(node))]
    return "\n\n".join(found)


def _licenses() -> str:
    """The license files of the installed distributions (every one Python can import, a virtual environment's
    system packages too), each text once, in the order of the distributions' names."""
    from importlib import metadata

    seen, texts = set(), []
    for dist in sorted(metadata.distributions(), key=lambda d: (d.metadata["Name"] or "").lower()):
        for file in sorted(dist.files or [], key=str):
            if file.name.upper().startswith(("LICENSE", "LICENCE", "COPYING", "NOTICE")):
                try:
                    text = file.read_text(encoding="utf-8")
                except (OSError, UnicodeDecodeError):
                    continue
                if text and text not in seen:
                    seen.add(text)
                    texts.append(text)
    return "\n\n".join(texts)


def load_text(val_fraction: float = 0.1, text: str = "python-docs") -> dict[str, torch.Tensor]:
    """The bytes of ``text`` (one of :data:`TEXTS`) as uint8 tensors: ``train`` and ``val`` (the last
    ``val_fraction``)."""
    readers = {"python-docs": _python_docs, "stdlib-docstrings": _stdlib_docstrings, "licenses": _licenses}
    if text not in readers:
        raise ValueError(f"unknown lm text {text!r}; texts: {', '.join(TEXTS)}")
    data = torch.frombuffer(bytearray(readers[text]().encode("utf-8")), dtype=torch.uint8).clone()
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
    """The task's model of ``size`` (:func:`shape`: a key of :data:`SIZES` or ``"layers=L,width=W,context=C"``),
    its weights drawn from ``seed``."""
    s = shape(size)
    torch.manual_seed(seed)
    return ByteGPT(context=s.context, width=s.width, layers=s.layers)


def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1))


class Windows:
    """This worker's random training windows: (input bytes, next bytes), ``batch_size`` x ``context``."""

    def __init__(self, data: torch.Tensor, rank: int, batch_size: int, seed: int, context: int = CONTEXT):
        self.data = data.long()
        self.batch_size, self.context = batch_size, context
        self.gen = torch.Generator().manual_seed(seed * 1000 + rank + 1)

    def next(self) -> tuple[torch.Tensor, torch.Tensor]:
        starts = torch.randint(0, len(self.data) - self.context - 1, (self.batch_size,), generator=self.gen)
        idx = starts[:, None] + torch.arange(self.context + 1)
        chunk = self.data[idx]
        return chunk[:, :-1], chunk[:, 1:]


@torch.no_grad()
def validation_loss(model: nn.Module, val: torch.Tensor, max_windows: int = 256) -> float:
    """Mean next-byte cross-entropy (nats) over non-overlapping windows of the validation split (windows of the
    model's context)."""
    was = model.training
    model.eval()
    data = val.long()
    context = int(cast(ByteGPT, model).pos.shape[0])
    n = min(max_windows, (len(data) - 1) // context)
    step = max(1, ((len(data) - 1) // context) // n)
    starts = torch.arange(n) * step * context
    idx = starts[:, None] + torch.arange(context + 1)
    chunk = data[idx]
    total = 0.0
    for part in chunk.split(64):
        total += loss_fn(model(part[:, :-1]), part[:, 1:]).item() * len(part)
    model.train(was)
    return total / n


def cosine(step: int, steps: int, floor: float = 0.1) -> float:
    """Cosine decay of the learning rate from 1 to ``floor`` over ``steps``."""
    return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * min(step, steps) / max(1, steps)))
