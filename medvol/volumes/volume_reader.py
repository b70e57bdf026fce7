"""One reader for every volume medvol accepts: a NIfTI file (nibabel) or a DICOM series folder (`dicom_io`).

`LoadVolumed` is MONAI's `LoadImaged` with this reader: the dataset transforms load a subject's channels
from NIfTI files and series folders alike, each with its RAS affine, so orientation, spacing and the
source grid that outputs are mapped back onto work the same for both. `volume_grid` gives the shape and
affine from headers alone (the data checks, the fingerprint, predict's channel check).
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
from monai.data import ImageReader, NibabelReader
from monai.data.utils import is_no_channel
from monai.transforms import LoadImaged
from monai.utils import MetaKeys, SpaceKeys, ensure_tuple

from medvol.volumes.dicom_io import is_dicom_series, read_series, series_geometry
from medvol.volumes.volume_budget import check_resampled_size, load_nifti

# The meta key naming the SeriesInstanceUID a volume was read from ('' for NIfTI).
SERIES_KEY = "dicom_series"


def volume_grid(path: str | Path, series: str | None = None) -> tuple[tuple[int, ...], np.ndarray]:
    """(shape, 4x4 RAS affine) of a NIfTI file or a DICOM series folder, from headers only (a series: 3D)."""
    if Path(path).is_dir():
        geometry = series_geometry(path, series)
        return geometry.shape, geometry.affine
    image = load_nifti(path)
    return tuple(int(s) for s in image.shape), np.asarray(image.affine, dtype=np.float64)


def check_volume_file(
    path: str | Path, spacing: Sequence[float] | None = None, orientation: str | None = None, series: str | None = None
) -> None:
    """A NIfTI file's or series folder's headers against the memory budget, before a voxel is read: the volume as
    read, and the grid resampling to `spacing` mm (after `orientation`) makes of it; one `MedvolError` line else."""
    shape, affine = volume_grid(path, series)
    if spacing:
        check_resampled_size(path, shape, affine, spacing, orientation)


class VolumeReader(ImageReader):
    """A MONAI image reader for NIfTI files and DICOM series folders; several paths are stacked as channels.

    Args:
        series: the SeriesInstanceUID or SeriesDescription to read from folders holding several series.
    """

    def __init__(self, series: str | None = None) -> None:
        super().__init__()
        self.series = series

    def verify_suffix(self, filename: Sequence[str | Path] | str | Path) -> bool:
        return all(Path(f).is_dir() or str(f).endswith((".nii", ".nii.gz")) for f in ensure_tuple(filename))

    def read(self, data: Sequence[str | Path] | str | Path, **kwargs: Any) -> list[tuple[np.ndarray, dict]]:
        return [self._read_one(Path(f)) for f in ensure_tuple(data)]

    def _read_one(self, path: Path) -> tuple[np.ndarray, dict]:
        if is_dicom_series(path):
            volume, geometry = read_series(path, self.series)
            meta = {
                MetaKeys.AFFINE: geometry.affine.copy(), MetaKeys.ORIGINAL_AFFINE: geometry.affine.copy(),
                MetaKeys.SPATIAL_SHAPE: np.asarray(volume.shape), MetaKeys.SPACE: SpaceKeys.RAS,
                MetaKeys.ORIGINAL_CHANNEL_DIM: float("nan"), SERIES_KEY: geometry.uid,
            }
            return volume, meta
        load_nifti(path)  # the header's size, before MONAI's reader allocates the voxels
        nifti = NibabelReader()
        array, meta = nifti.get_data(nifti.read(str(path)))
        meta[SERIES_KEY] = ""
        return array, meta

    def get_data(self, img: list[tuple[np.ndarray, dict]]) -> tuple[np.ndarray, dict]:
        arrays = [array for array, _ in img]
        meta = dict(img[0][1])
        if len(arrays) == 1:
            return arrays[0], meta
        if all(_has_no_channel(m) for _, m in img):
            meta[MetaKeys.ORIGINAL_CHANNEL_DIM] = 0
            return np.stack(arrays, axis=0), meta
        # NIfTI files with their own channel axis (the last): concatenated along it, single volumes given one.
        arrays = [a if a.ndim == 4 else a[..., None] for a in arrays]
        meta[MetaKeys.ORIGINAL_CHANNEL_DIM] = -1
        return np.concatenate(arrays, axis=-1), meta


def _has_no_channel(meta: Mapping[str, Any]) -> bool:
    return is_no_channel(meta.get(MetaKeys.ORIGINAL_CHANNEL_DIM))


class LoadVolumed(LoadImaged):
    """`LoadImaged` reading NIfTI files and DICOM series folders (`VolumeReader`), its refusals passed on as they are.

    Args:
        keys: the keys holding a path or a list of paths (stacked as channels).
        series: the series to read from folders holding several (UID or description).
        **kwargs: `LoadImaged` settings (image_only, ensure_channel_first, dtype, ...).
    """

    def __init__(self, keys: Sequence[str], series: str | None = None, **kwargs: Any) -> None:
        super().__init__(keys, reader="NibabelReader", **kwargs)
        self.volume_reader = VolumeReader(series)

    def __call__(self, data: Mapping[Hashable, Any], reader: ImageReader | None = None) -> dict[Hashable, Any]:
        # A reader given at call time is used directly: MONAI's reader fallback would bury a refusal in a traceback.
        return super().__call__(data, reader or self.volume_reader)
