"""Fresh outputs of the fused kernels (:mod:`gradcompress.codecs.fast`) on transparent huge pages: :func:`empty`."""

from __future__ import annotations

import ctypes
import os
import sys
from collections.abc import Callable
from typing import Literal

import torch

#: Outputs of at least this many bytes get their memory advised as transparent huge pages (:func:`empty`).
HUGE_MIN_BYTES = 4 << 20
HUGE_ENV_VAR = "GRADCOMPRESS_HUGEPAGES"
_HUGE_PAGE = 2 << 20
_MADV_HUGEPAGE = 14  # <sys/mman.h> on Linux
_madvise: Callable[[int, int, int], int] | Literal[False] | None = None  # libc's madvise, False: none (looked up once)


def _huge_madvise() -> Callable[[int, int, int], int] | Literal[False]:
    """libc's ``madvise`` where the kernel's transparent huge pages are not ``never``, else False."""
    global _madvise
    if _madvise is None:
        _madvise = False
        if sys.platform.startswith("linux"):
            try:
                with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
                    mode = f.read()
                if "[never]" not in mode:
                    fn = ctypes.CDLL(None, use_errno=True).madvise
                    fn.argtypes, fn.restype = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int], ctypes.c_int
                    _madvise = fn
            except (OSError, AttributeError):
                pass
    return _madvise


def empty(shape: int | tuple[int, ...] | torch.Size, dtype: torch.dtype = torch.float32,
          device: torch.device | str | None = None) -> torch.Tensor:
    """``torch.empty(shape, dtype=dtype, device=device)`` for an output that is written in full right away (a
    decode's result).

    On Linux CPUs, an output of at least :data:`HUGE_MIN_BYTES` has the 2 MiB-aligned part of its fresh memory
    advised as transparent huge pages (``madvise(MADV_HUGEPAGE)``, before anything touches it): the first write
    then takes one page fault per 2 MiB instead of one per 4 KiB. Writing a fresh 100 MB tensor took 22 ms with
    4 KiB pages and 7 ms with huge pages here (a decode into a fresh tensor is mostly its page faults). Values are
    the same either way. ``GRADCOMPRESS_HUGEPAGES=0`` turns the advice off; it is a no-op where the kernel's
    transparent huge pages are ``never``.
    """
    out = torch.empty(shape, dtype=dtype, device=device)
    nbytes = out.numel() * out.element_size()
    if (nbytes < HUGE_MIN_BYTES or out.device.type != "cpu"
            or os.environ.get(HUGE_ENV_VAR, "1").strip().lower() in ("0", "false", "no", "off")):
        return out
    madvise = _huge_madvise()
    if madvise:
        start = out.data_ptr()
        lo = -(-start // _HUGE_PAGE) * _HUGE_PAGE
        hi = (start + nbytes) // _HUGE_PAGE * _HUGE_PAGE
        if hi > lo:
            madvise(lo, hi - lo, _MADV_HUGEPAGE)  # advice only: a failure leaves 4 KiB pages
    return out
