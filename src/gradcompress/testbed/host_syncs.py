"""Host synchronisations counted: the ops after which the CPU waits for the accelerator, on any device.

On CUDA, kernels are queued and the host runs ahead; an op whose *result the host must read* (a number, or a
shape that depends on the data) blocks the host until the queue drains, so the next kernels are not queued while
the device works. One such wait per step is the floor of a step that decides anything on the host (the overflow
check); every further one stalls the step. :class:`HostSyncs` counts them on whatever device the tensors are (on
CPU nothing waits, but the same ops run: it counts those that WOULD block on CUDA), so a CPU test bounds them.

Counted (a ``TorchDispatchMode``, which sees every aten op, also inside autograd's hooks; plus ``Tensor.tolist``,
which on CPU reads memory without any op, wrapped while counting):

* ``aten._local_scalar_dense``: a tensor read as a Python number (``.item()``, ``bool(t)``, ``int(t)``,
  ``float(t)``, ``if t:``);
* ops whose output size depends on the data, so the host reads it before allocating: ``nonzero`` (``argwhere``,
  one-argument ``where``), ``masked_select``, the ``unique`` family, ``repeat_interleave`` with tensor repeats
  and no ``output_size``, ``bincount``, indexing (``t[mask]``, ``t[mask] = v``) with a boolean mask;
* ops returning a Python bool: ``equal``, ``allclose``;
* ``Tensor.tolist()`` and copies from an accelerator to the CPU that are not ``non_blocking`` (``.cpu()``,
  ``.to("cpu")``, ``cpu_tensor.copy_(cuda_tensor)``; on CPU there are none).

Not counted: collectives (their host waits are the process group's, ``Work.wait()`` on NCCL does not block the
host), and code that reads tensor memory outside torch (the CPU codecs' fused kernels: CUDA never takes them, so
count with them off, ``codecs.fast.use(False)``, to see the path CUDA takes). On CPU every tensor is taken for one
that would be on the accelerator: a read of a tensor kept on the host on purpose counts too (read once, ``tolist``).
"""

from __future__ import annotations

import collections
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

#: aten ops (overload packets) that always make the host wait for the device
ALWAYS = frozenset({"_local_scalar_dense", "nonzero", "masked_select", "_unique", "_unique2", "unique_dim",
                    "unique_consecutive", "unique_dim_consecutive", "bincount", "equal", "allclose"})
#: indexing ops that wait only with a boolean (or uint8) mask among their indices
MASKED_INDEX = frozenset({"index", "index_put", "index_put_", "_index_put_impl_"})


def _is_mask(t: Any) -> bool:
    return isinstance(t, torch.Tensor) and t.dtype in (torch.bool, torch.uint8)


def _device_to_host(name: str, args: tuple, kwargs: dict) -> bool:
    """A blocking copy from an accelerator to the CPU (``_to_copy`` to CPU, ``copy_`` into a CPU tensor)."""
    if kwargs.get("non_blocking") or not args or not isinstance(args[0], torch.Tensor):
        return False
    if name == "_to_copy":
        src, dst = args[0].device, torch.device(kwargs.get("device") or args[0].device)
    elif name == "copy_" and len(args) > 1 and isinstance(args[1], torch.Tensor):
        src, dst = args[1].device, args[0].device
        if len(args) > 2 and args[2]:  # copy_(src, non_blocking)
            return False
    else:
        return False
    return src.type not in ("cpu", "meta") and dst.type == "cpu"


def waits(func: Any, args: tuple, kwargs: dict) -> bool:
    """Whether the aten op ``func`` called with ``args``/``kwargs`` makes the host wait for the device."""
    name = func.overloadpacket.__name__
    if name in ALWAYS:
        return True
    if name == "repeat_interleave":  # tensor repeats: the output's size is their sum
        return func._overloadname in ("Tensor", "self_Tensor") and kwargs.get("output_size") is None
    if name in MASKED_INDEX:
        indices = args[1] if len(args) > 1 else kwargs.get("indices", ())
        return any(_is_mask(t) for t in indices or ())
    return _device_to_host(name, args, kwargs)


class _Ops(TorchDispatchMode):
    def __init__(self, record: HostSyncs):
        super().__init__()
        self.record = record

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if not self.record.quiet and waits(func, args, kwargs):
            self.record.add(str(func.overloadpacket.__name__))
        return func(*args, **kwargs)


def _counting_tolist(record: HostSyncs, tolist: Any) -> Any:
    """``Tensor.tolist`` that counts itself: it runs no aten op on CPU, and a ``TorchFunctionMode`` is off inside
    autograd's hooks (where DDP's communication hook runs), so the method itself is wrapped."""
    def counted(self: torch.Tensor) -> Any:
        record.add("tolist")
        record.quiet += 1  # on CUDA its copy to the CPU is the same wait: count it once
        try:
            return tolist(self)
        finally:
            record.quiet -= 1

    return counted


class HostSyncs:
    """A context manager counting host synchronisations (see the module docstring) made inside it: aten ops on this
    thread and in the backward passes it starts (autograd carries the mode), ``tolist`` on any thread. ``count``,
    and ``ops`` (op name -> count)::

        with HostSyncs() as syncs:
            compressor.synchronize(params)
        assert syncs.count <= 1, syncs.ops
    """

    def __init__(self) -> None:
        self.count = 0
        self.ops: collections.Counter[str] = collections.Counter()
        self.quiet = 0
        self._mode: _Ops | None = None
        self._tolist: Any = None

    def add(self, name: str) -> None:
        self.count += 1
        self.ops[name] += 1

    def __enter__(self) -> HostSyncs:
        self._tolist = torch.Tensor.tolist
        torch.Tensor.tolist = _counting_tolist(self, self._tolist)  # type: ignore[method-assign]
        self._mode = _Ops(self)
        self._mode.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        if self._mode is not None:
            self._mode.__exit__(*exc)
        torch.Tensor.tolist = self._tolist  # type: ignore[method-assign]
        self._mode = None
