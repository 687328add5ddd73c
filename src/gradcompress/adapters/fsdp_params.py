"""FSDP2's parameter all-gather, compressed (``register_fsdp(model, spec, params="int8" | "bf16")``).

Before each forward (and, with ``reshard_after_forward``, each backward) FSDP2 all-gathers every group's sharded
parameters into the unsharded ones the layers compute with. :class:`CompressedAllGather`
(``FSDPModule.set_custom_all_gather``) quantises this rank's shard, all-gathers the payloads, and every rank
decodes every rank's payload into the unsharded buffer (its own shard included, so every rank computes with the
same unsharded parameters).

What is sent: ``"int8"``: one int8 code per value and one float32 scale per block of :data:`PARAM_BLOCK` values
(absmax / 127, round to nearest: the codec ``int8:bucket=2048``), ~1/4 of float32 parameters plus 0.2 %;
``"bf16"``: the shard cast to bfloat16 (1/2). ``stats()["param_bytes"]`` counts them ((W-1) x payload per
all-gather, as a ring sends it), apart from the gradients' ``wire_bytes``.

Bias: only the unsharded copy used by forward and backward is approximate — each value within half a quantisation
step of its block (int8: absmax/254; bf16: a relative 2^-9); the sharded parameters, which the optimizer updates,
stay exact, so the error does not accumulate over steps: gradients are taken at parameters rounded afresh each
step. When to use: plain FSDP across nodes, where the all-gathers of the parameters cross the slow link twice per
step (ZeRO++'s qwZ); not needed for HSDP, whose all-gathers stay inside the node. A group whose parameters mix
dtypes (FSDP then all-gathers raw bytes) is gathered exactly, with a warning.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import torch

from ..spec import make
from ..collectives import Collectives, from_bytes, layout, to_bytes

if TYPE_CHECKING:
    from ..codecs.base import Codec

try:
    from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather
except ImportError:  # pragma: no cover - torch without FSDP2
    AllGather = object  # type: ignore[misc,assignment]  # the fallback base where torch has no FSDP2

#: values per int8 scale in the parameter all-gather
PARAM_BLOCK = 2048
#: ``params=`` values and the codec each one is
PARAM_CODECS = {"int8": f"int8:bucket={PARAM_BLOCK}", "bf16": "bf16"}


def param_codec(params: str | None) -> Codec | None:
    """The codec of ``params=`` (None: exact, FSDP's own all-gather); ``ValueError`` naming what is allowed."""
    if params is None:
        return None
    if not isinstance(params, str) or params not in PARAM_CODECS:
        raise ValueError(f"gradcompress FSDP: params must be None (exact parameters), 'int8' or 'bf16', "
                         f"got {params!r}")
    return make(PARAM_CODECS[params])


class CompressedAllGather(AllGather):
    """FSDP2's ``AllGather`` extension point with a quantised payload (module doc); ``count(n)`` receives the bytes
    this rank sent."""

    def __init__(self, codec: Codec, count: Callable[[int], None]) -> None:
        self.codec, self.count = codec, count
        self._comms: dict = {}
        self._warned = False

    def allocate(self, size: Sequence[int | torch.SymInt], *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)

    def _comm(self, group) -> Collectives:
        comm = self._comms.get(group)
        if comm is None:
            comm = self._comms[group] = Collectives(group)
        return comm

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group, async_op: bool = False):
        comm = self._comm(group)
        if not output_tensor.is_floating_point():
            return self._exact(comm, output_tensor, input_tensor)
        payload = self.codec.encode(input_tensor.detach().reshape(-1))
        before = comm.wire_bytes
        gathered, work = comm.all_gather_flat(to_bytes(payload.tensors, input_tensor.device))
        comm.wait([work])
        self.count(comm.wire_bytes - before)
        lay = layout(payload.tensors)
        rows = output_tensor.view(comm.world, -1)
        for r, piece in enumerate(gathered.view(comm.world, -1)):
            rows[r].copy_(self.codec.decode(payload.replace(from_bytes(piece, lay))).reshape(-1))
        return None

    def _exact(self, comm: Collectives, output_tensor, input_tensor):
        """A group of mixed dtypes (FSDP all-gathers raw bytes): gathered as it is."""
        if not self._warned:
            warnings.warn("gradcompress FSDP: params= cannot quantise a parameter group of mixed dtypes (FSDP "
                          "all-gathers it as raw bytes); that group's parameters are gathered exactly", stacklevel=2)
            self._warned = True
        before = comm.wire_bytes
        gathered, work = comm.all_gather_flat(input_tensor)
        comm.wait([work])
        self.count(comm.wire_bytes - before)
        output_tensor.copy_(gathered)
        return None


__all__ = ["CompressedAllGather", "PARAM_BLOCK", "PARAM_CODECS", "param_codec"]
