"""``Config``: what a spec string and the Compressor's keywords become, resolved and validated once, frozen.

The spec is read by :func:`gradcompress.spec.parse_compressor` (the one grammar: a spec string or dict may carry
Compressor options by name, ``"topk:ratio=0.01,momentum=0.9"``; the same option given there and as a keyword is a
``ValueError``) into a :class:`~gradcompress.spec.Scheme`; this module takes that value, fills in the defaults and
checks every option's value. :meth:`Config.text` is the one line every rank compares and every checkpoint records.
"""

from __future__ import annotations

import dataclasses
import enum
import warnings
from typing import TYPE_CHECKING, Any, TypeAlias

import torch

from . import topology as topology_mod
from .codecs.base import Codec
from .schedule import SCHEDULES
from .spec import Auto, Scheme, is_auto, parse_compressor
from .transforms import Clip, ErrorFeedback, MomentumCorrection, Transforms

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

RESIDUAL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
#: the Compressor's options and their defaults (each may also be given in the spec string, by name)
DEFAULTS = dict(error_feedback="auto", server_error_feedback=False, momentum=0.0, warmup_steps=0, min_numel=1024,
                seed=0, schedule=None, ramp_steps=0, residual_dtype=torch.float32, monitor_every=0, topology="auto",
                intra_node="none")
#: what ``compressor.NAME`` reads from its Config (:class:`gradcompress.Compressor`): the options, the codec, auto's
READABLE = frozenset(DEFAULTS) | {"codec", "auto"}


class Unset(enum.Enum):
    """The type of :data:`UNSET`."""

    UNSET = "unset"


#: the default of the Compressor's option keywords: the option was not given as a keyword
UNSET = Unset.UNSET
#: what ``Compressor(spec)`` takes: a spec string, a dict of one, or a codec
Spec: TypeAlias = "str | dict[str, Any] | Codec"
#: what the ``topology`` option takes (:func:`gradcompress.topology.check_topology`): ``"auto"``, ``"flat"``, workers per
#: node, a 2-D DeviceMesh or a :class:`~gradcompress.topology.Topology`
TopologyOption: TypeAlias = "str | int | topology_mod.Topology | DeviceMesh"


def _check_int(name: str, value: Any, lo: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < lo:
        raise ValueError(f"Compressor: {name} must be an integer >= {lo}, got {value!r}")
    return value


def _check_bool(name: str, value: Any, auto: bool = False) -> Any:
    if isinstance(value, bool) or (auto and value == "auto"):
        return value
    allowed = "True, False or 'auto'" if auto else "True or False"
    raise ValueError(f"Compressor: {name} must be {allowed}, got {value!r}")


def _validate(o: dict[str, Any]) -> None:
    """``ValueError`` naming the option and what is allowed, for a bad value."""
    if o["schedule"] not in SCHEDULES:
        raise ValueError(f"Compressor: schedule must be None or 'exp', got {o['schedule']!r}")
    _check_bool("error_feedback", o["error_feedback"], auto=True)
    _check_bool("server_error_feedback", o["server_error_feedback"])
    m = o["momentum"]
    if isinstance(m, bool) or not isinstance(m, (int, float)) or not 0.0 <= m < 1.0:
        raise ValueError(f"Compressor: momentum must be a number in [0, 1), got {m!r}")
    topology_mod.check_topology(o["topology"], o["intra_node"])
    if o["residual_dtype"] not in RESIDUAL_DTYPES:
        raise ValueError(f"Compressor: residual_dtype must be one of "
                         f"{', '.join(str(d) for d in RESIDUAL_DTYPES)}, got {o['residual_dtype']!r}")
    for name, lo in (("warmup_steps", 0), ("min_numel", 0), ("seed", 0), ("ramp_steps", 0), ("monitor_every", 0)):
        _check_int(name, o[name], lo)


@dataclasses.dataclass(frozen=True)
class Placement:
    """``topology`` (which workers share a node) and ``intra_node`` (what travels inside one), as given."""

    topology: object = "auto"
    intra_node: str = "none"


@dataclasses.dataclass(frozen=True)
class Config:
    """A Compressor's options, resolved (``error_feedback`` is a bool here; ``codec`` is the codec made from the spec).

    Options (keywords of :class:`gradcompress.Compressor`, or carried by the spec string by name):
        error_feedback: ``"auto"`` (default): on for biased lossy codecs (topk, sign,
            int8/int4 with rounding to nearest, powersgd, dgc, threshold, unscaled randomk),
            off for unbiased ones (qsgd, terngrad, ``stochastic=true``, ``randomk:scale=true``:
            their error can exceed the gradient and fed back it grows without bound), for the
            16-bit casts (a half-ulp residual buys nothing) and for ``none``. ``True`` /
            ``False`` force it. After construction ``error_feedback`` is the resolved bool.
        server_error_feedback: in the two-step reduce of quantising codecs (int8, int4,
            sign, qsgd, terngrad with 2+ ranks), the chunk owner adds its own residual
            before re-encoding the averaged chunk and keeps the new re-quantisation error
            (as 1-bit Adam does). Default False: see docs/guarantees.md for the
            measurement behind that choice.
        momentum: momentum correction (DGC's, for every codec): when > 0 the Compressor keeps
            u = momentum * u + g per parameter and compresses u; **run the optimizer
            without momentum**. Makes error-fed aggressive codecs (sign, topk) stable under
            heavy momentum. For ``dgc`` the codec's own ``momentum`` option is used.
        warmup_steps: the first steps are all-reduced dense (2 or more with DDP).
        min_numel: tensors with fewer elements (biases, norms) are sent dense, batched
            into one all-reduce per bucket.
        seed: seeds every random choice (randomk positions, PowerSGD's first Q,
            stochastic rounding), mixed with the parameter key and the step.
        schedule: None, or ``"exp"``: ratio/rank ramp over ``ramp_steps`` after warm-up.
        residual_dtype: storage type of the error-feedback residuals (float32 default;
            ``torch.bfloat16`` halves their memory).
        monitor_every: telemetry (0 = off). Every N-th compressed step the exact dense
            average of the same tensors is computed too (one extra all-reduce, counted in
            ``stats()["monitor_bytes"]``, not in ``wire_bytes``), and ``stats()["monitor"]``
            gives the relative error ||compressed - exact|| / ||exact|| and the cosine, overall
            and per parameter key, the residual norm (error feedback) and a short history.
            The DDP hook and ``synchronize``; N = 100 costs about 1 % more bytes.
        topology: which workers share a node (:mod:`gradcompress.topology`): ``"auto"`` (default: torchrun's
            ``LOCAL_WORLD_SIZE``/``GROUP_RANK``, else ``LOCAL_RANK``/``RANK``, else the hostnames; found once at the
            first step), ``"flat"``, an ``int`` G (consecutive blocks of G ranks per node) or a 2-D ``DeviceMesh``
            (dim 0 between nodes, dim 1 inside). With 2 or more nodes of 2 or more workers each the exchange is
            hierarchical (:mod:`gradcompress.exchanges.hierarchical`: reduce-scatter inside the node, the codec's
            exchange of each worker's 1/G shard between nodes, all-gather inside); otherwise flat, exactly as
            before. PowerSGD (whole matrices) assigns whole tensors to local ranks instead of flat shards
            (:mod:`gradcompress.exchanges.owners`). FSDP's reduce-scatter goes dense inside the node, compressed
            between. A checkpoint records a hierarchical topology; loading it under another is a ``ValueError``.
        intra_node: the dtype of the hierarchical exchange's traffic inside a node: ``"none"`` (the gradients'
            own), ``"bf16"`` or ``"fp16"`` (16 bits on the wire and in the sum, as BytePS does).
    """

    #: what the spec named, read by :func:`gradcompress.spec.parse_compressor`: the codec (``codec``) and, for
    #: ``"auto"``, the autopilot's options (``auto``: the plan is then its decision, ``codec`` is ``none``, dense)
    scheme: Scheme
    error_feedback: bool
    server_error_feedback: bool
    momentum: float
    warmup_steps: int
    min_numel: int
    seed: int
    schedule: str | None
    ramp_steps: int
    residual_dtype: torch.dtype
    monitor_every: int
    placement: Placement  # ``topology`` and ``intra_node``, checked together

    @classmethod
    def parse(cls, spec: Any, given: dict[str, Any]) -> Config:
        """The configuration of ``Compressor(spec, **given)``; ``ValueError`` for a bad value."""
        scheme = parse_compressor(spec, given)
        o = {**DEFAULTS, **dict(scheme.options)}
        if scheme.auto is not None and o["error_feedback"] == "auto":
            o["error_feedback"] = True  # every lossy candidate is biased; the 16-bit cast's residual is harmless
        codec = scheme.codec
        _validate(o)
        if o["error_feedback"] is True and codec.unbiased:
            warnings.warn(f"gradcompress: error feedback with the unbiased codec {codec.name!r} accumulates "
                          "its variance and can diverge; leave error_feedback='auto' (off for it)", stacklevel=3)
        feedback = codec.wants_error_feedback if o["error_feedback"] == "auto" else o["error_feedback"]
        placement = Placement(o.pop("topology"), o.pop("intra_node"))
        o.update(error_feedback=feedback, momentum=float(o["momentum"]))
        config = cls(scheme=scheme, placement=placement, **o)
        config.momentum_stage()  # a conflicting momentum is refused now
        return config

    @property
    def codec(self) -> Codec:
        """The codec made from the spec (``none`` for ``"auto"``)."""
        codec: Codec = self.scheme.codec
        return codec

    @property
    def auto(self) -> Auto | None:
        """The autopilot's options (``"auto"``), else None."""
        return self.scheme.auto

    @property
    def topology(self) -> object:
        """Which workers share a node (:mod:`gradcompress.topology`)."""
        return self.placement.topology

    @property
    def intra_node(self) -> str:
        """The dtype of the hierarchical exchange's traffic inside a node."""
        return self.placement.intra_node

    def momentum_stage(self) -> tuple[MomentumCorrection | None, float]:
        """Momentum correction and clipping from ``momentum`` or the codec's own options (DGC)."""
        codec: Any = self.codec  # Any: codecs that carry momentum (DGC) have momentum, masking and clip options
        if codec.carries_momentum:
            if self.momentum and self.momentum != codec.momentum:
                raise ValueError(f"Compressor: momentum={self.momentum} conflicts with {codec.name}'s own "
                                 f"momentum={codec.momentum}; set it in one place (e.g. '{codec.name}:momentum=...')")
            stage = MomentumCorrection(codec.momentum, codec.masking) if codec.momentum > 0 else None
            return stage, codec.clip
        return (MomentumCorrection(self.momentum) if self.momentum > 0 else None), 0.0

    def transforms(self, ctx: Any, world: int) -> Transforms:
        """The chain of one step (clip -> momentum correction -> worker error feedback, and the server's)."""
        momentum, clip = self.momentum_stage()
        dtype = self.residual_dtype
        return Transforms(ctx, Clip(clip, world) if clip > 0 else None, momentum,
                          ErrorFeedback(dtype) if self.error_feedback else None,
                          ErrorFeedback(dtype) if self.server_error_feedback else None)

    @property
    def uses_fast_kernels(self) -> bool:
        """Whether a step may run the C++ kernels (the codec's, or the autopilot's int8/int4 candidates)."""
        return self.codec.uses_fast_kernels or self.auto is not None

    @property
    def name(self) -> str:
        """The codec's spec, or the autopilot's (``auto:...``)."""
        return self.codec.spec if self.auto is None else self.auto.text()

    def text(self) -> str:
        """Every option that changes what is sent or computed, as one line (compared across ranks)."""
        return (f"{self.name} error_feedback={self.error_feedback} "
                f"server_error_feedback={self.server_error_feedback} momentum={self.momentum} "
                f"warmup_steps={self.warmup_steps} min_numel={self.min_numel} seed={self.seed} "
                f"schedule={self.schedule} ramp_steps={self.ramp_steps} "
                f"residual_dtype={str(self.residual_dtype).replace('torch.', '')}")


__all__ = ["Config", "DEFAULTS", "Placement", "READABLE", "RESIDUAL_DTYPES", "Spec", "TopologyOption", "UNSET", "Unset",
           "is_auto"]
