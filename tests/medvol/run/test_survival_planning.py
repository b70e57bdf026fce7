"""A survival run on a CSV table: the plan from the data (medvol/run/survival_planning.py) applied, printed, written and
read back by predict.py; what the test writes (risks with covariates and survival probabilities, the Kaplan-Meier
figure, the Brier score); predict.py on new scans with the covariates beside them."""

from __future__ import annotations

import csv
import json
import logging
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from datamodules.sources.example_data import write_mace_csv
from lightning_modules.discriminative.risk_groups import risk_groups
from lightning_modules.discriminative.survival import KM_FILE, KM_TAG
from lightning_modules.discriminative.survival_metrics import breslow_baseline, survival_probabilities
from medvol.core.errors import MedvolError
from medvol.run.predicting import predict
from medvol.run.survival_planning import with_survival_plan
from medvol.run.training import run
from medvol.volumes.plan import read_plan
from tests.conftest import compose_cfg
from tests.medvol.run.test_predict import predict_cfg, saved_run

SUBJECTS = 24


def rows(path: Path) -> list[dict[str, str]]:
    with path.open(newline="") as handle:
        return list(csv.DictReader(handle))


def overrides(table: Path, *extra: str) -> list[str]:
    return [
        "model=survival", "dataset=csv", f"dataset.csv_path={table}", "dataset.covariate_columns=[age,sex]",
        "hardware=cpu", "callbacks.progress_bar=null", "callbacks.model_summary=null", "callbacks.volume_slices=null",
        "trainer.max_epochs=2", "dataset.val_fraction=0.25", "dataset.test_fraction=0.25", "model.backbone=resnet10",
        "model.widen_factor=0.125", "model.horizons=[12,24]", "logger=tensorboard", "test=true", *extra,
    ]


class Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


@pytest.fixture(scope="module")
def survival_run(tmp_path_factory) -> tuple[Path, Path]:
    """A run on 24 CT phantoms (16^3 at 2 mm) with age and sex; its table and its run folder (the console's lines
    in `console.txt`)."""
    root = tmp_path_factory.mktemp("survival")
    table = write_mace_csv(root / "mace", SUBJECTS, 16)
    lines, logger = Lines(), logging.getLogger("medvol")
    level = logger.level
    logger.addHandler(lines)
    logger.setLevel(logging.INFO)
    try:
        run_dir = saved_run(root / "run", compose_cfg(root / "run", overrides(table), tiny=False))
    finally:
        logger.removeHandler(lines)
        logger.setLevel(level)
    (run_dir / "console.txt").write_text("\n".join(lines.lines))
    return table, run_dir


def test_the_plan_is_made_from_the_training_subjects_printed_and_applied(survival_run):
    table, run_dir = survival_run
    plan = read_plan(run_dir / "plan.json")
    split = json.loads((run_dir / "split.json").read_text())
    train = [r for r in rows(table) if r["subject"] in set(split["train"])]
    rate = np.mean([float(r["event"]) for r in train])
    # 12 training subjects: ceil(5 / rate) wanted for ~5 events a batch, at least 4, at most half of them (6).
    assert plan["family"] == "survival" and plan["subjects"] == len(train) == 12
    assert plan["event_rate"] == pytest.approx(rate, abs=1e-4)
    assert plan["batch_size"] == min(max(4, int(np.ceil(5 / rate))), 6)
    # The phantoms are written at 2 mm, their bodies fill at most 16^3 voxels; CT (air at -1000 HU).
    assert plan["spacing"] == [2.0, 2.0, 2.0] and plan["spatial_size"] == [16, 16, 16]
    assert [c["kind"] for c in plan["normalization"]] == ["ct"]
    log = (run_dir / "console.txt").read_text()
    assert f"plan: batch {plan['batch_size']} (training event rate" in log
    assert "`dataset.transforms.spatial_size` [64, 64, 64] gives way to the plan's [16, 16, 16]" in log
    assert f"`dataset.batch_size` 2 gives way to the plan's {plan['batch_size']}" in log
    applied = with_survival_plan(compose_cfg(run_dir, overrides(table), tiny=False), plan)
    assert applied.dataset.batch_size == plan["batch_size"] and applied.dataset.transforms.intensity == "zscore"
    assert applied.dataset.transforms.crop_foreground is True and applied.dataset.transforms.flip_prob == 0.5
    # The plan flips the training volumes, so held-out risks are the mean of the mirrored copies.
    assert applied.model.tta is True
    # No scheduler in the model config: a cosine decay to 0 over the run's 2 epochs.
    assert applied.model.scheduler == {"_target_": "torch.optim.lr_scheduler.CosineAnnealingLR", "_partial_": True,
                                       "T_max": 2}
    assert "plan: learning rate: cosine decay to 0 over 2 epochs" in log


def test_model_plan_values_are_used_instead_and_use_false_keeps_the_config(tmp_path):
    table = write_mace_csv(tmp_path / "mace", 12, 16)
    cfg = compose_cfg(tmp_path / "a", overrides(table, "model.plan.batch_size=3", "dataset.transforms.spacing=[4,4,4]",
                                                 "model.plan.flip_prob=0", "train=false", "test=false"), tiny=False)
    run(cfg)
    plan = read_plan(tmp_path / "a" / "plan.json")
    assert (plan["batch_size"], plan["spacing"], plan["flip_prob"]) == (3, [4.0, 4.0, 4.0], 0.0)
    assert plan["overridden"] == ["batch_size", "flip_prob", "spacing"]
    # No training flips, no test-time mirroring.
    assert with_survival_plan(cfg, plan).model.tta is False
    run(compose_cfg(tmp_path / "b", overrides(table, "model.plan.use=false", "train=false", "test=false"), tiny=False))
    assert not (tmp_path / "b" / "plan.json").exists()


def test_risks_hold_each_subjects_covariates_and_survival_from_the_checkpoints_baseline(survival_run):
    table, run_dir = survival_run
    by_subject = {r["subject"]: r for r in rows(table)}
    risks = rows(run_dir / "predictions" / "risks.csv")
    assert list(risks[0]) == ["subject", "risk", "time", "event", "age", "sex", "survival@12", "survival@24", "split"]
    for row in risks:
        assert float(row["age"]) == float(by_subject[row["subject"]]["age"])
        assert float(row["sex"]) == float(by_subject[row["subject"]]["sex"])
    # The survival columns come from Breslow's baseline of the validation subjects at the tested checkpoint's
    # weights (their risks from predict.py on the val split), which the checkpoint keeps.
    summary = json.loads((run_dir / "summary.json").read_text())
    out = run_dir.parent / "val"
    predict(predict_cfg(f"ckpt_path={summary['best_checkpoint']}", "split=val", f"output_dir={out}"))
    val = rows(out / "predictions.csv")
    baseline = breslow_baseline(*(torch.tensor([float(r[k]) for r in val]) for k in ("risk", "time", "event")))
    risk = torch.tensor([float(r["risk"]) for r in risks], dtype=torch.float64)
    expected = survival_probabilities(risk, *baseline, torch.tensor([12.0, 24.0])).numpy()
    np.testing.assert_allclose([[float(r["survival@12"]), float(r["survival@24"])] for r in risks], expected,
                               atol=1e-5)
    assert [list(r)[-3:-1] for r in val[:1]] == [["survival@12", "survival@24"]]
    assert "test/ibs" in summary["metrics"]


def test_the_kaplan_meier_figure_of_the_test_risk_groups_is_written_and_logged(survival_run):
    _, run_dir = survival_run
    risks = rows(run_dir / "predictions" / "risks.csv")
    figure = np.asarray(Image.open(run_dir / "predictions" / KM_FILE))
    assert figure.shape == (520, 760, 3)
    expected = risk_groups(np.array([float(r["risk"]) for r in risks]), np.array([float(r["time"]) for r in risks]),
                           np.array([float(r["event"]) for r in risks]))
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["metrics"]["test/logrank_p"] == pytest.approx(expected.p_value, rel=1e-5)
    events = EventAccumulator(str(next((run_dir / "tensorboard").rglob("events.out.tfevents.*")).parent),
                              size_guidance={"images": 0})
    events.Reload()
    assert KM_TAG in events.Tags()["images"]


def test_predict_gives_new_scans_the_test_risk_with_the_covariates_beside_them(survival_run, tmp_path):
    table, run_dir = survival_run
    by_subject = {r["subject"]: r for r in rows(table)}
    tested = rows(run_dir / "predictions" / "risks.csv")
    scans = tmp_path / "scans"
    scans.mkdir()
    for row in tested:
        shutil.copy(table.parent / by_subject[row["subject"]]["image"], scans / f"{row['subject']}.nii.gz")
    ckpt = f"ckpt_path={json.loads((run_dir / 'summary.json').read_text())['best_checkpoint']}"
    with pytest.raises(MedvolError, match=r"`covariates`: the model takes covariates \['age', 'sex'\]: none given"):
        predict(predict_cfg(ckpt, f"input={scans}", f"output_dir={tmp_path / 'none'}"))
    assert not (tmp_path / "none").exists()
    with (scans / "covariates.csv").open("w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(["subject", "sex", "age"])
        writer.writerows([r["subject"], by_subject[r["subject"]]["sex"], by_subject[r["subject"]]["age"]]
                         for r in tested)
    predict(predict_cfg(ckpt, f"input={scans}", f"output_dir={tmp_path / 'out'}"))
    predicted = {r["subject"]: r for r in rows(tmp_path / "out" / "predictions.csv")}
    for row in tested:
        assert float(predicted[row["subject"]]["risk"]) == pytest.approx(float(row["risk"]), abs=1e-5)
        assert predicted[row["subject"]]["age"] == row["age"]
    # Test and predict.py both mirrored (equal above); one call per scan gives other risks.
    predict(predict_cfg(ckpt, f"input={scans}", f"output_dir={tmp_path / 'once'}", "tta=false"))
    once = {r["subject"]: float(r["risk"]) for r in rows(tmp_path / "once" / "predictions.csv")}
    assert max(abs(once[s] - float(r["risk"])) for s, r in predicted.items()) > 1e-5
    # Other covariates, another risk: the table beside the scans is what the model read.
    older = tmp_path / "older.csv"
    older.write_text("subject,age,sex\n" + "".join(f"{r['subject']},{float(r['age']) + 40},{r['sex']}\n"
                                                     for r in tested))
    predict(predict_cfg(ckpt, f"input={scans}", f"covariates={older}", f"output_dir={tmp_path / 'older'}"))
    moved = rows(tmp_path / "older" / "predictions.csv")
    assert max(abs(float(r["risk"]) - float(predicted[r["subject"]]["risk"])) for r in moved) > 1e-4


@pytest.mark.parametrize(("content", "message"), [
    ("subject,age\n", "has no column 'sex'; expected columns subject, age, sex"),
    ("subject,age,sex\nother,60,1\n", "has no row for subject"),
    ("subject,age,sex\n{first},sixty,1\n", ":2: age='sixty': expected a number"),
])
def test_a_covariate_table_that_cannot_serve_the_inputs_is_one_line(survival_run, tmp_path, content, message):
    table, run_dir = survival_run
    scans = tmp_path / "scans"
    scans.mkdir()
    first = rows(table)[0]
    shutil.copy(table.parent / first["image"], scans / f"{first['subject']}.nii.gz")
    (tmp_path / "given.csv").write_text(content.format(first=first["subject"]))
    ckpt = f"ckpt_path={json.loads((run_dir / 'summary.json').read_text())['best_checkpoint']}"
    with pytest.raises(MedvolError, match="`covariates`: ") as error:
        predict(predict_cfg(ckpt, f"input={scans}", f"covariates={tmp_path / 'given.csv'}",
                            f"output_dir={tmp_path / 'out'}"))
    assert message in str(error.value) and not (tmp_path / "out").exists()
