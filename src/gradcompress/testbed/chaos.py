"""Faults anywhere: a replica killed (or stopped) at a point drawn at random among the points of its exchange.

:func:`sweep` runs one scenario per exchange family: replicas 0 and 1 train throughout (the **survivors**), replica
2 is killed again and again, each time at a point drawn from a seed (:func:`draw`): a step a few steps after it
healed, and an **event** of that step's exchange — ``0`` before its first collective, then ``2i - 1`` just after
collective i was issued and ``2i`` just after it was waited for (so: before, inside and between the rounds of every
exchange); an event past the step's last kills it after the exchange, before ``should_commit``. A killed replica
is replaced at once by a **standby** process (already started, torch imported) that joins the next quorum and heals
from a peer, and is killed in turn; the last one trains to the end.

Each replica logs one JSON line per step (:func:`replica`): the step's index (its quorum's step), whether it
committed, whether the Manager saw an error, the digests of its parameters (DiLoCo: its anchors) and of the state
every replica shares (PowerSGD's factors; momentum correction is each worker's own). :func:`verdict` reads
the log and says, per family, what the issue's targets ask: no survivor crashed or hung, the survivors' parameters
and shared state equal after every step they both committed, no step with an error committed, every standby
healed (equal to the survivors at every step it committed after its heal).

``kind``: ``kill`` (SIGKILL), ``stop`` (SIGSTOP: the process hangs with its sockets open; it is killed after the
survivors went on without it) or, on the namespace testbed (:func:`run_partition`, root), ``cut``: the replica's
link drops every packet both ways from that point (a partition, a host losing power: no reset), and the process
is killed once the survivors went on; each stall (from the fault to the survivors' first commit of a later step)
is reported.

Run one replica: ``python -m gradcompress.testbed.chaos '<json>'``.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, cast

import torch

from . import faults

if TYPE_CHECKING:
    from ..compressor import Compressor
    from ..quorum import Quorum

SELF = [sys.executable, "-m", "gradcompress.testbed.chaos"]
#: the exchange families (a codec each: dense, two-step, gathered, summed, low rank)
FAMILIES = {"dense": "none", "two-step": "int8", "sign": "sign", "top-k": "topk:ratio=0.05",
            "dgc": "dgc:ratio=0.05", "threshold": "threshold:value=0.05", "random-k": "randomk:ratio=0.1",
            "cast": "fp16", "low-rank": "powersgd:rank=2"}
#: events drawn per kill: 0 (before the exchange) to this (past the last of most exchanges: after it)
EVENTS = 12
#: standbys forked ahead of their turn (each then sets up DDP while the others train)
LOOKAHEAD = 2
IFNAME = "gcveth"  # a testbed host's link (:mod:`.netns`)
#: streaming DiLoCo in the scenarios (``mode="streaming"``): 2 fragments, applied one inner step after their send
STREAMING: dict[str, Any] = {"fragments": 2, "delay": 1}
#: seconds each replica sleeps per step: the digits MLP's steps take milliseconds, and replicas that spin on them
#: starve the standbys' start of the 2 cores
PACE = 0.02


def draw(seed: int, kills: int) -> list[tuple[int, int]]:
    """``kills`` (steps after healing, event) pairs from ``seed``: 1 to 3 steps after the heal, an event of
    :data:`EVENTS`."""
    rng = random.Random(seed)
    return [(rng.randint(1, 3), rng.randint(0, EVENTS)) for _ in range(kills)]


def draw_every_event(seed: int) -> list[tuple[int, int]]:
    """One kill at each event of :data:`EVENTS` (0 to it), in an order drawn from ``seed``, each 1 to 3 steps after
    the heal: every point of an exchange is hit (:func:`draw`'s 20 random draws hit 8 to 12 of the 13)."""
    rng = random.Random(seed)
    events = list(range(EVENTS + 1))
    rng.shuffle(events)
    return [(rng.randint(1, 3), e) for e in events]


class Tripwire:
    """Counts the events of the next exchange of a compressor under a quorum and fires at event ``event``:
    ``fire()`` kills or stops the process. Installed on the coordinator's collectives (test instrumentation)."""

    def __init__(self, compressor: Compressor, event: int, fire: Callable[[], object]):
        self.compressor, self.event, self.fire = compressor, event, fire
        self.armed, self.count = False, 0
        comm = cast("Quorum", compressor.coordinator).comm  # under torchft: the quorum
        issue, wait = comm._issue, comm.wait

        def counted_issue(start, outputs):
            self._tick()
            handle = issue(start, outputs)
            self._tick()
            return handle

        def counted_wait(works):
            wait(works)
            self._tick()

        comm._issue, comm.wait = counted_issue, counted_wait  # type: ignore[method-assign]  # instrumentation: counted

    def arm(self) -> None:
        """Count the events of the next step's exchange (the quorum's membership gather, before the step opens,
        is not counted)."""
        self.armed, self.count = True, 0

    def after(self) -> None:
        """The armed step's exchange ended before its event: fire now (after the exchange, before the commit)."""
        if self.armed:
            self.fire()

    def _tick(self) -> None:
        if not self.armed or self.compressor.current_step is None:
            return
        self.count += 1
        if self.count == self.event:
            self.fire()


def replica(cfg: dict, prepared: tuple | None = None) -> None:
    """One replica: the digits MLP under torchft with ``cfg["spec"]`` (``mode``: ``ddp``, gradcompress's torchft
    DDP, or ``diloco``: DiLoCo with H = ``sync_every``); a standby (forked by :func:`zygote`, ``prepared``: what it
    imported and loaded) waits for ``go<n>`` first; a victim fires its tripwire at its drawn point; everyone stops at
    the file ``stop``. Logs one line per step (DiLoCo: per sync)."""
    from ..quorum import shared_state

    where = cfg["dir"]
    if cfg.get("serve_lighthouse"):  # the testbed's lighthouse, on this host's address
        cfg["lighthouse"] = _serve_lighthouse(cfg)
    elif cfg["lighthouse"].startswith("file:"):
        path = cfg["lighthouse"][5:]
        faults.wait_for(path, timeout=120)
        cfg["lighthouse"] = open(path).read()
    x, y = prepared or _prepare()
    net = faults.model(32, 0)
    if cfg.get("standby") is not None:
        if cfg.get("mode", "ddp") == "ddp":  # DDP's first construction (its reducer's lazy set-up: ~0.6 s here)
            from torchft.process_group import ProcessGroupDummy

            torch.nn.parallel.DistributedDataParallel(faults.model(32, 0), process_group=ProcessGroupDummy(0, 1))
        faults.wait_for(os.path.join(where, f"go{cfg['standby']}"), timeout=cfg.get("limit", 600))
    manager, _store = faults.make_manager(cfg, (lambda sd: net.load_state_dict(sd), lambda: net.state_dict()))
    train, comp, record = _loop(cfg, manager, net)
    if cfg.get("standby") in (None, 0):  # the first three: one first quorum (a replica that came first would
        _ready(where, cfg["replica"])  # otherwise commit a step 0 alone, the others another step 0 without it)
    signals: dict[str | None, signal.Signals | None] = {"stop": signal.SIGSTOP, "cut": None}
    sig = signals.get(cfg.get("kind"), signal.SIGKILL)
    signal.signal(signal.SIGTERM, lambda *_: os._exit(0))  # the scenario's end (:func:`_drain`), not a fault
    wire = Tripwire(comp, cfg["event"], lambda: _fire(where, sig)) if cfg.get("after") is not None else None
    log = open(cfg["log"], "a")
    gen = torch.Generator().manual_seed(1000 + 10 * cfg["replica"] + (cfg.get("standby") or 0))
    healed_at, exchanges = None, 0
    while not os.path.exists(os.path.join(where, "stop")):
        time.sleep(PACE)  # leave the standbys CPU to start (the machine has 2 cores)
        idx = torch.randint(0, len(x), (32,), generator=gen)
        # train() calls arm() before it returns, in this iteration: no late binding of healed_at, exchanges
        exchanged = train(x[idx], y[idx], lambda: wire.arm() if wire is not None and healed_at is not None  # noqa: B023 - called now
                          and exchanges == healed_at + cfg["after"] else None, wire)  # noqa: B023 - called now
        if not exchanged:
            continue
        exchanges += 1
        last = comp.coordinator.held[-1]  # this step (decided at the next one's begin): its index is the quorum's
        committed = last.committed if last.committed is not None else manager.current_step() == last.index + 1
        if committed and healed_at is None:
            healed_at = exchanges
        error = manager.errored()
        shared = shared_state(comp)
        log.write(json.dumps({"replica": cfg["replica"], "standby": cfg.get("standby"), "step": last.index,
                              "committed": committed, "error": None if error is None else repr(error)[:200],
                              "params": faults.digest(record()), "participants": manager.num_participants(),
                              "shared": faults.digest([t for s in ("q", "p") for t in shared[s].values()]),
                              "time": time.time()}) + "\n")
        log.flush()
    manager.shutdown(wait=False)


def _ready(where: str, replica: int) -> None:
    """The scenario's first replicas (survivors 0 and 1, the first standby) wait for each other, their Managers
    heartbeating, before their first quorum."""
    _write(os.path.join(where, f"ready{replica}"), "")
    for i in range(3):
        faults.wait_for(os.path.join(where, f"ready{i}"), timeout=120)


def _prepare() -> tuple:
    """What every replica loads before its turn and a fork keeps: the data, the C++ kernels (not torchft: its
    native runtime starts threads at import, which a fork does not carry over)."""
    from ..codecs import fast
    from ..integrations import torchft as _gft  # noqa: F401 - gradcompress's side only, no torchft import

    fast.prepare()
    _warm_optimizers()
    return faults.data()


def _warm_optimizers() -> None:
    """One step of AdamW and of SGD with Nesterov momentum on a throwaway model: an optimizer's first step loads what
    every later one uses (about a second of a DiLoCo standby's start on this machine), once in the zygote."""
    net = faults.model(32, 0)
    for opt in (torch.optim.AdamW(net.parameters(), lr=1e-3),
                torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9, nesterov=True)):
        for p in net.parameters():
            p.grad = torch.zeros_like(p)
        opt.step()


def zygote(cfg: dict) -> None:
    """Forks the standbys of a scenario: loads what every replica loads once (:func:`_prepare`: seconds of imports
    on a loaded 2-core machine), then for each request ``spawn<n>.json`` forks a replica (its pid in ``pid<n>``, its
    exit status in ``exit<n>``: the code, or minus the signal) until the file ``stop-zygote``."""
    torch.set_num_threads(1)  # no OpenMP pool in this process: a forked child could not use its threads
    prepared, where = _prepare(), cfg["dir"]
    pids: dict[int, Any] = {}
    while True:
        for name in sorted(os.listdir(where)):
            if name.startswith("spawn") and name.endswith(".json") and name[5:-5] not in pids.values():
                n = name[5:-5]
                with open(os.path.join(where, name)) as f:
                    child_cfg = json.load(f)
                pid = os.fork()
                if pid == 0:
                    try:
                        replica(child_cfg, prepared)
                    finally:
                        os._exit(0)
                pids[pid] = n
                _write(os.path.join(where, f"pid{n}"), str(pid))
        while pids:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:  # every child already reaped
                break
            if pid == 0:
                break
            code = -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)
            _write(os.path.join(where, f"exit{pids[pid]}"), str(code))
        if os.path.exists(os.path.join(where, "stop-zygote")) and all(
                os.path.exists(os.path.join(where, f"exit{n}")) for n in pids.values()):
            return
        time.sleep(0.02)


def _write(path: str, text: str) -> None:
    with open(path + ".part", "w") as f:
        f.write(text)
    os.replace(path + ".part", path)


class Forked:
    """A standby the zygote forked: ``pid``, ``poll()`` (its exit status or None), ``kill()``, ``wait()``."""

    def __init__(self, where: str, n: int, cfg: dict, limit: float):
        self.where, self.n, self.limit = where, n, limit
        _write(os.path.join(where, f"spawn{n}.json"), json.dumps(cfg))
        faults.wait_for(os.path.join(where, f"pid{n}"), timeout=limit)
        self.pid = int(open(os.path.join(where, f"pid{n}")).read())

    def poll(self) -> int | None:
        path = os.path.join(self.where, f"exit{self.n}")
        return int(open(path).read()) if os.path.exists(path) else None

    @property
    def returncode(self) -> int | None:
        return self.poll()

    def kill(self) -> None:
        self._signal(signal.SIGKILL)

    def terminate(self) -> None:
        self._signal(signal.SIGTERM)

    def _signal(self, sig) -> None:
        if self.poll() is None:
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:
                pass

    def wait(self) -> int:
        faults.wait_for(os.path.join(self.where, f"exit{self.n}"), timeout=self.limit)
        return cast(int, self.poll())  # its exit file is there


def _serve_lighthouse(cfg: dict) -> str:
    from ..integrations.torchft import Lighthouse

    lighthouse = Lighthouse(min_replicas=2, host=cfg["host"], heartbeat_timeout_ms=cfg["heartbeat_ms"],
                            join_timeout_ms=100)
    _serve_lighthouse.kept = lighthouse  # type: ignore[attr-defined]  # a function attribute: lives as long as this process
    path = os.path.join(cfg["dir"], "lighthouse")
    with open(path + ".part", "w") as f:
        f.write(lighthouse.address)
    os.replace(path + ".part", path)
    return lighthouse.address


def _loop(cfg: dict, manager, net):
    """(one training step ``train(x, y, arm, wire) -> exchanged``, the compressor, what is digested): ``arm`` is
    called just before a step that exchanges, ``wire.after()`` just after its exchange (before the commit)."""
    from torchft.optim import OptimizerWrapper

    from ..integrations import torchft as gft

    if cfg.get("mode", "ddp") == "ddp":
        ddp = gft.DistributedDataParallel(manager, net, cfg["spec"], min_numel=0)
        optimizer = OptimizerWrapper(manager, torch.optim.SGD(net.parameters(), lr=0.1))

        def train(x, y, arm, wire):
            optimizer.zero_grad()  # the step's quorum
            arm()
            torch.nn.functional.cross_entropy(ddp(x), y).backward()
            if wire is not None:
                wire.after()
            optimizer.step()  # should_commit, then the optimizer step
            return True

        return train, ddp.compressor, net.parameters

    from ..optim import DiLoCo
    from ..optim.streaming import due

    h = cfg["sync_every"]
    opt = DiLoCo(net, torch.optim.AdamW(net.parameters(), lr=3e-3), sync_every=h, codec=cfg["spec"],
                 manager=manager, **(STREAMING if cfg["mode"] == "streaming" else {}))

    def train(x, y, arm, wire):  # type: ignore[no-redef]  # DiLoCo's (the DDP branch returned its own)
        opt.zero_grad()
        torch.nn.functional.cross_entropy(net(x), y).backward()
        t = opt.inner_steps + 1
        sending = due(t, 0, opt.fragments, h)  # fragment 0 (DiLoCo: the whole model) is sent after this step
        flight = opt.flight.get(0)
        applying = (sending and opt.delay == 0) or (flight is not None and flight.apply_at <= t)
        if sending:
            arm()
        opt.step()  # a send: start_quorum, the exchange (streamed: on the courier), should_commit; an apply
        if applying and wire is not None:
            wire.after()  # past the exchange's last event: killed after its apply, before the next inner step
        return applying

    return train, opt.compressor, lambda: opt.anchor


def _fire(where: str, sig) -> None:
    path = os.path.join(where, f"fired{os.getpid()}")
    with open(path + ".tmp", "w") as f:  # renamed when written: the harness polls for the name, then reads it
        f.write(repr(time.time()))
    os.replace(path + ".tmp", path)
    if sig is None:  # cut this host's link both ways (inside its own namespace), and go on as if nothing happened
        for cmd in (["tc", "qdisc", "replace", "dev", IFNAME, "root", "netem", "loss", "100%"],
                    ["tc", "qdisc", "add", "dev", IFNAME, "ingress"],
                    ["tc", "filter", "add", "dev", IFNAME, "parent", "ffff:", "protocol", "all", "u32", "match",
                     "u32", "0", "0", "action", "drop"]):
            subprocess.run(cmd, check=True, capture_output=True)
        return
    os.kill(os.getpid(), sig)


def run_family(where: str, spec: str, kills: list[tuple[int, int]], *, kind: str = "kill", mode: str = "ddp",
               sync_every: int = 4, heartbeat_ms: int = 500, limit: float = 600.0, tail: int = 4) -> dict:
    """One family's scenario (see the module docstring): the kills drawn, then ``tail`` steps after the last heal.
    Returns :func:`verdict` of its log, with the exit codes and the seconds it took. ``mode``: ``ddp``,
    ``diloco`` (``sync_every``: H; the exchange is the outer sync) or ``streaming`` (:data:`STREAMING`: the kills
    land in fragment 0's exchange, run by the courier thread, or after its apply; a row per apply of fragment 0)."""
    # at least 2 replicas a quorum: of 3 (2 survivors, 1 standby) two quorums of one step cannot both form (with 1,
    # a replica that comes late trains that step alone: two results of one step, seen under load)
    s = faults.Scenario(where, 2, command=SELF, heartbeat_ms=heartbeat_ms, join_ms=100,
                        limit=limit, spec=spec, mode=mode, sync_every=sync_every, timeout=5, quorum_timeout=60,
                        pg_timeout=3)
    start = time.time()
    stalls: list = []
    try:
        survivors = [s.start(i) for i in range(2)]
        s.start(2, zygote=True)
        standbys: list = []

        def warm(upto: int) -> None:  # standbys forked ahead (the DDP set-up done while the others train)
            while len(standbys) <= min(upto, len(kills)):
                n = len(standbys)
                plan = dict(after=kills[n][0], event=kills[n][1], kind=kind) if n < len(kills) else {}
                cfg = {**s.common, "replica": 2, "standby": n, **plan}  # the last: no kill, trains to the end
                standbys.append(Forked(where, n, cfg, limit))

        for n in range(len(kills) + 1):
            warm(n + LOOKAHEAD)
            open(os.path.join(where, f"go{n}"), "w").close()
            if n < len(kills):
                victim = standbys[n]
                s.wait_until(lambda: victim.poll() is not None or _fired(where, victim),  # noqa: B023 - polled now
                             f"standby {n} to fire")
                stalls.append(_stall(s, where, victim, n))
                if kind == "stop":  # hung with its sockets open until the survivors went on without it
                    victim.kill()
                victim.wait()

        def healed() -> bool:
            return any(r.get("standby") == len(kills) and r["committed"] for r in s.rows())

        s.wait_until(healed, "the last standby to heal")
        last = max(r["step"] for r in s.rows())
        s.wait_until(lambda: max(r["step"] for r in s.rows()) >= last + tail, "the last steps")
        final = max(r["step"] for r in s.rows())
        open(os.path.join(where, "stop"), "w").close()
        open(os.path.join(where, "stop-zygote"), "w").close()
        _drain(s, survivors + standbys[-1:])
        s.finish()
        codes = {"survivors": [p.returncode for p in survivors], "standbys": [p.poll() for p in standbys]}
        return {**verdict(s.rows(), len(kills)), "exit_codes": codes, "seconds": time.time() - start,
                "stalls": stalls, "behind": behind(s.rows(), final)}
    finally:
        for p in standbys if "standbys" in locals() else []:
            p.kill()
        s.close()


def run_partition(where: str, spec: str, cuts: list[tuple[int, int]], *, rate_bit: float = 1e9,
                  heartbeat_ms: int = 500, pg_timeout: float = 3.0, limit: float = 600.0, tail: int = 4) -> dict:
    """Survivors on testbed hosts 0 and 1 (host 0 serves the lighthouse), the victim on host 2 cutting its own link
    at each drawn point (see the module docstring); between two victims the link is restored. Returns
    :func:`verdict`, the exit codes, the seconds and ``stalls`` (seconds from each cut to the survivors' first
    commit of a step after it). Needs root (:func:`gradcompress.testbed.netns.problem`)."""
    from . import netns

    os.makedirs(where, exist_ok=True)
    log = os.path.join(where, "log.jsonl")
    open(log, "w").close()
    common = {"log": log, "dir": where, "spec": spec, "mode": "ddp", "timeout": 5, "quorum_timeout": 60,
              "pg_timeout": pg_timeout, "lighthouse": "file:" + os.path.join(where, "lighthouse"),
              "heartbeat_ms": heartbeat_ms, "limit": limit}
    bed = netns.Testbed(3, rate_bit).up()
    named = _name_hosts(bed)
    start, stalls = time.time(), []
    procs: list = []

    def spawn(host: int, replica: int, **cfg) -> subprocess.Popen:
        out = open(os.path.join(where, f"out{replica}.txt"), "a")
        env = {**os.environ, "GLOO_SOCKET_IFNAME": IFNAME, "PYTHONPATH": os.pathsep.join(
            [os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))]
            + os.environ.get("PYTHONPATH", "").split(os.pathsep))}
        argv = [*SELF, json.dumps({**common, "replica": replica, "host": bed.addresses[host], **cfg})]
        procs.append(bed.spawn(host, _named(host, argv), env=env, stdout=out, stderr=subprocess.STDOUT))
        return procs[-1]

    def rows() -> list[dict]:
        with open(log) as f:
            return [json.loads(line) for line in f if line.strip()]

    def until(condition, what: str) -> None:
        while not condition():
            if time.time() - start > limit:
                raise TimeoutError(f"partition scenario: timed out after {limit:.0f} s waiting for {what}; logs in "
                                   f"{where}")
            time.sleep(0.05)

    try:
        survivors = [spawn(0, 0, serve_lighthouse=True), spawn(1, 1)]
        victims = []
        for n, point in enumerate([*cuts, None]):  # the last victim: no cut, trains to the end
            plan = {} if point is None else dict(after=point[0], event=point[1], kind="cut")
            victims.append(spawn(2, 2, standby=n, **plan))
            open(os.path.join(where, f"go{n}"), "w").close()
            if n == len(cuts):
                break
            victim = victims[-1]
            until(lambda: victim.poll() is not None or _fired(where, victim),  # noqa: B023 - polled now
                  f"victim {n} to cut its link")
            cut = float(open(os.path.join(where, f"fired{victim.pid}")).read())
            last = max((r["step"] for r in rows() if r.get("standby") == n and r["committed"]), default=-1)
            until(lambda: any(r["replica"] < 2 and r["committed"] and r["step"] > last for r in rows()),  # noqa: B023 - polled now
                  f"the survivors to go on after cut {n}")
            stalls.append(min(r["time"] for r in rows() if r["replica"] < 2 and r["committed"] and r["step"] > last)
                          - cut)
            victim.kill()
            victim.wait()
            _restore(bed, 2, rate_bit)
        until(lambda: any(r.get("standby") == len(cuts) and r["committed"] for r in rows()), "the last victim to heal")
        end = max(r["step"] for r in rows())
        until(lambda: max(r["step"] for r in rows()) >= end + tail, "the last steps")
        final = max(r["step"] for r in rows())
        open(os.path.join(where, "stop"), "w").close()
        until(lambda: all(p.poll() is not None for p in survivors + victims[-1:]), "every replica to finish")
        codes = {"survivors": [p.returncode for p in survivors], "standbys": [p.returncode for p in victims]}
        return {**verdict(rows(), len(cuts)), "exit_codes": codes, "seconds": time.time() - start,
                "stalls": stalls, "behind": behind(rows(), final)}
    finally:
        bed.down()
        for path in named:
            shutil.rmtree(path, ignore_errors=True)


def _name_hosts(bed) -> list[str]:
    """Every testbed host a name of its own (``gc-h<i>``, set by :func:`_named`) that resolves to its address in
    every host (``ip netns exec`` mounts ``/etc/netns/<ns>/hosts`` over ``/etc/hosts``): torchft's checkpoint
    transport tells its peers its machine's name, which is otherwise the same on every host and resolves to
    127.0.0.1, each host's own loopback. The folders written."""
    table = "127.0.0.1 localhost\n" + "".join(f"{addr} gc-h{i}\n" for i, addr in enumerate(bed.addresses))
    folders = []
    for ns in bed.host_ns:
        folder = os.path.join("/etc/netns", ns)
        os.makedirs(folder, exist_ok=True)
        with open(os.path.join(folder, "hosts"), "w") as f:
            f.write(table)
        folders.append(folder)
    return folders


def _named(host: int, argv: list[str]) -> list[str]:
    """``argv`` run under the host's own name (a UTS namespace of its own: :func:`_name_hosts`)."""
    return ["unshare", "--uts", "sh", "-c", f'hostname gc-h{host} && exec "$@"', "sh", *argv]


def _restore(bed, host: int, rate_bit: float) -> None:
    """The host's link as the testbed built it (its shaping back, the drop filter gone)."""
    from . import netns

    ns = bed.host_ns[host]
    subprocess.run(["tc", "-n", ns, "qdisc", "del", "dev", IFNAME, "ingress"], capture_output=True)
    subprocess.run(["tc", "-n", ns, "qdisc", "replace", "dev", IFNAME, "root", "handle", "1:", *netns.tbf(rate_bit)],
                   check=True, capture_output=True)


#: a survivor whose last committed step is more than this many steps behind the scenario's last one stopped going on
LAG = 4
#: seconds the replicas still running get to stop by themselves once one has stopped
GRACE = 3.0


def _drain(s, procs: list) -> None:
    """The scenario's end: the replicas stop at the file ``stop`` when they next look (between steps); one that
    is then waiting for a quorum its stopped peers will never join (DiLoCo's lighthouse wants 2 replicas) is
    still waiting :data:`GRACE` seconds after the first stopped: it is asked to stop (SIGTERM, exit code 0).
    :func:`behind` tells a survivor that had stopped going on before the end."""
    s.wait_until(lambda: any(p.poll() is not None for p in procs), "a replica to stop")
    end = time.time() + GRACE
    while time.time() < end and any(p.poll() is None for p in procs):
        time.sleep(0.05)
    for p in procs:
        if p.poll() is None:
            p.terminate()


def behind(rows: list[dict], final: int) -> list[int]:
    """The survivors (replicas 0 and 1) whose last committed step is more than :data:`LAG` steps before
    ``final`` (the last step of any replica when the scenario ended)."""
    last = {n: max((r["step"] for r in rows if r["replica"] == n and r["committed"]), default=-1) for n in (0, 1)}
    return [n for n, step in last.items() if step < final - LAG]


def _fired(where: str, proc: subprocess.Popen) -> bool:
    return os.path.exists(os.path.join(where, f"fired{proc.pid}"))


def _stall(s, where: str, victim, n: int) -> float:
    """Seconds from standby ``n``'s fault to the survivors' first commit of a step after the last one it committed
    (waiting for that commit: a hung replica must no longer hold them up)."""
    fault = float(open(os.path.join(where, f"fired{victim.pid}")).read())
    last = max((r["step"] for r in s.rows() if r.get("standby") == n and r["committed"]), default=-1)

    def later():
        return [r["time"] for r in s.rows() if r["replica"] < 2 and r["committed"] and r["step"] > last]

    s.wait_until(lambda: bool(later()), f"the survivors to go on after standby {n}'s fault")
    return max(min(later()) - fault, 0.0)  # 0: they had committed a later step before the fault (no stall)


def verdict(rows: list[dict], kills: int) -> dict:
    """What the log shows (see the module docstring): ``unequal`` (steps the survivors both committed with
    different parameters or shared state), ``failed_committed`` (rows that committed with an error),
    ``unhealed`` (standbys that never committed or differed from the survivors after healing), ``steps``, and
    ``unequal_rows`` (every row of the first two unequal steps)."""
    by_step: dict[int, list[dict]] = {}
    for r in rows:
        if r["committed"]:
            by_step.setdefault(r["step"], []).append(r)
    unequal = [s for s, rs in by_step.items()
               if len({(r["params"], r["shared"]) for r in rs if r["replica"] < 2}) > 1]
    failed = [r for r in rows if r["committed"] and r["error"]]
    unhealed = []
    for n in range(kills + 1):
        mine = [r for r in rows if r.get("standby") == n and r["committed"]]
        if not mine:
            unhealed.append(n)
            continue
        for r in mine[1:]:  # after its healing step
            peers = [p for p in by_step[r["step"]] if p["replica"] < 2]
            if peers and (peers[0]["params"], peers[0]["shared"]) != (r["params"], r["shared"]):
                unhealed.append(n)
                break
    return {"unequal": sorted(unequal), "failed_committed": len(failed), "unhealed": unhealed,
            "steps": max(by_step, default=-1) + 1,
            "unequal_rows": [r for r in rows if r["step"] in unequal[:2]]}  # what a failure shows to replay it


if __name__ == "__main__":
    config = json.loads(sys.argv[1])
    (zygote if config.get("zygote") else replica)(config)
    os._exit(0)
