"""DistributedDataParallel with a compressed gradient exchange, complete: 2 processes on one machine::

    torchrun --nproc_per_node 2 examples/ddp.py                   # int8, 3 epochs
    torchrun --nproc_per_node 2 examples/ddp.py --scheme auto     # or powersgd:rank=2, topk:ratio=0.01, ...

Each process trains a small MLP on its share of scikit-learn's handwritten digits (bundled with scikit-learn,
nothing is downloaded: ``pip install -e '.[demo]'``); DDP averages the gradients, and the one line
``gradcompress.register_ddp_hook(ddp, scheme)`` compresses that exchange. gloo on CPU, NCCL with one GPU per
process. Rank 0 prints the loss of each epoch, the held-out accuracy, and at the end what was sent.
tests/test_examples.py runs the command above with ``--max-steps``.
"""

import argparse
import os

import torch
import torch.distributed as dist
import torch.nn as nn
from sklearn.datasets import load_digits
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import gradcompress


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--scheme", default="int8", help="a gradcompress scheme (default: int8)")
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--max-steps", type=int, default=None, help="stop after this many steps (a quick check)")
    parser.add_argument("--batch-size", type=int, default=32, help="per process")
    parser.add_argument("--lr", type=float, default=0.1)
    args = parser.parse_args()

    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo")  # torchrun sets RANK, WORLD_SIZE, MASTER_ADDR/PORT
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)

    x, y = load_digits(return_X_y=True)
    x, y = torch.tensor(x / 16.0, dtype=torch.float32), torch.tensor(y)
    order = torch.randperm(len(x), generator=torch.Generator().manual_seed(0))  # the same split on every rank
    held_out, train = order[:300], order[300:]
    data = TensorDataset(x[train], y[train])
    sampler = DistributedSampler(data, num_replicas=world, rank=rank, seed=0)  # this rank's share
    loader = DataLoader(data, batch_size=args.batch_size, sampler=sampler, drop_last=True)

    model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 10)).to(device)
    ddp = DistributedDataParallel(model, device_ids=[device.index] if cuda else None)  # rank 0's weights everywhere
    compressor = gradcompress.register_ddp_hook(ddp, args.scheme)  # the one line
    optimizer = torch.optim.SGD(ddp.parameters(), lr=args.lr, momentum=0.9)

    step = 0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        total, batches = 0.0, 0
        for xb, yb in loader:
            optimizer.zero_grad()
            loss = nn.functional.cross_entropy(ddp(xb.to(device)), yb.to(device))
            loss.backward()  # the hook compresses and averages each bucket here
            optimizer.step()
            total, batches, step = total + loss.item(), batches + 1, step + 1
            if step == args.max_steps:
                break
        if rank == 0:
            print(f"epoch {epoch}: loss {total / max(batches, 1):.4f} (rank 0's batches)", flush=True)
        if step == args.max_steps:
            break

    stats = compressor.stats()  # every rank: its own counters
    if rank == 0:
        with torch.no_grad():
            accuracy = (model(x[held_out].to(device)).argmax(1).cpu() == y[held_out]).float().mean().item()
        ddp_bytes = stats["raw_bytes"] * 2 * (world - 1) / world  # what DDP's ring all-reduce sends of it
        print(f"held-out accuracy {accuracy:.3f}", flush=True)
        print(f"sent: {args.scheme}, {stats['steps']} steps, {stats['wire_bytes'] / 1e6:.3f} MB from rank 0 against "
              f"{ddp_bytes / 1e6:.3f} MB by DDP's all-reduce: {ddp_bytes / max(stats['wire_bytes'], 1):.1f}x fewer "
              f"bytes", flush=True)
        print(compressor.explain(), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
