"""An nnU-Net raw dataset with an ignore label through the whole run: planned without it as a class, trained and
validated on the annotated voxels, predicted without it (issue 50)."""

from __future__ import annotations

import json

import nibabel as nib
import numpy as np
import pytest

from benchmarks.segmentation.nnunet_plans import write_raw
from tests.medvol.run.test_channel_files import nnunet_run
from tests.medvol.run.test_predict import predict_cfg


@pytest.mark.slow
def test_a_run_on_a_dataset_with_an_ignore_label_never_predicts_it(tmp_path):
    from medvol.run.predicting import predict

    rng = np.random.default_rng(0)
    cases = {}
    for i in range(5):
        label = np.zeros((16, 14, 10), np.uint8)
        label[5:10, 4:9, 3:7] = 1
        label[:, :, 8:] = 2  # slices without truth
        image = rng.normal(100, 5, label.shape).astype(np.float32) + 50 * (label == 1)
        cases[f"case_{i:02d}"] = ([image], label, [1.0, 1.0, 2.0])
    write_raw(tmp_path / "raw", "Dataset013_Ignore", ["T2"], {"background": 0, "lesion": 1, "ignore": 2}, cases)
    root = tmp_path / "raw" / "Dataset013_Ignore"
    run_dir = tmp_path / "run"
    nnunet_run(run_dir, root, test_fraction=0.2)
    plan = json.loads((run_dir / "plan.json").read_text())
    assert plan["ignore_label"] == 2 and plan["num_classes"] == 2 and plan["labels"]["2"] > 0
    record = json.loads((run_dir / "run.json").read_text())
    assert json.dumps(record).count('"ignore_label": 2') >= 1
    fold = json.loads((run_dir / "validation" / "fold.json").read_text())
    assert fold["labels"]["ignore_label"] == 2
    out = tmp_path / "out"
    metrics = predict(predict_cfg(f"ckpt_path={run_dir / 'checkpoints' / 'last.ckpt'}", "split=test",
                                  f"output_dir={out}"))
    assert "dice_lesion" in metrics
    (mask,) = out.glob("case_??.nii.gz")  # nnU-Net's name for an nnU-Net dataset's case
    assert set(np.unique(np.asarray(nib.load(str(mask)).dataobj)).tolist()) <= {0, 1}
