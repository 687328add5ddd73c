"""``ManagedCollectives``: gradcompress's collectives on a torchft ``Manager``'s process group, for the live quorum.

torchft reconfigures its process group at every quorum change (a replica died or came back); its
``ManagedProcessGroup`` routes only ``allreduce`` through the Manager. Here every collective a compressed step
issues (all-reduce, all-gather, all-to-all) runs on the group of the *current* quorum, and an error (a peer killed
mid-exchange: "Connection closed by peer", or the group's timeout) is **reported to the Manager instead of
raised**: the step then runs to its end without communicating, ``Manager.should_commit()`` says no on this
replica, and torchft discards the step (what torchft's own ``Manager.allreduce`` does). Bytes are counted as
:class:`gradcompress.collectives.Collectives` counts them.
"""

from __future__ import annotations

import time
import zlib

import torch
from torch.distributed.distributed_c10d import AllgatherOptions, AllreduceOptions, AllToAllOptions, ReduceOp

from ...collectives import Collectives, Done


class ManagedCollectives(Collectives):
    """Collectives on ``manager``'s process group as configured for the current quorum (:meth:`refresh` reads its
    rank and size after ``Manager.wait_quorum()``). After a failure every later collective of the step is skipped
    (returns at once, its output unspecified): the Manager already knows the step is lost."""

    def __init__(self, manager):  # noqa: D107 - no torch.distributed group: deliberately not Collectives.__init__
        self.manager, self.group, self.pg = manager, None, None
        self.world, self.rank = 1, 0
        self.wire_bytes, self.monitor_bytes, self.comm_seconds = 0, 0, 0.0
        self.failed = False

    def refresh(self) -> None:
        """Bind to the quorum's group (call after ``wait_quorum``): its rank and size, and whether the Manager has
        already seen an error in this step."""
        self.pg = self.manager._pg.parent  # torchft's wrapper around the quorum's c10d group
        self.world, self.rank = self.pg.size(), self.pg.rank()
        self.failed = self.manager.errored() is not None

    # ---------------------------------------------------------------- errors
    def _fail(self, error: Exception) -> Done:
        if not self.failed:
            self.failed = True
            self.manager.report_error(error)
        return Done()

    def _issue(self, start):
        if self.failed:
            return Done()
        try:
            return start()
        except Exception as error:  # noqa: BLE001 - any failure of the group loses the step, torchft decides
            return self._fail(error)

    def wait(self, works: list) -> None:
        start = time.perf_counter()
        for w in works:
            if self.failed:
                break
            try:
                w.wait()
            except Exception as error:  # noqa: BLE001
                self._fail(error)
        self.comm_seconds += time.perf_counter() - start

    # ---------------------------------------------------------------- collectives
    def all_reduce(self, t: torch.Tensor, monitor: bool = False):
        self.count_all_reduce(t, monitor)
        opts = AllreduceOptions()
        opts.reduceOp = ReduceOp.SUM
        return self._issue(lambda: self.pg.allreduce([t], opts))

    def all_gather(self, t: torch.Tensor):
        self.wire_bytes += (self.world - 1) * t.numel() * t.element_size()
        outs = [torch.empty_like(t) for _ in range(self.world)]
        return outs, self._issue(lambda: self.pg.allgather([outs], [t], AllgatherOptions()))

    def all_gather_flat(self, t: torch.Tensor):
        outs, work = self.all_gather(t.reshape(-1))
        flat = torch.empty(self.world * t.numel(), dtype=t.dtype, device=t.device)
        return flat, _Then(work, lambda: torch.cat(outs, out=flat))

    def all_to_all(self, t: torch.Tensor):
        self.wire_bytes += (self.world - 1) * t.numel() * t.element_size() // self.world
        out = torch.empty_like(t)
        return out, self._issue(lambda: self.pg.alltoall_base(out, t, [], [], AllToAllOptions()))

    def all_to_all_v(self, t: torch.Tensor, in_splits: list[int], out_splits: list[int]):
        self.wire_bytes += (sum(in_splits) - in_splits[self.rank]) * t.element_size()
        out = torch.empty(sum(out_splits), dtype=t.dtype, device=t.device)
        return out, self._issue(lambda: self.pg.alltoall_base(out, t, out_splits, in_splits, AllToAllOptions()))

    def reduce_scatter(self, t: torch.Tensor):
        raise NotImplementedError("gradcompress under torchft: FSDP's reduce-scatter is not supported (torchft's "
                                  "gloo group has none); use DistributedDataParallel or synchronize")

    def check_same(self, text: str, who: str, extra=None) -> list:
        """Raise on every replica unless every replica of the quorum has the same configuration (a checksum,
        all-gathered; not counted in ``wire_bytes``): mixed formats would fail inside gloo."""
        if self.world > 1 and not self.failed:
            mine = torch.tensor([zlib.crc32(text.encode())], dtype=torch.int64)
            outs = [torch.empty_like(mine) for _ in range(self.world)]
            self.wait([self._issue(lambda: self.pg.allgather([outs], [mine], AllgatherOptions()))])
            if not self.failed and len({int(o) for o in outs}) > 1:
                raise RuntimeError(f"{who}: the replicas of the quorum are configured differently (this one: "
                                   f"{text[:300]}); every replica must pass the same spec and options")
        return [extra] * self.world


class _Then:
    """A work handle that runs ``then`` once its work has completed."""

    def __init__(self, work, then):
        self.work, self.then = work, then

    def wait(self) -> bool:
        self.work.wait()
        self.then()
        return True


__all__ = ["ManagedCollectives"]
