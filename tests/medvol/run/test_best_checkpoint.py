"""`test=true` evaluates the best checkpoint by the optimized metric, not the weights at the end of training."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from lightning_modules.base import MedvolModule
from medvol.run.training import run
from tests.conftest import TINY, compose_cfg

TINY_DATA = [item for item in TINY if not item.startswith("model.")]


class StepCounter(MedvolModule):
    """A weight that grows by one every optimizer step; the validation loss is lowest after epoch `best_epoch`.

    The test metric is the weight itself, so it says which checkpoint the test stage loaded.
    """

    def __init__(self, best_epoch: int = 1) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.steps = nn.Parameter(torch.zeros(1))

    def training_step(self, batch: dict[str, Any], batch_idx: int) -> torch.Tensor:
        # SGD with lr 1 on -w adds exactly 1 per step.
        return -self.steps.sum() + 0 * batch["image"].sum()

    def validation_step(self, batch: dict[str, Any], batch_idx: int) -> None:
        distance = float(abs(self.current_epoch - self.hparams.best_epoch))
        self.log("val/loss", distance, batch_size=batch["image"].shape[0])

    def test_step(self, batch: dict[str, Any], batch_idx: int) -> None:
        self.log("test/steps", self.steps.sum().detach(), batch_size=batch["image"].shape[0])

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=1.0)


def test_test_stage_loads_the_best_checkpoint_not_the_last_weights(tmp_path):
    cfg = compose_cfg(tmp_path, [
        *TINY_DATA, "~model", f"+model={{_target_:{StepCounter.__module__}.StepCounter,best_epoch:1}}",
        "optimized_metric=val/loss", "optimized_mode=min", "callbacks.volume_slices=null",
        "trainer.max_epochs=3", "test=true",
    ], tiny=False)
    metrics = run(cfg)
    checkpoints = tmp_path / "checkpoints"
    (best,) = checkpoints.glob("epoch001-*.ckpt")
    best_steps = torch.load(best, weights_only=True)["state_dict"]["steps"].item()
    last_steps = torch.load(checkpoints / "last.ckpt", weights_only=True)["state_dict"]["steps"].item()
    assert 0 < best_steps < last_steps
    assert metrics["test/steps"] == best_steps
