"""Muon for the hidden layers, AdamW for the rest, as one optimizer: :func:`muon`.

Muon (Jordan et al., 2024) steps a 2-D weight by the orthogonalised (Newton–Schulz) Nesterov momentum of its
gradient; embeddings, the output head, norms and biases are stepped by AdamW, as the Muon paper and Moonshot's
"Muon is Scalable for LLM Training" (Liu et al., 2025) prescribe. MuLoCo (Thérien et al., 2025) uses it as
DiLoCo's inner optimizer: its updates make the outer deltas easy to compress (2-bit with error feedback).

Defaults (each an argument): Moonshot's recipe, so that one learning rate serves both parts: Muon's update is
scaled to AdamW's RMS (``adjust_lr_fn="match_rms_adamw"``: ``0.2 * sqrt(max(A, B))``), decoupled weight decay 0.1
on both, AdamW betas (0.9, 0.95); Muon's momentum 0.95 with Nesterov and 5 Newton–Schulz steps are Jordan's.
``lr`` (Muon's) defaults to ``adamw_lr``, and ``adamw_lr`` to 1e-3 (AdamW's own default).

Which parameters are Muon's: the weight of every ``nn.Linear`` except the output head (by default the last
``nn.Linear`` of ``model.modules()``, or the modules named in ``head``) and except a weight shared with an
``nn.Embedding`` (tied embeddings). Everything else (embeddings, positional tables, norms, biases, convolutions:
torch's Muon takes 2-D weights only) is AdamW's.

The Newton–Schulz iterations run in bfloat16 on CUDA (as torch's Muon always does) and in float32 elsewhere:
bfloat16 matrix products on a CPU without bfloat16 units were 14x slower than float32 ones on our machine (1.0 s
against 73 ms per step for the LM task's 8 hidden matrices); ``ns_dtype`` chooses.

What it is to the rest of PyTorch: one ``torch.optim.Optimizer`` whose ``param_groups`` are the Muon groups then
the AdamW groups (each group's ``"optimizer"`` says which): LR schedulers scale both, ``state_dict`` /
``load_state_dict`` save and restore both, ``zero_grad`` clears both. It communicates nothing itself: use it under
DDP, a compressed hook or as :class:`~gradcompress.optim.DiLoCo`'s inner optimizer. On FSDP2 shards (DTensor
parameters) the Newton–Schulz iteration runs on the whole matrix: each rank all-gathers it over its mesh
(``full_tensor()``, per Muon matrix and step) and keeps its own shard of the result, bit for bit the unsharded
update.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable

import torch
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor

#: Muon's update scaled to AdamW's RMS (Moonshot): one learning rate for both parts
ADJUST_LR = "match_rms_adamw"
WEIGHT_DECAY = 0.1
MOMENTUM = 0.95
ADAMW_BETAS = (0.9, 0.95)
ADAMW_LR = 1e-3


def split_parameters(model: nn.Module, head: str | Iterable[str] | None = None) -> tuple[list[str], list[str]]:
    """(names of Muon's parameters, names of AdamW's), in ``model.named_parameters()`` order. ``head``: the name
    of the output head module, or several names (default: the last ``nn.Linear``)."""
    linears = [(name, m) for name, m in model.named_modules() if isinstance(m, nn.Linear)]
    heads = {linears[-1][0]} if head is None and linears else ({head} if isinstance(head, str) else set(head or ()))
    unknown = heads - {name for name, _ in model.named_modules()}
    if unknown:
        raise ValueError(f"muon: head={sorted(unknown)} names no module of the model")
    embedded = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    hidden = {id(m.weight) for name, m in linears
              if name not in heads and m.weight.dim() == 2 and id(m.weight) not in embedded}
    muon_names: list[str] = []
    adamw_names: list[str] = []
    for name, p in model.named_parameters():
        if p.requires_grad:
            (muon_names if id(p) in hidden else adamw_names).append(name)
    return muon_names, adamw_names


def orthogonalise(update: torch.Tensor, coefficients: tuple, steps: int, eps: float,
                  dtype: torch.dtype) -> torch.Tensor:
    """torch's quintic Newton–Schulz iteration (``torch.optim.Muon``'s, operation for operation) in ``dtype``."""
    if isinstance(update, DTensor):  # a shard (FSDP2): the iteration needs the whole matrix
        return _orthogonalise_sharded(update, coefficients, steps, eps, dtype)
    a, b, c = coefficients
    x = update.to(dtype)
    tall = update.size(0) > update.size(1)
    if tall:
        x = x.T
    x.div_(x.norm().clamp(min=eps))
    for _ in range(steps):
        gram = x @ x.T
        x = torch.addmm(x, torch.addmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    return x.T if tall else x


def _orthogonalise_sharded(update: DTensor, coefficients: tuple, steps: int, eps: float, dtype) -> DTensor:
    """A sharded (DTensor, FSDP2) update orthogonalised whole: every rank of its mesh all-gathers the matrix
    (``full_tensor()``, sent over the shard group: the matrix, per Muon parameter and step), runs the iteration on
    it and keeps its own shard (cut locally, nothing more sent). Bit for bit the unsharded model's update; each rank
    repeats the whole iteration (the compute of one unsharded Muon step per rank)."""
    whole = orthogonalise(update.full_tensor(), coefficients, steps, eps, dtype)
    return distribute_tensor(whole, update.device_mesh, update.placements, src_data_rank=None)


class _Muon(torch.optim.Muon):
    """``torch.optim.Muon`` with the Newton–Schulz iterations in ``ns_dtype`` (None: bfloat16 on CUDA, torch's own
    choice, float32 elsewhere); the same update rule, state (``momentum_buffer``) and options."""

    def __init__(self, params, ns_dtype=None, **options):
        super().__init__(params, **options)
        self.ns_dtype = ns_dtype

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            lr, decay, momentum = float(group["lr"]), group["weight_decay"], group["momentum"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if "momentum_buffer" not in state:
                    state["momentum_buffer"] = torch.zeros_like(p.grad, memory_format=torch.preserve_format)
                buf = state["momentum_buffer"]
                buf.lerp_(p.grad, 1 - momentum)
                update = p.grad.lerp(buf, momentum) if group["nesterov"] else buf
                dtype = self.ns_dtype or (torch.bfloat16 if p.is_cuda else torch.float32)
                update = orthogonalise(update, group["ns_coefficients"], group["ns_steps"], group["eps"], dtype)
                p.mul_(1 - lr * decay)
                p.add_(update, alpha=-lr * _rms_ratio(group["adjust_lr_fn"], p.shape))


def _rms_ratio(adjust_lr_fn: str | None, shape) -> float:
    """Muon's learning-rate scale for a weight of ``shape`` (torch's ``adjust_lr_fn`` rules)."""
    rows, cols = shape[:2]
    if adjust_lr_fn in (None, "original"):
        return math.sqrt(max(1, rows / cols))
    return 0.2 * math.sqrt(max(rows, cols)) if adjust_lr_fn == "match_rms_adamw" else 1.0


class Muon(torch.optim.Optimizer):
    """Muon on the hidden 2-D weights and AdamW on the rest as one optimizer (build it with :func:`muon`).

    It communicates nothing itself (use it under DDP, a compressed hook, or as DiLoCo's inner optimizer: MuLoCo).
    Muon: `Jordan et al., 2024 <https://kellerjordan.github.io/posts/muon/>`_; the AdamW-matched update scale and
    weight decay: `Liu et al., 2025 (Moonlight) <https://arxiv.org/abs/2502.16982>`_.

    Args:
        muon_params: the parameters Muon steps (2-D weights; torch's ``Muon`` refuses others).
        adamw_params: the parameters AdamW steps.
        lr, adamw_lr, weight_decay, adamw_weight_decay, momentum, nesterov, ns_steps, adjust_lr_fn, betas, eps,
            ns_dtype: as in :func:`muon` (here all given, no defaults).

    Raises:
        ValueError: both lists empty (no trainable parameter), or an option torch's ``Muon``/``AdamW`` refuses.

    Example::

        >>> import torch
        >>> from gradcompress.optim import Muon
        >>> hidden, head = torch.nn.Linear(8, 8), torch.nn.Linear(8, 2)
        >>> opt = Muon([hidden.weight], [hidden.bias, *head.parameters()], lr=1e-3, adamw_lr=1e-3,
        ...            weight_decay=0.1, adamw_weight_decay=0.1, momentum=0.95, nesterov=True, ns_steps=5,
        ...            adjust_lr_fn="match_rms_adamw", betas=(0.9, 0.95), eps=1e-8)
        >>> [g["optimizer"] for g in opt.param_groups]     # param_groups: Muon's, then AdamW's
        ['muon', 'adamw']
    """

    def __init__(self, muon_params: list, adamw_params: list, *, lr: float, adamw_lr: float, weight_decay: float,
                 adamw_weight_decay: float, momentum: float, nesterov: bool, ns_steps: int, adjust_lr_fn: str | None,
                 betas: tuple, eps: float, ns_dtype: torch.dtype | None = None) -> None:
        groups = []
        if muon_params:
            groups.append({"params": muon_params, "lr": lr, "weight_decay": weight_decay, "momentum": momentum,
                           "nesterov": nesterov, "ns_steps": ns_steps, "adjust_lr_fn": adjust_lr_fn,
                           "optimizer": "muon"})
        if adamw_params:
            groups.append({"params": adamw_params, "lr": adamw_lr, "weight_decay": adamw_weight_decay,
                           "betas": betas, "eps": eps, "optimizer": "adamw"})
        if not groups:
            raise ValueError("muon: the model has no trainable parameters")
        super().__init__(groups, {})
        self.ns_dtype = ns_dtype
        self._link()

    def _link(self) -> None:
        """Build the two parts on this optimizer's own group dicts and state (again after ``load_state_dict``)."""
        def part(kind, make):
            groups = [g for g in self.param_groups if g["optimizer"] == kind]
            if not groups:
                return None
            opt = make([dict(g) for g in groups])  # validates and fills the part's own defaults
            for given, filled in zip(groups, opt.param_groups):
                for k, v in filled.items():
                    given.setdefault(k, v)
            opt.param_groups, opt.state = groups, self.state  # step on the shared dicts and state
            return opt

        self._muon = part("muon", lambda g: _Muon(g, ns_dtype=self.ns_dtype))
        self._adamw = part("adamw", lambda g: torch.optim.AdamW(g))

    def __setstate__(self, state: dict) -> None:
        super().__setstate__(state)
        if "param_groups" in state:
            self._link()

    # ignore[override] below: torch.optim.Optimizer.step is overloaded (None -> None, a closure -> float)
    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        """One step of both parts (``closure`` is evaluated once, with gradients enabled)."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for part in (self._muon, self._adamw):
            if part is not None:
                part.step()
        return loss


def muon(model: nn.Module, lr: float | None = None, adamw_lr: float | None = None, *,
         weight_decay: float = WEIGHT_DECAY, adamw_weight_decay: float | None = None, momentum: float = MOMENTUM,
         nesterov: bool = True, ns_steps: int = 5, adjust_lr_fn: str | None = ADJUST_LR,
         betas: tuple = ADAMW_BETAS, eps: float = 1e-8, head: str | Iterable[str] | None = None,
         ns_dtype: torch.dtype | None = None) -> Muon:
    """One optimizer: Muon on ``model``'s hidden 2-D weights, AdamW on the rest (module docstring: which is which).

    Sends nothing (see :class:`Muon`). Muon: `Jordan et al., 2024 <https://kellerjordan.github.io/posts/muon/>`_;
    defaults: Moonlight's recipe, `Liu et al., 2025 <https://arxiv.org/abs/2502.16982>`_.

    Args:
        model: the ``nn.Module`` whose trainable parameters it steps.
        lr: Muon's learning rate, >= 0 (default None: ``adamw_lr``, right with ``"match_rms_adamw"``; with
            ``adjust_lr_fn="original"``, Jordan's scaling, use Muon's own, e.g. 0.02).
        adamw_lr: AdamW's learning rate, >= 0 (default None: 1e-3).
        weight_decay: decoupled weight decay of both parts, >= 0 (default 0.1).
        adamw_weight_decay: AdamW's own weight decay (default None: ``weight_decay``).
        momentum, nesterov, ns_steps: Muon's momentum (0.95), Nesterov (True), Newton–Schulz steps (5).
        adjust_lr_fn: ``"match_rms_adamw"`` (default: the update at AdamW's RMS), ``"original"`` or None.
        betas, eps: AdamW's (default (0.9, 0.95) and 1e-8).
        head: the name of the output module that stays with AdamW, or several (default: the last ``nn.Linear``).
        ns_dtype: the Newton–Schulz dtype: None (bfloat16 on CUDA, float32 elsewhere) or a floating dtype.

    Returns:
        A :class:`Muon` (one ``torch.optim.Optimizer``: LR schedulers, ``state_dict`` and ``zero_grad`` see both).

    Raises:
        TypeError: ``model`` is not an ``nn.Module``.
        ValueError: a negative learning rate or weight decay, a bad ``ns_dtype``, a ``head`` that names no module.

    Example::

        >>> import torch
        >>> from gradcompress.optim import muon
        >>> model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))
        >>> opt = muon(model, adamw_lr=1e-3)
        >>> model(torch.randn(4, 8)).sum().backward(); opt.step()
        >>> [len(g["params"]) for g in opt.param_groups]   # Muon: the hidden weight; AdamW: the biases and head
        [1, 3]
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"muon: expects the model (an nn.Module), got {type(model).__name__}: it sorts the "
                        "parameters by the layer they belong to")
    adamw_lr = ADAMW_LR if adamw_lr is None else adamw_lr
    if ns_dtype not in (None, torch.float32, torch.float64, torch.bfloat16, torch.float16):
        raise ValueError(f"muon: ns_dtype must be None (bfloat16 on CUDA, float32 elsewhere) or a torch floating "
                         f"dtype, got {ns_dtype!r}")
    for name, value in (("adamw_lr", adamw_lr), ("lr", lr), ("weight_decay", weight_decay)):
        if value is None:
            continue
        if not value >= 0:
            raise ValueError(f"muon: {name} must be a number >= 0, got {value!r}")
    lr = adamw_lr if lr is None else lr
    muon_names, adamw_names = split_parameters(model, head)
    params = dict(model.named_parameters())
    return Muon([params[n] for n in muon_names], [params[n] for n in adamw_names], lr=lr, adamw_lr=adamw_lr,
                weight_decay=weight_decay,
                adamw_weight_decay=weight_decay if adamw_weight_decay is None else adamw_weight_decay,
                momentum=momentum, nesterov=nesterov, ns_steps=ns_steps, adjust_lr_fn=adjust_lr_fn, betas=betas,
                eps=eps, ns_dtype=ns_dtype)
