"""Lightning's `ModelCheckpoint` with `{step}` in file names on the run's one step axis."""

from __future__ import annotations

from typing import Any

import pytorch_lightning as pl
import torch
from pytorch_lightning.callbacks import ModelCheckpoint

from medvol.core.step import logging_step


class StepCheckpoint(ModelCheckpoint):
    """`ModelCheckpoint` (same arguments) whose `{step}` is where TensorBoard shows the checkpoint's score.

    That is the step at which the validation just run logged its metrics (`medvol.core.step`), not
    `global_step`, which counts both optimizers of a GAN; for saves between validations
    (`every_n_train_steps`) or without validation, the current step.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._validated_at: int | None = None

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any, **kwargs: Any) -> None:
        # Saves every n training steps happen here, before this batch's validation: they take the current step.
        self._validated_at = None
        super().on_train_batch_end(trainer, pl_module, *args, **kwargs)

    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if not trainer.sanity_checking:
            self._validated_at = logging_step(trainer)
        super().on_validation_end(trainer, pl_module)

    def _monitor_candidates(self, trainer: pl.Trainer) -> dict[str, torch.Tensor]:
        candidates = super()._monitor_candidates(trainer)
        step = self._validated_at if self._validated_at is not None else logging_step(trainer)
        candidates["step"] = torch.tensor(step)
        return candidates
