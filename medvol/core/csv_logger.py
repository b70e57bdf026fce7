"""A CSV logger that continues a resumed run's `metrics.csv` instead of deleting it (Lightning's default), and never
writes through a link in a run folder (`medvol.core.run_files`)."""

from __future__ import annotations

import csv
from pathlib import Path
from typing import Any

from pytorch_lightning.loggers import CSVLogger
from pytorch_lightning.loggers.csv_logs import ExperimentWriter
from pytorch_lightning.loggers.logger import rank_zero_experiment

from medvol.core.run_files import writable_path


class _AppendingWriter(ExperimentWriter):
    def __init__(self, log_dir: str, root: str) -> None:
        self.root = Path(root)
        super().__init__(log_dir)

    def _refuse_links(self) -> None:
        for name in (self.NAME_METRICS_FILE, self.NAME_HPARAMS_FILE):
            writable_path(self.root, Path(self.log_dir) / name)

    def log_hparams(self, params: dict[str, Any]) -> None:
        self._refuse_links()
        super().log_hparams(params)

    def save(self) -> None:
        self._refuse_links()
        super().save()

    def _check_log_dir_exists(self) -> None:
        self._refuse_links()
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
            self._experiment = _AppendingWriter(log_dir=self.log_dir, root=self.save_dir)
        return self._experiment
