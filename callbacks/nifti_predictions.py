"""Writes test-time output volumes as NIfTI files on the source grid (the batch's affine)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytorch_lightning as pl
import torch

from medvol.intensity import scale_from_range
from medvol.nifti_io import save_volume


class NiftiPredictionWriter(pl.Callback):
    """Saves the `volumes` a model returns from `test_step` as `<output_dir>/<subject>_<name>.nii.gz`.

    Each sample is written with its own `affine` from the batch, so the file overlays the
    source scan in any viewer. Patch batches (with `patch_origin`) add the patch corner to the
    name. Under DDP every rank writes the subjects of its own test partition. A model that
    returns `"window": (low, high)` with its volumes has float volumes written in those raw units
    (e.g. HU for CT: the inverse of the dataset's window scaling); label maps stay integer.

    Args:
        output_dir: folder for the files (the run's `predictions/`).
        skip: names of `volumes` entries not to write (the input is already on disk).
    """

    def __init__(self, output_dir: str, skip: tuple[str, ...] | list[str] = ("input",)) -> None:
        self.output_dir = Path(output_dir)
        self.skip = set(skip)

    def on_test_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int, dataloader_idx: int = 0
    ) -> None:
        if not isinstance(outputs, dict) or "volumes" not in outputs or not isinstance(batch, dict):
            return
        affines, subjects = batch.get("affine"), batch.get("subject")
        if affines is None or subjects is None:
            return
        origins = batch.get("patch_origin")
        window = outputs.get("window")
        for name, volumes in outputs["volumes"].items():
            if name in self.skip:
                continue
            for i, subject in enumerate(subjects):
                stem = str(subject).replace("/", "_")
                if origins is not None:
                    stem += "_patch" + "-".join(str(int(v)) for v in origins[i])
                volume = volumes[i]
                if torch.is_floating_point(volume):
                    volume = volume.float() if window is None else scale_from_range(volume.float(), *window, (-1.0, 1.0))
                save_volume(volume, self.output_dir / f"{stem}_{name}.nii.gz", affines[i])
