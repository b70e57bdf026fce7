"""`model=survival` with its defaults learns lesion burden on real anatomy (slow): the MACE-style table of
`datamodules.sources.brain_outcomes` and the split that `benchmarks/training/survival_baselines.py real --spacing 8 8 8`
trains its arms on at seed 1, with the command its medvol arm types."""

from __future__ import annotations

import csv

import pytest

from datamodules.pipeline.split import make_split, save_split
from datamodules.sources.brain_outcomes import write_mace_brains
from medvol.run.training import run
from tests.conftest import compose_cfg

# Calibrated on this set and split (docs/benchmarks/training.md, "Survival on real anatomy", seed 1, the split where the
# defaults had been below the plain script): the defaults before test-time mirroring reach a test C-index of
# 0.440-0.464 here (two runs), the plain MONAI + torchsurv script 0.515, today's defaults 0.627; the oracle Cox
# model on the true lesion radius 0.755. Over the benchmark's five seeds today's defaults' spread is given there.
THRESHOLD = 0.56
SPLIT_SEED = 1


@pytest.mark.slow
# About 40 minutes on the shared 2-core machine under other sessions' load.
@pytest.mark.timeout(3600)
def test_the_default_survival_model_learns_lesion_burden_on_real_anatomy(tmp_path):
    pytest.importorskip("nilearn.datasets", reason="the MNI152 brains come from nilearn's wheel (the dev extra)")
    table = write_mace_brains(tmp_path / "mace", 96, spacing=(8.0, 8.0, 8.0), seed=0)
    with table.open(newline="") as handle:
        subjects = sorted(row["subject"] for row in csv.DictReader(handle))
    split = make_split(subjects, 0.15, 0.33, SPLIT_SEED)
    save_split(tmp_path / "split.json", split, SPLIT_SEED)
    metrics = run(compose_cfg(tmp_path / "run", [
        "model=survival", "dataset=csv", f"dataset.csv_path={table}", "dataset.covariate_columns=[age,sex]",
        f"dataset.split_file={tmp_path / 'split.json'}", "trainer.max_epochs=12", "test=true", f"seed={SPLIT_SEED}",
        "hardware=cpu", "callbacks.progress_bar=null", "logger=csv",
    ], tiny=False))
    with (tmp_path / "run" / "predictions" / "risks.csv").open() as handle:
        assert sorted(row["subject"] for row in csv.DictReader(handle)) == sorted(split["test"])
    assert metrics["test/cindex"] > THRESHOLD
