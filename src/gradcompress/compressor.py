"""``Compressor``: configuration, state and statistics of compressed gradient averaging.

A Compressor holds what a user configures (codec, error feedback, momentum correction,
schedules), everything compression remembers between steps (one
:class:`gradcompress.step.State`: residuals, server residuals, PowerSGD factors,
momentum, the schedule position, keyed by parameter position or group name, never by
DDP bucket) and counters. The work of a step is done by :class:`gradcompress.step.Step`,
which :meth:`Compressor.begin_step` opens; every adapter (DDP hook, ``synchronize``,
FSDP, 1-bit Adam, DiLoCo) uses that protocol and nothing else.
"""

from __future__ import annotations

import warnings
from typing import Iterable

import torch
import torch.distributed as dist

from . import topology as topology_mod
from .adapters import ddp_hook
from .adapters import params as params_mod
from .codecs.base import Aggregation
from .collectives import Collectives, LocalCollectives
from .exchanges.hierarchical import Hierarchy
from .monitor import Telemetry
from .schedule import SCHEDULES
from .spec import make
from .step import State, Step
from .transforms import Clip, ErrorFeedback, MomentumCorrection, Transforms

COLLECTIVES = ("auto", "allgather")
RESIDUAL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
#: state slots that belong to one rank of one world size: reset when a state resumes at another world size
PER_RANK_SLOTS = ("residual", "server_residual")
#: state keys of FSDP's parameter groups (``fsdp:<module name>``): flat buffers of W chunks, so world-dependent
FSDP_KEY_PREFIX = "fsdp:"


def _check_int(name: str, value, lo: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < lo:
        raise ValueError(f"Compressor: {name} must be an integer >= {lo}, got {value!r}")
    return value


def _check_bool(name: str, value, auto: bool = False):
    if isinstance(value, bool) or (auto and value == "auto"):
        return value
    allowed = "True, False or 'auto'" if auto else "True or False"
    raise ValueError(f"Compressor: {name} must be {allowed}, got {value!r}")


_UNSET = object()  # an option not given as a keyword
#: the Compressor's options and their defaults (each may also be given in the spec string, by name)
DEFAULTS = dict(error_feedback="auto", server_error_feedback=False, momentum=0.0, warmup_steps=0, min_numel=1024,
                seed=0, collective="auto", schedule=None, ramp_steps=0, residual_dtype=torch.float32,
                monitor_every=0, overlap=False, topology="auto", intra_node="none")


def _options(spec, given: dict):
    """(codec spec, every option): a spec string or dict may carry Compressor options by name, as the CLI and the
    README write schemes (``"topk:ratio=0.01,momentum=0.9"``); an option given there and as a keyword too is a
    ``ValueError``. A codec object is taken as it is."""
    if isinstance(spec, (str, dict)):
        from .scheme import merge_compressor_options, split_compressor_options

        codec_spec, from_spec = split_compressor_options(spec)
        if from_spec:
            given = merge_compressor_options(from_spec, given, spec=spec)
            spec = codec_spec
    return spec, {**DEFAULTS, **given}


def _validate(o: dict) -> None:
    """``ValueError`` naming the option and what is allowed, for a bad value."""
    if o["collective"] not in COLLECTIVES:
        raise ValueError(f"Compressor: collective must be one of {', '.join(COLLECTIVES)}, got {o['collective']!r}")
    if o["schedule"] not in SCHEDULES:
        raise ValueError(f"Compressor: schedule must be None or 'exp', got {o['schedule']!r}")
    _check_bool("error_feedback", o["error_feedback"], auto=True)
    _check_bool("server_error_feedback", o["server_error_feedback"])
    _check_bool("overlap", o["overlap"])
    m = o["momentum"]
    if isinstance(m, bool) or not isinstance(m, (int, float)) or not 0.0 <= m < 1.0:
        raise ValueError(f"Compressor: momentum must be a number in [0, 1), got {m!r}")
    topology_mod.check(o["topology"], o["intra_node"])
    if o["residual_dtype"] not in RESIDUAL_DTYPES:
        raise ValueError(f"Compressor: residual_dtype must be one of "
                         f"{', '.join(str(d) for d in RESIDUAL_DTYPES)}, got {o['residual_dtype']!r}")


def default_group():
    """The default process group, or None when ``torch.distributed`` is not initialised."""
    return dist.group.WORLD if dist.is_available() and dist.is_initialized() else None


class Compressor:
    """Averages gradients across a process group with a codec, error feedback and schedules.

    Args:
        spec: codec spec (``"topk:ratio=0.01"``, a dict, or a codec from :func:`make`).
        process_group: the group to average over (default: the world; with DDP, the
            DDP model's own group).
        error_feedback: ``"auto"`` (default): on for biased lossy codecs (topk, sign,
            int8/int4 with rounding to nearest, powersgd, dgc, threshold, unscaled randomk),
            off for unbiased ones (qsgd, terngrad, ``stochastic=true``, ``randomk:scale=true``:
            their error can exceed the gradient and fed back it grows without bound), for the
            16-bit casts (a half-ulp residual buys nothing) and for ``none``. ``True`` /
            ``False`` force it. After construction ``error_feedback`` is the resolved bool.
        server_error_feedback: in the two-step reduce of quantising codecs (int8, int4,
            sign, qsgd, terngrad with 2+ ranks), the chunk owner adds its own residual
            before re-encoding the averaged chunk and keeps the new re-quantisation error
            (as 1-bit Adam does). Default False: see the README ("Guarantees") for the
            measurement behind that choice.
        momentum: momentum correction (DGC's, for every codec): when > 0 the Compressor keeps
            u = momentum * u + g per parameter and compresses u; **run the optimizer
            without momentum**. Makes error-fed aggressive codecs (sign, topk) stable under
            heavy momentum. For ``dgc`` the codec's own ``momentum`` option is used.
        warmup_steps: the first steps are all-reduced dense (2 or more with DDP).
        min_numel: tensors with fewer elements (biases, norms) are sent dense, batched
            into one all-reduce per bucket.
        seed: seeds every random choice (randomk positions, PowerSGD's first Q,
            stochastic rounding), mixed with the parameter key and the step.
        collective: ``"auto"`` picks the collective from the codec's algebra;
            ``"allgather"`` gathers every rank's payload whatever the codec.
        schedule: None, or ``"exp"``: ratio/rank ramp over ``ramp_steps`` after warm-up.
        residual_dtype: storage type of the error-feedback residuals (float32 default;
            ``torch.bfloat16`` halves their memory).
        monitor_every: telemetry (0 = off). Every N-th compressed step the exact dense
            average of the same tensors is computed too (one extra all-reduce, counted in
            ``stats()["monitor_bytes"]``, not in ``wire_bytes``), and ``stats()["monitor"]``
            gives the relative error ||compressed - exact|| / ||exact|| and the cosine, overall
            and per parameter key, the residual norm (error feedback) and a short history.
            The DDP hook and ``synchronize``; N = 100 costs about 1 % more bytes.
        overlap: with the DDP hook, each bucket's launch also advances every earlier bucket by one
            round of collectives (in a fixed order, the same on every rank), so the two-step
            reduce's second round and PowerSGD's Q round travel during the backward pass instead
            of after it. Default ``False``: only each bucket's first round overlaps the backward
            pass — advancing blocks the backward thread on the earlier round, and on the netbench
            testbed (4 hosts, 2 cores) it did not pay (BENCHMARKS.md). Results are the same either
            way; every rank must use the same setting (checked).
        topology: which workers share a node (:mod:`gradcompress.topology`): ``"auto"`` (default: torchrun's
            ``LOCAL_WORLD_SIZE``/``GROUP_RANK``, else ``LOCAL_RANK``/``RANK``, else the hostnames; found once at the
            first step), ``"flat"``, an ``int`` G (consecutive blocks of G ranks per node) or a 2-D ``DeviceMesh``
            (dim 0 between nodes, dim 1 inside). With 2 or more nodes of 2 or more workers each the exchange is
            hierarchical (:mod:`gradcompress.exchanges.hierarchical`: reduce-scatter inside the node, the codec's
            exchange of each worker's 1/G shard between nodes, all-gather inside); otherwise flat, exactly as
            before. PowerSGD (whole matrices) assigns whole tensors to local ranks instead of flat shards
            (:mod:`gradcompress.exchanges.owners`). FSDP's reduce-scatter goes dense inside the node, compressed
            between. A checkpoint records a hierarchical topology; loading it under another is a ``ValueError``.
        intra_node: the dtype of the hierarchical exchange's traffic inside a node: ``"none"`` (the gradients'
            own), ``"bf16"`` or ``"fp16"`` (16 bits on the wire and in the sum, as BytePS does).
    """

    def __init__(self, spec, *, process_group=None, error_feedback=_UNSET, server_error_feedback=_UNSET,
                 momentum=_UNSET, warmup_steps=_UNSET, min_numel=_UNSET, seed=_UNSET, collective=_UNSET,
                 schedule=_UNSET, ramp_steps=_UNSET, residual_dtype=_UNSET, monitor_every=_UNSET, overlap=_UNSET,
                 topology=_UNSET, intra_node=_UNSET):
        given = {k: v for k, v in locals().items() if k in DEFAULTS and v is not _UNSET}
        spec, o = _options(spec, given)
        self.codec = make(spec)
        _validate(o)
        self.overlap = o["overlap"]
        self.__name__ = self.__qualname__ = f"gradcompress.Compressor({self.codec.spec})"  # DDP logs hook names
        if o["error_feedback"] is True and self.codec.unbiased:
            warnings.warn(f"gradcompress: error feedback with the unbiased codec {self.codec.name!r} accumulates "
                          "its variance and can diverge; leave error_feedback='auto' (off for it)", stacklevel=2)
        self.process_group = process_group
        feedback = o["error_feedback"]
        self.error_feedback: bool = self.codec.wants_error_feedback if feedback == "auto" else feedback
        self.server_error_feedback = o["server_error_feedback"]
        self.momentum = float(o["momentum"])
        self.momentum_correction, self.clip = self._momentum_stage()
        self.warmup_steps = _check_int("warmup_steps", o["warmup_steps"], 0)
        self.min_numel = _check_int("min_numel", o["min_numel"], 0)
        self.seed = _check_int("seed", o["seed"], 0)
        self.collective, self.schedule = o["collective"], o["schedule"]
        self.ramp_steps = _check_int("ramp_steps", o["ramp_steps"], 0)
        self.residual_dtype = o["residual_dtype"]
        self.monitor_every = _check_int("monitor_every", o["monitor_every"], 0)
        self.topology, self.intra_node = o["topology"], o["intra_node"]
        self._runtime()

    def _runtime(self) -> None:
        """What a Compressor holds besides its configuration: state, buffers, telemetry, counters."""
        self.telemetry = Telemetry(self.error_feedback)
        #: the codec of dense steps on paths that encode anyway (the FSDP reduce-scatter)
        self.dense_codec = make("none")
        self.state = State()
        #: per-key scratch buffers reused every step (the error-fed input), not part of the state
        self.workspace: dict = {}
        if self.codec.uses_fast_kernels:  # compile the kernels now, not inside the first step (CPU machines)
            from .codecs import fast

            fast.prepare()
        self.current_step: Step | None = None
        self._comm: Collectives | None = None
        self._checked = False
        self._params_checked = False  # synchronize's one check that the replicas start equal
        self._saved_world: int | None = None  # a loaded state's world size, until compared with the group's
        #: the hierarchical exchange's collectives (None: flat), and the group's ranks per node when known
        self.hierarchy: Hierarchy | None = None
        self._nodes: list | None = None
        self._saved_topology: str | None = None  # a loaded state's topology, until compared with the group's
        self._key_of: dict[int, int] = {}
        self._totals = {"steps": 0, "skipped": 0, "raw_bytes": 0, "codec_seconds": 0.0, "param_bytes": 0}

    def _momentum_stage(self) -> tuple[MomentumCorrection | None, float]:
        """Momentum correction and clipping from the Compressor's ``momentum`` or the codec's own options."""
        codec = self.codec
        if codec.carries_momentum:
            if self.momentum and self.momentum != codec.momentum:
                raise ValueError(f"Compressor: momentum={self.momentum} conflicts with {codec.name}'s own "
                                 f"momentum={codec.momentum}; set it in one place (e.g. '{codec.name}:momentum=...')")
            stage = MomentumCorrection(codec.momentum, codec.masking) if codec.momentum > 0 else None
            return stage, codec.clip
        return (MomentumCorrection(self.momentum) if self.momentum > 0 else None), 0.0

    def transforms(self, ctx, world: int) -> Transforms:
        """The chain of one step (clip -> momentum correction -> worker error feedback, and the server's)."""
        dtype = self.residual_dtype
        return Transforms(ctx, Clip(self.clip, world) if self.clip > 0 else None, self.momentum_correction,
                          ErrorFeedback(dtype) if self.error_feedback else None,
                          ErrorFeedback(dtype) if self.server_error_feedback else None)

    # ------------------------------------------------------------------ state views
    @property
    def committed_steps(self) -> int:
        """Committed steps (the schedule position; a skipped non-finite step does not count)."""
        return self.state.step

    @property
    def residual(self) -> dict:
        """Worker-side error-feedback residuals, by key."""
        return self.state.slots["residual"]

    @property
    def server_residual(self) -> dict:
        """Chunk owners' residuals of the two-step reduce, by key (this rank's chunk of each tensor)."""
        return self.state.slots["server_residual"]

    @property
    def momentum_buffers(self) -> dict:
        """Momentum-correction buffers u, by key."""
        return self.state.slots["momentum"]

    # ------------------------------------------------------------------ the step protocol
    def step(self, collectives: Collectives | None = None) -> Step:
        """Open a step, to use as ``with compressor.step() as step:`` (commit on a clean exit, rollback on an
        exception; see :mod:`gradcompress.step`). The same as :meth:`begin_step`."""
        return self.begin_step(collectives)

    def begin_step(self, collectives: Collectives | None = None) -> Step:
        """Open a step (see :mod:`gradcompress.step`); on the first one, check every rank's configuration.

        ``collectives``: use these instead of the process group's from now on (e.g.
        :class:`gradcompress.collectives.LocalCollectives` to time a step without a group). Without them the
        step runs on the process group, and ``torch.distributed`` must be initialised: a single process without
        it passes ``LocalCollectives(1)`` explicitly (nothing is sent; the same code runs).
        """
        if self.current_step is not None and self.current_step.open:
            raise RuntimeError("gradcompress: a step of this compressor is still open; end() or abort() it first")
        if collectives is not None:
            self._comm = collectives
        if self._comm is None:
            self._comm = self._group_collectives()
        self._reconcile_world()
        if not self._checked:
            text = (f"{self.config()} overlap={self.overlap} topology={topology_mod.describe(self.topology)} "
                    f"intra_node={self.intra_node}")
            keys = self._comm.check_same(text, "gradcompress",
                                         topology_mod.node_key() if self.topology == "auto" else None)
            self._resolve_topology(keys)
            self._checked = True
        self._reconcile_topology()
        self.current_step = Step(self, self._comm, self._close_step)
        return self.current_step

    def _resolve_topology(self, keys) -> None:
        """The nodes of the group and, when hierarchical, the collectives inside and between them (decided once,
        at the first step, from every rank's node key: the same on every rank)."""
        recorded = getattr(self._comm, "topology", None)  # the cost model's RecordingCollectives of N x G workers
        if isinstance(self._comm, LocalCollectives) and recorded is None:
            return
        layout = self.topology if recorded is None else recorded
        group = self._comm.group
        self._nodes = topology_mod.nodes_of(layout, group, keys)
        nodes = self._nodes
        if nodes is None or len(nodes) < 2 or len(nodes[0]) < 2:
            return
        whole = self.codec.aggregation is Aggregation.LOWRANK and self.collective != "allgather"
        self.hierarchy = Hierarchy(topology_mod.build(layout, nodes, group), self.intra_node, owners=whole)

    def _topology_text(self) -> str:
        """The resolved topology as a checkpoint records it (``"flat"``, or ``"NxG intra_node=..."``)."""
        if self.hierarchy is None:
            return "flat"
        return f"{self.hierarchy.topology.text} intra_node={self.intra_node}"

    def _reconcile_topology(self) -> None:
        """A loaded state's topology must be this group's (its state keys are pieces of a G-way cut)."""
        saved, self._saved_topology = self._saved_topology, None
        if saved is not None and saved != self._topology_text():
            raise ValueError(f"Compressor.load_state_dict: the state was saved with topology {saved!r}, this "
                             f"compressor runs {self._topology_text()!r}; resume with the same topology")

    def _group_collectives(self) -> Collectives:
        """The collectives of the process group; a ``RuntimeError`` naming the fix when ``torch.distributed`` is
        not initialised (a silent single-process fallback would change ``.grad`` lossily and send nothing)."""
        if not (dist.is_available() and dist.is_initialized()):
            raise RuntimeError(
                "gradcompress: torch.distributed is not initialised, so there is no group to average over; call "
                "torch.distributed.init_process_group(...) first (or launch with torchrun, then init_process_group). "
                "For a single process without torch.distributed, pass the collectives explicitly: "
                "compressor.synchronize(params, collectives=gradcompress.collectives.LocalCollectives(1)) or "
                "compressor.begin_step(gradcompress.collectives.LocalCollectives(1))")
        return Collectives(self.process_group)

    def _close_step(self, step: Step, new: dict | None, counted: bool = True) -> None:
        """Called by the step at its end: commit ``new`` (None: roll back), add its counters."""
        if new is not None:
            if step.ctx.monitor is not None and step.ctx.monitor.rows:
                self.telemetry.report(step.index, step.ctx.monitor)
            self.state.commit(new)
        if counted:
            self._totals["steps"] += 1
            self._totals["skipped"] += new is None
        self._totals["raw_bytes"] += step.raw_bytes
        self._totals["codec_seconds"] += step.codec_seconds
        if self.current_step is step:
            self.current_step = None

    def keys_for(self, parameters: Iterable[torch.nn.Parameter]) -> list[int]:
        """State keys of ``parameters``: their positions as given to :meth:`index_parameters`, or,
        for parameters never indexed, the order in which they are first seen (DDP's first
        iteration follows the model definition, the same on every rank and in every run)."""
        keys = []
        for p in parameters:
            if id(p) not in self._key_of:
                self._key_of[id(p)] = len(self._key_of)
            keys.append(self._key_of[id(p)])
        return keys

    def index_parameters(self, parameters: Iterable[torch.nn.Parameter]) -> None:
        """Key state by each parameter's position among those that require grad."""
        params = [p for p in parameters if p.requires_grad]
        self._key_of = {id(p): i for i, p in enumerate(params)}

    # ------------------------------------------------------------------ integrations
    def register(self, ddp_model) -> "Compressor":
        """Install as ``ddp_model``'s communication hook (``DistributedDataParallel.register_comm_hook``).

        Averages over ``ddp_model.process_group`` (the group the DDP model was built on)
        unless this Compressor was given a ``process_group``, which must then be the same.
        """
        return ddp_hook.register(self, ddp_model)

    def __call__(self, state, bucket):
        """Lets the Compressor itself be passed where a hook is expected, with any state:
        ``ddp_model.register_comm_hook(None, compressor)``. (No annotations: DDP checks them.)
        """
        return ddp_hook.hook(self, bucket)

    def synchronize(self, parameters: Iterable[torch.nn.Parameter], collectives: Collectives | None = None) -> bool:
        """Average the ``.grad`` of ``parameters`` across the group, in place (custom training loops).

        Pass the same parameters in the same order on every rank and at every step
        (e.g. ``model.parameters()``); state is keyed by position in this list. Returns
        False when some rank's gradient was non-finite (the result is then non-finite
        everywhere and no state changed). Needs an initialised ``torch.distributed``
        (``RuntimeError`` otherwise); ``collectives``: as for :meth:`begin_step`, e.g.
        ``gradcompress.collectives.LocalCollectives(1)`` for a single process without it.

        The first call checks once that every rank holds the same parameters (a checksum, one small
        all-gather not counted in ``wire_bytes``) and raises ``RuntimeError`` on every rank if not: the
        replicas must start equal (:func:`gradcompress.broadcast_parameters`).
        """
        params = [p for p in parameters if p.requires_grad]
        entries = [(i, p.grad) for i, p in enumerate(params) if p.grad is not None]
        for _, g in entries:
            if g.is_sparse:
                raise ValueError("Compressor.synchronize: sparse gradients are not supported")
        with self.step(collectives) as step:
            if not self._params_checked:
                if not isinstance(step.comm, LocalCollectives):
                    params_mod.check_same_parameters(params, step.comm.group)
                self._params_checked = True
            step.drive([step.exchange([k for k, _ in entries], [g for _, g in entries])])
        return step.committed

    # ------------------------------------------------------------------ reporting and checkpoints
    def stats(self) -> dict:
        """Counters of this Compressor object since it was built (not part of ``state_dict()``: a fresh
        Compressor that loads a checkpoint counts from 0).

        ``steps``: synchronising steps; ``skipped``: those with a non-finite gradient on
        some rank (nothing committed); ``raw_bytes``: the gradients' own size (numel x
        element size) summed over steps; ``wire_bytes``: bytes this rank transmitted
        through collectives, counted as ring algorithms send them (see
        :mod:`gradcompress.collectives`); ``ratio``: raw / wire; ``codec_seconds``: time in
        encode/decode and state updates; ``comm_seconds``: time waiting on collectives;
        ``inter_node_bytes`` / ``intra_node_bytes``: the part of ``wire_bytes`` sent between nodes / inside a node
        (flat: all of it between nodes, unless the group is known to be one node; hierarchical: the collectives
        between nodes, and those of dense groups, which stay flat, count between);
        ``topology``: ``nodes``, ``workers_per_node`` (None while not known) and ``kind`` (``"flat"`` or
        ``"hierarchical"``); ``param_bytes``: bytes sent by FSDP's compressed parameter all-gathers
        (``register_fsdp(..., params=...)``; 0 otherwise: FSDP's own all-gathers are not counted), apart from
        ``wire_bytes``.
        """
        inter, intra, monitor = self._bytes()
        wire, raw = inter + intra, self._totals["raw_bytes"]
        return {
            "steps": self._totals["steps"],
            "skipped": self._totals["skipped"],
            "raw_bytes": raw,
            "wire_bytes": wire,
            "ratio": raw / wire if wire else float("inf") if raw else 1.0,
            "codec_seconds": self._totals["codec_seconds"],
            "comm_seconds": self._comm.comm_seconds if self._comm else 0.0,
            "monitor_bytes": monitor,
            "monitor": self.telemetry.stats(),
            "inter_node_bytes": inter,
            "intra_node_bytes": intra,
            "topology": self._topology_stats(),
            "param_bytes": self._totals["param_bytes"],
        }

    def count_param_bytes(self, sent: int) -> None:
        """Add bytes this rank sent in compressed parameter all-gathers (FSDP's ``params=``) to
        ``stats()["param_bytes"]``."""
        self._totals["param_bytes"] += int(sent)

    def _bytes(self) -> tuple[int, int, int]:
        """(bytes sent between nodes, inside a node, telemetry's), see :meth:`stats`."""
        flat = self._comm.wire_bytes if self._comm else 0
        monitor = self._comm.monitor_bytes if self._comm else 0
        if self.hierarchy is not None:
            intra, inter = self.hierarchy.intra, self.hierarchy.inter
            return flat + inter.wire_bytes, intra.wire_bytes, monitor + intra.monitor_bytes + inter.monitor_bytes
        if self._nodes is not None and len(self._nodes) == 1:
            return 0, flat, monitor
        return flat, 0, monitor

    def _topology_stats(self) -> dict:
        nodes = self._nodes
        return {"nodes": len(nodes) if nodes else None, "workers_per_node": len(nodes[0]) if nodes else None,
                "kind": "flat" if self.hierarchy is None else "hierarchical"}

    def state_dict(self) -> dict:
        """Tensors and plain values only (``torch.load(..., weights_only=True)`` reads it).

        ``world``: the size of the group the state was made in (residuals are per rank, the server residuals
        one chunk of W); :meth:`load_state_dict` compares it with the group it resumes in. ``topology`` (only when
        the exchange is hierarchical, ``"NxG intra_node=..."``): loading it under another topology is an error.
        """
        extra = {"topology": self._topology_text()} if self.hierarchy is not None else {}
        return {"config": self.config(), "world": self._world(), **extra, **self.state.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        """Resume from :meth:`state_dict`. Saved with another world size, what stays valid is kept (PowerSGD's
        ``q``/``p``, ``momentum``, the step count) and the per-rank residuals (``residual``, ``server_residual``)
        restart at zero, with a ``UserWarning``; decided when the group is known (now if this compressor has
        stepped, else at its first step). A state without ``world`` (older checkpoints) is loaded as it is."""
        if state.get("config") != self.config():
            raise ValueError(f"Compressor.load_state_dict: the checkpoint was made with {state.get('config')!r}, "
                             f"this compressor is {self.config()!r}")
        world = state.get("world")
        if world is not None and (isinstance(world, bool) or not isinstance(world, int) or world < 1):
            raise ValueError(f"Compressor.load_state_dict: world must be an integer >= 1, got {world!r}")
        self.state.load_state_dict(state)
        self._saved_world = world
        self._saved_topology = state.get("topology", "flat")
        if self._comm is not None:
            self._reconcile_world()
        if self._checked:
            self._reconcile_topology()

    def _world(self) -> int:
        """The world size of this compressor's state (see :meth:`state_dict`)."""
        if self._saved_world is not None:
            return self._saved_world
        if self._comm is not None:
            return self._comm.world
        if dist.is_available() and dist.is_initialized():
            return dist.get_world_size(self.process_group)
        return 1

    def _reconcile_world(self) -> None:
        """A loaded state saved at another world size: reset the per-rank residuals, keep the rest, warn once."""
        saved, self._saved_world = self._saved_world, None
        world = self._comm.world
        if saved is None or saved == world:
            return
        for slot in PER_RANK_SLOTS:
            self.state.slots[slot] = {}
        # FSDP's flat group buffers are laid out in W chunks: their momentum does not fit another world either
        chunked = [k for k in self.state.slots["momentum"] if str(k).startswith(FSDP_KEY_PREFIX)]
        for key in chunked:
            del self.state.slots["momentum"][key]
        self.state.spare = {}
        self.workspace.clear()
        also = " and the momentum of FSDP's flat buffers (laid out in W chunks)" if chunked else ""
        warnings.warn(f"gradcompress: the compressor state was saved with {saved} workers and resumes with {world}: "
                      f"the per-rank error-feedback residuals ({', '.join(PER_RANK_SLOTS)}){also} were reset to "
                      f"zero; PowerSGD's factors (q, p), the momentum buffers and the step count ({self.state.step}) "
                      "were kept", UserWarning, stacklevel=3)

    def config(self) -> str:
        """Every option that changes what is sent or computed, as one line (compared across ranks)."""
        return (f"{self.codec.spec} error_feedback={self.error_feedback} "
                f"server_error_feedback={self.server_error_feedback} momentum={self.momentum} "
                f"warmup_steps={self.warmup_steps} min_numel={self.min_numel} seed={self.seed} "
                f"collective={self.collective} schedule={self.schedule} ramp_steps={self.ramp_steps} "
                f"residual_dtype={str(self.residual_dtype).replace('torch.', '')}")


__all__ = ["Compressor"]
