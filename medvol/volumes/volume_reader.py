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

import nibabel as nib
import numpy as np
from monai.data import ImageReader, NibabelReader
from monai.data.utils import is_no_channel
from monai.transforms import LoadImaged
from monai.utils import MetaKeys, SpaceKeys, ensure_tuple

from medvol.core.errors import MedvolError
from medvol.volumes.dicom_io import is_dicom_series, read_series, series_geometry
from medvol.volumes.scan_checks import shape_problem, truncation_problem
from medvol.volumes.volume_budget import check_resampled_size, load_nifti, resampled_shape

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
    path: str | Path, spacing: Sequence[float] | None = None, orientation: str | None = None, series: str | None = None,
    smallest: tuple[Sequence[int], str] | None = None,
) -> None:
    """A NIfTI file's or series folder's headers, before a voxel is read: a 3D volume whose file holds all its voxels
    (`medvol.volumes.scan_checks`), within the memory budget as read and on the grid resampling to `spacing` mm
    (after `orientation`) makes of it, and that grid at least `smallest` = ((D, H, W), why) where the model
    needs as many; one `MedvolError` line else."""
    if Path(path).is_dir():
        geometry = series_geometry(path, series)
        shape, affine, problem = geometry.shape, geometry.affine, None
    else:
        image = load_nifti(path)
        shape, affine = tuple(int(s) for s in image.shape), np.asarray(image.affine, dtype=np.float64)
        problem = truncation_problem(path, image)
    problem = problem or shape_problem(shape)
    if problem:
        raise MedvolError(f"{path}: {problem}")
    if spacing:
        check_resampled_size(path, shape, affine, spacing, orientation)
    if smallest:
        check_smallest_grid(path, shape, affine, spacing, orientation, *smallest)


def check_smallest_grid(
    path: str | Path, shape: Sequence[int], affine: np.ndarray, spacing: Sequence[float] | None,
    orientation: str | None, smallest: Sequence[int], why: str,
) -> None:
    """Refuse a volume whose grid, reoriented to `orientation` and resampled to `spacing` mm where given, has fewer
    voxels along an axis than `smallest` (D, H, W; `why`: what in the model needs them), in one line naming its size
    as stored and as the model would see it."""
    if spacing:
        grid = resampled_shape(shape, affine, spacing, orientation)
    else:
        zooms = np.sqrt((np.asarray(affine, dtype=np.float64)[:3, :3] ** 2).sum(axis=0))
        grid = resampled_shape(shape, affine, oriented(zooms, affine, orientation), orientation)
    if all(size >= least for size, least in zip(grid, smallest, strict=True)):
        return
    stored = "x".join(str(int(s)) for s in shape[:3])
    size = f"{'x'.join(map(str, grid))} voxels" + (
        f" once resampled to {'x'.join(f'{float(s):.4g}' for s in spacing)} mm ({stored} as stored)" if spacing
        else f" ({stored} as stored)" if orientation else ""
    )
    raise MedvolError(
        f"{path}: {size}, smaller than the model takes: at least {'x'.join(map(str, smallest))} voxels ({why})"
    )


def oriented(values: Sequence[float], affine: np.ndarray, orientation: str | None) -> list[float]:
    """Per-axis `values` of a grid stored with `affine`, in the axis order reorienting to `orientation` gives."""
    if not orientation:
        return [float(v) for v in values]
    turn = nib.orientations.ornt_transform(
        nib.orientations.io_orientation(np.asarray(affine, dtype=np.float64)),
        nib.orientations.axcodes2ornt(tuple(orientation)),
    )
    turned = [0.0] * 3
    for axis, (to, _) in enumerate(turn):
        turned[int(to)] = float(values[axis])
    return turned


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
