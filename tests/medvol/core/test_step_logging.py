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


def _last_steps(run_dir: Path) -> dict[str, int]:
    """Every TensorBoard tag of a run (scalars and images) -> the step of its last value."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    last: dict[str, int] = {}
    for events in sorted(run_dir.rglob("events.out.tfevents*")):
        reader = EventAccumulator(str(events), size_guidance={"scalars": 0, "images": 0})
        reader.Reload()
        for tag in reader.Tags()["scalars"]:
            last[tag] = max(last.get(tag, 0), reader.Scalars(tag)[-1].step)
        for tag in reader.Tags()["images"]:
            last[tag] = max(last.get(tag, 0), reader.Images(tag)[-1].step)
    return last


def test_every_card_of_a_gan_run_ends_on_the_one_step_axis(tiny_cfg, tmp_path):
    # 6 training subjects in batches of 2 for 2 epochs: 6 batches, steps 0..5. The discriminators start at
    # batch 2, so `trainer.global_step` (both optimizers' steps) reaches 10: a card on that axis ends elsewhere.
    run(tiny_cfg("trainer.max_epochs=2", "logger=tensorboard"))
    last = _last_steps(tmp_path)
    assert {"telemetry/step_time_ms", "val/psnr", "hp_metric", "train/loss_epoch", "train/loss_step",
            "val/slices"} <= set(last)
    assert {tag: step for tag, step in last.items() if step != 5} == {}, last
