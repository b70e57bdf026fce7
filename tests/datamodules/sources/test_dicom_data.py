"""DICOM series folders as the file datasets' volumes (folder patterns, CSV columns, BraTS-like cases), and the data
doctor's findings on series that are no volume: several series, a gap, a localizer, mixed sizes, a constant volume."""

from __future__ import annotations

import csv
from pathlib import Path

import nibabel as nib
import numpy as np
import torch

from datamodules.sources.brats import BratsDataModule
from datamodules.sources.csv_table import CsvDataModule
from datamodules.sources.nifti import NiftiDataModule
from medvol.run.data_check import main as check_main
from medvol.volumes.dicom_io import read_series
from tests.dicom_series import ramp, write_localizer, write_series

RAW = {"orientation": None, "intensity": "none", "spatial_size": None}


def first_item(datamodule: NiftiDataModule) -> dict:
    return datamodule.build_dataset(datamodule.subjects(), "test")[0]


def test_a_nifti_pattern_matches_series_folders_named_without_the_suffix(tmp_path: Path):
    write_series(tmp_path / "case0" / "t1", ramp(5, 4, 3), intercept=-1024.0)
    write_series(tmp_path / "case0" / "t2", ramp(5, 4, 3) + 7, intercept=-1024.0)
    datamodule = NiftiDataModule(root=str(tmp_path), image_modalities=["t1", "t2"], transforms=RAW, num_workers=0)
    assert [r["subject"] for r in datamodule.subjects()] == ["case0"]
    item = first_item(datamodule)
    expected, _ = read_series(tmp_path / "case0" / "t1")
    assert item["image"].shape == (2, 4, 5, 3)
    np.testing.assert_allclose(item["image"][0].numpy(), expected)
    np.testing.assert_allclose((item["image"][1] - item["image"][0]).numpy(), 7.0)
    assert item["source_file"] == str(tmp_path / "case0" / "t1") and item["source_series"]


def test_a_csv_image_column_may_name_a_series_folder(tmp_path: Path):
    write_series(tmp_path / "series" / "a", ramp(4, 4, 3), step=2.0)
    with (tmp_path / "table.csv").open("w", newline="") as handle:
        csv.writer(handle).writerows([["subject", "image", "time", "event"], ["a", "series/a", 3.5, 1]])
    datamodule = CsvDataModule(csv_path=str(tmp_path / "table.csv"), transforms=RAW, num_workers=0)
    item = first_item(datamodule)
    np.testing.assert_allclose(item["image"][0].numpy(), read_series(tmp_path / "series" / "a")[0])
    np.testing.assert_allclose(torch.as_tensor(item["affine"])[2, 2].item(), 2.0)


def test_brats_like_cases_of_series_folders_with_a_nifti_label(tmp_path: Path):
    case = tmp_path / "BraTS-GLI-00000-000"
    for i, suffix in enumerate(("-t1n", "-t1c", "-t2w", "-t2f")):
        info = write_series(case / f"{case.name}{suffix}", ramp(6, 5, 4) + i)
    _, geometry = read_series(case / f"{case.name}-t1n")
    label = np.zeros(geometry.shape, dtype=np.uint8)
    label[1:3, 1:3, 1:3] = 3
    nib.save(nib.Nifti1Image(label, geometry.affine), str(case / f"{case.name}-seg.nii.gz"))
    datamodule = BratsDataModule(root=str(tmp_path), transforms=RAW, num_workers=0)
    assert datamodule.year == 2023 and info["uid"]
    problems, count = datamodule.data_problems(full=True)
    assert (problems, count) == ([], 1)
    item = first_item(datamodule)
    assert item["image"].shape == (4, 5, 6, 4) and int(item["label"].max()) == 3


def test_the_data_doctor_flags_series_that_are_no_volume(tmp_path: Path, capsys):
    write_series(tmp_path / "clean" / "image", ramp(4, 4, 4))
    write_series(tmp_path / "two" / "image", ramp(4, 4, 3), description="first")
    write_series(tmp_path / "two" / "image", ramp(4, 4, 3), description="second")
    write_series(tmp_path / "gap" / "image", ramp(4, 4, 5), skip=(2,))
    scout = write_series(tmp_path / "scout" / "image", ramp(4, 4, 3))
    write_localizer(tmp_path / "scout" / "image", (4, 4), scout["uid"])
    sizes = write_series(tmp_path / "sizes" / "image", ramp(4, 4, 3))
    write_series(tmp_path / "sizes" / "image", ramp(5, 4, 1), uid=sizes["uid"], origin=(0, 0, 3.0))
    write_series(tmp_path / "flat" / "image", np.full((4, 4, 3), 12, dtype=np.int16))
    status = check_main(["dataset=nifti", f"dataset.root={tmp_path}"])
    out = capsys.readouterr().out
    expected = {
        "two": "holds 2 DICOM series", "gap": "a missing slice?", "scout": "1 localizer image(s) among the slices",
        "sizes": "mixed slice sizes", "flat": "constant volume",
    }
    assert status == 1
    for subject, message in expected.items():
        assert message in next((row for row in out.splitlines() if row.startswith(subject)), ""), (subject, out)
    assert not any(row.startswith("clean") for row in out.splitlines())
