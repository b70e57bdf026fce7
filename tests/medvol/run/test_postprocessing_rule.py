"""Which recorded post-processing applies (issue 50): as nnU-Net, one chosen on cross-validation folds applies by
default; one chosen on a single run's validation split is written and applied only when asked."""

from __future__ import annotations

import json

import pytest

from lightning_modules.segmentation.postprocessing import ALL_FOREGROUND, Postprocessing, postprocessing_switch
from medvol.core.errors import MedvolError
from medvol.run.fold_records import applied_postprocessing, read_postprocessing

STEPS = [{"name": ALL_FOREGROUND, "values": [1, 2]}]
BY_HAND = Postprocessing((("core", (1,)),))


def record(folder, **extra):
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "postprocessing.json").write_text(json.dumps({"steps": STEPS, **extra}))
    return folder


def test_a_single_splits_choice_is_written_not_applied_unless_asked(tmp_path):
    run = record(tmp_path / "run", folds=1)
    applied, line = applied_postprocessing(run, "auto", Postprocessing())
    assert applied.steps == () and "not applied" in line and "postprocessing=true" in line
    # By hand (`model.largest_component=true`) stays where no recorded decision applies.
    applied, _ = applied_postprocessing(run, "auto", BY_HAND)
    assert applied.steps == BY_HAND.steps
    applied, line = applied_postprocessing(run, True, Postprocessing())
    assert applied.steps == ((ALL_FOREGROUND, (1, 2)),) and "one validation split" in line
    applied, line = applied_postprocessing(run, False, BY_HAND)
    assert applied.steps == () and "off" in line


def test_a_choice_made_on_cross_validation_folds_applies_by_default(tmp_path):
    sweep = record(tmp_path / "sweep", folds=5)
    applied, line = applied_postprocessing(sweep, "auto", BY_HAND)
    assert applied.steps == ((ALL_FOREGROUND, (1, 2)),) and "5 cross-validation folds" in line
    assert applied_postprocessing(sweep, False, BY_HAND)[0].steps == ()


def test_a_record_written_before_records_said_their_folds(tmp_path):
    # A sweep's (cross_validation.json beside it, two folds): chosen on the folds. A run's: on its split.
    sweep = record(tmp_path / "sweep")
    (sweep / "cross_validation.json").write_text(json.dumps({"folds": {"0": {}, "1": {}}}))
    assert read_postprocessing(sweep).folds == 2
    assert applied_postprocessing(sweep, "auto", Postprocessing())[0].steps == ((ALL_FOREGROUND, (1, 2)),)
    run = record(tmp_path / "run")
    assert read_postprocessing(run).folds == 1
    assert applied_postprocessing(run, "auto", Postprocessing())[0].steps == ()


def test_bad_switches_and_records_are_refused_in_one_line(tmp_path):
    with pytest.raises(MedvolError, match="`postprocessing=true`: no post-processing recorded"):
        applied_postprocessing(tmp_path, True, Postprocessing())
    with pytest.raises(MedvolError, match="`postprocessing=true`: no post-processing recorded"):
        applied_postprocessing(None, True, Postprocessing())
    for bad in ("yes", 1, None, "AUTO"):
        with pytest.raises(MedvolError, match="`model.postprocessing` is .*; expected auto"):
            postprocessing_switch(bad, "model.postprocessing")
    for bad in (0, "5", True, 10**6):
        run = record(tmp_path / f"bad{bad!s}", folds=bad)
        with pytest.raises(MedvolError, match="postprocessing.json: `folds` is"):
            read_postprocessing(run)
