"""Lightning + gradcompress: CompressedDDPStrategy on 2 CPU processes (tests/test_integrations.py runs it).

    python examples/lightning_ddp.py OUT_DIR topk:ratio=0.05


Lightning's popen launcher starts rank 1 by running this script again with its rank in the
environment; each rank saves its compressor's stats and its parameters to OUT_DIR.
"""

import os
import sys

import lightning
import torch
import torch.nn as nn

from gradcompress.integrations.lightning import CompressedDDPStrategy


class Net(lightning.LightningModule):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(32, 128), nn.ReLU(), nn.Linear(128, 10))

    def training_step(self, batch, _):
        x, y = batch
        return nn.functional.cross_entropy(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def main(out_dir: str, spec: str) -> None:
    g = torch.Generator().manual_seed(1)
    data = torch.utils.data.TensorDataset(torch.randn(256, 32, generator=g), torch.randint(0, 10, (256,), generator=g))
    loader = torch.utils.data.DataLoader(data, batch_size=16)
    strategy = CompressedDDPStrategy(spec, min_numel=0, warmup_steps=1, bucket_cap_mb=1)
    trainer = lightning.Trainer(accelerator="cpu", devices=2, strategy=strategy, max_steps=6, logger=False,
                                enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    model = Net()
    trainer.fit(model, loader)
    rank = trainer.global_rank
    torch.save({"stats": strategy.compressor.stats(), "params": [p.detach() for p in model.parameters()],
                "error_feedback": strategy.compressor.error_feedback},
               os.path.join(out_dir, f"rank{rank}.pt"))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
