"""What fault tolerance costs per step: plain DDP, torchft's DDP and gradcompress under torchft, side by side.

``python -m gradcompress.testbed.ftbench --hosts 4 [--rate 1gbit] [--steps 20] [--model mlp] [--modes ...]``
runs each mode once on the same model and batches, one replica per host, and prints the mean step time (after
``--warmup`` steps) and the bytes each host sent per step:

* ``ddp``: PyTorch's DDP on a gloo group (no fault tolerance), the reference;
* ``ddp+int8``, ``ddp+powersgd:rank=4``: the same with gradcompress's hook (no fault tolerance);
* ``torchft``: torchft's own DDP (a Manager, a quorum per step, dense all-reduce through the Manager);
* ``ft+none``, ``ft+int8``, ``ft+powersgd``: :class:`gradcompress.integrations.torchft.DistributedDataParallel`.

With ``--rate`` the hosts are network namespaces on one bridge with shaped links (:mod:`gradcompress.testbed.netns`,
root); without it, processes on loopback. The lighthouse runs in host 0's process, on host 0's address.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import timedelta

MODULE = "gradcompress.testbed.ftbench"
MODES = ("ddp", "ddp+int8", "ddp+powersgd:rank=4", "torchft", "ft+none", "ft+int8", "ft+powersgd:rank=4")


def _address(cfg: dict) -> str:
    """This host's address: host 0's with this node's last octet (netns), or loopback."""
    if cfg["master"] == "127.0.0.1":
        return "127.0.0.1"
    return cfg["master"].rsplit(".", 1)[0] + f".{cfg['node'] + 1}"


def _lighthouse(cfg: dict, me: str) -> tuple[object, str]:
    """Host 0 starts the lighthouse and publishes its address in the run's folder; the others read it."""
    from ..integrations.torchft import Lighthouse

    path = os.path.join(os.path.dirname(cfg["out"]), "lighthouse")
    if cfg["rank"] == 0:
        lh = Lighthouse(min_replicas=cfg["world"], host=me, join_timeout_ms=1000, heartbeat_timeout_ms=5000)
        with open(path + ".part", "w") as f:
            f.write(lh.address)
        os.replace(path + ".part", path)
        return lh, lh.address
    while not os.path.exists(path):
        time.sleep(0.05)
    return None, open(path).read()


def _setup(cfg: dict, model):
    """The model wrapped for the mode, and the step's optimizer (``step()``/``zero_grad()``)."""
    import torch
    import torch.distributed as dist

    mode, me = cfg["mode"], _address(cfg)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    if mode.startswith("ddp"):
        dist.init_process_group("gloo", init_method=f"tcp://{cfg['master']}:{cfg['port']}", rank=cfg["rank"],
                                world_size=cfg["world"], timeout=timedelta(seconds=120))
        ddp = torch.nn.parallel.DistributedDataParallel(model)
        if "+" in mode:
            import gradcompress

            gradcompress.register_ddp_hook(ddp, mode.split("+", 1)[1])
        return ddp, opt, None
    from torch.distributed import TCPStore
    from torchft.manager import Manager
    from torchft.optim import OptimizerWrapper
    from torchft.process_group import ProcessGroupGloo

    lh, address = _lighthouse(cfg, me)
    store = TCPStore(me, 0, is_master=True, wait_for_workers=False)
    manager = Manager(pg=ProcessGroupGloo(timeout=timedelta(seconds=120)), load_state_dict=model.load_state_dict,
                      state_dict=model.state_dict, min_replica_size=1, replica_id=f"replica_{cfg['rank']}",
                      store_addr=me, store_port=store.port, rank=0, world_size=1, lighthouse_addr=address,
                      hostname=me, timeout=timedelta(seconds=120), init_sync=False)
    if mode == "torchft":
        from torchft.ddp import DistributedDataParallel

        ddp = DistributedDataParallel(manager, model)
    else:
        from ..integrations.torchft import DistributedDataParallel

        ddp = DistributedDataParallel(manager, model, mode.split("+", 1)[1])
    return ddp, OptimizerWrapper(manager, opt), (manager, store, lh)


def worker(cfg: dict) -> dict:
    import torch

    from . import hosts, models

    torch.set_num_threads(1)  # several processes share this machine's cores
    model = models.build_model(cfg["model"], seed=0)
    ddp, opt, keep = _setup(cfg, model)
    x, y = models.batch(cfg["model"], 32, cfg["rank"])
    times: list[float] = []
    for i in range(cfg["warmup"] + cfg["steps"]):
        if i == cfg["warmup"]:
            tx0 = hosts.read_tx_bytes(cfg["ifname"])
        start = time.perf_counter()
        opt.zero_grad()
        models.loss(cfg["model"], ddp(x), y).backward()
        opt.step()
        if i >= cfg["warmup"]:
            times.append(time.perf_counter() - start)
    tx = hosts.read_tx_bytes(cfg["ifname"]) - tx0
    committed = keep[0].current_step() if keep else None
    return {"mode": cfg["mode"], "step_seconds": times, "tx_bytes_per_step": tx / cfg["steps"],
            "committed": committed, "torch": torch.__version__}


# --------------------------------------------------------------------------- the parent
def run_mode(mode: str, hosts_n: int, rate_bit: float | None, steps: int, warmup: int, model: str) -> list[dict]:
    settings = {"mode": mode, "steps": steps, "warmup": warmup, "model": model}
    if rate_bit is not None:
        from . import hosts

        return hosts.run_workers(hosts_n, settings, module=MODULE, rate_bit=rate_bit, delay_s=0.0,
                                 timeout=600, label="ftbench")
    return _run_loopback(hosts_n, settings)


def _run_loopback(n: int, settings: dict) -> list[dict]:
    """The same workers as local processes on loopback (``ifname`` ``lo``: its counter is every process's)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    tmp = tempfile.mkdtemp(prefix="ftbench-")
    procs = []
    for rank in range(n):
        cfg = {**settings, "parent": os.getpid(), "rank": rank, "world": n, "master": "127.0.0.1", "port": port,
               "ifname": "lo", "node": rank, "out": os.path.join(tmp, f"rank{rank}.json")}
        path = os.path.join(tmp, f"rank{rank}.cfg.json")
        with open(path, "w") as f:
            json.dump(cfg, f)
        log = open(os.path.join(tmp, f"rank{rank}.log"), "w")
        procs.append(subprocess.Popen([sys.executable, "-m", MODULE, "--worker", path], stdout=log,
                                      stderr=subprocess.STDOUT))
    for rank, p in enumerate(procs):
        if p.wait(timeout=600) != 0:
            raise RuntimeError(f"ftbench: rank {rank} failed; see {tmp}/rank{rank}.log")
    return [json.load(open(os.path.join(tmp, f"rank{r}.json"))) for r in range(n)]


def main(argv: list[str] | None = None) -> int:
    from ..timing import RATE_RULE, rate_argument as rate_arg

    p = argparse.ArgumentParser(prog="python -m gradcompress.testbed.ftbench", description=__doc__.split("\n\n")[0])
    p.add_argument("--hosts", type=int, default=4)
    p.add_argument("--rate", type=rate_arg, default=None,
                   help=f"link rate of each host, in {RATE_RULE}; default: loopback")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--model", default="mlp")
    p.add_argument("--modes", nargs="+", default=list(MODES))
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        from . import hosts

        cfg = hosts.worker_config(args.worker)
        hosts.write_result(cfg, worker(cfg))
        os._exit(0)
    from ..timing import format_rate

    rate = args.rate
    say = (lambda *a, **k: None) if args.json else print
    say(f"ftbench: {args.hosts} {'hosts at ' + format_rate(rate) if rate else 'processes on loopback'}, model "
        f"{args.model}, {args.steps} timed steps after {args.warmup}")
    base, rows = None, []
    for mode in args.modes:
        records = run_mode(mode, args.hosts, rate, args.steps, args.warmup, args.model)
        step = statistics.mean(statistics.mean(r["step_seconds"]) for r in records)
        base = base or step
        sent = statistics.mean(r["tx_bytes_per_step"] for r in records) / (1 if rate else args.hosts)
        rows.append({"mode": mode, "step_s": step, "vs_first": step / base, "tx_bytes_per_step_per_host": sent})
        say(f"  {mode:<22} {1000 * step:8.1f} ms/step  {step / base:5.2f}x {args.modes[0]}  {sent / 1e6:8.2f} "
            f"MB/step per host", flush=True)
    if args.json:
        print(json.dumps({"benchmark": "ftbench", "hosts": args.hosts, "bandwidth_bit": rate, "model": args.model,
                          "steps": args.steps, "warmup": args.warmup, "modes": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
