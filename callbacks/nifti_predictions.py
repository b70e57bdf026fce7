"""Writes test-time output volumes as NIfTI files on the source scan's grid, and per-subject metrics as a CSV."""

from __future__ import annotations

from typing import Any

import pytorch_lightning as pl
import torch

from medvol.volumes.prediction_writer import PredictionWriter


class NiftiPredictionWriter(pl.Callback):
    """At test time, saves the `volumes` a model returns from `test_step` with `medvol.volumes.prediction_writer`.

    Files go to `<output_dir>/<subject>_<name>.nii.gz` on the source scan's grid and in its units
    (the same code `predict.py` uses). A `subject_metrics` output (name -> (B,) tensor) becomes one
    row per subject of `<output_dir>/metrics.csv`, gathered from every rank. Under DDP every rank
    writes the volumes of its own test partition.

    Args:
        output_dir: folder for the files (the run's `predictions/`).
        skip: names of `volumes` entries not to write (the input and label are already on disk).
        output_format: nifti, dicom or both (DICOM-SEG and derived series for subjects read from DICOM series).
        segment_codes: DICOM-SEG segment name -> its SNOMED CT `category` and/or `type` (the root `segment_codes`).
        channels: batch key -> the dataset's channel names (a derived series' modality).
    """

    def __init__(
        self, output_dir: str, skip: tuple[str, ...] | list[str] = ("input", "label"), output_format: str = "nifti",
        segment_codes: dict[str, Any] | None = None, channels: dict[str, Any] | None = None,
    ) -> None:
        self.writer = PredictionWriter(
            output_dir, skip, output_format=output_format, segment_codes=segment_codes, channels=channels
        )

    def on_test_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.writer.rows = []

    def on_test_batch_end(
        self,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        outputs: Any,
        batch: Any,
        batch_idx: int,
        dataloader_idx: int = 0,
    ) -> None:
        if isinstance(outputs, dict) and isinstance(batch, dict):
            self.writer.write(outputs, batch)

    def on_test_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        rows = self.writer.rows
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            gathered: list[list[dict[str, Any]] | None] = [None] * torch.distributed.get_world_size()
            torch.distributed.all_gather_object(gathered, rows)
            rows = [row for part in gathered for row in part or []]
        if trainer.is_global_zero:
            self.writer.write_metrics(rows)
