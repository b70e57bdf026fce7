"""A MACE-style table on real anatomy: the MNI152 brain with a bright white-matter lesion whose radius sets the hazard.

    write_mace_brains(root, subjects=96, spacing=(6, 6, 6), seed=0)

Per subject (`datamodules.sources.brain_lesions` gives the anatomy): a smooth random deformation and
scaling of the MNI152 brain, one ellipsoidal lesion centred in the white matter with a radius drawn
uniformly from `RADIUS_MM`, and one FLAIR-like contrast (the lesion brighter than every normal
tissue) with a per-subject gain, bias field and noise. The template is first resampled to `spacing`
and every subject is made on that grid (a few hundred subjects in minutes at 6 mm). The outcome follows a
proportional-hazards model in the radius alone: an exponential event time with rate
`BASE_RATE * exp(LOG_HAZARD_PER_SD * z)`, z the radius standardised over its uniform law, censored by
an independent uniform follow-up (about 30% censored). Age and sex are drawn independently of
everything else: covariates that carry no signal. The table holds the true radius too
(`lesion_radius_mm`), the feature of an oracle Cox model (the ceiling of what any risk can reach).
"""

from __future__ import annotations

import csv
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import nibabel as nib
import numpy as np
from scipy import ndimage

from datamodules.sources.brain_lesions import contrast, deformation, resample, template

RADIUS_MM = (4.0, 20.0)
BASE_RATE = 1 / 48.0
LOG_HAZARD_PER_SD = 1.2
FOLLOW_UP_MONTHS = (6.0, 120.0)
TABLE = "mace.csv"


def radius_score(radius_mm: float) -> float:
    """The radius standardised over its uniform law: the log-hazard is `LOG_HAZARD_PER_SD` times it."""
    low, high = RADIUS_MM
    return (radius_mm - (low + high) / 2) / ((high - low) / np.sqrt(12.0))


def white_matter_lesion(
    white_matter: np.ndarray, brain: np.ndarray, radius_mm: float, rng: np.random.Generator,
    spacing: Sequence[float],
) -> np.ndarray:
    """A soft (0..1) ellipsoid of `radius_mm` (mean semi-axis) centred in the white matter, on a grid of `spacing`
    mm: its voxels are the share of each voxel inside it (sampled on a 3^3 sub-grid)."""
    core = white_matter > 0.5
    deep = np.argwhere(ndimage.binary_erosion(core)) if ndimage.binary_erosion(core).any() else np.argwhere(core)
    centre = deep[int(rng.integers(len(deep)))] * np.asarray(spacing) + rng.uniform(-0.5, 0.5, 3) * np.asarray(spacing)
    axes = rng.uniform(0.8, 1.25, 3)
    axes = axes / np.cbrt(np.prod(axes)) * radius_mm
    share = np.zeros(white_matter.shape, np.float32)
    offsets = (np.arange(3) - 1) / 3.0
    for dx in offsets:
        for dy in offsets:
            for dz in offsets:
                points = [(np.arange(n) + d) * s - c for n, d, s, c in zip(white_matter.shape, (dx, dy, dz), spacing,
                                                                           centre, strict=True)]
                x, y, z = np.meshgrid(*[(p / a) ** 2 for p, a in zip(points, axes, strict=True)], indexing="ij",
                                      sparse=True)
                share += (x + y + z <= 1.0).astype(np.float32) / 27.0
    return share * brain


def subject(
    gm: np.ndarray, wm: np.ndarray, csf: np.ndarray, rng: np.random.Generator, spacing: Sequence[float]
) -> tuple[np.ndarray, dict[str, Any]]:
    """One deformed brain with its lesion (FLAIR-like, on the tissue maps' grid of `spacing` mm) and its table row
    (outcome, covariates, radius)."""
    # The template's deformation: 3 voxels of 2 mm, smooth over 16 mm.
    coordinates = deformation(gm.shape, rng, amplitude=6.0 / float(np.mean(spacing)))
    warped = [ndimage.map_coordinates(t, coordinates, order=1) for t in (csf, gm, wm)]
    brain = sum(warped) > 0.3
    radius = float(rng.uniform(*RADIUS_MM))
    lesion = white_matter_lesion(warped[2], brain, radius, rng, spacing)
    normal = 1.0 - lesion
    # FLAIR: oedema-like lesion (1.0) over csf 0.15, grey 0.60, white 0.50; no necrosis or enhancement.
    tissues = [w * normal for w in warped] + [lesion, np.zeros_like(lesion), np.zeros_like(lesion)]
    image = contrast("flair", tissues, rng)
    rate = BASE_RATE * np.exp(LOG_HAZARD_PER_SD * radius_score(radius))
    event_time = float(rng.exponential(1.0 / rate))
    follow_up = float(rng.uniform(*FOLLOW_UP_MONTHS))
    row = {
        "time": round(min(event_time, follow_up), 2), "event": int(event_time <= follow_up),
        "age": int(rng.integers(40, 86)), "sex": int(rng.integers(0, 2)), "lesion_radius_mm": round(radius, 3),
    }
    return image, row


def write_mace_brains(root: Path, subjects: int, spacing: Sequence[float] = (6.0, 6.0, 6.0), seed: int = 0) -> Path:
    """`root/images/brain_NNNN.nii.gz` at `spacing` mm (RAS) and `root/mace.csv` (subject, image, time, event, age,
    sex, lesion_radius_mm); returns the table's path."""
    spacing = [float(s) for s in spacing]
    gm, wm, csf = (np.clip(resample(t, spacing, label=False), 0.0, 1.0) for t in template())
    affine = np.diag([*spacing, 1.0])
    rows = []
    for index in range(subjects):
        rng = np.random.default_rng([seed, index])
        image, row = subject(gm, wm, csf, rng, spacing)
        name = f"brain_{index:04d}"
        path = Path(root) / "images" / f"{name}.nii.gz"
        path.parent.mkdir(parents=True, exist_ok=True)
        nib.save(nib.Nifti1Image(image.astype(np.float32), affine), str(path))
        rows.append({"subject": name, "image": f"images/{name}.nii.gz", **row})
    table = Path(root) / TABLE
    with table.open("w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    return table
