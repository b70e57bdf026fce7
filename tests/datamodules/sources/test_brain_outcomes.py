"""The real-anatomy MACE table (datamodules/sources/brain_outcomes.py): lesion burden visible in the images, the hazard
of the stated proportional-hazards model, covariates without signal."""

from __future__ import annotations

import csv

import nibabel as nib
import numpy as np
import pytest

from datamodules.sources.brain_outcomes import LOG_HAZARD_PER_SD, RADIUS_MM, write_mace_brains


def test_the_table_lists_one_brain_per_row_whose_bright_voxels_follow_the_lesion_volume(tmp_path):
    pytest.importorskip("nilearn.datasets", reason="the MNI152 brains come from nilearn's wheel (the dev extra)")
    table = write_mace_brains(tmp_path / "mace", 8, spacing=(6.0, 6.0, 6.0), seed=3)
    with table.open(newline="") as handle:
        rows = list(csv.DictReader(handle))
    assert list(rows[0]) == ["subject", "image", "time", "event", "age", "sex", "lesion_radius_mm"]
    bright, volume = [], []
    for row in rows:
        image = nib.load(str(table.parent / row["image"]))
        assert image.shape == (33, 39, 32) and np.allclose(image.header.get_zooms(), 6.0)
        voxels = np.asarray(image.dataobj)
        body = voxels[voxels > 0]
        # The lesion (FLAIR 1.0) is the only tissue far above the body's mean (grey 0.6, white 0.5).
        bright.append(((voxels - body.mean()) / body.std() > 2.5).sum())
        volume.append(float(row["lesion_radius_mm"]) ** 3)
        assert RADIUS_MM[0] <= float(row["lesion_radius_mm"]) <= RADIUS_MM[1]
        assert float(row["time"]) > 0 and row["event"] in ("0", "1")
    assert np.corrcoef(bright, volume)[0, 1] > 0.95


@pytest.mark.slow
def test_a_cox_model_recovers_the_radius_hazard_and_finds_none_in_age_and_sex(tmp_path):
    pytest.importorskip("nilearn.datasets", reason="the MNI152 brains come from nilearn's wheel (the dev extra)")
    pd, lifelines = pytest.importorskip("pandas"), pytest.importorskip("lifelines")
    frame = pd.read_csv(write_mace_brains(tmp_path / "mace", 160, spacing=(8.0, 8.0, 8.0), seed=1))
    assert 0.25 < 1 - frame["event"].mean() < 0.5
    cox = lifelines.CoxPHFitter().fit(frame[["time", "event", "lesion_radius_mm", "age", "sex"]], "time", "event")
    per_mm = LOG_HAZARD_PER_SD / ((RADIUS_MM[1] - RADIUS_MM[0]) / np.sqrt(12.0))
    low, high = cox.confidence_intervals_.loc["lesion_radius_mm"]
    assert low < per_mm < high
    for noise in ("age", "sex"):
        low, high = cox.confidence_intervals_.loc[noise]
        assert low < 0 < high
