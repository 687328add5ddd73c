"""Fault scenarios under torchft: replica processes around torchft's own lighthouse, killed by SIGKILL and restarted.

What ``gradcompress train --fault-tolerant``, ``gradcompress demo --faults`` and the tests run. Each replica is one
process (one torchft replica group of one worker): a real ``torchft.Manager`` talking to a real lighthouse
(:class:`gradcompress.integrations.torchft.Lighthouse`), the digits MLP under gradcompress's torchft DDP, torchft's
``OptimizerWrapper``; it writes one JSON line per step (:func:`replica_main`). A replica can SIGKILL itself at a
chosen step (``kill_at``) or inside its exchange, after the first collective round (``kill_in_exchange``);
:class:`Scenario` starts replicas, restarts one and reads the log; :func:`kill_and_restart` is the standard
scenario and :func:`summarize_scenario` what it showed. Run one replica: ``python -m gradcompress.testbed.faults '<json>'``.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Callable, Iterable
from datetime import timedelta
from typing import TYPE_CHECKING, Any, cast

import torch

from ..integrations import torchft as gft
from ..quorum import shared_state
from . import launch

if TYPE_CHECKING:
    from torch.distributed import TCPStore
    from torchft.manager import Manager

    from ..compressor import Compressor
    from ..quorum import Quorum

#: a replica's own script (``python -m gradcompress.testbed.faults``)
SELF = [sys.executable, "-m", "gradcompress.testbed.faults"]


def data() -> tuple[torch.Tensor, torch.Tensor]:
    """The handwritten digits (scikit-learn), scaled to [0, 1]: (inputs, labels)."""
    from sklearn.datasets import load_digits

    x, y = load_digits(return_X_y=True)
    return torch.tensor(x / 16.0, dtype=torch.float32), torch.tensor(y)


def model(hidden: int = 32, seed: int = 0) -> torch.nn.Sequential:
    """The MLP every replica starts from (the same seed on every replica)."""
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(64, hidden), torch.nn.ReLU(), torch.nn.Linear(hidden, 10))


def digest(tensors: Iterable[torch.Tensor]) -> str:
    h = hashlib.sha256()
    for t in tensors:
        h.update(t.detach().float().contiguous().numpy().tobytes())
    return h.hexdigest()[:16]


def make_manager(cfg: dict[str, Any],
                 state_fns: tuple[Callable[[dict[str, Any]], object], Callable[[], dict[str, Any]]],
                 group_rank: int = 0, group_world: int = 1, store_port: int | None = None
                 ) -> tuple[Manager, TCPStore | None]:
    from torchft.manager import Manager
    from torchft.process_group import ProcessGroupGloo
    from torch.distributed import TCPStore

    store = None
    if store_port is None:
        store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
        store_port = store.port
    load, save = state_fns
    host = cfg.get("host", "127.0.0.1")  # this replica's address (a namespace's on the testbed)
    manager = Manager(pg=ProcessGroupGloo(timeout=timedelta(seconds=cfg.get("pg_timeout", 5))),
                      load_state_dict=load, state_dict=save, min_replica_size=cfg.get("min_replicas", 1),
                      replica_id=f"replica_{cfg['replica']}", store_addr=host, store_port=store_port,
                      rank=group_rank, world_size=group_world, lighthouse_addr=cfg["lighthouse"],
                      hostname=host, timeout=timedelta(seconds=cfg.get("timeout", 10)),
                      quorum_timeout=timedelta(seconds=cfg.get("quorum_timeout", 30)),
                      connect_timeout=timedelta(seconds=10))
    return manager, store


def wait_for(path: str, timeout: float = 60.0) -> None:
    end = time.time() + timeout
    while not os.path.exists(path):
        if time.time() > end:
            raise TimeoutError(path)
        time.sleep(0.02)


#: torchft's Manager heartbeats the lighthouse every 100 ms (its default ``heartbeat_interval``)
HEARTBEAT_S = 0.1


def announce_rejoined(directory: str) -> None:
    """A restarted replica tells the waiting survivors it is back, once its Manager has heartbeated the lighthouse
    (three intervals after it was made): a quorum asked for before the lighthouse heard from it would form without
    it (a forked replica reaches this point within milliseconds of making its Manager)."""
    time.sleep(3 * HEARTBEAT_S)
    open(os.path.join(directory, "rejoined"), "w").close()


def lighthouse_holds_a_request(address: str) -> bool:
    """Whether torchft's lighthouse at ``address`` holds a quorum request not yet answered, read from its
    dashboard's ``/status`` page (torchft 0.2 has no call that says so; the page's wording is matched exactly and
    anything else is an error, not a guess)."""
    text = urllib.request.urlopen(address.rstrip("/") + "/status", timeout=5).read().decode()
    waiting = re.search(r"only have (\d+) participants", text)
    if waiting:
        return int(waiting.group(1)) > 0
    if re.search(r"(Valid|Fast) quorum", text):
        return True  # requests enough for a quorum, about to be answered
    raise RuntimeError(f"the lighthouse's /status page reads differently than torchft 0.2's: {text[:300]!r}")


def announce_once_asked(directory: str, lighthouse: str, timeout: float = 60.0) -> None:
    """``directory/rejoined`` created, in the background, once the lighthouse holds this restarted replica's first
    quorum request (the survivors wait for that file, not asking): were the survivors, the previous quorum, to ask
    first, the lighthouse would form their quorum at once without it (a "fast quorum") and it would join a step
    later. Call it right after asking (``zero_grad`` under torchft's OptimizerWrapper); the lighthouse's join
    timeout must leave the survivors time to ask once woken."""

    def announce() -> None:
        end = time.monotonic() + timeout
        while not lighthouse_holds_a_request(lighthouse):
            if time.monotonic() > end:
                raise TimeoutError(f"the lighthouse at {lighthouse} held no quorum request within {timeout} s")
            time.sleep(0.01)
        open(os.path.join(directory, "rejoined"), "w").close()

    threading.Thread(target=announce, daemon=True).start()


def rendezvous(cfg: dict[str, Any], announce: bool = True) -> None:
    """First start: every replica ready before the first quorum (so the first quorum holds them all); a restarted
    replica announces itself (its Manager heartbeats now; ``announce=False``: the caller announces) and goes
    straight to its first quorum."""
    if cfg.get("restarted"):
        if announce:
            announce_rejoined(cfg["dir"])
        return
    open(os.path.join(cfg["dir"], f"ready{cfg['replica']}"), "w").close()
    for i in range(cfg["replicas"]):
        wait_for(os.path.join(cfg["dir"], f"ready{i}"))


def die(directory: str) -> None:
    """SIGKILL this process, after writing the time into ``directory/killed_at`` (the stall is measured from it)."""
    with open(os.path.join(directory, "killed_at"), "w") as f:
        f.write(repr(time.time()))
    os.kill(os.getpid(), signal.SIGKILL)


def kill_inside_exchange(compressor: Compressor, at_step: int, directory: str) -> None:
    """SIGKILL this process inside the exchange of step ``at_step``, after its first collective round."""
    quorum = cast("Quorum", compressor.coordinator)  # under torchft: the quorum
    comm = quorum.comm
    wait = comm.wait

    def wait_then_die(works):
        wait(works)  # a round of the step's exchange (not the quorum's membership gather, before the step opens)
        if compressor.current_step is not None and quorum.manager.current_step() == at_step:
            die(directory)

    comm.wait = wait_then_die  # type: ignore[method-assign]  # instrumentation: this round's wait, then die


def replica_main(cfg: dict[str, Any]) -> None:
    """One replica (one process) training with gradcompress's torchft DDP; logs each step."""
    from torchft.optim import OptimizerWrapper

    x, y = data()
    net = model(cfg.get("hidden", 32), cfg.get("seed", 0))
    opt = torch.optim.SGD(net.parameters(), lr=cfg.get("lr", 0.1))

    def save():
        return {"model": net.state_dict(), "optim": opt.state_dict()}

    def load(sd):
        net.load_state_dict(sd["model"])
        opt.load_state_dict(sd["optim"])

    manager, store = make_manager(cfg, (load, save))
    if cfg.get("torchft_ddp"):  # torchft's own DDP (its dense all-reduce), the reference for "none"
        from torchft.ddp import DistributedDataParallel

        ddp = DistributedDataParallel(manager, net)
        comp = gft.Compressor("none", manager)  # unused by the model: its log fields stay empty
    else:
        ddp = gft.DistributedDataParallel(manager, net, cfg["spec"], **cfg.get("options", {}))
        comp = ddp.compressor
    optimizer = OptimizerWrapper(manager, opt)
    if cfg.get("kill_in_exchange") is not None:
        kill_inside_exchange(comp, cfg["kill_in_exchange"], cfg["dir"])
    log = open(cfg["log"], "a")
    gen = torch.Generator().manual_seed(1000 + cfg["replica"] + 7919 * cfg.get("seed", 0))
    rendezvous(cfg, announce=False)
    unannounced = bool(cfg.get("restarted"))  # a restarted replica announces itself once it asked for a quorum
    while manager.current_step() < cfg["steps"]:
        step = manager.current_step()
        if cfg.get("kill_at") == step:
            log.flush()
            die(cfg["dir"])
        if cfg.get("pause_at") == step:
            wait_for(os.path.join(cfg["dir"], "rejoined"))
        idx = torch.randint(0, len(x), (cfg.get("batch_size", 32),), generator=gen)
        began = time.time()
        optimizer.zero_grad()  # start_quorum
        if unannounced:
            announce_once_asked(cfg["dir"], cfg["lighthouse"])
            unannounced = False
        loss = torch.nn.functional.cross_entropy(ddp(x[idx]), y[idx])
        loss.backward()
        residuals = {k: float(v.abs().sum()) for k, v in comp.residual.items()}
        server = sum(float(v.abs().sum()) for v in comp.server_residual.values())  # after this step's begin
        held = cast("Quorum", comp.coordinator).held  # under torchft: the quorum
        silent = held[-1].silent if held else None
        optimizer.step()  # should_commit, then the optimizer step if committed
        error = manager.errored()
        after = manager.current_step()
        committed = after > step
        with torch.no_grad():
            out = net(x)
            full = float(torch.nn.functional.cross_entropy(out, y))
            accuracy = float((out.argmax(1) == y).float().mean())
        shared = shared_state(comp)
        log.write(json.dumps({"replica": cfg["replica"], "step": step, "committed": committed,
                              "participants": manager.num_participants(), "silent": silent,
                              "residual_before": sum(residuals.values()), "server_before": server, "params": digest(net.parameters()),
                              "shared": digest([t for s in ("q", "p", "momentum") for t in shared[s].values()]),
                              "state_step": comp.state.step, "after": after, "loss": full, "accuracy": accuracy,
                              "pid": os.getpid(), "time": time.time(),
                              "stats_steps": comp.stats()["steps"], "world": cast("Quorum", comp.coordinator).comm.world,
                              "rank": cast("Quorum", comp.coordinator).comm.rank, "wire": comp.stats()["wire_bytes"],
                              "error": None if error is None else repr(error.original_exception)[:300],
                              "seconds": time.time() - began}) + "\n")
        log.flush()
    manager.shutdown(wait=False)


# --------------------------------------------------------------------------- scenarios
class Scenario:
    """Replica processes around one lighthouse (torchft's, on 127.0.0.1) in folder ``where``; ``rows()`` reads
    their log. ``command``: how to start a replica (default: this module). ``close()`` kills what still runs."""

    def __init__(self, where: str, min_replicas: int = 1, *, command: list[str] | None = None, limit: float = 60.0,
                 heartbeat_ms: int = 1000, join_ms: int = 200, lighthouse: str | None = None, **common: Any):
        os.makedirs(where, exist_ok=True)
        self.dir, self.log, self.limit = where, os.path.join(where, "log.jsonl"), limit
        open(self.log, "w").close()
        self.lighthouse = None
        if lighthouse is None:
            self.lighthouse = gft.Lighthouse(min_replicas=min_replicas, heartbeat_timeout_ms=heartbeat_ms,
                                             join_timeout_ms=join_ms)
            lighthouse = self.lighthouse.address
        address = lighthouse if "://" in lighthouse else f"http://{lighthouse}"
        self.common = {"lighthouse": address, "log": self.log, "dir": where, **common}
        self.command = command or SELF
        self.procs: list[launch.Child | subprocess.Popen] = []
        self.start_time = time.time()

    def start(self, replica: int, **cfg: Any) -> launch.Child | subprocess.Popen:
        cfg = {**self.common, "replica": replica, **cfg}
        out = os.path.join(self.dir, f"out{replica}{cfg.get('group_rank', '')}.txt")
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([os.path.dirname(os.path.dirname(os.path.dirname(
            os.path.abspath(__file__))))] + os.environ.get("PYTHONPATH", "").split(os.pathsep))}
        proc = launch.child([*self.command, json.dumps(cfg)], env, out)  # forked: torch already imported
        self.procs.append(proc)
        return proc

    def rows(self) -> list[dict]:
        with open(self.log) as f:
            return [json.loads(line) for line in f if line.strip()]

    def wait_until(self, condition: Callable[[], object], what: str) -> None:
        while not condition():
            if time.time() - self.start_time > self.limit:
                raise TimeoutError(f"fault scenario: timed out after {self.limit:.0f} s waiting for {what}; the "
                                   f"replicas' logs are in {self.dir}")
            time.sleep(0.05)

    def finish(self) -> None:
        self.wait_until(lambda: all(p.poll() is not None for p in self.procs), "every replica to finish")

    def close(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.kill()
        if self.lighthouse is not None:
            self.lighthouse.shutdown()


def kill_and_restart(where: str, spec: str, *, replicas: int = 3, steps: int = 40, kill_at: int | None = 10,
                     restart_at: int | None = 20, inside: bool = False, lighthouse: str | None = None,
                     limit: float = 60.0, join_ms: int = 1000, min_replicas: int | None = None,
                     **cfg: Any) -> list[dict]:
    """Train ``replicas`` replicas for ``steps`` steps; the last one SIGKILLs itself at step ``kill_at`` (None: no
    fault; ``inside``: in the middle of that step's exchange, after its first collective round) and is restarted
    when the others reach ``restart_at`` (they wait there until it is back, so the run shows the heal; None: not
    restarted). ``join_ms``: the lighthouse's join timeout (how long a quorum waits for a replica that heartbeats
    but has not asked yet: a slow starter; with 200 ms, two survivors woken by the restarted replica's
    announcement more than that apart under load split: one was left out of the rejoining quorum). ``min_replicas``: the fewest replicas a quorum of the scenario's own
    lighthouse takes (default: a majority of 3 or more replicas, so that two quorums of one step cannot both form —
    with 1, a replica that asks after a step's quorum formed trains that step alone, seen under load; 1 for 2
    replicas, so that a survivor trains on). Returns the log's rows."""
    if min_replicas is None:
        min_replicas = replicas // 2 + 1 if replicas >= 3 else 1
    s = Scenario(where, min_replicas, lighthouse=lighthouse, limit=limit, join_ms=join_ms, spec=spec, steps=steps,
                 replicas=replicas, **cfg)
    try:
        victim = replicas - 1
        pause = {} if kill_at is None or restart_at is None else {"pause_at": restart_at}
        first = [s.start(i, **pause) for i in range(victim)]
        fault = {} if kill_at is None else {"kill_in_exchange" if inside else "kill_at": kill_at}
        first.append(s.start(victim, **fault))
        if kill_at is not None:
            s.wait_until(lambda: first[-1].poll() is not None, f"replica {victim} to die")
            if restart_at is not None:
                s.wait_until(lambda: any(r["replica"] == 0 and r["step"] >= restart_at - 1 for r in s.rows()),
                             f"the survivors at step {restart_at - 1}")
                s.start(victim, restarted=True)
        s.finish()
        bad = [p.returncode for p in s.procs if p.returncode not in (0, -signal.SIGKILL)]
        if bad:
            raise RuntimeError(f"fault scenario: a replica failed (exit codes {bad}); logs in {s.dir}")
        return s.rows()
    finally:
        s.close()


def killed_at(where: str) -> float | None:
    """When the victim SIGKILLed itself in the scenario run in ``where`` (None: nobody was killed)."""
    path = os.path.join(where, "killed_at")
    return float(open(path).read()) if os.path.exists(path) else None


def summarize_scenario(rows: list[dict], replicas: int, killed: float | None = None) -> dict:
    """What a scenario showed: each replica's committed steps, the quorum size per committed step (replica 0's
    view), whether every replica ended with the same parameters, the final loss and accuracy, the rows not
    committed, and ``stall_seconds``: from the kill (``killed``, :func:`killed_at`) to replica 0's first commit of a
    step after the last one the victim (the last replica) committed before it died: a step before the kill whose
    row was logged just after it does not count."""
    final, quorum = {}, {}
    for r in rows:
        if r["committed"]:
            final[r["replica"]] = r
            if r["replica"] == 0:
                quorum[r["after"] - 1] = r["participants"]
    committed = {i: sorted(r["after"] - 1 for r in rows if r["replica"] == i and r["committed"])
                 for i in range(replicas)}
    later = [r["time"] for r in rows if r["replica"] == 0 and r["committed"] and killed is not None
             and r["step"] > _last_before(rows, replicas - 1, killed)]
    ends = list(final.values())
    return {"committed": committed, "quorum": quorum, "stall_seconds": min(later) - killed if later else None,
            "equal": len({r["params"] for r in ends}) == 1 and len(ends) == replicas,
            "loss": ends[0]["loss"] if ends else None, "accuracy": ends[0]["accuracy"] if ends else None,
            "uncommitted": sum(not r["committed"] for r in rows)}


def _last_before(rows: list[dict], victim: int, killed: float) -> int:
    """The last step ``victim`` committed before it was killed at ``killed`` (-1: none)."""
    done = [r["step"] for r in rows if r["replica"] == victim and r["committed"] and r["time"] <= killed]
    return max(done, default=-1)


if __name__ == "__main__":
    replica_main(json.loads(sys.argv[1]))
    os._exit(0)
