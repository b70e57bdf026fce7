"""Anatomical mid-plane grids of fixed validation subjects, sent to every image-capable logger at the shared step."""

from __future__ import annotations

from typing import Any

import pytorch_lightning as pl
import torch
from pytorch_lightning.utilities import rank_zero_only

from callbacks.slice_grid import Sample, slice_grid
from medvol.core.step import logging_step

TAG = "val/slices"


class VolumeSliceLogger(pl.Callback):
    """Logs the `volumes` that `validation_step` returns as a labelled grid of anatomical planes.

    The first logged epoch picks `max_samples` validation subjects (by the batch's `subject`
    key, else by position); later epochs show the same subjects, so the image slider in
    TensorBoard scrubs through training. Planes are named from the batch's `affine`
    (radiological convention). A `"difference": (a, b)` entry in the step output adds an |a - b|
    error-map column; a `"segments"` entry (structure -> label values) colours and names the label maps' structures
    as the report page does. Images are logged at the step of the scalars and checkpoints
    (`medvol.core.step.logging_step`).

    Args:
        every_n_epochs: log every this many validation epochs.
        max_samples: subjects per grid.
        panel_size: side of each plane's panel in pixels (nearest-neighbour upsampling).
        colorbar: draw the error map's colour scale next to it.
    """

    def __init__(
        self, every_n_epochs: int = 1, max_samples: int = 2, panel_size: int = 256, colorbar: bool = True
    ) -> None:
        self.every_n_epochs = every_n_epochs
        self.max_samples = max_samples
        self.panel_size = panel_size
        self.colorbar = colorbar
        self.subjects: list[str] | None = None
        self._found: dict[str, Sample] = {}

    def state_dict(self) -> dict[str, Any]:
        return {"subjects": self.subjects}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.subjects = state_dict.get("subjects")

    def _due(self, trainer: pl.Trainer) -> bool:
        return not trainer.sanity_checking and trainer.current_epoch % self.every_n_epochs == 0

    def on_validation_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._found = {}

    @rank_zero_only
    def on_validation_batch_end(
        self,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        outputs: Any,
        batch: Any,
        batch_idx: int,
        dataloader_idx: int = 0,
    ) -> None:
        if not self._due(trainer) or not isinstance(outputs, dict) or "volumes" not in outputs:
            return
        volumes: dict[str, torch.Tensor] = outputs["volumes"]
        size = next(iter(volumes.values())).shape[0]
        batch = batch if isinstance(batch, dict) else {}
        subjects = batch.get("subject") or [f"val-{batch_idx}-{i}" for i in range(size)]
        affines = batch.get("affine")
        difference = outputs.get("difference")
        for i, subject in enumerate(map(str, subjects)):
            wanted = subject in self.subjects if self.subjects is not None else len(self._found) < self.max_samples
            if not wanted or subject in self._found:
                continue
            self._found[subject] = Sample(
                subject=subject,
                volumes={name: vol[i, 0].detach().cpu() for name, vol in volumes.items()},
                affine=affines[i].detach().cpu() if affines is not None else None,
                difference=tuple(difference) if difference else None,
                segments=dict(outputs["segments"]) if outputs.get("segments") else None,
            )

    @rank_zero_only
    def on_validation_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if not self._found:
            return
        if self.subjects is None:
            self.subjects = list(self._found)
        samples = [self._found[s] for s in self.subjects if s in self._found]
        image = slice_grid(samples, self.panel_size, self.colorbar)
        step = logging_step(trainer)
        for logger in trainer.loggers:
            experiment = getattr(logger, "experiment", None)
            if hasattr(experiment, "add_image"):
                experiment.add_image(TAG, image, global_step=step, dataformats="HWC")
            elif hasattr(logger, "log_image"):
                logger.log_image(key=TAG, images=[image], step=step)
        self._found = {}
