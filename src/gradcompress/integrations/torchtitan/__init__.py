"""torchtitan: compressed FSDP/HSDP gradients and DiLoCo from torchtitan's own command line.

::

    torchrun --nproc_per_node 8 -m torchtitan.train --module gradcompress.integrations.torchtitan \\
        --config llama3_8b --gradcompress.scheme int8

torchtitan's ``ConfigManager`` imports this package (``--module``; it has no ``config_registry`` submodule) and
calls the function named by ``--config``. Every config function of torchtitan's registered models
(``torchtitan.models._supported_models``, each ``torchtitan.models.<model>.config_registry``) is found here under
its own name (:func:`__getattr__`): it returns the model's own config, of a subclass of its class with one more
section, ``gradcompress`` (:class:`GradcompressConfig`, ``--gradcompress.scheme``, ``--gradcompress.stats_file``),
that builds a subclass of the model's own trainer. After torchtitan has built, parallelised and initialised the
model and built its optimizer (the end of ``Trainer.__init__``), that trainer installs the scheme:

* ``none`` (the default): torchtitan's own run, nothing of gradcompress installed.
* A codec spec, the library's strings unchanged (``int8``, ``int4``, ``sign``, ``topk:ratio=0.01``, ``auto``,
  ``int8:warmup_steps=10``): :func:`gradcompress.register_fsdp` on each model part: FSDP's gradient
  reduce-scatter goes through the codec, or with ``--parallelism.data_parallel_replicate_degree`` > 1 (torchtitan's
  HSDP on its 2-D mesh) the replicas' all-reduce.
* A DiLoCo scheme (``int2:diloco=100,fragments=4,delay=5,inner=muon``): :mod:`.diloco`, across the replicas.

torchtitan's fault-tolerant trainer (``torchtitan/experiments/torchft``; its configs, e.g.
``llama3_torchft_debugmodel``, are found here too) with ``--fault_tolerance.enable``: the replicas are its torchft
replica groups, the codec's all-reduce and DiLoCo's syncs run on the Manager's quorum, and a restarted group heals
from a live peer (:mod:`.ft`).

A bad spec, PowerSGD (it needs whole matrices), a scheme that is not a codec, or DiLoCo without replicas is one
``ValueError`` while torchtitan parses its command line; a layout the library cannot take is its error at the end
of the trainer's construction, before the first step. Every step torchtitan logs gains a line (and its TensorBoard
/ W&B metrics ``gradcompress/...``): the bytes this rank sent per step, averaged over the run, and how many times
fewer that is than torchtitan's own data parallelism would send (:class:`StepBytes`). ``--gradcompress.stats_file``
also writes them, with the step's loss, as JSON lines (rank 0).
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import inspect
import json
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from ...adapters.fsdp import check_codec, register_fsdp
from ...compressor import Compressor
from ...scheme import Scheme, parse_scheme
from . import diloco, ft

try:
    from torchtitan.models import _supported_models
    from torchtitan.tools.logging import logger
    from torchtitan.trainer import Trainer
except ImportError as err:  # pragma: no cover - depends on the environment
    raise ImportError("gradcompress.integrations.torchtitan needs torchtitan: pip install 'gradcompress[torchtitan]' "
                      f"({err})") from err

NONE = "none"


def diloco_scheme(spec: str) -> Scheme | None:
    """The parsed scheme if ``spec`` is a DiLoCo scheme (``...:diloco=H``), else None."""
    try:
        scheme = parse_scheme(spec)
    except ValueError:
        return None  # not a scheme: Compressor(spec) says what is wrong, in its own grammar
    return scheme if scheme.diloco is not None else None


def check_scheme(spec: str) -> None:
    """``ValueError`` naming what works for a scheme this integration cannot run: a bad spec, a codec that cannot
    compress FSDP's reduce-scatter (PowerSGD), or a scheme that is neither a codec nor DiLoCo (``ddp``,
    ``onebitadam``, ...)."""
    if spec == NONE or diloco_scheme(spec) is not None:
        return
    try:
        check_codec(Compressor(spec).codec)
    except ValueError as err:
        raise ValueError(f"--gradcompress.scheme {spec!r}: {err}; what works: a codec spec for FSDP's gradient "
                         "reduce-scatter (int8, int4, sign, topk:ratio=0.01, auto, ...), a DiLoCo scheme "
                         "(int2:diloco=100,fragments=4,delay=5,inner=muon, ...) or none") from err


def check_config(config: Any) -> None:
    """``ValueError`` for a combination of the scheme and torchtitan's options that cannot run (DiLoCo's:
    :func:`gradcompress.integrations.torchtitan.diloco.check_config`), at parse time."""
    spec = config.gradcompress.scheme
    scheme = diloco_scheme(spec)
    ft.check_config(spec, scheme, config)
    if scheme is not None:
        diloco.check_config(scheme, config)


@dataclass(kw_only=True, slots=True)
class GradcompressConfig:
    """The ``gradcompress`` section of torchtitan's command line: which scheme compresses what torchtitan sends.

    torchtitan's ``ConfigManager`` fills it from ``--gradcompress.scheme`` and ``--gradcompress.stats_file`` when
    ``--module gradcompress.integrations.torchtitan`` names this package (every config function of torchtitan's
    models is found here, its config extended by :func:`with_gradcompress`). With a codec, what is sent, once per
    step, is the codec's payloads in place of the float gradients of FSDP's reduce-scatter (or, with HSDP's
    replicas, of their all-reduce); biased codecs (``int8``, ``sign``, ``topk``) run with error feedback, which adds
    what a step's encode dropped to the next step's gradient. With a DiLoCo scheme (`Douillard et al., 2023 <https://arxiv.org/abs/2311.08105>`_) the
    replicas exchange compressed outer gradients every H steps instead. torchtitan itself: `Liang et al., 2024
    <https://arxiv.org/abs/2410.06511>`_. Each logged step gains the bytes this rank sent per step and how many
    times fewer that is than torchtitan's own data parallelism. On the command line (8 GPUs; ``--config`` names any
    of torchtitan's config functions)::

        torchrun --nproc_per_node 8 -m torchtitan.train --module gradcompress.integrations.torchtitan \\
            --config llama3_debugmodel --gradcompress.scheme "int8"

    Args:
        scheme: ``"none"`` (the default: torchtitan's own run, nothing installed), a codec spec for FSDP's gradient
            reduce-scatter (``"int8"``, ``"int4"``, ``"sign"``, ``"topk:ratio=0.01"``, ``"auto"``; the library's
            strings), or a DiLoCo scheme (``"int2:diloco=100,fragments=4,delay=5,inner=muon"``).
        stats_file: a JSON-lines file of each logged step (loss, gradient bytes sent per step, x fewer than
            torchtitan's data parallelism), written by rank 0, relative to ``--dump_folder``; empty: none.

    Raises:
        ValueError: a scheme this integration cannot run (a bad spec, ``powersgd``, which needs whole matrices, or a
            scheme that is neither a codec nor DiLoCo), when torchtitan parses its command line; the message says
            what works.

    Example::

        >>> from gradcompress.integrations.torchtitan import GradcompressConfig
        >>> GradcompressConfig(scheme="int8")
        GradcompressConfig(scheme='int8', stats_file='')
        >>> GradcompressConfig(scheme="powersgd")    # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        ValueError: --gradcompress.scheme 'powersgd': ... powersgd cannot compress FSDP's reduce-scatter: ...
    """

    scheme: str = NONE
    """gradcompress codec spec for FSDP's gradient reduce-scatter (int8, int4, sign, topk:ratio=0.01, auto, ...;
    the library's strings); none: torchtitan's own data parallelism, nothing installed"""

    stats_file: str = ""
    """JSON lines of each logged step (loss, gradient bytes sent per step, x fewer than torchtitan's data
    parallelism), written by rank 0; relative to --dump_folder; empty: none"""

    def __post_init__(self) -> None:
        check_scheme(self.scheme)


def dense_bytes(compressor: Compressor, all_reduce: bool, world: int | None = None) -> float:
    """Bytes torchtitan's own data parallelism would have sent for what ``compressor`` compressed so far
    (``raw_bytes``: the buffers' own size) over the compressor's group of W ranks (``world``, default the
    compressor's process group's size; under torchft the configured number of replica groups): per rank, a dense
    ring reduce-scatter (FSDP) sends (W-1)/W of each buffer, a ring all-reduce (HSDP's replicas) 2(W-1)/W."""
    world = dist.get_world_size(compressor.process_group) if world is None else world
    return compressor.stats()["raw_bytes"] * (world - 1) / world * (2 if all_reduce else 1)


def natively_hsdp(model: torch.nn.Module) -> bool:
    """Whether FSDP shards ``model`` over a 2-D (replicate, shard) mesh (torchtitan's HSDP)."""
    return any(isinstance(p, DTensor) and p.device_mesh.ndim == 2 for p in model.parameters())


class StepBytes:
    """The bytes sent per training step, averaged over the steps of this run so far (DiLoCo sends every H
    steps): ``sent()`` and ``dense(steps)`` are the cumulative bytes this rank sent and those torchtitan's own data
    parallelism would have sent in ``steps`` steps."""

    def __init__(self, sent: Callable[[], float], dense: Callable[[int], float]) -> None:
        self.sent, self.dense = sent, dense
        self.first: int | None = None  # the first training step read (a resumed run starts late)

    def read(self, step: int) -> dict[str, float]:
        """``gradcompress/bytes_per_step``, ``gradcompress/dense_bytes_per_step`` and ``gradcompress/x_fewer``."""
        self.first = step if self.first is None else self.first
        steps = step - self.first + 1
        per_step, dense_per_step = self.sent() / steps, self.dense(steps) / steps
        return {"gradcompress/bytes_per_step": per_step, "gradcompress/dense_bytes_per_step": dense_per_step,
                "gradcompress/x_fewer": dense_per_step / per_step if per_step else float("inf")}


def fsdp_bytes(compressors: list[Compressor], hsdp: bool, world: int | None = None) -> StepBytes:
    """Compressed FSDP (``hsdp``: the replicas' all-reduce of HSDP; ``world``: :func:`dense_bytes`'s): what the
    compressors sent (the codec's payloads and ``auto``'s measurements) against torchtitan's dense collectives of
    the same buffers (:func:`dense_bytes`)."""
    return StepBytes(lambda: sum(c.stats()["wire_bytes"] + c.stats()["monitor_bytes"] for c in compressors),
                     lambda steps: sum(dense_bytes(c, hsdp, world) for c in compressors))


def step_log_line(step: int, scheme: str, metrics: dict[str, float]) -> str:
    """The step log's gradcompress line (DiLoCo before its first sync: nothing sent yet)."""
    if not metrics["gradcompress/bytes_per_step"]:
        return f"gradcompress {scheme}: step {step:2}  nothing sent yet"
    return (f"gradcompress {scheme}: step {step:2}  sent {metrics['gradcompress/bytes_per_step'] / 2**20:.3f} MiB "
            f"per step  {metrics['gradcompress/x_fewer']:.2f}x fewer than torchtitan's data parallelism "
            f"({metrics['gradcompress/dense_bytes_per_step'] / 2**20:.3f} MiB)")


class GradcompressMixin:
    """What a trainer of this module adds to the model's own trainer class (it is mixed in before it:
    :func:`trainer_class`): ``register_fsdp`` on each model part once torchtitan has built it, and the bytes in
    the step log. ``compressors``: one :class:`gradcompress.Compressor` per model part (empty with scheme none)."""

    model_parts: list[torch.nn.Module]  # the trainer's, set by its __init__
    config: Any  # the trainer's JobConfig (with its gradcompress section), set by its __init__
    metrics_processor: Any
    compressors: list[Compressor]
    diloco: Any  # with a DiLoCo scheme: the gradcompress.optim.DiLoCo

    def __init__(self, config: Any) -> None:
        super().__init__(config)  # type: ignore[call-arg]  # a mixin: object's to mypy, the Trainer's at run time
        spec = config.gradcompress.scheme
        scheme = diloco_scheme(spec)
        manager = ft.manager(self)  # torchtitan's FT trainer with --fault_tolerance.enable: the replica groups'
        groups = config.fault_tolerance.group_size if manager is not None else None
        self.compressors, counter = [], None
        if scheme is not None:
            self.diloco = diloco.attach(scheme, self, manager)
            per_step = diloco.dense_bytes_per_step(self.model_parts[0], groups)
            counter = StepBytes(lambda: diloco.sync_wire_bytes(self.diloco), lambda steps: steps * per_step)
            replicas = (f"the {groups} torchft replica groups" if manager is not None
                        else f"the {dist.get_world_size(self.diloco.process_group)} replicas")
            logger.info(f"gradcompress: DiLoCo {spec} across {replicas}")
        elif spec != NONE:
            self.compressors = [register_fsdp(part, spec, manager=manager) for part in self.model_parts]
            hsdp = manager is not None or natively_hsdp(self.model_parts[0])
            counter = fsdp_bytes(self.compressors, hsdp, groups)
            what = ("gradient all-reduce across the torchft replica groups" if manager is not None else
                    "HSDP replicas' gradient all-reduce" if hsdp else "FSDP gradient reduce-scatter")
            logger.info(f"gradcompress: {spec} compresses the {what} of {len(self.compressors)} model part(s)")
        if spec != NONE:
            ft.attach_state(self, with_model=scheme is None, log=logger.info)
        self._log_bytes(config.gradcompress, config.dump_folder, counter)

    def init_distributed(self) -> Any:
        """The trainer's own; under torchtitan's FT trainer :func:`.ft.prepare_trainer` follows (it built its
        ``TorchFTManager`` there, before the model and the optimizers)."""
        dims = super().init_distributed()  # type: ignore[misc]  # a mixin: the Trainer's at run time
        if ft.manager(self) is not None and self.config.gradcompress.scheme != NONE:
            ft.prepare_trainer(self, diloco=diloco_scheme(self.config.gradcompress.scheme) is not None)
        return dims

    def _log_bytes(self, section: GradcompressConfig, dump_folder: str, counter: StepBytes | None) -> None:
        """Wrap the metrics processor's ``log`` (``torchtitan/components/metrics.py``, ``MetricsProcessor.log``,
        called by ``Trainer.train_step`` on each logged step): gradcompress's metrics join torchtitan's, its line
        follows torchtitan's, the stats file gets a line."""
        processor = self.metrics_processor
        path = os.path.join(dump_folder, section.stats_file) if section.stats_file else None
        torchtitan_log = processor.log

        def log(step: int, global_avg_loss: float, global_max_loss: float, grad_norm: float,
                extra_metrics: dict[str, Any] | None = None) -> None:
            ours = counter.read(step) if counter is not None else {}
            torchtitan_log(step, global_avg_loss, global_max_loss, grad_norm, {**(extra_metrics or {}), **ours})
            if ours:
                logger.info(step_log_line(step, section.scheme, ours))
            if path is not None and dist.get_rank() == 0:
                write_stats(path, {"step": step, "loss": global_avg_loss, "grad_norm": grad_norm,
                                   "scheme": section.scheme, **ours})

        processor.log = log


def write_stats(path: str, record: dict[str, Any]) -> None:
    """Append ``record`` to the JSON-lines file ``path`` (its folder made if missing)."""
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "a") as out:
        out.write(json.dumps(record) + "\n")


@functools.cache
def trainer_class(base: Any) -> type:
    """The model's own trainer class ``base`` with :class:`GradcompressMixin`'s additions."""
    return type(f"Gradcompress{base.__name__}", (GradcompressMixin, base), {"__module__": __name__})


@functools.cache
def config_class(base: Any) -> Any:
    """A subclass of the config class ``base`` with the ``gradcompress`` section, building :func:`trainer_class`
    of ``base``'s trainer; its ``__post_init__`` is ``base``'s, then :func:`check_config`."""

    def post_init(self: Any) -> None:
        base.__post_init__(self)
        check_config(self)

    cls: Any = dataclasses.make_dataclass(
        f"Gradcompress{base._owner.__name__}Config",
        [("gradcompress", GradcompressConfig, field(default_factory=GradcompressConfig))],
        bases=(base,), namespace={"__post_init__": post_init}, kw_only=True, slots=True)
    cls.__module__ = __name__
    cls._owner = trainer_class(base._owner)
    return cls


def with_gradcompress(config: Any) -> Any:
    """A torchtitan trainer config with the ``gradcompress`` section added, at its defaults (scheme ``"none"``).

    What torchtitan's ``ConfigManager`` calls for ``--config NAME`` under ``--module
    gradcompress.integrations.torchtitan``: this package's ``NAME`` is torchtitan's config function of that name
    with its config passed through here. The result is an instance of a subclass of ``config``'s class (every value
    copied) with one more field, ``gradcompress`` (:class:`GradcompressConfig`), whose trainer is a subclass of the
    model's own trainer that installs the scheme at the end of its construction (:func:`gradcompress.register_fsdp`
    on each model part, or DiLoCo); nothing is sent or installed until that trainer is built. The default semi-sync
    method of torchtitan's fault-tolerant configs is cleared (the scheme is the semi-sync method here;
    ``--fault_tolerance.semi_sync_method`` sets it again).

    Args:
        config: a torchtitan ``Trainer.Config`` (or a subclass's), as a config function of torchtitan's returns it.

    Returns:
        The extended config (``config`` itself is not changed).

    Raises:
        TypeError: ``config`` is not a torchtitan ``Trainer.Config``.

    Example::

        >>> from torchtitan.models.llama3 import config_registry
        >>> from gradcompress.integrations.torchtitan import with_gradcompress
        >>> config = with_gradcompress(config_registry.llama3_debugmodel())
        >>> config.gradcompress
        GradcompressConfig(scheme='none', stats_file='')
        >>> isinstance(config, type(config_registry.llama3_debugmodel()))
        True
    """
    if not isinstance(config, Trainer.Config):
        raise TypeError(f"gradcompress.integrations.torchtitan: expected a torchtitan Trainer.Config, got "
                        f"{type(config).__name__}")
    values = {f.name: getattr(config, f.name) for f in dataclasses.fields(config) if f.init}
    base: Any = type(config)
    extended = config_class(base)(**values)
    ft.clear_semi_sync(extended)
    return extended


def _registries() -> list[Any]:
    """The ``config_registry`` modules of torchtitan's registered models that import here (a model whose
    optional dependencies are missing is left out)."""
    found = []
    for name in [*(f"torchtitan.models.{model}.config_registry" for model in sorted(_supported_models)),
                 *ft.EXPERIMENT_REGISTRIES]:
        try:
            found.append(importlib.import_module(name))
        except ImportError:
            continue
    return found


def _config_functions(module: Any) -> dict[str, Callable[[], Any]]:
    """The config functions a ``config_registry`` module defines: public, its own, called with no argument."""
    return {name: fn for name, fn in vars(module).items()
            if inspect.isfunction(fn) and fn.__module__ == module.__name__ and not name.startswith("_")
            and not any(p.default is p.empty and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)
                        for p in inspect.signature(fn).parameters.values())}


def wrap(fn: Callable[[], Any]) -> Callable[[], Any]:
    """The config function ``fn`` of torchtitan's, its config extended by :func:`with_gradcompress`."""
    @functools.wraps(fn)
    def config_fn() -> Any:
        return with_gradcompress(fn())

    config_fn.__module__ = __name__
    return config_fn


@functools.cache
def _lookup(name: str) -> Callable[[], Any] | None:
    for module in _registries():
        fn = _config_functions(module).get(name)
        if fn is not None:
            return wrap(fn)
    return None


def __getattr__(name: str) -> Callable[[], Any]:
    """``gradcompress.integrations.torchtitan.<config>``: torchtitan's config function of that name, of any
    registered model, with the ``gradcompress`` section (what ``ConfigManager`` calls for ``--config``)."""
    fn = None if name.startswith("_") else _lookup(name)
    if fn is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r} (no config function of that name in "
                             "torchtitan's registered models)")
    return fn


def __dir__() -> list[str]:
    return sorted({*globals(), *(n for m in _registries() for n in _config_functions(m))})
