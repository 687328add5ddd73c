"""Replica processes for tests/test_torchft.py: one torchft replica group per process (or per pair of processes),
a real Manager talking to a real lighthouse, trained on the digits data; each writes one JSON line per step.

Run as ``python tests/torchft_workers.py '<json config>'``. A replica may SIGKILL itself at a chosen step
(``kill_at``), or inside the exchange after its first collective round (``kill_in_exchange``).
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import sys
import threading
import time
from datetime import timedelta

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "src"))

import gradcompress  # noqa: E402
from gradcompress.integrations import torchft as gft  # noqa: E402


def digest(tensors) -> str:
    h = hashlib.sha256()
    for t in tensors:
        h.update(t.detach().float().contiguous().numpy().tobytes())
    return h.hexdigest()[:16]


def data():
    from sklearn.datasets import load_digits

    x, y = load_digits(return_X_y=True)
    return torch.tensor(x / 16.0, dtype=torch.float32), torch.tensor(y)


def model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.ReLU(), torch.nn.Linear(32, 10))


def make_manager(cfg, state_fns, group_rank=0, group_world=1, store_port=None):
    from torchft.manager import Manager
    from torchft.process_group import ProcessGroupGloo
    from torch.distributed import TCPStore

    store = None
    if store_port is None:
        store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
        store_port = store.port
    load, save = state_fns
    manager = Manager(pg=ProcessGroupGloo(timeout=timedelta(seconds=cfg.get("pg_timeout", 5))),
                      load_state_dict=load, state_dict=save, min_replica_size=cfg.get("min_replicas", 1),
                      replica_id=f"replica_{cfg['replica']}", store_addr="127.0.0.1", store_port=store_port,
                      rank=group_rank, world_size=group_world, lighthouse_addr=cfg["lighthouse"],
                      hostname="127.0.0.1", timeout=timedelta(seconds=cfg.get("timeout", 10)),
                      quorum_timeout=timedelta(seconds=cfg.get("quorum_timeout", 30)),
                      connect_timeout=timedelta(seconds=10))
    return manager, store


def wait_for(path: str, timeout: float = 60.0) -> None:
    end = time.time() + timeout
    while not os.path.exists(path):
        if time.time() > end:
            raise TimeoutError(path)
        time.sleep(0.02)


def rendezvous(cfg, announce: bool = True) -> None:
    """First start: every replica ready before the first quorum (so the first quorum holds them all); a restarted
    replica announces itself (its Manager heartbeats now) and goes straight to its first quorum."""
    if cfg.get("restarted"):
        if announce:
            open(os.path.join(cfg["dir"], "rejoined"), "w").close()
        return
    open(os.path.join(cfg["dir"], f"ready{cfg['replica']}"), "w").close()
    for i in range(cfg["replicas"]):
        wait_for(os.path.join(cfg["dir"], f"ready{i}"))


def kill_inside_exchange(compressor, at_step: int) -> None:
    """SIGKILL this process inside the exchange of step ``at_step``, after its first collective round."""
    comm = compressor.collectives
    wait = comm.wait

    def wait_then_die(works):
        wait(works)
        if compressor.manager.current_step() == at_step:
            os.kill(os.getpid(), signal.SIGKILL)

    comm.wait = wait_then_die


def ddp_replica(cfg):
    """One replica (one process) training with gradcompress's torchft DDP; logs each step."""
    from torchft.optim import OptimizerWrapper

    x, y = data()
    net = model()
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
        kill_inside_exchange(comp, cfg["kill_in_exchange"])
    log = open(cfg["log"], "a")
    gen = torch.Generator().manual_seed(1000 + cfg["replica"])
    rendezvous(cfg)
    while manager.current_step() < cfg["steps"]:
        step = manager.current_step()
        if cfg.get("kill_at") == step:
            log.flush()
            os.kill(os.getpid(), signal.SIGKILL)
        if cfg.get("pause_at") == step:
            wait_for(os.path.join(cfg["dir"], "rejoined"))
        idx = torch.randint(0, len(x), (32,), generator=gen)
        began = time.time()
        optimizer.zero_grad()  # start_quorum
        loss = torch.nn.functional.cross_entropy(ddp(x[idx]), y[idx])
        loss.backward()
        residuals = {k: float(v.abs().sum()) for k, v in comp.residual.items()}
        silent = comp.held[-1].silent if comp.held else None
        optimizer.step()  # should_commit, then the optimizer step if committed
        error = manager.errored()
        after = manager.current_step()
        committed = after > step
        with torch.no_grad():
            full = float(torch.nn.functional.cross_entropy(net(x), y))
        shared = comp.shared_state_dict()
        log.write(json.dumps({"replica": cfg["replica"], "step": step, "committed": committed,
                              "participants": manager.num_participants(), "silent": silent,
                              "residual_before": sum(residuals.values()), "params": digest(net.parameters()),
                              "shared": digest([t for s in ("q", "p", "momentum") for t in shared[s].values()]),
                              "state_step": comp.state.step, "after": after, "loss": full, "pid": os.getpid(),
                              "stats_steps": comp.stats()["steps"], "world": comp.collectives.world,
                              "rank": comp.collectives.rank, "wire": comp.stats()["wire_bytes"],
                              "error": None if error is None else repr(error.original_exception)[:300],
                              "seconds": time.time() - began}) + "\n")
        log.flush()
    manager.shutdown(wait=False)


def diloco_replica(cfg):
    """One replica running DiLoCo under torchft (H = ``sync_every``); logs each sync."""
    from gradcompress.optim import DiLoCo

    x, y = data()
    net = model()
    manager, store = make_manager(cfg, (None, None))
    inner = torch.optim.AdamW(net.parameters(), lr=3e-3)
    opt = DiLoCo(net, inner, sync_every=cfg["sync_every"], codec=cfg["spec"], manager=manager)
    log = open(cfg["log"], "a")
    gen = torch.Generator().manual_seed(1000 + cfg["replica"])
    rendezvous(cfg, announce=False)  # a restarted replica announces itself just before its first sync
    while opt.inner_steps < cfg["steps"]:
        if cfg.get("restarted") and opt.inner_steps + 1 == cfg["sync_every"]:  # its first sync comes next
            open(os.path.join(cfg["dir"], "rejoined"), "w").close()
        if cfg.get("kill_at") == opt.inner_steps:
            os.kill(os.getpid(), signal.SIGKILL)
        if cfg.get("pause_at") == opt.inner_steps:
            wait_for(os.path.join(cfg["dir"], "rejoined"))
        idx = torch.randint(0, len(x), (32,), generator=gen)
        opt.zero_grad()
        torch.nn.functional.cross_entropy(net(x[idx]), y[idx]).backward()
        syncs = opt.syncs
        opt.step()
        if opt.syncs != syncs or opt.inner_steps % cfg["sync_every"] == 0:
            with torch.no_grad():
                full = float(torch.nn.functional.cross_entropy(net(x), y))
            log.write(json.dumps({"replica": cfg["replica"], "inner_steps": opt.inner_steps, "syncs": opt.syncs,
                                  "participants": manager.num_participants(), "skipped": opt.skipped,
                                  "anchor": digest(opt.anchor), "params": digest(net.parameters()),
                                  "step": manager.current_step(), "loss": full, "pid": os.getpid()}) + "\n")
            log.flush()
    manager.shutdown(wait=False)


def group_replica(cfg):
    """One process of a replica group of 2: DDP inside the group on its own gloo group, gradcompress's managed
    ``synchronize`` between the groups (each group rank exchanges with the same group rank of the other groups)."""
    import torch.distributed as dist
    from torch.distributed import TCPStore
    from torchft.optim import OptimizerWrapper

    g, name = cfg["group_rank"], os.path.join(cfg["dir"], f"store{cfg['replica']}")
    if g == 0:
        store = TCPStore("127.0.0.1", 0, world_size=2, is_master=True, wait_for_workers=False)
        with open(name + ".tmp", "w") as f:
            f.write(str(store.port))
        os.replace(name + ".tmp", name)
    else:
        wait_for(name)
        store = TCPStore("127.0.0.1", int(open(name).read()), world_size=2, is_master=False)
    dist.init_process_group("gloo", store=dist.PrefixStore("group", store), rank=g, world_size=2)
    x, y = data()
    net = model()
    ddp = torch.nn.parallel.DistributedDataParallel(net)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    manager, _ = make_manager(cfg, (lambda sd: net.load_state_dict(sd), lambda: net.state_dict()), group_rank=g,
                              group_world=2, store_port=store.port)
    comp = gft.Compressor(cfg["spec"], manager, group=dist.group.WORLD)
    optimizer = OptimizerWrapper(manager, opt)
    log = open(cfg["log"], "a")
    gen = torch.Generator().manual_seed(1000 + 10 * cfg["replica"] + g)
    if g == 0 or not cfg.get("restarted"):
        rendezvous(cfg)
    while manager.current_step() < cfg["steps"]:
        step = manager.current_step()
        if cfg.get("kill_at") == step:
            os.kill(os.getpid(), signal.SIGKILL)
        if cfg.get("pause_at") == step:
            wait_for(os.path.join(cfg["dir"], "rejoined"))
        idx = torch.randint(0, len(x), (32,), generator=gen)
        optimizer.zero_grad()
        torch.nn.functional.cross_entropy(ddp(x[idx]), y[idx]).backward()
        before = digest([p.grad for p in net.parameters()])
        comp.synchronize(net.parameters())
        after = digest([p.grad for p in net.parameters()])
        silent = comp.held[-1].silent
        optimizer.step()
        log.write(json.dumps({"replica": cfg["replica"], "group_rank": g, "step": step, "committed": manager.current_step() > step, "participants":
                              manager.num_participants(), "params": digest(net.parameters()),
                              "state_step": comp.state.step, "grads": [before, after], "rank": comp.collectives.rank, "silent": silent}) + "\n")
        log.flush()
    manager.shutdown(wait=False)


def blocked_replica(cfg):
    """A replica whose quorum never forms (the lighthouse wants 2, it is alone): while its backward waits on the
    quorum inside the hook, another thread reads the compressor's state; logs how long each read took."""
    x, y = data()
    net = model()
    manager, store = make_manager(cfg, (None, None))
    ddp = gft.DistributedDataParallel(manager, net, cfg["spec"])
    comp = ddp.compressor

    def read():
        time.sleep(1.0)
        times = {}
        for name, fn in (("state_dict", comp.state_dict), ("shared_state_dict", comp.shared_state_dict),
                         ("stats", comp.stats)):
            start = time.time()
            fn()
            times[name] = time.time() - start
        times["waiting"] = comp.current_step is None and not comp.held  # the step has not begun: inside the wait
        with open(cfg["log"], "a") as f:
            f.write(json.dumps(times) + "\n")
        os._exit(0)

    threading.Thread(target=read, daemon=True).start()
    manager.start_quorum()
    torch.nn.functional.cross_entropy(ddp(x[:32]), y[:32]).backward()  # the hook waits for the quorum
    os._exit(3)


if __name__ == "__main__":
    cfg = json.loads(sys.argv[1])
    kinds = {"ddp": ddp_replica, "diloco": diloco_replica, "group": group_replica, "blocked": blocked_replica}
    kinds[cfg.get("kind", "ddp")](cfg)
    os._exit(0)
