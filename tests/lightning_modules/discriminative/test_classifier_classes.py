"""`model=classifier` on the synthetic phantoms: classes split about evenly, both in every split, and a one-class set
is said out loud (NaN AUROC, one warning) with checkpoints chosen by the fallback metric."""

from __future__ import annotations

import csv
import logging
import math
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch
from scipy.stats import mannwhitneyu
from torchmetrics.classification import MulticlassAUROC

from datamodules.pipeline.split import make_split
from datamodules.sources.phantom import lesion_class
from lightning_modules.discriminative.classifier import set_auroc
from medvol.core.build import build
from medvol.run.training import run, sweep_objective
from tests.conftest import compose_cfg


def test_the_phantom_class_splits_the_generators_subjects_about_evenly():
    for seed in (0, 1):
        share = np.mean([lesion_class(seed, i) for i in range(150)])
        assert 0.4 <= share <= 0.6, (seed, share)


def test_the_default_synthetic_classifier_run_has_both_classes_in_val_and_test(tmp_path):
    cfg = compose_cfg(tmp_path, ["model=classifier"], tiny=False)
    datamodule = build(cfg.dataset)
    datamodule.setup("fit")
    for split in ("val", "test"):
        dataset = datamodule.datasets[split]
        classes = Counter(int(dataset[i]["class_label"]) for i in range(len(dataset)))
        assert set(classes) == {0, 1}, (split, classes)


def test_a_stratified_split_gives_every_split_each_strata_share():
    subjects = [f"s{i:02d}" for i in range(32)]
    strata = ["a"] * 20 + ["b"] * 12
    split = make_split(subjects, 0.125, 0.125, seed=0, strata=strata)
    by_subject = dict(zip(subjects, strata, strict=True))
    for name, size in (("val", 4), ("test", 4), ("train", 24)):
        counts = Counter(by_subject[s] for s in split[name])
        # 20/32 and 12/32 of the split, to within one subject.
        assert sum(counts.values()) == size
        assert abs(counts["a"] - size * 20 / 32) < 1 and abs(counts["b"] - size * 12 / 32) < 1
    assert sorted(split["val"] + split["test"] + split["train"]) == subjects
    # Without strata the split is the plain seeded cut it always was.
    assert make_split(subjects, 0.125, 0.125, seed=0) == make_split(subjects, 0.125, 0.125, seed=0, strata=None)


def _one_vs_rest_auroc(probabilities: torch.Tensor, labels: torch.Tensor, cls: int) -> float:
    """AUROC as the Mann-Whitney U statistic over (positive, negative) pairs."""
    scores = probabilities[:, cls].numpy()
    positive, negative = scores[labels.numpy() == cls], scores[labels.numpy() != cls]
    return mannwhitneyu(positive, negative).statistic / (len(positive) * len(negative))


def test_set_auroc_is_the_macro_over_the_classes_present_and_nan_for_one_class():
    generator = torch.Generator().manual_seed(0)
    probabilities = torch.rand(12, 3, generator=generator).softmax(1)
    labels = torch.tensor([0, 1, 0, 1, 1, 0, 0, 1, 1, 1, 0, 1])  # class 2 absent
    metric = MulticlassAUROC(3, average=None, thresholds=None)
    auroc = set_auroc(metric(probabilities, labels), torch.bincount(labels, minlength=3))
    reference = np.mean([_one_vs_rest_auroc(probabilities, labels, c) for c in (0, 1)])
    assert float(auroc) == pytest.approx(reference, abs=1e-6)
    one_class = torch.ones(12, dtype=torch.long)
    assert math.isnan(float(set_auroc(metric(probabilities, one_class), torch.bincount(one_class, minlength=3))))


def test_a_one_class_validation_set_is_nan_with_a_warning_and_checkpoints_fall_back_to_the_loss(tiny_cfg, tmp_path,
                                                                                                caplog):
    caplog.set_level(logging.WARNING, logger="medvol")
    # 8 phantoms: the validation set is one subject, so one class.
    metrics = run(tiny_cfg("model=classifier", "trainer.max_epochs=3", "logger=csv"))
    assert math.isnan(metrics["val/auroc"]) and math.isfinite(metrics["val/loss"])
    # A sweep gets the worst value for the metric's mode, never NaN.
    assert sweep_objective(metrics, "val/auroc", "max") == -math.inf
    assert sweep_objective(metrics, "val/auroc", "min") == math.inf
    assert sweep_objective(metrics, "val/loss", "min") == metrics["val/loss"]
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    single = [m for m in warnings if m.startswith("the val set holds a single class (class 0: ")]
    assert len(single) == 1 and " subjects): val/auroc is undefined" in single[0], warnings
    assert sum("chosen by `val/loss` (min) instead" in m for m in warnings) == 1, warnings
    # The best checkpoint is the epoch with the lowest validation loss, as the CSV log has it.
    rows = [r for r in csv.DictReader(next(Path(tmp_path).rglob("metrics.csv")).open()) if r.get("val/loss")]
    losses = [float(r["val/loss"]) for r in rows]
    best = min(range(len(losses)), key=losses.__getitem__)
    checkpoint = torch.load(tmp_path / "checkpoints" / "last.ckpt", weights_only=True)
    state = next(v for k, v in checkpoint["callbacks"].items() if k.startswith("StepCheckpoint"))
    assert state["falling_back"] and f"epoch{best:03d}" in Path(state["best_model_path"]).name
    assert float(state["best_model_score"]) == pytest.approx(losses[best], rel=1e-5)
    # The file names show the score that ranks them, not `scorenan`.
    names = sorted(p.name for p in (tmp_path / "checkpoints").glob("epoch*.ckpt"))
    assert names and all("nan" not in name for name in names), names
    assert f"score{losses[best]:.4f}" in Path(state["best_model_path"]).name
