"""How tensors are cut and laid out for the exchanges (pure arithmetic on sizes, shared with the cost model)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from ..codecs.base import Codec, Payload

#: elements per chunk of the two-step reduce are a multiple of this (whole packed bytes for 1-bit codes)
CHUNK_BLOCK = 8

#: a tensor joins its group's single payload while its last bucket pads it by at most this fraction
WHOLE_GROUP_SLACK = 0.01

#: dense tensors of at least this many elements are all-reduced in place (no copy into a flat buffer and back)
IN_PLACE_NUMEL = 1 << 20


def chunk_numel(numel: int, world: int, block: int = CHUNK_BLOCK) -> int:
    """Elements per rank's chunk in the two-step reduce: ceil(numel / world) rounded up to ``block``."""
    per = -(-numel // world)
    return -(-per // block) * block


def split_chunks(flat: torch.Tensor, world: int, block: int = CHUNK_BLOCK) -> list[torch.Tensor]:
    """``flat`` zero-padded to ``world`` equal chunks of :func:`chunk_numel` elements."""
    per = chunk_numel(flat.numel(), world, block)
    if per * world != flat.numel():
        flat = torch.nn.functional.pad(flat, (0, per * world - flat.numel()))
    return list(flat.view(world, per))


def fills_buckets(numel: int, bucket: int) -> bool:
    """Whether a tensor of ``numel`` elements travels in the whole-group payload (its last bucket pads it by
    at most :data:`WHOLE_GROUP_SLACK`): every multiple of the bucket, and anything over 100 buckets."""
    return numel > 0 and (-numel) % bucket <= WHOLE_GROUP_SLACK * numel


def whole_group_elements(numels: Sequence[int], bucket: int, world: int) -> int:
    """Elements one rank's whole-group payload holds: the tensors' buckets back to back (each tensor from a
    bucket edge) in ``world`` chunks of whole buckets."""
    buckets = sum(-(-n // bucket) for n in numels)
    return world * -(-buckets // world) * bucket


def decode_chunks(codec: Codec, payloads: Sequence[Payload], n: int, device: torch.device) -> torch.Tensor:
    """The first ``n`` values of the chunks' decodes, back to back, in float32 (each chunk decoded into its
    place: no full-size temporaries besides the result)."""
    out = torch.empty(sum(p.numel for p in payloads), dtype=torch.float32, device=device)
    offset = 0
    for p in payloads:
        codec.decode_into(p, out[offset : offset + p.numel])
        offset += p.numel
    return out[:n]


def split(flat: torch.Tensor, shapes: Sequence[Sequence[int]]) -> list[torch.Tensor]:
    """Views of ``flat``, back to back, in ``shapes``."""
    out: list[torch.Tensor] = []
    offset = 0
    for shape in shapes:
        n = math.prod(shape)
        out.append(flat[offset : offset + n].view(*shape))
        offset += n
    return out


def scatter(flat: torch.Tensor, grads: Sequence[torch.Tensor]) -> None:
    """Copy ``flat``'s values back into ``grads``, back to back."""
    offset = 0
    for g in grads:
        g.copy_(flat[offset : offset + g.numel()].view(g.shape))
        offset += g.numel()


def flat_cat(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """The tensors as one new flat tensor."""
    return torch.cat([t.reshape(-1) for t in tensors])


__all__ = ["CHUNK_BLOCK", "IN_PLACE_NUMEL", "WHOLE_GROUP_SLACK", "chunk_numel", "decode_chunks", "fills_buckets",
           "flat_cat", "scatter", "split", "split_chunks", "whole_group_elements"]
