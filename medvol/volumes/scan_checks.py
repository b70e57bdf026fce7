"""What a scan file must be before a model reads it, from its header: a volume (three spatial axes, more than one
slice), with finite geometry, whose body holds every voxel its header promises.

Each fact is checked here once, for predict.py's inputs and the data doctor alike; each returns the problem as the
words after the file's name (the doctor's table lists them so, a refusal prefixes the path), or None.
"""

from __future__ import annotations

import gzip
import struct
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import nibabel as nib
import numpy as np

TRUNCATED = "truncated: the file ends before all its voxels (re-copy or re-export it)"


def shape_problem(shape: Sequence[int]) -> str | None:
    """A file that is no 3D volume: fewer than three axes (a 2D image), or one slice along one of its three (a 3D
    network reads volumes; one slice is neither segmented nor reconstructed as one)."""
    shape = tuple(int(s) for s in shape)
    if len(shape) < 3:
        return f"not a 3D volume: shape {shape}"
    if min(shape[:3]) < 2:
        return f"not a 3D volume: a single slice, shape {shape}"
    return None


def geometry_problem(image: Any) -> str | None:
    """NaN or inf in a NIfTI header's voxel sizes (pixdim) or voxel-to-world affine: no grid can be placed."""
    zooms = np.asarray(image.header.get_zooms()[:3], dtype=np.float64)
    if not np.all(np.isfinite(zooms)):
        return f"its header gives voxel sizes (pixdim) of {_numbers(zooms)} mm; expected finite numbers"
    affine = np.asarray(image.affine, dtype=np.float64)
    if not np.all(np.isfinite(affine)):
        rows = "; ".join(_numbers(row) for row in affine[:3])
        return f"its header's voxel-to-world affine holds NaN or inf ({rows}); expected finite numbers"
    return None


def _numbers(values: Sequence[float]) -> str:
    return ", ".join(f"{float(v):.4g}" for v in values)


def truncation_problem(path: str | Path, image: Any) -> str | None:
    """`TRUNCATED` where the file ends before the voxels its header promises: a plain file shorter than them, a gzip
    file whose trailer disagrees (its stored size mod 2^32) and whose stream then ends before them."""
    path = Path(path)
    expected = _expected_bytes(image)
    if path.name.endswith(".gz"):
        suspicious = _gzip_size_mismatch(path, expected)
    else:
        suspicious = path.stat().st_size < expected
    return TRUNCATED if suspicious and _full_read_fails(path, expected) else None


def _expected_bytes(image: Any) -> int:
    # nibabel gives a loaded image's header a data offset of 0; the file's own (352 for a .nii) is the array proxy's.
    header = image.header
    offset = getattr(image.dataobj, "offset", None)
    offset = header.get_data_offset() if offset is None else offset
    return int(offset) + int(np.prod(image.shape)) * header.get_data_dtype().itemsize


def _gzip_size_mismatch(path: Path, expected: int) -> bool:
    """Cheap truncation test: a gzip file ends with its uncompressed size mod 2^32; a cut file does not."""
    with path.open("rb") as handle:
        handle.seek(0, 2)
        if handle.tell() < 22:
            return True
        handle.seek(-4, 2)
        stored = struct.unpack("<I", handle.read(4))[0]
    return stored != expected % 2**32


def _full_read_fails(path: Path, expected: int) -> bool:
    """Whether the file ends before its `expected` bytes (a gzip stream is inflated up to them, never further: a
    stream that inflates without end behind a modest header costs no more than the header promises)."""
    try:
        if path.name.endswith(".gz"):
            left = expected
            with gzip.open(path, "rb") as handle:
                while left > 0:
                    chunk = handle.read(min(left, 1 << 24))
                    if not chunk:
                        return True
                    left -= len(chunk)
        np.asarray(nib.load(str(path)).dataobj)
    except Exception:  # noqa: BLE001 - EOFError, zlib.error, OSError: the file is cut or corrupt
        return True
    return False
