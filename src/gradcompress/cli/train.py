"""``gradcompress train``: one training run with one scheme, of the digits MLP or (``--task lm``) the LM.

Locally (no ``RANK``/``WORLD_SIZE`` in the environment) it starts ``--workers`` processes
with a gloo process group on loopback, on the CPU. Under ``torchrun``::

    torchrun --nnodes=N --nproc-per-node=M -m gradcompress train --schemes powersgd:rank=2

it joins the process group torchrun describes (``init_process_group`` with backend
nccl when CUDA is available, else gloo) and, with CUDA, trains on ``cuda:LOCAL_RANK``.
Rank 0 prints the run's line and the demo's table of its one row (bytes per step, x fewer bytes than DDP,
ms/step, losses); with ``--out`` it also writes ``results.json``.
"""

from __future__ import annotations

import argparse
import json
import os

from ..scheme import ONEBITADAM, scheme_name
from .common import (CLIError, check_out_dir, human_bytes, nonnegative_int, positive_float, positive_int,
                     split_schemes)
from .demo import format_demo, printable
from .schemes import check, is_adam_scheme, onebitadam_problem
from .task import TASKS, RunConfig, summarize, train_worker


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> argparse.ArgumentParser:
    p = sub.add_parser(
        "train", help="one training run with one scheme (digits MLP, or --task lm; local workers, or under "
                      "torchrun)",
        description="Train one task with one compression scheme: --task digits (default), a small MLP on "
                    "scikit-learn's digits with SGD, or --task lm, a byte-level transformer on Python's "
                    "documentation with AdamW. Without torchrun it starts --workers local processes (gloo, CPU); "
                    "under torchrun (RANK and WORLD_SIZE set) it joins that process group (nccl and "
                    "cuda:LOCAL_RANK when CUDA is available, else gloo).",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="examples:\n"
               "  gradcompress train --schemes topk:ratio=0.01 --steps 300\n"
               "  gradcompress train --schemes auto\n"
               "  gradcompress train --schemes onebitadam\n"
               "  gradcompress train --task lm --schemes decoupled:topk=32,chunk=64\n"
               "  gradcompress train --fault-tolerant --schemes int8 --replicas 3 --kill-at 30 --restart-at 60\n"
               "  torchrun --nnodes=1 --nproc-per-node=4 -m gradcompress train --schemes powersgd:rank=2")
    p.add_argument("--schemes", "--codec", dest="codec", required=True, metavar="SPEC",
                   help="the one scheme to train with (--codec: its old name, still read): a codec spec (e.g. int8, "
                        "topk:ratio=0.01,values=int8, powersgd:rank=2), auto (the autopilot chooses per bucket), "
                        "onebitadam or decoupled (DeMo); "
                        "Compressor options may follow the codec's (sign:momentum=0.9 is sign with momentum "
                        "correction, the optimizer then runs without momentum); "
                        "CODEC,compressed_adam=true trains with CompressedAdam (Adam's momentum through the codec)")
    p.add_argument("--steps", type=positive_int, default=300, help="training steps (default 300)")
    p.add_argument("--lr", type=positive_float, default=None,
                   help="learning rate (default 0.05 for SGD; 1e-3 for onebitadam and decoupled, lm 3e-3)")
    p.add_argument("--workers", type=positive_int, default=2,
                   help="local worker processes when not under torchrun (default 2)")
    p.add_argument("--warmup-steps", type=nonnegative_int, default=None,
                   help="dense steps before compression starts (default 5; onebitadam and compressed_adam=true: their "
                        "dense Adam warm-up, default 20%% of the steps)")
    p.add_argument("--error-feedback", action=argparse.BooleanOptionalAction, default=None,
                   help="keep the compression error and add it to the next gradient (default: the library's "
                        "'auto': on for biased codecs, off for none, fp16/bf16 and the unbiased ones: qsgd, "
                        "terngrad, int8/int4 with stochastic=true, randomk with scale=true)")
    p.add_argument("--batch-size", type=positive_int, default=None,
                   help="minibatch per worker (default 32; lm: 16 windows of 64 bytes)")
    p.add_argument("--seed", type=nonnegative_int, default=0, help="seed (default 0)")
    p.add_argument("--task", choices=("digits", "lm"), default="digits",
                   help="digits (default) or lm: a byte-level transformer on Python's docs with AdamW")
    p.add_argument("--diloco", type=positive_int, default=None, metavar="H",
                   help="DiLoCo: H local SGD steps per worker, then the outer gradient averaged through the codec "
                        "(gradcompress.optim.DiLoCo, outer SGD lr 0.7 with Nesterov momentum 0.9; no DDP)")
    p.add_argument("--fsdp", action="store_true",
                   help="shard the model with FSDP2 (fully_shard per layer and on the root) and compress its "
                        "reduce-scatter (gradcompress.register_fsdp) instead of DDP's all-reduce")
    p.add_argument("--hsdp", action="store_true",
                   help="with --fsdp: HSDP, sharded inside each node of --workers-per-node workers and replicated "
                        "across nodes; the replicas' all-reduce goes through the codec (register_fsdp(..., mesh=))")
    p.add_argument("--workers-per-node", type=positive_int, default=2, metavar="G",
                   help="with --hsdp: workers per node, ranks in consecutive blocks (default 2)")
    p.add_argument("--params", choices=("int8", "bf16"), default=None,
                   help="with --fsdp: compress the parameter all-gathers (int8 blocks of 2048 values, or bf16); "
                        "the sharded parameters stay exact (default: exact all-gathers)")
    p.add_argument("--fault-tolerant", action="store_true",
                   help="under torchft: --replicas replica processes around torchft's lighthouse (started on "
                        "127.0.0.1 unless --lighthouse is given), the codec on gradcompress's torchft DDP; needs "
                        "pip install 'gradcompress[torchft]'")
    p.add_argument("--replicas", type=positive_int, default=3, help="with --fault-tolerant: replicas (default 3)")
    p.add_argument("--lighthouse", default=None, metavar="HOST:PORT",
                   help="with --fault-tolerant: a running torchft lighthouse to use")
    p.add_argument("--kill-at", type=nonnegative_int, default=None, metavar="STEP",
                   help="with --fault-tolerant: the last replica SIGKILLs itself at this step")
    p.add_argument("--restart-at", type=positive_int, default=None, metavar="STEP",
                   help="with --kill-at: restart it when the others reach this step")
    p.add_argument("--out", default=None, help="folder for results.json (default: write nothing)")
    p.set_defaults(run=run)
    return p


def under_torchrun() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def run(args: argparse.Namespace) -> int:
    from ..testbed import launch

    named = split_schemes([args.codec])
    if len(named) > 1:
        raise CLIError(f"train runs one scheme, got {len(named)} ({'; '.join(named)}); 'gradcompress demo "
                       "--schemes' compares several")
    args.codec = named[0] if named else args.codec  # none: check() says the scheme is empty
    if args.fault_tolerant:
        from . import faults

        return faults.train(args)
    if args.lighthouse or args.kill_at is not None or args.restart_at is not None:
        raise CLIError("--lighthouse, --kill-at and --restart-at apply to --fault-tolerant runs; add it")

    check(args.codec, fsdp=args.fsdp, diloco=bool(args.diloco))  # the scheme, and with --fsdp and --diloco
    if scheme_name(args.codec) == ONEBITADAM:
        problem = onebitadam_problem()
        if problem:
            raise CLIError(problem)
    if (args.hsdp or args.params) and not args.fsdp:
        raise CLIError("--hsdp and --params apply to --fsdp runs; add --fsdp")
    out_dir = check_out_dir(args.out) if args.out else None
    warmup = 5 if args.warmup_steps is None else args.warmup_steps
    scheme = args.codec.strip()
    adam_warmup = args.warmup_steps if is_adam_scheme(scheme) else None  # explicit: Adam's warm-up
    batch_size = args.batch_size or (16 if args.task == "lm" else 32)
    cfg = RunConfig(scheme=scheme, steps=args.steps, batch_size=batch_size, lr=args.lr,
                    warmup_steps=warmup, seed=args.seed,
                    error_feedback="auto" if args.error_feedback is None else args.error_feedback, fsdp=args.fsdp,
                    hsdp=args.workers_per_node if args.hsdp else 0, params=args.params,
                    diloco=args.diloco or 0, task=args.task, adam_warmup=adam_warmup)

    if under_torchrun():
        records, world, rank = _run_torchrun(cfg)
        if rank != 0:
            return 0
    else:
        data = TASKS[args.task].load(args.seed)
        world, rank = args.workers, 0
        records = launch.run(train_worker, world, data, cfg, timeout=120 + 2.0 * args.steps)

    summary = summarize(records, cfg, world)
    print(printable(format_summary(summary, cfg, world)))
    if out_dir:
        path = os.path.join(out_dir, "results.json")
        with open(path, "w") as f:
            json.dump({"runs": [summary]}, f, indent=1, allow_nan=False)
        print(f"wrote {path}")
    return 0


def format_summary(summary: dict, cfg: RunConfig, world: int) -> str:
    """The run's line (scheme, layout, workers, steps) over the demo's table of its one row, with its legend."""
    mode = (f" (HSDP, nodes of {cfg.hsdp})" if cfg.hsdp else " (FSDP)") + \
        (f", params {cfg.params}" if cfg.params else "") if cfg.fsdp else f" (DiLoCo, H={cfg.diloco})" if cfg.diloco else ""
    params_text = (f"; + {human_bytes(summary['param_bytes_per_step'])} per step of compressed parameter all-gathers "
                   "(not in bytes/step)") if cfg.params else ""
    fsdp_text = ("; FSDP: its gradient reduce-scatter against DDP's all-reduce (a dense reduce-scatter sends half of "
                 "it: 2.0x; FSDP's parameter all-gathers are not counted)") if cfg.fsdp else ""
    head = f"{cfg.scheme}{mode}: {world} workers, {summary['steps']} steps{params_text}{fsdp_text}"
    return head + "\n" + format_demo([summary], world, versus_none=False)


def _run_torchrun(cfg: RunConfig):
    """Join torchrun's process group, train, and gather every rank's record on rank 0."""
    import torch
    import torch.distributed as dist

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(local_rank)
    device = f"cuda:{local_rank}" if cuda else "cpu"
    own_group = not dist.is_initialized()
    if own_group:
        dist.init_process_group("nccl" if cuda else "gloo")
    try:
        data = TASKS[cfg.task].load(cfg.seed)
        record = train_worker(rank, world, data, cfg, device)
        records = [None] * world if rank == 0 else None
        dist.gather_object(record, records, dst=0)
    finally:
        if own_group:
            dist.destroy_process_group()
    return records, world, rank
