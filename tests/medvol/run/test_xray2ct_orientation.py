"""A radiograph's orientation comes from its file: turned (and mirrored: a PA film) into the projector's frame when its
header says how it was stored, refused with one line when it has none or lies in another plane than its name says;
its values must be the model's 1 - I/I0 in [0, 1]."""

from __future__ import annotations

import nibabel as nib
import numpy as np
import pytest

from datamodules.sources.example_data import write_xray_ct
from datamodules.sources.synthetic import phantom_radiographs
from medvol.core.errors import MedvolError
from medvol.run.radiographs import ViewGeometry, read_view

# The example writer's geometry: 16^3 voxels of 12 mm (a 192 mm field of view), 16 x 16 views.
GEOMETRY = ViewGeometry(["ap", "lateral"], (16, 16), (16, 16, 16), (12.0, 12.0, 12.0), (-1.0, 1.0))


@pytest.fixture(scope="module")
def example(tmp_path_factory):
    return write_xray_ct(tmp_path_factory.mktemp("xr"), 1, size=16, field_of_view=192.0, xray_size=(16, 16))


def _restored(example, tmp_path, view: str, pixels, index_map: np.ndarray, name: str | None = None):
    """The example `view` stored otherwise: `pixels(data)`, with an affine still true to the patient (old = map @
    new)."""
    image = nib.load(str(example / f"phantom-0-0000_{view}.nii.gz"))
    data = np.asarray(image.dataobj)
    path = tmp_path / f"phantom-0-0000_{name or view}.nii.gz"
    nib.save(nib.Nifti1Image(np.ascontiguousarray(pixels(data)), image.affine @ index_map), str(path))
    return path


def test_example_radiographs_read_back_as_the_dataset_projects_them(example):
    expected = phantom_radiographs(0, 0, (192.0,) * 3, ["ap", "lateral"], (16, 16), output_range=(0.0, 1.0)).numpy()
    for index, view in enumerate(("ap", "lateral")):
        read = read_view(example / f"phantom-0-0000_{view}.nii.gz", view, GEOMETRY)
        np.testing.assert_allclose(read, expected[index], atol=1e-6)


def test_a_view_stored_turned_a_quarter_with_a_true_header_reads_as_stored_upright(example, tmp_path):
    upright = read_view(example / "phantom-0-0000_ap.nii.gz", "ap", GEOMETRY)
    # np.rot90: new[i, j] = old[j, 15 - i], so old (row, column) = (j, 15 - i).
    quarter = np.array([[0, 1, 0, 0], [-1, 0, 0, 15], [0, 0, 1, 0], [0, 0, 0, 1]], dtype=float)
    path = _restored(example, tmp_path, "ap", np.rot90, quarter)
    np.testing.assert_array_equal(read_view(path, "ap", GEOMETRY), upright)
    half = np.array([[-1, 0, 0, 15], [0, -1, 0, 15], [0, 0, 1, 0], [0, 0, 0, 1]], dtype=float)
    path = _restored(example, tmp_path, "ap", lambda d: d[::-1, ::-1], half)
    np.testing.assert_array_equal(read_view(path, "ap", GEOMETRY), upright)


def test_a_pa_film_seen_from_behind_reads_as_the_ap_view_of_the_same_phantom(tmp_path):
    # 16^3 CT and 16 x 16 views of it at its own grid (xray_grid 16): the AP view is the projector's line integral
    # of this very CT, no resampling between.
    example = write_xray_ct(tmp_path / "xr", 1, size=16, field_of_view=192.0, xray_size=(16, 16), xray_grid=16)
    ct = nib.load(str(example / "phantom-0-0000_ct.nii.gz"))
    hounsfield, spacing = np.asarray(ct.dataobj, dtype=np.float64), 12.0
    # The PA film written out: the beam from back to front, the film seen from behind, so the patient's right is on
    # the viewer's right: rows from the head (z down), columns from the patient's left to right (x up).
    attenuation = 0.02 * np.clip(1.0 + hounsfield / 1000.0, 0.0, None)
    pa = (1.0 - np.exp(-attenuation.sum(axis=1) * spacing)).T[::-1, :]  # (x, z) -> rows z from the top, columns x
    affine = np.zeros((4, 4))
    affine[2, 0], affine[0, 1], affine[1, 2], affine[3, 3] = -spacing, spacing, 1.0, 1.0
    affine[:3, 3] = [-7.5 * spacing, 0.0, 7.5 * spacing]  # pixel (0, 0): the head, the patient's left
    nib.save(nib.Nifti1Image(np.ascontiguousarray(pa, dtype=np.float32), affine), str(tmp_path / "case_pa_ap.nii.gz"))
    read = read_view(tmp_path / "case_pa_ap.nii.gz", "ap", GEOMETRY)
    np.testing.assert_allclose(read, read_view(example / "phantom-0-0000_ap.nii.gz", "ap", GEOMETRY), atol=1e-5)
    # The same film as the file stores it is the AP view mirrored left-right: that is what had been refused.
    assert not np.allclose(pa, read, atol=1e-3)


def test_a_right_lateral_reads_as_the_left_one_mirrored(example, tmp_path):
    # Columns reversed, the header following: the face on the viewer's right (seen from the patient's right).
    mirror = np.array([[1, 0, 0, 0], [0, -1, 0, 15], [0, 0, 1, 0], [0, 0, 0, 1]], dtype=float)
    path = _restored(example, tmp_path, "lateral", lambda d: d[:, ::-1], mirror)
    np.testing.assert_array_equal(read_view(path, "lateral", GEOMETRY),
                                  read_view(example / "phantom-0-0000_lateral.nii.gz", "lateral", GEOMETRY))


def test_views_outside_the_models_range_are_refused_naming_the_file_and_its_values(example, tmp_path):
    image = nib.load(str(example / "phantom-0-0000_ap.nii.gz"))
    counts = np.round(np.asarray(image.dataobj) * 4095).astype(np.uint16)  # a 12-bit detector image
    nib.save(nib.Nifti1Image(counts, image.affine), str(tmp_path / "raw_ap.nii.gz"))
    with pytest.raises(MedvolError, match=r"raw_ap.nii.gz holds values 66\.\.4004 \(stored as uint16.*1 - I/I0 in "
                                          r"\[0, 1\]") as refused:
        read_view(tmp_path / "raw_ap.nii.gz", "ap", GEOMETRY)
    assert "\n" not in str(refused.value)
    broken = np.asarray(image.dataobj, dtype=np.float32).copy()
    broken[3, 4] = np.nan
    nib.save(nib.Nifti1Image(broken, image.affine), str(tmp_path / "nan_ap.nii.gz"))
    with pytest.raises(MedvolError, match=r"nan_ap.nii.gz holds values .* and NaN or Inf"):
        read_view(tmp_path / "nan_ap.nii.gz", "ap", GEOMETRY)


def test_a_lateral_labelled_ap_is_refused(example, tmp_path):
    path = _restored(example, tmp_path, "lateral", lambda d: d, np.eye(4), name="ap")
    with pytest.raises(MedvolError, match="named a ap view but its orientation puts it in the sagittal"):
        read_view(path, "ap", GEOMETRY)


def test_a_view_without_orientation_is_refused(example, tmp_path):
    image = nib.load(str(example / "phantom-0-0000_ap.nii.gz"))
    bare = nib.Nifti1Image(np.asarray(image.dataobj), None)
    bare.header.set_sform(None, code=0)
    bare.header.set_qform(None, code=0)
    nib.save(bare, str(tmp_path / "bare_ap.nii.gz"))
    with pytest.raises(MedvolError, match="has no orientation"):
        read_view(tmp_path / "bare_ap.nii.gz", "ap", GEOMETRY)
