"""Scheme strings: a codec spec plus the options of what runs it (read by :mod:`gradcompress.spec`, the one home).

A *scheme* names what one training run or benchmark row uses to average gradients::

    "int8"                                          a codec spec (our Compressor with that codec)
    "sign:momentum=0.9"                             ... plus Compressor options by name
    "int4:diloco=25"                                DiLoCo, H = 25, int4 outer gradients
    "none:diloco=50,outer=sparseloco"               DiLoCo, H = 50, SparseLoCo's outer gradients (its codec)
    "int4:diloco=50,fragments=4,delay=5"            streaming DiLoCo: 4 fragments in turn, each applied 5 steps on
    "int2:diloco=100,inner=muon"                    DiLoCo with Muon inside (MuLoCo), int2 outer gradients + EF
    "topk:ratio=0.01,values=int8,compressed_adam=true"   CompressedAdam (Adam's momentum through the codec)
    "onebitadam:warmup_steps=30"                    OneBitAdam with its own options
    "onebitadam:sync_every=4"                       ... with local steps: a sync every 4th step after the freeze
    "decoupled:topk=32,chunk=64"                    DeMo (decoupled momentum) with its own options
    "ddp", "torch-fp16", "torch-powersgd:rank=4"    PyTorch's baselines (netbench, plan, the cost model)

:func:`parse_scheme` reads any of them into one frozen :class:`Scheme`; every mistake is
one ``ValueError`` naming the option and what is allowed. The grammar lives in :mod:`gradcompress.spec` (the one
module that reads spec text); this module names the schemes, re-exports the grammar's names and says what a scheme
means to DiLoCo (:func:`diloco_options`). An option the codec has is the
codec's (``dgc:momentum=0.9`` is DGC's own momentum); otherwise it may be one of the
Compressor's options a scheme can set (:data:`SCHEME_COMPRESSOR_OPTIONS`) or a scheme
option (:data:`SCHEME_OPTIONS`).

:func:`split_compressor_options` is the same grammar for ``Compressor(spec)``: a codec spec
whose options may also set any Compressor option (:data:`COMPRESSOR_OPTIONS`), e.g.
``"topk:ratio=0.01,momentum=0.9,warmup_steps=10"``; :func:`merge_compressor_options`
joins those with the keywords given to the Compressor (an option set in both is an error).

This module is library level: it imports nothing from :mod:`gradcompress.cli`.
"""

from __future__ import annotations

from typing import Any

from .spec import (AUTO, BASELINES, COMPRESSOR_OPTIONS, DECOUPLED, DECOUPLED_OPTIONS, DILOCO_INNERS, DILOCO_OUTERS,
                   ONEBITADAM, ONEBITADAM_OPTIONS, RESIDUAL_DTYPE_NAMES, SCHEME_COMPRESSOR_OPTIONS, SCHEME_OPTIONS,
                   STREAMING_OPTIONS, Scheme, check_diloco, check_scheme_inner, check_scheme_outer, codec_options,
                   compressor_value, merge_compressor_options, parse_scheme, scheme_name, split_compressor_options,
                   unknown_option_message)


def diloco_options(scheme: Scheme, error_feedback: Any = "auto") -> dict[str, Any]:
    """DiLoCo's ``codec``, ``outer``, ``outer_lr``, streaming options and ``error_feedback`` for a scheme: ``outer=sparseloco`` with an
    exact codec (``none:diloco=50,outer=sparseloco``) takes SparseLoCo's own codec (and its own error feedback)."""
    outer = scheme.outer or "nesterov"
    lr: dict[str, Any] = {} if scheme.outer_lr is None else {"outer_lr": scheme.outer_lr}
    lr.update(scheme.stream)  # streaming DiLoCo: fragments, delay, mix
    if outer == "sparseloco":
        return {"codec": None if scheme.codec.exact else scheme.codec, "outer": outer, **lr}
    return {"codec": scheme.codec, "outer": outer, "error_feedback": error_feedback, **lr}


__all__ = ["STREAMING_OPTIONS", "AUTO", "diloco_options", "BASELINES", "COMPRESSOR_OPTIONS", "DECOUPLED", "DECOUPLED_OPTIONS", "DILOCO_INNERS", "DILOCO_OUTERS", "check_scheme_inner", "check_scheme_outer", "ONEBITADAM", "ONEBITADAM_OPTIONS", "RESIDUAL_DTYPE_NAMES",
           "SCHEME_COMPRESSOR_OPTIONS", "SCHEME_OPTIONS", "Scheme", "check_diloco", "codec_options",
           "compressor_value", "merge_compressor_options", "parse_scheme", "scheme_name",
           "split_compressor_options", "unknown_option_message"]
