"""BraTS-2021 case folders on real anatomy: the MNI152 brain with lesions of our own design, per-subject variation.

    write_brain_lesions(root, subjects=24, spacing=(4, 4, 4))

The brain is the MNI152 2009 template that ships inside nilearn's wheel (grey matter, white matter
and the brain mask, 2 mm; `nilearn.datasets.load_mni152_*` reads packaged files, nothing is
downloaded). Per subject: a smooth random deformation and a random scaling of the anatomy; one lesion
of one of three shapes (ellipsoid, lobulated: a union of balls, irregular: a thresholded smooth noise
field) and a size drawn from small to large, nested as BraTS nests it (oedema 2 around a tumour core
of necrosis 1 and an enhancing rim 4); four MR contrasts (t1, t1ce, t2, flair) from tissue values
with a per-subject gain, bias field and noise. The volumes are written at `spacing` (resampled by
block averaging / nearest label), so one dataset may be anisotropic. nilearn is a `dev` dependency.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import nibabel as nib
import numpy as np
from scipy import ndimage

from medvol.core.errors import MedvolError

TEMPLATE_SPACING = 2.0
SHAPES = ("ellipsoid", "lobulated", "irregular")
# Mean intensity per tissue and contrast (csf, grey matter, white matter, oedema, necrosis, enhancing).
TISSUES = ("csf", "gm", "wm", "oedema", "necrosis", "enhancing")
CONTRASTS = {
    "t1": (0.25, 0.60, 0.85, 0.50, 0.30, 0.55),
    "t1ce": (0.25, 0.60, 0.85, 0.52, 0.28, 1.25),
    "t2": (1.00, 0.65, 0.45, 0.90, 0.95, 0.70),
    "flair": (0.15, 0.60, 0.50, 1.00, 0.55, 0.80),
}


def template() -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Grey matter, white matter and CSF probabilities inside the MNI152 brain mask, 2 mm."""
    try:
        from nilearn import datasets
    except ImportError as err:
        raise MedvolError("the real-anatomy data needs nilearn (`pip install nilearn`, in medvol's dev extra)") from err
    gm = np.asarray(datasets.load_mni152_gm_template(resolution=2).dataobj, dtype=np.float32)
    wm = np.asarray(datasets.load_mni152_wm_template(resolution=2).dataobj, dtype=np.float32)
    mask = np.asarray(datasets.load_mni152_brain_mask(resolution=2).dataobj) > 0
    csf = np.clip(mask - gm - wm, 0.0, 1.0) * mask
    return gm * mask, wm * mask, csf


def deformation(shape: Sequence[int], rng: np.random.Generator, amplitude: float = 3.0) -> list[np.ndarray]:
    """Sample coordinates of a smooth random displacement (voxels) and a random scaling about the centre."""
    grid = np.meshgrid(*[np.arange(n, dtype=np.float32) for n in shape], indexing="ij")
    scale = rng.uniform(0.92, 1.08, 3)
    centre = np.asarray(shape) / 2.0
    coordinates = []
    for axis in range(3):
        field = ndimage.gaussian_filter(rng.standard_normal(shape).astype(np.float32), 8.0)
        field *= amplitude / (np.abs(field).max() + 1e-6)
        coordinates.append((grid[axis] - centre[axis]) / scale[axis] + centre[axis] + field)
    return coordinates


def lesion(shape: Sequence[int], brain: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """A BraTS label map (0, 1 necrosis, 2 oedema, 4 enhancing) of one lesion inside `brain`."""
    kind = SHAPES[int(rng.integers(len(SHAPES)))]
    inside = np.argwhere(ndimage.binary_erosion(brain, iterations=6))
    centre = inside[int(rng.integers(len(inside)))].astype(np.float32)
    # Whole-tumour radius in template voxels (2 mm): from small (6 mm) to large (30 mm).
    radius = float(rng.choice([3.0, 5.0, 8.0, 11.0, 15.0]) * rng.uniform(0.85, 1.15))
    grid = np.stack(np.meshgrid(*[np.arange(n, dtype=np.float32) for n in shape], indexing="ij"), -1)
    axes = rng.uniform(0.7, 1.3, 3)
    distance = np.sqrt((((grid - centre) / axes) ** 2).sum(-1)) / radius
    if kind == "lobulated":
        for _ in range(3):
            offset = centre + rng.normal(0.0, radius * 0.6, 3)
            distance = np.minimum(distance, np.sqrt(((grid - offset) ** 2).sum(-1)) / (radius * rng.uniform(0.4, 0.7)))
    elif kind == "irregular":
        noise = ndimage.gaussian_filter(rng.standard_normal(shape).astype(np.float32), 2.0)
        distance = distance + 0.35 * noise / (np.abs(noise).max() + 1e-6)
    core = rng.uniform(0.35, 0.6)
    rim = core * rng.uniform(0.55, 0.8)
    label = np.zeros(shape, np.uint8)
    label[(distance < 1.0) & brain] = 2
    label[(distance < core) & brain] = 4
    label[(distance < rim) & brain] = 1
    return label


def contrast(name: str, tissues: Sequence[np.ndarray], rng: np.random.Generator) -> np.ndarray:
    """One MR contrast: tissue means weighted by the tissue maps, times a gain and a bias field, plus noise."""
    values = CONTRASTS[name]
    image = sum(v * t for v, t in zip(values, tissues, strict=True))
    bias = 1.0 + 0.15 * ndimage.gaussian_filter(rng.standard_normal(image.shape).astype(np.float32), 12.0) * 20
    noisy = image * rng.uniform(0.7, 1.4) * np.clip(bias, 0.7, 1.3) + rng.normal(
        0.0, rng.uniform(0.02, 0.05), image.shape
    )
    return np.where(sum(tissues) > 0.05, np.clip(noisy, 0.0, None), 0.0).astype(np.float32) * 1000.0


def resample(volume: np.ndarray, spacing: Sequence[float], label: bool) -> np.ndarray:
    """From the template's 2 mm to `spacing`: linear for intensities, nearest for labels."""
    zoom = [TEMPLATE_SPACING / float(s) for s in spacing]
    return ndimage.zoom(volume, zoom, order=0 if label else 1, grid_mode=True, mode="grid-constant")


def subject_volumes(gm: np.ndarray, wm: np.ndarray, csf: np.ndarray, rng: np.random.Generator) -> dict[str, np.ndarray]:
    """One deformed brain with a lesion: the four contrasts and the label map, at 2 mm."""
    coordinates = deformation(gm.shape, rng)
    warped = [ndimage.map_coordinates(t, coordinates, order=1) for t in (csf, gm, wm)]
    brain = sum(warped) > 0.3
    label = lesion(gm.shape, brain, rng)
    # Inside the lesion the tumour tissues replace the normal ones (partial volume kept at the border).
    lesion_tissues = [(label == 2).astype(np.float32), (label == 1).astype(np.float32), (label == 4).astype(np.float32)]
    lesion_tissues = [ndimage.gaussian_filter(t, 0.7) for t in lesion_tissues]
    normal = 1.0 - np.clip(sum(lesion_tissues), 0.0, 1.0)
    tissues = [w * normal for w in warped] + [t * brain for t in lesion_tissues]
    volumes = {name: contrast(name, tissues, rng) for name in CONTRASTS}
    volumes["seg"] = label
    return volumes


def write_brain_lesions(root: Path, subjects: int, spacing: Sequence[float] = (4.0, 4.0, 4.0), seed: int = 0) -> Path:
    """`root/BraTS2021_NNNNN/BraTS2021_NNNNN_{t1,t1ce,t2,flair,seg}.nii.gz` at `spacing` mm (RAS)."""
    gm, wm, csf = template()
    affine = np.diag([*[float(s) for s in spacing], 1.0])
    for index in range(subjects):
        rng = np.random.default_rng([seed, index])
        case = f"BraTS2021_{index:05d}"
        for name, volume in subject_volumes(gm, wm, csf, rng).items():
            data = resample(volume, spacing, label=name == "seg")
            path = Path(root) / case / f"{case}_{name}.nii.gz"
            path.parent.mkdir(parents=True, exist_ok=True)
            nib.save(nib.Nifti1Image(data.astype(np.uint8 if name == "seg" else np.float32), affine), str(path))
    return Path(root)
