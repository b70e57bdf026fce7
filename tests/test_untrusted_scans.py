"""Scans a model cannot take are one line (issue 59, routes 14-15; issue 63, item 8): a NIfTI whose body is shorter
than its header says, a 2D or one-slice file, a volume smaller than the model takes once resampled, and NaN or inf in
the geometry of a NIfTI header or a DICOM series. Each is refused by predict before the first output, with the line
the data doctor gives for the same file (one check per fact, `medvol.volumes.scan_checks`)."""

from __future__ import annotations

import gzip
import struct
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import nibabel as nib
import numpy as np
import pydicom
import pytest
import torch
from torchmetrics.functional.image import structural_similarity_index_measure

from datamodules.pipeline.check import check_record
from medvol.run.predict_job import smallest_input
from medvol.run.predicting import predict
from tests.conftest import ROOT, subprocess_env
from tests.dicom_series import ramp, write_series
from tests.medvol.run.test_predict import predict_cfg
from tests.test_untrusted_sizes import one_line_refusal, phantom_run, scan  # noqa: F401 - a fixture

# Byte offsets in a NIfTI-1 header: pixdim[1] (the first voxel size), srow_x[0], qform_code and sform_code.
PIXDIM_X, SROW_X, QFORM_CODE, SFORM_CODE = 80, 280, 252, 254
# The least the phantom run's VQ-GAN takes: its per-subject SSIM (ssim_kernel_size 5, tests/conftest.py's tiny VQ-GAN).
SMALLEST = (6, 6, 7)
LEAST = "x".join(map(str, SMALLEST))
TRUNCATED = "truncated: the file ends before all its voxels (re-copy or re-export it)"


def predicted(run: Path, source: Path, out: Path) -> str:
    """The one line predict refuses `source` with; nothing written."""
    line = one_line_refusal(
        predict, predict_cfg(f"ckpt_path={run}/checkpoints/last.ckpt", f"input={source}", f"output_dir={out}")
    )
    assert not out.exists()
    return line


def doctor(path: Path) -> list[str]:
    """What the data doctor (check_data.py's check of one subject, headers only) says of `path`."""
    return [p.problem for p in check_record({"subject": "s", "files": {"image": str(path)}}, None, full=False)]


def cut(path: Path) -> Path:
    """`path` cut to half its bytes: a download that stopped."""
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    return path


def patched_header(path: Path, *changes: tuple[int, str, float]) -> Path:
    """A 16^3 6 mm scan whose header bytes at (offset, struct format, value) are overwritten: what no writer makes."""
    image = nib.Nifti1Image(np.zeros((16, 16, 16), np.int16), np.diag([6.0, 6.0, 6.0, 1.0]))
    raw = bytearray(image.to_bytes())
    for offset, form, value in changes:
        struct.pack_into(form, raw, offset, value)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(gzip.compress(bytes(raw)))
    return path


# ---- route 14: a body shorter than its header, a volume smaller than the model takes --------------------------


@pytest.mark.parametrize("name", ["plain.nii", "packed.nii.gz"])
def test_a_nifti_whose_body_is_shorter_than_its_header_is_refused_as_the_doctor_says(phantom_run, tmp_path, name):  # noqa: F811
    image = cut(scan(tmp_path / "scans" / name))
    assert predicted(phantom_run, image, tmp_path / "out") == f"{image}: {TRUNCATED}"
    assert doctor(image) == [TRUNCATED]


def test_a_volume_smaller_than_the_models_ssim_window_is_refused_naming_both_sizes(phantom_run, tmp_path):  # noqa: F811
    tiny = scan(tmp_path / "scans" / "tiny.nii.gz", (2, 2, 2))
    line = predicted(phantom_run, tiny, tmp_path / "out")
    assert line == (f"{tiny}: 2x2x2 voxels once resampled to 6x6x6 mm (2x2x2 as stored), smaller than the model "
                    f"takes: at least {LEAST} voxels (its per-subject SSIM's 11-voxel Gaussian window, "
                    "ssim_kernel_size 5)")


def test_a_volume_small_once_resampled_to_the_training_spacing_is_refused_and_the_smallest_size_predicts(
    phantom_run, tmp_path  # noqa: F811
):
    # 24x36x36 voxels of 1 mm are 5x7x7 at the model's 6 mm (MONAI counts the corners): short along D.
    # The least it takes predicts.
    fine = scan(tmp_path / "scans" / "fine.nii.gz", (24, 36, 36), (1.0, 1.0, 1.0))
    line = predicted(phantom_run, fine, tmp_path / "out")
    assert f"5x7x7 voxels once resampled to 6x6x6 mm (24x36x36 as stored), smaller than the model takes: " \
        f"at least {LEAST}" in line
    least = scan(tmp_path / "least" / "least.nii.gz", SMALLEST)
    out = tmp_path / "predicted"
    predict(predict_cfg(f"ckpt_path={phantom_run}/checkpoints/last.ckpt", f"input={least}", f"output_dir={out}"))
    assert nib.load(str(out / "least_reconstruction.nii.gz")).shape == SMALLEST


@pytest.mark.parametrize("kernel", [3, 5, 7, 11])
def test_the_smallest_size_is_the_least_torchmetrics_ssim_takes_along_each_axis(kernel):
    sizes, _ = smallest_input(SimpleNamespace(hparams={"ssim_kernel_size": kernel}))

    def scores(shape: tuple[int, ...]) -> bool:
        volume = torch.rand(1, 1, *shape)
        try:
            structural_similarity_index_measure(volume, volume, data_range=2.0, kernel_size=kernel, reduction="none")
        except RuntimeError:
            return False
        return True

    for axis, least in enumerate(sizes):
        shape = [16, 16, 16]
        shape[axis] = least
        assert scores(tuple(shape)), (axis, least)
        shape[axis] = least - 1
        assert not scores(tuple(shape)), (axis, least)
    assert smallest_input(SimpleNamespace(hparams={})) is None


# ---- issue 63, item 8: 2D and one-slice files, at predict as at check_data ---------------------------------------


@pytest.mark.parametrize("shape", [(64, 64), (64, 64, 1), (1, 64, 64, 2)])
def test_a_2d_or_one_slice_file_is_not_a_3d_volume_at_predict_as_at_check_data(phantom_run, tmp_path, shape):  # noqa: F811
    flat = scan(tmp_path / "scans" / "flat.nii.gz", shape)
    line = predicted(phantom_run, flat, tmp_path / "out")
    assert line.startswith(f"{flat}: not a 3D volume: ") and str(shape) in line
    assert doctor(flat) == [line.removeprefix(f"{flat}: ")]


def test_a_one_slice_dicom_series_is_not_a_3d_volume_at_predict_as_at_check_data(phantom_run, tmp_path):  # noqa: F811
    folder = tmp_path / "series"
    write_series(folder, ramp(8, 6, 1))
    line = predicted(phantom_run, folder, tmp_path / "out")
    assert line == f"{folder}: not a 3D volume: a single slice, shape (6, 8, 1)"
    assert doctor(folder) == [line.removeprefix(f"{folder}: ")]


# ---- route 15: NaN and inf in positions, orientations and spacings ---------------------------------------------


@pytest.mark.parametrize(("keyword", "value", "slices"), [
    ("ImagePositionPatient", ["nan", "0", "1"], 3),
    ("ImageOrientationPatient", ["1", "0", "0", "0", "nan", "0"], 3),
    ("PixelSpacing", ["inf", "1"], 3),
    ("SliceThickness", "nan", 1),
])
def test_nan_or_inf_in_a_dicom_series_geometry_is_one_line_naming_the_file_and_attribute(
    phantom_run, tmp_path, keyword, value, slices  # noqa: F811
):
    folder = tmp_path / "series"
    files = write_series(folder, ramp(8, 6, slices))["files"]
    # Every slice for a value the slices must share; one slice's position for a position.
    for path in files[:1] if keyword == "ImagePositionPatient" else files:
        header = pydicom.dcmread(path)
        setattr(header, keyword, value)
        header.save_as(path)
    line = predicted(phantom_run, folder, tmp_path / "out")
    assert line.startswith(f"{folder}/") and f".dcm: {keyword} is " in line and "expected" in line
    assert "finite number" in line
    assert doctor(folder) == [f"DICOM series: {line.removeprefix(f'{folder}: ')}"]


@pytest.mark.parametrize(("changes", "said"), [
    ([(PIXDIM_X, "<f", float("inf"))], "voxel sizes (pixdim) of inf, 6, 6 mm"),
    ([(SROW_X, "<f", float("nan")), (QFORM_CODE, "<h", 0), (SFORM_CODE, "<h", 2)], "affine holds NaN or inf"),
    ([(PIXDIM_X, "<f", float("nan")), (QFORM_CODE, "<h", 0), (SFORM_CODE, "<h", 0)], "pixdim) of nan, 6, 6 mm"),
])
def test_nan_or_inf_in_a_nifti_headers_voxel_sizes_or_affine_is_one_line(phantom_run, tmp_path, changes, said):  # noqa: F811
    image = patched_header(tmp_path / "scans" / "damaged.nii.gz", *changes)
    line = predicted(phantom_run, image, tmp_path / "out")
    assert line.startswith(f"{image}: its header") and said in line and line.endswith("expected finite numbers")
    assert doctor(image) == [f"unusable: {line.removeprefix(f'{image}: ')}"]


# ---- through predict.py, as a user runs it ---------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("attack", ["cut-body", "2x2x2", "2d", "dicom-nan-position"])
def test_each_bad_scan_ends_in_one_line_and_exit_2_through_predict_py(phantom_run, tmp_path, attack):  # noqa: F811
    out = tmp_path / "out"
    if attack == "cut-body":
        named = cut(scan(tmp_path / "scans" / "cut.nii.gz"))
    elif attack == "2x2x2":
        named = scan(tmp_path / "scans" / "tiny.nii.gz", (2, 2, 2))
    elif attack == "2d":
        named = scan(tmp_path / "scans" / "flat.nii.gz", (64, 64))
    else:
        named = tmp_path / "series"
        victim = write_series(named, ramp(8, 6, 3))["files"][1]
        header = pydicom.dcmread(victim)
        header.ImagePositionPatient = ["nan", "0", "1"]
        header.save_as(victim)
    done = subprocess.run(
        [sys.executable, str(ROOT / "predict.py"), f"ckpt_path={phantom_run}/checkpoints/last.ckpt", f"input={named}",
         f"output_dir={out}", "device=cpu"],
        cwd=tmp_path, capture_output=True, text=True, env=subprocess_env(OMP_NUM_THREADS="1"), timeout=300,
    )
    lines = [line for line in (done.stdout + done.stderr).splitlines() if line.strip()]
    assert done.returncode == 2 and len(lines) == 1, lines[-20:]
    assert lines[0].startswith(f"medvol: error: {named}")
    assert not out.exists()
