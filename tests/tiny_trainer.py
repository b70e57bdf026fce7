"""A few tensors and a one-weight regression under a real `pl.Trainer`, for callbacks and the step axis."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytorch_lightning as pl
import torch
from torch.utils.data import DataLoader, Dataset


class Samples(Dataset):
    """`count` samples {"image": (1,), "target": (1,)} with target = 2 * image."""

    def __init__(self, count: int) -> None:
        self.x = torch.linspace(-1, 1, count).unsqueeze(1)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return {"image": self.x[index], "target": 2 * self.x[index]}


class TinyRegression(pl.LightningModule):
    """y = w x, trained with SGD; logs `val/loss`, `test/loss` and whatever `val_metrics` (epoch -> dict) gives."""

    def __init__(self, val_metrics: Any = None) -> None:
        super().__init__()
        self.net = torch.nn.Linear(1, 1, bias=False)
        self.val_metrics = val_metrics

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        loss = torch.nn.functional.mse_loss(self.net(batch["image"]), batch["target"])
        self.log("train/loss", loss, batch_size=len(batch["image"]))
        return loss

    def validation_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> None:
        loss = torch.nn.functional.mse_loss(self.net(batch["image"]), batch["target"])
        self.log("val/loss", loss, batch_size=len(batch["image"]))
        for name, value in (self.val_metrics(self.current_epoch) if self.val_metrics else {}).items():
            self.log(name, value, batch_size=len(batch["image"]))

    def test_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> None:
        loss = torch.nn.functional.mse_loss(self.net(batch["image"]), batch["target"])
        self.log("test/loss", loss, batch_size=len(batch["image"]))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def loader(count: int = 8, batch_size: int = 2) -> DataLoader:
    return DataLoader(Samples(count), batch_size=batch_size)


def tiny_trainer(root: Path, **settings: Any) -> pl.Trainer:
    """A quiet CPU trainer writing under `root`; `settings` override the defaults."""
    defaults: dict[str, Any] = dict(
        accelerator="cpu", devices=1, max_epochs=1, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0, default_root_dir=str(root),
    )
    return pl.Trainer(**{**defaults, **settings})
