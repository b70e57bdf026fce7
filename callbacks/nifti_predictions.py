"""Writes test-time output volumes as NIfTI files on the source scan's grid, and per-subject metrics as a CSV."""

from __future__ import annotations

import csv
from pathlib import Path
from typing import Any

import pytorch_lightning as pl
import torch

from medvol.intensity import scale_from_range
from medvol.nifti_io import save_volume
from medvol.source_grid import to_source_grid

SOURCE_KEYS = ("source_affine", "source_shape")


class NiftiPredictionWriter(pl.Callback):
    """Saves the `volumes` a model returns from `test_step` as `<output_dir>/<subject>_<name>.nii.gz`.

    Batches from files carry the grid of the source scan (`source_affine`, `source_shape`,
    `source_file`): each volume is mapped back onto it (`medvol.source_grid`: orientation,
    resampling and crop/pad undone; nearest for integer label maps, linear otherwise) and written
    with the source header, so it has the scan's own shape and affine. Without those keys
    (synthetic data, already on its own grid) a volume is written with the batch's `affine`.
    Integer volumes are label maps: with a batch `label_values` ((B, K): the file's value of each
    model label, e.g. BraTS 2021's 0, 1, 2, 4) they are written with the values the input used.
    Patch batches (with `patch_origin`) stay on the patch grid and add the patch corner to the name.

    A model that returns `"window": (low, high)` with its volumes has its float volumes written in
    those raw units (e.g. HU for CT: the inverse of the dataset's window scaling).

    A `subject_metrics` output (name -> (B,) tensor) becomes one row per subject of
    `<output_dir>/metrics.csv`, gathered from every rank. Under DDP every rank writes the volumes
    of its own test partition.

    Args:
        output_dir: folder for the files (the run's `predictions/`).
        skip: names of `volumes` entries not to write (the input and label are already on disk).
    """

    def __init__(self, output_dir: str, skip: tuple[str, ...] | list[str] = ("input", "label")) -> None:
        self.output_dir = Path(output_dir)
        self.skip = set(skip)
        self.rows: list[dict[str, Any]] = []

    def on_test_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.rows = []

    def on_test_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int, dataloader_idx: int = 0
    ) -> None:
        if not isinstance(outputs, dict) or not isinstance(batch, dict):
            return
        subjects = batch.get("subject")
        if subjects is None:
            return
        metrics = outputs.get("subject_metrics") or {}
        if metrics:
            self.rows.extend(
                {"subject": str(subject), **{name: float(values[i]) for name, values in metrics.items()}}
                for i, subject in enumerate(subjects)
            )
        if "volumes" in outputs and batch.get("affine") is not None:
            self._write_volumes(outputs["volumes"], batch, subjects, outputs.get("window"))

    def _write_volumes(
        self, volumes: dict[str, torch.Tensor], batch: dict[str, Any], subjects: list[str],
        window: tuple[float, float] | None = None,
    ) -> None:
        affines, origins = batch["affine"], batch.get("patch_origin")
        on_source = origins is None and all(batch.get(k) is not None for k in SOURCE_KEYS)
        sources = batch.get("source_file")
        label_values = batch.get("label_values")
        for name, batch_volumes in volumes.items():
            if name in self.skip:
                continue
            for i, subject in enumerate(subjects):
                stem = str(subject).replace("/", "_")
                if origins is not None:
                    stem += "_patch" + "-".join(str(int(v)) for v in origins[i])
                volume = batch_volumes[i].detach().cpu()
                is_label = not torch.is_floating_point(volume)
                if not is_label:
                    volume = volume.float() if window is None else scale_from_range(volume.float(), *window, (-1.0, 1.0))
                if is_label and label_values is not None:
                    lookup = label_values[i].cpu()
                    volume = lookup[volume.long().clamp(0, len(lookup) - 1)]
                affine, header = affines[i], None
                if on_source:
                    grid = (batch["source_affine"][i], batch["source_shape"][i])
                    # Cropped-away voxels: background for labels, the darkest output value for intensities.
                    fill = 0.0 if is_label else float(volume.min())
                    volume = to_source_grid(volume, grid, affines[i], "nearest" if is_label else "linear", fill)
                    affine = batch["source_affine"][i]
                    source_file = sources[i] if sources is not None else ""
                    header = source_file if source_file and Path(source_file).is_file() else None
                save_volume(volume, self.output_dir / f"{stem}_{name}.nii.gz", affine, header=header)

    def on_test_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        rows = self.rows
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            gathered: list[list[dict[str, Any]] | None] = [None] * torch.distributed.get_world_size()
            torch.distributed.all_gather_object(gathered, rows)
            rows = [row for part in gathered for row in part or []]
        if not rows or not trainer.is_global_zero:
            return
        rows = sorted(rows, key=lambda row: row["subject"])
        columns = list(dict.fromkeys(key for row in rows for key in row))
        self.output_dir.mkdir(parents=True, exist_ok=True)
        with (self.output_dir / "metrics.csv").open("w", newline="") as handle:
            writer = csv.DictWriter(handle, fieldnames=columns)
            writer.writeheader()
            writer.writerows(rows)
