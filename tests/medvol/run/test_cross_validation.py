"""Cross-validation: each fold run validates on the source grid after training, the sweep is summarised once, and
predict.py averages the folds' probabilities (the ensemble equals the members' mean)."""

from __future__ import annotations

import csv
import json

import nibabel as nib
import numpy as np
import pytest
import torch
from omegaconf import OmegaConf

from lightning_modules.segmentation.segmentation import Segmenter
from medvol.core.errors import MedvolError
from medvol.run.cross_validation import CrossValidationSummary, summarise_sweep
from medvol.run.ensemble import Ensemble
from medvol.run.fold_records import fold_checkpoints
from medvol.run.predicting import predict
from medvol.volumes.sliding_window import SlidingWindow
from tests.conftest import compose_cfg
from tests.medvol.run.test_predict import predict_cfg, saved_run

FOLD_RUN = [
    "model=segmentation", "dataset.num_subjects=10", "dataset.test_fraction=0.2", "dataset.num_folds=2",
    "logger=none", "callbacks.volume_slices=null", "model.regions={lesion:[1,2],core:[1]}",
]


def test_the_ensemble_takes_the_softmax_of_the_mean_of_its_members_logits():
    """nnU-Net v2 averages its folds' logits (`predict_logits_from_preprocessed_data`) and takes the softmax after."""
    torch.manual_seed(0)
    members = [Segmenter(in_channels=1, num_classes=3, features=[4, 8], patch_size=[8, 8, 8], tta=False).eval()
               for _ in range(3)]
    image = torch.randn(1, 1, 8, 8, 8)
    window = SlidingWindow.of([8, 8, 8])
    with torch.no_grad():
        outputs = Ensemble(members).predict_volumes({"image": image}, window, ["probabilities"])
        # The window is the whole volume: each member's logits are its network's.
        logits = torch.stack([m.net(image) for m in members])
    expected = torch.softmax(logits.mean(0), 1)
    torch.testing.assert_close(outputs["volumes"]["probabilities"], expected)
    # The mean of the members' softmax (medvol's rule before) is another distribution.
    assert not torch.allclose(torch.softmax(logits, 2).mean(0), expected, atol=1e-4)
    assert torch.equal(outputs["volumes"]["seg"], expected.argmax(1, keepdim=True))
    with pytest.raises(MedvolError, match="at least one checkpoint"):
        Ensemble([])


@pytest.fixture(scope="module")
def sweep(tmp_path_factory):
    """Two fold runs of one split, as `python train.py -m ... dataset.fold=0,1` writes them into its sweep."""
    root = tmp_path_factory.mktemp("sweep")
    for fold in (0, 1):
        run_dir = root / str(fold)
        saved_run(run_dir, compose_cfg(run_dir, [*FOLD_RUN, f"dataset.fold={fold}"]))
    return root


def test_each_fold_validates_once_on_its_own_fold_and_the_sweep_is_summarised(sweep):
    records = [json.loads((sweep / str(k) / "split.json").read_text()) for k in (0, 1)]
    assert records[0]["folds"] == records[1]["folds"] and records[0]["test"] == records[1]["test"]
    for k in (0, 1):
        fold = json.loads((sweep / str(k) / "validation" / "fold.json").read_text())
        assert fold["fold"] == k and sorted(fold["subjects"]) == records[k]["val"] == records[k]["folds"][k]
        assert (sweep / str(k) / "postprocessing.json").is_file()
    CrossValidationSummary().on_multirun_end(config=OmegaConf.create({"hydra": {"sweep": {"dir": str(sweep)}}}))
    summary = json.loads((sweep / "cross_validation.json").read_text())
    rows = [row for k in (0, 1) for row in csv.DictReader((sweep / str(k) / "validation" / "metrics.csv").open())]
    # Every non-test subject once, scored by the fold that did not train on it.
    assert sorted(r["subject"] for r in rows) == sorted(s for f in records[0]["folds"] for s in f)
    for name in ("dice_lesion", "dice_core"):
        assert summary["all_subjects"][name] == pytest.approx(np.mean([float(r[name]) for r in rows]))
        per_fold = [np.mean([float(r[name]) for r in csv.DictReader(
            (sweep / str(k) / "validation" / "metrics.csv").open())]) for k in (0, 1)]
        assert [summary["folds"][str(k)][name] for k in (0, 1)] == pytest.approx(per_fold)
    assert json.loads((sweep / "postprocessing.json").read_text()) == summary["postprocessing"]
    assert summary["postprocessing"]["subjects"] == len(rows)


def test_predict_with_the_sweep_averages_the_folds(sweep, tmp_path):
    checkpoints = fold_checkpoints(sweep)
    assert len(checkpoints) == 2
    out = tmp_path / "out"
    predict(predict_cfg(f"run_dir={sweep}", "split=test", f"output_dir={out}", "save_probabilities=true"))
    one = tmp_path / "one"
    predict(predict_cfg(f"ckpt_path={checkpoints[0]}", "split=test", f"output_dir={one}", "save_probabilities=true"))
    test_subjects = json.loads((sweep / "0" / "split.json").read_text())["test"]
    assert sorted(p.name for p in out.glob("*_seg.nii.gz")) == sorted(f"{s}_seg.nii.gz" for s in test_subjects)
    subject = test_subjects[0]
    ensemble = nib.load(str(out / f"{subject}_probabilities.nii.gz")).get_fdata()
    single = nib.load(str(one / f"{subject}_probabilities.nii.gz")).get_fdata()
    assert ensemble.shape == single.shape and not np.allclose(ensemble, single)
    with pytest.raises(MedvolError, match="`run_dir` and `ckpt_path` are both set"):
        predict(predict_cfg(f"run_dir={sweep}", f"ckpt_path={checkpoints[0]}", "split=test", f"output_dir={out}"))
    with pytest.raises(MedvolError, match="holds no validated cross-validation runs"):
        predict(predict_cfg(f"run_dir={tmp_path}", "split=test", f"output_dir={out}"))


def test_predict_applies_a_choice_made_on_the_folds_and_not_one_made_on_a_single_split(sweep, tmp_path):
    """A fold run predicted alone: its own decision (chosen on its one validation fold) is written, not applied;
    the sweep's ensemble: the decision chosen on both folds applies (nnU-Net's rule); `postprocessing=` overrides."""
    record = {"steps": [{"name": "all foreground", "values": [1, 2]}]}
    own = sweep / "0" / "postprocessing.json"
    kept = own.read_text()
    (sweep / "postprocessing.json").write_text(json.dumps({**record, "folds": 2}))
    try:
        own.write_text(json.dumps({**record, "folds": 1}))
        checkpoint = fold_checkpoints(sweep)[0]
        lines = {}
        for name, overrides in (("single", [f"ckpt_path={checkpoint}"]), ("asked", [f"ckpt_path={checkpoint}",
                                "postprocessing=true"]), ("folds", [f"run_dir={sweep}"]),
                                ("off", [f"run_dir={sweep}", "postprocessing=false"])):
            out = tmp_path / name
            predict(predict_cfg(*overrides, "split=test", f"output_dir={out}"))
            lines[name] = next(x for x in (out / "predict.log").read_text().splitlines() if "post-processing" in x)
    finally:
        own.write_text(kept)
    assert "not applied" in lines["single"] and "all foreground" in lines["single"]
    assert "chosen on one validation split, postprocessing=true" in lines["asked"]
    assert "chosen on 2 cross-validation folds" in lines["folds"]
    assert "post-processing: off" in lines["off"]
    with pytest.raises(MedvolError, match="`postprocessing` is 'sometimes'; expected auto"):
        predict(predict_cfg(f"run_dir={sweep}", "postprocessing=sometimes", "split=test",
                            f"output_dir={tmp_path / 'bad'}"))


def test_a_sweep_without_folds_is_left_alone(tmp_path):
    assert summarise_sweep(tmp_path) is None and not (tmp_path / "cross_validation.json").exists()


@pytest.mark.slow
def test_a_fold_sweep_on_the_command_line_writes_its_cross_validation_once(tmp_path):
    from tests.conftest import TINY_COMMON, TINY_MODEL
    from tests.ddp_support import explain, train_cli

    sweep = tmp_path / "sweep"
    done = train_cli(
        ["-m", *TINY_COMMON, *TINY_MODEL["segmentation"], *FOLD_RUN, "dataset.fold=0,1",
         f"hydra.sweep.dir={sweep}"], cwd=tmp_path, tiny=False, timeout=1200,
    )
    assert done.returncode == 0, explain(done)
    summary = json.loads((sweep / "cross_validation.json").read_text())
    assert sorted(summary["folds"]) == ["0", "1"] and (sweep / "postprocessing.json").is_file()
    assert "cross-validation of 2 folds" in done.stdout + done.stderr


def test_mean_metrics_leave_out_undefined_values():
    from medvol.run.trained_model import mean_metrics

    rows = [{"subject": "a", "dice_x": 0.5, "hd95_x": float("nan")}, {"subject": "b", "dice_x": 1.0, "hd95_x": 4.0}]
    assert mean_metrics(rows) == {"dice_x": 0.75, "hd95_x": 4.0}
