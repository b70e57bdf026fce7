"""Read one DICOM radiograph (CR, DX) as a 2D image with a RAS affine, as a 2D NIfTI radiograph is read.

A projection radiograph has no ImagePositionPatient or ImageOrientationPatient: where its rows and columns
run in the patient is given by PatientOrientation (0020,0020), two values naming the direction of the rows
(along a row, as the column index grows) and of the columns (down a column, as the row index grows) with the
letters L/R, A/P, H/F. Its pixel spacing in the patient's plane is PixelSpacing where the file has it (the
calibrated spacing), otherwise ImagerPixelSpacing (at the detector) divided by
EstimatedRadiographicMagnificationFactor (1 when absent): medvol's projector is parallel-beam, without the
magnification a point source gives, so the patient's plane is the one its views were made in.

Values: the stored pixels over their stored range (BitsStored, signed or not) give [0, 1], and a MONOCHROME1
image (the smallest value displayed white) is inverted, so that dense tissue is bright as 1 - I/I0 is. A
radiograph "for presentation" has been processed (logarithm, equalisation, LUTs) and is not the attenuation a
DRR holds; it is read as its stored values say, and how close it comes to the training views is the user's
question (docs/xray2ct.md).

Refused in one line naming the file: another modality, a multi-frame object, no PatientOrientation or an oblique
one, no pixel spacing, colour, a file larger than the memory budget.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pydicom

from medvol.core.errors import MedvolError
from medvol.volumes.dicom_io import Slice, finite_numbers, refuse_multi_frame, stored_pixels
from medvol.volumes.dicom_read import read_dicom
from medvol.volumes.volume_budget import check_volume_size

# The modalities of projection radiographs medvol reads: computed and digital radiography.
RADIOGRAPH_MODALITIES = ("CR", "DX")
# PatientOrientation's letters as RAS unit vectors (DICOM's L is RAS's -x, P is -y, H is +z).
LETTERS = {"L": (-1.0, 0.0, 0.0), "R": (1.0, 0.0, 0.0), "A": (0.0, 1.0, 0.0), "P": (0.0, -1.0, 0.0),
           "H": (0.0, 0.0, 1.0), "F": (0.0, 0.0, -1.0)}


@dataclass(frozen=True)
class Radiograph:
    """A radiograph's pixels (rows, columns) in [0, 1] and the RAS affine of its (row, column) indices."""

    pixels: np.ndarray
    affine: np.ndarray


def _direction(path: Path, value: str, which: str) -> np.ndarray:
    letters = value.strip().upper()
    if not letters or any(letter not in LETTERS for letter in letters):
        raise MedvolError(
            f"`input`: {path.name}: PatientOrientation's {which} direction is {value!r}; expected letters from "
            "L, R, A, P, H, F (e.g. 'L' and 'F' for a chest film displayed facing the patient)"
        )
    vector = np.sum([LETTERS[letter] for letter in letters], axis=0)
    return vector / np.linalg.norm(vector)


def _spacing(path: Path, header: pydicom.Dataset) -> tuple[float, float]:
    if header.get("PixelSpacing"):
        keyword, values = "PixelSpacing", header.PixelSpacing
    elif header.get("ImagerPixelSpacing"):
        magnification = finite_numbers(path, "EstimatedRadiographicMagnificationFactor",
                                       header.get("EstimatedRadiographicMagnificationFactor", 1.0) or 1.0, 1, True)
        keyword = "ImagerPixelSpacing / EstimatedRadiographicMagnificationFactor"
        values = [float(v) / float(magnification[0]) for v in header.ImagerPixelSpacing]
    else:
        raise MedvolError(
            f"`input`: {path.name} has neither PixelSpacing nor ImagerPixelSpacing; the model needs each view's "
            "pixel size in mm"
        )
    row, column = finite_numbers(path, keyword, values, 2, positive=True)
    return float(row), float(column)


def read_radiograph(path: str | Path) -> Radiograph:
    """One CR/DX file as pixels in [0, 1] (MONOCHROME1 inverted) and the RAS affine its PatientOrientation and
    pixel spacing give; refused in one line when it is not such a radiograph."""
    path = Path(path)
    header = read_dicom(path, header_only=True)
    modality = str(header.get("Modality", "") or "none")
    if modality not in RADIOGRAPH_MODALITIES:
        raise MedvolError(
            f"`input`: {path.name} is a DICOM of modality {modality}; radiographs are read from "
            f"{' or '.join(RADIOGRAPH_MODALITIES)} files"
        )
    refuse_multi_frame(Slice(path, header))
    if int(header.get("SamplesPerPixel", 1) or 1) != 1:
        raise MedvolError(f"`input`: {path.name} is a colour image; a radiograph is one grey channel")
    orientation = list(header.get("PatientOrientation") or [])
    if len(orientation) != 2:
        raise MedvolError(
            f"`input`: {path.name} has no PatientOrientation (it holds {orientation or 'nothing'}); expected the "
            "directions of its rows and columns (e.g. L\\F), without which the view's side is unknown"
        )
    rows, columns = int(header.Rows), int(header.Columns)
    check_volume_size(path, (rows, columns))
    row_spacing, column_spacing = _spacing(path, header)
    affine = np.eye(4)
    # Array axis 0 (down a column, the row index) runs along the second value; axis 1 along the first.
    affine[:3, 0] = _direction(path, str(orientation[1]), "column") * row_spacing
    affine[:3, 1] = _direction(path, str(orientation[0]), "row") * column_spacing
    bits = int(header.get("BitsStored", 16) or 16)
    low = -(2.0 ** (bits - 1)) if int(header.get("PixelRepresentation", 0) or 0) == 1 else 0.0
    pixels = (stored_pixels(Slice(path, header)).astype(np.float64) - low) / (2.0**bits - 1)
    pixels = np.clip(pixels, 0.0, 1.0)
    if str(header.get("PhotometricInterpretation", "MONOCHROME2")).strip() == "MONOCHROME1":
        pixels = 1.0 - pixels
    return Radiograph(pixels.astype(np.float32), affine)
