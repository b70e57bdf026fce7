"""End-of-run summary (rank 0): where everything is, final metrics, throughput and peak memory."""

from __future__ import annotations

import json
import resource
import sys
import time
from datetime import datetime
from pathlib import Path
from typing import Any

import pytorch_lightning as pl
import torch
from pytorch_lightning.loggers import TensorBoardLogger
from pytorch_lightning.utilities import rank_zero_only
from rich.console import Console
from rich.table import Table

from medvol.core.run_files import open_in


def _batch_size(batch: Any) -> int:
    if isinstance(batch, dict):
        for value in batch.values():
            if isinstance(value, torch.Tensor) and value.ndim > 0:
                return int(value.shape[0])
    if isinstance(batch, (list, tuple)) and batch and isinstance(batch[0], torch.Tensor):
        return int(batch[0].shape[0])
    return 0


def peak_host_memory_mb() -> float:
    """Peak resident set size of this process in MiB."""
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss / 1024 / 1024 if sys.platform == "darwin" else rss / 1024


class RunSummary(pl.Callback):
    """Counts training samples and time, then writes `summary.json` and prints a table at the end.

    A test-only run (`train=false test=true ckpt_path=...`) keeps the training run's
    `summary.json` and writes `summary-test-<stamp>.json` beside it.

    Samples/s is over all ranks (per-rank count x world size) and counts only time spent in
    training batches (validation excluded).

    Args:
        output_dir: the run directory.
        optimized_metric: the metric the run is judged by (shown first).
    """

    def __init__(self, output_dir: str, optimized_metric: str | None = None) -> None:
        self.output_dir = Path(output_dir)
        self.optimized_metric = optimized_metric
        self.samples = 0
        self.train_seconds = 0.0
        self._batch_start: float | None = None
        self.fit_metrics: dict[str, float] = {}
        self.fitted = False
        self._pending: tuple[dict[str, Any], str] | None = None
        self.started = datetime.now().strftime("%Y-%m-%d_%H-%M-%S")

    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        self._batch_start = time.perf_counter()

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if self._batch_start is not None:
            self.train_seconds += time.perf_counter() - self._batch_start
            self.samples += _batch_size(batch) * trainer.world_size

    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.fitted = True
        self.fit_metrics = self._metrics(trainer)
        self._write(trainer, "fit")

    def on_test_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._write(trainer, "test")

    @rank_zero_only
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        # After the progress bar's teardown (it comes first in the callback list) and the test table.
        if self._pending is not None:
            self._print(*self._pending)
            self._pending = None

    def summary_file(self, stage: str) -> Path:
        """`summary.json` for a training run (and its test); a test-only run adds `summary-test-<stamp>.json`."""
        if stage == "test" and not self.fitted:
            return self.output_dir / f"summary-test-{self.started}.json"
        return self.output_dir / "summary.json"

    @staticmethod
    def _metrics(trainer: pl.Trainer) -> dict[str, float]:
        return {
            k: float(v) for k, v in sorted(trainer.callback_metrics.items()) if torch.is_tensor(v) and v.numel() == 1
        }

    def summary(self, trainer: pl.Trainer) -> dict[str, Any]:
        checkpoint = trainer.checkpoint_callback
        tensorboard = next((lg.log_dir for lg in trainer.loggers if isinstance(lg, TensorBoardLogger)), None)
        metrics = {**self.fit_metrics, **self._metrics(trainer)}
        peak_gpu = torch.cuda.max_memory_allocated() / 2**20 if torch.cuda.is_available() else None
        # Callbacks that measure the run (callbacks/telemetry.py) add their own fields, and so does the
        # datamodule (what its cache chose).
        extra = {
            k: v
            for cb in trainer.callbacks
            if hasattr(cb, "summary_fields")
            for k, v in cb.summary_fields(trainer.lightning_module).items()
        }
        datamodule = getattr(trainer, "datamodule", None)
        if hasattr(datamodule, "summary_fields"):
            extra.update(datamodule.summary_fields())
        return {
            "run_dir": str(self.output_dir),
            "best_checkpoint": getattr(checkpoint, "best_model_path", None) or None,
            "best_score": float(checkpoint.best_model_score)
            if getattr(checkpoint, "best_model_score", None) is not None
            else None,
            # The metric the best checkpoint was chosen by: `optimized_metric`,
            # or its fallback where that was undefined.
            "best_by": getattr(checkpoint, "monitor", None),
            "last_checkpoint": getattr(checkpoint, "last_model_path", None) or None,
            "tensorboard": tensorboard,
            "optimized_metric": self.optimized_metric,
            "metrics": metrics,
            "epochs": trainer.current_epoch,
            "global_step": trainer.global_step,
            "world_size": trainer.world_size,
            "train_samples": self.samples,
            "train_seconds": round(self.train_seconds, 3),
            "samples_per_second": round(self.samples / self.train_seconds, 3) if self.train_seconds else None,
            "peak_host_memory_mb": round(peak_host_memory_mb(), 1),
            "peak_gpu_memory_mb": round(peak_gpu, 1) if peak_gpu is not None else None,
            **extra,
        }

    @rank_zero_only
    def _write(self, trainer: pl.Trainer, stage: str) -> None:
        summary = self.summary(trainer)
        # Never over a training run's record: a test-only command writes a file of its own.
        path = self.summary_file(stage)
        with open_in(self.output_dir, path, "w") as handle:
            handle.write(json.dumps(summary, indent=2) + "\n")
        self._pending = ({**summary, "summary": str(path)}, stage)

    def _print(self, summary: dict[str, Any], stage: str) -> None:
        """Paths as whole lines (a terminal may wrap them, but never inside a name), metrics as a table."""
        console = Console()
        console.rule(f"medvol run summary ({stage})")
        for key in ("run_dir", "summary", "best_checkpoint", "last_checkpoint", "tensorboard"):
            if summary.get(key):
                console.print(f"{key:<16} {summary[key]}", soft_wrap=True, highlight=False)
        table = Table(show_header=False, box=None, padding=(0, 1, 0, 0))
        table.add_column("what", style="bold")
        table.add_column("value", justify="right")
        metrics = summary["metrics"]
        shown = [self.optimized_metric] if self.optimized_metric in metrics else []
        shown += [k for k in metrics if k.startswith(("val/", "test/")) and k not in shown]
        for key in shown:
            table.add_row(key, f"{metrics[key]:.4f}")
        table.add_row("samples/s (train)", str(summary["samples_per_second"]))
        table.add_row("peak host memory", f"{summary['peak_host_memory_mb']} MiB")
        if summary["peak_gpu_memory_mb"] is not None:
            table.add_row("peak GPU memory", f"{summary['peak_gpu_memory_mb']} MiB")
        console.print(table)
