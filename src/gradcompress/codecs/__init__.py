"""Codec families, one module each; importing this package registers every codec."""

from . import cast, dct, lowrank, quantize, sign, sparse  # noqa: F401 - imported to register their codecs
from .base import Aggregation, Codec, Payload

__all__ = ["Aggregation", "Codec", "Payload"]
