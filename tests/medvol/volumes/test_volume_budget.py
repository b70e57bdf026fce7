"""Inputs cannot exhaust the machine: what a header promises is checked before a voxel is allocated."""

from __future__ import annotations

import gzip
import logging
from pathlib import Path

import nibabel as nib
import numpy as np
import pytest
from monai.transforms import Compose, Orientationd, Spacingd

from datamodules.pipeline.check import check_record
from medvol.core.errors import MedvolError
from medvol.run.predict_inputs import input_files
from medvol.volumes.dicom_io import list_series
from medvol.volumes.volume_budget import (
    BUDGET_ENV,
    GIB,
    RESAMPLE_CHANNEL_BYTES,
    RESAMPLE_GRID_BYTES,
    check_resampled_size,
    load_nifti,
    machine_memory_bytes,
    read_dtype,
    resampled_shape,
    volume_budget_bytes,
)
from medvol.volumes.volume_reader import LoadVolumed, volume_grid
from tests.dicom_series import ramp, write_series


def promising_header(path: Path, shape: tuple[int, ...], dtype=np.int16) -> Path:
    """A .nii whose header promises `shape` voxels, followed by a few bytes only (a crafted or corrupt file)."""
    header = nib.Nifti1Header()
    header.set_data_shape(shape)
    header.set_data_dtype(dtype)
    header.set_qform(np.eye(4), code=1)
    with path.open("wb") as handle:
        handle.write(header.binaryblock)
        handle.write(b"\0" * (int(header.get_data_offset()) - len(header.binaryblock) + 64))
    return path


def test_the_budget_is_a_quarter_of_the_memory_unless_set(monkeypatch):
    monkeypatch.delenv(BUDGET_ENV, raising=False)
    assert volume_budget_bytes() == machine_memory_bytes() // 4
    monkeypatch.setenv(BUDGET_ENV, "0.5")
    assert volume_budget_bytes() == GIB // 2
    monkeypatch.setenv(BUDGET_ENV, "lots")
    with pytest.raises(MedvolError, match=rf"`{BUDGET_ENV}` is 'lots'; expected a positive number of GiB"):
        volume_budget_bytes()


def test_a_header_of_10_to_the_12_voxels_is_refused_by_every_reader_before_anything_is_allocated(tmp_path):
    path = promising_header(tmp_path / "huge.nii", (10_000, 10_000, 10_000))
    # Each voxel as read (int16: 2 bytes) and as float32 (4): 6e12 bytes.
    expected = (
        r"huge\.nii: its header promises 10000x10000x10000 = 1e\+12 voxels "
        r"\(5\.59e\+03 GiB as int16 read and as float32\)"
    )
    for read in (load_nifti, volume_grid, lambda p: LoadVolumed(["image"])({"image": str(p)})):
        with pytest.raises(MedvolError, match=expected) as refused:
            read(path)
        assert "\n" not in str(refused.value)
    problems = check_record({"subject": "s1", "files": {"ct": str(path)}}, None, full=True)
    assert [p.problem.split(":")[0] for p in problems] == ["too large"]


def test_a_volume_within_the_budget_reads_and_the_same_one_over_a_smaller_budget_does_not(tmp_path, monkeypatch):
    path = tmp_path / "ok.nii.gz"
    nib.save(nib.Nifti1Image(np.ones((16, 16, 16), np.float32), np.eye(4)), str(path))
    assert load_nifti(path).shape == (16, 16, 16)
    monkeypatch.setenv(BUDGET_ENV, str(16**3 * 4 / GIB * 0.99))
    with pytest.raises(MedvolError, match="more than one volume may take here"):
        load_nifti(path)


def test_the_data_doctor_inflates_a_gzip_stream_no_further_than_its_header_promises(tmp_path, monkeypatch):
    # A modest 16^3 header in front of a stream that inflates to 64 MiB more (a gzip bomb's shape, scaled down);
    # its trailer does not match the header, so the doctor reads the stream to check for truncation.
    image = nib.Nifti1Image(np.zeros((16, 16, 16), np.float32), np.eye(4))
    plain = tmp_path / "x.nii"
    nib.save(image, str(plain))
    path = tmp_path / "bomb.nii.gz"
    with gzip.open(path, "wb") as handle:
        handle.write(plain.read_bytes())
        for _ in range(64):
            handle.write(b"\0" * (1 << 20))
    inflated = []
    read = gzip.GzipFile.read

    def counting(self, size=-1):
        chunk = read(self, size)
        inflated.append(len(chunk))
        return chunk

    monkeypatch.setattr(gzip.GzipFile, "read", counting)
    check_record({"subject": "s1", "files": {"ct": str(path)}}, None, full=False)
    assert 0 < sum(inflated) <= 3 * plain.stat().st_size  # the header and the voxels, read twice at most


def test_other_files_in_an_input_folder_are_counted_and_skipped_unread(tmp_path, caplog):
    scans = tmp_path / "scans"
    scans.mkdir()
    nib.save(nib.Nifti1Image(np.zeros((4, 4, 4), np.float32), np.eye(4)), str(scans / "p1.nii.gz"))
    for k in range(1500):
        (scans / f"report{k}.txt").write_bytes(b"x" * 100)
    series = tmp_path / "series"
    write_series(series, ramp(4, 4, 3))
    for k in range(300):
        (series / f"thumb{k}.jpg").write_bytes(b"\xff\xd8" * 2000)
    opened: list[int] = []
    original = Path.open

    def spy(self, mode="r", *args, **kwargs):
        handle = original(self, mode, *args, **kwargs)
        if self.suffix in (".txt", ".jpg"):
            read = handle.read
            handle.read = lambda size=-1: opened.append(size) or read(size)  # type: ignore[method-assign]
        return handle

    with caplog.at_level(logging.INFO, logger="medvol"):
        assert input_files(scans) == [scans / "p1.nii.gz"]
        Path.open = spy  # type: ignore[method-assign]
        try:
            assert len(list_series(series)[next(iter(list_series(series)))]) == 3
        finally:
            Path.open = original  # type: ignore[method-assign]
    assert "1500 file(s) that are not .nii/.nii.gz skipped" in caplog.text
    assert "300 file(s) that are not DICOM skipped" in caplog.text
    # Each non-DICOM file is told apart by its first 132 bytes, never read whole.
    assert opened and max(opened) == 132


@pytest.mark.parametrize(("affine", "spacing", "orientation"), [
    (np.diag([1.2, 0.9, 2.5, 1.0]), [1.0, 1.0, 1.0], "RAS"),
    (np.array([[-1.2, 0, 0, 30.0], [0, -0.9, 0, 21.0], [0, 0, 2.5, -40.0], [0, 0, 0, 1]]), [0.7, 1.3, 2.0], "RAS"),
    (np.array([[0, 0, 2.0, 0], [-0.8, 0, 0, 0], [0, 1.1, 0, 0], [0, 0, 0, 1]]), [0.5, 1.0, 3.0], "RAS"),
    (np.array([[0.9, -0.4, 0, 0], [0.4, 0.9, 0, 0], [0, 0, 1.5, 0], [0, 0, 0, 1]]), [0.6, 0.6, 1.0], None),
], ids=["isotropic-target", "lps", "permuted", "oblique"])
def test_the_resampled_grid_is_the_one_monais_orientation_and_spacing_make(tmp_path, affine, spacing, orientation):
    path = tmp_path / "scan.nii.gz"
    nib.save(nib.Nifti1Image(np.zeros((13, 17, 11), np.float32), affine), str(path))
    chain = [LoadVolumed(["image"], ensure_channel_first=True, image_only=True)]
    chain += [Orientationd(["image"], axcodes=orientation, labels=None)] if orientation else []
    made = Compose([*chain, Spacingd(["image"], pixdim=spacing)])({"image": str(path)})["image"]
    assert resampled_shape((13, 17, 11), affine, spacing, orientation) == tuple(made.shape[1:])


def test_a_grid_resampled_past_the_budget_is_refused_at_what_monais_spacing_holds_per_voxel(tmp_path, monkeypatch):
    # 10^3 voxels of 10 mm at 1 mm: 91^3 (MONAI's rounding of the corners' extent), 64 + 16 bytes each.
    grid = 91**3 * (RESAMPLE_GRID_BYTES + RESAMPLE_CHANNEL_BYTES)
    monkeypatch.setenv(BUDGET_ENV, str(grid / GIB))
    check_resampled_size("scan", (10, 10, 10), np.diag([10.0, 10.0, 10.0, 1.0]), [1.0, 1.0, 1.0], None)
    monkeypatch.setenv(BUDGET_ENV, str((grid - 1) / GIB))
    with pytest.raises(MedvolError, match=r"^scan: resampled from 10x10x10 mm voxels to 1x1x1 mm it becomes "
                                          r"91x91x91 = 7\.54e\+05 voxels \(0\.0561 GiB while resampled\)"):
        check_resampled_size("scan", (10, 10, 10), np.diag([10.0, 10.0, 10.0, 1.0]), [1.0, 1.0, 1.0], None)
    with pytest.raises(MedvolError, match=r"91x91x91 x 2 channels"):
        check_resampled_size("scan", (10, 10, 10, 2), np.diag([10.0, 10.0, 10.0, 1.0]), [1.0, 1.0, 1.0], None)


@pytest.mark.parametrize(("dtype", "scaled", "held"), [
    (np.uint8, False, 1), (np.int16, False, 2), (np.int16, True, 8), (np.float32, False, 4), (np.float32, True, 8),
    (np.float64, False, 8), (np.int64, False, 8),
])
def test_a_nifti_is_counted_at_the_dtype_nibabel_hands_its_voxels_over_in(tmp_path, dtype, scaled, held):
    image = nib.Nifti1Image(np.ones((4, 4, 4), dtype), np.eye(4), dtype=dtype)
    if scaled:
        image.header.set_slope_inter(2.0, 1.0)
    nib.save(image, str(tmp_path / "v.nii"))
    loaded = nib.load(str(tmp_path / "v.nii"))
    # nibabel's own answer: the dtype of the array it reads.
    assert np.asanyarray(loaded.dataobj).dtype.itemsize == held
    assert read_dtype("v.nii", loaded).itemsize == held


def test_complex_and_rgb_voxels_are_refused_for_what_they_are(tmp_path):
    for name, data in (("c", np.ones((4, 4, 4), np.complex64)),
                       ("rgb", np.ones((4, 4, 4), [("R", "u1"), ("G", "u1"), ("B", "u1")]))):
        nib.save(nib.Nifti1Image(data, np.eye(4), dtype=data.dtype), str(tmp_path / f"{name}.nii"))
        with pytest.raises(MedvolError, match=rf"{name}\.nii: its voxels are (complex64 \(complex\)|RGB \(RGB\)); "):
            load_nifti(tmp_path / f"{name}.nii")
