"""The stages composed around a codec, each with its own state, and their chain in one declared order.

A compressed tensor goes through, per parameter::

    grad -> clip -> momentum correction -> + worker residual -> codec -> collective
         -> (chunk owner: + server residual -> re-encode) -> decode -> averaged gradient

Each stage is a small frozen dataclass in the manner of optax's transformations: ``update(x, state) -> (x',
new_state)`` before the codec (a stage's state starts as None: nothing to initialise); the stages that remember
what compression delivered (error feedback: residual' = sent - delivered; masked momentum: u cleared where
something was delivered) have one more pure function for that. Nothing here mutates its inputs or keeps state
of its own.

:class:`Transforms` chains them (clip -> momentum correction -> worker error feedback) for one step: it reads the
committed states and writes the new ones through the step's :class:`~gradcompress.exchanges.context.Context`, so a
rollback is "do not commit" and no state can be forgotten. It also chooses, once, between the fused error feedback
(inside the codec's encode: the residual added and the new one written in the codec's pass) and the reference, and
owns the residual buffers (the one a commit replaced becomes the next new residual's home).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Hashable
from typing import TYPE_CHECKING, Protocol, cast

import torch

from .codecs.base import Aggregation, Codec, Payload, SizedEncode
from .codecs.fast import RESIDUAL_DTYPES
from .exchanges.layout import chunk_numel, decode_chunks, split_chunks

if TYPE_CHECKING:
    from .monitor import StepMonitor


class StepSlots(Protocol):
    """What the transforms read and write of their step's context (:class:`gradcompress.exchanges.context.Context`,
    whose module imports this one): the committed and new states by (slot, key), buffers, the step's monitor."""

    residual_dtype: torch.dtype
    owned: dict[Hashable, torch.Tensor]
    monitor: StepMonitor | None

    def old(self, slot: str, key: Hashable) -> torch.Tensor | None: ...

    def latest(self, slot: str, key: Hashable) -> torch.Tensor | None: ...

    def put(self, slot: str, key: Hashable, value: torch.Tensor) -> None: ...

    def spare(self, slot: str, key: Hashable, like: torch.Tensor) -> torch.Tensor | None: ...

    def new_residual(self, key: Hashable, like: torch.Tensor) -> torch.Tensor: ...

    def work(self, name: str, key: Hashable, like: torch.Tensor) -> torch.Tensor: ...


@dataclasses.dataclass(frozen=True)
class Clip:
    """DGC's local gradient clipping: scale x so that ||x|| <= clip / sqrt(world). No state."""

    clip: float
    world: int

    def update(self, x: torch.Tensor, state: None = None) -> tuple[torch.Tensor, None]:
        norm = torch.linalg.vector_norm(x)
        return x * (self.clip / (math.sqrt(self.world) * norm + 1e-12)).clamp(max=1.0), state


@dataclasses.dataclass(frozen=True)
class MomentumCorrection:
    """Momentum correction (DGC, Lin et al. 2018), for every codec.

    State u (the momentum buffer): ``u' = momentum * u + g`` and u' is what gets compressed
    (and error-fed), so the optimizer must run *without* momentum: compressing the
    momentum instead of the gradient keeps error-fed aggressive codecs stable where heavy
    optimizer momentum would amplify their delayed updates. ``masking`` (momentum factor
    masking) clears u at the coordinates that were delivered, so stale momentum does not push
    them again.
    """

    momentum: float
    masking: bool = False
    slot = "momentum"

    def update(self, g: torch.Tensor, u: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        u = g.clone() if u is None else u * self.momentum + g
        return u, u

    def masked(self, u: torch.Tensor, delivered: torch.Tensor) -> torch.Tensor:
        """u cleared where ``delivered`` (what this rank's compression sent) is nonzero."""
        return u.masked_fill(delivered.view(u.shape) != 0, 0)


@dataclasses.dataclass(frozen=True)
class ErrorFeedback:
    """Error feedback (Seide et al. 2014; Karimireddy et al. 2019): what compression dropped is
    added to the next input.

    ``update``: x' = x + residual. ``residual``: residual' = x' - delivered, where delivered is
    what this side's compression actually transmitted. The invariant the tests check:
    sum of inputs = sum of delivered + residual. Used on the worker side (per parameter)
    and on the chunk owner's side of the two-step reduce (per chunk of each parameter,
    ``server`` residuals), with ``dtype`` the residual's storage type.
    """

    dtype: torch.dtype = torch.float32

    def update(self, x: torch.Tensor, residual: torch.Tensor | None,
               out: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """x + residual (into ``out`` when given: a buffer of x's shape and dtype that aliases neither)."""
        if residual is None:
            return x, residual
        return (torch.add(x, residual.to(x.dtype), out=out) if out is not None else x + residual.to(x.dtype)), residual

    def residual(self, sent: torch.Tensor, delivered: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """The new residual, sent - delivered, in ``dtype`` (written into ``out`` when given: the same values)."""
        d = delivered.reshape(sent.shape).to(sent.dtype)
        if out is not None:
            return torch.sub(sent, d, out=out)
        return (sent - d).to(self.dtype)


def _fits(residual: torch.Tensor | None, x: torch.Tensor) -> torch.Tensor | None:
    """The committed residual if it has x's shape (else None: e.g. a checkpoint from another layout)."""
    return residual if residual is None or residual.shape == x.shape else None


class Transforms:
    """The chain of one step: ``clip`` -> ``momentum`` -> ``feedback`` (worker error feedback), each optional,
    and ``server`` (the chunk owner's error feedback); states through ``ctx``."""

    def __init__(self, ctx: StepSlots, clip: Clip | None, momentum: MomentumCorrection | None,
                 feedback: ErrorFeedback | None, server: ErrorFeedback | None) -> None:
        self.ctx, self.clip, self.momentum, self.feedback, self.server = ctx, clip, momentum, feedback, server
        self.masking = momentum is not None and momentum.masking
        self._fused = {a: self._fuses(a) for a in Aggregation}  # decided once per step

    # ---------------------------------------------------------------- before the codec
    def fuses(self, aggregation: Aggregation) -> bool:
        """Whether worker error feedback takes the fused path for ``aggregation`` (see :meth:`_fuses`)."""
        return self._fused[aggregation]

    def _fuses(self, aggregation: Aggregation) -> bool:
        """Whether worker error feedback takes the fused path: quantisers and sparsifiers (``REQUANTIZE``,
        ``GATHER``) run it inside the encode (``Codec.encode_feedback``: x + residual is never stored; float32 or
        bfloat16 residuals in the quantisers' kernel, the reference inside the codec otherwise); PowerSGD
        (``LOWRANK``) computes its float32 residual in place with one ``addmm_``. Not with momentum masking
        (it needs the delivered values): that takes the reference path."""
        dtypes = (torch.float32,) if aggregation is Aggregation.LOWRANK else RESIDUAL_DTYPES
        return (self.feedback is not None and aggregation is not Aggregation.SUM
                and self.feedback.dtype in dtypes and not self.masking)

    def dense(self, key: Hashable, g: torch.Tensor) -> torch.Tensor:
        """Momentum correction of a tensor that travels dense: g is replaced by u (in place)."""
        momentum = cast(MomentumCorrection, self.momentum)  # called only where the step has momentum correction
        u, state = momentum.update(g.detach().float(), self.ctx.old(momentum.slot, key))
        self.ctx.put(momentum.slot, key, state)
        g.copy_(u.view(g.shape))
        return g

    def input(self, key: Hashable, grad: torch.Tensor, private: bool = True, fused: bool = False) -> torch.Tensor:
        """What gets compressed: clip -> momentum correction -> + residual, float32 and contiguous
        (``private``: never the gradient's own storage; ``fused``: the residual is left for the encode,
        :meth:`encode_fed`, to add)."""
        ctx = self.ctx
        x = grad.detach().float().contiguous()
        if self.clip is not None:
            x, _ = self.clip.update(x)
        if self.momentum is not None:
            x, state = self.momentum.update(x, ctx.old(self.momentum.slot, key))
            ctx.put(self.momentum.slot, key, state)
        if ctx.monitor is not None:
            ctx.monitor.reference(key, x, grad)
        if self.feedback is not None and not fused:
            x = self._add_residual(key, x)
        if private and x.data_ptr() == grad.data_ptr():
            x = x.clone()  # the gradient is overwritten with the result while x may still be read
        return x

    def _add_residual(self, key: Hashable, x: torch.Tensor) -> torch.Tensor:
        """x + the committed residual, into a buffer of ours: the residual the last commit replaced (float32
        residuals; the new residual is then computed in place there) or a persistent workspace."""
        ctx = self.ctx
        residual = ctx.old("residual", key)
        if residual is None:
            return x
        in_place = residual.dtype == x.dtype
        buf = ctx.spare("residual", key, x) if in_place else None
        if buf is None:
            buf = torch.empty_like(x) if in_place else ctx.work("input", key, x)
        x, _ = cast(ErrorFeedback, self.feedback).update(x, residual, out=buf)  # called only with error feedback
        if in_place:
            ctx.owned[key] = x
        return x

    # ---------------------------------------------------------------- after the codec
    def delivered(self, key: Hashable, sent: torch.Tensor, delivered: Callable[[], torch.Tensor]) -> None:
        """Record what this rank's compression delivered for ``key``: the new residual and masked momentum.
        ``delivered`` is evaluated once, and only when some state needs it."""
        if self.feedback is None and not self.masking:
            return
        cache: list[torch.Tensor] = []

        def once() -> torch.Tensor:
            if not cache:
                cache.append(delivered())
            return cache[0]

        ctx = self.ctx
        if self.feedback is not None:  # in place where ``sent`` is our own buffer: nothing reads it after this
            out = sent if ctx.owned.get(key) is sent else ctx.spare("residual", key, sent)
            ctx.put("residual", key, self.feedback.residual(sent, once(), out=out))
        if self.masking:
            momentum = cast(MomentumCorrection, self.momentum)  # masking implies momentum correction
            u = cast(torch.Tensor, ctx.latest("momentum", key))  # put by input() earlier in the step
            ctx.put("momentum", key, momentum.masked(u, once()))

    def _own_copy(self, key: Hashable, sent: torch.Tensor) -> torch.Tensor:
        """``sent`` itself when it is this step's buffer, else a copy of it in the new residual's buffer."""
        out = sent if self.ctx.owned.get(key) is sent else self.ctx.new_residual(key, sent)
        if out is not sent:
            out.copy_(sent)
        return out

    def delivered_product(self, key: Hashable, sent: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
        """:meth:`delivered` of a low-rank delivery ``a @ b.T``: the new residual ``sent - a @ b.T`` computed in
        place by one ``addmm_`` (no n x m product materialised; the same values as the subtraction, which
        stays the path for masked momentum and residuals in another dtype)."""
        if not self.fuses(Aggregation.LOWRANK) or sent.dtype != torch.float32:
            return self.delivered(key, sent, lambda: a @ b.T)
        out = self._own_copy(key, sent)
        out.view(a.shape[0], b.shape[0]).addmm_(a, b.T, alpha=-1)
        self.ctx.put("residual", key, out)

    def delivered_sparse(self, codec: Codec, key: Hashable, sent: torch.Tensor, payload: Payload, world: int) -> bool:
        """:meth:`delivered` of random-k's mean part: the new residual ``sent - decode(payload) * world`` changes
        only at the k kept positions (elsewhere sent - 0 = sent, bit for bit), so it is written there only.
        False (the dense reference path) with masked momentum or a residual in another dtype."""
        if (not codec.keeps_positions or not payload.tensors or sent.dtype != torch.float32
                or not sent.is_contiguous() or self.ctx.residual_dtype != torch.float32
                or not self.fuses(Aggregation.GATHER)):  # the sparsifiers' switch: EF on, no masking
            return False
        out = self._own_copy(key, sent)
        idx, vals = codec.kept(payload)
        flat = out.view(-1)
        flat.index_copy_(0, idx, flat.index_select(0, idx) - vals * world)
        self.ctx.put("residual", key, out)
        return True

    def encode(self, codec: Codec, key: Hashable, x: torch.Tensor, seeds: list[int], parts: int,
               aggregation: Aggregation) -> list[Payload]:
        """``x`` in ``parts`` chunks (:func:`~gradcompress.exchanges.layout.split_chunks`'s, one seed each), each
        encoded, with worker error feedback fused into the encode when :meth:`fuses` says so, else through the
        reference (``delivered``: the decode of the chunks)."""
        if self.fuses(aggregation):
            return self.encode_fed(codec, key, x, seeds, parts)
        pieces = split_chunks(x.reshape(-1), parts) if parts > 1 else [x]
        payloads = [codec.encode(c, seed=s) for c, s in zip(pieces, seeds)]
        if parts > 1:
            self.delivered(key, x, lambda: decode_chunks(codec, payloads, x.numel(), x.device))
        else:
            self.delivered(key, x, lambda: codec.decode(payloads[0]).float())
        return payloads

    def encode_sized(self, codec: Codec, key: Hashable, x: torch.Tensor, seed: int) -> SizedEncode:
        """:meth:`encode` of ``x`` whole (one part, ``GATHER``) in two halves (:data:`~.codecs.base.SizedEncode`): the
        codec's payload sizes are read by the exchange with every other tensor's; the same payload and state."""
        if not self.fuses(Aggregation.GATHER):
            payload = yield from codec.encode_sized(x, seed=seed)
            self.delivered(key, x, lambda: codec.decode(payload).float())
            return payload
        residual = _fits(self.ctx.old("residual", key), x)
        out = self.ctx.new_residual(key, x)
        rs = None if residual is None else residual.reshape(-1)
        payload = yield from codec.encode_feedback_sized(x.reshape(-1), rs, seed=seed, out=out.view(-1))
        self.ctx.put("residual", key, out)
        return payload

    def encode_fed(self, codec: Codec, key: Hashable, x: torch.Tensor, seeds: list[int], parts: int) -> list[Payload]:
        """Worker error feedback fused into the encode: ``x`` + the committed residual cut into ``parts`` chunks,
        each encoded by ``Codec.encode_feedback``, whose new residual goes straight into the residual buffer of
        this step (the one the last commit replaced). The same payloads and residual as the reference, without
        materialising x + residual or a full decode."""
        residual = _fits(self.ctx.old("residual", key), x)
        out = self.ctx.new_residual(key, x)
        xs, outs = x.reshape(-1), out.view(-1)
        rs = None if residual is None else residual.reshape(-1)
        n = xs.numel()
        per = chunk_numel(n, parts) if parts > 1 else n
        payloads = []
        for j, seed in enumerate(seeds):
            lo, hi = min(n, j * per), min(n, (j + 1) * per)
            if hi - lo == per:
                payloads.append(codec.encode_feedback(xs[lo:hi], None if rs is None else rs[lo:hi], seed=seed,
                                                      out=outs[lo:hi]))
            else:
                payloads.append(_encode_padded(codec, xs, rs, outs, lo, hi, per, seed))
        self.ctx.put("residual", key, out)
        return payloads

    def encode_piece(self, codec: Codec, key: Hashable, x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor,
                     seed: int) -> None:
        """``x`` encoded into its place of a whole-group payload, with the worker error feedback fused when on."""
        if not self.fuses(Aggregation.REQUANTIZE):
            codec.encode_piece(x, None, None, codes, scales, seed)
            return
        residual = _fits(self.ctx.old("residual", key), x)
        out = self.ctx.new_residual(key, x)
        codec.encode_piece(x, residual, out, codes, scales, seed)
        self.ctx.put("residual", key, out)

    def server_encode(self, codec: Codec, key: Hashable, mean_chunk: torch.Tensor, seed: int) -> Payload:
        """The chunk owner's re-encode in the two-step reduce, with server error feedback when on."""
        if self.server is None:
            return codec.encode(mean_chunk, seed=seed)
        residual = self.ctx.old("server_residual", key)
        if residual is not None and residual.numel() != mean_chunk.numel():
            residual = None  # a checkpoint from another world size: restart this residual
        y, _ = self.server.update(mean_chunk, residual)
        payload = codec.encode(y, seed=seed)
        out = self.ctx.spare("server_residual", key, y)
        self.ctx.put("server_residual", key, self.server.residual(y, codec.decode(payload).float(), out=out))
        return payload


def _encode_padded(codec: Codec, xs: torch.Tensor, rs: torch.Tensor | None, outs: torch.Tensor, lo: int, hi: int,
                   per: int, seed: int) -> Payload:
    """The last chunk (and any beyond n) zero-padded to the chunk size, as ``split_chunks`` pads, encoded with
    fused error feedback; its new residual written back into ``outs[lo:hi]``."""
    xp = torch.zeros(per, dtype=xs.dtype, device=xs.device)
    xp[: hi - lo] = xs[lo:hi]
    rp = None
    if rs is not None:
        rp = torch.zeros(per, dtype=rs.dtype, device=rs.device)
        rp[: hi - lo] = rs[lo:hi]
    tmp = torch.empty(per, dtype=outs.dtype, device=xs.device)
    payload = codec.encode_feedback(xp, rp, seed=seed, out=tmp)
    outs[lo:hi] = tmp[: hi - lo]
    return payload


__all__ = ["Clip", "ErrorFeedback", "MomentumCorrection", "Transforms"]
