"""DICOM out on its own: a derived series and a DICOM-SEG on the source slices, read back by SimpleITK and highdicom."""

from __future__ import annotations

from pathlib import Path

import highdicom as hd
import numpy as np
import pydicom
import pytest
import SimpleITK as sitk

from medvol.core.errors import MedvolError
from medvol.volumes.dicom_io import series_geometry
from medvol.volumes.dicom_write import write_derived_series, write_segmentation
from tests.dicom_series import oblique_orientation, ramp, write_series


@pytest.fixture
def source(tmp_path: Path):
    write_series(tmp_path / "src", ramp(6, 5, 4), oblique_orientation(15.0), spacing=(0.8, 1.2), step=2.5,
                 intercept=-1024.0, seed=2)
    return series_geometry(tmp_path / "src")


def sitk_series(folder: Path) -> tuple[np.ndarray, sitk.Image]:
    reader = sitk.ImageSeriesReader()
    reader.SetFileNames(reader.GetGDCMSeriesFileNames(str(folder)))
    image = reader.Execute()
    return sitk.GetArrayFromImage(image).transpose(2, 1, 0).astype(np.float64), image


def test_a_derived_series_holds_the_values_on_the_source_grid_in_a_new_series_of_the_same_study(tmp_path, source):
    volume = np.linspace(-1000.0, 2500.0, int(np.prod(source.shape))).reshape(source.shape)
    write_derived_series(volume, source, tmp_path / "out", "medvol test")
    values, image = sitk_series(tmp_path / "out")
    _, reference = sitk_series(tmp_path / "src")
    slope = float(pydicom.dcmread(next((tmp_path / "out").iterdir())).RescaleSlope)
    np.testing.assert_allclose(values, volume, atol=slope / 2 + 1e-6)
    np.testing.assert_allclose(image.GetOrigin(), reference.GetOrigin(), atol=1e-4)
    np.testing.assert_allclose(image.GetDirection(), reference.GetDirection(), atol=1e-6)
    np.testing.assert_allclose(image.GetSpacing(), reference.GetSpacing(), atol=1e-4)
    made, first = pydicom.dcmread(next((tmp_path / "out").iterdir())), source.slices[0].header
    assert made.SeriesInstanceUID != first.SeriesInstanceUID and "DERIVED" in list(made.ImageType)
    assert (made.StudyInstanceUID, made.FrameOfReferenceUID) == (first.StudyInstanceUID, first.FrameOfReferenceUID)


def test_a_derived_series_never_goes_into_a_folder_that_holds_files_or_off_the_source_grid(tmp_path, source):
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "mine.dcm").write_bytes(b"the user's")
    with pytest.raises(MedvolError, match="already holds files"):
        write_derived_series(np.zeros(source.shape), source, tmp_path / "taken", "x")
    assert (tmp_path / "taken" / "mine.dcm").read_bytes() == b"the user's"
    with pytest.raises(MedvolError, match="must lie on the source slices"):
        write_derived_series(np.zeros((2, 2, 2)), source, tmp_path / "new", "x")


def test_a_segmentation_read_back_gives_each_segment_on_its_source_slices_and_omits_empty_frames(tmp_path, source):
    mask = np.zeros(source.shape, dtype=np.int64)
    mask[1:4, 1:3, 1] = 1
    mask[2, 2, 2] = 2
    path = write_segmentation(mask, source, tmp_path / "seg.dcm", {"whole": [1, 2], "core": [2]}, "medvol seg")
    seg = hd.seg.segread(path)
    assert [s.SegmentLabel for s in seg.SegmentSequence] == ["whole", "core"]
    instances = [str(item.header.SOPInstanceUID) for item in source.slices]
    frames = seg.get_pixels_by_source_instance(source_sop_instance_uids=instances, segment_numbers=[1, 2])
    # frames: (slices, rows, columns, segments); the mask is (columns, rows, slices).
    np.testing.assert_array_equal(frames[..., 0] > 0, np.isin(mask, [1, 2]).transpose(2, 1, 0))
    np.testing.assert_array_equal(frames[..., 1] > 0, (mask == 2).transpose(2, 1, 0))
    assert seg.NumberOfFrames == 2 + 1
    with pytest.raises(MedvolError, match="must lie on the source slices"):
        write_segmentation(mask[:, :, :2], source, tmp_path / "bad.dcm", {"whole": [1]}, "x")
