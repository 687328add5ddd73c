"""A process of a torchft replica group of 2 running DiLoCo over its FSDP2 shards (tests/test_diloco_fsdp.py).

Each replica group shards the digits MLP with ``fully_shard`` over its own 1-D mesh (the group's default gloo
process group: FSDP's collectives stay inside the group); each group rank has its own torchft ``Manager``, whose
process group joins the same group rank of every replica group, and ``DiLoCo(..., manager=manager)`` syncs that
rank's shards with them. Run as ``python tests/diloco_fsdp_torchft_workers.py '<json config>'``; logs one JSON
line per sync.
"""

from __future__ import annotations

import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src"))

from gradcompress.testbed.faults import data, digest, make_manager, rendezvous, wait_for
from torchft_workers import _join_group, _kill_group, sharded_model


def replica(cfg: dict) -> None:
    """One group rank: ``kill_at`` (inner step: group rank 0 SIGKILLs the group), ``pause_at`` (inner step: wait for
    the restarted group), ``restarted`` (announces itself just before its first sync)."""
    from gradcompress.optim import DiLoCo

    g, store = cfg["group_rank"], _join_group(cfg)
    x, y = data()
    net = sharded_model()
    manager, _ = make_manager(cfg, (None, None), group_rank=g, group_world=2, store_port=store.port)
    opt = DiLoCo(net, torch.optim.AdamW(net.parameters(), lr=3e-3), sync_every=cfg["sync_every"], codec=cfg["spec"],
                 manager=manager)
    with open(os.path.join(cfg["dir"], f"pid{cfg['replica']}_{g}"), "w") as f:
        f.write(str(os.getpid()))
    gen = torch.Generator().manual_seed(1000 + 10 * cfg["replica"] + g)
    log = open(cfg["log"], "a")
    rendezvous(cfg, announce=False)
    while opt.inner_steps < cfg["steps"]:
        if cfg.get("restarted") and g == 0 and opt.inner_steps + 1 == cfg["sync_every"]:  # its first sync next
            open(os.path.join(cfg["dir"], "rejoined"), "w").close()
        if cfg.get("kill_at") == opt.inner_steps:
            _kill_group(cfg)
        if cfg.get("pause_at") == opt.inner_steps:
            wait_for(os.path.join(cfg["dir"], "rejoined"))
        idx = torch.randint(0, len(x), (32,), generator=gen)
        opt.zero_grad()
        torch.nn.functional.cross_entropy(net(x[idx]), y[idx]).backward()
        syncs = opt.syncs
        opt.step()
        if opt.syncs != syncs:
            with torch.no_grad():
                loss = float(torch.nn.functional.cross_entropy(net(x), y))  # an FSDP forward: both group ranks
            log.write(json.dumps({"replica": cfg["replica"], "group_rank": g, "inner_steps": opt.inner_steps,
                                  "syncs": opt.syncs, "participants": manager.num_participants(),
                                  "skipped": opt.skipped, "anchor": digest(opt.anchor),
                                  "params": digest(p.to_local() for p in net.parameters()),
                                  "local_numel": sum(a.numel() for a in opt.anchor), "loss": loss,
                                  "pid": os.getpid()}) + "\n")
            log.flush()
    manager.shutdown(wait=False)


if __name__ == "__main__":
    replica(json.loads(sys.argv[1]))
    os._exit(0)
