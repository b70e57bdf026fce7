"""`StepCheckpoint`: `{step}` on the run's one step axis (not `global_step`), and a fallback metric when the
monitored one is undefined (NaN)."""

from __future__ import annotations

import csv
import logging
import math

import torch
from pytorch_lightning.loggers import CSVLogger

from callbacks.step_checkpoint import StepCheckpoint
from tests.tiny_trainer import TinyRegression, loader, tiny_trainer


class TwoOptimizers(TinyRegression):
    """A GAN's shape: manual optimization stepping two optimizers per batch, so `global_step` runs twice as fast."""

    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.other = torch.nn.Linear(1, 1)

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> None:
        for optimizer, net in zip(self.optimizers(), (self.net, self.other), strict=True):
            optimizer.zero_grad()
            self.manual_backward(torch.nn.functional.mse_loss(net(batch["image"]), batch["target"]))
            optimizer.step()

    def configure_optimizers(self) -> list[torch.optim.Optimizer]:
        return [torch.optim.SGD(self.net.parameters(), lr=0.1), torch.optim.SGD(self.other.parameters(), lr=0.1)]


def test_the_step_in_a_checkpoint_name_is_where_the_logger_put_its_validation(tmp_path):
    saving = StepCheckpoint(dirpath=tmp_path / "checkpoints", filename="{step}", monitor="val/loss", save_top_k=-1)
    logger = CSVLogger(tmp_path, name="", version="")
    trainer = tiny_trainer(tmp_path, max_epochs=2, enable_checkpointing=True, logger=logger, callbacks=[saving])
    # 4 batches an epoch, two optimizer steps each.
    trainer.fit(TwoOptimizers(), loader(8, 2), loader(2, 2))
    with open(tmp_path / "metrics.csv", newline="") as handle:
        validated_at = [int(row["step"]) for row in csv.DictReader(handle) if row.get("val/loss")]
    names = sorted(path.name for path in (tmp_path / "checkpoints").glob("*.ckpt"))
    assert trainer.global_step == 16
    assert validated_at == [3, 7]
    assert names == ["step=3.ckpt", "step=7.ckpt"]


def undefined_auroc(epoch: int) -> dict[str, float]:
    # The AUROC of a validation set holding one class is NaN every epoch; the loss is lowest after epoch 1.
    return {"auroc": math.nan, "score": [3.0, 1.0, 2.0][epoch]}


def fit_with_fallback(tmp_path) -> StepCheckpoint:
    saving = StepCheckpoint(dirpath=tmp_path / "checkpoints", filename="{epoch}-{auroc:.2f}", monitor="auroc",
                            mode="max", fallback_monitor="score", fallback_mode="min")
    trainer = tiny_trainer(tmp_path, max_epochs=3, enable_checkpointing=True, callbacks=[saving])
    trainer.fit(TinyRegression(val_metrics=undefined_auroc), loader(4, 2), loader(2, 2))
    return saving


def test_an_undefined_monitor_ranks_by_the_fallback_and_names_its_value(tmp_path, caplog):
    with caplog.at_level(logging.WARNING, logger="medvol"):
        saving = fit_with_fallback(tmp_path)
    assert [p.name for p in (tmp_path / "checkpoints").glob("*.ckpt")] == ["epoch=1-score=1.00.ckpt"]
    assert saving.best_model_path.endswith("epoch=1-score=1.00.ckpt")
    assert float(saving.best_model_score) == 1.0
    assert "`auroc` is undefined (NaN) on this validation set; the best checkpoints are chosen by `score` (min)" \
        in caplog.text


def test_a_resumed_run_keeps_ranking_by_the_fallback_under_the_configured_state_key(tmp_path):
    saving = fit_with_fallback(tmp_path)
    state = saving.state_dict()
    resumed = StepCheckpoint(dirpath=tmp_path / "checkpoints", monitor="auroc", mode="max",
                             fallback_monitor="score", fallback_mode="min")
    configured = resumed.state_key
    resumed.load_state_dict(state)
    assert state["falling_back"] is True
    assert (resumed.monitor, resumed.mode, resumed.best_model_path) == ("score", "min", saving.best_model_path)
    assert resumed.state_key == configured == saving.state_key
    assert "'monitor': 'auroc'" in configured
