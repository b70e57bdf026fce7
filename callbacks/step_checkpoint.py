"""Lightning's `ModelCheckpoint` with `{step}` in file names on the run's one step axis, and a fallback metric."""

from __future__ import annotations

import logging
from typing import Any

import pytorch_lightning as pl
import torch
from pytorch_lightning.callbacks import ModelCheckpoint

from medvol.core.step import logging_step

log = logging.getLogger("medvol")


class StepCheckpoint(ModelCheckpoint):
    """`ModelCheckpoint` (same arguments) whose `{step}` is where TensorBoard shows the checkpoint's score.

    That is the step at which the validation just run logged its metrics (`medvol.core.step`), not
    `global_step`, which counts both optimizers of a GAN; for saves between validations
    (`every_n_train_steps`) or without validation, the current step.

    A monitored metric can be undefined on a validation set (NaN: the AUROC of a set that holds
    one class). Lightning would then rank every checkpoint last and keep whichever came first;
    with `fallback_monitor`, the checkpoints are ranked by that metric instead, from the first
    validation whose monitored value is NaN (before any checkpoint was ranked), and the console
    says so.

    Args:
        fallback_monitor: metric to rank by when `monitor` is NaN, e.g. `val/loss`; null: none.
        fallback_mode: `min` or `max` for the fallback metric.
        *args, **kwargs: `ModelCheckpoint`'s.
    """

    def __init__(
        self, *args: Any, fallback_monitor: str | None = None, fallback_mode: str = "min", **kwargs: Any
    ) -> None:
        super().__init__(*args, **kwargs)
        self._validated_at: int | None = None
        self.fallback_monitor = fallback_monitor
        self.fallback_mode = fallback_mode
        self._configured = (self.monitor, self.mode)
        self._falling_back = False

    @property
    def state_key(self) -> str:
        # The configured monitor, also after a fallback: a resumed run finds the state it saved.
        return self._generate_state_key(
            monitor=self._configured[0], mode=self._configured[1], every_n_train_steps=self._every_n_train_steps,
            every_n_epochs=self._every_n_epochs, train_time_interval=self._train_time_interval,
        )

    def _fall_back(self) -> None:
        self._falling_back = True
        # A file name that shows the configured metric would read `scorenan`: it shows the one that ranks it.
        if self.filename and self.monitor:
            self.filename = self.filename.replace("{" + self.monitor, "{" + self.fallback_monitor)
        self.monitor, self.mode = self.fallback_monitor, self.fallback_mode
        self.kth_value = torch.tensor(torch.inf if self.mode == "min" else -torch.inf)

    def _save_topk_checkpoint(self, trainer: pl.Trainer, monitor_candidates: dict[str, torch.Tensor]) -> None:
        current = monitor_candidates.get(self.monitor) if self.monitor else None
        undefined = current is not None and bool(torch.isnan(current))
        if undefined and self.fallback_monitor and not self._falling_back and not self.best_k_models \
                and self.fallback_monitor in monitor_candidates:
            if trainer.is_global_zero:
                log.warning(
                    "checkpointing: `%s` is undefined (NaN) on this validation set; the best checkpoints are "
                    "chosen by `%s` (%s) instead", self.monitor, self.fallback_monitor, self.fallback_mode,
                )
            self._fall_back()
        super()._save_topk_checkpoint(trainer, monitor_candidates)

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "falling_back": self._falling_back}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if state_dict.get("falling_back") and self.fallback_monitor:
            self._fall_back()
        super().load_state_dict(state_dict)

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
