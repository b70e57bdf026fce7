"""The mean of per-subject metric rows: what predict.py and a segmentation run's validation after training report.

A trained run's model is opened by `medvol.run.trained_run`."""

from __future__ import annotations

import math
from typing import Any


def mean_metrics(rows: list[dict[str, Any]]) -> dict[str, float]:
    """Per metric, the mean over the subjects where it is finite (HD95 is NaN for an empty mask)."""
    names = dict.fromkeys(key for row in rows for key in row if key != "subject")
    means = {}
    for name in names:
        values = [row[name] for row in rows if name in row and math.isfinite(row[name])]
        if values:
            means[name] = sum(values) / len(values)
    return means
