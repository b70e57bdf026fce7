"""Mid-slice image grids (axial, coronal, sagittal) of validation volumes, sent to every image-capable logger."""

from __future__ import annotations

from typing import Any

import pytorch_lightning as pl
import torch
import torch.nn.functional as F
from pytorch_lightning.utilities import rank_zero_only


def mid_slices(volume: torch.Tensor) -> list[torch.Tensor]:
    """Axial, coronal and sagittal middle slices of a (D, H, W) volume, resized to a common square."""
    d, h, w = volume.shape
    planes = [volume[d // 2], volume[:, h // 2], volume[:, :, w // 2]]
    side = max(d, h, w)
    return [F.interpolate(p[None, None].float(), size=(side, side), mode="nearest")[0, 0] for p in planes]


def slice_grid(volumes: dict[str, torch.Tensor], max_samples: int) -> torch.Tensor:
    """A (1, rows*S, cols*S) image in [0, 1]: one row per sample; per plane, one column per named volume.

    Volumes are (B, C, D, H, W) in [-1, 1]; the first channel is shown. Integer volumes
    (label maps) are scaled by their maximum.
    """
    rows = []
    first = next(iter(volumes.values()))
    for b in range(min(max_samples, first.shape[0])):
        planes_per_volume = []
        for vol in volumes.values():
            v = vol[b, 0].detach().float().cpu()
            if not torch.is_floating_point(vol):
                v = v / max(float(v.max()), 1.0) * 2 - 1
            planes_per_volume.append(mid_slices(v))
        columns = [planes[p] for p in range(3) for planes in planes_per_volume]
        rows.append(torch.cat(columns, dim=1))
    grid = torch.cat(rows, dim=0)
    return ((grid.clamp(-1, 1) + 1) / 2)[None]


class VolumeSliceLogger(pl.Callback):
    """Logs the first validation batch's `volumes` output (a name -> (B, C, D, H, W) dict) as a slice grid.

    Columns: for each plane (axial, coronal, sagittal), each named volume in order,
    e.g. input | reconstruction. Model families opt in by returning `{"volumes": {...}}`
    from `validation_step`.

    Args:
        every_n_epochs: log every this many validation epochs.
        max_samples: rows (samples) per grid.
    """

    def __init__(self, every_n_epochs: int = 1, max_samples: int = 2) -> None:
        self.every_n_epochs = every_n_epochs
        self.max_samples = max_samples

    @rank_zero_only
    def on_validation_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int, dataloader_idx: int = 0
    ) -> None:
        if batch_idx != 0 or trainer.sanity_checking or not isinstance(outputs, dict) or "volumes" not in outputs:
            return
        if trainer.current_epoch % self.every_n_epochs:
            return
        names = "|".join(outputs["volumes"])
        grid = slice_grid(outputs["volumes"], self.max_samples)
        tag = f"val/slices ({names}; axial, coronal, sagittal)"
        for logger in trainer.loggers:
            experiment = getattr(logger, "experiment", None)
            if hasattr(experiment, "add_image"):
                experiment.add_image(tag, grid, global_step=trainer.global_step)
            elif hasattr(logger, "log_image"):
                logger.log_image(key="val/slices", images=[grid[0].numpy()], step=trainer.global_step)
