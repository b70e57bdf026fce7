"""A radiograph's orientation comes from its file: turned into the projector's frame when its header says how it was
stored, refused with one line when it has none, lies in another plane than its name says, or is mirrored."""

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


def test_a_mirrored_view_is_refused(example, tmp_path):
    # Columns reversed, the header following: the patient's right on the viewer's right (seen from behind).
    mirror = np.array([[1, 0, 0, 0], [0, -1, 0, 15], [0, 0, 1, 0], [0, 0, 0, 1]], dtype=float)
    path = _restored(example, tmp_path, "ap", lambda d: d[:, ::-1], mirror)
    with pytest.raises(MedvolError, match="is mirrored for a ap view .*columns toward the right"):
        read_view(path, "ap", GEOMETRY)


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
