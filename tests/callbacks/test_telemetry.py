"""Telemetry: a slow loader shows as data wait near 1 (with a warning naming the remedies), a cached one near 0."""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import pytorch_lightning as pl
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from torch.utils.data import Dataset

import callbacks.telemetry as telemetry_module
from datamodules.pipeline.volume_datamodule import Record
from datamodules.sources.synthetic import SyntheticDataModule
from medvol.run.training import run
from tests.ddp_support import explain, train_cli
from tests.medvol.run.test_ddp_correctness import REGRESSOR, TINY_DATA

DELAY_SECONDS = 1.0


class SlowDataset(Dataset):
    """Wraps a dataset so that every item takes `DELAY_SECONDS` longer, like a slow disk or transform."""

    def __init__(self, dataset: Dataset) -> None:
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)  # type: ignore[arg-type]

    def __getitem__(self, index: int) -> Any:
        time.sleep(DELAY_SECONDS)
        return self.dataset[index]


class SlowPhantoms(SyntheticDataModule):
    """Synthetic phantoms behind an artificially slow loader."""

    def build_dataset(self, records: list[Record], stage: str) -> Dataset:
        return SlowDataset(super().build_dataset(records, stage))


class CachedPhantoms(SyntheticDataModule):
    """Synthetic phantoms generated once at set-up and served from memory."""

    def build_dataset(self, records: list[Record], stage: str) -> Dataset:
        dataset = super().build_dataset(records, stage)
        return [dataset[i] for i in range(len(dataset))]  # type: ignore[return-value]


class SlowStep(pl.Callback):
    """Makes every training step compute for 50 ms more, so the loader's share does not hang on the machine's load."""

    def on_before_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule, loss: Any) -> None:
        time.sleep(0.05)


def _train(
    tiny_cfg, source: str, subjects: int, caplog: pytest.LogCaptureFixture, *extra: str
) -> tuple[dict[str, Any], list[str]]:
    # Discriminators off: a cheaper step, so the test is about the loader.
    cfg = tiny_cfg(
        f"dataset._target_=tests.callbacks.test_telemetry.{source}", f"dataset.num_subjects={subjects}",
        "model.discriminator_iter_start=100", *extra,
    )
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="medvol"):
        run(cfg)
    summary = json.loads((Path(cfg.paths.output_dir) / "summary.json").read_text())
    warnings = [r.getMessage() for r in caplog.records if r.getMessage().startswith("telemetry:")]
    return summary["telemetry"], warnings


# A deliberately slow loader (~8 s; its share bound is sensitive to a loaded machine): the slow suite.
@pytest.mark.slow
def test_data_wait_is_near_one_for_a_slow_loader_and_warns_with_the_remedies(tiny_cfg, caplog, tmp_path):
    telemetry, warnings = _train(tiny_cfg, "SlowPhantoms", 8, caplog)
    assert telemetry["data_wait_fraction"] > 0.75
    # 6 training subjects in batches of 2: the steps after the first (warm-up), each waiting for a slow batch.
    assert telemetry["steps"] == 2
    assert telemetry["step_time_ms"] > 1000 * DELAY_SECONDS * 2
    assert telemetry["samples_per_second"] == pytest.approx(2000 / telemetry["step_time_ms"], rel=1e-3)
    assert telemetry["host_peak_rss_mb"] > 0
    # The epoch holds its counted steps (and the first step and validation besides).
    assert telemetry["epoch_seconds"] > telemetry["step_time_ms"] * telemetry["steps"] / 1000 + DELAY_SECONDS
    (warning,) = warnings
    for remedy in ("dataset.cache", "dataset.num_workers", "dataset.gpu_transforms"):
        assert remedy in warning

    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    logged = set(events.Tags()["scalars"])
    assert {"telemetry/data_wait_fraction", "telemetry/samples_per_second", "telemetry/step_time_ms",
            "telemetry/epoch_seconds", "telemetry/host_peak_rss_mb"} <= logged
    (point,) = events.Scalars("telemetry/data_wait_fraction")
    assert point.value > 0.75


def test_data_wait_is_near_zero_for_a_cached_loader_and_nothing_is_warned(tiny_cfg, caplog):
    telemetry, warnings = _train(
        tiny_cfg, "CachedPhantoms", 16, caplog, "+callbacks.slow_step._target_=tests.callbacks.test_telemetry.SlowStep"
    )
    assert telemetry["data_wait_fraction"] < 0.1
    assert telemetry["steps"] == 5
    assert warnings == []


STEP_SECONDS = 0.5


class ScriptedClock(pl.Callback):
    """Telemetry's clock, scripted: it stands still except inside each training step, which takes STEP_SECONDS.

    Steps then last exactly STEP_SECONDS and nothing waits for data, whatever the machine's load.
    """

    def __init__(self) -> None:
        self.now = 0.0
        self.saved = telemetry_module.time

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        telemetry_module.time = SimpleNamespace(perf_counter=lambda: self.now)

    def on_before_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule, loss: Any) -> None:
        self.now += STEP_SECONDS

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        telemetry_module.time = self.saved


@pytest.mark.slow
def test_samples_per_second_on_two_gloo_ranks_counts_both_ranks_batches(tmp_path):
    # 16 subjects, 4 for validation: 12 training subjects, 6 per rank in batches of 2, so 3 steps per epoch,
    # each of 2 x 2 = 4 subjects.
    result = train_cli([
        *TINY_DATA, *REGRESSOR, "strategy=ddp", "trainer.devices=2", "dataset.batch_size=2",
        "dataset.num_subjects=16", "dataset.val_fraction=0.25", "dataset.test_fraction=0", "trainer.max_epochs=2",
        "+callbacks.clock._target_=tests.callbacks.test_telemetry.ScriptedClock", f"hydra.run.dir={tmp_path / 'run'}",
    ], cwd=tmp_path, tiny=False)
    assert result.returncode == 0, explain(result)
    split = json.loads((tmp_path / "run" / "split.json").read_text())
    per_rank_batches = len(split["train"]) // 2 // 2
    assert (len(split["train"]), per_rank_batches) == (12, 3)
    telemetry = json.loads((tmp_path / "run" / "summary.json").read_text())["telemetry"]
    # Every step of both epochs but the run's first, each STEP_SECONDS long, each 4 subjects over the 2 ranks.
    assert telemetry["steps"] == 2 * per_rank_batches - 1
    assert telemetry["step_time_ms"] == pytest.approx(1000 * STEP_SECONDS)
    assert telemetry["samples_per_second"] == pytest.approx(2 * 2 / STEP_SECONDS)
    assert telemetry["data_wait_fraction"] == 0
