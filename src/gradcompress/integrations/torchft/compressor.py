"""A :class:`gradcompress.Compressor` whose steps follow a torchft ``Manager``: quorum, divisor, commit, healing.

What changes against the plain Compressor, step by step:

* **begin**: wait for the quorum (``Manager.wait_quorum``), bind the collectives to its group
  (:class:`~.collectives.ManagedCollectives`), take the schedule position from the Manager's committed step (every
  live replica picks the same codec at the same step, a healed one included); on a new quorum the server residuals
  (owners of chunks of a group that changed) restart at zero and the replicas' configurations are compared;
* **exchange**: the mean divides by the live participants (``Manager.num_participants()``); a replica that torchft
  is healing takes part but sends zeros and reads none of its own residuals or momentum (a *silent* step);
* **end**: the step closes (finiteness known) and waits: its new state commits when ``Manager.should_commit()``
  says yes on this replica (gradcompress wraps that method once per Manager, so torchft's ``OptimizerWrapper``
  and user loops that call it work unchanged), and is dropped otherwise. A silent step commits only what every
  replica computed alike (PowerSGD's factors);
* **healing**: the Compressor registers its shared state with the Manager (``register_state_dict_fn``): the step,
  PowerSGD's factors and the momentum-correction buffers travel to a rejoining replica through torchft's state
  transfer; its residuals start at zero (another replica's residual is not its own). That state function reads
  nothing from the group and waits on nothing: torchft calls it from its quorum thread.
"""

from __future__ import annotations


from ...compressor import Compressor as _Compressor
from ...config import is_auto
from ...state import PER_RANK_SLOTS
from .collectives import ManagedCollectives

#: the key under which a Compressor's shared state travels in torchft's state transfer (first Compressor)
STATE_KEY = "gradcompress"


class Compressor(_Compressor):
    """``Compressor(spec, manager, **options)``: a :class:`gradcompress.Compressor` under torchft's ``manager``.

    Use it for custom loops (``compressor.synchronize(model.parameters())`` after backward, then
    ``if manager.should_commit(): optimizer.step()``, or torchft's ``OptimizerWrapper``), or let
    :class:`~gradcompress.integrations.torchft.DistributedDataParallel` build one. ``state_key``: the name of its
    shared state in torchft's transfer (default ``"gradcompress"``, then ``"gradcompress.1"``...); ``group``: the
    replica group's own process group, for replica groups of several processes (:meth:`synchronize`). The options are
    the Compressor's; ``"auto"`` and hierarchical topologies are refused (a quorum changes its members every step).
    """

    def __init__(self, spec, manager, *, group=None, state_key: str | None = None, **options):
        if is_auto(spec):
            raise ValueError("gradcompress under torchft: 'auto' is not supported (the autopilot measures a fixed "
                             "group; a quorum changes): name a codec, e.g. 'int8'")
        topology = options.pop("topology", "flat")
        if topology not in ("auto", "flat"):
            raise ValueError(f"gradcompress under torchft: topology must be 'flat' (the replica groups are the "
                             f"quorum's members), got {topology!r}")
        super().__init__(spec, topology="flat", divisor=manager.num_participants, **options)
        self.manager, self.group = manager, group
        self.collectives = ManagedCollectives(manager)
        self.held: list = []  # closed steps waiting for Manager.should_commit()
        self.quorum = None
        self.session.params_checked = True  # torchft's init_sync starts every replica from the same state
        # the replicas' configurations are compared at each new quorum (begin_step), not once per process: a
        # restarted replica must issue the same collectives as its peers
        self.session.resolved = True
        linked = _link(manager)
        linked.append(self)
        self.state_key = state_key or (STATE_KEY if len(linked) == 1 else f"{STATE_KEY}.{len(linked) - 1}")
        manager.register_state_dict_fn(self.state_key, self.load_shared, self.shared_state_dict)

    def begin_step(self, collectives=None, *, plan=None, should_commit=None, deferred=True, silent=None):
        """Open a step on the current quorum (see the module docstring); the step's commit waits for
        ``manager.should_commit()``."""
        if self.held:
            raise RuntimeError("gradcompress under torchft: the last step is still waiting for its commit decision; "
                               "call manager.should_commit() once after each step (torchft's OptimizerWrapper.step() "
                               "does) before the next backward")
        m, comm = self.manager, self.collectives
        m.wait_quorum()
        comm.refresh()
        quorum = getattr(m, "_quorum_id", None)
        if quorum != self.quorum:
            self.quorum = quorum
            self.state.forget(["server_residual"], list(self.state.slots["server_residual"]))
            comm.check_same(self.config(), "gradcompress")
        self.state.step = m.current_step()
        step = super().begin_step(collectives or comm, plan=plan, should_commit=should_commit, deferred=True,
                                  silent=not m.is_participating() if silent is None else silent)
        self.held.append(step)
        return step

    def synchronize(self, parameters, collectives=None) -> bool:
        """Average the gradients over the live replicas (see :meth:`gradcompress.Compressor.synchronize`); returns
        whether every replica's gradient was finite. The commit is ``manager.should_commit()``'s.

        With ``group`` (a replica group of G processes that hold the same gradients, e.g. after DDP on the
        group): rank g of the group averages parameters g, g+G, g+2G... with rank g of the other replica groups,
        then every parameter is broadcast inside the group from its owner: each process sends 1/G of the
        gradient between groups, and the group's processes end with the same average (torchft decides healing
        per group rank; one owner per parameter keeps the group's processes equal)."""
        if self.group is None:
            super().synchronize(parameters, collectives)
            return bool(self.held[-1].finite)
        import torch.distributed as dist

        params = [p for p in parameters if p.requires_grad]
        size, rank = dist.get_world_size(self.group), dist.get_rank(self.group)
        mine = [(i, p.grad) for i, p in enumerate(params) if i % size == rank and p.grad is not None]
        with self.step(collectives) as step:
            step.drive([step.exchange([i for i, _ in mine], [g for _, g in mine])])
        for i, p in enumerate(params):
            if p.grad is not None:
                dist.broadcast(p.grad, src=dist.get_global_rank(self.group, i % size), group=self.group)
        return bool(step.finite)

    def settle(self, agreed: bool) -> None:
        """The Manager decided this replica's step: commit the held steps' state, or drop it."""
        held, self.held = self.held, []
        for step in held:
            if step.open:
                step.abort(RuntimeError("gradcompress: should_commit() was called inside the step"))
            elif step.finite is not None:
                step.decide(agreed)

    # ---------------------------------------------------------------- torchft's state transfer
    def shared_state_dict(self) -> dict:
        """What a rejoining replica receives: everything but this replica's residuals (no collective, no wait)."""
        state = self.state.state_dict()
        for slot in PER_RANK_SLOTS:
            state[slot] = {}
        return {"config": self.config(), **state}

    def load_shared(self, state: dict) -> None:
        """Take a peer's shared state (torchft heals this replica); this replica's residuals restart at zero."""
        if state.get("config") != self.config():
            raise ValueError(f"gradcompress under torchft: the peer's compressor is {state.get('config')!r}, this "
                             f"replica's {self.config()!r}")
        self.state.load_state_dict(state)
        self.workspace.clear()


def _link(manager) -> list:
    """The Compressors following ``manager``'s commit decisions: its ``should_commit`` is wrapped, once, so that
    each decision settles them (whoever asks: torchft's OptimizerWrapper, DiLoCo, the user's loop)."""
    linked = getattr(manager, "_gradcompress_compressors", None)
    if linked is None:
        linked, original = [], manager.should_commit

        def should_commit(*args, **kwargs) -> bool:
            agreed = False
            try:
                agreed = original(*args, **kwargs)
            finally:
                for compressor in linked:
                    compressor.settle(agreed)
            return agreed

        manager.should_commit = should_commit
        manager._gradcompress_compressors = linked
    return linked


__all__ = ["Compressor", "STATE_KEY"]
