"""The data doctor's checks of one subject's files (datamodules/pipeline/check.py), on files written here: headers in
the cheap mode, voxels in the full one, each finding worded for the table, and the one-line refusal training gives."""

from __future__ import annotations

import gzip
import shlex
from pathlib import Path

import nibabel as nib
import numpy as np
import pytest

from datamodules.pipeline.check import (
    Problem,
    check_record,
    dataset_overrides,
    duplicate_subjects,
    format_table,
    preflight_error,
)
from medvol.volumes import scan_checks
from tests.conftest import compose_cfg


def _write(path: Path, data: np.ndarray, affine: np.ndarray | None = None) -> str:
    nib.save(nib.Nifti1Image(data, np.eye(4) if affine is None else affine), path)
    return str(path)


def _ramp(shape: tuple[int, ...] = (6, 6, 6)) -> np.ndarray:
    return np.arange(np.prod(shape), dtype=np.float32).reshape(shape)


def _problems(files: dict[str, str | None], full: bool = True, label_values: list[int] | None = None,
              **settings: object) -> list[str]:
    return [p.problem for p in check_record({"subject": "s1", "files": files}, label_values, full, **settings)]


def test_a_clean_subject_has_no_problem(tmp_path):
    label = np.zeros((6, 6, 6), dtype=np.int16)
    label[2:4, 2:4, 2:4] = 2
    files = {"t1": _write(tmp_path / "t1.nii.gz", _ramp()), "label": _write(tmp_path / "seg.nii.gz", label)}
    assert _problems(files, label_values=[0, 1, 2]) == []


def test_missing_files_are_named_by_kind(tmp_path):
    problems = _problems({"t1": None, "label": None, "t2": str(tmp_path / "absent.nii.gz")})
    assert problems == ["missing modality 't1': no file found for this subject",
                        "missing label 'label': no file found for this subject", "missing file (t2): no such file"]


def test_grids_that_disagree_with_the_first_file_are_named(tmp_path):
    t1 = _write(tmp_path / "t1.nii.gz", _ramp())
    smaller = _write(tmp_path / "t2.nii.gz", _ramp((6, 6, 5)))
    shifted = _write(tmp_path / "flair.nii.gz", _ramp(), np.diag([1.0, 1.0, 1.01, 1.0]))
    nearly = _write(tmp_path / "dwi.nii.gz", _ramp(), np.diag([1.0, 1.0, 1.00005, 1.0]))  # within rounding of headers
    problems = _problems({"t1": t1, "t2": smaller, "flair": shifted, "dwi": nearly}, full=False)
    assert problems == ["shape mismatch: t2 is (6, 6, 5), t1 is (6, 6, 6)",
                        "affine mismatch: flair and t1 lie on different voxel grids (resample them)"]


def test_a_cut_gzip_or_plain_file_is_truncated_and_a_2d_image_is_not_a_volume(tmp_path):
    voxels = np.random.default_rng(0).random((16, 16, 16)).astype(np.float32)
    whole, plain = Path(_write(tmp_path / "t1.nii.gz", voxels)), Path(_write(tmp_path / "plain.nii", voxels))
    cut = tmp_path / "cut.nii.gz"
    cut.write_bytes(whole.read_bytes()[: whole.stat().st_size // 2])
    plain.write_bytes(plain.read_bytes()[:-1000])
    flat = _write(tmp_path / "flat.nii.gz", _ramp((6, 6)))
    truncated = "truncated: the file ends before all its voxels (re-copy or re-export it)"
    assert _problems({"t1": str(cut)}, full=False) == [truncated]
    assert _problems({"t1": str(plain)}, full=False) == [truncated]
    assert _problems({"t1": flat}, full=False) == ["not a 3D volume: shape (6, 6)"]


def test_a_gzip_file_whose_stored_size_is_the_voxels_is_read_only_by_its_header(tmp_path, monkeypatch):
    # The gzip trailer holds the uncompressed size mod 2^32 (RFC 1952); when it matches, no voxel is read.
    path = Path(_write(tmp_path / "t1.nii.gz", _ramp()))
    with gzip.open(path, "rb") as handle:
        size = len(handle.read())
    assert int.from_bytes(path.read_bytes()[-4:], "little") == size
    monkeypatch.setattr(scan_checks, "_full_read_fails", lambda *read: pytest.fail(f"the cheap check read {read}"))
    assert _problems({"t1": str(path)}, full=False) == []


def test_a_plain_file_cut_by_a_few_bytes_is_truncated(tmp_path):
    plain = Path(_write(tmp_path / "plain.nii", _ramp()))
    plain.write_bytes(plain.read_bytes()[:-100])
    assert _problems({"t1": str(plain)}, full=False) == [
        "truncated: the file ends before all its voxels (re-copy or re-export it)"]


def test_the_full_check_counts_nan_and_inf_voxels_and_finds_a_constant_image(tmp_path):
    data = _ramp()
    data[0, 0, :3] = np.nan
    data[1, 1, :2] = [np.inf, -np.inf]
    files = {"t1": _write(tmp_path / "t1.nii.gz", data), "t2": _write(tmp_path / "t2.nii.gz", np.full((6, 6, 6), 7.0))}
    assert _problems(files) == ["5 NaN/Inf voxels", "constant volume (every voxel is 7): no signal to learn"]
    assert _problems(files, full=False) == []


def test_label_values_outside_the_expected_set_and_fractions_are_found(tmp_path):
    label = np.zeros((6, 6, 6), dtype=np.float32)
    label[0, 0, 0], label[1, 1, 1], label[2, 2, 2] = 4, 0.5, 1
    files = {"t1": _write(tmp_path / "t1.nii.gz", _ramp()), "label": _write(tmp_path / "seg.nii.gz", label)}
    assert _problems(files, label_values=[0, 1, 2]) == [
        "label values [0.5, 4.0] outside the expected [0, 1, 2]", "label map holds non-integer values"]
    assert _problems(files) == ["label map holds non-integer values"]


def test_only_the_named_image_channels_are_checked_for_constant_volumes(tmp_path):
    mask = _write(tmp_path / "mask.nii.gz", np.zeros((6, 6, 6)))
    files = {"t1": _write(tmp_path / "t1.nii.gz", _ramp()), "mask": mask}
    assert _problems(files, image_names=["t1"]) == []
    assert _problems(files) == ["constant volume (every voxel is 0): no signal to learn"]


def test_each_subject_listed_more_than_once_is_one_problem():
    records = [{"subject": s} for s in ("b", "a", "b", "c", "a", "b")]
    assert duplicate_subjects(records, "subjects.csv") == [
        Problem("a", "subjects.csv", "duplicate subject: listed 2 times; subject ids must be unique"),
        Problem("b", "subjects.csv", "duplicate subject: listed 3 times; subject ids must be unique"),
    ]


def test_the_table_pads_subject_and_file_columns_under_a_rule_as_long_as_its_longest_line():
    table = format_table([Problem("s1", "a.nii.gz", "x"), Problem("subject-10", "b.nii", "yy")])
    assert table.splitlines() == [
        "subject     file      problem",
        "-----------------------------",
        "s1          a.nii.gz  x",
        "subject-10  b.nii     yy",
    ]


def test_the_refusal_names_the_count_the_first_three_and_the_full_check_with_the_same_overrides():
    problems = [Problem("s", f"f{i}.nii", f"p{i}") for i in range(5)]
    message = str(preflight_error(problems, ["dataset=brats", "dataset.root=/data"]))
    assert message == (
        "the data check found 5 problem(s), training not started (first: f0.nii: p0; f1.nii: p1; f2.nii: p2); "
        "run the full check for the whole table: python check_data.py dataset=brats dataset.root=/data"
    )


def test_the_dataset_overrides_of_the_hydra_job_are_repeated_with_the_group_choice_first(tmp_path):
    compose_cfg(tmp_path, ["dataset.root=/data", "model=segmentation", "dataset=nifti", "trainer.max_epochs=2"],
                tiny=False)
    assert dataset_overrides() == ["dataset=nifti", "dataset.root=/data"]


def test_an_experiment_that_chooses_the_dataset_is_repeated_too(tmp_path):
    """`experiment=brats_segmentation dataset.root=DIR` chooses BraTS through the preset: without it the suggested
    check would compose the synthetic default, which has no `root`."""
    compose_cfg(tmp_path, ["experiment=brats_segmentation", "dataset.root=/data", "trainer.max_epochs=2"], tiny=False)
    assert dataset_overrides() == ["experiment=brats_segmentation", "dataset.root=/data"]


def test_the_suggested_check_quotes_what_the_shell_would_strip():
    """Issue 49 item 7: Hydra needs the quotes of `"{subject}/label.nii.gz"`; pasted unquoted, the shell drops them."""
    message = str(preflight_error([Problem("s", "f.nii", "p")],
                                  ["dataset=nifti", 'dataset.label_file="{subject}/label.nii.gz"', "dataset.x=[a,b]"]))
    command = message.split("whole table: ")[1]
    assert command == ("python check_data.py dataset=nifti 'dataset.label_file=\"{subject}/label.nii.gz\"' "
                       "'dataset.x=[a,b]'")
    assert shlex.split(command)[3:] == ['dataset.label_file="{subject}/label.nii.gz"', "dataset.x=[a,b]"]
