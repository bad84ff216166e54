"""PyTorch Lightning with the redsock backend: an ordinary LightningModule, trained by
``Trainer(strategy=DDPStrategy(process_group_backend=...), accelerator="cpu", devices=2)``.

    python examples/lightning_ddp.py --backend redsock      # or gloo, to compare
    python examples/lightning_ddp.py --backend redsock --json out/lightning.json

Nothing in the module knows about redsock: the backend is one string given to the strategy
(``import redsock.torch`` is not needed either: the backend registers itself at ``import
torch``).  Lightning starts the second process itself (it runs this script again with its
rank in the environment).  Rank 0 prints the loss over the whole data set after each epoch
and, with ``--json``, writes them.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import lightning as L
import torch
from lightning.pytorch.strategies import DDPStrategy
from torch import nn
from torch.utils.data import DataLoader, TensorDataset


class Regressor(L.LightningModule):
    """A small MLP fitting a fixed random linear map with noise (mean squared error)."""

    def __init__(self, features: int = 32, hidden: int = 64, lr: float = 0.05):
        super().__init__()
        self.save_hyperparameters()
        self.net = nn.Sequential(nn.Linear(features, hidden), nn.Tanh(), nn.Linear(hidden, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = nn.functional.mse_loss(self(x), y)
        self.log("train_loss", loss, sync_dist=True)
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.hparams.lr, momentum=0.9)


def dataset(n: int, features: int, seed: int = 0) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, features, generator=g)
    w = torch.randn(features, 1, generator=g)
    y = torch.tanh(x @ w / features ** 0.5) + 0.01 * torch.randn(n, 1, generator=g)
    return TensorDataset(x, y)


class FullLoss(L.Callback):
    """After each epoch, rank 0 evaluates the loss over the whole data set (no gradients)."""

    def __init__(self, data: TensorDataset):
        self.data = data
        self.losses: list[float] = []

    def on_train_epoch_end(self, trainer, module) -> None:
        if trainer.global_rank == 0:
            x, y = self.data.tensors
            with torch.no_grad():
                self.losses.append(nn.functional.mse_loss(module(x), y).item())


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--backend", default="redsock")
    p.add_argument("--devices", type=int, default=2)
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--samples", type=int, default=512)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--json", help="rank 0 writes the backend and the loss after each epoch here")
    args = p.parse_args(argv)

    L.seed_everything(0, workers=True)
    data = dataset(args.samples, 32)
    loss = FullLoss(data)
    trainer = L.Trainer(strategy=DDPStrategy(process_group_backend=args.backend), accelerator="cpu",
                        devices=args.devices, max_epochs=args.epochs, deterministic=True, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        callbacks=[loss])
    trainer.fit(Regressor(), DataLoader(data, batch_size=args.batch_size, shuffle=True))
    if trainer.global_rank == 0:
        backend = torch.distributed.get_backend() if torch.distributed.is_initialized() else args.backend
        print(f"backend {backend}: loss per epoch {' '.join(f'{v:.6f}' for v in loss.losses)}")
        if args.json:
            Path(args.json).write_text(json.dumps({"backend": backend, "losses": loss.losses}))


if __name__ == "__main__":
    main()
