"""Which DICOM series reader medvol uses: three readers against the truth of series whose geometry is known.

    PYTHONPATH=$PWD python benchmarks/data/dicom_readers.py

Readers: medvol's (`medvol.volumes.dicom_io`: pydicom + its own geometry), SimpleITK's `ImageSeriesReader`
(GDCM's position sorter) and MONAI's `PydicomReader`. Cases: pydicom's real 5-slice CT (truth: its headers,
worked by hand), and series written here with a known grid: shuffled names with an oblique, anisotropic grid
and intercept -1024, a stack whose InstanceNumbers run against its positions, a missing slice, two series in
one folder, a localizer among the slices, one JPEG 2000 slice. A reader agrees when its volume, brought to the
closest canonical orientation (nibabel), has the truth's values (1e-3) and affine (1e-4 mm); a series that is no
volume should be refused. Prints one Markdown table.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import warnings
from collections.abc import Callable
from pathlib import Path

import nibabel as nib
import numpy as np
import pydicom
import SimpleITK as sitk
from monai.data import PydicomReader

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root, for a direct run
from benchmarks.common import table_header  # noqa: E402
from medvol.volumes.dicom_io import LPS_TO_RAS, read_series  # noqa: E402
from tests.dicom_series import CT5N, oblique_orientation, pydicom_file, ramp, write_localizer, write_series

Truth = tuple[np.ndarray, np.ndarray] | None  # (volume, RAS affine), or None: the series should be refused


def medvol_reader(folder: Path) -> tuple[np.ndarray, np.ndarray]:
    volume, geometry = read_series(folder)
    return volume, geometry.affine


def simpleitk_reader(folder: Path) -> tuple[np.ndarray, np.ndarray]:
    reader = sitk.ImageSeriesReader()
    reader.SetFileNames(reader.GetGDCMSeriesFileNames(str(folder)))
    image = reader.Execute()
    affine = np.eye(4)
    affine[:3, :3] = np.asarray(image.GetDirection()).reshape(3, 3) * np.asarray(image.GetSpacing())
    affine[:3, 3] = image.GetOrigin()
    return sitk.GetArrayFromImage(image).transpose(2, 1, 0).astype(np.float32), LPS_TO_RAS @ affine


def monai_pydicom_reader(folder: Path) -> tuple[np.ndarray, np.ndarray]:
    reader = PydicomReader()
    array, meta = reader.get_data(reader.read(str(folder)))
    return np.asarray(array, dtype=np.float32), np.asarray(meta["affine"], dtype=np.float64)


READERS: dict[str, Callable[[Path], tuple[np.ndarray, np.ndarray]]] = {
    "medvol (pydicom + own geometry)": medvol_reader,
    "SimpleITK ImageSeriesReader": simpleitk_reader,
    "MONAI PydicomReader": monai_pydicom_reader,
}


def canonical(volume: np.ndarray, affine: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    image = nib.as_closest_canonical(nib.Nifti1Image(volume.astype(np.float32), affine))
    return np.asarray(image.dataobj, dtype=np.float64), np.asarray(image.affine)


def grid(orientation, spacing, step, origin) -> np.ndarray:
    """The RAS affine of a written series, from its parameters (the hand-worked truth)."""
    rows, columns = np.asarray(orientation[:3], float), np.asarray(orientation[3:], float)
    affine = np.eye(4)
    affine[:3, 0], affine[:3, 1] = rows * spacing[1], columns * spacing[0]
    affine[:3, 2], affine[:3, 3] = np.cross(rows, columns) * step, origin
    return LPS_TO_RAS @ affine


def ct5n_truth() -> Truth:
    headers = sorted((pydicom.dcmread(p) for p in CT5N.iterdir()), key=lambda d: float(d.ImagePositionPatient[2]))
    volume = np.stack([d.pixel_array.T * float(d.RescaleSlope) + float(d.RescaleIntercept) for d in headers], -1)
    return volume, grid((1, 0, 0, 0, 1, 0), [float(v) for v in headers[0].PixelSpacing], 2.5,
                        [float(v) for v in headers[0].ImagePositionPatient])


def written_cases(root: Path) -> dict[str, tuple[Path, Truth]]:
    cases: dict[str, tuple[Path, Truth]] = {"real CT, 5 slices (pydicom CT5N)": (CT5N, ct5n_truth())}
    stored = ramp(6, 5, 7)
    oblique = oblique_orientation(25.0)
    write_series(root / "oblique", stored, oblique, (0.7, 1.3), 2.9, (-12.5, 30.0, 4.0), intercept=-1024.0, seed=3)
    cases["shuffled, oblique, anisotropic, intercept -1024"] = (
        root / "oblique", (stored.transpose(1, 0, 2) - 1024.0, grid(oblique, (0.7, 1.3), 2.9, (-12.5, 30.0, 4.0))))
    write_series(root / "reversed", stored, (0, 1, 0, 1, 0, 0), (1.0, 1.0), 1.5, (0, 0, 0), slope=2.0, seed=7)
    cases["normal pointing down, slope 2"] = (
        root / "reversed", (stored.transpose(1, 0, 2) * 2.0, grid((0, 1, 0, 1, 0, 0), (1.0, 1.0), 1.5, (0, 0, 0))))
    write_series(root / "gap", stored, skip=(3,))
    cases["a missing slice"] = (root / "gap", None)
    write_series(root / "two", stored, seed=1)
    write_series(root / "two", stored[:, :, :4], seed=2)
    cases["two series in one folder"] = (root / "two", None)
    scout = write_series(root / "scout", stored)
    write_localizer(root / "scout", stored.shape[:2], scout["uid"])
    cases["a localizer among the slices (truth: dropped)"] = (
        root / "scout", (stored.transpose(1, 0, 2).astype(float), grid((1, 0, 0, 0, 1, 0), (1, 1), 1.0, (0, 0, 0))))
    (root / "j2k").mkdir()
    shutil.copy(pydicom_file("MR_small_jp2klossless.dcm"), root / "j2k" / "slice.dcm")
    plain = pydicom.dcmread(pydicom_file("MR_small.dcm"))
    cases["one JPEG 2000 slice (MR_small)"] = (root / "j2k", (
        plain.pixel_array.T[..., None].astype(float), _single_slice_affine(plain)))
    return cases


def _single_slice_affine(header: pydicom.Dataset) -> np.ndarray:
    orientation = [float(v) for v in header.ImageOrientationPatient]
    step = float(header.get("SpacingBetweenSlices") or header.get("SliceThickness") or 1.0)
    return grid(
        orientation, [float(v) for v in header.PixelSpacing], step, [float(v) for v in header.ImagePositionPatient]
    )


def verdict(reader: Callable, folder: Path, truth: Truth) -> str:
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            volume, affine = reader(folder)
    except Exception as err:  # noqa: BLE001 - every failure is a verdict of the table
        return "refused" + (" (right)" if truth is None else f": {type(err).__name__}")
    if truth is None:
        return f"read {volume.shape} (should refuse)"
    if volume.ndim != 3:
        return f"shape {volume.shape}"
    try:
        ours, theirs = canonical(volume, affine), canonical(*truth)
    except nib.orientations.OrientationError:
        return f"degenerate affine (columns {np.round(np.linalg.norm(affine[:3, :3], axis=0), 3).tolist()})"
    if ours[0].shape != theirs[0].shape:
        return f"shape {ours[0].shape}, truth {theirs[0].shape}"
    geometry = float(np.abs(ours[1] - theirs[1]).max())
    values = float(np.abs(ours[0] - theirs[0]).max())
    return "agrees" if geometry < 1e-4 and values < 1e-3 else f"differs: affine {geometry:.3g} mm, values {values:.3g}"


def main() -> None:
    argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter).parse_args()
    sitk.ProcessObject.SetGlobalWarningDisplay(False)
    with tempfile.TemporaryDirectory() as scratch:
        cases = written_cases(Path(scratch))
        print(table_header(["case", *READERS]))
        for name, (folder, truth) in cases.items():
            print(f"| {name} | " + " | ".join(verdict(reader, folder, truth) for reader in READERS.values()) + " |")


if __name__ == "__main__":
    main()
