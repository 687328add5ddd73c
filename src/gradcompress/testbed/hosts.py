"""One worker process per emulated host on a :class:`gradcompress.testbed.netns.Testbed`, all torn down after.

Used by ``gradcompress netbench``. :func:`run_workers` builds the hosts (network namespaces
on one bridge, every link shaped; see :mod:`gradcompress.testbed.netns`), starts ``python -m MODULE
--worker CONFIG.json`` inside each host's namespace, waits for every worker and returns what
each wrote (:func:`write_result`), by rank. A worker's config is the caller's ``settings`` plus
``parent`` (this process's pid), ``rank``, ``world``, ``master`` (host 0's address), ``port``,
``ifname`` (the host's link interface, also ``GLOO_SOCKET_IFNAME``), ``node``, ``local_rank``,
``workers_per_node`` and ``out`` (its result file).

Nodes: each host is a node and runs ``workers_per_node`` G workers (default 1), ranks in consecutive
blocks of G (node ``r // G``, local rank ``r % G``), with torchrun's variables (``RANK``,
``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``, ``GROUP_RANK``, ``WORLD_SIZE``) so that ``topology="auto"``
finds the nodes as under torchrun. gloo binds every worker to the address of ``GLOO_SOCKET_IFNAME``
(the node's veth); the G workers of a node share that address, and a connection to one's own
namespace's address is routed over the namespace's loopback (the kernel's local table), so traffic
between workers of a node never crosses the veth: its ``tx_bytes`` counts what leaves the node.

SIGINT, SIGTERM and SIGHUP stop a run (as ``KeyboardInterrupt``); the namespaces, links,
processes and scratch files are removed on every way out (success, error, timeout, signal),
with those signals held until the teardown is done. A worker that fails ends the run with
:class:`gradcompress.testbed.launch.WorkerError` carrying the tail of its log.

The worker's side: :func:`worker_config` (read the config, exit when the parent is gone),
:func:`read_tx_bytes` (the link interface's byte counter) and :func:`write_result`.

This module is library level: it imports nothing from :mod:`gradcompress.cli`.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time

from . import launch, netns

PORT = 29500
SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
#: what a torchrun child inherits and the workers must not (they form their own group)
TORCHRUN_VARIABLES = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK")


class TestbedError(RuntimeError):
    """The emulated network could not be built (the message is one line)."""

    __test__ = False  # not a pytest test class


# --------------------------------------------------------------------------- the parent
def run_workers(hosts: int, settings: dict, *, module: str, rate_bit: float, delay_s: float, timeout: float,
                env: dict | None = None, label: str = "testbed", timeout_hint: str = "",
                workers_per_node: int = 1) -> list[dict]:
    """Run ``python -m module --worker CONFIG`` ``workers_per_node`` times on each of ``hosts`` emulated hosts
    (nodes); every worker's result, by rank.

    ``env``: extra environment variables for the workers. ``label`` starts the progress lines
    copied from rank 0's log to stderr (``label: ...``) and the messages; ``timeout_hint`` ends
    the ``TimeoutError`` raised after ``timeout`` seconds.
    """
    tmp = tempfile.mkdtemp(prefix=f"gradcompress-{label}-")
    bed = netns.Testbed(hosts, rate_bit=rate_bit, delay_s=delay_s)
    previous = _interrupt_on_signals()
    logs: list = []
    echo = None
    try:
        try:
            bed.up()
        except netns.NetnsError as err:
            raise TestbedError(f"could not build the test network: {err}") from None
        _start_workers(bed, settings, module, tmp, env or {}, logs, workers_per_node)
        echo = _Echo(os.path.join(tmp, "rank0.log"), f"{label}: ")
        _wait(bed, tmp, timeout, label, timeout_hint)
        return [_read_json(os.path.join(tmp, f"rank{rank}.json")) for rank in range(hosts * workers_per_node)]
    finally:
        _teardown(bed, logs, tmp, echo, previous, label)


def _interrupt_on_signals() -> dict:
    """Make SIGINT, SIGTERM and SIGHUP raise KeyboardInterrupt; the handlers they had, to restore."""

    def on_signal(signum, frame):
        raise KeyboardInterrupt(f"signal {signum}")

    previous = {}
    for sig in SIGNALS:  # SIGINT too: a shell may have started us with SIGINT ignored
        try:
            previous[sig] = signal.signal(sig, on_signal)
        except (ValueError, OSError):  # not the main thread
            pass
    return previous


def node_environment(rank: int, node: int, local_rank: int, world: int, per_node: int) -> dict:
    """torchrun's variables for a worker of a node (one worker per host: every host its own node)."""
    return {"RANK": str(rank), "LOCAL_RANK": str(local_rank), "LOCAL_WORLD_SIZE": str(per_node),
            "GROUP_RANK": str(node), "WORLD_SIZE": str(world)}


def _start_workers(bed: netns.Testbed, settings: dict, module: str, tmp: str, extra_env: dict, logs: list,
                   per_node: int = 1) -> None:
    """Write each rank's config into ``tmp`` and start its worker in its node's namespace (``per_node`` workers per
    host, consecutive ranks), logging to ``tmp/rank<r>.log``."""
    env = dict(os.environ, GLOO_SOCKET_IFNAME=bed.ifname, PYTHONUNBUFFERED="1", **extra_env)
    for key in TORCHRUN_VARIABLES + ("LOCAL_WORLD_SIZE", "GROUP_RANK"):  # not a torchrun child
        env.pop(key, None)
    world = bed.hosts * per_node
    for rank in range(world):
        node, local = divmod(rank, per_node)
        cfg = {**settings, "parent": os.getpid(), "rank": rank, "world": world, "master": bed.addresses[0],
               "port": PORT, "ifname": bed.ifname, "node": node, "local_rank": local, "workers_per_node": per_node,
               "out": os.path.join(tmp, f"rank{rank}.json")}
        path = os.path.join(tmp, f"rank{rank}.cfg.json")
        with open(path, "w") as f:
            json.dump(cfg, f)
        log = open(os.path.join(tmp, f"rank{rank}.log"), "w")
        logs.append(log)
        bed.spawn(node, [sys.executable, "-m", module, "--worker", path],
                  env={**env, **node_environment(rank, node, local, world, per_node)},
                  stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


def _wait(bed: netns.Testbed, tmp: str, timeout: float, label: str, hint: str) -> None:
    """Until every worker has exited 0; ``WorkerError`` for the first that failed, ``TimeoutError`` after ``timeout``."""
    deadline = time.monotonic() + timeout
    while True:
        codes = [p.poll() for p in bed.procs]
        bad = [r for r, c in enumerate(codes) if c not in (None, 0)]
        if bad:
            r = bad[0]
            time.sleep(0.5)  # let a peer's clearer error land in its log
            raise launch.WorkerError(r, log_tail(tmp, r) or f"exited with code {codes[r]}")
        if all(c == 0 for c in codes):
            return
        if time.monotonic() > deadline:
            raise TimeoutError(f"{label} did not finish within {timeout:.0f} s{hint}")
        time.sleep(0.2)


def _teardown(bed: netns.Testbed, logs: list, tmp: str, echo: _Echo | None, previous: dict, label: str) -> None:
    """Stop the echo, the workers and the network, remove ``tmp``; a second Ctrl-C must not cut this short,
    so the signals are held until it is done, then the earlier handlers come back."""
    try:
        mask = signal.pthread_sigmask(signal.SIG_BLOCK, set(SIGNALS))
    except (ValueError, OSError):
        mask = None
    try:
        if echo is not None:
            echo.stop()
        errors = bed.down()
        for log in logs:
            log.close()
        shutil.rmtree(tmp, ignore_errors=True)
        if errors:
            print(f"{label}: teardown problems: {'; '.join(errors)}", file=sys.stderr)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        if mask is not None:
            signal.pthread_sigmask(signal.SIG_SETMASK, mask)


class _Echo:
    """Copies the progress lines (those starting with ``prefix``) of a worker's log to stderr while a run lasts."""

    def __init__(self, path: str, prefix: str):
        self.path, self.prefix = path, prefix
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        pos = 0
        while True:
            done = self._stop.wait(0.3)
            try:
                with open(self.path) as f:
                    f.seek(pos)
                    chunk = f.read()
            except OSError:
                chunk = ""
            complete = chunk[: chunk.rfind("\n") + 1]
            pos += len(complete.encode())
            for line in complete.splitlines():
                if line.startswith(self.prefix):
                    print(line, file=sys.stderr, flush=True)
            if done:
                return

    def stop(self) -> None:
        """Copy what is left, then end the thread."""
        self._stop.set()
        self._thread.join(timeout=2)


def log_tail(tmp: str, rank: int, lines: int = 40) -> str:
    """The last ``lines`` lines of rank ``rank``'s log in ``tmp`` ("" if there is none)."""
    path = os.path.join(tmp, f"rank{rank}.log")
    try:
        with open(path) as f:
            text = f.read()
    except OSError:
        return ""
    return "\n".join(text.rstrip().splitlines()[-lines:])


def _read_json(path: str) -> dict:
    with open(path) as f:
        return json.load(f)


# --------------------------------------------------------------------------- the worker
def worker_config(path: str) -> dict:
    """A worker's config (from :func:`run_workers`); from now on the worker exits when the parent is gone."""
    cfg = _read_json(path)
    watch_parent(cfg["parent"])  # first: a parent killed while the worker imports torch is noticed too
    return cfg


def watch_parent(parent: int) -> None:
    """Exit when the parent (pid ``parent``) is gone, so that no worker outlives a killed run."""

    def loop():
        while True:
            if os.getppid() != parent:
                os._exit(3)
            time.sleep(0.5)

    threading.Thread(target=loop, daemon=True).start()


def read_tx_bytes(ifname: str) -> int:
    """Bytes the interface ``ifname`` (of this process's namespace) has transmitted."""
    with open(f"/sys/class/net/{ifname}/statistics/tx_bytes") as f:
        return int(f.read())


def write_result(cfg: dict, result: dict) -> None:
    """Write this worker's result where :func:`run_workers` reads it (atomically: a partial file is never read)."""
    with open(cfg["out"] + ".part", "w") as f:
        json.dump(result, f)
    os.replace(cfg["out"] + ".part", cfg["out"])


__all__ = ["PORT", "SIGNALS", "TestbedError", "log_tail", "node_environment", "read_tx_bytes", "run_workers", "watch_parent",
           "worker_config", "write_result"]
