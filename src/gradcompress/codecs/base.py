"""The codec contract: ``Codec.encode(x, seed=) -> Payload`` and ``Codec.decode(payload) -> Tensor``.

A codec is pure: no ``torch.distributed``, no hidden state, randomness only from the
seed it is given (a private ``torch.Generator``; the global RNG is never reseeded).
``Payload.tensors`` is exactly what travels; the shape, dtype and numel needed to
rebuild the input stay local and are not counted in ``Payload.nbytes``.

Each codec declares how its payloads aggregate, so the exchange layer can pick the
collective from the codec alone:

* ``SUM``        payload tensors of equal layout can be added elementwise (all-reduce);
* ``REQUANTIZE`` codes are decoded, summed and re-encoded per chunk (two-step reduce);
* ``GATHER``     payloads are gathered from every rank and decoded one by one;
* ``LOWRANK``    the exchange drives the codec's rounds itself (PowerSGD).
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Generator, Sequence
from typing import TYPE_CHECKING, Any, ClassVar

import torch

from .. import spec as _spec

SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)


class PayloadError(ValueError):
    """A payload received from a peer that cannot be used as sent: an index out of range, sizes or counts that do
    not add up. A fault of the sender or of the link, not of the data (a non-finite value is data: the step is then
    skipped everywhere, as ``GradScaler`` expects); the exchanges check what they receive before they use it."""


def in_range(positions: torch.Tensor, values: torch.Tensor,
             numel: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(positions, values, valid)`` of a received payload's kept entries, safe to add into ``numel`` elements:
    positions outside ``[0, numel)`` become 0 with value 0, ``valid`` is a 0-d bool (no host sync) that says none
    was; counts that differ (a garbled payload) leave nothing to add and ``valid`` False. ``positions``/``values``
    may have a leading rank dimension: ``valid`` is then per rank."""
    if positions.shape != values.shape:
        lead = positions.shape[:-1] if positions.dim() > 1 else ()
        empty = positions.new_zeros((*lead, 0))
        return empty, values.new_zeros((*lead, 0)), torch.zeros(lead, dtype=torch.bool, device=positions.device)
    bad = (positions < 0) | (positions >= numel)
    return positions.masked_fill(bad, 0), values.masked_fill(bad, 0), ~bad.any(-1)


class Aggregation(enum.Enum):
    """How the payloads of a codec combine across ranks: the collective the exchange issues for it.

    A codec declares one (its class attribute ``aggregation``), and the exchange layer picks the collective from it
    alone; every rank then holds the mean of the ranks' decoded tensors. What crosses the wire is always the
    payloads' ``tensors`` (:class:`Payload`):

    * ``SUM``: payloads of one layout add elementwise, so one all-reduce sums them where they lie (``none``,
      ``bf16``, ``fp16``, ``randomk``, whose ranks share the kept positions through a shared seed); sent per rank:
      about twice the payload, as a ring all-reduce.
    * ``REQUANTIZE``: codes cannot be added as codes; each rank owns a chunk, receives every rank's codes of it
      (all-to-all), decodes, sums and re-encodes the mean, and sends it back (all-gather): the two-step reduce of
      ``int8``, ``int4``, ``int2``, ``sign``, ``qsgd``, ``terngrad``; about twice the payload per rank, whatever
      the world size. The re-encode adds a second quantisation (server error feedback, when on, keeps its error
      as the chunk owner's residual).
    * ``GATHER``: payloads of different positions (``topk``, ``dgc``, ``threshold``, ``dct``) are gathered from every
      rank and decoded one by one: a rank receives (W-1) payloads.
    * ``LOWRANK``: the exchange drives the codec's rounds itself, two all-reduces of low-rank factors per matrix
      (``powersgd``, `Vogels et al., 2019 <https://arxiv.org/abs/1905.13727>`_).

    Args:
        value: the member's value, as ``Aggregation("sum")`` looks it up: ``"sum"``, ``"requantize"``,
            ``"gather"`` or ``"lowrank"``.

    Example::

        >>> import gradcompress
        >>> gradcompress.make("int8").aggregation
        <Aggregation.REQUANTIZE: 'requantize'>
        >>> [gradcompress.make(name).aggregation.name for name in ("bf16", "topk", "powersgd")]
        ['SUM', 'GATHER', 'LOWRANK']
        >>> gradcompress.Aggregation("sum") is gradcompress.Aggregation.SUM
        True
    """

    SUM = "sum"
    REQUANTIZE = "requantize"
    GATHER = "gather"
    LOWRANK = "lowrank"


@dataclasses.dataclass(frozen=True)
class Payload:
    """What a codec produced for one tensor: the tensors that are sent, and what stays local to rebuild it.

    Only ``tensors`` travel, and :attr:`nbytes` counts them (``int8``: one int8 code per element and one float32
    scale per bucket of 512, 1.008 bytes per element against float32's 4); the rest is this rank's metadata, never
    sent: a peer's payload is read with the local metadata (:meth:`replace`), since every rank encodes tensors of the
    same shapes. Whether ``decode(encode(x))`` is biased is the codec's (:attr:`Codec.unbiased`), not the payload's.
    A payload that a peer sent and that cannot be used (an index out of range, sizes that do not add up) is a
    :class:`PayloadError` where the exchange reads it.

    Args:
        tensors: the data that travels, and nothing else (codes, scales, kept values and positions, factors).
        shape: the input's shape, kept locally to rebuild it.
        dtype: the input's dtype; ``decode`` returns this dtype.
        seed: the seed the encode used, kept locally (codecs such as ``randomk`` regenerate their positions from it
            instead of sending them); None for a deterministic codec.
        device: the input's device (where an empty tensor decodes to).
        local: what the encoder derived that a decode would derive again from the metadata (random-k's positions),
            kept locally to save the work; never sent, not compared, and kept by :meth:`replace`.

    Example::

        >>> import torch, gradcompress
        >>> payload = gradcompress.make("int8").encode(torch.randn(4, 256))
        >>> [(t.dtype, t.numel()) for t in payload.tensors]        # what is sent: codes, then one scale per bucket
        [(torch.int8, 1024), (torch.float32, 2)]
        >>> payload.nbytes, payload.shape, payload.dtype          # bytes sent; the rest stays local
        (1032, torch.Size([4, 256]), torch.float32)
        >>> received = payload.replace(tuple(t.clone() for t in payload.tensors))   # a peer's tensors, local metadata
        >>> gradcompress.make("int8").decode(received).shape
        torch.Size([4, 256])
    """

    tensors: tuple[torch.Tensor, ...]
    shape: torch.Size
    dtype: torch.dtype
    seed: int | None = None
    device: torch.device | None = None
    local: tuple[torch.Tensor, ...] = dataclasses.field(default=(), compare=False, repr=False)

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n

    @property
    def nbytes(self) -> int:
        """Bytes on the wire: the sum of the sizes of ``tensors``."""
        return sum(t.numel() * t.element_size() for t in self.tensors)

    def replace(self, tensors: tuple[torch.Tensor, ...]) -> Payload:
        """The same local metadata with other data (e.g. payload tensors received from another rank)."""
        return dataclasses.replace(self, tensors=tuple(tensors))


def check_input(x: Any, codec_name: str) -> None:
    """Raise ``TypeError`` unless ``x`` is a real floating-point tensor."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{codec_name}: expected a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in SUPPORTED_DTYPES:
        allowed = ", ".join(str(d).replace("torch.", "") for d in SUPPORTED_DTYPES)
        raise TypeError(f"{codec_name}: cannot compress a tensor of dtype {str(x.dtype).replace('torch.', '')}; "
                        f"allowed dtypes: {allowed}")


def generator(seed: int, device: torch.device) -> torch.Generator:
    """A private generator seeded with ``seed`` on ``device``."""
    g = torch.Generator(device=device)
    g.manual_seed(int(seed) & 0xFFFF_FFFF_FFFF_FFFF)
    return g


def fresh_seed() -> int:
    """A seed drawn from the global RNG, for encodes called without one."""
    return int(torch.randint(0, 2**62, (1,)).item())


#: an encode in two halves, for an exchange that reads the payload sizes of all its tensors with one host read: a
#: generator that returns the payload at once, or first yields (numbers: a 1-D int64 tensor on the device, the
#: element count of each payload tensor first, then any numbers of the codec's own; the payload tensors' dtypes),
#: is sent those numbers read on the host (a list of ints), then returns the payload
SizedEncode = Generator[tuple[torch.Tensor, tuple[torch.dtype, ...]], list[int], "Payload"]


def run_sized(encode: SizedEncode) -> Payload:
    """A two-half encode (:data:`SizedEncode`) run on its own: its numbers, if it asks, read at once."""
    try:
        numbers, _ = next(encode)
        encode.send(numbers.tolist())
    except StopIteration as done:
        return done.value  # type: ignore[no-any-return]
    raise RuntimeError("a two-half encode did not return its payload once sent its counts")


@dataclasses.dataclass(frozen=True)
class Codec:
    """The base class of codecs: ``encode(x, seed=) -> Payload`` and ``decode(payload) -> Tensor``, nothing sent.

    A codec compresses one tensor into a :class:`Payload`, whose ``tensors`` are what a step sends (``nbytes``
    bytes), and back; it is pure (no ``torch.distributed``, no hidden state, randomness only from the seed it is
    given) and communicates nothing itself: a :class:`gradcompress.Compressor` (DDP's hook, FSDP, DiLoCo) exchanges
    the payloads with the collective its :attr:`aggregation` names (:class:`Aggregation`). Bias: most codecs are
    biased (``int8``, ``sign``, ``topk``, ``powersgd``: ``E[decode(encode(x))] != x``) and are used with error
    feedback, which adds what a step's encode dropped to the next step's gradient (`Karimireddy et al., 2019
    <https://arxiv.org/abs/1901.09847>`_); the unbiased ones (``qsgd``, `Alistarh et al., 2017
    <https://arxiv.org/abs/1610.02132>`_; ``terngrad``; ``int8:stochastic=true``) are used without it
    (:attr:`unbiased`, :attr:`wants_error_feedback`). Sizes and bias of each: ``docs/codecs.md``.

    Writing a codec: a frozen dataclass subclass whose fields are its options; it implements
    ``_encode(flat, seed) -> tuple[Tensor, ...]`` on a contiguous 1-D tensor (in the input's dtype) and
    ``_decode(tensors, numel, seed, device) -> Tensor`` returning a 1-D tensor; the base class handles shapes,
    dtypes, seeds and empty tensors. It declares ``aggregation`` (default ``GATHER``, which any codec may use) and
    its properties (the class attributes below: ``unbiased``, ``stochastic``, ``fixed_layout``...);
    ``@gradcompress.spec.register_codec("name")`` makes it reachable from :func:`gradcompress.make` and spec strings.
    The other methods have reference implementations from these two, which codecs with fused kernels override with
    the same values.

    Example::

        >>> import dataclasses, torch, gradcompress
        >>> codec = gradcompress.make("int8")             # a library codec
        >>> x = torch.randn(1000)
        >>> payload = codec.encode(x)
        >>> payload.nbytes, codec.aggregation.name, codec.unbiased
        (1008, 'REQUANTIZE', False)
        >>> bool((codec.decode(payload) - x).abs().max() <= x.abs().max() / 127)
        True
        >>> @dataclasses.dataclass(frozen=True)
        ... class Half(gradcompress.Codec):               # a new one: float16 on the wire, summable as sent
        ...     name = "half"
        ...     aggregation = gradcompress.Aggregation.SUM
        ...     def _encode(self, flat, seed):
        ...         return (flat.to(torch.float16),)
        ...     def _decode(self, tensors, numel, seed, device):
        ...         return tensors[0].float()
        >>> half = Half()
        >>> payload = half.encode(x)
        >>> payload.nbytes, half.decode(payload).dtype
        (2000, torch.float32)
        >>> torch.equal(half.decode(payload), x.half().float())
        True
    """

    name = "codec"
    aggregation = Aggregation.GATHER
    #: True when the payload layout (tensor sizes) depends only on numel, so received
    #: payloads can be read with the local layout and no size exchange is needed.
    fixed_layout = True
    #: True when a non-finite input always gives a non-finite decoded output.
    preserves_nonfinite = True
    #: True when every rank must encode with the same seed (randomk's shared positions).
    shared_seed = False
    #: True when the codec draws random numbers (so a seed matters).
    stochastic = False
    #: True when E[decode(encode(x))] = x. Such codecs (qsgd, terngrad, stochastic
    #: rounding, rescaled randomk) are not contractions: their error can exceed ||x||, so
    #: error feedback would accumulate it without bound; use them without it.
    #: (Some codecs compute it from their options: a read-only property to the type checker.)
    if TYPE_CHECKING:
        @property
        def unbiased(self) -> bool: ...
    else:
        unbiased = False
    #: True when decode(encode(x)) == x exactly (``none``): no state, a plain all-reduce.
    exact = False
    #: True when the codec's options configure momentum correction (``momentum``,
    #: ``masking``, ``clip``), which a Compressor applies as transforms (DGC).
    carries_momentum = False
    #: whether the codec's CPU path uses the fused kernels (:mod:`gradcompress.codecs.fast`)
    uses_fast_kernels = True
    #: the options ``schedule="exp"`` ramps: ``("ratio",)`` for sparsifiers, ``("rank",)`` for PowerSGD
    schedule_knobs: ClassVar[tuple[str, ...]] = ()
    #: True when :meth:`kept` gives a payload's positions and values (the summed path's residual then changes
    #: only at the kept positions)
    keeps_positions = False
    #: True when :meth:`accumulate_gathered` adds every rank's gathered payload of a tensor at once
    #: (some codecs compute it from their options: a read-only property to the type checker)
    if TYPE_CHECKING:
        @property
        def gathers_stacked(self) -> bool: ...
    else:
        gathers_stacked = False

    @property
    def wants_error_feedback(self) -> bool:
        """What ``error_feedback="auto"`` resolves to: on for biased lossy codecs, off for
        exact ones and for unbiased ones (whose fed-back variance grows without bound)."""
        return not (self.exact or self.unbiased)

    def at_step(self, step: int) -> Codec:
        """The codec to use ``step`` compressed steps after the dense warm-up (its own schedule, e.g.
        DGC's sparsity warm-up); ``self`` for codecs without one."""
        return self

    def __post_init__(self) -> None:
        _spec.validate(self)

    # ----------------------------------------------------------------- public API
    def encode(self, x: torch.Tensor, *, seed: int | None = None) -> Payload:
        check_input(x, self.name)
        if seed is None and (self.stochastic or self.shared_seed):
            seed = fresh_seed()
        flat = x.reshape(-1)
        if not flat.is_contiguous():
            flat = flat.contiguous()
        tensors = self._encode(flat, seed) if flat.numel() else ()
        return Payload(tuple(tensors), x.shape, x.dtype, seed, x.device)

    def encode_sized(self, x: torch.Tensor, *, seed: int | None = None) -> SizedEncode:
        """:meth:`encode` in two halves (:data:`SizedEncode`), for an exchange that reads the payload sizes of all its
        tensors at once. Here: the payload at once (its sizes are known on the host)."""
        yield from ()
        return self.encode(x, seed=seed)

    def decode(self, payload: Payload) -> torch.Tensor:
        n = payload.numel
        if n == 0:
            return torch.zeros(payload.shape, dtype=payload.dtype, device=payload.device)
        device = payload.tensors[0].device
        flat = self._decode(payload.tensors, n, payload.seed, device)
        return flat.to(payload.dtype).reshape(payload.shape)

    # ----------------------------------------------------------------- the step's summed path
    def mean_part_dtype(self, x: torch.Tensor) -> torch.dtype | None:
        """The wire dtype when :meth:`encode_mean_part` can write into a caller's buffer (casts), else None."""
        return None

    def encode_mean_part(self, x: torch.Tensor, world: int, *, seed: int | None = None,
                         out: torch.Tensor | None = None) -> Payload:
        """``encode(x / world)``: this rank's part of a summable mean. Codecs may fuse the division
        (same values) and write into ``out`` (a flat buffer of :meth:`mean_part_dtype`)."""
        return self.encode(x / world, seed=seed)

    def decode_into(self, payload: Payload, out: torch.Tensor) -> None:
        """``out.copy_(decode(payload))`` (same values; codecs may skip the temporary)."""
        out.copy_(self.decode(payload).reshape(out.shape))

    def encode_feedback(self, x: torch.Tensor, residual: torch.Tensor | None, *, seed: int | None = None,
                        out: torch.Tensor) -> Payload:
        """Error feedback and encode in one call: the payload of ``y = x + residual`` (``residual`` None: of x),
        and ``out`` (float32, x's shape; may be x or residual itself) receives ``y - decode(payload)``.

        This is the reference (y materialised, a full decode, a subtraction); codecs with fused kernels
        compute the same values in one pass over x and residual.
        """
        y = x if residual is None else torch.add(x, residual.to(x.dtype))
        payload = self.encode(y, seed=seed)
        torch.sub(y, self.decode(payload).reshape(y.shape).to(y.dtype), out=out)
        return payload

    def encode_feedback_sized(self, x: torch.Tensor, residual: torch.Tensor | None, *, seed: int | None = None,
                              out: torch.Tensor) -> SizedEncode:
        """:meth:`encode_feedback` in two halves (:data:`SizedEncode`). Here: the payload at once."""
        yield from ()
        return self.encode_feedback(x, residual, seed=seed, out=out)

    # ----------------------------------------------------------------- declared capabilities
    def slices_by_bucket(self) -> bool:
        """Whether payloads of many buckets can be cut at any bucket edge (:meth:`encode_piece`: the whole-group
        two-step reduce). False unless a bucketed quantiser says so."""
        return False

    def encode_piece(self, x: torch.Tensor, residual: torch.Tensor | None, out: torch.Tensor | None,
                     codes: torch.Tensor, scales: torch.Tensor, seed: int | None, offset: int = 0) -> None:
        """Encode ``x`` into the caller's payload buffers (codecs whose :meth:`slices_by_bucket` is True)."""
        raise NotImplementedError(f"{self.name} does not encode into caller's buffers")

    def kept(self, payload: Payload) -> tuple[torch.Tensor, torch.Tensor]:
        """(int64 positions, float32 values) of a payload (codecs whose :attr:`keeps_positions` is True)."""
        raise NotImplementedError(f"{self.name} does not keep positions")

    def accumulate_gathered(self, payload: Payload, parts: Sequence[torch.Tensor], out: torch.Tensor,
                            world: int | None = None) -> torch.Tensor | None:
        """Every rank's gathered payload of one tensor added at once (codecs whose :attr:`gathers_stacked` is
        True): a bool tensor per rank, whether its payload was well formed (:func:`in_range`); None when not
        handled (the caller then adds them one by one)."""
        return None

    def accumulate_into(self, payload: Payload, out: torch.Tensor) -> torch.Tensor | None:
        """``out += decode(payload)`` (same values; sparse codecs add only their kept entries: O(k), not O(n)).
        Returns a 0-d bool tensor, whether the payload was well formed (None: nothing to check, a fixed layout of
        values; codecs that send positions check them, :func:`in_range`)."""
        out.add_(self.decode(payload).reshape(out.shape))
        return None

    def mean_into(self, payloads: Sequence[Payload], out: torch.Tensor, divisor: int) -> None:
        """``out`` = (decode(payloads[0]) + ... + decode(payloads[-1])) / divisor: :meth:`decode_into` of the first,
        :meth:`accumulate_into` of the others in order, ``out.div_(divisor)`` (the chunk owner's mean in the two-step
        reduce; codecs with fused kernels compute the same values in one pass that writes ``out`` once)."""
        for i, payload in enumerate(payloads):
            if i:
                self.accumulate_into(payload, out)
            else:
                self.decode_into(payload, out)
        out.div_(divisor)

    def wire_nbytes(self, numel: int, dtype: torch.dtype = torch.float32) -> int:
        """Bytes one encode of a tensor of ``numel`` elements sends (fixed-layout codecs)."""
        x = torch.zeros(numel, dtype=dtype)
        return self.encode(x, seed=0).nbytes

    def payload_nbytes(self, numel: int, shape: tuple[int, ...] | None = None) -> int:
        """Bytes one encode of a float32 tensor of ``numel`` elements (of ``shape``) sends, by arithmetic
        (the cost model's; codec families override it with their formula, the default encodes zeros).
        Raises ``ValueError`` for codecs whose size depends on the data."""
        return self.wire_nbytes(numel) if numel else 0

    @property
    def spec(self) -> str:
        """A canonical spec string (every option spelled out) that :func:`make` reads back."""
        parts = []
        for f in dataclasses.fields(self):
            if not f.init:
                continue
            v = getattr(self, f.name)
            if v is None:
                continue
            if isinstance(v, Codec):
                v = v.name if v == _spec.make(v.name) else "{" + v.spec + "}"
            elif isinstance(v, bool):
                v = "true" if v else "false"
            parts.append(f"{f.name}={v}")
        return self.name + (":" + ",".join(parts) if parts else "")

    # ----------------------------------------------------------------- to implement
    def _encode(self, flat: torch.Tensor, seed: int | None) -> tuple[torch.Tensor, ...]:
        raise NotImplementedError

    def _decode(self, tensors: tuple[torch.Tensor, ...], numel: int, seed: int | None,
                device: torch.device) -> torch.Tensor:
        raise NotImplementedError
