"""DeMo: decoupled momentum optimization (Peng, Quesnelle, Kingma, 2024, arXiv 2411.19870).

Each worker keeps its own momentum and exchanges only its fast-moving part::

    m  <- beta * m + g                      (local gradient, local momentum; beta = momentum_decay)
    q  =  top-k DCT coefficients of m, per chunk          (the ``dct`` codec: what is sent)
    m  <- m - idct(q)                       (what was sent leaves the momentum: it acts as error feedback)
    u  =  idct(mean over workers of q)      (every worker's coefficients added in DCT space, one inverse DCT)
    p  <- p * (1 - lr * weight_decay) - lr * sign(u)      (``sign=False``: - lr * u)

Chunks (:mod:`gradcompress.codecs.dct`): a matrix whose dims are multiples of ``chunk`` (viewed as
``shape[0] x rest``) is cut into ``chunk x chunk`` blocks with a 2-D DCT each, as in the paper; every other
tensor (biases, norms, odd shapes) into chunks of ``chunk`` values of its flattened form, 1-D DCT, zero-padded.

Paper defaults: momentum_decay 0.999, chunk 64, topk 32, sign on. The learning rate default, 4e-4, is the one the
paper's OLMo runs use (300M: ``learning_rate: 4.0e-4``, with warm-up and cosine decay); the reference optimizer
itself inherits ``torch.optim.SGD``'s. Differences from the reference implementation, on purpose: (1) the
reference adds ``lr * g`` to the momentum; here ``g`` (the same update under ``sign=True`` with a constant lr;
with ``sign=False`` the lr is applied once, at the step); (2) the reference averages each coefficient over the
workers that sent it (scatter "mean"); here the sum is divided by the world size, the exact mean of the workers'
reconstructions (the sign of each coefficient is the same, the magnitudes differ); (3) positions travel as uint8
/ int16 (the smallest type that holds a position in its chunk), not int64.
"""

from __future__ import annotations

import math
import numbers
from typing import TYPE_CHECKING, cast

import torch

from .. import topology as topology_mod
from ..collectives import LocalCollectives
from ..compressor import Compressor
from ..spec import make
from .exchanging import ExchangingOptimizer, refuse_manager

if TYPE_CHECKING:
    import torch.distributed as dist
    from torch.optim.optimizer import ParamsT
    from torchft.manager import Manager

    from ..codecs.base import Codec
    from ..config import Spec, TopologyOption

#: the learning rate of the paper's OLMo runs (sign updates)
DEFAULT_LR = 4e-4
#: parameter dtypes DeMo accepts (the momentum is float32 for all of them)
PARAM_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def _number(name: str, value, lo: float, hi: float | None = None, hi_open: bool = False) -> float:
    """``value`` as a float in [lo, hi] (or [lo, hi)), else a ``ValueError`` naming what is allowed."""
    ok = not isinstance(value, bool) and isinstance(value, numbers.Real) and math.isfinite(float(value))
    if ok:
        v = float(value)
        ok = v >= lo and (hi is None or (v < hi if hi_open else v <= hi))
    if not ok:
        upper = "inf)" if hi is None else f"{hi:g}{')' if hi_open else ']'}"
        raise ValueError(f"DeMo: {name} must be a number in [{lo:g}, {upper}, got {value!r}")
    return float(value)


def _check_group(lr, momentum_decay, weight_decay, sign) -> None:
    _number("lr", lr, 0.0)
    _number("momentum_decay", momentum_decay, 0.0, 1.0, hi_open=True)
    _number("weight_decay", weight_decay, 0.0)
    if not isinstance(sign, bool):
        raise ValueError(f"DeMo: sign must be True or False, got {sign!r}")


def demo_codec(chunk: int, topk: int, values: Spec | None = None) -> Codec:
    """The ``dct`` codec DeMo sends its momentum through; ``ValueError`` (naming DeMo) for bad options."""
    for name, v in (("chunk", chunk), ("topk", topk)):
        if isinstance(v, bool) or not isinstance(v, numbers.Integral) or v < 1:
            raise ValueError(f"DeMo: {name} must be an integer >= 1, got {v!r}")
    spec = {"name": "dct", "chunk": int(chunk), "topk": int(topk)}
    if values is not None:
        spec["values"] = values
    try:
        return make(spec)
    except (ValueError, TypeError) as err:
        raise ValueError(f"DeMo: {err}") from None


class DeMo(ExchangingOptimizer):
    """Decoupled momentum: each worker's momentum stays local; only its top-k DCT components per chunk travel.

    What is sent, per step and parameter: for each chunk, ``topk`` (position, value) pairs of the momentum's DCT,
    all-gathered (every worker receives every other's): ``(W-1) x blocks x k x (4 + 1 or 2)`` bytes per worker
    and step (float32 values; uint8 positions for 1-D chunks, int16 for 64 x 64 blocks). On a 64-divisible
    matrix with the defaults that is 192 bytes per 16 KB of float32 and worker, so against DDP's ring all-reduce
    (``2 (W-1)/W x 4 n``) about 170/W times fewer bytes (43x at 4 workers; vectors send half their coefficients,
    so a model's ratio is lower: 30.5x for the LM task's transformer at 4 workers); the bytes grow with W (a
    gather), so it pays most at few workers over slow links.

    Bias: the exchanged update is biased (top-k), but nothing is lost: what a worker did not send stays in its
    momentum and is sent later (the momentum is the error-feedback buffer; ``beta`` < 1 lets old residue fade).
    The workers' momenta differ (decoupled); the parameters do not: every worker applies the same decoded mean.
    With ``sign=True`` (the paper's) the step is signSGD on the mean of the extracted components, so ``lr`` is
    the per-coordinate step size (tune it like Adam's, not like SGD's). With ``topk`` at least the chunk's
    coefficient count (``chunk**2`` for 2-D blocks, ``chunk`` otherwise) everything is extracted every step,
    the momentum empties, and DeMo with ``sign=False`` is plain SGD (no momentum) on the exact mean gradient.

    When to use it: bandwidth-bound data parallelism (few workers, slow links) on transformer-like models, in
    place of AdamW; it keeps no second moment (memory: one float32 momentum per parameter).

    Use it like :class:`gradcompress.optim.OneBitAdam`: the bare model (not ``DistributedDataParallel``, or
    ``backward`` inside ``no_sync()``), identical initial parameters on every rank, every rank calls
    :meth:`step` together with gradients for the same parameters (a parameter whose ``.grad`` is None is
    skipped and must be None on every rank). The ``.grad`` tensors are left as they were::

        opt = DeMo(model.parameters(), lr=3e-3)          # momentum_decay=0.999, chunk=64, topk=32, sign=True
        for x, y in loader:
            opt.zero_grad(); loss_fn(model(x), y).backward(); opt.step()

    Args:
        params: parameters or groups (float32, float16, bfloat16; momentum float32). Groups may set ``lr``,
            ``momentum_decay``, ``weight_decay`` and ``sign``.
        lr: step size (>= 0); default 4e-4, the paper's OLMo runs'.
        momentum_decay: beta in [0, 1) (paper: 0.999).
        chunk: the chunk's side (paper: 64). topk: coefficients sent per chunk (paper: 32).
        sign: step with the sign of the mean (paper: True) or the mean itself.
        weight_decay: decoupled, ``p <- p (1 - lr weight_decay)`` before the step (paper's runs: 0).
        process_group: the group to average over (default: the world; none initialised: a single process).
        topology: ``"flat"`` (default) or anything :class:`gradcompress.Compressor` takes that resolves to a
            flat exchange. A hierarchical one (2+ nodes of 2+ workers) is refused at the first step: it would
            compress the node's summed momentum, not each worker's, so no worker could remove what it sent.
        values: optional codec for the kept values (``"bf16"``: 2 bytes instead of 4); default as they are.
        manager: a torchft ``Manager`` is refused (it exchanges inside ``step()``, after torchft's commit
            decision: :func:`gradcompress.optim.exchanging.refuse_manager`).

    Non-finite gradients: a step in which any rank's momentum would hold an Inf or NaN is skipped on every rank
    (read from the gathered coefficients, which every rank holds alike): parameters, momenta and step counts stay
    as they were; counted in ``stats()["skipped"]``. ``state_dict()`` holds, per parameter, ``step`` and
    ``momentum`` (this rank's: save one checkpoint per rank); resuming continues bit for bit.
    """

    def __init__(self, params: ParamsT, lr: float = DEFAULT_LR, *, momentum_decay: float = 0.999, chunk: int = 64,
                 topk: int = 32, sign: bool = True, weight_decay: float = 0.0,
                 process_group: dist.ProcessGroup | None = None, topology: TopologyOption = "flat",
                 values: Spec | None = None, manager: Manager | None = None) -> None:
        refuse_manager(type(self).__name__, manager)
        topology_mod.check_topology(topology, "none")
        _check_group(lr, momentum_decay, weight_decay, sign)
        self.codec = demo_codec(chunk, topk, values)
        defaults = dict(lr=lr, momentum_decay=momentum_decay, weight_decay=weight_decay, sign=sign)
        super().__init__(params, defaults)
        self.process_group, self.topology = process_group, topology
        self._compressor: Compressor | None = None
        self._local: LocalCollectives | None = None
        self._checked = False
        self._counters = {"steps": 0, "skipped": 0, "raw_bytes": 0, "seconds": 0.0}

    def add_param_group(self, param_group: dict) -> None:
        values = {k: param_group.get(k, self.defaults[k]) for k in ("lr", "momentum_decay", "weight_decay", "sign")}
        _check_group(**values)
        if "process_group" in param_group:
            raise ValueError("DeMo: process_group is an argument of the optimizer, not of a parameter group")
        super().add_param_group(param_group)
        for p in self.param_groups[-1]["params"]:
            if p.dtype not in PARAM_DTYPES:
                self.param_groups.pop()
                raise ValueError(f"DeMo: parameters must be float32, float16 or bfloat16; got one of dtype "
                                 f"{str(p.dtype).replace('torch.', '')}")

    # ------------------------------------------------------------------ public API
    def stats(self) -> dict:
        """Counters of this process since the optimizer was built (not saved in checkpoints).

        ``steps``: calls to :meth:`step` that exchanged something; ``skipped``: those skipped for a non-finite
        momentum; ``raw_bytes``: the exchanged momenta's float32 size, summed; ``wire_bytes``: bytes this rank
        transmitted (ring-counted, :mod:`gradcompress.collectives`: ``(W-1) x`` the payloads); ``ratio``: raw /
        wire; ``comm_seconds``; ``codec_seconds``: the rest of the time in :meth:`step`; ``inter_node_bytes`` /
        ``intra_node_bytes`` / ``topology``: the Compressor's.
        """
        return {"steps": self._counters["steps"], "skipped": self._counters["skipped"], **self._exchange_stats()}

    def payload_bytes(self) -> int:
        """Bytes one step's payloads of this rank take (every parameter with a gradient), by the codec's
        arithmetic: a step transmits ``(W-1)`` times this."""
        params = [p for g in self.param_groups for p in g["params"] if p.grad is not None]
        return sum(self.codec.payload_nbytes(p.numel(), tuple(p.shape)) for p in params)

    def load_state_dict(self, state_dict: dict) -> None:
        """Load a state dict; the momenta stay float32 (torch would cast them to the parameter's dtype)."""
        saved = {k: {n: v.clone() if isinstance(v, torch.Tensor) else v for n, v in s.items()}
                 for k, s in state_dict["state"].items()}
        super().load_state_dict(state_dict)
        ids = [i for g in state_dict["param_groups"] for i in g["params"]]
        params = [p for g in self.param_groups for p in g["params"]]
        for sid, p in zip(ids, params):
            if sid in saved:
                self.state[p] = {n: v.to(device=p.device, dtype=torch.float32) if n == "momentum" else v
                                 for n, v in saved[sid].items()}

    # ------------------------------------------------------------------ the step (ExchangingOptimizer.step)
    def _active(self) -> list:
        """(key, group, parameter, state) of every parameter with a gradient; key = position among all."""
        out, key = [], -1
        for group in self.param_groups:
            for p in group["params"]:
                key += 1
                if p.grad is None:
                    continue
                if p.grad.is_sparse:
                    raise RuntimeError("DeMo does not support sparse gradients")
                state = self.state[p]
                if "step" not in state:
                    state["step"] = torch.tensor(0.0)
                    state["momentum"] = torch.zeros(p.shape, dtype=torch.float32, device=p.device)
                out.append((key, group, p, state))
        return out

    def _exchange_and_update(self, step, loss):
        active = self._active()
        if not active:
            step.end()
            return loss
        self._counters["steps"] += 1
        self._counters["raw_bytes"] += 4 * sum(p.numel() for _, _, p, _ in active)
        momenta, residues = [], []
        for _, group, p, state in active:
            m = state["momentum"].mul(group["momentum_decay"]).add_(p.grad.detach().float())
            # what this rank sends is decode(encode(m)); the codec is deterministic, so the exchange's own
            # encode of m sends exactly this
            delivered = self.codec.decode(self.codec.encode(m))
            residues.append(m - delivered)
            momenta.append(m)
        step.drive([step.exchange([k for k, _, _, _ in active], momenta)])  # momenta now hold the mean
        if not step.end():  # some rank's momentum was non-finite: skip everywhere, nothing changes
            self._counters["skipped"] += 1
            return loss
        for (_, group, p, state), mean, residue in zip(active, momenta, residues):
            state["momentum"] = residue
            state["step"] += 1
            self._update(group, p, mean)
        return loss

    @staticmethod
    def _update(group: dict, p: torch.Tensor, mean: torch.Tensor) -> None:
        """p <- p (1 - lr wd) - lr sign(mean) (or - lr mean), in float32, written back in p's dtype."""
        lr, wd = group["lr"], group["weight_decay"]
        direction = mean.sign() if group["sign"] else mean
        p32 = p.detach().float() if p.dtype != torch.float32 else p
        if wd != 0:
            p32.mul_(1 - lr * wd)
        p32.add_(direction.view(p.shape), alpha=-lr)
        if p32 is not p:
            p.copy_(p32)

    def _make_compressor(self) -> Compressor:
        """The DCT codec's Compressor; the momentum is the error-feedback buffer: the Compressor keeps none of its
        own."""
        return Compressor(self.codec, process_group=self.process_group, error_feedback=False,
                          server_error_feedback=False, min_numel=0, topology=self.topology)

    def _check_layout(self, step) -> None:
        """A hierarchical exchange is refused: it would compress the node's summed momentum, not each worker's."""
        hierarchy = cast(Compressor, self._compressor).hierarchy
        if hierarchy is not None:
            step.abort()
            raise ValueError(f"DeMo: topology={self.topology!r} resolved to a hierarchical exchange "
                             f"({hierarchy.topology.text}); DeMo needs every worker's own momentum "
                             "components to travel (it removes what it sent): pass topology='flat'")

    def _group_text(self, group: dict) -> str:
        return (f"lr={group['lr']} momentum_decay={group['momentum_decay']} weight_decay={group['weight_decay']} "
                f"sign={group['sign']}")


__all__ = ["DEFAULT_LR", "DeMo", "demo_codec"]
