"""The three orthogonal mid-planes of a volume, named by anatomy (from its affine) and oriented as radiologists read
them.

Radiological convention: axial and coronal planes show the patient's right on the image's
left (viewed from the feet / from the front), anterior (axial) or superior (coronal,
sagittal) at the top; sagittal planes show anterior on the left (viewed from the patient's left).
"""

from __future__ import annotations

from dataclasses import dataclass

import nibabel as nib
import numpy as np
import torch

# plane -> (world direction the plane is perpendicular to, letter shown at the top, letter shown at the left)
RADIOLOGICAL = {"axial": ("S", "A", "R"), "coronal": ("A", "S", "R"), "sagittal": ("R", "S", "A")}
_OPPOSITE = {"R": "L", "L": "R", "A": "P", "P": "A", "S": "I", "I": "S"}
_WORLD_AXIS = {"R": 0, "L": 0, "A": 1, "P": 1, "S": 2, "I": 2}


@dataclass(frozen=True)
class Plane:
    """One displayed plane: `image[0, 0]` is the top-left pixel as a radiologist would see it."""

    name: str
    image: torch.Tensor
    spacing: tuple[float, float]
    top: str
    left: str

    @property
    def bottom(self) -> str:
        return _OPPOSITE[self.top]

    @property
    def right(self) -> str:
        return _OPPOSITE[self.left]


def orientation(affine: torch.Tensor | np.ndarray | None) -> tuple[str, str, str]:
    """Direction letters of the array axes (nibabel's `aff2axcodes`, e.g. ('R', 'A', 'S')); RAS without an affine."""
    if affine is None:
        return ("R", "A", "S")
    matrix = affine.detach().cpu().double().numpy() if isinstance(affine, torch.Tensor) else np.asarray(affine, float)
    codes = nib.orientations.aff2axcodes(matrix)
    if None in codes or len({_WORLD_AXIS[c] for c in codes}) != 3:
        return ("R", "A", "S")
    return tuple(codes)  # type: ignore[return-value]


def voxel_spacing(affine: torch.Tensor | np.ndarray | None) -> tuple[float, float, float]:
    """Voxel size along each array axis (mm); 1 mm without an affine."""
    if affine is None:
        return (1.0, 1.0, 1.0)
    matrix = affine.detach().cpu().double().numpy() if isinstance(affine, torch.Tensor) else np.asarray(affine, float)
    return tuple(float(s) or 1.0 for s in np.linalg.norm(matrix[:3, :3], axis=0))  # type: ignore[return-value]


def mid_planes(
    volume: torch.Tensor, affine: torch.Tensor | np.ndarray | None = None, centre: tuple[int, int, int] | None = None
) -> list[Plane]:
    """Axial, coronal and sagittal planes through the middle voxel of a (D, H, W) volume, or through `centre`.

    Args:
        volume: the volume in array order, as the affine maps it to the world.
        affine: 4x4 voxel-to-world matrix (the batch's `affine`); None means RAS, 1 mm.
        centre: the voxel (array indices) the three planes cross at; None: the middle.
    """
    codes = orientation(affine)
    spacing = voxel_spacing(affine)
    array_axis = {_WORLD_AXIS[c]: i for i, c in enumerate(codes)}
    planes = []
    for name, (normal, top, left) in RADIOLOGICAL.items():
        fixed, rows, cols = (array_axis[_WORLD_AXIS[letter]] for letter in (normal, top, left))
        # Even sizes have two middle slices: take the same world slice however the array is stored.
        middle = volume.shape[fixed] // 2
        index = middle if codes[fixed] in "RAS" else volume.shape[fixed] - 1 - middle
        image = volume.select(fixed, int(centre[fixed]) if centre is not None else index)
        remaining = [a for a in range(3) if a != fixed]
        if remaining.index(rows) == 1:
            image = image.T
        # Index grows towards codes[axis]; the display wants `top`/`left` at index 0.
        if codes[rows] == top:
            image = image.flip(0)
        if codes[cols] == left:
            image = image.flip(1)
        planes.append(Plane(name, image, (spacing[rows], spacing[cols]), top, left))
    return planes
