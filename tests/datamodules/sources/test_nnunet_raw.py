"""nnU-Net raw datasets and Decathlon tasks read as they are (datamodules/sources/nnunet_raw.py), and the fingerprint
rules checked against what nnU-Net's own `plan_and_preprocess` answered on the same files
(tests/data/nnunet_plans.json, `benchmarks/segmentation/nnunet_plans.py reference`)."""

from __future__ import annotations

import json
from pathlib import Path

import nibabel as nib
import numpy as np
import pytest

from benchmarks.segmentation.nnunet_plans import tiny_datasets, write_raw
from datamodules.sources.nnunet_raw import NnunetDataModule
from medvol.core.errors import MedvolError
from medvol.run.resolvers import nnunet_channels
from medvol.volumes.plan import make_plan

REFERENCE = json.loads((Path(__file__).resolve().parents[2] / "data" / "nnunet_plans.json").read_text())["fingerprints"]


def datamodule(root: Path, tmp_path: Path, **kwargs) -> NnunetDataModule:
    return NnunetDataModule(root=str(root), image_modalities=nnunet_channels(str(root)), val_fraction=0.0,
                            test_fraction=0.0, split_file=str(tmp_path / "split.json"), **kwargs)


@pytest.fixture(scope="module")
def raw(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("nnUNet_raw")
    for name, (cases, channels) in tiny_datasets().items():
        write_raw(folder, name, channels, {"background": 0, "lesion": 1}, cases)
    return folder


@pytest.mark.parametrize(("name", "masked"), [("Dataset901_MaskRule", True), ("Dataset902_NoBackground", False)])
def test_the_non_zero_mask_normalizes_exactly_where_nnunet_uses_it(raw, tmp_path, name, masked):
    data = datamodule(raw / name, tmp_path)
    fingerprint = data.plan_fingerprint()
    recorded = REFERENCE[name]
    assert np.median(fingerprint.relative_sizes) == pytest.approx(recorded["median_relative_size_after_cropping"])
    plan = make_plan(fingerprint, 512, 16, kinds=data.modality_kind)
    assert [c["use_mask"] for c in plan["normalization"]] == recorded["use_mask_for_norm"] == [masked] * len(
        recorded["use_mask_for_norm"])


def test_ct_statistics_come_from_the_labelled_voxels_only_a_lesion_free_subject_adds_nothing(raw, tmp_path):
    """numpy over the labelled voxels exactly; nnU-Net's own (from its random samples of the same voxels) closely;
    the lesion-free subject's air and body are not counted."""
    data = datamodule(raw / "Dataset903_CTLesionFree", tmp_path)
    plan = make_plan(data.plan_fingerprint(), 512, 16, kinds=data.modality_kind)
    (channel,) = plan["normalization"]
    assert channel["kind"] == "ct"
    voxels = []
    for record in data.training_records():
        image = np.asarray(nib.load(record["image"][0]).dataobj, dtype=np.float64)
        voxels.append(image[np.asarray(nib.load(record["label"]).dataobj) > 0])
    voxels = np.concatenate(voxels)
    assert channel["mean"] == pytest.approx(voxels.mean()) and channel["std"] == pytest.approx(voxels.std())
    assert channel["clip"] == pytest.approx(np.percentile(voxels, [0.5, 99.5]).tolist())
    nnunet = REFERENCE["Dataset903_CTLesionFree"]["foreground_intensity_properties_per_channel"]["0"]
    assert REFERENCE["Dataset903_CTLesionFree"]["normalization_schemes"] == ["CTNormalization"]
    assert channel["mean"] == pytest.approx(nnunet["mean"], rel=2e-3)
    assert channel["std"] == pytest.approx(nnunet["std"], rel=1e-2)
    assert channel["clip"] == pytest.approx([nnunet["percentile_00_5"], nnunet["percentile_99_5"]], rel=2e-2)
    assert plan["spacing"] == pytest.approx(REFERENCE["Dataset903_CTLesionFree"]["spacing"][::-1])


def write_decathlon(root: Path, cases: int = 3) -> Path:
    """A Decathlon task as published: 4D images (two channels on the fourth axis), labels as value -> name."""
    (root / "imagesTr").mkdir(parents=True)
    (root / "labelsTr").mkdir()
    training = []
    for i in range(cases):
        image = np.zeros((12, 10, 8, 2), np.float32)
        image[2:10, 2:8, 1:7, 0] = 100.0 + i
        image[2:10, 2:8, 1:7, 1] = -5.0 - i
        label = np.zeros((12, 10, 8), np.uint8)
        label[4:7, 3:6, 2:5] = 1
        label[5, 4, 3] = 2
        nib.save(nib.Nifti1Image(image, np.eye(4)), str(root / "imagesTr" / f"case_{i:03d}.nii.gz"))
        nib.save(nib.Nifti1Image(label, np.eye(4)), str(root / "labelsTr" / f"case_{i:03d}.nii.gz"))
        training.append({"image": f"./imagesTr/case_{i:03d}.nii.gz", "label": f"./labelsTr/case_{i:03d}.nii.gz"})
    (root / "dataset.json").write_text(json.dumps({
        "name": "Task", "modality": {"0": "FLAIR", "1": "T1w"}, "labels": {"0": "background", "1": "edema",
                                                                         "2": "enhancing tumour"},
        "numTraining": cases, "training": training, "test": [],
    }))
    return root


def test_a_decathlon_task_keeps_its_4d_channels_apart(tmp_path):
    root = write_decathlon(tmp_path / "Task01")
    data = datamodule(root, tmp_path)
    assert data.image_modalities == ["image"]
    assert data.label_names() == ["edema", "enhancing_tumour"] and data.label_regions_of_data() is None
    fingerprint = data.plan_fingerprint()
    assert len(fingerprint.channels) == 2 and fingerprint.labels == {0: 3 * (960 - 27), 1: 3 * 26, 2: 3}
    plan = make_plan(fingerprint, 512, 16, kinds=data.modality_kind)
    assert plan["channels"] == 2 and plan["num_classes"] == 3
    data.setup()
    item = data.datasets["train"][0]
    assert item["image"].shape[0] == 2


def test_an_nnunet_dataset_gives_its_channels_classes_and_regions(tmp_path):
    cases = {f"c{i}": ([np.full((6, 6, 6), 1.0 + i, np.float32), np.full((6, 6, 6), 2.0, np.float32)],
                       np.eye(6, dtype=np.uint8)[None].repeat(6, 0) * 3, [1.0, 1.0, 2.0]) for i in range(3)}
    regions = {"background": 0, "whole tumor": [1, 2, 3], "tumor core": [2, 3], "enhancing tumor": 3}
    write_raw(tmp_path / "raw", "Dataset010_Regions", ["T2", "CT"], regions, cases)
    data = datamodule(tmp_path / "raw" / "Dataset010_Regions", tmp_path)
    assert data.image_modalities == ["0000_T2", "0001_CT"]
    assert data.modality_kind == ["mr", "ct"]
    assert data.label_regions_of_data() == {"whole_tumor": [1, 2, 3], "tumor_core": [2, 3], "enhancing_tumor": [3]}
    records = data.subjects()
    assert [r["subject"] for r in records] == ["c0", "c1", "c2"]
    assert records[1]["image"] == [str(tmp_path / "raw" / "Dataset010_Regions" / "imagesTr" / f"c1_{k:04d}.nii.gz")
                                   for k in range(2)]


def test_an_ignore_label_is_not_a_class_and_the_plan_leaves_it_out(tmp_path):
    """nnU-Net's `"ignore": 3` after the classes 0-2: no class of its own, the plan's classes 0-2 although the label
    files hold 3; it must be one above every other value, as nnU-Net's LabelManager requires."""
    label = np.zeros((6, 6, 6), np.uint8)
    label[1:3, 1:3, 1:3], label[3:5, 3:5, 3:5], label[:, :, 5] = 1, 2, 3
    cases = {f"c{i}": ([np.full((6, 6, 6), 1.0 + i, np.float32)], label, [1.0, 1.0, 1.0]) for i in range(3)}
    write_raw(tmp_path / "raw", "Dataset012_Ignore", ["T1"], {"background": 0, "a": 1, "b": 2, "ignore": 3}, cases)
    data = datamodule(tmp_path / "raw" / "Dataset012_Ignore", tmp_path)
    assert data.ignore_label_of_data() == 3 and data.label_names() == ["a", "b"] and data.label_values == [0, 1, 2, 3]
    fingerprint = data.plan_fingerprint()
    assert set(fingerprint.labels) == {0, 1, 2, 3}
    plan = make_plan(fingerprint, 512, 16, kinds=data.modality_kind, ignore_label=3)
    assert plan["num_classes"] == 3 and plan["ignore_label"] == 3
    # Read as a class, the ignore value would be a fourth class.
    assert make_plan(fingerprint, 512, 16, kinds=data.modality_kind)["num_classes"] == 4
    content = json.loads((tmp_path / "raw" / "Dataset012_Ignore" / "dataset.json").read_text())
    for bad in (5, [3], "3"):
        content["labels"]["ignore"] = bad
        (tmp_path / "raw" / "Dataset012_Ignore" / "dataset.json").write_text(json.dumps(content))
        with pytest.raises(MedvolError, match=r"`labels.ignore` is .*; expected the integer one above every other"):
            datamodule(tmp_path / "raw" / "Dataset012_Ignore", tmp_path)


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ({"labels": {"background": 0}, "file_ending": ".nii.gz"}, r"`channel_names` is missing"),
        ({"channel_names": {"0": "T1"}, "file_ending": ".nii.gz"}, r"`labels` is missing"),
        ({"channel_names": {"0": "T1"}, "labels": {"tumour": 1}, "file_ending": ".nii.gz"}, r"no background 0"),
        ({"channel_names": {"0": "T1"}, "labels": {"background": 0, "x": "one"}, "file_ending": ".nii.gz"},
         r"`labels.x` is 'one'"),
        ({"channel_names": {"0": "T1", "2": "T2"}, "labels": {"background": 0}, "file_ending": ".nii.gz"},
         r"`channel_names` must number the channels 0..1"),
        ({"channel_names": {"0": "T1"}, "labels": {"background": 0}, "file_ending": ".mha"},
         r"`file_ending` is '.mha'"),
    ],
)
def test_a_malformed_dataset_json_is_one_line_naming_the_key(tmp_path, content, message):
    root = tmp_path / "Dataset011_Bad"
    (root / "imagesTr").mkdir(parents=True)
    (root / "dataset.json").write_text(json.dumps(content))
    with pytest.raises(MedvolError, match=message):
        NnunetDataModule(root=str(root), split_file=str(tmp_path / "split.json")).subjects()
