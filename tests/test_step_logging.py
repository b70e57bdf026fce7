"""The cheap per-step logging: VQ-GAN epoch means from running sums, TensorBoard flushes throttled."""

from __future__ import annotations

import csv
from pathlib import Path

import pytest

from medvol.core.tensorboard_logger import MedvolTensorBoardLogger
from medvol.run.training import run


def test_vqgan_epoch_values_are_the_sample_weighted_means_of_its_step_values(tiny_cfg, tmp_path):
    # 6 training subjects in batches of 4: steps of 4 and 2 samples, so weighting matters.
    cfg = tiny_cfg("dataset.batch_size=4", "logger=csv", "trainer.max_epochs=2")
    metrics = run(cfg)
    rows = list(csv.DictReader(next(Path(tmp_path).rglob("metrics.csv")).open()))
    for term in ("loss", "generator_loss", "recon_loss", "commitment_loss", "perplexity", "gan_generator"):
        steps = [float(r[f"train/{term}_step"]) for r in rows if r.get(f"train/{term}_step")]
        epochs = [float(r[f"train/{term}_epoch"]) for r in rows if r.get(f"train/{term}_epoch")]
        # Every step logged (log_every_n_steps=1); the GAN term only from discriminator_iter_start=2 on.
        assert (len(steps), len(epochs)) == ((2, 1) if term == "gan_generator" else (4, 2)), term
        assert epochs[-1] == pytest.approx((4 * steps[-2] + 2 * steps[-1]) / 6, rel=1e-5), term
    # The unsuffixed epoch value stays available to callbacks and `optimized_metric`.
    assert metrics["train/loss"] == pytest.approx(metrics["train/loss_epoch"])


def test_tensorboard_logger_flushes_at_most_every_flush_seconds(tmp_path, monkeypatch):
    calls = []
    for seconds, expected in ((3600.0, 1), (0.0, 5)):
        logger = MedvolTensorBoardLogger(save_dir=str(tmp_path), name=f"tb{seconds}", flush_seconds=seconds)
        monkeypatch.setattr(logger.experiment, "flush", lambda: calls.append(1))
        calls.clear()
        for _ in range(5):
            logger.save()
        assert len(calls) == expected
        assert (Path(logger.log_dir) / "hparams.yaml").is_file()
