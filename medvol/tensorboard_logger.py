"""TensorBoard logger whose HPARAMS tab compares runs by the metric they optimise."""

from __future__ import annotations

from typing import Any

from pytorch_lightning.loggers import TensorBoardLogger


class MedvolTensorBoardLogger(TensorBoardLogger):
    """`TensorBoardLogger` (same arguments) with hparams tied to the run's `optimized_metric`.

    The hyperparameters are recorded with two metric columns, `hp_metric` and the optimized
    metric itself; `hp_metric` follows every value logged for the optimized metric. Lightning's
    `epoch` scalar (a one-point chart for short runs) is left out: the step axis is documented
    in `medvol.step`.

    Args:
        optimized_metric: the metric the run is judged by, e.g. `val/psnr`.
    """

    def __init__(self, *args: Any, optimized_metric: str | None = None, **kwargs: Any) -> None:
        kwargs.setdefault("default_hp_metric", False)
        super().__init__(*args, **kwargs)
        self.optimized_metric = optimized_metric
        self._declaring = False

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
