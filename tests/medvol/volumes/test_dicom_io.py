"""DICOM series in: geometry and values against SimpleITK's series reader (GDCM), on pydicom's real CT series and on
series written here (shuffled names, oblique, anisotropic, intercept -1024), and the refusals of what is no volume."""

from __future__ import annotations

import logging
import shutil
from pathlib import Path

import nibabel as nib
import numpy as np
import pydicom
import pytest
from monai.transforms import LoadImaged

from medvol.core.errors import MedvolError
from medvol.volumes.dicom_io import read_series, series_geometry
from medvol.volumes.volume_reader import LoadVolumed, volume_grid
from tests.dicom_series import CT5N, oblique_orientation, pydicom_file, ramp, write_localizer, write_series


def sitk_reference(folder: Path, uid: str = "") -> tuple[np.ndarray, np.ndarray]:
    """SimpleITK's (GDCM's) reading of a series: the (columns, rows, slices) values and the RAS affine."""
    sitk = pytest.importorskip("SimpleITK")
    reader = sitk.ImageSeriesReader()
    reader.SetFileNames(reader.GetGDCMSeriesFileNames(str(folder), uid))
    image = reader.Execute()
    values = sitk.GetArrayFromImage(image).transpose(2, 1, 0).astype(np.float64)
    affine = np.eye(4)
    affine[:3, :3] = np.asarray(image.GetDirection()).reshape(3, 3) * np.asarray(image.GetSpacing())
    affine[:3, 3] = image.GetOrigin()
    return values, np.diag([-1.0, -1.0, 1.0, 1.0]) @ affine


def assert_matches_simpleitk(folder: Path, uid: str = "") -> np.ndarray:
    volume, geometry = read_series(folder, uid or None)
    values, affine = sitk_reference(folder, uid)
    np.testing.assert_allclose(geometry.affine, affine, atol=1e-4)
    np.testing.assert_allclose(volume, values, atol=1e-3)
    return volume


def test_pydicoms_real_ct_series_matches_simpleitk_in_hounsfield_units():
    volume = assert_matches_simpleitk(CT5N)
    assert volume.shape == (16, 16, 5)
    # The lowest slice (z = -1.2375) is file 3353; its stored values minus 1024 are Hounsfield units.
    stored = pydicom.dcmread(CT5N / "3353").pixel_array
    np.testing.assert_array_equal(volume[:, :, 0], stored.T.astype(np.float32) - 1024)


def test_a_shuffled_oblique_anisotropic_series_with_intercept_matches_simpleitk(tmp_path: Path):
    orientation = oblique_orientation(25.0)
    write_series(tmp_path / "s", ramp(6, 5, 7), orientation, spacing=(0.7, 1.3), step=2.9,
                 origin=(-12.5, 30.0, 4.0), intercept=-1024.0, seed=3)
    volume = assert_matches_simpleitk(tmp_path / "s")
    # Stored 0 at the first voxel: -1024 HU; the slice spacing comes from the positions, not SliceThickness (1).
    assert volume[0, 0, 0] == -1024.0
    _, geometry = read_series(tmp_path / "s")
    np.testing.assert_allclose(np.linalg.norm(geometry.affine[:3, :3], axis=0), [1.3, 0.7, 2.9], atol=1e-5)


def test_a_reversed_stack_is_ordered_along_the_normal_not_by_instance_number(tmp_path: Path):
    # The normal of (0,1,0)x(1,0,0) points down: slice k lies lower, so the first position along it is the top slice.
    write_series(tmp_path / "s", ramp(4, 4, 5), (0, 1, 0, 1, 0, 0), step=1.5, slope=2.0, seed=7)
    assert_matches_simpleitk(tmp_path / "s")


def as_series(name: str, folder: Path) -> Path:
    """One of pydicom's compressed files as a one-slice series (the pixel data kept as encoded), with an image
    plane where the file has none."""
    dataset = pydicom.dcmread(pydicom_file(name))
    for keyword, value in (("ImageOrientationPatient", [1, 0, 0, 0, 1, 0]), ("ImagePositionPatient", [0, 0, 0]),
                           ("PixelSpacing", [1, 1])):
        if keyword not in dataset:
            setattr(dataset, keyword, value)
    folder.mkdir()
    dataset.save_as(folder / "slice.dcm")
    return folder


@pytest.mark.parametrize(("name", "tolerance"), [
    ("MR_small_jp2klossless.dcm", 0), ("MR_small_jpeg_ls_lossless.dcm", 0), ("MR_small_RLE.dcm", 0),
    ("693_J2KI.dcm", 0), ("JPEG2000.dcm", 0), ("JPEGLSNearLossless_16.dcm", 0),
    # Lossy JPEG: two decoders may round an inverse DCT differently by one.
    ("JPGExtended.dcm", 1),
])
def test_compressed_transfer_syntaxes_decode_as_gdcm_decodes_them(tmp_path: Path, name: str, tolerance: int):
    sitk = pytest.importorskip("SimpleITK")
    folder = as_series(name, tmp_path / "s")
    volume, _ = read_series(folder)
    reference = sitk.GetArrayFromImage(sitk.ReadImage(str(folder / "slice.dcm"))).astype(np.float64)
    np.testing.assert_allclose(volume[:, :, 0].T, reference.reshape(reference.shape[-2:]), atol=tolerance)


def test_lossless_compressed_slices_decode_to_the_uncompressed_values(tmp_path: Path):
    plain, _ = read_series(as_series("MR_small.dcm", tmp_path / "plain"))
    for name in ("MR_small_jp2klossless.dcm", "MR_small_jpeg_ls_lossless.dcm", "MR_small_RLE.dcm"):
        np.testing.assert_array_equal(read_series(as_series(name, tmp_path / name))[0], plain)


def test_an_undecodable_transfer_syntax_is_refused_in_one_line_naming_it(tmp_path: Path):
    # 12-bit JPEG Extended: neither pylibjpeg nor Pillow decodes it.
    folder = as_series("JPEG-lossy.dcm", tmp_path / "s")
    refused = "transfer syntax JPEG Extended \\(Process 2 and 4\\) \\(1.2.840.10008.1.2.4.51\\)"
    with pytest.raises(MedvolError, match=refused) as refusal:
        read_series(folder)
    assert "\n" not in str(refusal.value)


def test_two_series_in_one_folder_are_listed_and_one_is_chosen_by_uid_or_description(tmp_path: Path):
    first = write_series(tmp_path / "s", ramp(4, 4, 3), description="axial 3mm", seed=1)
    second = write_series(tmp_path / "s", ramp(4, 4, 5) + 100, description="axial 1mm", seed=2)
    with pytest.raises(MedvolError, match="holds 2 DICOM series") as refusal:
        read_series(tmp_path / "s")
    message = str(refusal.value)
    assert f"{first['uid']} ('axial 3mm', 3 slices)" in message
    assert f"{second['uid']} ('axial 1mm', 5 slices)" in message
    assert "\n" not in message
    by_uid, _ = read_series(tmp_path / "s", second["uid"])
    by_description, _ = read_series(tmp_path / "s", "axial 3mm")
    assert by_uid.shape[2] == 5 and by_description.shape[2] == 3
    np.testing.assert_allclose(by_uid, sitk_reference(tmp_path / "s", second["uid"])[0])
    with pytest.raises(MedvolError, match="no series .* match 'sagittal'"):
        read_series(tmp_path / "s", "sagittal")


def test_a_missing_slice_is_refused(tmp_path: Path):
    write_series(tmp_path / "s", ramp(4, 4, 6), step=2.0, skip=(3,))
    with pytest.raises(MedvolError, match="a gap of 4 mm .* where the others are 2 mm apart"):
        read_series(tmp_path / "s")


def test_two_slices_at_one_position_are_refused(tmp_path: Path):
    info = write_series(tmp_path / "s", ramp(4, 4, 3))
    shutil.copy(info["files"][0], tmp_path / "s" / "copy.dcm")
    with pytest.raises(MedvolError, match="at the same position"):
        read_series(tmp_path / "s")


def test_mixed_sizes_and_orientations_are_refused(tmp_path: Path):
    info = write_series(tmp_path / "sizes", ramp(4, 4, 3))
    write_series(tmp_path / "sizes", ramp(5, 4, 1), uid=info["uid"], origin=(0, 0, 9.0))
    with pytest.raises(MedvolError, match="mixed slice sizes"):
        read_series(tmp_path / "sizes")
    info = write_series(tmp_path / "turned", ramp(4, 4, 3))
    write_series(tmp_path / "turned", ramp(4, 4, 1), orientation=(0, 1, 0, 1, 0, 0), uid=info["uid"],
                 origin=(0, 0, 9.0))
    with pytest.raises(MedvolError, match="mixed slice orientations"):
        read_series(tmp_path / "turned")


def test_a_localizer_among_the_slices_is_dropped_with_a_line(tmp_path: Path, caplog: pytest.LogCaptureFixture):
    info = write_series(tmp_path / "s", ramp(4, 4, 4), step=3.0)
    write_localizer(tmp_path / "s", (4, 4), info["uid"])
    with caplog.at_level(logging.WARNING, logger="medvol"):
        volume, geometry = read_series(tmp_path / "s")
    assert volume.shape == (4, 4, 4) and geometry.dropped == (tmp_path / "s" / "scout.dcm",)
    assert "dropped 1 localizer image(s)" in caplog.text
    np.testing.assert_allclose(geometry.affine[2, 2], 3.0)


def test_a_sheared_stack_is_refused(tmp_path: Path):
    info = write_series(tmp_path / "s", ramp(4, 4, 2))
    write_series(tmp_path / "s", ramp(4, 4, 1), uid=info["uid"], origin=(3.0, 0.0, 2.0))
    with pytest.raises(MedvolError, match="shifted within its plane"):
        read_series(tmp_path / "s")


def test_a_series_folder_loads_like_the_same_volume_as_nifti(tmp_path: Path):
    """LoadVolumed on the folder = MONAI's nibabel LoadImaged on SimpleITK's NIfTI export of it (LPS -> RAS by ITK)."""
    sitk = pytest.importorskip("SimpleITK")
    write_series(tmp_path / "s", ramp(6, 5, 4), oblique_orientation(15.0), spacing=(0.8, 1.1), step=2.2,
                 intercept=-1024.0)
    reader = sitk.ImageSeriesReader()
    reader.SetFileNames(reader.GetGDCMSeriesFileNames(str(tmp_path / "s")))
    sitk.WriteImage(sitk.Cast(reader.Execute(), sitk.sitkFloat32), str(tmp_path / "s.nii.gz"))
    ours = LoadVolumed(["image"], image_only=True, ensure_channel_first=True)({"image": str(tmp_path / "s")})["image"]
    theirs = LoadImaged(["image"], reader="NibabelReader", image_only=True, ensure_channel_first=True)(
        {"image": str(tmp_path / "s.nii.gz")})["image"]
    assert ours.shape == theirs.shape == (1, 5, 6, 4)
    np.testing.assert_allclose(ours.numpy(), theirs.numpy(), atol=1e-3)
    np.testing.assert_allclose(np.asarray(ours.affine), np.asarray(theirs.affine), atol=1e-4)
    shape, affine = volume_grid(tmp_path / "s")
    np.testing.assert_allclose(affine, nib.load(str(tmp_path / "s.nii.gz")).affine, atol=1e-4)
    assert shape == (5, 6, 4)


def test_channels_from_two_series_folders_stack(tmp_path: Path):
    write_series(tmp_path / "a", ramp(4, 4, 3))
    write_series(tmp_path / "b", ramp(4, 4, 3) + 5)
    loaded = LoadVolumed(["image"], image_only=True, ensure_channel_first=True)(
        {"image": [str(tmp_path / "a"), str(tmp_path / "b")]})["image"]
    assert loaded.shape == (2, 4, 4, 3)
    np.testing.assert_allclose((loaded[1] - loaded[0]).numpy(), 5.0)


def test_refusals_pass_through_the_monai_loader_as_one_line(tmp_path: Path):
    write_series(tmp_path / "s", ramp(4, 4, 6), skip=(2,))
    with pytest.raises(MedvolError, match="a missing slice"):
        LoadVolumed(["image"], image_only=True)({"image": str(tmp_path / "s")})


def test_the_geometry_needs_no_pixels(tmp_path: Path):
    write_series(tmp_path / "s", ramp(4, 3, 2), spacing=(0.5, 0.25), step=4.0)
    geometry = series_geometry(tmp_path / "s")
    assert geometry.shape == (3, 4, 2)
    np.testing.assert_allclose(np.diag(geometry.affine)[:3], [-0.25, -0.5, 4.0])


def test_a_series_and_a_4d_nifti_stack_as_channels(tmp_path: Path):
    write_series(tmp_path / "s", ramp(4, 5, 3))
    shape, affine = volume_grid(tmp_path / "s")
    two = np.stack([np.full(shape, 1.0), np.full(shape, 2.0)], -1).astype(np.float32)
    nib.save(nib.Nifti1Image(two, affine), str(tmp_path / "two.nii.gz"))
    loaded = LoadVolumed(["image"], image_only=True, ensure_channel_first=True)(
        {"image": [str(tmp_path / "s"), str(tmp_path / "two.nii.gz")]})["image"]
    assert loaded.shape == (3, 5, 4, 3)
    np.testing.assert_allclose(loaded[0].numpy(), read_series(tmp_path / "s")[0])
    assert float(loaded[1].mean()) == 1.0 and float(loaded[2].mean()) == 2.0


def test_a_series_whose_step_changes_is_resampled_onto_an_even_grid_with_a_line(tmp_path: Path, caplog):
    # Six slices 2.5 mm apart, then six 2.74 mm apart: read as even (the mean step), the last slices would lie
    # 0.7 mm from where they were taken; each voxel of the even grid is the linear interpolation of its two
    # neighbouring slices at their true positions (numpy's interp per voxel, the reference).
    positions = np.concatenate([np.arange(6) * 2.5, 12.5 + np.arange(1, 7) * 2.74])
    stored = ramp(3, 4, 12)
    write_series(tmp_path / "s", stored, positions=positions, seed=4)
    with caplog.at_level(logging.WARNING, logger="medvol"):
        volume, geometry = read_series(tmp_path / "s")
    # The even grid spans the series at no coarser a step than its finest: 28.94 mm in 12 steps of 2.412 mm.
    assert "slice steps from 2.5 to 2.74 mm" in caplog.text and "resampled onto 13 even slices 2.412 mm" in caplog.text
    assert geometry.resampled and geometry.shape == (4, 3, 13) and volume.shape == (4, 3, 13)
    step = np.linalg.norm(geometry.affine[:3, 2])
    assert step == pytest.approx(positions[-1] / 12)
    grid = np.arange(13) * step
    values = stored.transpose(1, 0, 2).astype(np.float64)
    expected = np.apply_along_axis(lambda along: np.interp(grid, positions, along), 2, values)
    np.testing.assert_allclose(volume, expected, atol=1e-3)
    # Back on the source slices: the values as stored (the writers take outputs there).
    np.testing.assert_allclose(geometry.on_source_slices(volume, labels=False), values, atol=0.5)
    np.testing.assert_array_equal(geometry.on_source_slices(np.broadcast_to(grid, (4, 3, 13)), labels=True)[0, 0],
                                  grid[np.abs(grid[None, :] - positions[:, None]).argmin(1)])


def test_an_even_series_within_the_tolerance_is_read_as_it_is(tmp_path: Path, caplog):
    positions = np.arange(8) * 2.0 + np.array([0, 0.01, -0.01, 0.02, 0, -0.02, 0.01, 0])
    write_series(tmp_path / "s", ramp(3, 3, 8), positions=positions)
    with caplog.at_level(logging.WARNING, logger="medvol"):
        volume, geometry = read_series(tmp_path / "s")
    assert not geometry.resampled and volume.shape[2] == 8 and "resampled" not in caplog.text


def test_a_multi_frame_object_is_refused_for_what_it_is(tmp_path: Path):
    # pydicom's real RT Dose file: 15 frames, geometry in GridFrameOffsetVector, not in slices.
    (tmp_path / "dose").mkdir()
    shutil.copy(pydicom_file("rtdose.dcm"), tmp_path / "dose" / "rtdose.dcm")
    with pytest.raises(MedvolError, match=r"rtdose\.dcm: a multi-frame RT Dose Storage object \(15 frames\)"):
        read_series(tmp_path / "dose")
    # An Enhanced CT: its orientation lives in functional groups, so the slice attributes are absent.
    info = write_series(tmp_path / "enhanced", ramp(4, 4, 1))
    enhanced = pydicom.dcmread(info["files"][0])
    enhanced.SOPClassUID = "1.2.840.10008.5.1.4.1.1.2.1"
    enhanced.NumberOfFrames = 3
    for keyword in ("ImageOrientationPatient", "ImagePositionPatient"):
        delattr(enhanced, keyword)
    enhanced.save_as(info["files"][0])
    with pytest.raises(MedvolError, match=r"a multi-frame Enhanced CT Image Storage object \(3 frames\); medvol reads"):
        read_series(tmp_path / "enhanced")


def test_a_series_whose_headers_promise_more_than_the_memory_budget_is_refused_before_its_pixels(tmp_path, monkeypatch):
    info = write_series(tmp_path / "s", ramp(4, 4, 3))
    for path in info["files"]:
        header = pydicom.dcmread(path)
        header.Rows = header.Columns = 65535
        header.save_as(path)
    decoded = []
    monkeypatch.setattr(pydicom.dataset.Dataset, "pixel_array", property(lambda _: decoded.append(1)))
    with pytest.raises(MedvolError, match=r"its headers promise 65535x65535x3 = 1\.29e\+10 voxels .*refused before"):
        read_series(tmp_path / "s")
    assert not decoded
