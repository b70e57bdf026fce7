"""DICOM radiographs (CR, DX) read for X-ray-to-CT: PatientOrientation and the pixel spacing give the affine, so a
film reads as the NIfTI view of the same pixels and orientation does (nibabel's reading is the reference); stored
values over their range, MONOCHROME1 inverted; each refusal one line naming the file."""

from __future__ import annotations

from pathlib import Path

import nibabel as nib
import numpy as np
import pydicom
import pytest
from pydicom.dataset import Dataset, FileDataset, FileMetaDataset
from pydicom.uid import ExplicitVRLittleEndian, generate_uid

from datamodules.sources.example_data import write_xray_ct
from medvol.core.errors import MedvolError
from medvol.run.radiographs import ViewGeometry, model_views, radiograph_subjects, read_view
from medvol.volumes.dicom_radiograph import read_radiograph

# The example writer's geometry: 16^3 voxels of 12 mm (a 192 mm field of view), 16 x 16 views of 12 mm pixels.
GEOMETRY = ViewGeometry(["ap", "lateral"], (16, 16), (16, 16, 16), (12.0, 12.0, 12.0), (-1.0, 1.0))
DX_STORAGE = "1.2.840.10008.5.1.4.1.1.1.1"
# RAS unit vectors written by hand as DICOM's letters (DICOM's L is RAS's -x, P is -y, F is -z).
LETTER = {(0, 1): "R", (0, -1): "L", (1, 1): "A", (1, -1): "P", (2, 1): "H", (2, -1): "F"}
STEP = 1.0 / 65535


@pytest.fixture(scope="module")
def example(tmp_path_factory):
    return write_xray_ct(tmp_path_factory.mktemp("xr"), 1, size=16, field_of_view=192.0, xray_size=(16, 16))


def _letters(column: np.ndarray) -> str:
    axis = int(np.argmax(np.abs(column)))
    return LETTER[(axis, int(np.sign(column[axis])))]


def write_dx(path: Path, stored: np.ndarray, orientation: list[str] | None, *, bits: int = 16, signed: bool = False,
             photometric: str = "MONOCHROME2", pixel_spacing=None, imager_spacing=(12.0, 12.0),
             magnification: float | None = None, modality: str = "DX", frames: int | None = None) -> Path:
    """A DX file as a detector writes one: no position, PatientOrientation (row direction, column direction)."""
    meta = FileMetaDataset()
    meta.MediaStorageSOPClassUID, meta.MediaStorageSOPInstanceUID = DX_STORAGE, generate_uid()
    meta.TransferSyntaxUID = ExplicitVRLittleEndian
    ds = FileDataset("", Dataset(), file_meta=meta, preamble=b"\0" * 128)
    ds.SOPClassUID, ds.SOPInstanceUID = DX_STORAGE, meta.MediaStorageSOPInstanceUID
    ds.StudyInstanceUID, ds.SeriesInstanceUID, ds.Modality = generate_uid(), generate_uid(), modality
    if orientation is not None:
        ds.PatientOrientation = orientation
    if pixel_spacing is not None:
        ds.PixelSpacing = [f"{v:g}" for v in pixel_spacing]
    if imager_spacing is not None:
        ds.ImagerPixelSpacing = [f"{v:g}" for v in imager_spacing]
    if magnification is not None:
        ds.EstimatedRadiographicMagnificationFactor = f"{magnification:g}"
    if frames is not None:
        ds.NumberOfFrames = frames
    ds.Rows, ds.Columns = stored.shape
    ds.SamplesPerPixel, ds.PhotometricInterpretation = 1, photometric
    ds.BitsAllocated, ds.BitsStored, ds.HighBit, ds.PixelRepresentation = 16, bits, bits - 1, int(signed)
    ds.PixelData = np.ascontiguousarray(stored.astype("<i2" if signed else "<u2")).tobytes()
    ds.save_as(path, enforce_file_format=True)
    return path


def as_dx(nifti: Path, dicom: Path, **kwargs) -> Path:
    """The NIfTI view's pixels as 16-bit stored values, its affine's directions as PatientOrientation."""
    image = nib.load(str(nifti))
    pixels = np.asarray(image.dataobj, dtype=np.float64).reshape(16, 16)
    orientation = [_letters(image.affine[:3, 1]), _letters(image.affine[:3, 0])]
    return write_dx(dicom, np.round(pixels * 65535), orientation, **kwargs)


@pytest.mark.parametrize("view", ["ap", "lateral"])
def test_a_dx_film_reads_as_the_nifti_view_of_the_same_pixels(example, tmp_path, view):
    nifti = example / f"phantom-0-0000_{view}.nii.gz"
    dicom = as_dx(nifti, tmp_path / f"case_{view}.dcm")
    assert pydicom.dcmread(dicom).PatientOrientation == (["L", "F"] if view == "ap" else ["P", "F"])
    np.testing.assert_allclose(read_view(dicom, view, GEOMETRY), read_view(nifti, view, GEOMETRY), atol=STEP)


def test_a_pa_film_stored_as_seen_from_behind_is_mirrored_into_the_ap_frame(example, tmp_path):
    ap = read_view(example / "phantom-0-0000_ap.nii.gz", "ap", GEOMETRY)
    # Seen from behind: the columns run toward the patient's right, the pixels mirrored left-right.
    dicom = write_dx(tmp_path / "case_ap.dcm", np.round(ap[:, ::-1] * 65535), ["R", "F"])
    np.testing.assert_allclose(read_view(dicom, "ap", GEOMETRY), ap, atol=STEP)
    assert not np.allclose(read_radiograph(dicom).pixels, ap, atol=1e-3)


def test_monochrome1_is_inverted_and_a_signed_12_bit_range_is_scaled_to_0_1(example, tmp_path):
    ap = read_view(example / "phantom-0-0000_ap.nii.gz", "ap", GEOMETRY)
    inverted = write_dx(tmp_path / "m1.dcm", np.round((1.0 - ap) * 65535), ["L", "F"], photometric="MONOCHROME1")
    np.testing.assert_allclose(read_view(inverted, "ap", GEOMETRY), ap, atol=STEP)
    # 12 bits, signed: stored -2048 is 0, 2047 is 1 (4095 steps), by hand.
    stored = np.array([[-2048, 0], [1, 2047]])
    signed = write_dx(tmp_path / "s.dcm", stored, ["L", "F"], bits=12, signed=True)
    np.testing.assert_allclose(read_radiograph(signed).pixels, [[0.0, 2048 / 4095], [2049 / 4095, 1.0]], atol=1e-7)


def test_the_patient_plane_spacing_is_pixel_spacing_or_the_detectors_over_the_magnification(tmp_path):
    stored = np.zeros((4, 6))
    magnified = write_dx(tmp_path / "a.dcm", stored, ["L", "F"], imager_spacing=(0.15, 0.18), magnification=1.2)
    np.testing.assert_allclose(np.linalg.norm(read_radiograph(magnified).affine[:3, :2], axis=0), [0.125, 0.15])
    calibrated = write_dx(tmp_path / "b.dcm", stored, ["L", "F"], pixel_spacing=(0.1, 0.2), magnification=1.2)
    np.testing.assert_allclose(np.linalg.norm(read_radiograph(calibrated).affine[:3, :2], axis=0), [0.1, 0.2])
    # Rows run to the feet (-z), columns to the patient's left (-x): the affine's columns, by hand.
    np.testing.assert_allclose(read_radiograph(calibrated).affine[:3, :2], [[0, -0.2], [0, 0], [-0.1, 0]])


def test_a_folder_of_dicom_films_gives_the_views_its_nifti_twin_gives(example, tmp_path):
    films = tmp_path / "films"
    films.mkdir()
    for view in ("ap", "lateral"):
        as_dx(example / f"phantom-0-0000_{view}.nii.gz", films / f"case7_{view}.dcm")
    (films / "notes.txt").write_text("not a view")
    assert radiograph_subjects(films, GEOMETRY) == {"case7": {v: films / f"case7_{v}.dcm" for v in ("ap", "lateral")}}
    torch_views = model_views(films, GEOMETRY)["case7"].numpy()
    np.testing.assert_allclose(torch_views, model_views(example, GEOMETRY)["phantom-0-0000"].numpy(), atol=3 * STEP)
    nib.save(nib.load(str(example / "phantom-0-0000_ap.nii.gz")), str(films / "case7_ap.nii.gz"))
    with pytest.raises(MedvolError, match="subject case7 has two ap views"):
        radiograph_subjects(films, GEOMETRY)


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"orientation": None}, r"a\.dcm has no PatientOrientation"),
    ({"orientation": ["LF", "F"]}, "obliquely"),
    ({"orientation": ["X", "F"]}, "PatientOrientation's row direction is 'X'"),
    ({"modality": "CT"}, r"a\.dcm is a DICOM of modality CT; radiographs are read from CR or DX"),
    ({"frames": 3}, "a multi-frame"),
    ({"imager_spacing": None}, "neither PixelSpacing nor ImagerPixelSpacing"),
])
def test_what_is_not_a_readable_radiograph_is_one_line_naming_the_file(tmp_path, kwargs, message):
    kwargs = {"orientation": ["L", "F"], **kwargs}
    path = write_dx(tmp_path / "a.dcm", np.zeros((16, 16)), kwargs.pop("orientation"), **kwargs)
    with pytest.raises(MedvolError, match=message) as caught:
        read_view(path, "ap", GEOMETRY)
    assert "\n" not in str(caught.value)
