"""How large a volume medvol will read: what a header promises is checked against the machine's memory before a
voxel is read or allocated.

A NIfTI header or a DICOM series' Rows x Columns x slices says how many voxels reading the file will produce;
a crafted or corrupt header (10^12 voxels, a gzip stream that inflates without end behind a modest file) would
otherwise fill the memory and take the machine down with the run. One volume may take a quarter of the
machine's memory as float32: the pipeline holds it as read, as float, resampled and as the network's
input at once. `MEDVOL_VOLUME_BUDGET_GIB` sets another budget (a large-memory node, a shared one).
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import nibabel as nib

from medvol.core.errors import MedvolError

BUDGET_ENV = "MEDVOL_VOLUME_BUDGET_GIB"
# Bytes per voxel as the pipeline holds a volume (float32).
WORKING_BYTES = 4
MEMORY_SHARE = 4
GIB = 1024**3


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


def check_volume_size(source: str | Path, shape: Sequence[int], what: str = "its header promises") -> None:
    """Refuse `source` in one line when a volume of `shape` would not fit the budget as float32."""
    voxels = math.prod(int(s) for s in shape)
    budget = volume_budget_bytes()
    if voxels * WORKING_BYTES > budget:
        size = "x".join(str(int(s)) for s in shape)
        raise MedvolError(
            f"{source}: {what} {size} = {voxels:.3g} voxels ({voxels * WORKING_BYTES / GIB:.3g} GiB as float32), "
            f"more than one volume may take here ({budget / GIB:.3g} GiB, a quarter of this machine's memory; "
            f"{BUDGET_ENV} sets another); refused before reading it"
        )


def check_file_size(path: str | Path) -> None:
    """Refuse a file that alone is larger than one volume may be (read whole, e.g. a DICOM file's pixel data)."""
    size, budget = Path(path).stat().st_size, volume_budget_bytes()
    if size > budget:
        raise MedvolError(
            f"{path}: the file is {size / GIB:.3g} GiB, more than one volume may take here ({budget / GIB:.3g} GiB, "
            f"a quarter of this machine's memory; {BUDGET_ENV} sets another); refused before reading it"
        )


def load_nifti(path: str | Path) -> Any:
    """`nib.load(path)` (the header; voxels stay on disk until asked for), refused unless its shape fits the budget."""
    image = nib.load(str(path))
    check_volume_size(path, image.shape)
    return image
