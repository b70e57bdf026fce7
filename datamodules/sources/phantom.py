"""Procedural 3D head phantoms that look like MR and CT volumes, deterministic in (seed, index).

A phantom is an ellipsoidal head: scalp/skull shell, cortex (grey matter) with a folded
inner border, white matter, two lateral ventricles, and 0-4 lesions, each a necrotic/enhancing
core inside an oedema halo. Tissue maps are soft (partial volume at borders). MR channels
(T1, T1ce, T2, FLAIR) take per-tissue intensities, a smooth multiplicative bias field and
Rician noise; the CT channel takes Hounsfield units with Gaussian noise. Survival time and
event follow an exponential hazard that grows with lesion burden, with uniform censoring.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import cache

import numpy as np

MODALITIES = ("t1", "t1ce", "t2", "flair", "ct")
TISSUES = ("air", "skull", "grey", "white", "csf", "oedema", "core")

# Relative MR intensities and CT Hounsfield units per tissue, in the order of TISSUES.
INTENSITY = {
    "t1": (0.0, 0.85, 0.55, 0.75, 0.15, 0.45, 0.35),
    "t1ce": (0.0, 0.85, 0.56, 0.76, 0.15, 0.47, 0.95),
    "t2": (0.0, 0.45, 0.65, 0.45, 1.00, 0.85, 0.70),
    "flair": (0.0, 0.40, 0.60, 0.45, 0.08, 0.95, 0.75),
    "ct": (-1000.0, 900.0, 38.0, 28.0, 8.0, 20.0, 45.0),
}
LABELS = {"background": 0, "core": 1, "oedema": 2}
# A phantom's class: its lesion load above the generator's median, measured on one fixed grid so a
# subject keeps its class at every volume size. The median lesion fraction of series 0 on the 16^3
# grid is 0.0675 over 2000 phantoms (0.069 on 32^3; 21% have no lesion): about half the subjects
# fall on each side (`benchmarks/data/phantom_classes.py`).
CLASS_GRID = 16
LESION_CLASS_THRESHOLD = 0.0675


@dataclass
class Phantom:
    channels: dict[str, np.ndarray]  # modality -> (D, H, W) float32, MR in [0, ~1], CT in HU
    label: np.ndarray  # (D, H, W) uint8: 0 background, 1 lesion core, 2 oedema
    lesion_fraction: float  # lesion voxels / brain voxels
    time: float  # months to event or censoring
    event: int  # 1 if the event was observed


def phantom_affine(shape: Sequence[int], spacing: float) -> np.ndarray:
    """RAS affine with `spacing` mm voxels, centred on the origin."""
    affine = np.diag([spacing, spacing, spacing, 1.0])
    affine[:3, 3] = -spacing * (np.asarray(shape) - 1) / 2
    return affine


def _sigmoid(x: np.ndarray) -> np.ndarray:
    return 1.0 / (1.0 + np.exp(-np.clip(x, -30, 30)))


def _smooth_field(rng: np.random.Generator, grid: tuple[np.ndarray, ...], order: int = 2) -> np.ndarray:
    """A smooth random field: a random polynomial of the coordinates up to `order`."""
    z, y, x = grid
    field = np.zeros(np.broadcast_shapes(z.shape, y.shape, x.shape), dtype=np.float32)
    for i in range(order + 1):
        for j in range(order + 1 - i):
            for k in range(order + 1 - i - j):
                if i + j + k:
                    field += rng.normal(0, 1) / (i + j + k) * (z**i) * (y**j) * (x**k)
    return field


def make_phantom(seed: int, index: int, size: int | tuple[int, int, int] = 32) -> Phantom:
    """Generate phantom `index` of the series `seed`; the same arguments give the same volume."""
    shape = (size,) * 3 if isinstance(size, int) else tuple(size)
    rng = np.random.default_rng([int(seed), int(index)])
    axes = [np.linspace(-1, 1, n, dtype=np.float32) for n in shape]
    z, y, x = np.meshgrid(*axes, indexing="ij", sparse=True)
    edge = 2.0 / min(shape)  # one voxel in normalised units: the width of a soft border

    center = rng.uniform(-0.04, 0.04, 3)
    semi = np.array([rng.uniform(0.78, 0.9), rng.uniform(0.8, 0.92), rng.uniform(0.68, 0.8)])
    angle = rng.uniform(-0.2, 0.2)
    ya, xa = y - center[1], x - center[2]
    yr = np.cos(angle) * ya - np.sin(angle) * xa
    xr = np.sin(angle) * ya + np.cos(angle) * xa
    zr = z - center[0]
    radius = np.sqrt((zr / semi[0]) ** 2 + (yr / semi[1]) ** 2 + (xr / semi[2]) ** 2)

    theta = np.arctan2(yr, xr)
    phi = np.arctan2(zr, np.sqrt(xr**2 + yr**2) + 1e-6)
    folds = rng.integers(5, 9)
    gyri = 0.035 * np.sin(folds * theta + rng.uniform(0, 6.3)) * np.cos((folds - 2) * phi + rng.uniform(0, 6.3))

    head = _sigmoid((1.0 - radius) / edge)
    brain = _sigmoid((0.88 - radius) / edge)
    white = _sigmoid((0.68 + gyri - radius) / edge)
    ventricles = np.zeros_like(radius)
    gap = rng.uniform(0.08, 0.14)
    for side in (-1, 1):
        vr = np.sqrt(((zr - 0.05) / 0.22) ** 2 + ((yr - 0.05) / 0.3) ** 2 + ((xr - side * gap) / 0.07) ** 2)
        ventricles = np.maximum(ventricles, _sigmoid((1.0 - vr) / (edge * 6)))

    core = np.zeros_like(radius)
    oedema = np.zeros_like(radius)
    for _ in range(rng.integers(0, 5)):
        direction = rng.normal(size=3)
        direction /= np.linalg.norm(direction)
        c = direction * rng.uniform(0.15, 0.55) * semi
        r = rng.uniform(0.06, 0.16)
        lobes = sum(
            np.exp(-(((zr - c[0] - d[0]) ** 2 + (yr - c[1] - d[1]) ** 2 + (xr - c[2] - d[2]) ** 2) / (2 * r**2)))
            for d in rng.normal(0, r * 0.5, (3, 3))
        )
        core = np.maximum(core, _sigmoid((lobes - 1.2) / 0.08))
        oedema = np.maximum(oedema, _sigmoid((lobes - 0.35) / 0.08))
    core *= brain
    oedema = np.clip(oedema * brain - core, 0, 1)

    # Soft tissue memberships that sum to one at every voxel.
    ventricles = ventricles * brain * (1 - core - oedema).clip(0, 1)
    lesion_free = (1 - core - oedema - ventricles).clip(0, 1)
    memberships = [
        1 - head,
        head - brain,
        (brain - white).clip(0, 1) * lesion_free,
        white * brain * lesion_free,
        ventricles,
        oedema,
        core,
    ]
    texture = 0.03 * _smooth_field(rng, (z * 3, y * 3, x * 3), order=3)
    bias = np.exp(0.15 * _smooth_field(rng, (z, y, x), order=2))

    channels: dict[str, np.ndarray] = {}
    for modality in MODALITIES:
        values = INTENSITY[modality]
        image = sum(m * v for m, v in zip(memberships, values, strict=True))
        if modality == "ct":
            image = image + 15.0 * texture / 0.03 * head + rng.normal(0, 12.0, shape)
            channels[modality] = np.asarray(image, dtype=np.float32)
            continue
        image = (image * (1 + texture)) * bias
        sigma = 0.025
        image = np.sqrt((image + rng.normal(0, sigma, shape)) ** 2 + rng.normal(0, sigma, shape) ** 2)
        channels[modality] = np.asarray(image, dtype=np.float32)

    label = np.zeros(shape, dtype=np.uint8)
    label[oedema > 0.5] = LABELS["oedema"]
    label[core > 0.5] = LABELS["core"]
    brain_voxels = max(float((brain > 0.5).sum()), 1.0)
    lesion_fraction = float((label > 0).sum()) / brain_voxels

    # Exponential survival, hazard rising with lesion burden; months, uniform censoring.
    hazard = (1.0 / 48.0) * np.exp(2.0 * min(lesion_fraction / 0.1, 2.0))
    event_time = rng.exponential(1.0 / hazard)
    censor_time = rng.uniform(6.0, 60.0)
    event = int(event_time <= censor_time)
    return Phantom(channels, label, lesion_fraction, float(min(event_time, censor_time)), event)


@cache
def lesion_class(seed: int, index: int) -> int:
    """1 if phantom `index` of series `seed` carries more lesion than the generator's median, else 0."""
    return int(make_phantom(seed, index, CLASS_GRID).lesion_fraction > LESION_CLASS_THRESHOLD)
