"""A CSV logger that continues a resumed run's `metrics.csv` instead of deleting it (Lightning's default)."""

from __future__ import annotations

import csv

from pytorch_lightning.loggers import CSVLogger
from pytorch_lightning.loggers.csv_logs import ExperimentWriter
from pytorch_lightning.loggers.logger import rank_zero_experiment


class _AppendingWriter(ExperimentWriter):
    def _check_log_dir_exists(self) -> None:
        # Keep earlier rows: adopt the existing header so new rows are appended under it.
        if self._fs.isfile(self.metrics_file_path):
            with self._fs.open(self.metrics_file_path, "r", newline="") as file:
                self.metrics_keys = sorted(next(csv.reader(file), []))


class ResumableCSVLogger(CSVLogger):
    """`CSVLogger` whose `metrics.csv` survives `ckpt_path=` resumes; same arguments."""

    @property
    @rank_zero_experiment
    def experiment(self) -> ExperimentWriter:
        if self._experiment is None:
            self._fs.makedirs(self.root_dir, exist_ok=True)
            self._experiment = _AppendingWriter(log_dir=self.log_dir)
        return self._experiment
