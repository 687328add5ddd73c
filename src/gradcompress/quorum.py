"""A replica manager's quorum as the terms of each step: fault tolerance (torchft's ``Manager``, public API only).

:func:`under` makes the coordinator (:mod:`gradcompress.terms`) of a Compressor whose steps follow a torchft
``Manager``; ``gradcompress.integrations.torchft`` builds it for users, ``DiLoCo(..., manager=...)`` for its outer
exchange. Step by step:

* **collectives**: wait for the quorum (``Manager.wait_quorum``); then one small all-gather on the quorum's group
  tells this replica its rank, the members (a new membership: the chunk owners' server residuals restart) and
  whether every replica is configured alike (else ``RuntimeError`` on every replica). Every collective runs on the
  process group the Manager was given, through torchft's wrapper (its timeouts, abort and reconfiguration apply);
  an error (a peer killed mid-exchange, a timeout) is reported to the Manager (``report_error``) instead of raised,
  the step's later collectives are skipped and their outputs read zeros: torchft then discards the step; so is a
  payload a peer sent that cannot be used (:class:`~gradcompress.codecs.base.PayloadError`, the step's ``fault``);
* **terms**: the schedule position is the Manager's committed step (every live replica picks the same codec at the
  same step, a healed one included); the mean divides by the live participants (``num_participants()``); a replica
  torchft is healing takes part silently (zeros in, none of its own residuals read); the commit is deferred;
* **commit**: a step closes with its finiteness known and waits for the Manager's decision, read from the Manager's
  public step counter (``should_commit()`` moves it past the step exactly when it agrees) before the next step, a
  report or a checkpoint; whoever asks ``should_commit()`` (torchft's ``OptimizerWrapper``, DiLoCo, the user's loop)
  needs to do nothing else, and a caller that has the answer may pass it at once (``step.decide(agreed)``);
* **healing**: the Compressor's shared state (its step, PowerSGD's factors, momentum correction; not the residuals,
  which are a replica's own) travels to a rejoining replica through ``register_state_dict_fn``; the state function
  reads nothing from the group and waits on nothing (torchft calls it from its quorum thread).

The process group: torchft's Manager offers no accessor for the group it was given; torchft's own public
``ManagedProcessGroup(manager)`` holds it as its ``parent`` (:func:`managed_group`). Pass ``process_group=`` (the
group given to the Manager) to name it yourself.
"""

from __future__ import annotations

import os
import threading
import weakref
import zlib
from collections.abc import Callable, Hashable
from typing import TYPE_CHECKING, Any, Protocol, cast

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import AllgatherOptions, AllreduceOptions, AllToAllOptions, ReduceOp

from .collectives import Collectives, Done, Handle
from .terms import Closed, Coordinator, Terms
from .schedule import plan_at

if TYPE_CHECKING:
    from torchft.manager import Manager

    from .config import Config
    from .state import State
    from .step import Step

#: the key under which a Compressor's shared state travels in torchft's state transfer (first Compressor)
STATE_KEY = "gradcompress"
#: manager -> the state keys registered on it
_KEYS: weakref.WeakKeyDictionary[Manager, list[str]] = weakref.WeakKeyDictionary()
#: errors of our own code, raised whatever the group did (everything else a collective raises is the group's fault)
PROGRAMMING_ERRORS = (AttributeError, NameError, TypeError, ImportError)


class Phases(Protocol):
    """What decides a quorum's phase (:func:`under`'s ``schedule``; DiLoCo's count of inner steps)."""

    def position(self) -> int: ...

    def agree(self, position: int) -> None: ...


class Coordinated(Protocol):
    """What a quorum reads of the :class:`gradcompress.Compressor` it coordinates (typed by its shape: the
    compressor's module imports this one)."""

    options: Config
    state: State
    coordinator: Coordinator
    workspace: dict[tuple[str, Hashable], torch.Tensor]

    def config(self) -> str: ...


def managed_group(manager: Manager) -> dist.ProcessGroup:
    """The process group the Manager was given, as torchft's public ``ManagedProcessGroup`` holds it."""
    from torchft.process_group import ManagedProcessGroup

    parent: dist.ProcessGroup = ManagedProcessGroup(manager).parent
    return parent


def under(manager: Manager, *, group: dist.ProcessGroup | None = None, state_key: str | None = None,
          process_group: dist.ProcessGroup | None = None, phase: int = 0,
          schedule: Phases | None = None) -> Callable[[Coordinated], Quorum]:
    """The coordinator factory of a Compressor under ``manager`` (``Compressor(spec, coordinator=under(m))``):
    ``group``: the replica group's own process group, for replica groups of several processes (see
    :meth:`Quorum.mine`); ``state_key``: the name of its shared state in torchft's transfer (default
    ``"gradcompress"``, then ``"gradcompress.1"``...); ``process_group``: the group given to the Manager;
    ``phase``: which of several exchanges sharing the Manager this one is (streaming DiLoCo: its fragment): a step
    whose replicas are at different phases (a replica that just joined, not yet healed) fails on every replica;
    ``schedule``: what decides the phase, an object with ``position() -> int`` and ``agree(position)`` (DiLoCo's
    count of inner steps): at every step each member is told the position of the quorum's first participating
    member, so a replica that joined or missed a quorum takes up its peers' schedule."""

    def make(compressor: Coordinated) -> Quorum:
        if compressor.options.auto is not None:
            raise ValueError("gradcompress under torchft: 'auto' is not supported (the autopilot measures a fixed "
                             "group; a quorum changes): name a codec, e.g. 'int8'")
        if compressor.options.topology not in ("auto", "flat"):
            raise ValueError(f"gradcompress under torchft: topology must be 'flat' (the replica groups are the "
                             f"quorum's members), got {compressor.options.topology!r}")
        return Quorum(compressor, manager, group, state_key, process_group, phase, schedule)

    return make


def shared_state(compressor: Coordinated) -> dict[str, Any]:
    """What a replica that rejoins receives from a peer: the compressor's state without this rank's own residuals
    (``State.shared_state_dict``), its held steps decided first. Reads nothing from the group, waits on nothing
    (torchft calls it from its quorum thread)."""
    compressor.coordinator.settle()
    return {"config": compressor.config(), **compressor.state.shared_state_dict()}


def load_shared(compressor: Coordinated, state: dict[str, Any]) -> None:
    """Take a peer's :func:`shared_state` (torchft heals this replica); its residuals restart at zero."""
    if state.get("config") != compressor.config():
        raise ValueError(f"gradcompress under torchft: the peer's compressor is {state.get('config')!r}, this "
                         f"replica's {compressor.config()!r}")
    compressor.state.load_state_dict(state)
    compressor.workspace.clear()


class QuorumCollectives(Collectives):
    """gradcompress's collectives on a torchft Manager's quorum: an error is reported to the Manager, not raised.

    Every collective a compressed step issues (all-reduce, all-gather, all-to-all) runs on ``pg``, the process group
    the Manager was given (torchft's wrapper: its timeouts, abort and reconfiguration at each quorum apply; rank and
    size are set by :meth:`Quorum.collectives` at the start of each step). What is sent is the codec's payloads,
    counted in ``wire_bytes`` as for any :class:`gradcompress.Compressor`; the mean divides by the live participants,
    so a replica that died is left out, not averaged in as zeros. An error of the group (a peer killed mid-exchange:
    "Connection closed by peer", or the group's timeout) goes to ``manager.report_error`` instead of being raised:
    every later collective of the step is skipped (returns at once) and every output of the step's collectives reads
    zeros (never what a half-finished collective left: a codec must not decode garbage); the step runs to its end,
    ``Manager.should_commit()`` says no, and torchft discards it, as its own ``Manager.allreduce`` does (`torchft
    <https://github.com/pytorch/torchft>`_). A programming error (``AttributeError``, ``TypeError``, ...) is
    raised, never swallowed. :func:`gradcompress.integrations.torchft.managed_compressor` and
    ``DistributedDataParallel`` build it; FSDP's reduce-scatter is not supported (``NotImplementedError``).

    Args:
        manager: the torchft ``Manager`` whose quorum the collectives run on; its ``report_error`` receives errors.
        pg: the process group given to the Manager (torchft's reconfigurable group, e.g. ``ProcessGroupGloo``).

    Example::

        >>> import torch
        >>> from gradcompress.integrations.torchft import ManagedCollectives
        >>> class Manager:                        # stands for torchft's Manager: what the collectives call of it
        ...     def report_error(self, error):
        ...         print("reported to the Manager:", error)
        >>> class PeerKilled:                     # stands for a process group whose peer died mid-step
        ...     def allreduce(self, tensors, options):
        ...         raise RuntimeError("Connection closed by peer")
        >>> collectives = ManagedCollectives(Manager(), PeerKilled())
        >>> t = torch.ones(4)
        >>> collectives.wait([collectives.all_reduce(t)])   # not raised: the step is lost, torchft discards it
        reported to the Manager: Connection closed by peer
        >>> t, collectives.failed                 # the output reads zeros; later collectives of the step are skipped
        (tensor([0., 0., 0., 0.]), True)
    """

    # no torch.distributed group: deliberately not Collectives.__init__
    def __init__(self, manager: Manager, pg: dist.ProcessGroup) -> None:
        self.manager, self.pg, self.group = manager, pg, None
        self.world, self.rank = 1, 0
        self.wire_bytes, self.monitor_bytes, self.comm_seconds = 0, 0, 0.0
        self.failed = False

    def fail(self, error: Exception) -> Done:
        if isinstance(error, PROGRAMMING_ERRORS):  # a bug, not a fault of the group: never swallowed
            raise error
        if not self.failed:
            self.failed = True
            self.manager.report_error(error)
        return Done()

    def _issue(self, start: Callable[[], Handle], outputs: list[torch.Tensor]) -> _Fenced:
        work: Handle = Done()
        if not self.failed:
            try:
                work = start()
            except Exception as error:  # any failure of the group loses the step, torchft decides
                self.fail(error)
        return _Fenced(self, work, outputs)

    def all_reduce(self, t: torch.Tensor, monitor: bool = False) -> Handle:
        self.count_all_reduce(t, monitor)
        opts = AllreduceOptions()
        opts.reduceOp = ReduceOp.SUM  # type: ignore[assignment]  # torch's stubs: SUM is a RedOpType, accepted here
        return self._issue(lambda: self.pg.allreduce([t], opts), [t])

    def all_gather(self, t: torch.Tensor) -> tuple[list[torch.Tensor], Handle]:
        self.wire_bytes += (self.world - 1) * t.numel() * t.element_size()
        outs = [torch.empty_like(t) for _ in range(self.world)]
        return outs, self._issue(lambda: self.pg.allgather([outs], [t], AllgatherOptions()), outs)

    def all_gather_flat(self, t: torch.Tensor) -> tuple[torch.Tensor, Handle]:
        outs, work = self.all_gather(t.reshape(-1))
        flat = torch.empty(self.world * t.numel(), dtype=t.dtype, device=t.device)
        return flat, _Then(work, lambda: torch.cat(outs, out=flat))

    def all_to_all(self, t: torch.Tensor) -> tuple[torch.Tensor, Handle]:
        self.wire_bytes += (self.world - 1) * t.numel() * t.element_size() // self.world
        out = torch.empty_like(t)
        return out, self._issue(lambda: self.pg.alltoall_base(out, t, [], [], AllToAllOptions()), [out])

    def all_to_all_v(self, t: torch.Tensor, in_splits: list[int], out_splits: list[int]
                     ) -> tuple[torch.Tensor, Handle]:
        self.wire_bytes += (sum(in_splits) - in_splits[self.rank]) * t.element_size()
        out = torch.empty(sum(out_splits), dtype=t.dtype, device=t.device)
        return out, self._issue(lambda: self.pg.alltoall_base(out, t, out_splits, in_splits,
                                                              AllToAllOptions()), [out])

    def reduce_scatter(self, t: torch.Tensor) -> tuple[torch.Tensor, Handle]:
        raise NotImplementedError("gradcompress under torchft: FSDP's reduce-scatter is not supported (torchft's "
                                  "gloo group has none); use DistributedDataParallel or synchronize")

    def check_same(self, text: str, who: str, extra: object = None) -> list[object]:
        return [extra] * self.world  # the quorum compares the replicas' configurations at every step

    def members(self, mine: torch.Tensor) -> list[torch.Tensor] | None:
        """Every replica's ``mine`` (an all-gather not counted in ``wire_bytes``), or None if the group failed."""
        outs = [torch.empty_like(mine) for _ in range(self.world)]
        self.wait([self._issue(lambda: self.pg.allgather([outs], [mine], AllgatherOptions()), outs)])
        return None if self.failed else outs


class _Fenced:
    """A collective's work handle whose outputs read zeros once the step's group has failed (the wait's error is
    reported through ``comm``, not raised)."""

    def __init__(self, comm: QuorumCollectives, work: Handle, outputs: list[torch.Tensor]) -> None:
        self.comm, self.work, self.outputs = comm, work, outputs

    def wait(self) -> bool:
        if not self.comm.failed:
            try:
                self.work.wait()
            except Exception as error:  # the group's fault: reported, the step lost
                self.comm.fail(error)
        if self.comm.failed:
            for t in self.outputs:
                t.zero_()
        return True


class _Then:
    """A work handle that runs ``then`` once its work has completed."""

    def __init__(self, work: Handle, then: Callable[[], object]) -> None:
        self.work, self.then = work, then

    def wait(self) -> bool:
        self.work.wait()
        self.then()
        return True


class Quorum(Coordinator):
    """The steps of ``compressor`` follow ``manager``'s quorum (see the module docstring)."""

    checks_group = False  # each membership is checked at every step; torchft's init_sync makes replicas start alike

    def __init__(self, compressor: Coordinated, manager: Manager, group: dist.ProcessGroup | None = None,
                 state_key: str | None = None, process_group: dist.ProcessGroup | None = None, phase: int = 0,
                 schedule: Phases | None = None) -> None:
        self.manager, self.config, self.group, self.phase = manager, compressor.options, group, int(phase)
        self.schedule = schedule
        self.comm = QuorumCollectives(manager, process_group if process_group is not None else managed_group(manager))
        self.token = int.from_bytes(os.urandom(7), "little")  # this replica process, among the quorum's members
        self.members: tuple[int, ...] | None = None
        self.fresh = False  # the members changed at this step
        self.held: list[Step] = []  # closed steps waiting for the Manager's decision
        self.lock = threading.RLock()  # settle() decides steps, whose decide() tells closed()
        keys = _KEYS.setdefault(manager, [])
        self.state_key = state_key or (STATE_KEY if not keys else f"{STATE_KEY}.{len(keys)}")
        keys.append(self.state_key)
        manager.register_state_dict_fn(self.state_key, lambda state: load_shared(compressor, state),
                                       lambda: shared_state(compressor))

    def collectives(self) -> QuorumCollectives:
        """Wait for the quorum, then learn this replica's rank and the members (one all-gather of 40 bytes per
        replica, not counted in ``wire_bytes``); ``RuntimeError`` on every replica if their configurations differ;
        the step fails on every replica (reported to the Manager) if their phases differ; the schedule agrees."""
        self.manager.wait_quorum()
        self.settle(final=True)
        comm = self.comm
        comm.failed = self.manager.errored() is not None
        if comm.failed:  # e.g. the group's configuration failed: it may not even have a size; the step is lost
            comm.world, comm.rank, self.fresh = 1, 0, False
            return comm
        comm.world, comm.rank = comm.pg.size(), 0
        position = self.schedule.position() if self.schedule is not None else 0
        mine = torch.tensor([self.token, zlib.crc32(self.config.text().encode()), self.phase, position,
                             int(self.manager.is_participating())], dtype=torch.int64)
        outs = comm.members(mine)
        if outs is None:
            self.fresh = False
            return comm
        tokens = tuple(int(o[0]) for o in outs)
        if len({int(o[1]) for o in outs}) > 1:
            raise RuntimeError(f"gradcompress: the replicas of the quorum are configured differently (this one: "
                               f"{self.config.text()[:300]}); every replica must pass the same spec and options")
        comm.rank, self.fresh, self.members = tokens.index(self.token), tokens != self.members, tokens
        if self.schedule is not None:  # the first participating member's (a healing one follows its peers)
            self.schedule.agree(int(min(outs, key=lambda o: (-int(o[4]), int(o[0])))[3]))
        phases = sorted({int(o[2]) for o in outs})
        if len(phases) > 1:  # the members would exchange different tensors: the step is lost on every replica
            comm.fail(RuntimeError(f"gradcompress: the replicas of the quorum are at different phases {phases} "
                                   f"(this one: {self.phase}); the step is discarded"))
        return comm

    def open(self, comm: Collectives, index: int) -> Terms:
        m = self.manager
        return Terms(plan_at(self.config, m.current_step()), m.current_step(), m.num_participants(),
                     silent=not m.is_participating(), deferred=True, new_group=self.fresh, fault=m.report_error)

    def override(self, terms: Terms, given: dict[str, Any]) -> Terms:
        if "should_commit" in given or given.get("deferred") is False:
            raise ValueError("gradcompress under torchft: the Manager decides the commit (should_commit); "
                             "begin_step takes no should_commit or deferred=False here")
        return super().override(terms, {k: v for k, v in given.items() if k != "deferred"})

    def closed(self, step: Closed) -> None:
        step = cast("Step", step)  # a Compressor's coordinator hears of its own steps (gradcompress.step.Step)
        with self.lock:
            if step.committed is None and step.finite is not None and step not in self.held:
                self.held.append(step)

    def settle(self, final: bool = False) -> None:
        """Decide the held steps from the Manager's step counter: ``should_commit()`` moved it past a step exactly
        when it agreed. Before the next step (``final``) a step it did not move past is dropped; before that (a
        report, a checkpoint, the state a healing peer asks for) it may not have been asked yet: it stays held (its
        state is not committed either way). A replica being healed has its state replaced by a peer's anyway."""
        with self.lock:
            now, still = self.manager.current_step(), []
            for step in self.held:
                if step.committed is not None:
                    continue
                if now == step.index + 1 or final:
                    step.decide(now == step.index + 1)
                else:
                    still.append(step)
            self.held = still

    # ---------------------------------------------------------------- replica groups of several processes
    def mine(self, entries: list[tuple[int, torch.Tensor]]) -> list[tuple[int, torch.Tensor]]:
        """The (position, gradient) entries this process exchanges: with ``group`` (a replica group of G processes
        that hold the same gradients, e.g. after DDP inside the group) rank g of the group takes positions
        g, g+G, g+2G... (exchanged with rank g of the other replica groups: each process sends 1/G of the gradient
        between groups); else all."""
        if self.group is None:
            return entries
        size, rank = dist.get_world_size(self.group), dist.get_rank(self.group)
        return [(i, g) for i, g in entries if i % size == rank]

    def share(self, params: list[torch.nn.Parameter]) -> None:
        """After the exchange: every parameter's averaged gradient broadcast inside the replica group from its owner
        (torchft decides healing per group rank; one owner per parameter keeps the group's processes equal)."""
        if self.group is None:
            return
        size = dist.get_world_size(self.group)
        for i, p in enumerate(params):
            if p.grad is not None:
                dist.broadcast(p.grad, src=dist.get_global_rank(self.group, i % size), group=self.group)


__all__ = ["Quorum", "QuorumCollectives", "STATE_KEY", "load_shared", "managed_group", "shared_state", "under"]
