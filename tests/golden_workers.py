"""Golden results: SHA-256 digests of short multi-process runs, recorded before a refactor and kept as a test.

Every case trains the tests' MLP for ``STEPS`` steps on 2 or 4 gloo workers and digests, in order, the averaged
gradients of every step, the final parameters and the compressor's (or optimizer's) state dict. Cases cover every
codec of ``gradcompress.available()`` through the DDP hook and ``synchronize``, plus FSDP, DiLoCo, 1-bit Adam and
CompressedAdam and DeMo (DiLoCo also streaming, with its outer options, SparseLoCo, Muon inside and resumed from a
state dict mid-run), with error feedback, momentum correction, server error feedback, telemetry, bfloat16 residuals and
a non-finite step (rank W-1's loss times Inf at ``BAD_STEP``: the step must be skipped everywhere).

``python tests/golden_workers.py --record`` records the digests of this machine into ``tests/golden/``, keyed by
:func:`fingerprint` (float results depend on more than the CPU's vector width: the CPU's vendor and model, which
kernels MKL dispatches to, the torch build); ``python tests/golden_workers.py`` prints them as JSON.

A Compressor's configuration text (``state_dict()["config"]``) is not digested: it is a description, checked by the
tests of the configuration, not a result; everything computed (gradients, parameters, state tensors, counters) is.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import re
import sys

import torch
import torch.distributed as dist
import torch.nn as nn

sys.path.insert(0, os.path.dirname(__file__))

import gradcompress
from gradcompress.optim import CompressedAdam, DeMo, DiLoCo, OneBitAdam, muon
from workers import batch, make_model

STEPS = 20
BAD_STEP = 7

#: (name, spec, Compressor options): run through the DDP hook and synchronize()
CODEC_CASES = [
    ("none", "none", {}),
    ("fp16", "fp16", {}),
    ("bf16", "bf16", {}),
    ("int8", "int8", {}),
    ("int8-stochastic", "int8:stochastic=true", {}),
    ("int4", "int4", {}),
    ("qsgd", "qsgd", {}),
    ("terngrad", "terngrad", {}),
    ("sign-momentum", "sign", {"momentum": 0.9}),
    ("topk", "topk:ratio=0.05", {}),
    ("topk-int8", "topk:ratio=0.05,values=int8", {}),
    ("randomk-scaled", "randomk:ratio=0.1,scale=true", {}),
    ("randomk-momentum", "randomk:ratio=0.25,scale=false", {"momentum": 0.9}),
    ("threshold", "threshold:value=0.01", {}),
    ("dgc", "dgc:ratio=0.05", {}),
    ("powersgd", "powersgd:rank=2", {}),
    ("powersgd-alt", "powersgd:rank=1,alternate=true", {}),
    ("int8-server-ef", "int8", {"server_error_feedback": True}),
    ("int4-server-ef", "int4", {"server_error_feedback": True, "momentum": 0.5}),
    ("sign-server-ef", "sign", {"server_error_feedback": True}),
    ("int8-warmup-monitor", "int8", {"warmup_steps": 3, "monitor_every": 3}),
    ("topk-bf16-residual", "topk:ratio=0.05", {"residual_dtype": torch.bfloat16}),
    ("int8-bf16-residual", "int8", {"residual_dtype": torch.bfloat16}),
    ("topk-schedule", "topk:ratio=0.05", {"schedule": "exp", "ramp_steps": 6}),
    ("int2", "int2", {}),
    ("topk-chunk-int2", "topk:ratio=0.05,chunk=64,values=int2", {}),
    ("dct", "dct:chunk=16,topk=8", {}),
]

#: (spec, register_fsdp options)
FSDP_CASES = [("none", {}), ("fp16", {}), ("int8", {}), ("int4", {}), ("sign", {}), ("topk:ratio=0.05", {}),
              ("randomk:ratio=0.1", {}), ("dgc:ratio=0.05", {}), ("qsgd", {}), ("threshold:value=0.01", {}),
              ("sign", {"momentum": 0.9}), ("int8", {"residual_dtype": torch.bfloat16})]
DILOCO_CASES = ["none", "int8", "int4", "topk:ratio=0.05", "powersgd:rank=2"]


def _outer_adam(anchor):
    """An outer optimizer of the user's (``outer_optimizer=``): Adam on the anchors."""
    return torch.optim.Adam(anchor, lr=0.05)


#: DiLoCo's other options, name -> (inner optimizer, DiLoCo's keyword arguments): streaming (fragments, delay, mix),
#: the outer step's options, SparseLoCo, Muon inside, error feedback off and on, and a non-finite step (skipped: the
#: fragment restarts from its anchor); "skip" trains with SGD on ``_loss`` (rank W-1's loss times Inf at BAD_STEP)
DILOCO_VARIANTS = {
    "streaming": ("adamw", {"sync_every": 4, "fragments": 2, "delay": 1, "codec": "int8"}),
    "streaming-mix": ("adamw", {"sync_every": 4, "fragments": 3, "mix": 0.5, "codec": "int4"}),
    "streaming-delay2": ("adamw", {"sync_every": 3, "fragments": 3, "delay": 2, "mix": 0.75, "codec": "none"}),
    "outer-momentum": ("adamw", {"sync_every": 3, "outer_lr": 0.5, "outer_momentum": 0.5, "nesterov": False}),
    "outer-optimizer": ("adamw", {"sync_every": 3, "outer_optimizer": _outer_adam, "codec": "int8"}),
    "sparseloco": ("adamw", {"sync_every": 3, "outer": "sparseloco"}),
    "sparseloco-decay": ("adamw", {"sync_every": 3, "outer": "sparseloco", "error_decay": 0.8, "outer_lr": 0.9,
                                   "codec": "topk:ratio=0.05,values=int2"}),
    "muon": ("muon", {"sync_every": 3, "codec": "int4"}),
    "int4-no-ef": ("adamw", {"sync_every": 3, "codec": "int4", "error_feedback": False}),
    "topk-ef": ("adamw", {"sync_every": 3, "codec": "topk:ratio=0.05", "error_feedback": True, "seed": 3}),
    "skip": ("sgd", {"sync_every": 3, "codec": "int8"}),
}
#: the variants also run resumed from a state_dict taken after RESUME_AT steps (streaming: a fragment in flight);
#: the resumed run must give its uninterrupted twin's digest
DILOCO_RESUMED = ["streaming", "streaming-delay2", "sparseloco", "muon", "outer-momentum", "skip"]
RESUME_AT = 8
ADAM_CASES = ["onebitadam", "topk:ratio=0.05", "int8", "powersgd:rank=2"]
#: DeMo's options (chunk 16: the MLP's matrices in 2-D blocks, its biases in 1-D chunks)
DEMO_CASES = [{"chunk": 16, "topk": 8}, {"chunk": 16, "topk": 8, "sign": False, "weight_decay": 0.1}]


class Digest:
    """A running SHA-256 over tensors (dtype, shape, raw bytes) and plain values, in the order given, and beside it
    the ``mass``: the sum of the absolute values of every finite floating-point tensor added (in float64), a
    summary that another CPU's BLAS moves only in its last digits, compared within :data:`MASS_RTOL` where no exact
    recording of this machine exists."""

    def __init__(self):
        self.h = hashlib.sha256()
        self.mass = 0.0

    def add(self, obj) -> None:
        if isinstance(obj, torch.Tensor):
            t = _local(obj).detach().cpu().contiguous()
            self.h.update(f"{t.dtype}{tuple(t.shape)}".encode())
            self.h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
            if t.is_floating_point() and bool(torch.isfinite(t).all()):
                self.mass += float(t.double().abs().sum())
        elif isinstance(obj, dict):
            for k in sorted(obj, key=str):
                if k == "world" and "config" in obj:  # a Compressor state's world size: the case's W, added
                    continue  # after the digests were recorded; everything they covered is still covered
                if k == "config" and isinstance(obj[k], str):  # a description of the options, not a result
                    continue
                self.h.update(str(k).encode())
                self.add(obj[k])
        elif isinstance(obj, (list, tuple)):
            for v in obj:
                self.add(v)
        else:
            self.h.update(repr(obj).encode())

    def hex(self) -> str:
        return self.h.hexdigest()

    def result(self) -> tuple[str, float]:
        return self.h.hexdigest(), self.mass


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def _loss(model, rank, world, step):
    x, y = batch(rank, step)
    loss = nn.functional.cross_entropy(model(x), y)
    if step == BAD_STEP and rank == world - 1:
        loss = loss * float("inf")
    return loss


def _finite(params) -> bool:
    return all(bool(torch.isfinite(_local(p.grad)).all()) for p in params if p.grad is not None)


def _train(model, forward, average, opt, rank, world, d: Digest) -> None:
    """STEPS steps: backward, ``average()``, digest the gradients, step unless non-finite (GradScaler's rule)."""
    for step in range(STEPS):
        opt.zero_grad()
        _loss(forward, rank, world, step).backward()
        average()
        finite = _finite(model.parameters())
        d.add(finite)
        if finite:
            d.add([_local(p.grad) for p in model.parameters()])
            opt.step()
    d.add([_local(p) for p in model.parameters()])


def codec_case(rank, world, spec, options, mode) -> str:
    d = Digest()
    model = make_model()
    opts = {"min_numel": 256, **options}
    if mode == "hook":
        ddp = nn.parallel.DistributedDataParallel(model, bucket_cap_mb=0.01)
        comp = gradcompress.register_ddp_hook(ddp, spec, **opts)
        forward, average = ddp, (lambda: None)
    else:
        comp = gradcompress.Compressor(spec, **opts)
        forward, average = model, (lambda: comp.synchronize(model.parameters()))
    _train(model, forward, average, torch.optim.SGD(model.parameters(), lr=0.05), rank, world, d)
    d.add(comp.state_dict())
    stats = comp.stats()
    d.add([stats[k] for k in ("steps", "skipped", "raw_bytes", "wire_bytes", "monitor_bytes")])
    return d.result()


#: auto with a restored per-bucket plan (key -> spec), run for fewer steps than its first check: the plan's groups
#: by codec and the restored decision, without the clock-dependent measuring
AUTO_PLAN_CASES = [{0: "int8", 1: "int8", 2: "int4", 3: "int4", 4: "topk:ratio=0.05"}, {2: "int4", 3: "int4"}]


def auto_plan_case(rank, world, plan) -> str:
    d = Digest()
    model = make_model()
    ddp = nn.parallel.DistributedDataParallel(model, bucket_cap_mb=0.01)
    comp = gradcompress.register_ddp_hook(ddp, "auto:budget=any", min_numel=256)
    state = comp.state_dict()
    state["auto"]["plan"] = dict(plan)
    comp.load_state_dict(state)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    for step in range(comp.autopilot.first):
        opt.zero_grad()
        _loss(ddp, rank, world, step + 100).backward()  # steps past BAD_STEP: all finite
        d.add([p.grad for p in model.parameters()])
        opt.step()
    d.add([p for p in model.parameters()])
    d.add({k: v for k, v in comp.state_dict().items() if k != "auto"})
    d.add([comp.stats()[k] for k in ("steps", "skipped", "raw_bytes", "wire_bytes")])
    return d.result()


def fsdp_case(rank, world, spec, options) -> str:
    from torch.distributed.fsdp import fully_shard

    d = Digest()
    model = make_model()
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer)
    fully_shard(model)
    comp = gradcompress.register_fsdp(model, spec, **options)
    _train(model, model, lambda: None, torch.optim.SGD(model.parameters(), lr=0.05), rank, world, d)
    d.add(comp.state_dict())
    stats = comp.stats()
    d.add([stats[k] for k in ("steps", "skipped", "raw_bytes", "wire_bytes")])
    return d.result()


def diloco_case(rank, world, codec) -> str:
    d = Digest()
    model = make_model()
    opt = DiLoCo(model, torch.optim.AdamW(model.parameters(), lr=1e-2), sync_every=3, codec=codec)
    for step in range(STEPS):
        opt.zero_grad()
        x, y = batch(rank, step)
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        d.add(list(model.parameters()))
    d.add(opt.state_dict())
    d.add(opt.stats()["wire_bytes"])
    return d.result()


def _diloco(inner: str, options: dict):
    """A fresh model and DiLoCo over it (a collective: every rank starts from rank 0's parameters)."""
    model = make_model()
    if inner == "muon":
        opt = muon(model, adamw_lr=1e-2)
    elif inner == "sgd":
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
    else:
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    return model, DiLoCo(model, opt, **options)


def diloco_variant_case(rank, world, inner, options, resume_at=None):
    """(digest of the parameters after every step, the state dict and the step counters; that digest with the bytes
    sent added). ``resume_at``: after that many steps the model's and DiLoCo's state dicts are taken, DiLoCo closed,
    and the run goes on in a fresh model and DiLoCo that loaded them."""
    d = Digest()
    model, opt = _diloco(inner, options)
    for step in range(STEPS):
        if step == resume_at:
            saved = (model.state_dict(), opt.state_dict())
            opt.close()
            model, opt = _diloco(inner, options)
            model.load_state_dict(saved[0])
            opt.load_state_dict(saved[1])
        opt.zero_grad()
        _loss(model, rank, world, step + (0 if inner == "sgd" else 100)).backward()  # (100+: past BAD_STEP)
        opt.step()
        d.add(list(model.parameters()))
    d.add(opt.state_dict())
    stats = opt.stats()
    d.add([stats[k] for k in ("steps", "syncs", "skipped")])
    core = d.result()
    d.add([stats[k] for k in ("raw_bytes", "wire_bytes", "peak_sync_bytes")])
    opt.close()
    return core, d.result()


def adam_case(rank, world, codec) -> str:
    d = Digest()
    model = make_model()
    if codec == "onebitadam":
        opt = OneBitAdam(model.parameters(), lr=1e-2, warmup_steps=4)
    else:
        opt = CompressedAdam(model.parameters(), lr=1e-2, warmup_steps=4, codec=codec)
    for step in range(STEPS):
        opt.zero_grad()
        _loss(model, rank, world, step).backward()
        opt.step()
        d.add(list(model.parameters()))
    d.add(opt.state_dict())
    d.add(opt.bytes_sent())
    return d.result()


def demo_case(rank, world, options) -> str:
    d = Digest()
    model = make_model()
    opt = DeMo(model.parameters(), lr=1e-2, **options)
    for step in range(STEPS):
        opt.zero_grad()
        _loss(model, rank, world, step).backward()
        opt.step()
        d.add(list(model.parameters()))
    d.add(opt.state_dict())
    d.add([opt.bytes_sent(), opt.stats()["skipped"]])
    return d.result()


def all_cases(rank, world) -> dict:
    out = {}
    for name, spec, options in CODEC_CASES:
        for mode in ("hook", "sync"):
            out[f"W{world}/{mode}/{name}"] = codec_case(rank, world, spec, options, mode)
    for spec, options in FSDP_CASES:
        out[f"W{world}/fsdp/{spec}{sorted(options.items())}"] = fsdp_case(rank, world, spec, options)
    for codec in DILOCO_CASES:
        out[f"W{world}/diloco/{codec}"] = diloco_case(rank, world, codec)
    for name, (inner, options) in DILOCO_VARIANTS.items():
        core, out[f"W{world}/diloco/{name}"] = diloco_variant_case(rank, world, inner, options)
        if name in DILOCO_RESUMED:
            resumed, _ = diloco_variant_case(rank, world, inner, options, resume_at=RESUME_AT)
            assert resumed == core, f"DiLoCo {name}: the run resumed at step {RESUME_AT} differs from its twin's"
            out[f"W{world}/diloco-resume/{name}"] = resumed
    for codec in ADAM_CASES:
        out[f"W{world}/adam/{codec}"] = adam_case(rank, world, codec)
    for options in DEMO_CASES:
        out[f"W{world}/demo/{sorted(options.items())}"] = demo_case(rank, world, options)
    for plan in AUTO_PLAN_CASES:
        out[f"W{world}/auto-plan/{sorted(plan.items())}"] = auto_plan_case(rank, world, plan)
    # every rank's digest counts (FSDP's shards and DiLoCo's local steps differ by rank)
    everyone: list = [None] * world
    dist.all_gather_object(everyone, out)
    digests = {k: hashlib.sha256(" ".join(e[k][0] for e in everyone).encode()).hexdigest() for k in out}
    return {"digests": digests, "masses": {k: sum(e[k][1] for e in everyone) for k in out}}


def record_world(world: int) -> dict:
    """``{"digests": {case: hex}, "masses": {case: float}}`` for every case at ``world`` workers."""
    from gradcompress.testbed import launch

    return launch.run(all_cases, world, timeout=900)[0]


def record() -> dict:
    out: dict = {"digests": {}, "masses": {}}
    for world in (2, 4):
        got = record_world(world)
        out["digests"].update(got["digests"])
        out["masses"].update(got["masses"])
    return out


GOLDEN_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "golden")


def _cpuinfo() -> dict:
    """The first processor's vendor, model and flags from /proc/cpuinfo (empty elsewhere)."""
    out = {}
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if not line.strip():
                    break
                key, _, value = line.partition(":")
                out[key.strip()] = value.strip()
    except OSError:
        pass
    return out


def fingerprint() -> dict:
    """What float results here depend on: the CPU (vendor, model, flags), torch's version, vector width and BLAS."""
    cpu = _cpuinfo()
    config = torch.__config__.show()
    blas = sorted(set(re.findall(r"(?:BLAS_INFO|LAPACK_INFO)=\w+", config)))
    mkl = re.findall(r"Math Kernel Library Version [^\n]*", config)
    return {"machine": platform.machine(), "vendor": cpu.get("vendor_id", platform.processor()),
            "model": cpu.get("model name", ""), "family": cpu.get("cpu family", ""), "cpu_model": cpu.get("model", ""),
            "flags": hashlib.sha256(" ".join(sorted(cpu.get("flags", "").split())).encode()).hexdigest()[:16],
            "torch": torch.__version__, "capability": torch.backends.cpu.get_cpu_capability(),
            "blas": blas, "mkl": mkl}


def fingerprint_id(fp: dict) -> str:
    return hashlib.sha256(json.dumps(fp, sort_keys=True).encode()).hexdigest()[:12]


#: how far another machine's masses may lie from a recording's (relative): float sums in another order (another
#: vector width or BLAS) move the last digits of each step's results, and 20 steps of training carry them on, through
#: int4's rounding boundaries too. Measured against the AMD EPYC recording by forcing other kernels on it
#: (``MKL_CBWR``/``ATEN_CPU_CAPABILITY``, 0 digests left equal): AVX2 at most 3.5e-5 (W2/diloco/int4), SSE2 without
#: torch's vector kernels at most 1.6e-4 (W2/int4-server-ef); 1e-4 failed that run, so 1e-3
MASS_RTOL = 1e-3


def recorded_for(fp: dict) -> tuple[str, dict] | None:
    """(path, digests) of the recording made on a machine with fingerprint ``fp``, or None."""
    path = os.path.join(GOLDEN_DIR, f"{fingerprint_id(fp)}.json")
    if not os.path.exists(path):
        return None
    with open(path) as f:
        data = json.load(f)
    return (path, data["digests"]) if data["fingerprint"] == fp else None


def recorded_masses() -> tuple[str, dict]:
    """(path, masses) of a recording that has masses (the first by name): what a machine with no exact recording
    of its own is compared with, within :data:`MASS_RTOL`."""
    for name in sorted(os.listdir(GOLDEN_DIR)):
        with open(os.path.join(GOLDEN_DIR, name)) as f:
            data = json.load(f)
        if data.get("masses"):
            return os.path.join(GOLDEN_DIR, name), data["masses"]
    raise FileNotFoundError(f"no recording in {GOLDEN_DIR} has masses: record one with --record")


def save(recording: dict, commit: str) -> str:
    """Write ``recording`` (:func:`record`'s) as this machine's, recorded at ``commit``."""
    fp = fingerprint()
    path = os.path.join(GOLDEN_DIR, f"{fingerprint_id(fp)}.json")
    os.makedirs(GOLDEN_DIR, exist_ok=True)
    with open(path, "w") as f:
        json.dump({"fingerprint": fp, "recorded_at": commit, **recording}, f, indent=1, sort_keys=True)
        f.write("\n")
    return path


if __name__ == "__main__":
    if sys.argv[1:2] == ["--record"]:
        import subprocess

        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
        print(save(record(), head))
    else:
        print(json.dumps(record(), indent=1, sort_keys=True))
