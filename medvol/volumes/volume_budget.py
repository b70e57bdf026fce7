"""How large a volume medvol will read: what a header promises is checked against the machine's memory before a
voxel is read or allocated.

A NIfTI header or a DICOM series' Rows x Columns x slices says how many voxels reading the file will produce;
a crafted or corrupt header (10^12 voxels, a gzip stream that inflates without end behind a modest file) would
otherwise fill the memory and take the machine down with the run. One volume may take a quarter of the
machine's memory as float32: the pipeline holds it as read, as float, resampled and as the network's
input at once. `MEDVOL_VOLUME_BUDGET_GIB` sets another budget (a large-memory node, a shared one).

A NIfTI file is counted at the bytes its reader holds: the voxels as stored (16 bytes each for float128, 8 for
float64 or int64; nibabel's float64 where the header scales them) beside the float32 copy; complex and RGB
voxels, which no model of medvol reads, are refused. A volume resampled to another spacing is counted on the
grid it is resampled to (`check_resampled_size`: the header's shape and voxel size against the target spacing,
rounded as MONAI's `Spacing` rounds) at what the resampler holds per voxel of it, so a header promising few voxels
of a large size cannot ask for more.
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import nibabel as nib
import numpy as np
from monai.data.utils import compute_shape_offset, zoom_affine

from medvol.core.errors import MedvolError
from medvol.volumes.scan_checks import geometry_problem

BUDGET_ENV = "MEDVOL_VOLUME_BUDGET_GIB"
# Bytes per voxel as the pipeline holds a volume (float32).
WORKING_BYTES = 4
# What MONAI's `Spacing` holds per voxel of the grid it resamples to (benchmarks/data/resample_memory.py,
# docs/benchmarks/data.md: 58 bytes linearly whatever the channels, its sampling coordinates; 57 plus 17 per channel
# with cubic splines).
RESAMPLE_GRID_BYTES = 64
RESAMPLE_CHANNEL_BYTES = 16
MEMORY_SHARE = 4
GIB = 1024**3


class VolumeTooLarge(MedvolError):
    """A volume, or what it becomes, larger than the memory budget (the data doctor lists it as such)."""


def machine_memory_bytes() -> int:
    """The physical memory of this machine (16 GiB where the system does not say)."""
    try:
        return int(os.sysconf("SC_PAGE_SIZE")) * int(os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):
        return 16 * GIB


def volume_budget_bytes() -> int:
    """The most bytes one volume may take as float32: `MEDVOL_VOLUME_BUDGET_GIB`, else a quarter of the memory."""
    given = os.environ.get(BUDGET_ENV)
    if given:
        try:
            value = float(given)
        except ValueError:
            value = -1.0
        if not value > 0:
            raise MedvolError(f"`{BUDGET_ENV}` is {given!r}; expected a positive number of GiB")
        return int(value * GIB)
    return machine_memory_bytes() // MEMORY_SHARE


def check_volume_size(
    source: str | Path, shape: Sequence[int], what: str = "its header promises", stored: np.dtype | None = None,
    before: str = "reading it",
) -> None:
    """Refuse `source` in one line when a volume of `shape` would not fit the budget as float32, beside its voxels as
    read in `stored` (the dtype its reader holds them in before the float32 copy; None: read straight to float32);
    the line ends `refused before <before>`."""
    read = 0 if stored is None else np.dtype(stored).itemsize
    held = "as float32" if stored is None else f"as {np.dtype(stored).name} read and as float32"
    _check_bytes(source, f"{what} {_shape_text(shape)}", math.prod(int(s) for s in shape), read + WORKING_BYTES,
                 held, before)


def _shape_text(shape: Sequence[int]) -> str:
    return "x".join(str(int(s)) for s in shape)


def _check_bytes(source: str | Path, what: str, voxels: int, per_voxel: int, held: str, before: str) -> None:
    budget = volume_budget_bytes()
    if voxels * per_voxel > budget:
        raise VolumeTooLarge(
            f"{source}: {what} = {voxels:.3g} voxels ({voxels * per_voxel / GIB:.3g} GiB {held}), more than one volume "
            f"may take here ({budget / GIB:.3g} GiB, a quarter of this machine's memory; {BUDGET_ENV} sets another); "
            f"refused before {before}"
        )


def read_dtype(path: str | Path, image: Any) -> np.dtype:
    """The dtype nibabel hands a NIfTI file's voxels over in: the stored one, or float64 where the header scales
    them (`scl_slope`/`scl_inter`, nibabel's `get_fdata` too); refuses complex and RGB voxels in one line."""
    stored = np.dtype(image.get_data_dtype())
    if stored.kind not in "biuf":
        kind = "complex" if stored.kind == "c" else "RGB" if stored.fields else stored.kind
        raise MedvolError(
            f"{path}: its voxels are {stored.name if not stored.fields else 'RGB'} ({kind}); medvol reads volumes of "
            "real numbers: convert it first (e.g. to the magnitude of complex data, or to grey values)"
        )
    proxy = image.dataobj
    scaled = getattr(proxy, "slope", 1.0) != 1.0 or getattr(proxy, "inter", 0.0) != 0.0
    return np.dtype(np.float64) if scaled and stored.itemsize < 8 else stored


def resampled_shape(
    shape: Sequence[int], affine: np.ndarray, spacing: Sequence[float], orientation: str | None = None
) -> tuple[int, ...]:
    """The grid a volume of `shape` (its first three axes) and voxel-to-world `affine` takes once reoriented to
    `orientation` (axis codes, None: as stored) and resampled to `spacing` mm, as MONAI's `Orientation` and
    `Spacing` make it (`zoom_affine`, then `compute_shape_offset`'s rounding of the corners' extent)."""
    shape = [int(s) for s in shape[:3]]
    affine = np.asarray(affine, dtype=np.float64)
    if orientation:
        turn = nib.orientations.ornt_transform(
            nib.orientations.io_orientation(affine), nib.orientations.axcodes2ornt(tuple(orientation))
        )
        affine = affine @ nib.orientations.inv_ornt_aff(turn, shape)
        turned = list(shape)
        for axis, (to, _) in enumerate(turn):
            turned[int(to)] = shape[axis]
        shape = turned
    target = zoom_affine(affine, np.asarray(spacing, dtype=np.float64), diagonal=False)
    return tuple(int(s) for s in compute_shape_offset(shape, affine, target, scale_extent=False)[0])


def check_resampled_size(
    source: str | Path, shape: Sequence[int], affine: np.ndarray, spacing: Sequence[float], orientation: str | None
) -> None:
    """Refuse `source` in one line when resampling it to `spacing` mm (after `orientation`) would take more than the
    budget: each voxel of the grid it makes (the shape of its first three axes) at what `Spacing` holds for it
    (`RESAMPLE_GRID_BYTES`, and `RESAMPLE_CHANNEL_BYTES` for each channel of the axes past the third)."""
    spacing = [float(s) for s in spacing]
    zooms = np.sqrt((np.asarray(affine, dtype=np.float64)[:3, :3] ** 2).sum(axis=0))
    if not np.all(zooms > 0):
        raise MedvolError(f"{source}: its header gives voxels of {_sizes(zooms)} mm; expected sizes above 0")
    try:
        grid = resampled_shape(shape, affine, spacing, orientation)
    except ValueError as err:
        raise MedvolError(f"{source}: its affine cannot be inverted ({err}); the header is damaged") from None
    channels = math.prod(int(s) for s in shape[3:])
    what = (
        f"resampled from {_sizes(zooms)} mm voxels to {_sizes(spacing)} mm it becomes {_shape_text(grid)}"
        + (f" x {channels} channels" if channels > 1 else "")
    )
    _check_bytes(source, what, math.prod(grid), RESAMPLE_GRID_BYTES + RESAMPLE_CHANNEL_BYTES * channels,
                 "while resampled", "resampling it")


def _sizes(values: Sequence[float]) -> str:
    return "x".join(f"{float(v):.4g}" for v in values)


def check_file_size(path: str | Path) -> None:
    """Refuse a file that alone is larger than one volume may be (read whole, e.g. a DICOM file's pixel data)."""
    size, budget = Path(path).stat().st_size, volume_budget_bytes()
    if size > budget:
        raise MedvolError(
            f"{path}: the file is {size / GIB:.3g} GiB, more than one volume may take here ({budget / GIB:.3g} GiB, "
            f"a quarter of this machine's memory; {BUDGET_ENV} sets another); refused before reading it"
        )


def load_nifti(path: str | Path) -> Any:
    """`nib.load(path)` (the header; voxels stay on disk until asked for), refused unless its voxels, as read and as
    float32, fit the budget, and its geometry is finite."""
    image = nib.load(str(path))
    check_volume_size(path, image.shape, stored=read_dtype(path, image))
    problem = geometry_problem(image)
    if problem:
        raise MedvolError(f"{path}: {problem}")
    return image
