"""medvol's TensorBoard logger: an HPARAMS tab that compares runs by the metric they optimise, and cheap flushes."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from pytorch_lightning.loggers import TensorBoardLogger
from pytorch_lightning.loggers.logger import rank_zero_experiment
from pytorch_lightning.utilities import rank_zero_only

from medvol.core.run_files import writable_path


class MedvolTensorBoardLogger(TensorBoardLogger):
    """`TensorBoardLogger` (same arguments) with hparams tied to `optimized_metric` and throttled flushes.

    The hyperparameters are recorded with two metric columns, `hp_metric` and the optimized
    metric itself; `hp_metric` follows every value logged for the optimized metric. Lightning's
    `epoch` scalar (a one-point chart for short runs) is left out: the step axis is documented
    in `medvol.core.step`.

    `save()`, which Lightning calls after every logging step, writes to disk at most every
    `flush_seconds`; the event writer also flushes on its own and at the end of the run. A flush
    cost about 30 ms on a busy shared disk, every `log_every_n_steps` steps: the largest fixed
    cost of medvol's training step (see benchmarks/training/overhead.py).

    TensorBoard writes into a folder: a `log_dir` that is a link, or a link on its way below `save_dir` (the run) or
    in place of `hparams.yaml`, is refused in one line (`medvol.core.run_files`), never followed.

    Args:
        optimized_metric: the metric the run is judged by, e.g. `val/psnr`.
        flush_seconds: least time between two flushes from `save()`.
    """

    def __init__(
        self, *args: Any, optimized_metric: str | None = None, flush_seconds: float = 10.0, **kwargs: Any
    ) -> None:
        kwargs.setdefault("default_hp_metric", False)
        super().__init__(*args, **kwargs)
        self.optimized_metric = optimized_metric
        self.flush_seconds = flush_seconds
        self._last_flush = float("-inf")
        self._declaring = False

    def _refuse_links(self) -> None:
        writable_path(Path(self.save_dir), Path(self.log_dir) / self.NAME_HPARAMS_FILE)

    @property
    @rank_zero_experiment
    def experiment(self) -> Any:
        if self._experiment is None:
            self._refuse_links()
        return super().experiment

    def log_hyperparams(self, params: Any, metrics: dict[str, Any] | None = None, step: int | None = None) -> None:
        columns = dict.fromkeys(["hp_metric", *([self.optimized_metric] if self.optimized_metric else [])], 0.0)
        # Lightning writes the declared metric values as scalars; they are placeholders here, not measurements.
        self._declaring = metrics is None
        try:
            super().log_hyperparams(params, metrics=metrics or columns, step=step)
        finally:
            self._declaring = False

    def log_metrics(self, metrics: dict[str, Any], step: int | None = None) -> None:
        if self._declaring:
            return
        metrics = {k: v for k, v in metrics.items() if k != "epoch"}
        if self.optimized_metric in metrics:
            metrics["hp_metric"] = metrics[self.optimized_metric]
        if metrics:
            super().log_metrics(metrics, step)

    @rank_zero_only
    def save(self) -> None:
        now = time.monotonic()
        if now - self._last_flush >= self.flush_seconds:
            self._last_flush = now
            self._refuse_links()
            super().save()
