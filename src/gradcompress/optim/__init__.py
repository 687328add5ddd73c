"""Optimisers that do their own (compressed) gradient communication.

:class:`OneBitAdam`: 1-bit Adam (Tang et al., 2021), dense Adam during warm-up, then a
frozen variance and the momentum averaged through a 1-bit compressed all-reduce with
worker- and server-side error feedback.
"""

from .onebit_adam import OneBitAdam

__all__ = ["OneBitAdam"]
