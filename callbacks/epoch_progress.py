"""One line per epoch for a run watched through a file (SLURM, nohup, a pipe), like nnU-Net's per-epoch lines."""

from __future__ import annotations

import logging
import math
import sys
import time
from typing import Any

import pytorch_lightning as pl
import torch

log = logging.getLogger("medvol")


def duration(seconds: float) -> str:
    """`45s`, `12m05s`, `3h07m`: short enough to read at a glance in a log line."""
    seconds = round(seconds)
    if seconds < 60:
        return f"{seconds}s"
    if seconds < 3600:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    return f"{seconds // 3600}h{seconds // 60 % 60:02d}m"


class EpochProgress(pl.Callback):
    """At the end of every training epoch (after its validation), rank 0 logs to the `medvol` logger:

        epoch 3/15 | lr 3.0e-04 | train/loss 0.4213 | val/psnr 21.3700 (best 21.5200 at epoch 2) | 72.1 s/epoch
        | 14m25s left

    (one line; a metric not validated this epoch shows as `-`, a run without an epoch limit gets no time left).

    Epochs count from 0 up to the last, as Lightning's bar and the checkpoint names do. The line always reaches
    `train.log`; on the console only where stdout is not a terminal (there the Rich bar shows progress). It reads
    only `trainer.callback_metrics` and the optimizers, so every model family gets it.

    Args:
        monitor: the metric the run is judged by (the run's `optimized_metric`); null: the checkpoint callback's.
        mode: `max` or `min` for `monitor`; null: the checkpoint callback's.
        train_metric: the training loss to show (its epoch mean where the family logs one).
    """

    def __init__(self, monitor: str | None = None, mode: str | None = None, train_metric: str = "train/loss") -> None:
        self.monitor = monitor
        self.mode = mode
        self.train_metric = train_metric
        self.best: float | None = None
        self.best_epoch: int | None = None
        self._epoch_start: float | None = None
        self._epoch_seconds: list[float] = []
        self._validated = False
        self._pending: tuple[list[str], list[str]] | None = None

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        checkpoint = trainer.checkpoint_callback
        self.monitor = self.monitor or getattr(checkpoint, "monitor", None)
        self.mode = self.mode or getattr(checkpoint, "mode", None) or "min"

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # A run resumed inside an epoch (a stop's checkpoint) continues it without a new epoch start.
        self._epoch_start = time.perf_counter()

    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._flush(trainer)
        self._epoch_start = time.perf_counter()
        self._validated = False

    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.sanity_checking:
            return
        self._validated = True
        value = self._metric(trainer, self.monitor)
        if value is None or math.isnan(value):
            return
        if self.best is None or (value > self.best if self.mode == "max" else value < self.best):
            self.best, self.best_epoch = value, trainer.current_epoch

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        assert self._epoch_start is not None
        self._epoch_seconds.append(time.perf_counter() - self._epoch_start)
        # The module logs its epoch means in its own `on_train_epoch_end`, after the callbacks': the line waits for
        # the next hook; what changes before then (the scheduler's next lr) is read now.
        self._pending = self.head(trainer), self.tail(trainer)

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._flush(trainer)

    def _flush(self, trainer: pl.Trainer) -> None:
        if self._pending is None:
            return
        head, tail = self._pending
        self._pending = None
        loss = self._metric(trainer, f"{self.train_metric}_epoch")
        if loss is None:
            loss = self._metric(trainer, self.train_metric)
        line = " | ".join([*head, *([f"{self.train_metric} {loss:.4f}"] if loss is not None else []), *tail])
        if trainer.is_global_zero:
            # On a terminal the Rich bar is the console's progress: the line goes to train.log only.
            log.info("%s", line, extra={"file_only": sys.stdout.isatty()})

    def head(self, trainer: pl.Trainer) -> list[str]:
        """The epoch and the learning rates it trained with."""
        epoch, last = trainer.current_epoch, trainer.max_epochs
        parts = [f"epoch {epoch}/{last - 1}" if last is not None and last > 0 else f"epoch {epoch}"]
        rates = sorted({group["lr"] for optimizer in trainer.optimizers for group in optimizer.param_groups})
        if rates:
            parts.append("lr " + "/".join(f"{rate:.1e}" for rate in rates))
        return parts

    def tail(self, trainer: pl.Trainer) -> list[str]:
        """The monitored metric with the best so far, the epoch's time and the time left."""
        parts = []
        if self.monitor:
            value = self._metric(trainer, self.monitor) if self._validated else None
            shown = f"{value:.4f}" if value is not None else "-"
            if self.best is not None:
                shown += f" (best {self.best:.4f} at epoch {self.best_epoch})"
            parts.append(f"{self.monitor} {shown}")
        parts.append(f"{self._epoch_seconds[-1]:.1f} s/epoch")
        epoch, last = trainer.current_epoch, trainer.max_epochs
        if last is not None and last > 0:
            mean = sum(self._epoch_seconds) / len(self._epoch_seconds)
            parts.append(f"{duration(mean * (last - 1 - epoch))} left")
        return parts

    @staticmethod
    def _metric(trainer: pl.Trainer, name: str | None) -> float | None:
        value = trainer.callback_metrics.get(name) if name else None
        if isinstance(value, torch.Tensor) and value.numel() == 1:
            return float(value)
        return None

    def state_dict(self) -> dict[str, Any]:
        # A resumed run keeps its best so far.
        return {"best": self.best, "best_epoch": self.best_epoch}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.best = state_dict.get("best")
        self.best_epoch = state_dict.get("best_epoch")
