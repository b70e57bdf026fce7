"""What a resume's command changes: the values that differ between the run's recorded overrides composed and those
with the command's (medvol.run.resume), checked against hand-made trees."""

from __future__ import annotations

from omegaconf import OmegaConf

from medvol.run.run_record import _changes, _set


def test_the_changes_are_the_leaves_that_differ_and_the_keys_dropped():
    before = {"trainer": {"max_epochs": 1, "devices": 1}, "model": {"lr": 1e-3, "old": 2}, "ckpt_path": None}
    after = {"trainer": {"max_epochs": 20, "devices": 1}, "model": {"lr": 1e-3, "new": [1, 2]}, "ckpt_path": "x"}
    changes = _changes(after, before, [])
    assert sorted((k, v) for k, v in changes if v is not ...) == [
        (["ckpt_path"], "x"), (["model", "new"], [1, 2]), (["trainer", "max_epochs"], 20)]
    assert [k for k, v in changes if v is ...] == [["model", "old"]]
    record = OmegaConf.create({"trainer": {"max_epochs": 1, "devices": 1, "planned": 3}, "model": {"old": 2},
                               "ckpt_path": None})
    for key, value in changes:
        _set(record, key, value)
    assert OmegaConf.to_container(record) == {
        "trainer": {"max_epochs": 20, "devices": 1, "planned": 3}, "model": {"new": [1, 2]}, "ckpt_path": "x"}
