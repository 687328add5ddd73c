"""Portable golden results: what does not depend on the CPU's BLAS or vector width, compared bit for bit everywhere.

:mod:`golden_workers` trains a model (matrix products: another CPU's BLAS moves the last bits), so its exact digests
hold only on the machine that recorded them. Here nothing is trained: every codec case of
:data:`golden_workers.CODEC_CASES` runs ``Compressor.synchronize`` on 2 gloo workers for :data:`STEPS` steps on
gradients made by integer arithmetic (exact in float32 on every machine), and each rank digests, in order, the
averaged gradients of every step, the Compressor's state dict and its byte counters. Element-wise arithmetic,
maxima, rounding and the sum of two ranks are exact, so these digests are the same on every x86-64 machine.

Cases whose codec reduces in float (a sum, a norm or a matrix product: its order follows the vector width or the
BLAS) are in :data:`NOT_PORTABLE` with the reason; they stay guarded exactly on a recorded machine and by their
mass elsewhere (``test_golden.py``). The split was measured, not assumed: this module's ``--check-portable`` runs
every case under torch's and MKL's other kernels (``ATEN_CPU_CAPABILITY``, ``MKL_CBWR``) and lists the cases whose
digests moved.

``python tests/golden_portable.py --record`` writes ``tests/golden/portable.json``.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(__file__))

import gradcompress
from golden_workers import CODEC_CASES, Digest

STEPS = 3
#: the gradients' shapes: two matrices compressed (min_numel 256), a vector sent dense
SHAPES = [(48, 40), (40,), (10, 48)]
PATH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "golden", "portable.json")
#: case -> why its digest may move with the CPU (measured with ``--check-portable``)
NOT_PORTABLE = {"powersgd": "matrix products (BLAS)", "powersgd-alt": "matrix products (BLAS)",
                "dct": "the DCT is a matrix product (BLAS)"}


def gradient(shape: tuple[int, ...], rank: int, step: int, index: int) -> torch.Tensor:
    """Values in [-1000, 1000] / 997 from integer arithmetic: the same float32 bits on every machine."""
    n = 1
    for s in shape:
        n *= s
    i = torch.arange(n, dtype=torch.int64)
    v = (i * (7919 + 104729 * index) + 31337 * rank + 65537 * step) % 2001 - 1000
    return (v.to(torch.float32) / 997.0).reshape(shape)


def case(rank: int, spec: str, options: dict) -> str:
    """This rank's digest of ``STEPS`` synchronize calls of one codec case."""
    d = Digest()
    comp = gradcompress.Compressor(spec, **{"min_numel": 256, **options})
    params = [torch.nn.Parameter(torch.zeros(s)) for s in SHAPES]
    for step in range(STEPS):
        for j, p in enumerate(params):
            p.grad = gradient(SHAPES[j], rank, step, j)
        comp.synchronize(params)
        d.add([p.grad for p in params])
    d.add(comp.state_dict())
    stats = comp.stats()
    d.add([stats[k] for k in ("steps", "skipped", "raw_bytes", "wire_bytes")])
    return d.hex()


def all_cases(rank: int, world: int) -> dict[str, str]:
    """{case name: digest over every rank} for every codec case."""
    out = {name: case(rank, spec, options) for name, spec, options in CODEC_CASES}
    everyone: list = [None] * world
    dist.all_gather_object(everyone, out)
    return {k: hashlib.sha256(" ".join(e[k] for e in everyone).encode()).hexdigest() for k in out}


def digests() -> dict[str, str]:
    from gradcompress.testbed import launch

    return launch.run(all_cases, 2, timeout=600)[0]


def recorded() -> dict[str, str]:
    with open(PATH) as f:
        return json.load(f)["digests"]


def _under(env: dict[str, str]) -> dict[str, str]:
    """The digests computed in a fresh process with ``env`` added (other kernels forced)."""
    code = "import golden_portable, json; print(json.dumps(golden_portable.digests()))"
    out = subprocess.run([sys.executable, "-c", code], cwd=os.path.dirname(os.path.abspath(__file__)),
                         env={**os.environ, **env}, capture_output=True, text=True, check=True).stdout
    return json.loads(out.strip().splitlines()[-1])


#: the other kernels ``--check-portable`` forces: torch's AVX2 and scalar paths, MKL's AVX2 and SSE2 paths, and
#: torch's own operations in place of gradcompress's compiled kernels (where these cannot be built)
OTHER_KERNELS = [{"ATEN_CPU_CAPABILITY": "avx2", "MKL_CBWR": "AVX2"},
                 {"ATEN_CPU_CAPABILITY": "default", "MKL_CBWR": "COMPATIBLE"},
                 {"GRADCOMPRESS_FAST": "0"}]


def check_portable() -> dict[str, list[str]]:
    """{case: [the kernels under which its digest moved]}: the cases that are not portable."""
    here = digests()
    moved: dict[str, list[str]] = {}
    for env in OTHER_KERNELS:
        other = _under(env)
        for k in here:
            if other[k] != here[k]:
                moved.setdefault(k, []).append(" ".join(f"{a}={b}" for a, b in env.items()))
    return moved


def main() -> None:
    if sys.argv[1:2] == ["--record"]:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
        got = {k: v for k, v in digests().items() if k not in NOT_PORTABLE}
        os.makedirs(os.path.dirname(PATH), exist_ok=True)
        with open(PATH, "w") as f:
            json.dump({"recorded_at": head, "digests": got}, f, indent=1, sort_keys=True)
            f.write("\n")
        print(PATH)
    elif sys.argv[1:2] == ["--check-portable"]:
        print(json.dumps(check_portable(), indent=1, sort_keys=True))
    else:
        print(json.dumps(digests(), indent=1, sort_keys=True))


if __name__ == "__main__":
    main()
