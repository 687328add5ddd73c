"""Replica processes for tests/test_torchft.py beyond :mod:`gradcompress.testbed.faults`' own (``kind="ddp"``):
DiLoCo under torchft, replica groups of 2 processes, and a replica whose quorum never forms.

Run as ``python tests/torchft_workers.py '<json config>'``; each writes JSON lines to the scenario's log.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "src"))

from gradcompress.integrations import torchft as gft
from gradcompress.quorum import shared_state
from gradcompress.testbed.faults import announce_once_asked, data, digest, make_manager, model, rendezvous, replica_main, wait_for


def _announce_after_first_quorum(manager, cfg) -> None:
    """The survivors waiting for ``rejoined`` go on once the lighthouse holds this replica's first quorum request
    (``faults.announce_once_asked``): were the survivors, the previous quorum, to ask first, the lighthouse would form
    their quorum at once without it (a "fast quorum"), and the replacement's first exchange would pair with their
    next one and fail. The lighthouse's ``join_ms`` must leave the survivors time to ask."""
    start = manager.start_quorum

    def start_then_announce(*args, **kwargs):
        out = start(*args, **kwargs)
        if not os.path.exists(os.path.join(cfg["dir"], "rejoined")):
            announce_once_asked(cfg["dir"], cfg["lighthouse"])
        return out

    manager.start_quorum = start_then_announce


def diloco_replica(cfg):
    """One replica running DiLoCo under torchft (H = ``sync_every``; streamed with ``fragments``, ``delay``); logs
    each sync (each apply of a fragment)."""
    from gradcompress.optim import DiLoCo

    x, y = data()
    net = model()
    manager, store = make_manager(cfg, (None, None))
    inner = torch.optim.AdamW(net.parameters(), lr=3e-3)
    opt = DiLoCo(net, inner, sync_every=cfg["sync_every"], codec=cfg["spec"], manager=manager,
                 fragments=cfg.get("fragments", 1), delay=cfg.get("delay", 0))
    log = open(cfg["log"], "a")
    gen = torch.Generator().manual_seed(1000 + cfg["replica"])
    rendezvous(cfg, announce=False)  # a restarted replica announces itself just before its first sync, or with
    after = cfg.get("announce_once_asked")  # this, once the lighthouse holds its first quorum request
    if cfg.get("restarted") and after:
        _announce_after_first_quorum(manager, cfg)
    while opt.inner_steps < cfg["steps"]:
        if cfg.get("restarted") and not after and opt.inner_steps + 1 == cfg["sync_every"]:  # first sync next
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


class _Closed:
    """A closed exchange step as a torchft quorum holds it until the Manager decides: ``finite`` (every rank was),
    ``committed`` once decided."""

    def __init__(self, finite: bool):
        self.finite, self.committed = finite, None

    def decide(self, agreed: bool) -> bool:
        self.committed = bool(agreed) and self.finite
        return self.committed


class _NoCommit:
    """A Manager whose ``should_commit`` refuses: a peer died in the exchange (what the survivors of
    test_streaming_diloco_replica_killed_and_restarted_keeps_training see for the exchange the killed one was in)."""

    def should_commit(self) -> bool:
        return False


def lost_exchange(rank, world, poisoned: bool = False):
    """Streaming DiLoCo (H = 10, 2 fragments, delay 2) trained 7 inner steps, then fragment 1's exchange is decided
    as torchft decides one a peer died in (finite, not committed), at its apply: returns (fragment 1's local
    parameters kept, equal to its anchors, its anchors unchanged, fragment 0 untouched, ``skipped``).
    ``poisoned``: an Inf in this replica's fragment 1 first (it must restart from its anchor then)."""
    from gradcompress.optim import DiLoCo
    from gradcompress.optim.streaming import InFlight, done

    torch.manual_seed(0)
    x, y = data()
    net = model()
    opt = DiLoCo(net, torch.optim.SGD(net.parameters(), lr=0.1), sync_every=10, codec="int4", fragments=2, delay=2)
    gen = torch.Generator().manual_seed(7)
    for _ in range(7):
        idx = torch.randint(0, len(x), (32,), generator=gen)
        opt.zero_grad()
        torch.nn.functional.cross_entropy(net(x[idx]), y[idx]).backward()
        opt.step()
    one, zero = opt.parts[1], opt.parts[0]
    if poisoned:
        with torch.no_grad():
            opt.params[one[0]].view(-1)[0] = float("inf")
    local = [opt.params[i].detach().clone() for i in one]
    others = [opt.params[i].detach().clone() for i in zero]
    anchors = [opt.anchor[i].detach().clone() for i in one]
    opt.quorum.manager = _NoCommit()
    opt.exchange.flight[1] = InFlight(1, [torch.zeros_like(a) for a in anchors], 7, done(_Closed(True)))
    applied = opt._apply(1)
    kept = all(torch.equal(a, opt.params[i]) for a, i in zip(local, one))
    restarted = all(torch.equal(opt.anchor[i], opt.params[i]) for i in one)
    anchors_kept = all(torch.equal(a, opt.anchor[i]) for a, i in zip(anchors, one))
    untouched = all(torch.equal(a, opt.params[i]) for a, i in zip(others, zero))
    opt.close()
    return applied, kept, restarted, anchors_kept, untouched, opt.skipped


def group_replica(cfg):
    """One process of a replica group of 2: DDP inside the group on its own gloo group, gradcompress's managed
    ``synchronize`` between the groups (each group rank exchanges with the same group rank of the other groups)."""
    import torch.distributed as dist
    from torchft.optim import OptimizerWrapper

    g, store = cfg["group_rank"], _join_group(cfg)
    x, y = data()
    net = model()
    ddp = torch.nn.parallel.DistributedDataParallel(net)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    manager, _ = make_manager(cfg, (lambda sd: net.load_state_dict(sd), lambda: net.state_dict()), group_rank=g,
                              group_world=2, store_port=store.port)
    comp = gft.Compressor(cfg["spec"], manager, group=dist.group.WORLD)
    optimizer = OptimizerWrapper(manager, opt)
    log = open(cfg["log"], "a")
    for step, idx in _group_steps(cfg, manager, len(x)):
        optimizer.zero_grad()
        torch.nn.functional.cross_entropy(ddp(x[idx]), y[idx]).backward()
        before = digest([p.grad for p in net.parameters()])
        comp.synchronize(net.parameters())
        after = digest([p.grad for p in net.parameters()])
        silent = comp.coordinator.held[-1].silent
        optimizer.step()
        log.write(json.dumps({"replica": cfg["replica"], "group_rank": g, "step": step, "committed": manager.current_step() > step, "participants":
                              manager.num_participants(), "params": digest(net.parameters()),
                              "state_step": comp.state_dict()["step"], "grads": [before, after], "rank": comp.coordinator.comm.rank, "silent": silent}) + "\n")
        log.flush()
    manager.shutdown(wait=False)


def _group_steps(cfg, manager, examples: int):
    """A replica group process's steps until ``steps``: (the Manager's step, this step's minibatch of 32 indices),
    with the scenario's points (``kill_at``: SIGKILL the group — group rank 0 kills its peers first, so that none
    of them sees rank 0's Manager vanish and fails on its own before its kill —; ``pause_at``: wait for the
    restarted replica); a first start waits for every replica first."""
    gen = torch.Generator().manual_seed(1000 + 10 * cfg["replica"] + cfg["group_rank"])
    with open(os.path.join(cfg["dir"], f"pid{cfg['replica']}_{cfg['group_rank']}"), "w") as f:
        f.write(str(os.getpid()))
    if cfg["group_rank"] == 0 or not cfg.get("restarted"):
        rendezvous(cfg)
    while manager.current_step() < cfg["steps"]:
        step = manager.current_step()
        if cfg.get("kill_at") == step:
            _kill_group(cfg)
        if cfg.get("pause_at") == step:
            wait_for(os.path.join(cfg["dir"], "rejoined"))
        yield step, torch.randint(0, examples, (32,), generator=gen)


def _kill_group(cfg) -> None:
    """SIGKILL this replica group: group rank 0 its peers first (each named by its pid file), then itself."""
    if cfg["group_rank"] == 0:
        for g in range(1, 2):
            try:
                os.kill(int(open(os.path.join(cfg["dir"], f"pid{cfg['replica']}_{g}")).read()), signal.SIGKILL)
            except (OSError, ValueError):  # already gone
                pass
    os.kill(os.getpid(), signal.SIGKILL)


def sharded_model() -> torch.nn.Module:
    """The scenarios' model sharded by FSDP2 over this replica group's 2 processes (each Linear, then the root)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (2,))
    net = model()
    for layer in net:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(net, mesh=mesh)
    return net


def _join_group(cfg):
    """This process's replica group of 2 as the default process group (gloo; a TCPStore its group rank 0 serves,
    its port in the file ``store<replica>``): the store."""
    import torch.distributed as dist
    from torch.distributed import TCPStore

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
    return store


def hsdp_replica(cfg):
    """One process of a replica group of 2 under compressed HSDP: the MLP sharded over the group's own 1-D mesh
    (FSDP's reduce-scatter inside the group), ``register_fsdp(..., manager=)`` between the groups; torchft heals a
    group rank from its peer's local shards. Logs each step: its shards' digest and the loss on the whole data."""
    from torchft.optim import OptimizerWrapper

    import gradcompress

    g, store = cfg["group_rank"], _join_group(cfg)
    x, y = data()
    net = sharded_model()
    sharded = list(net.parameters())  # FSDP's DTensors (the module holds unsharded ones during forward/backward)

    def shards():
        return [p.to_local() for p in sharded]

    def load(state):
        with torch.no_grad():
            for t, saved in zip(shards(), state["shards"]):
                t.copy_(saved)

    manager, _ = make_manager(cfg, (load, lambda: {"shards": [t.detach().clone() for t in shards()]}),
                              group_rank=g, group_world=2, store_port=store.port)
    mesh = sharded[0].device_mesh  # the group's own 1-D mesh, as a user passes it
    comp = gradcompress.register_fsdp(net, cfg["spec"], mesh=mesh, manager=manager)
    optimizer = OptimizerWrapper(manager, torch.optim.SGD(sharded, lr=0.1))
    log = open(cfg["log"], "a")
    for step, idx in _group_steps(cfg, manager, len(x)):
        optimizer.zero_grad()  # the step's quorum
        torch.nn.functional.cross_entropy(net(x[idx]), y[idx]).backward()  # FSDP's hooks: the compressed exchange
        optimizer.step()  # only if manager.should_commit()
        with torch.no_grad():
            full = float(torch.nn.functional.cross_entropy(net(x), y))  # an FSDP forward: both group ranks
        log.write(json.dumps({"replica": cfg["replica"], "group_rank": g, "step": step,
                              "committed": manager.current_step() > step, "participants": manager.num_participants(),
                              "params": digest(shards()), "loss": full, "wire": comp.stats()["wire_bytes"]}) + "\n")
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

    inside, left = threading.Event(), threading.Event()  # the hook's wait_quorum called / returned or raised
    wait_quorum = manager.wait_quorum

    def waiting(*args, **kwargs):
        inside.set()
        try:
            return wait_quorum(*args, **kwargs)
        finally:
            left.set()

    manager.wait_quorum = waiting

    def read():
        inside.wait(timeout=60)
        times: dict = {"inside": inside.is_set()}
        for name, fn in (("state_dict", comp.state_dict), ("shared_state_dict", lambda: shared_state(comp)),
                         ("stats", comp.stats)):
            start = time.time()
            fn()
            times[name] = time.time() - start
        times["waiting"] = comp.current_step is None and not comp.coordinator.held  # the step has not begun: inside the wait
        times["still_inside"] = not left.is_set()  # every read done while the quorum wait is still open
        with open(cfg["log"], "a") as f:
            f.write(json.dumps(times) + "\n")
        os._exit(0)

    threading.Thread(target=read, daemon=True).start()
    manager.start_quorum()
    torch.nn.functional.cross_entropy(ddp(x[:32]), y[:32]).backward()  # the hook waits for the quorum
    os._exit(3)


if __name__ == "__main__":
    cfg = json.loads(sys.argv[1])
    kinds = {"ddp": replica_main, "diloco": diloco_replica, "group": group_replica, "blocked": blocked_replica,
             "hsdp": hsdp_replica}
    kinds[cfg.get("kind", "ddp")](cfg)
    os._exit(0)
