"""Start N worker processes on this machine with a gloo process group (no launcher needed).

Used by the CLI's ``demo`` and by the tests. ``run(fn, world_size, *args)`` calls
``fn(rank, world_size, *args)`` in each worker after ``init_process_group`` and returns
the list of their results (rank order). If a worker raises, the others are stopped and
:class:`WorkerError` carries that worker's traceback; if the run exceeds ``timeout``
(a deadlock, say), every worker is killed and ``TimeoutError`` is raised. Nothing is
left running either way. ``fn`` must be a module-level function (it is pickled).
"""

from __future__ import annotations

import contextlib
import datetime
import os
import pickle
import queue as queue_mod
import runpy
import socket
import subprocess
import sys
import time
import traceback
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any, cast

import torch.multiprocessing as mp

if TYPE_CHECKING:
    import torch.distributed as dist


class WorkerError(RuntimeError):
    """A worker process raised; ``rank`` and the worker's traceback text are kept."""

    def __init__(self, rank: int, text: str):
        super().__init__(f"worker {rank} failed:\n{text}")
        self.rank = rank
        self.text = text


@contextlib.contextmanager
def one_process_group() -> Iterator[dist.ProcessGroup | None]:
    """A gloo process group of this process alone (rank 0 of 1, in memory: no port), destroyed on exit: what a
    single-process DiLoCo, a test or a script run without torchrun, needs (``DiLoCo`` refuses to run without a
    group). Refused if ``torch.distributed`` is already initialised."""
    import torch.distributed as dist

    if dist.is_initialized():
        raise RuntimeError("one_process_group: torch.distributed is already initialised")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield dist.group.WORLD
    finally:
        dist.destroy_process_group()


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
    """Workers fork from a server that has imported torch once (a spawned worker spends ~2 s importing it), and
    ``torch._dynamo``, which an optimizer's first step imports (another ~2 s: AdamW's first step here)."""
    if "forkserver" not in mp.get_all_start_methods():  # Windows
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "torch.distributed", "torch._dynamo", "gradcompress"])
    return ctx


class Child:
    """``python -m MODULE ARGS...`` or ``python SCRIPT ARGS...`` (``argv``, ``argv[0]`` this interpreter) run in a
    process forked from the fork server (torch already imported: a replica starts in a fraction of the ~2 s a fresh
    interpreter spends importing it), with ``env`` as its whole environment and its stdout and stderr appended to
    ``out``. What :class:`subprocess.Popen` offers a caller that starts, polls, signals and waits: ``pid``,
    ``poll()``, ``returncode`` (the exit code, or minus the signal), ``kill()``, ``terminate()``,
    ``send_signal()``, ``wait(timeout)``. :func:`child` falls back to a Popen where it cannot fork."""

    def __init__(self, argv: list[str], env: dict, out: str):
        self.args = list(argv)
        self._proc = _context().Process(target=_child_main, args=(self.args[1:], dict(env), out))
        self._proc.start()
        self.pid = self._proc.pid

    def poll(self) -> int | None:
        return self._proc.exitcode

    @property
    def returncode(self) -> int | None:
        return self._proc.exitcode

    def send_signal(self, sig: int) -> None:
        if self._proc.exitcode is None:
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:
                pass

    def kill(self) -> None:
        self.send_signal(9)

    def terminate(self) -> None:
        self.send_signal(15)

    def wait(self, timeout: float | None = None) -> int:
        self._proc.join(timeout)
        if self._proc.exitcode is None:
            raise subprocess.TimeoutExpired(self.args, cast(float, timeout))  # None: join waited until the end
        return self._proc.exitcode


def child(argv: list[str], env: dict, out: str) -> Child | subprocess.Popen:
    """A :class:`Child` running ``argv`` where the fork server can run it (this interpreter, ``-m MODULE`` or a
    script); else a :class:`subprocess.Popen` of it (output appended to ``out``)."""
    forkable = len(argv) >= 2 and argv[0] == sys.executable and (argv[1] == "-m" or argv[1].endswith(".py"))
    if forkable and "forkserver" in mp.get_all_start_methods():
        return Child(argv, env, out)
    with open(out, "a") as f:
        return subprocess.Popen(argv, stdout=f, stderr=subprocess.STDOUT, env=env)


def _child_main(args: list[str], env: dict, out: str) -> None:
    """In the forked process: the environment, the output, ``sys.path`` and ``sys.argv`` a fresh interpreter would
    have, then the module or script as ``__main__``."""
    os.environ.clear()
    os.environ.update(env)
    fd = os.open(out, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    sys.stdout.flush()
    sys.stderr.flush()
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    extra = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p and p not in sys.path]
    sys.path[1:1] = extra
    if args[0] == "-m":
        sys.argv = [args[1], *args[2:]]
        runpy.run_module(args[1], run_name="__main__", alter_sys=True)
    else:
        sys.argv = list(args)
        sys.path.insert(0, os.path.dirname(os.path.abspath(args[0])))
        runpy.run_path(args[0], run_name="__main__")


def run(fn: Callable[..., Any], world_size: int, *args: Any, timeout: float = 120.0, collective_timeout: float = 30.0,
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
                    raise WorkerError(dead[0], f"exited with code {procs[dead[0]].exitcode} without a result") from None
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
