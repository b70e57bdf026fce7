"""Cross-validation folds: test subjects in none, every other subject validated in exactly one fold, the split
file records them, and a resumed run keeps its fold."""

from __future__ import annotations

import json
from collections import Counter

import pytest
from omegaconf import open_dict

from datamodules.pipeline.split import fold_split, make_folds, make_split
from medvol.core.build import build
from medvol.core.errors import MedvolError
from tests.conftest import compose_cfg


def test_folds_hold_every_non_test_subject_once_and_no_test_subject():
    subjects = [f"s{i:02d}" for i in range(23)]
    split = make_split(subjects, 0.1, 0.2, seed=3)
    pool = split["train"] + split["val"]
    folds = make_folds(pool, 5, seed=3)
    counted = Counter(s for fold in folds for s in fold)
    assert set(counted) == set(pool) and set(counted.values()) == {1}
    assert not set(counted) & set(split["test"])
    assert len(pool) == 18 and sorted(len(f) for f in folds) == [3, 3, 4, 4, 4]
    runs = [fold_split(split, folds, k) for k in range(5)]
    # Each subject outside the test split is validated in exactly one of the five runs, and trained on in the others.
    assert Counter(s for r in runs for s in r["val"]) == Counter(pool)
    for r in runs:
        assert r["test"] == split["test"] and not set(r["train"]) & set(r["val"])
        assert sorted(r["train"] + r["val"]) == sorted(pool)


def test_stratified_folds_keep_each_strata_share():
    subjects = [f"s{i:02d}" for i in range(20)]
    strata = ["a" if i < 5 else "b" for i in range(20)]
    folds = make_folds(subjects, 5, seed=0, strata=strata)
    assert [sum(s in subjects[:5] for s in fold) for fold in folds] == [1] * 5


def test_bad_fold_values_are_refused():
    with pytest.raises(MedvolError, match="`dataset.num_folds` is 1"):
        make_folds(["a", "b"], 1, 0)
    with pytest.raises(MedvolError, match="too few for 5 folds"):
        make_folds(["a", "b", "c"], 5, 0)
    with pytest.raises(MedvolError, match=r"`dataset.fold` is 5; expected null or a fold index 0..4"):
        fold_split({"test": []}, [["a"]] * 5, 5)


def test_a_fold_run_records_its_folds_plans_from_every_fold_and_keeps_its_fold_on_resume(tmp_path):
    cfg = compose_cfg(tmp_path, ["model=segmentation", "dataset.num_subjects=12", "dataset.fold=2"])
    datamodule = build(cfg.dataset)
    datamodule.setup("fit")
    record = json.loads((tmp_path / "split.json").read_text())
    assert record["fold"] == 2 and len(record["folds"]) == 5
    assert record["val"] == record["folds"][2] and not set(record["test"]) & {s for f in record["folds"] for s in f}
    # The plan and the fingerprint read every fold's subjects, the same in all five runs.
    assert sorted(r["subject"] for r in datamodule.training_records()) == sorted(record["train"] + record["val"])
    with open_dict(cfg):
        cfg.dataset.fold = 3
    with pytest.raises(MedvolError, match="records the split of fold 2"):
        build(cfg.dataset).setup("fit")
