"""`ResumableCSVLogger` continues a resumed run's `metrics.csv` where Lightning's `CSVLogger` deletes it."""

from __future__ import annotations

import csv

from medvol.core.csv_logger import ResumableCSVLogger


def rows(path) -> list[dict[str, str]]:
    with path.open(newline="") as handle:
        return list(csv.DictReader(handle))


def logged(root, metrics: dict[str, float], step: int) -> None:
    """A fresh logger on the run directory `root` (as a resumed run makes one) that logs one row."""
    logger = ResumableCSVLogger(save_dir=str(root), name="", version="")
    logger.log_metrics(metrics, step=step)
    logger.save()


def test_a_resumed_runs_rows_are_appended_under_the_first_runs_rows(tmp_path):
    logged(tmp_path, {"val/loss": 0.5}, step=3)
    logged(tmp_path, {"val/loss": 0.25}, step=7)
    assert rows(tmp_path / "metrics.csv") == [{"step": "3", "val/loss": "0.5"}, {"step": "7", "val/loss": "0.25"}]


def test_a_new_metric_after_resume_widens_the_header_and_keeps_the_earlier_values(tmp_path):
    logged(tmp_path, {"val/loss": 0.5}, step=3)
    logged(tmp_path, {"val/loss": 0.25, "val/dice": 0.75}, step=7)
    assert rows(tmp_path / "metrics.csv") == [
        {"step": "3", "val/dice": "", "val/loss": "0.5"},
        {"step": "7", "val/dice": "0.75", "val/loss": "0.25"},
    ]


def test_a_fresh_run_directory_gets_a_file_with_its_own_header(tmp_path):
    logged(tmp_path / "run", {"train/loss": 1.5}, step=0)
    assert rows(tmp_path / "run" / "metrics.csv") == [{"step": "0", "train/loss": "1.5"}]
