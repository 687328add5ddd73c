"""``gradcompress bench``: speed, size and error of every codec on one gradient-sized tensor.

For each codec: the median over ``--repeats`` runs of ``encode`` and of ``decode``
(after one untimed warm-up run), reported as GB/s of input (float32 bytes / seconds)
and as (encode + decode) / (a float16 round trip ``x.half().float()`` timed in the same
run); the payload ratio (input bytes / ``Payload.nbytes``: one tensor, no exchange, so not the "x fewer bytes
than DDP" that ``demo`` and ``train`` print) and the relative error
||decode(encode(x)) - x|| / ||x||.

The tensor: ``--numel`` float32 values drawn from N(0, 1e-3^2) (a gradient's scale;
only ``threshold``'s result depends on the scale). ``powersgd`` codecs see it as a
4096 x (numel // 4096) matrix (the few trailing elements dropped); every other codec
sees it as a flat vector. Single-process round trips, no communication.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from ..spec import scheme_name
from .common import CLIError, positive_int, progress_bars, split_schemes, text_table
from .common import fmt as f

if TYPE_CHECKING:
    import torch

EXTRA_CODECS = ("topk:ratio=0.01,values=int8", "int8:stochastic=true", "powersgd:rank=4")
MATRIX_ROWS = 4096


def default_codecs() -> list[str]:
    import gradcompress

    return gradcompress.available() + list(EXTRA_CODECS)


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> argparse.ArgumentParser:
    p = sub.add_parser(
        "bench", help="encode/decode speed, payload ratio and error of every codec",
        description="Time encode and decode of every codec on one gradient-sized tensor and compare with a "
                    "float16 round trip; report the payload ratio (input bytes / encoded bytes, no exchange) and "
                    "relative error.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="Codecs: every registered codec with its default options, plus " + "; ".join(EXTRA_CODECS) +
               ".\nChoose some with --schemes (';'-separated and/or repeated, since specs contain commas):\n"
               "  gradcompress bench --schemes 'int8;topk:ratio=0.01,values=int8' --numel 1000000\n"
               "  gradcompress bench --in-step --schemes 'none;int8;sign;topk:ratio=0.01;powersgd:rank=4'")
    p.add_argument("--numel", type=positive_int, default=25_000_000,
                   help="elements of the float32 tensor (default 25000000, 100 MB)")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="where the tensor lives (default cpu)")
    p.add_argument("--repeats", type=positive_int, default=None,
                   help="timed runs per codec; the median counts (default 5; --in-step: 6 steps)")
    p.add_argument("--schemes", "--codecs", action="extend", nargs="+", metavar="SPEC", dest="codecs",
                   help="codec specs to time (';'-separated and/or repeated; default: all). --codecs: the old name, "
                        "still read")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.add_argument("--seed", type=int, default=0, help="seed of the tensor and the codecs (default 0)")
    p.add_argument("--in-step", action="store_true",
                   help="time one whole Compressor step (synchronize, library defaults) on --workers local gloo "
                        "processes against a dense all_reduce of the same gradients, with its memory")
    p.add_argument("--workers", type=positive_int, default=2, help="--in-step: local processes (default 2)")
    p.add_argument("--size", type=positive_int, default=2048, help="--in-step: gradient matrices are SIZE x SIZE "
                   "(default 2048)")
    p.add_argument("--matrices", type=positive_int, default=3, help="--in-step: how many (default 3)")
    p.add_argument("--versus-torch", action="store_true",
                   help="--in-step: instead, DDP steps (backward of --matrices bias-free SIZE x SIZE linear layers, "
                        "batch 64, one bucket) with PyTorch's fp16_compress_hook and powerSGD_hook (rank 4) against "
                        "ours (fp16, powersgd:rank=4, int8) and plain DDP, side by side")
    p.set_defaults(run=run)
    return p


def _timer(device):
    import torch

    def now() -> float:
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return time.perf_counter()

    return now


def _median_time(fn, repeats: int, now) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        start = now()
        fn()
        times.append(now() - start)
    return statistics.median(times)


def bench_codec(spec: str, x: torch.Tensor, repeats: int, fp16_seconds: float, now: Callable[[], float],
                seed: int = 0) -> dict:
    import torch

    import gradcompress

    codec = gradcompress.make(spec)
    if codec.name == "powersgd":
        cols = max(1, x.numel() // MATRIX_ROWS)
        rows = min(MATRIX_ROWS, x.numel())
        x = x[: rows * cols].view(rows, cols)
    payload = codec.encode(x, seed=seed)
    enc = _median_time(lambda: codec.encode(x, seed=seed), repeats, now)
    dec = _median_time(lambda: codec.decode(payload), repeats, now)
    y = codec.decode(payload)
    in_bytes = x.numel() * x.element_size()
    norm = torch.linalg.vector_norm(x.float()).item()
    err = torch.linalg.vector_norm(y.float() - x.float()).item() / norm if norm else 0.0
    return {
        "codec": spec,
        "canonical": codec.spec,
        "shape": list(x.shape),
        "encode_seconds": enc,
        "decode_seconds": dec,
        "encode_gbps": in_bytes / enc / 1e9 if enc else None,
        "decode_gbps": in_bytes / dec / 1e9 if dec else None,
        "vs_fp16_roundtrip": (enc + dec) / fp16_seconds if fp16_seconds else None,
        "payload_bytes": payload.nbytes,
        "compression_ratio": in_bytes / payload.nbytes if payload.nbytes else None,
        "relative_error": err if math.isfinite(err) else None,
    }


def run(args: argparse.Namespace) -> int:
    import torch

    import gradcompress

    specs = split_schemes(args.codecs) if args.codecs else default_codecs()
    if not specs:
        raise CLIError("--schemes is empty")
    valid = ", ".join(gradcompress.available())
    for s in specs:
        try:
            gradcompress.make(s)
        except (ValueError, TypeError) as err:
            msg = " ".join(str(err).split())
            if "unknown codec" in msg:
                msg = f"unknown codec {scheme_name(s)!r}; valid codecs: {valid}"
            raise CLIError(msg) from None
    if args.in_step:
        from .instep import format_in_step, run_in_step

        if args.device != "cpu":
            raise CLIError("--in-step runs gloo workers on the CPU; --device cuda does not apply")
        if args.versus_torch:
            from .instep import format_ddp_versus_torch, run_ddp_versus_torch

            result = run_ddp_versus_torch(args.workers, args.size, args.matrices, 64, args.repeats or 6, args.seed)
            print(json.dumps(result, indent=1, allow_nan=False) if args.json else format_ddp_versus_torch(result))
            return 0
        result = run_in_step(specs, args.workers, args.size, args.matrices, args.repeats or 6, args.seed)
        print(json.dumps(result, indent=1, allow_nan=False) if args.json else format_in_step(result))
        return 0
    args.repeats = args.repeats or 5
    if args.device == "cuda" and not torch.cuda.is_available():
        raise CLIError("--device cuda: CUDA is not available in this PyTorch build or on this machine")
    device = torch.device(args.device)
    now = _timer(device)
    g = torch.Generator(device=device).manual_seed(args.seed)
    try:
        x = torch.randn(args.numel, generator=g, device=device) * 1e-3
    except (RuntimeError, MemoryError) as err:
        raise CLIError(f"cannot allocate a tensor of {args.numel} float32 values on {device}: "
                       f"{' '.join(str(err).split())[:200]}") from None
    fp16 = _median_time(lambda: x.half().float(), args.repeats, now)
    in_bytes = x.numel() * x.element_size()

    from tqdm import tqdm

    rows = []
    for spec in tqdm(specs, desc="bench", unit="codec", leave=False, file=sys.stderr, disable=not progress_bars()):
        rows.append(bench_codec(spec, x, args.repeats, fp16, now, args.seed))
    result = {"numel": args.numel, "device": str(device), "repeats": args.repeats, "threads": torch.get_num_threads(),
              "fp16_roundtrip_seconds": fp16, "fp16_roundtrip_gbps": in_bytes / fp16 / 1e9 if fp16 else None,
              "codecs": rows}
    if args.json:
        print(json.dumps(result, indent=1, allow_nan=False))
    else:
        print(format_bench(result))
    return 0


def format_bench(result: dict) -> str:
    head = ("codec", "encode GB/s", "decode GB/s", "enc+dec ms", "x fp16 trip", "payload ratio", "rel. error")
    rows = [head] + [(r["codec"], f(r["encode_gbps"], ".2f"), f(r["decode_gbps"], ".2f"),
                      f(1000 * (r["encode_seconds"] + r["decode_seconds"]), ".2f"),
                      f(r["vs_fp16_roundtrip"], ".1f"), f(r["compression_ratio"], ".1f"),
                      f(r["relative_error"], ".3g")) for r in result["codecs"]]
    title = (f"{result['numel']:,} float32 values on {result['device']} ({result['threads']} threads), "
             f"median of {result['repeats']}; float16 round trip x.half().float(): "
             f"{1000 * result['fp16_roundtrip_seconds']:.2f} ms ({f(result['fp16_roundtrip_gbps'], '.2f')} GB/s)")
    return text_table(title, rows, "enc+dec ms: encode + decode time of the tensor; x fp16 trip: (encode + decode "
                      "time) / float16 round trip time; payload ratio: input bytes / the encoded payload's bytes, one "
                      "tensor and no exchange (not bytes sent against DDP: a payload all-gathered over W workers is "
                      "sent W-1 times, DDP's all-reduce sends 2(W-1)/W of the gradient; 'gradcompress demo' and "
                      "'train' print x fewer bytes than DDP); rel. error: ||decode - x|| / ||x||; powersgd on a 4096 "
                      "x (numel/4096) matrix")
