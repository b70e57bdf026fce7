"""Every run measures its own speed: samples/s, step time, epoch time, data-wait fraction, GPU and host memory.

A step runs from the end of the previous training batch (or the epoch's start) to the end of
this one; its data wait is the part before the batch starts, where the loop fetches, collates
and moves the batch. On CUDA the wait is the time the GPU sat idle in that gap
(CUDA events, no synchronisation), since the loop may fetch while kernels are still running.
Validation is not counted, nor the run's first step, which carries one-off costs (lazy
initialisation, cuDNN autotuning, compilation).
"""

from __future__ import annotations

import logging
import resource
import sys
import time
from collections import deque
from dataclasses import dataclass
from typing import Any

import pytorch_lightning as pl
import torch

from medvol.core.step import epoch_end_step

log = logging.getLogger("medvol")


def host_peak_rss_mib() -> float:
    """Peak resident set size of this process in MiB."""
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss / 2**20 if sys.platform == "darwin" else rss / 1024


@dataclass
class Totals:
    """Running sums over training steps."""

    steps: int = 0
    samples: int = 0
    seconds: float = 0.0
    wait_seconds: float = 0.0
    epochs: int = 0
    epoch_seconds: float = 0.0

    def add(self, other: Totals) -> None:
        self.steps += other.steps
        self.samples += other.samples
        self.seconds += other.seconds
        self.wait_seconds += other.wait_seconds
        self.epochs += other.epochs
        self.epoch_seconds += other.epoch_seconds


def batch_size(batch: Any) -> int:
    """Samples in a batch dict (first tensor's leading size) or tuple of tensors."""
    values = batch.values() if isinstance(batch, dict) else batch if isinstance(batch, (list, tuple)) else []
    return next((int(v.shape[0]) for v in values if isinstance(v, torch.Tensor) and v.ndim > 0), 0)


class Telemetry(pl.Callback):
    """Logs `telemetry/*` once per training epoch, at the step of its last batch (the run's one step axis,
    `medvol.core.step`, like `train/*_epoch`), and warns when the data or the GPU memory is the limit.

    Figures (TensorBoard and `summary.json`): `samples_per_second` (all ranks), `step_time_ms`,
    `epoch_seconds` (wall time of a training epoch, its validation included), `data_wait_fraction`, `gpu_max_memory_mb`
    and `gpu_memory_fraction` of the card (CUDA only), `host_peak_rss_mb` (rank 0's process). The warnings are judged on
    the epochs after the first (cache filling and worker start-up make the first one slow), or on the first when it is
    the only one.

    Args:
        data_wait_warning: warn when the data-wait fraction exceeds this.
        gpu_memory_warning: warn when peak GPU memory stays under this fraction of the card.
    """

    def __init__(self, data_wait_warning: float = 0.1, gpu_memory_warning: float = 1 / 3) -> None:
        self.data_wait_warning = data_wait_warning
        self.gpu_memory_warning = gpu_memory_warning
        self.run = Totals()
        self.epoch = Totals()
        self.judged = Totals()
        self._last_end: float | None = None
        self._epoch_start = 0.0
        self._step_from: float | None = None
        self._end_event: torch.cuda.Event | None = None
        self._pending: deque[tuple[torch.cuda.Event, torch.cuda.Event]] = deque()
        self._warned = False

    def _cuda(self, pl_module: pl.LightningModule) -> bool:
        return pl_module.device.type == "cuda"

    def _settle_events(self, block: bool) -> None:
        """Adds the GPU-idle gaps whose events have completed (all of them when `block`)."""
        while self._pending and (block or self._pending[0][1].query()):
            end, start = self._pending.popleft()
            start.synchronize()
            self.epoch.wait_seconds += end.elapsed_time(start) / 1000

    def _mark_end(self, pl_module: pl.LightningModule) -> None:
        """From here on the loop waits for the next batch."""
        self._last_end = time.perf_counter()
        self._end_event = None
        if self._cuda(pl_module):
            self._end_event = torch.cuda.Event(enable_timing=True)
            self._end_event.record()

    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # From the second epoch on, the loader's iterator (and its workers) start after this hook.
        self.epoch = Totals()
        self._epoch_start = time.perf_counter()
        self._last_end = self._end_event = None
        if trainer.current_epoch > 0 or self.run.steps:
            self._mark_end(pl_module)

    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        self._step_from = self._last_end
        if self._last_end is None:
            return
        if self._end_event is not None:
            start = torch.cuda.Event(enable_timing=True)
            start.record()
            self._pending.append((self._end_event, start))
            self._settle_events(block=False)
        else:
            self.epoch.wait_seconds += time.perf_counter() - self._last_end

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if self._step_from is not None:
            self.epoch.steps += 1
            self.epoch.samples += batch_size(batch) * trainer.world_size
            self.epoch.seconds += time.perf_counter() - self._step_from
        self._mark_end(pl_module)

    def on_validation_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # Validation is not part of any training step.
        if not trainer.sanity_checking:
            self._last_end = self._end_event = None

    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if not trainer.sanity_checking:
            self._mark_end(pl_module)

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._settle_events(block=True)
        self.epoch.epochs = 1
        self.epoch.epoch_seconds = time.perf_counter() - self._epoch_start
        self.run.add(self.epoch)
        if trainer.current_epoch > 0:
            self.judged.add(self.epoch)
        if trainer.is_global_zero and self.epoch.steps:
            figures = self.figures(self.epoch, pl_module)
            for logger in trainer.loggers:
                logger.log_metrics({f"telemetry/{k}": v for k, v in figures.items()}, step=epoch_end_step(trainer))
        if trainer.current_epoch > 0:
            self._warn(trainer, pl_module, self.judged)

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._warn(trainer, pl_module, self.judged if self.judged.steps else self.run)

    def figures(self, totals: Totals, pl_module: pl.LightningModule) -> dict[str, float]:
        """The telemetry figures of `totals` (plus the run's peak memory so far)."""
        figures = {
            "samples_per_second": totals.samples / totals.seconds if totals.seconds else 0.0,
            "step_time_ms": 1000 * totals.seconds / totals.steps if totals.steps else 0.0,
            "epoch_seconds": totals.epoch_seconds / totals.epochs if totals.epochs else 0.0,
            "data_wait_fraction": min(1.0, totals.wait_seconds / totals.seconds) if totals.seconds else 0.0,
            "host_peak_rss_mb": host_peak_rss_mib(),
        }
        if self._cuda(pl_module):
            peak = torch.cuda.max_memory_allocated(pl_module.device)
            figures["gpu_max_memory_mb"] = peak / 2**20
            figures["gpu_memory_fraction"] = peak / torch.cuda.get_device_properties(pl_module.device).total_memory
        return figures

    def summary_fields(self, pl_module: pl.LightningModule) -> dict[str, Any]:
        """The whole run's figures for `summary.json` (rounded)."""
        return {
            "telemetry": {k: round(v, 4) for k, v in self.figures(self.run, pl_module).items()}
            | {"steps": self.run.steps}
        }

    def _warn(self, trainer: pl.Trainer, pl_module: pl.LightningModule, totals: Totals) -> None:
        if self._warned or not trainer.is_global_zero or not totals.steps:
            return
        self._warned = True
        figures = self.figures(totals, pl_module)
        wait = figures["data_wait_fraction"]
        if wait > self.data_wait_warning:
            log.warning(
                "telemetry: the training loop waits for data %.0f%% of each step (%.0f ms of %.0f ms); remedies: "
                "cache the deterministic transforms (`dataset.cache=memory` or `disk`; for `auto`, a larger "
                "`dataset.cache_budget`), more loader workers "
                "(`dataset.num_workers`), random transforms on the GPU (`dataset.gpu_transforms=true`)",
                100 * wait, wait * figures["step_time_ms"], figures["step_time_ms"],
            )
        fraction = figures.get("gpu_memory_fraction")
        if fraction is not None and fraction < self.gpu_memory_warning:
            log.warning(
                "telemetry: peak GPU memory is %.0f MiB, %.0f%% of the card; a larger `dataset.batch_size` or "
                "patch size would use it better (fewer, fuller steps)",
                figures["gpu_max_memory_mb"], 100 * fraction,
            )
