"""Hugging Face Accelerate + gradcompress: prepare the model, then install the compression hook.

Run on 2 CPU processes (what tests/test_integrations.py does)::

    torchrun --nproc-per-node 2 examples/accelerate_ddp.py OUT_DIR int8

or ``accelerate launch --cpu --num_processes 2 examples/accelerate_ddp.py OUT_DIR int8``.
``accelerator.prepare(model)`` wraps the model in ``DistributedDataParallel`` (gloo on CPU,
NCCL on GPUs); ``gradcompress.register_ddp_hook`` then compresses its gradient exchange.
Each rank saves its compressor's stats and parameters to OUT_DIR.
"""

import os
import sys

import torch
import torch.nn as nn
from accelerate import Accelerator

import gradcompress


def main(out_dir: str, spec: str) -> None:
    accelerator = Accelerator(cpu=True)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 128), nn.ReLU(), nn.Linear(128, 10))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(1)
    data = torch.utils.data.TensorDataset(torch.randn(256, 32, generator=g), torch.randint(0, 10, (256,), generator=g))
    loader = torch.utils.data.DataLoader(data, batch_size=16)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    compressor = gradcompress.register_ddp_hook(model, spec, min_numel=0, warmup_steps=1)  # the one line
    steps = 0
    for x, y in loader:
        optimizer.zero_grad()
        accelerator.backward(nn.functional.cross_entropy(model(x), y))
        optimizer.step()
        steps += 1
    torch.save({"stats": compressor.stats(), "steps": steps, "ddp": type(model).__name__,
                "params": [p.detach() for p in accelerator.unwrap_model(model).parameters()]},
               os.path.join(out_dir, f"rank{accelerator.process_index}.pt"))
    accelerator.wait_for_everyone()
    accelerator.end_training()  # tears the process group down before exit (no gloo abort at shutdown)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
