"""gradcompress: fewer bytes for data-parallel PyTorch training.

Public names: :func:`make`, :func:`available`, :class:`Codec`, :class:`Payload`,
:class:`Compressor`, :func:`register_ddp_hook`, :func:`register_fsdp`, :func:`broadcast_parameters` and the
:mod:`gradcompress.optim` package.
"""

from .codecs import Aggregation, Codec, Payload
from .compressor import Compressor
from .adapters.ddp import register_ddp_hook
from .adapters.fsdp import register_fsdp
from .params import broadcast_parameters
from .spec import available, make
from . import optim

__all__ = ["Aggregation", "Codec", "Compressor", "Payload", "available", "broadcast_parameters", "make", "optim",
           "register_ddp_hook", "register_fsdp"]
__version__ = "0.1.0"
