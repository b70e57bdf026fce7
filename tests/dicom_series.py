"""Write small DICOM series for the tests: a chosen grid (orientation, spacings, origin), stored values and rescale,
file names that say nothing of the slice order, and a patient module whose values must never leak."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pydicom
from pydicom.data import get_testdata_file
from pydicom.dataset import Dataset, FileDataset, FileMetaDataset
from pydicom.uid import CTImageStorage, ExplicitVRLittleEndian, MRImageStorage, generate_uid

# The real 5-slice CT series in pydicom's wheel (16 x 16, 2.5 mm, intercept -1024).
CT5N = Path(os.path.dirname(pydicom.data.__file__)) / "test_files" / "dicomdirtests" / "98892001" / "CT5N"
PATIENT = {"PatientName": "Doe^Jane", "PatientID": "PRIV-4711", "PatientBirthDate": "19700101",
           "AccessionNumber": "ACC-0815"}
STUDY_UID = generate_uid()
FRAME_UID = generate_uid()


def pydicom_file(name: str) -> Path:
    """A single file from pydicom's wheel (those it ships, never a download)."""
    return Path(str(get_testdata_file(name)))


def _slice(stored: np.ndarray, position: np.ndarray, orientation, spacing, uid: str, description: str,
           intercept: float, slope: float, number: int, image_type: list[str], modality: str = "CT") -> FileDataset:
    sop_class = MRImageStorage if modality == "MR" else CTImageStorage
    meta = FileMetaDataset()
    meta.MediaStorageSOPClassUID = sop_class
    meta.MediaStorageSOPInstanceUID = generate_uid()
    meta.TransferSyntaxUID = ExplicitVRLittleEndian
    ds = FileDataset("", Dataset(), file_meta=meta, preamble=b"\0" * 128)
    for key, value in PATIENT.items():
        setattr(ds, key, value)
    ds.PatientSex = "F"
    ds.SOPClassUID, ds.SOPInstanceUID = sop_class, meta.MediaStorageSOPInstanceUID
    ds.StudyInstanceUID, ds.SeriesInstanceUID, ds.FrameOfReferenceUID = STUDY_UID, uid, FRAME_UID
    ds.Modality, ds.SeriesDescription, ds.SeriesNumber, ds.InstanceNumber = modality, description, 1, number
    ds.StudyDate, ds.StudyTime, ds.StudyID, ds.ReferringPhysicianName = "20240101", "120000", "1", ""
    ds.Manufacturer, ds.PositionReferenceIndicator = "medvol-tests", ""
    ds.ImageType = image_type
    ds.ImagePositionPatient = [f"{v:.6f}" for v in position]
    ds.ImageOrientationPatient = [f"{v:.8f}" for v in orientation]
    ds.PixelSpacing = [f"{spacing[0]:.6f}", f"{spacing[1]:.6f}"]
    ds.SliceThickness = "1"
    ds.Rows, ds.Columns = stored.shape
    ds.SamplesPerPixel, ds.PhotometricInterpretation = 1, "MONOCHROME2"
    ds.BitsAllocated, ds.BitsStored, ds.HighBit, ds.PixelRepresentation = 16, 16, 15, 1
    ds.RescaleIntercept, ds.RescaleSlope = f"{intercept:g}", f"{slope:g}"
    ds.RescaleType = "HU" if modality == "CT" else "US"
    if modality == "MR":
        ds.ScanningSequence, ds.SequenceVariant, ds.EchoTime, ds.RepetitionTime = "SE", "NONE", "12", "500"
    ds.PixelData = np.ascontiguousarray(stored.astype("<i2")).tobytes()
    return ds


def write_series(
    folder: Path, stored: np.ndarray, orientation=(1, 0, 0, 0, 1, 0), spacing=(1.0, 1.0), step: float = 1.0,
    origin=(0.0, 0.0, 0.0), intercept: float = 0.0, slope: float = 1.0, uid: str | None = None,
    description: str = "test series", seed: int = 0, skip: tuple[int, ...] = (), positions=None,
    modality: str = "CT",
) -> dict:
    """Write `stored` ((rows, columns, slices) int16) as one file per slice, in a shuffled order of random names.

    Slice k lies at `origin + k * step * normal` (normal: row direction x column direction), or at
    `origin + positions[k] * normal` where `positions` (mm) are given; `spacing` is PixelSpacing (between rows,
    between columns). `skip` leaves those slices out (a missing slice). `modality`: CT (CT Image Storage) or MR.
    Returns the series' facts: uid, LPS origin, normal, files.
    """
    folder.mkdir(parents=True, exist_ok=True)
    uid = uid or generate_uid()
    rows, columns = np.asarray(orientation[:3], float), np.asarray(orientation[3:], float)
    normal = np.cross(rows, columns)
    rng = np.random.default_rng(seed)
    order = rng.permutation(stored.shape[2])
    files = []
    for rank, k in enumerate(order):
        if k in skip:
            continue
        distance = k * step if positions is None else positions[k]
        position = np.asarray(origin, float) + distance * normal
        ds = _slice(stored[:, :, k], position, orientation, spacing, uid, description, intercept, slope,
                    int(rng.integers(1, 10_000)), ["ORIGINAL", "PRIMARY", "AXIAL"], modality)
        # Random names (the order means nothing), distinct per series so two series can share a folder.
        path = folder / f"IM{rank:04d}_{rng.integers(1e6):06d}_{uid[-6:]}.dcm"
        ds.save_as(path, enforce_file_format=True)
        files.append(path)
    return {"uid": uid, "origin": np.asarray(origin, float), "normal": normal, "files": files}


def write_localizer(folder: Path, shape: tuple[int, int], uid: str, name: str = "scout.dcm") -> Path:
    """A localizer image (ImageType LOCALIZER, a sagittal plane) in the series `uid`."""
    stored = np.full(shape, 7, dtype=np.int16)
    ds = _slice(stored, np.zeros(3), (0, 1, 0, 0, 0, -1), (1.0, 1.0), uid, "scout", 0.0, 1.0, 1,
                ["ORIGINAL", "PRIMARY", "LOCALIZER"])
    path = folder / name
    ds.save_as(path, enforce_file_format=True)
    return path


def ramp(rows: int, columns: int, slices: int) -> np.ndarray:
    """Stored values that differ in every voxel, so any axis swap or flip shows."""
    return (np.arange(rows * columns * slices).reshape(rows, columns, slices) % 3000).astype(np.int16)


def oblique_orientation(degrees: float = 20.0) -> tuple[float, ...]:
    """Row and column directions rotated about the x and z axes: no axis of the grid is a world axis."""
    a, b = np.deg2rad(degrees), np.deg2rad(degrees / 2)
    rz = np.array([[np.cos(a), -np.sin(a), 0], [np.sin(a), np.cos(a), 0], [0, 0, 1]])
    rx = np.array([[1, 0, 0], [0, np.cos(b), -np.sin(b)], [0, np.sin(b), np.cos(b)]])
    rotation = rx @ rz
    return (*rotation[:, 0], *rotation[:, 1])
