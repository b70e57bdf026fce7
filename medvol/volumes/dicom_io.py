"""Read a DICOM series folder as one volume on its patient grid, as nibabel reads a NIfTI file, or refuse it in one
line.

A series is the image files of a folder that share a SeriesInstanceUID. Its slices are ordered by their
position along the slice normal (ImagePositionPatient projected on the cross product of the two
ImageOrientationPatient directions), never by file name or InstanceNumber; the slice spacing comes from
those positions, the in-plane spacing from PixelSpacing. The volume's axes are (column, row, slice), as
ITK and dcm2niix give them, and its affine maps them to RAS millimetres (DICOM's patient space is LPS:
the first two world axes change sign), the space nibabel's NIfTI affines are in. Values are the stored
values times RescaleSlope plus RescaleIntercept (Hounsfield units for CT). Compressed transfer syntaxes
are decoded by pydicom's pixel handlers (pylibjpeg: JPEG, JPEG-LS, JPEG 2000, RLE).

Slices whose positions lie off an even grid by more than `EVEN_TOLERANCE` of a step (a scanner that changed
its step within the series) are resampled onto an even grid at their smallest step, linearly along the
normal, with a warning saying so: read as if even, slices would land millimetres from where they were
taken. Outputs written back as DICOM go onto the source slices again (`SeriesGeometry.on_source_slices`).

Refused: several series where none was chosen, slices of different orientations, sizes or pixel
spacings, two slices at one position, a gap (a missing slice: a step over `GAP_FACTOR` times the usual
one), sheared stacks (a gantry tilt), colour images, multi-frame and enhanced objects (named as such), and
series larger than the memory budget (`medvol.volumes.volume_budget`). Dropped with a warning: localizer
(scout) images among the slices. Messages name folders, series UIDs and descriptions, never a patient
attribute.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from pydicom.dataset import FileDataset

from medvol.core.errors import MedvolError
from medvol.volumes.dicom_read import read_dicom
from medvol.volumes.volume_budget import check_volume_size

LOG = logging.getLogger("medvol")
# DICOM's patient axes are L, P, S; NIfTI's (and medvol's) R, A, S.
LPS_TO_RAS = np.diag([-1.0, -1.0, 1.0, 1.0])
# Directory records and other files without pixels share a folder with the slices.
MEDIA_DIRECTORY_SOP = "1.2.840.10008.1.3.10"
ORIENTATION_TOLERANCE = 1e-4
# How far (a fraction of the slice step) a slice may lie from the even grid through the first and last slices
# and still be read as lying on it: header strings round positions to 1e-4 mm or finer, so an even series
# is far inside; a fiftieth of a slice moves anatomy less than any interpolation of the volume resolves.
EVEN_TOLERANCE = 0.02
# A step this many times the series' usual one is a missing slice, not a changed step: refused.
GAP_FACTOR = 1.5


@dataclass(frozen=True)
class Slice:
    """One image file of a series: its path and header (no pixels read)."""

    path: Path
    header: FileDataset


@dataclass(frozen=True)
class SeriesGeometry:
    """A series read from a folder: its slices in order along the normal, the voxel grid they make.

    Args:
        folder: the folder the series was read from.
        uid: SeriesInstanceUID.
        description: SeriesDescription ('' when absent).
        slices: the slices, ordered by position along the slice normal.
        affine: 4x4 voxel-to-world matrix in RAS mm of the (column, row, slice) axes.
        dropped: localizer files left out of the volume.
        distances: where the slices lie along the normal, in mm from the first, when they lie off an even grid
            (the volume is then resampled onto `grid_slices` even slices); None for an even series.
        grid_slices: the number of slices of the even grid an uneven series is resampled onto.
    """

    folder: Path
    uid: str
    description: str
    slices: tuple[Slice, ...]
    affine: np.ndarray
    dropped: tuple[Path, ...] = ()
    distances: tuple[float, ...] | None = None
    grid_slices: int = 0

    @property
    def shape(self) -> tuple[int, int, int]:
        """(columns, rows, slices) of the volume's grid: the source slices, or the even grid an uneven series
        is resampled onto."""
        first = self.slices[0].header
        return int(first.Columns), int(first.Rows), self.grid_slices if self.resampled else len(self.slices)

    @property
    def resampled(self) -> bool:
        """Whether the slices lie off an even grid and the volume is resampled onto one."""
        return self.distances is not None

    def on_grid(self, stacked: np.ndarray) -> np.ndarray:
        """The source slices (stacked on the last axis, in order) on the volume's grid (linear along the normal)."""
        if not self.resampled:
            return stacked
        step = float(np.linalg.norm(self.affine[:3, 2]))
        return _interpolated(stacked, np.asarray(self.distances), np.arange(self.grid_slices) * step, labels=False)

    def on_source_slices(self, volume: np.ndarray, labels: bool) -> np.ndarray:
        """A volume on the grid back on the source slices: nearest for `labels`, linear otherwise."""
        if not self.resampled:
            return volume
        step = float(np.linalg.norm(self.affine[:3, 2]))
        return _interpolated(volume, np.arange(volume.shape[-1]) * step, np.asarray(self.distances), labels)

    @property
    def first(self) -> FileDataset:
        return self.slices[0].header


def _interpolated(volume: np.ndarray, at: np.ndarray, to: np.ndarray, labels: bool) -> np.ndarray:
    """`volume`'s slices (last axis) taken at positions `at` (increasing), read at positions `to`: the nearest
    slice for labels, else linear between the two around each position."""
    upper = np.clip(np.searchsorted(at, to, side="right"), 1, len(at) - 1)
    lower = upper - 1
    weight = np.clip((to - at[lower]) / (at[upper] - at[lower]), 0.0, 1.0)
    if labels:
        return volume[..., np.where(weight < 0.5, lower, upper)]
    out = volume[..., lower] * (1.0 - weight) + volume[..., upper] * weight
    return out.astype(volume.dtype, copy=False)


def is_dicom_file(path: Path) -> bool:
    """A DICOM Part 10 file: 128 bytes of preamble, then `DICM`."""
    try:
        with path.open("rb") as handle:
            return handle.read(132)[128:] == b"DICM"
    except OSError:
        return False


def dicom_files(folder: Path) -> list[Path]:
    """The DICOM files directly in `folder` (sorted by name; the order means nothing)."""
    if not folder.is_dir():
        return []
    return sorted(p for p in folder.iterdir() if p.is_file() and is_dicom_file(p))


def is_dicom_series(path: str | Path) -> bool:
    """Whether `path` is a folder holding DICOM files (a series folder); stops at the first one found."""
    path = Path(path)
    return path.is_dir() and any(p.is_file() and is_dicom_file(p) for p in path.iterdir())


def series_folders(path: str | Path) -> list[Path]:
    """`path` itself when it is a series folder, else its subfolders that are (one subject each)."""
    path = Path(path)
    if is_dicom_series(path):
        return [path]
    if not path.is_dir():
        return []
    return sorted(p for p in path.iterdir() if p.is_dir() and is_dicom_series(p))


def refuse_non_series_subjects(records: Sequence[Mapping[str, Any]]) -> None:
    """`output_format=dicom` writes outputs for subjects read from DICOM series only: refused before any work
    for a subject whose first image (or condition) is a NIfTI file or no file (synthetic data)."""
    for record in records:
        first = next(iter(record.get("image") or record.get("cond") or []), None)
        if first is None or not is_dicom_series(first):
            source = f"comes from {first}, not a DICOM series" if first else "comes from no file"
            raise MedvolError(
                f"`output_format`: dicom, but subject {record.get('subject')} {source}; use output_format=nifti or both"
            )


def _image_slices(folder: Path) -> list[Slice]:
    slices = []
    files = dicom_files(folder)
    others = sum(1 for p in folder.iterdir() if p.is_file()) - len(files)
    if others:
        # Read 132 bytes each to tell them apart, never whole.
        LOG.info("medvol: %s: %d file(s) that are not DICOM skipped", folder, others)
    for path in files:
        header = read_dicom(path, header_only=True)
        if header.get("SOPClassUID") != MEDIA_DIRECTORY_SOP and "Rows" in header:
            slices.append(Slice(path, header))
    if not slices:
        raise MedvolError(f"{folder}: no DICOM image files (only directory records or non-image objects)")
    return slices


def list_series(folder: str | Path) -> dict[str, list[Slice]]:
    """SeriesInstanceUID -> its image slices, in the order the folder lists them."""
    grouped: dict[str, list[Slice]] = {}
    for item in _image_slices(Path(folder)):
        grouped.setdefault(str(item.header.get("SeriesInstanceUID", "")), []).append(item)
    return grouped


def describe_series(grouped: dict[str, list[Slice]]) -> str:
    """`UID ('description', N slices)` for every series, as the refusal and the data doctor list them."""
    return "; ".join(
        f"{uid} ({str(items[0].header.get('SeriesDescription', ''))!r}, {len(items)} slices)"
        for uid, items in grouped.items()
    )


def choose_series(folder: str | Path, series: str | None = None) -> tuple[str, list[Slice]]:
    """The one series of `folder`, or the one whose UID or description is `series`; refuses otherwise."""
    grouped = list_series(folder)
    if series:
        chosen = {uid: items for uid, items in grouped.items()
                  if series in (uid, str(items[0].header.get("SeriesDescription", "")))}
        if len(chosen) != 1:
            found = "no" if not chosen else f"{len(chosen)}"
            raise MedvolError(
                f"`series`: {found} series of {folder} match {series!r}; it holds {describe_series(grouped)}"
            )
        grouped = chosen
    if len(grouped) > 1:
        raise MedvolError(
            f"{folder} holds {len(grouped)} DICOM series: {describe_series(grouped)}; "
            "choose one with series=<SeriesInstanceUID or SeriesDescription>"
        )
    uid, items = next(iter(grouped.items()))
    return uid, items


def is_localizer(header: FileDataset) -> bool:
    """A scout/localizer image (ImageType value LOCALIZER), taken across the stack, not part of it."""
    return "LOCALIZER" in [str(v).upper() for v in header.get("ImageType", [])]


def _orientation(item: Slice) -> np.ndarray:
    if "ImageOrientationPatient" not in item.header or "ImagePositionPatient" not in item.header:
        raise MedvolError(f"{item.path}: no ImageOrientationPatient/ImagePositionPatient; a volume needs both")
    return finite_numbers(item.path, "ImageOrientationPatient", item.header.ImageOrientationPatient, 6)


def finite_numbers(path: Path, keyword: str, values: Any, count: int, positive: bool = False) -> np.ndarray:
    """A geometry attribute's `count` numbers (float64), refused in one line naming the file and the attribute
    unless each is finite (and with `positive`, above 0): NaN or inf would place no slice anywhere."""
    listed = list(values) if isinstance(values, Iterable) and not isinstance(values, (str, bytes)) else [values]
    try:
        numbers = np.asarray([float(v) for v in listed], dtype=np.float64)
    except (TypeError, ValueError):
        numbers = np.full(1, np.nan)
    if len(numbers) != count or not np.all(np.isfinite(numbers)) or positive and not np.all(numbers > 0):
        shown = " ".join(str([str(v) for v in listed]).split())[:80]
        kind = "positive finite" if positive else "finite"
        raise MedvolError(f"{path}: {keyword} is {shown}; expected {count} {kind} number{'s' if count > 1 else ''}")
    return numbers


def _frames(header: FileDataset) -> int:
    try:
        return int(header.get("NumberOfFrames", 1) or 1)
    except (TypeError, ValueError):
        return 1


def refuse_multi_frame(item: Slice) -> None:
    """Refuse a multi-frame or enhanced object (Enhanced CT/MR, RT Dose, ultrasound cine, ...) for what it is:
    its geometry lives per frame in functional groups, not in the slice attributes a series of slices has."""
    header = item.header
    sop = header.get("SOPClassUID")
    name = str(getattr(sop, "name", "") or sop or "DICOM")
    frames = _frames(header)
    if frames > 1 or "PerFrameFunctionalGroupsSequence" in header or "Enhanced" in name:
        raise MedvolError(
            f"{item.path}: a multi-frame {name} object ({frames} frame{'s' if frames != 1 else ''}); medvol reads a "
            "series of single-frame slices: convert it to NIfTI (dcm2niix reads enhanced objects) or export the "
            "series as single-frame slices"
        )


def _check_uniform(folder: Path, slices: Sequence[Slice]) -> np.ndarray:
    """The orientation all slices share; refuses multi-frame objects, mixed orientations, sizes, spacings, colour."""
    for item in slices:
        refuse_multi_frame(item)
    first = slices[0]
    orientation = _orientation(first)
    for item in slices:
        header = item.header
        if int(header.get("SamplesPerPixel", 1)) != 1:
            raise MedvolError(
                f"{item.path}: a colour image ({header.get('PhotometricInterpretation')}); expected greyscale slices"
            )
        if not np.allclose(_orientation(item), orientation, atol=ORIENTATION_TOLERANCE):
            raise MedvolError(
                f"{folder}: mixed slice orientations ({first.path.name} and {item.path.name}); one volume needs one"
            )
        if (header.Rows, header.Columns) != (first.header.Rows, first.header.Columns):
            raise MedvolError(
                f"{folder}: mixed slice sizes ({first.header.Rows}x{first.header.Columns} in {first.path.name}, "
                f"{header.Rows}x{header.Columns} in {item.path.name})"
            )
        if not np.allclose(_pixel_spacing(item), _pixel_spacing(first), atol=1e-4):
            raise MedvolError(f"{folder}: mixed pixel spacings ({first.path.name} and {item.path.name})")
    return orientation


def _pixel_spacing(item: Slice) -> np.ndarray:
    """(between rows, between columns) in mm."""
    keyword = "PixelSpacing" if item.header.get("PixelSpacing") else "ImagerPixelSpacing"
    spacing = item.header.get(keyword)
    if spacing is None:
        raise MedvolError(f"{item.path}: no PixelSpacing; the voxel size is unknown")
    return finite_numbers(item.path, keyword, spacing, 2, positive=True)


def _position(item: Slice) -> np.ndarray:
    return finite_numbers(item.path, "ImagePositionPatient", item.header.ImagePositionPatient, 3)


@dataclass(frozen=True)
class SliceGrid:
    """The grid along the normal: its step (mm), and for slices off an even grid their distances from the first
    and the number of even slices they are resampled onto."""

    step: float
    distances: tuple[float, ...] | None = None
    slices: int = 0


def _slice_grid(folder: Path, uid: str, ordered: Sequence[Slice], distances: np.ndarray) -> SliceGrid:
    """The even grid of the slices; refuses doubled slices and gaps, resamples a series whose step changes."""
    if len(ordered) == 1:
        header = ordered[0].header
        keyword = next((k for k in ("SpacingBetweenSlices", "SliceThickness") if header.get(k)), None)
        if keyword is None:
            return SliceGrid(1.0)
        return SliceGrid(float(finite_numbers(ordered[0].path, keyword, header.get(keyword), 1)[0]))
    steps = np.diff(distances)
    step = float(np.median(steps))
    for k, gap in enumerate(steps):
        if gap < 1e-3 * max(step, 1e-6):
            raise MedvolError(
                f"{folder}: {ordered[k].path.name} and {ordered[k + 1].path.name} lie at the same position "
                "(several echoes, phases or time points?); put one volume per folder or choose a series"
            )
        if gap > GAP_FACTOR * step:
            raise MedvolError(
                f"{folder}: a gap of {gap:.3g} mm between slices {ordered[k].path.name} and {ordered[k + 1].path.name} "
                f"where the others are {step:.3g} mm apart (a missing slice?); the series must be complete"
            )
    span = float(distances[-1] - distances[0])
    even = span / (len(ordered) - 1)
    offsets = distances - distances[0]
    off_grid = float(np.max(np.abs(offsets - even * np.arange(len(ordered)))))
    if off_grid <= EVEN_TOLERANCE * even:
        return SliceGrid(even)
    # At least as fine as the finest step: no slice's detail is averaged away.
    count = int(np.ceil(span / float(steps.min()) - 1e-6)) + 1
    grid = SliceGrid(span / (count - 1), tuple(float(d) for d in offsets), count)
    LOG.warning(
        "medvol: %s: series %s has slice steps from %.4g to %.4g mm (slices up to %.3g mm off an even grid); "
        "resampled onto %d even slices %.4g mm apart (linear along the slice normal)",
        folder, uid, float(steps.min()), float(steps.max()), off_grid, count, grid.step,
    )
    return grid


def series_geometry(folder: str | Path, series: str | None = None) -> SeriesGeometry:
    """The geometry of the series in `folder` (headers only): slices in order, RAS affine; refusals as above."""
    folder = Path(folder)
    uid, items = choose_series(folder, series)
    kept = [item for item in items if not is_localizer(item.header)]
    dropped = tuple(item.path for item in items if is_localizer(item.header))
    if not kept:
        raise MedvolError(f"{folder}: series {uid} holds only localizer images; expected a stack of slices")
    orientation = _check_uniform(folder, kept)
    row_direction, column_direction = orientation[:3], orientation[3:]
    normal = np.cross(row_direction, column_direction)
    distances = np.asarray([_position(item) @ normal for item in kept])
    order = np.argsort(distances, kind="stable")
    ordered = [kept[i] for i in order]
    distances = distances[order]
    grid = _slice_grid(folder, uid, ordered, distances)
    _check_not_sheared(folder, ordered, normal, grid.step)
    row_spacing, column_spacing = _pixel_spacing(ordered[0])
    affine = np.eye(4)
    # Column index moves along the row direction, row index along the column direction.
    affine[:3, 0] = row_direction * column_spacing
    affine[:3, 1] = column_direction * row_spacing
    affine[:3, 2] = normal * grid.step
    affine[:3, 3] = _position(ordered[0])
    description = str(ordered[0].header.get("SeriesDescription", ""))
    geometry = SeriesGeometry(folder, uid, description, tuple(ordered), LPS_TO_RAS @ affine, dropped,
                              grid.distances, grid.slices)
    check_volume_size(f"{folder} (series {uid})", geometry.shape, "its headers promise")
    return geometry


def _check_not_sheared(folder: Path, ordered: Sequence[Slice], normal: np.ndarray, step: float) -> None:
    """Every slice's corner on the line through the first along the normal (a gantry tilt shears the stack)."""
    origin = _position(ordered[0])
    tolerance = max(0.05, 0.1 * float(_pixel_spacing(ordered[0]).min()))
    for item in ordered:
        offset = _position(item) - origin
        if np.linalg.norm(offset - (offset @ normal) * normal) > tolerance:
            raise MedvolError(
                f"{folder}: slice {item.path.name} is shifted within its plane against the first (a gantry tilt "
                "or a sheared stack); resample it to an orthogonal grid first"
            )


def stored_pixels(item: Slice) -> np.ndarray:
    """The stored values of one slice; refuses a file larger than a volume may be (or inflating beyond what its
    header promises: `read_dicom`), and a transfer syntax no installed decoder reads."""
    dataset = read_dicom(item.path, header_only=False)
    try:
        return np.asarray(dataset.pixel_array)
    except Exception as err:  # noqa: BLE001 - a missing or failing decoder raises one of several types
        syntax = dataset.file_meta.get("TransferSyntaxUID")
        name = getattr(syntax, "name", str(syntax))
        raise MedvolError(
            f"{item.path}: cannot decode its pixels, transfer syntax {name} ({syntax}): "
            f"{' '.join(str(err).split())[:120]}; "
            "decompress it (e.g. gdcmconv --raw) or install its decoder"
        ) from err


def slice_values(item: Slice) -> np.ndarray:
    """One slice in its units: stored values times RescaleSlope plus RescaleIntercept, (rows, columns) float32."""
    slope = float(item.header.get("RescaleSlope", 1.0) or 1.0)
    intercept = float(item.header.get("RescaleIntercept", 0.0) or 0.0)
    return (stored_pixels(item).astype(np.float64) * slope + intercept).astype(np.float32)


def read_series(folder: str | Path, series: str | None = None) -> tuple[np.ndarray, SeriesGeometry]:
    """The series in `folder` as a (columns, rows, slices) float32 volume in its units, and its geometry.

    A localizer among the slices is dropped with a warning naming how many.
    """
    geometry = series_geometry(folder, series)
    if geometry.dropped:
        LOG.warning(
            "medvol: %s: dropped %d localizer image(s) from series %s (ImageType LOCALIZER)",
            geometry.folder, len(geometry.dropped), geometry.uid,
        )
    volume = np.stack([slice_values(item).T for item in geometry.slices], axis=-1)
    return geometry.on_grid(volume), geometry
