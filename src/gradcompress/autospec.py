"""The ``"auto"`` spec: its options (what :mod:`gradcompress.autopilot` runs with), read by :mod:`gradcompress.spec`.

:class:`Auto` is the value, :func:`parse` (:func:`gradcompress.spec.parse_auto`) checks the options; both live in
:mod:`gradcompress.spec`, the one module that reads spec text, and are re-exported here with the budgets.

``"auto"`` takes the autopilot's own options and the Compressor's (``"auto:bandwidth=100mbit,warmup_steps=5"``):

* ``bandwidth=RATE`` (``100mbit``, ``1Gbps``, ``1G``: bits per second; bytes only with a capital B, ``125MBps``;
  :func:`gradcompress.timing.parse_rate`; default: measured): the link between workers, as a hint. Given, the
  autopilot does not probe the link (no probe bytes) and uses this rate; a test forces a slow-link decision on
  loopback with it.
* ``budget=safe|any`` (default ``safe``): the **error budget**, which codecs the autopilot may choose. ``safe``:
  ``none`` (dense), ``bf16``, ``int8``, ``int4``, each within 0.5 % of DDP's validation loss on the LM task under
  AdamW at lr 3e-3 with the library's defaults (README's LM table: int8 ±0.0 %, int4 +0.5 %; against DDP at its
  best lr, 1e-2: int4 +0.8 %, int8 +1.4 %, one seed). ``any`` adds PowerSGD rank 4 and
  rank 1, ``sign`` and ``topk:ratio=0.01``, which cut far more bytes but cost 5-11 % there.
* ``allocate=true|adam|false`` (default false): the error budget measured per tensor: where the cost model gives a
  bucket ``int4``, each of its tensors gets ``int8``, ``int4`` or ``int2``, the fewest bytes with the bucket's total
  squared error within ``int4``'s, measured on the gradients of the step before the decision
  (:mod:`gradcompress.autopilot.allocate`, L-GreCo's idea). ``adam``: each tensor's error weighed as an adaptive
  optimizer (Adam, AdamW) weighs it in its update: divided by the tensor's mean squared gradient (the per-tensor
  stand-in for Adam's preconditioner ``1/v``), so a tensor with small gradients counts as much as one with large.
* ``critical=ETA`` (default 0.5; 0: off): Accordion's detector of critical regimes (Agarwal et al. 2021). At each
  check the norm of the gradients of the step before it (each rank's, before the exchange; the ranks' squares
  summed) is compared with the previous check's: a relative change above ETA is a critical regime, in which the
  budget's riskiest codecs are left out (:data:`CRITICAL_DROPS`: ``safe`` drops ``int4``, ``any`` drops PowerSGD,
  sign and top-k) until a check finds the change below ETA again. Such a switch is made for the loss, not the
  speed: it is not tried against the old plan's step time.
* ``every=N`` (default 20): the autopilot re-measures every N steps and re-decides when the link rate or the compute
  time moved by more than 25 % since its last decision.
* ``cache=PATH|off`` (default: ``$GRADCOMPRESS_CACHE``, else the user's cache directory): where the codecs'
  calibration is kept between runs (:mod:`gradcompress.autopilot.calibration`); not part of the configuration text
  (each machine may keep its own).
"""

from __future__ import annotations

from .spec import AUTO_OPTIONS as OPTIONS
from .spec import BUDGETS, CRITICAL_DROPS, Auto
from .spec import parse_auto as parse

__all__ = ["Auto", "BUDGETS", "CRITICAL_DROPS", "OPTIONS", "parse"]
