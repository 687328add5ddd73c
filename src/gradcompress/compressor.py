"""``Compressor``: the public face of compressed gradient averaging; it delegates to three parts with one job each.

* :class:`~gradcompress.config.Config` (``compressor.options``): what the spec string and keywords became, frozen;
* :class:`~gradcompress.session.Session`: the process group, resolved once (collectives, nodes, hierarchy, state
  keys, the mean's divisor), and the exchanges it builds;
* :class:`~gradcompress.state.State`: everything compression remembers between steps (residuals, server
  residuals, PowerSGD factors, momentum, the schedule position, keyed by parameter position or group name, never
  by DDP bucket), its checkpoints and counters.

A step (:class:`gradcompress.step.Step`) runs on the terms its **coordinator** sets (:mod:`gradcompress.terms`:
the codec and schedule, ``"auto"``'s measured plan, or a quorum's); every adapter uses that protocol.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterable, Mapping
from typing import Any, Literal, cast

import torch

from .autopilot import coordinator_for
from .collectives import Collectives, LocalCollectives
from .config import DEFAULTS, READABLE, UNSET, Config, Spec, TopologyOption, Unset
from .exchanges.hierarchical import Hierarchy
from .monitor import Telemetry
from .params import check_same_parameters
from .schedule import Plan
from .session import Session
from .state import FSDP_KEY_PREFIX, Slot, State
from .step import Step
from .terms import Coordinator

_OLD_COLLECTIVE = " collective=auto"  # saved with a ``collective`` option that no longer exists: read without it


class Compressor:
    """Averages gradients across a process group with a codec, error feedback and schedules.

    Args:
        spec: codec spec (``"topk:ratio=0.01"``, a dict, or a codec from :func:`make`); it may carry the options
            below by name (``"topk:ratio=0.01,momentum=0.9"``).
        process_group: the group to average over (default: the world; with DDP, the DDP model's own group).
        error_feedback, server_error_feedback, momentum, warmup_steps, min_numel, seed, schedule, ramp_steps,
            residual_dtype, monitor_every, topology, intra_node: the options, each documented on
            :class:`gradcompress.config.Config` (``compressor.options``; read one as ``compressor.momentum``).
        divisor: what the mean divides by, asked at each step (default: the group's size; a quorum of fewer live
            workers passes its count).
        slots: per-key state mappings an optimizer owns (1-bit Adam's per-parameter state), used in place of the
            Compressor's own.
        coordinator: a callable making the coordinator of the steps from the Compressor (:mod:`gradcompress.terms`;
            :func:`gradcompress.quorum.under`: a torchft Manager's quorum).

    What is sent, its bias and when to use it are the codec's (:func:`gradcompress.available`, docs/codecs.md);
    error feedback (on by default for biased codecs) sends what a step's codec left out in later steps.

    Example::

        >>> import torch, torch.distributed as dist
        >>> import gradcompress
        >>> dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        >>> model = torch.nn.Linear(64, 32)
        >>> compressor = gradcompress.Compressor("int8", min_numel=0)   # a custom loop's exchange
        >>> model(torch.randn(8, 64)).pow(2).mean().backward()
        >>> compressor.synchronize(model.parameters())    # True: every rank's gradient was finite
        True
        >>> compressor.stats()["steps"]      # with W > 1, stats()["x_fewer_than_ddp"]: about 4x for int8
        1
        >>> dist.destroy_process_group()
    """

    def __init__(self, spec: Spec, *, process_group: torch.distributed.ProcessGroup | None = None,
                 error_feedback: bool | Literal["auto"] | Unset = UNSET, server_error_feedback: bool | Unset = UNSET,
                 momentum: float | Unset = UNSET, warmup_steps: int | Unset = UNSET, min_numel: int | Unset = UNSET,
                 seed: int | Unset = UNSET, schedule: str | None | Unset = UNSET, ramp_steps: int | Unset = UNSET,
                 residual_dtype: torch.dtype | Unset = UNSET, monitor_every: int | Unset = UNSET,
                 topology: TopologyOption | Unset = UNSET, intra_node: str | Unset = UNSET,
                 divisor: Callable[[], int] | None = None, slots: Mapping[str, Slot] | None = None,
                 coordinator: Callable[[Compressor], Coordinator] | None = None) -> None:
        given = {k: v for k, v in locals().items() if k in DEFAULTS and v is not UNSET}
        self.options = Config.parse(spec, given)
        self.__name__ = self.__qualname__ = f"gradcompress.Compressor({self.options.name})"  # DDP logs hook names
        self.session = Session(self.options, process_group, divisor)
        self.state = State(slots)
        self.coordinator: Coordinator = (coordinator or coordinator_for)(self)
        self.telemetry = Telemetry(self.options.error_feedback)
        #: per-key scratch buffers reused every step (the error-fed input), not part of the state
        self.workspace: dict[tuple[str, Hashable], torch.Tensor] = {}
        self._step: Step | None = None
        self._pending: dict[str, object] = {}  # a loaded state's world and topology, until compared with the group's
        if self.options.uses_fast_kernels:  # compile the kernels now, not inside the first step (CPU machines)
            from .codecs import fast
            fast.prepare()

    def __getattr__(self, name: str) -> Any:  # Any: each option has its own type (Config's attributes)
        """The options, read-only: ``compressor.codec``, ``compressor.error_feedback``, ``compressor.momentum``..."""
        options = self.__dict__.get("options")
        if options is not None and name in READABLE:
            return getattr(options, name)
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    # ------------------------------------------------------------------ views
    @property
    def process_group(self) -> torch.distributed.ProcessGroup | None:
        """The group this compressor averages over (None: the world, or not yet bound by an adapter)."""
        return self.session.group

    @property
    def hierarchy(self) -> Hierarchy | None:  # the hierarchical exchange's collectives (None: flat), from the first step
        return self.session.hierarchy

    @property
    def residual(self) -> Slot:
        """Worker-side error-feedback residuals, by key."""
        return self.state.slots["residual"]

    @property
    def server_residual(self) -> Slot:
        """Chunk owners' residuals of the two-step reduce, by key (this rank's chunk of each tensor)."""
        return self.state.slots["server_residual"]

    @property
    def autopilot(self) -> Coordinator | None:
        """``"auto"``'s coordinator (:class:`gradcompress.autopilot.Autopilot`), else None."""
        return self.coordinator if self.coordinator.name == "auto" else None

    @property
    def current_step(self) -> Step | None:  # the open step, or None
        return self._step if self._step is not None and self._step.open else None

    # ------------------------------------------------------------------ the step protocol
    def step(self, collectives: Collectives | None = None, **options: Any) -> Step:  # options: begin_step's
        """:meth:`begin_step` for ``with compressor.step() as step:`` (commit on a clean exit, else rollback)."""
        return self.begin_step(collectives, **options)

    def begin_step(self, collectives: Collectives | None = None, *, plan: Plan | None = None,
                   should_commit: Callable[[], bool] | None = None, deferred: bool | None = None,
                   silent: bool | None = None) -> Step:
        """Open a step on the group (or ``collectives``, e.g. ``LocalCollectives(1)``) on the coordinator's terms;
        the keywords set this step's (:class:`~gradcompress.terms.Terms`: ``plan``, an outside decision
        ``should_commit`` asked at its end, or ``deferred`` to ``Step.decide``; ``silent``: sends zeros)."""
        if self.current_step is not None:
            raise RuntimeError("gradcompress: a step of this compressor is still open; end() or abort() it first")
        coordinator, session = self.coordinator, self.session
        coordinator.settle()
        comm = session.open(collectives or coordinator.collectives())
        self._reconcile_world(comm.world)
        if coordinator.checks_group:
            session.resolve()
            session.check_topology(cast("str | None", self._pending.pop("topology", None)))  # a checkpoint's text
        given = dict(plan=plan, should_commit=should_commit, deferred=deferred, silent=silent)
        terms = coordinator.override(coordinator.open(comm, self.state.step),
                                     {k: v for k, v in given.items() if v is not None})
        if terms.new_group:  # the chunk owners of the two-step reduce changed: their residuals restart
            self.state.forget(["server_residual"], list(self.state.slots["server_residual"]))
        self.state.step = terms.index
        self._step = Step(self.options, session, self.state, self.telemetry, self.workspace, terms, coordinator.closed)
        return self._step

    def bind(self, group: torch.distributed.ProcessGroup | None) -> Compressor:
        """Average over ``group`` (an adapter's: the DDP model's, FSDP's); ``ValueError`` if another was given."""
        self.session.bind(group)
        return self

    def keys_for(self, parameters: Iterable[torch.nn.Parameter]) -> list[int]:
        """State keys of ``parameters``: their positions as given to :meth:`index_parameters`, or, for parameters
        never indexed, the order in which they are first seen (DDP's first iteration follows the model definition,
        the same on every rank and in every run)."""
        return self.session.keys_for(parameters)

    def index_parameters(self, parameters: Iterable[torch.nn.Parameter]) -> None:
        """Key state by each parameter's position among those that require grad."""
        self.session.index_parameters(parameters)

    # ------------------------------------------------------------------ custom loops
    def synchronize(self, parameters: Iterable[torch.nn.Parameter], collectives: Collectives | None = None) -> bool:
        """Average the ``.grad`` of ``parameters`` across the group, in place (custom training loops).

        Pass the same parameters in the same order on every rank and at every step (e.g. ``model.parameters()``);
        state is keyed by position in this list. Returns False when some rank's gradient was non-finite (the result
        is then non-finite everywhere and no state changed). Needs an initialised ``torch.distributed``
        (``RuntimeError`` otherwise); ``collectives``: as for :meth:`begin_step`.

        The first call checks once that every rank holds the same parameters (a checksum, one small all-gather not
        counted in ``wire_bytes``) and raises ``RuntimeError`` on every rank if not: the replicas must start equal
        (:func:`gradcompress.broadcast_parameters`).
        """
        params = [p for p in parameters if p.requires_grad]
        entries = [(i, p.grad) for i, p in enumerate(params) if p.grad is not None]
        if any(g.is_sparse for _, g in entries):
            raise ValueError("Compressor.synchronize: sparse gradients are not supported")
        entries = self.coordinator.mine(entries)
        with self.step(collectives) as step:
            if not self.session.params_checked and self.coordinator.checks_group:
                if not isinstance(step.comm, LocalCollectives):
                    check_same_parameters(params, step.comm.group)
                self.session.params_checked = True
            step.drive([step.exchange([k for k, _ in entries], [g for _, g in entries])])
        self.coordinator.share(params)
        return step.committed if step.committed is not None else bool(step.finite)

    # ------------------------------------------------------------------ reporting and checkpoints
    def stats(self) -> dict[str, Any]:
        """Counters of this Compressor object since it was built (not part of ``state_dict()``).

        ``steps``, ``skipped`` (not committed: a non-finite gradient somewhere, or the outside decision said no);
        ``raw_bytes`` (the gradients' size, summed); ``wire_bytes`` (sent by this rank, ring-counted:
        :mod:`gradcompress.collectives`); ``ratio`` (raw / wire); ``ddp_bytes`` (what DDP's ring all-reduce of the
        same gradients sends from this rank: 2 (W-1)/W x raw; for FSDP the whole gradient's all-reduce);
        ``x_fewer_than_ddp`` (ddp / wire, the one ratio the CLI prints: dense 1.0 for any W); ``codec_seconds``,
        ``comm_seconds``; ``inter_node_bytes`` / ``intra_node_bytes``; ``topology``; ``param_bytes`` (FSDP's
        compressed parameter all-gathers, apart); ``monitor_bytes`` and ``monitor``; ``auto`` (its decision).
        """
        coordinator = self.coordinator
        coordinator.settle()
        own = {coordinator.name: coordinator.stats()} if coordinator.name else {}
        return {**self.session.stats(self.state.totals), "monitor": self.telemetry.stats(), **own}

    def count_param_bytes(self, sent: int) -> None:
        """Add bytes sent by compressed parameter all-gathers (FSDP's ``params=``) to ``stats()["param_bytes"]``."""
        self.state.totals["param_bytes"] += int(sent)

    def state_dict(self) -> dict[str, Any]:
        """Tensors and plain values only (``torch.load(..., weights_only=True)`` reads it).

        ``world``: the size of the group the state was made in; :meth:`load_state_dict` compares it with the group
        it resumes in. ``topology`` (only when the exchange is hierarchical, ``"NxG intra_node=..."``): loading it
        under another topology is an error. Reads nothing from the group (safe from any thread)."""
        session, coordinator = self.session, self.coordinator
        coordinator.settle()
        extra: dict[str, object] = {"topology": session.topology_text()} if session.hierarchy is not None else {}
        extra.update({coordinator.name: coordinator.state_dict()} if coordinator.name else {})
        world = self._pending.get("world") or session.world()
        return {"config": self.config(), "world": world, **extra, **self.state.state_dict()}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Resume from :meth:`state_dict`. Saved with another world size, what stays valid is kept (PowerSGD's
        ``q``/``p``, ``momentum``, the step count), the per-rank residuals restart at zero with a ``UserWarning``;
        decided when the group is known (now if this compressor has stepped, else at its first step). A state
        without ``world`` (older checkpoints) is loaded as it is."""
        saved = str(state.get("config")).replace(_OLD_COLLECTIVE, "")
        if saved != self.config():
            raise ValueError(f"Compressor.load_state_dict: the checkpoint was made with {state.get('config')!r}, "
                             f"this compressor is {self.config()!r}")
        world = state.get("world")
        self.state.load_state_dict(state, world)
        if self.coordinator.name:
            self.coordinator.load_state_dict(state.get(self.coordinator.name, {}))
        self._pending.update(world=world, topology=state.get("topology", "flat"))
        if self.session.comm is not None:
            self._reconcile_world(self.session.comm.world)
        if self.session.resolved:
            self.session.check_topology(cast("str | None", self._pending.pop("topology", None)))

    def _reconcile_world(self, world: int) -> None:  # a loaded state's world size meets the group's
        saved = cast("int | None", self._pending.pop("world", None))  # checked by State.load_state_dict
        if saved is not None and self.state.resize(saved, world):
            self.workspace.clear()

    def explain(self) -> str:  # "auto": what it measured and why each bucket got its codec (else: the codec's spec)
        return self.coordinator.explain() or f"{self.codec.spec}: chosen by the user"

    def config(self) -> str:
        """Every option that changes what is sent or computed, as one line (compared across ranks)."""
        return self.options.text()


__all__ = ["Compressor", "FSDP_KEY_PREFIX"]
