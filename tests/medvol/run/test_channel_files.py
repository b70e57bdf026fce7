"""predict.py takes the channels as training took them (medvol/run/channel_files.py): nnU-Net's `<case>_XXXX` files
grouped into one subject per case, a 4D or single-channel file as one subject; a model trained on an nnU-Net raw
dataset predicts a folder of imagesTs as nnU-Net does."""

from __future__ import annotations

from pathlib import Path

import nibabel as nib
import numpy as np
import pytest

from benchmarks.segmentation.nnunet_plans import write_raw
from medvol.core.errors import MedvolError
from medvol.run.channel_files import channel_groups
from medvol.run.predicting import predict
from tests.conftest import TINY_COMMON, TINY_MODEL, compose_cfg
from tests.medvol.run.test_predict import predict_cfg, saved_run
from tests.medvol.volumes.test_source_grid import write_brats_lps


def touch(folder: Path, *names: str) -> list[Path]:
    """Empty files `names`, returned in the order given (a listing need not be sorted)."""
    folder.mkdir(parents=True, exist_ok=True)
    paths = [folder / n for n in names]
    for p in paths:
        p.write_bytes(b"")
    return paths


def nnunet_run(run_dir: Path, root: Path, test_fraction: float) -> None:
    """One epoch of the planned segmentation at 4 base filters on the nnU-Net raw dataset `root`, saved in
    `run_dir`."""
    cfg = compose_cfg(run_dir, [
        "model=segmentation", "dataset=nnunet", f"dataset.root={root}", "dataset.val_fraction=0.2",
        f"dataset.test_fraction={test_fraction}", "dataset.num_workers=0", "model.plan.base_features=4",
        "model.plan.iterations_per_epoch=1", "hardware=cpu", "callbacks.progress_bar=null",
        "callbacks.model_summary=null", "trainer.max_epochs=1", "trainer.num_sanity_val_steps=0", "logger=none",
    ], tiny=False)
    saved_run(run_dir, cfg)


def test_nnunet_channel_files_group_into_one_subject_per_case_in_channel_order(tmp_path):
    files = touch(tmp_path, "la_003_0001.nii.gz", "la_003_0000.nii.gz", "la_007_0000.nii.gz", "la_007_0001.nii.gz")
    groups = channel_groups(files, 2)
    assert list(groups) == ["la_003", "la_007"]
    assert [p.name for p in groups["la_003"]] == ["la_003_0000.nii.gz", "la_003_0001.nii.gz"]
    # One channel: nnU-Net's case name, without the channel index.
    assert list(channel_groups(touch(tmp_path / "one", "a_0000.nii.gz"), 1)) == ["a"]
    # Files of another naming (a 4D file each, or 3D volumes): one subject per file.
    assert list(channel_groups(touch(tmp_path / "plain", "BRATS_001.nii.gz", "brain.nii.gz"), 1)) == [
        "BRATS_001", "brain"]


@pytest.mark.parametrize(
    ("names", "channels", "message"),
    [
        (("c_0000.nii.gz", "c_0002.nii.gz"), 2, r"case c has the channel files \[0, 2\]; the model takes 2"),
        (("c_0000.nii.gz",), 2, r"case c has the channel files \[0\]"),
        (("brain.nii.gz",), 3, r"brain.nii.gz holds 1 volume\(s\); the model takes 3 channels per subject: one 4D file "
                                r"holding them on its last axis, or one file per channel named as nnU-Net does"),
    ],
)
def test_channel_files_that_do_not_fit_the_model_are_refused_in_one_line(tmp_path, names, channels, message):
    with pytest.raises(MedvolError, match=message):
        channel_groups(touch(tmp_path, *names), channels)


def test_a_4d_file_is_one_subject_of_as_many_channels_as_it_holds_volumes(tmp_path):
    for name, volumes in (("four.nii.gz", 4), ("three.nii.gz", 3), ("flat.nii.gz", 1)):
        shape = (6, 5, 4, volumes) if volumes > 1 else (6, 5, 4)
        nib.save(nib.Nifti1Image(np.zeros(shape, np.float32), np.eye(4)), str(tmp_path / name))
    assert channel_groups([tmp_path / "four.nii.gz"], 4) == {"four": [tmp_path / "four.nii.gz"]}
    with pytest.raises(MedvolError, match=r"three.nii.gz holds 3 volume\(s\); the model takes 4 channels"):
        channel_groups([tmp_path / "four.nii.gz", tmp_path / "three.nii.gz"], 4)
    with pytest.raises(MedvolError, match=r"flat.nii.gz holds 1 volume\(s\); the model takes 4 channels"):
        channel_groups([tmp_path / "flat.nii.gz"], 4)


def test_a_model_trained_on_an_nnunet_dataset_predicts_a_folder_of_imagests(tmp_path):
    rng = np.random.default_rng(0)
    cases = {}
    for i in range(5):
        label = np.zeros((16, 14, 10), np.uint8)
        label[5:10, 4:9, 3:7] = 1
        t2 = rng.normal(100, 5, label.shape).astype(np.float32) + 50 * label
        adc = rng.normal(30, 3, label.shape).astype(np.float32) - 10 * label
        cases[f"prostate_{i:02d}"] = ([t2, adc], label, [1.0, 1.0, 2.0])
    write_raw(tmp_path / "raw", "Dataset005_Prostate", ["T2", "ADC"], {"background": 0, "peripheral zone": 1}, cases)
    root = tmp_path / "raw" / "Dataset005_Prostate"
    run_dir = tmp_path / "run"
    nnunet_run(run_dir, root, test_fraction=0.0)
    tests = tmp_path / "imagesTs"
    tests.mkdir()
    for name in ("0000", "0001"):
        source = root / "imagesTr" / f"prostate_00_{name}.nii.gz"
        (tests / f"case_{name}.nii.gz").write_bytes(source.read_bytes())
    out = tmp_path / "out"
    predict(predict_cfg(f"ckpt_path={run_dir / 'checkpoints' / 'last.ckpt'}", f"input={tests}", f"output_dir={out}"))
    # Issue 63 item 12: named as nnU-Net names its output for an nnU-Net folder, <case>.nii.gz, uint8 as nnU-Net's.
    mask = nib.load(str(out / "case.nii.gz"))
    assert mask.shape == (16, 14, 10) and mask.get_data_dtype() == np.uint8
    assert not (out / "case_seg.nii.gz").exists()
    assert set(np.unique(np.asarray(mask.dataobj)).tolist()) <= {0, 1}
    # Issue 49 item 17: the same case as one 4D file (channels on the last axis, as the Decathlon stores its scans)
    # was refused for a model trained on one file per channel; it is the same subject, and gives the same mask.
    channels = [nib.load(str(tests / f"case_{name}.nii.gz")) for name in ("0000", "0001")]
    stacked = tmp_path / "stacked" / "case4d.nii.gz"
    stacked.parent.mkdir()
    nib.save(nib.Nifti1Image(np.stack([c.get_fdata(dtype=np.float32) for c in channels], -1), channels[0].affine),
             str(stacked))
    predict(predict_cfg(f"ckpt_path={run_dir / 'checkpoints' / 'last.ckpt'}", f"input={stacked}",
                        f"output_dir={tmp_path / 'out4d'}"))
    from_4d = nib.load(str(tmp_path / "out4d" / "case4d_seg.nii.gz"))
    assert np.array_equal(from_4d.affine, mask.affine)
    assert np.array_equal(np.asarray(from_4d.dataobj), np.asarray(mask.dataobj))


def test_a_model_trained_on_brats_predicts_case_folders_and_4d_files_as_its_own_dataset(tmp_path):
    """Issue 49 item 17: a BraTS model (four files per subject) refused one 4D file ("name them as nnU-Net does") and
    BraTS case folders given as `input`. Each now gives the masks `dataset=brats dataset.root=...` gives."""
    root = write_brats_lps(tmp_path / "brats", 4)
    run_dir = tmp_path / "run"
    files = [o for o in [*TINY_COMMON, *TINY_MODEL["segmentation"]] if not o.startswith("dataset.")]
    saved_run(run_dir, compose_cfg(run_dir, [
        *files, "model=segmentation", "dataset=brats", f"dataset.root={root}", "dataset.num_workers=0",
        "dataset.val_fraction=0.25", "dataset.test_fraction=0.25", "model.plan.base_features=4", "logger=none",
        "callbacks.volume_slices=null",
    ], tiny=False))
    ckpt = f"ckpt_path={run_dir / 'checkpoints' / 'last.ckpt'}"
    predict(predict_cfg(ckpt, "dataset=brats", f"dataset.root={root}", "save_probabilities=true",
                        f"output_dir={tmp_path / 'reference'}"))
    case = "BraTS2021_00001"
    stacked = tmp_path / "scans" / f"{case}.nii.gz"
    stacked.parent.mkdir()
    volumes = [nib.load(str(root / case / f"{case}_{m}.nii.gz")) for m in ("t1", "t1ce", "t2", "flair")]
    nib.save(nib.Nifti1Image(np.stack([np.asarray(v.dataobj) for v in volumes], -1), volumes[0].affine), str(stacked))
    for name, source, cases in (("root", root, ["BraTS2021_00000", "BraTS2021_00001", "BraTS2021_00002",
                                                "BraTS2021_00003"]),
                                ("case", root / case, [case]), ("4d", stacked, [case])):
        out = tmp_path / name
        predict(predict_cfg(ckpt, f"input={source}", "save_probabilities=true", f"output_dir={out}"))
        assert sorted(p.name for p in out.glob("*_seg.nii.gz")) == [f"{c}_seg.nii.gz" for c in cases], name
        for c in cases:
            got, expected = (nib.load(str(folder / f"{c}_seg.nii.gz")) for folder in (out, tmp_path / "reference"))
            assert np.array_equal(got.affine, expected.affine), name
            assert np.array_equal(np.asarray(got.dataobj), np.asarray(expected.dataobj)), name
            # The probabilities the masks come from (a tiny model's masks may be background alone).
            got, expected = (nib.load(str(folder / f"{c}_probabilities.nii.gz")).get_fdata()
                             for folder in (out, tmp_path / "reference"))
            assert np.ptp(expected) > 0.01
            np.testing.assert_allclose(got, expected, rtol=0, atol=1e-6)
    # Case folders hold their segmentations: scored as a dataset's subjects are.
    assert (tmp_path / "root" / "metrics.csv").read_text() == (tmp_path / "reference" / "metrics.csv").read_text()
