"""`RunSummary`: samples over all ranks, the best checkpoint and final metrics in `summary.json`, never over
a training run's record."""

from __future__ import annotations

import json
import math
from types import SimpleNamespace

import pytest
import torch
from pytorch_lightning.callbacks import ModelCheckpoint

from callbacks.run_summary import RunSummary, _batch_size, peak_host_memory_mb
from tests.tiny_trainer import TinyRegression, loader, tiny_trainer

# A validation score per epoch: the second epoch is the best.
VAL_SCORES = {"val/score": [3.0, 1.0, 2.0]}


def scores(epoch: int) -> dict[str, float]:
    return {name: values[epoch] for name, values in VAL_SCORES.items()}


@pytest.fixture
def fitted(tmp_path):
    """Three epochs of 12 samples in batches of 4, best checkpoint by `val/score` (min); its summary."""
    summary = RunSummary(str(tmp_path / "run"), optimized_metric="val/score")
    checkpoints = ModelCheckpoint(dirpath=tmp_path / "run" / "checkpoints", monitor="val/score", mode="min",
                                  filename="best", save_last=True)
    trainer = tiny_trainer(tmp_path, max_epochs=3, enable_checkpointing=True, callbacks=[checkpoints, summary])
    trainer.fit(TinyRegression(val_metrics=scores), loader(12, 4), loader(4, 4))
    return summary, trainer, json.loads((tmp_path / "run" / "summary.json").read_text())


def test_the_summary_names_the_best_checkpoint_its_score_and_the_counted_samples(fitted):
    summary, trainer, written = fitted
    run = summary.output_dir
    assert written["best_checkpoint"] == str(run / "checkpoints" / "best.ckpt")
    assert written["last_checkpoint"] == str(run / "checkpoints" / "last.ckpt")
    assert (written["best_score"], written["best_by"], written["optimized_metric"]) == (1.0, "val/score", "val/score")
    # 3 epochs x 12 samples; 3 batches an epoch, one optimizer step each.
    assert (written["train_samples"], written["epochs"], written["global_step"], written["world_size"]) == (36, 3, 9, 1)
    # Over the unrounded time in training batches (`train_seconds` is written to the millisecond).
    assert written["samples_per_second"] == pytest.approx(36 / summary.train_seconds, abs=1e-3)
    assert written["train_seconds"] == round(summary.train_seconds, 3)
    assert written["metrics"]["val/score"] == 2.0
    assert written["metrics"]["val/loss"] == pytest.approx(float(trainer.callback_metrics["val/loss"]))


def test_a_test_only_run_writes_its_own_file_beside_the_training_record(fitted, tmp_path):
    summary, _, written = fitted
    test_only = RunSummary(str(summary.output_dir))
    tiny_trainer(tmp_path, callbacks=[test_only]).test(TinyRegression(), loader(4, 4))
    assert json.loads((summary.output_dir / "summary.json").read_text()) == written
    (record,) = summary.output_dir.glob("summary-test-*.json")
    assert record.name == f"summary-test-{test_only.started}.json"
    tested = json.loads(record.read_text())
    assert tested["train_samples"] == 0 and "test/loss" in tested["metrics"]


def test_the_table_printed_at_teardown_leads_with_the_optimized_metric(fitted, capsys):
    summary, trainer, _ = fitted
    capsys.readouterr()
    summary._pending = (summary.summary(trainer), "fit")
    summary.teardown(trainer, trainer.lightning_module, "fit")
    lines = capsys.readouterr().out.splitlines()
    assert "medvol run summary (fit)" in lines[0]
    shown = [line.split()[0] for line in lines if line.startswith(("val/", "test/"))]
    assert shown == ["val/score", "val/loss"]


def test_samples_count_every_rank_and_only_time_in_training_batches():
    summary = RunSummary("unused")
    two_ranks = SimpleNamespace(world_size=2)
    for size in (4, 4, 3):
        summary.on_train_batch_start(two_ranks, None, {"image": torch.zeros(size, 1)}, 0)
        summary.on_train_batch_end(two_ranks, None, None, {"image": torch.zeros(size, 1)}, 0)
    assert summary.samples == 2 * (4 + 4 + 3)
    assert 0 < summary.train_seconds < 1


@pytest.mark.parametrize(("batch", "size"), [
    ({"subject": ["a", "b"], "scalar": torch.tensor(1.0), "image": torch.zeros(3, 1, 2)}, 3),
    ([torch.zeros(5, 2), torch.zeros(5)], 5),
    ({"subject": ["a"]}, 0),
])
def test_the_batch_size_is_the_first_dimension_of_the_first_batched_tensor(batch, size):
    assert _batch_size(batch) == size


def test_peak_host_memory_is_the_kernels_high_water_mark_in_mib():
    def high_water_mib() -> float:
        status = open("/proc/self/status").read().splitlines()
        return next(int(line.split()[1]) for line in status if line.startswith("VmHWM:")) / 1024

    before, peak, after = high_water_mib(), peak_host_memory_mb(), high_water_mib()
    assert math.floor(before) - 1 <= peak <= after + 1
