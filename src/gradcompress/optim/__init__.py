"""Optimisers that do their own (compressed) gradient communication.

:class:`OneBitAdam`: 1-bit Adam (Tang et al., 2021), dense Adam during warm-up, then a
frozen variance and the momentum averaged through a 1-bit compressed all-reduce with
worker- and server-side error feedback.

:class:`CompressedAdam`: the same with any codec for the momentum (``codec="topk:ratio=0.01"``,
``"powersgd:rank=4"``, ...): compression after Adam's preconditioning.

:class:`DiLoCo`: low-communication training (Douillard et al., 2023): H local steps of any
inner optimizer, then the outer gradient averaged through a Compressor (any codec) and
applied by an outer optimizer (SGD with Nesterov momentum).

:class:`DeMo`: decoupled momentum (Peng et al., 2024): each worker keeps its own momentum, sends only its top-k
DCT coefficients per chunk (all-gathered), removes what it sent from its momentum, and steps with the sign of the
workers' mean.

:func:`muon`: Muon (orthogonalised momentum) on the hidden layers' weights and AdamW on the rest, as one
optimizer; no communication of its own (DiLoCo's inner optimizer in MuLoCo, or under DDP).
"""

from .decoupled import DeMo
from .diloco import DiLoCo
from .muon import Muon, muon
from .onebit_adam import CompressedAdam, OneBitAdam

__all__ = ["CompressedAdam", "DeMo", "DiLoCo", "Muon", "OneBitAdam", "muon"]
