"""A validation or test split too small for its metric is named in a warning (issue 63 item 9)."""

from __future__ import annotations

import logging

from datamodules.pipeline.split import make_split


def test_a_split_under_ten_subjects_or_five_events_is_warned_about(caplog):
    subjects = [f"s{k:02d}" for k in range(40)]
    with caplog.at_level(logging.WARNING, logger="medvol"):
        make_split(subjects, 0.1, 0.1, 0)
    lines = [r.getMessage() for r in caplog.records]
    assert any(line.startswith("split: the val split holds 4 subjects (under 10 subjects)") for line in lines)
    assert any(line.startswith("split: the test split holds 4 subjects") for line in lines)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="medvol"):
        make_split([f"s{k:03d}" for k in range(200)], 0.1, 0.1, 0)
    assert not caplog.records
    # Survival: 20 subjects a split, but few events among them.
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="medvol"):
        make_split([f"s{k:03d}" for k in range(200)], 0.1, 0.1, 0, events=[k % 20 == 0 for k in range(200)])
    assert any("events (under 10 subjects or 5 events)" in r.getMessage() for r in caplog.records)


def test_a_survival_datasets_split_is_warned_about_by_its_events(caplog):
    # The dataset passes each subject's event to the split (a CSV's `event` column): 200 subjects, 1 in 20 an event.
    from datamodules.pipeline.volume_datamodule import VolumeDataModule

    class Table(VolumeDataModule):
        def subjects(self):
            return [{"subject": f"s{k:03d}", "event": int(k % 20 == 0), "time": 1.0} for k in range(200)]

    with caplog.at_level(logging.WARNING, logger="medvol"):
        Table().assign_split()
    assert any("events (under 10 subjects or 5 events)" in r.getMessage() for r in caplog.records)
