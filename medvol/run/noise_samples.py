"""predict.py with no input: N volumes generated from noise alone (an unconditional latent diffusion model).

Each draw k is written as `<output_dir>/sample_<k>.nii.gz` by the code that writes every prediction
(`PredictionWriter`), on a RAS grid of the spacing asked (default the training spacing, from the
checkpoint's record; the training scans' median spacing for a model trained on each scan's own grid) and in
the training data's units (HU for CT, from the record's intensity scaling).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from lightning_modules.base import MedvolModule
from medvol.core.console import log_file
from medvol.core.errors import MedvolError
from medvol.run.generation import intensity_record, with_target_units
from medvol.run.predict_batch import LOG_FILE, peak_memory
from medvol.run.predict_config import input_geometry
from medvol.volumes.prediction_writer import PredictionWriter

if TYPE_CHECKING:
    from medvol.run.predict_check import PredictRequest

log = logging.getLogger("medvol")

SUBJECT = "sample"


def ras_affine(spacing: Sequence[float], shape: Sequence[int]) -> torch.Tensor:
    """A RAS affine of `spacing` mm voxels centred on the origin (as the synthetic phantoms')."""
    affine = np.diag([*[float(s) for s in spacing], 1.0])
    affine[:3, 3] = -np.asarray(spacing, float) * (np.asarray(shape) - 1) / 2
    return torch.from_numpy(affine)


def noise_batch(spacing: Sequence[float], shape: Sequence[int], intensity: Mapping[str, Any] | None) -> dict[str, Any]:
    """The batch a model generates from noise: a subject name, its grid, and the training data's units."""
    return with_target_units({"subject": [SUBJECT], "affine": ras_affine(spacing, shape)[None]}, intensity)


def noise_geometry(spacing: Any, record: Mapping[str, Any] | None) -> dict[str, Any]:
    """The grid of samples from noise: `spacing=[...]` when asked, else the spacing the checkpoint records: the
    training spacing, or, for a model trained on each scan's own grid (`resampled` false, e.g. experiment=ctpa_ldm),
    the training scans' median (noise has no grid of its own to keep)."""
    geometry = input_geometry(spacing, record)
    if spacing is None and not geometry.get("spacing") and (record or {}).get("spacing"):
        geometry = {**geometry, "spacing": [float(s) for s in record["spacing"]]}  # type: ignore[index]
    return geometry


def write_noise_samples(module: MedvolModule, geometry: Mapping[str, Any], num_samples: int, output_dir: Path) -> int:
    """Write `num_samples` volumes generated from noise as `sample_<k>.nii.gz`; the number written."""
    spacing = geometry.get("spacing")
    if not spacing:
        raise MedvolError(
            "`spacing`: samples from noise need a voxel size, and the checkpoint records none; "
            "give `spacing=[x,y,z]` in mm"
        )
    writer = PredictionWriter(output_dir)
    for draw in range(num_samples):
        batch: dict[str, Any] = {"subject": [SUBJECT], "affine": ras_affine(spacing, (1, 1, 1))[None]}
        with torch.no_grad():
            volume = module.generate_volumes(batch, draw)["volumes"]["sample"]
        batch = noise_batch(spacing, volume.shape[2:], intensity_record(module))
        writer.write({"volumes": {str(draw): volume}}, batch)
    return num_samples


def noise_samples(request: PredictRequest, module: MedvolModule) -> dict[str, float]:
    """The request's `num_samples` volumes from noise alone, for an unconditional generator given no input, logged
    beside them."""
    with log_file(request.output_dir / LOG_FILE):
        geometry = noise_geometry(request.spacing, module.training_data)
        count = write_noise_samples(module, geometry, request.num_samples, request.output_dir)
        log.info("generated %d sample%s -> %s", count, "s" if count != 1 else "", request.output_dir)
        log.info(peak_memory(request.device))
    return {}
