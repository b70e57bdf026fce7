"""predict.py takes the channels as training took them (medvol/run/channel_files.py): nnU-Net's `<case>_XXXX` files
grouped into one subject per case, a 4D or single-channel file as one subject; a model trained on an nnU-Net raw
dataset predicts a folder of imagesTs as nnU-Net does."""

from __future__ import annotations

from pathlib import Path

import nibabel as nib
import numpy as np
import pytest

from benchmarks.nnunet_plans import write_raw
from medvol.core.errors import MedvolError
from medvol.run.channel_files import channel_groups
from medvol.run.predicting import predict
from tests.conftest import compose_cfg
from tests.medvol.run.test_predict import predict_cfg, saved_run


def touch(folder: Path, *names: str) -> list[Path]:
    """Empty files `names`, returned in the order given (a listing need not be sorted)."""
    folder.mkdir(parents=True, exist_ok=True)
    paths = [folder / n for n in names]
    for p in paths:
        p.write_bytes(b"")
    return paths


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
        (("brain.nii.gz",), 3, r"the model takes 3 channel files per subject; name them as nnU-Net does"),
    ],
)
def test_channel_files_that_do_not_fit_the_model_are_refused_in_one_line(tmp_path, names, channels, message):
    with pytest.raises(MedvolError, match=message):
        channel_groups(touch(tmp_path, *names), channels)


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
    cfg = compose_cfg(run_dir, [
        "model=segmentation", "dataset=nnunet", f"dataset.root={root}", "dataset.val_fraction=0.2",
        "dataset.test_fraction=0.0", "dataset.num_workers=0", "model.plan.base_features=4",
        "model.plan.iterations_per_epoch=1", "hardware=cpu", "callbacks.progress_bar=null",
        "callbacks.model_summary=null", "trainer.max_epochs=1", "trainer.num_sanity_val_steps=0", "logger=none",
    ], tiny=False)
    saved_run(run_dir, cfg)
    tests = tmp_path / "imagesTs"
    tests.mkdir()
    for name in ("0000", "0001"):
        source = root / "imagesTr" / f"prostate_00_{name}.nii.gz"
        (tests / f"case_{name}.nii.gz").write_bytes(source.read_bytes())
    out = tmp_path / "out"
    predict(predict_cfg(f"ckpt_path={run_dir / 'checkpoints' / 'last.ckpt'}", f"input={tests}", f"output_dir={out}"))
    mask = nib.load(str(out / "case_seg.nii.gz"))
    assert mask.shape == (16, 14, 10)
    assert set(np.unique(np.asarray(mask.dataobj)).tolist()) <= {0, 1}
