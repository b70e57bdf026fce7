"""A MACE-style table: image path column(s), follow-up `time` and `event`, optional covariates and class label.

Paths in the table are relative to the table's folder (or absolute). Each row is a subject.
Batch keys besides `image`: `time` and `event` (float32 scalars), `covariates` (float32
vector of `covariate_columns`), `class_label` (int64 scalar of `class_column`).
"""

from __future__ import annotations

import csv
import math
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from monai.transforms import EnsureTyped

from datamodules.pipeline.check import LABEL_KEY, Problem
from datamodules.pipeline.volume_datamodule import Record
from datamodules.sources.nifti import NiftiDataModule
from medvol.core.errors import MedvolError


def _number(value: Any) -> float | None:
    try:
        number = float(str(value).strip())
    except (TypeError, ValueError):
        return None
    return number if math.isfinite(number) else None


class CsvDataModule(NiftiDataModule):
    """Subjects from the rows of a CSV table.

    Args:
        csv_path: the table.
        image_modalities: path columns stacked into `image`.
        cond_modalities: path columns stacked into `cond`.
        label_column: path column of a label map, or null.
        subject_column: column of unique subject ids; null numbers the rows.
        time_column: follow-up time (>= 0), or null for tables without survival outcomes.
        event_column: event indicator (0 censored, 1 event), or null.
        covariate_columns: numeric columns gathered into `covariates`.
        class_column: integer class column gathered into `class_label`, or null.
        **kwargs: transforms, split, loader and cache settings of `NiftiDataModule`.
    """

    def __init__(
        self,
        csv_path: str,
        image_modalities: Sequence[str] = ("image",),
        cond_modalities: Sequence[str] = (),
        label_column: str | None = None,
        subject_column: str | None = "subject",
        time_column: str | None = "time",
        event_column: str | None = "event",
        covariate_columns: Sequence[str] = (),
        class_column: str | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(image_modalities=image_modalities, cond_modalities=cond_modalities, **kwargs)
        self.csv_path = Path(csv_path).expanduser()
        self.label_column = label_column
        self.subject_column = subject_column
        self.time_column = time_column
        self.event_column = event_column
        self.covariate_columns = list(covariate_columns)
        self.class_column = class_column

    def _columns(self) -> list[str]:
        optional = [self.label_column, self.subject_column, self.time_column, self.event_column, self.class_column]
        return [*self.channel_names(), *[c for c in optional if c], *self.covariate_columns]

    def list_subjects(self) -> tuple[list[Record], list[Problem]]:
        if not self.csv_path.is_file():
            raise MedvolError(f"`dataset.csv_path`: no file at {self.csv_path}; expected a CSV table with a header row")
        try:
            with self.csv_path.open(newline="") as handle:
                reader = csv.DictReader(handle)
                rows = list(reader)
                header = reader.fieldnames or []
        except (OSError, csv.Error, UnicodeDecodeError) as err:
            raise MedvolError(f"`dataset.csv_path`: cannot read {self.csv_path} ({err})") from err
        missing = [c for c in self._columns() if c not in header]
        if missing:
            raise MedvolError(
                f"`dataset.csv_path`: {self.csv_path} has no column {missing[0]!r}; its columns are {header}"
            )
        records, problems = [], []
        for number, row in enumerate(rows, start=2):  # row 1 is the header
            where = f"{self.csv_path.name}:{number}"
            subject = str(row[self.subject_column]).strip() if self.subject_column else f"row-{number:05d}"
            if not subject:
                problems.append(Problem(f"row {number}", where, f"empty subject id in column {self.subject_column!r}"))
                subject = f"row-{number:05d}"
            files = {name: self._resolve(self.csv_path.parent, row.get(name)) for name in self.channel_names()}
            if self.label_column:
                files[LABEL_KEY] = self._resolve(self.csv_path.parent, row.get(self.label_column))
            record = self.make_record(subject, files)
            problems += self._row_values(record, row, subject, where)
            records.append(record)
        return records, problems

    def _row_values(self, record: Record, row: dict[str, Any], subject: str, where: str) -> list[Problem]:
        """Parse the outcome and covariate cells into `record`; every bad cell is a problem."""
        problems = []
        if self.time_column:
            time = _number(row[self.time_column])
            if time is None or time < 0:
                problems.append(
                    Problem(subject, where, f"{self.time_column}={row[self.time_column]!r}: expected a number >= 0")
                )
            record["time"] = time if time is not None else float("nan")
        if self.event_column:
            event = _number(row[self.event_column])
            if event not in (0.0, 1.0):
                problems.append(
                    Problem(subject, where, f"{self.event_column}={row[self.event_column]!r}: expected 0 or 1")
                )
            record["event"] = event if event is not None else float("nan")
        if self.covariate_columns:
            values = [_number(row[c]) for c in self.covariate_columns]
            for column, value in zip(self.covariate_columns, values, strict=True):
                if value is None:
                    problems.append(Problem(subject, where, f"{column}={row[column]!r}: expected a number"))
            record["covariates"] = [v if v is not None else float("nan") for v in values]
        if self.class_column:
            value = _number(row[self.class_column])
            if value is None or value != int(value) or value < 0:
                problems.append(
                    Problem(
                        subject, where, f"{self.class_column}={row[self.class_column]!r}: expected a class index >= 0"
                    )
                )
            record["class_label"] = int(value) if value is not None and value == int(value) else -1
        for name, path in record["files"].items():
            if path is None:
                column = self.label_column if name == LABEL_KEY else name
                problems.append(Problem(subject, where, f"empty path in column {column!r}"))
        return problems

    def source(self) -> str:
        return str(self.csv_path)

    def split_outcomes(self, stage: str) -> dict[str, Any]:
        """The outcome columns of every subject of split `stage` (all ranks' subjects, in split order).

        Models take training-split statistics (covariate mean/std) and checks (events, classes)
        from it without loading a volume. Keys: `source` (the table's name), `subject`, and
        where configured `time`, `event` (N,), `covariates` (N, K) float64, `class_label` (N,) int64.
        """
        if self.split is None:
            self.setup()
        assert self.split is not None
        by_id = {str(r["subject"]): r for r in self.subjects()}
        records = [by_id[s] for s in self.split[stage]]
        table: dict[str, Any] = {"source": self.csv_path.name, "subject": [str(r["subject"]) for r in records]}
        for key, dtype in (("time", torch.float64), ("event", torch.float64), ("class_label", torch.int64)):
            if key in (records[0] if records else {}):
                table[key] = torch.tensor([r[key] for r in records], dtype=dtype)
        if self.covariate_columns:
            table["covariates"] = torch.tensor([r["covariates"] for r in records], dtype=torch.float64).reshape(
                len(records), len(self.covariate_columns)
            )
        return table

    def data_problems(self, full: bool) -> tuple[list[Problem], int]:
        problems, count = super().data_problems(full)
        # An empty path cell is already reported against its row; drop the generic "missing file" twin.
        return [p for p in problems if not p.file.startswith("<")], count

    def extra_deterministic(self) -> list[Callable]:
        steps: list[Callable] = []
        floats = [k for k in ("time", "event", "covariates") if self._has(k)]
        if floats:
            steps.append(EnsureTyped(floats, dtype=torch.float32, track_meta=False))
        if self.class_column:
            steps.append(EnsureTyped(["class_label"], dtype=torch.int64, track_meta=False))
        return steps

    def _has(self, key: str) -> bool:
        return (
            {"time": self.time_column, "event": self.event_column, "covariates": self.covariate_columns}[key]
            not in (None, [])
        )

    def cache_key(self) -> dict[str, Any]:
        return {**super().cache_key(), "columns": self._columns()}
