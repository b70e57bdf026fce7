"""The data doctor finds every kind of bad data with a clear line, and training refuses to start on it."""

from __future__ import annotations

import csv
import subprocess
import sys
from pathlib import Path

import nibabel as nib
import numpy as np
import pytest

from datamodules.sources.brats import BratsDataModule
from datamodules.sources.csv_table import CsvDataModule
from datamodules.sources.example_data import write_brats, write_mace_csv, write_nifti_folder
from datamodules.sources.nifti import NiftiDataModule
from medvol.core.errors import MedvolError
from medvol.run.data_check import main as check_main
from medvol.run.training import run
from tests.conftest import ROOT
from tests.datamodules.sources.test_data_layouts import data_cfg


def _case(root: Path, i: int, suffix: str) -> Path:
    case = f"BraTS-GLI-{i:05d}-000"
    return root / case / f"{case}-{suffix}.nii.gz"


def _rewrite(path: Path, data: np.ndarray, affine: np.ndarray | None = None) -> None:
    old = nib.load(str(path))
    nib.save(nib.Nifti1Image(data, old.affine if affine is None else affine), str(path))


@pytest.fixture
def corrupted_brats(tmp_path: Path) -> Path:
    """BraTS 2023 cases 0-7, cases 1-7 each broken in one way (case 0 is clean)."""
    root = write_brats(tmp_path / "brats", 8, 2023, 16)
    t1 = _case(root, 1, "t1n")
    t1.write_bytes(t1.read_bytes()[: t1.stat().st_size // 2])  # truncated download
    nan = np.asarray(nib.load(str(_case(root, 2, "t2w"))).dataobj).copy()
    nan[4:6, 4:6, 4:6] = np.nan
    _rewrite(_case(root, 2, "t2w"), nan)
    _rewrite(_case(root, 3, "t2f"), np.full((16, 16, 16), 7.0, dtype=np.float32))
    _rewrite(_case(root, 4, "seg"), np.zeros((16, 16, 12), dtype=np.uint8))
    _case(root, 5, "t1c").unlink()
    seg = np.asarray(nib.load(str(_case(root, 6, "seg"))).dataobj).copy()
    seg[0, 0, 0] = 5
    _rewrite(_case(root, 6, "seg"), seg)
    shifted = nib.load(str(_case(root, 7, "t2w"))).affine.copy()
    shifted[:3, 3] += 10
    _rewrite(_case(root, 7, "t2w"), np.asarray(nib.load(str(_case(root, 7, "t2w"))).dataobj), shifted)
    return root


EXPECTED = {
    1: "truncated",
    2: "NaN/Inf voxels",
    3: "constant volume",
    4: "shape mismatch",
    5: "missing modality 't1ce'",
    6: "label values [5]",
    7: "affine mismatch",
}


def test_full_check_reports_every_problem_in_one_table(corrupted_brats, capsys):
    status = check_main(["dataset=brats", f"dataset.root={corrupted_brats}"])
    out = capsys.readouterr().out
    assert status == 1
    assert out.splitlines()[0].split() == ["subject", "file", "problem"]
    for case, message in EXPECTED.items():
        line = next((row for row in out.splitlines() if f"BraTS-GLI-{case:05d}-000" in row), "")
        assert message in line, (case, out)
    assert "BraTS-GLI-00000-000" not in out
    assert "7 problem(s) in 8 subject(s)" in out


def test_cheap_check_reads_headers_only(corrupted_brats):
    problems, _ = BratsDataModule(root=str(corrupted_brats), num_workers=0).data_problems(full=False)
    found = {p.subject: p.problem for p in problems}
    # Found from headers, sizes and file lists...
    for case in (1, 4, 5, 7):
        assert EXPECTED[case] in found[f"BraTS-GLI-{case:05d}-000"]
    # ...while voxel-level problems need the full read.
    assert not {f"BraTS-GLI-{c:05d}-000" for c in (2, 3, 6)} & set(found)


def test_training_refuses_to_start_and_names_the_full_check(corrupted_brats, tmp_path):
    cfg = data_cfg(tmp_path, "dataset=brats", f"dataset.root={corrupted_brats}")
    with pytest.raises(MedvolError) as err:
        run(cfg)
    message = str(err.value)
    assert "problem(s), training not started" in message and "truncated" in message
    assert "run the full check for the whole table: python check_data.py dataset=brats " in message
    assert f" dataset.root={corrupted_brats}" in message
    assert not (tmp_path / "run" / "checkpoints").exists()


def test_bad_csv_rows_and_duplicate_subjects(tmp_path):
    table = write_mace_csv(tmp_path / "mace", 6, 12)
    rows = list(csv.DictReader(table.open()))
    rows[1]["time"] = ""
    rows[2]["time"] = "-3"
    rows[3]["event"] = "2"
    rows[4]["subject"] = rows[0]["subject"]
    rows[5]["image"] = ""
    with table.open("w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    problems, _ = CsvDataModule(csv_path=str(table), num_workers=0).data_problems(full=True)
    text = "\n".join(f"{p.file} {p.problem}" for p in problems)
    assert "mace.csv:3 time='': expected a number >= 0" in text
    assert "mace.csv:4 time='-3': expected a number >= 0" in text
    assert "mace.csv:5 event='2': expected 0 or 1" in text
    assert "duplicate subject: listed 2 times" in text and rows[0]["subject"] in {p.subject for p in problems}
    assert "mace.csv:7 empty path in column 'image'" in text


def test_missing_columns_and_folders_are_one_clear_error(tmp_path):
    table = write_mace_csv(tmp_path / "mace", 2, 12)
    with pytest.raises(MedvolError, match="has no column 'followup'"):
        CsvDataModule(csv_path=str(table), time_column="followup").subjects()
    with pytest.raises(MedvolError, match="holds no BraTS files"):
        BratsDataModule(root=str(tmp_path))


def test_a_misspelt_key_or_option_is_one_line_and_exit_2_not_a_traceback(capsys):
    """Issue 49 item 7: data.md promises exit 2 for a bad command; Hydra's composition error was a traceback."""
    assert check_main(["dataset=brats", "dataset.roots=/data"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("medvol: error: `dataset.roots=/data`: cannot set this key") and err.count("\n") == 1
    assert check_main(["dataset=bratz"]) == 2
    assert "`dataset=bratz`: no such option in the `dataset` group" in capsys.readouterr().err


# check.py as a subprocess (~11 s): the slow suite; the checks themselves are tested in-process above.
@pytest.mark.slow
def test_check_command_line(tmp_path, capsys):
    clean = write_brats(tmp_path / "clean", 2, 2021, 12)
    command = [sys.executable, str(ROOT / "check_data.py"), "dataset=brats", f"dataset.root={clean}"]
    good = subprocess.run(command, cwd=ROOT, capture_output=True, text=True)
    assert good.returncode == 0, good.stderr
    assert "no problems found in 2 subject(s)" in good.stdout
    assert check_main(["dataset=brats", f"dataset.root={tmp_path / 'nowhere'}"]) == 2
    assert capsys.readouterr().err.startswith("medvol: error: `dataset.root`")


def _nifti_problems(root: Path, **kwargs) -> dict[str, str]:
    """subject -> its problems (joined) from a full check of a NIfTI folder with labels."""
    settings = {"root": str(root), "image_modalities": ["ct"], "label_file": "{subject}/label.nii.gz", "num_workers": 0}
    problems, _ = NiftiDataModule(**{**settings, **kwargs}).data_problems(full=True)
    found: dict[str, str] = {}
    for p in problems:
        found[p.subject] = f"{found.get(p.subject, '')} | {p.problem}"
    return found


def test_inf_voxels_non_integer_labels_and_label_values_are_found(tmp_path):
    root = write_nifti_folder(tmp_path / "ct", 4, 12, modalities=("ct",))
    ct = np.asarray(nib.load(str(root / "sub-001" / "ct.nii.gz")).dataobj).astype(np.float32)
    ct[2, 2, 2] = np.inf  # Inf, no NaN: a check for NaN alone misses it
    _rewrite(root / "sub-001" / "ct.nii.gz", ct)
    label = np.asarray(nib.load(str(root / "sub-002" / "label.nii.gz")).dataobj).astype(np.float32)
    label[0, 0, 0] = 0.5
    _rewrite(root / "sub-002" / "label.nii.gz", label)
    label = np.asarray(nib.load(str(root / "sub-003" / "label.nii.gz")).dataobj).copy()
    label[0, 0, 0] = 9
    _rewrite(root / "sub-003" / "label.nii.gz", label)

    found = _nifti_problems(root)
    assert "1 NaN/Inf voxels" in found["sub-001"]
    # With any integer label allowed, only the non-integer check can find 0.5.
    assert "label map holds non-integer values" in found["sub-002"]
    assert "sub-003" not in found and "sub-000" not in found

    found = _nifti_problems(root, label_values=[0, 1, 2])
    assert "label values [9] outside the expected [0, 1, 2]" in found["sub-003"]
    assert "sub-000" not in found


def test_unreadable_missing_label_and_non_3d_files(tmp_path):
    root = write_nifti_folder(tmp_path / "ct", 4, 12, modalities=("ct",))
    (root / "sub-001" / "ct.nii.gz").write_bytes(b"this is not a NIfTI file at all" * 8)
    (root / "sub-002" / "label.nii.gz").unlink()
    affine = nib.load(str(root / "sub-003" / "ct.nii.gz")).affine
    nib.save(nib.Nifti1Image(np.zeros((12, 12), dtype=np.float32), affine), str(root / "sub-003" / "ct.nii.gz"))

    found = _nifti_problems(root)
    assert "unreadable: " in found["sub-001"] and "truncated" not in found["sub-001"]
    assert "missing label 'label': no file found for this subject" in found["sub-002"]
    assert "not a 3D volume: shape (12, 12)" in found["sub-003"]
    assert "sub-000" not in found


def test_brats_2021_accepts_its_own_label_set_only(tmp_path):
    root = write_brats(tmp_path / "brats", 2, 2021, 12)
    for case, value in ((0, 4), (1, 3)):  # 2021 marks the enhancing tumour 4; 3 is 2023's number for it
        seg_path = root / f"BraTS2021_{case:05d}" / f"BraTS2021_{case:05d}_seg.nii.gz"
        seg = np.asarray(nib.load(str(seg_path)).dataobj).copy()
        seg[0, 0, 0] = value
        _rewrite(seg_path, seg)
    problems, checked = BratsDataModule(root=str(root), num_workers=0).data_problems(full=True)
    assert checked == 2
    assert [(p.subject, p.problem) for p in problems] == [
        ("BraTS2021_00001", "label values [3] outside the expected [0, 1, 2, 4]")
    ]


def test_non_numeric_covariate_is_a_bad_row(tmp_path):
    table = write_mace_csv(tmp_path / "mace", 3, 12)
    rows = list(csv.DictReader(table.open()))
    rows[1]["age"] = "forty"
    with table.open("w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    problems, _ = CsvDataModule(csv_path=str(table), covariate_columns=["age", "sex"],
                                num_workers=0).data_problems(full=True)
    assert [f"{p.file} {p.problem}" for p in problems] == ["mace.csv:3 age='forty': expected a number"]
