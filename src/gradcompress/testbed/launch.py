"""Start N worker processes on this machine with a gloo process group (no launcher needed).

Used by the CLI's ``demo`` and by the tests. ``run(fn, world_size, *args)`` calls
``fn(rank, world_size, *args)`` in each worker after ``init_process_group`` and returns
the list of their results (rank order). If a worker raises, the others are stopped and
:class:`WorkerError` carries that worker's traceback; if the run exceeds ``timeout``
(a deadlock, say), every worker is killed and ``TimeoutError`` is raised. Nothing is
left running either way. ``fn`` must be a module-level function (it is pickled).
"""

from __future__ import annotations

import datetime
import os
import pickle
import queue as queue_mod
import socket
import time
import traceback

import torch.multiprocessing as mp


class WorkerError(RuntimeError):
    """A worker process raised; ``rank`` and the worker's traceback text are kept."""

    def __init__(self, rank: int, text: str):
        super().__init__(f"worker {rank} failed:\n{text}")
        self.rank = rank
        self.text = text


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(fn, rank: int, world: int, port: int, args: tuple, results, collective_timeout: float, threads: int,
            environ: dict):
    import torch
    import torch.distributed as dist

    os.environ.clear()  # the caller's environment at the call, not the fork server's at its start
    os.environ.update(environ)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank))
    torch.set_num_threads(threads)
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=collective_timeout))
        out = fn(rank, world, *args)
        results.put((rank, True, pickle.dumps(out)))
    except BaseException:  # report everything, including KeyboardInterrupt
        results.put((rank, False, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:
                pass


def _context():
    """Workers fork from a server that has imported torch once (a spawned worker spends ~2 s importing it)."""
    if "forkserver" not in mp.get_all_start_methods():  # Windows
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "torch.distributed", "gradcompress"])
    return ctx


def run(fn, world_size: int, *args, timeout: float = 120.0, collective_timeout: float = 30.0,
        threads: int = 1) -> list:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` local gloo workers; see the module doc."""
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be a positive integer, got {world_size!r}")
    ctx = _context()
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_worker, args=(fn, r, world_size, port, args, results, collective_timeout, threads,
                                                   dict(os.environ)),
                         daemon=True) for r in range(world_size)]
    for p in procs:
        p.start()
    out: dict[int, object] = {}
    deadline = time.monotonic() + timeout
    try:
        while len(out) < world_size:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError(f"workers did not finish within {timeout:.0f} s (deadlock?); "
                                   f"finished: {sorted(out)}")
            try:
                rank, ok, data = results.get(timeout=min(remaining, 1.0))
            except queue_mod.Empty:
                dead = [r for r, p in enumerate(procs) if p.exitcode not in (None, 0) and r not in out]
                if dead:
                    raise WorkerError(dead[0], f"exited with code {procs[dead[0]].exitcode} without a result")
                continue
            if not ok:
                raise WorkerError(rank, data)
            out[rank] = pickle.loads(data)
        for p in procs:
            p.join(timeout=10)
        return [out[r] for r in range(world_size)]
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
        for p in procs:
            p.join(timeout=5)
