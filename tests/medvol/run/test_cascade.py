"""The cascade hands the next stage the best checkpoint of a stage, as its metric history says, not the last one."""

from __future__ import annotations

import csv
import json
import logging
from typing import Any

import pytest
import torch
from torch import nn

from lightning_modules.base import MedvolModule
from medvol.core.errors import MedvolError
from medvol.run.cascade import best_checkpoint
from medvol.run.training import run
from tests.conftest import TINY, compose_cfg

TINY_DATA = [item for item in TINY if not item.startswith(("model.", "dataset.size"))]
# Stage 1's validation score per epoch: the best epoch (1) is neither the first nor the last.
SCORES = (0.2, 0.9, 0.5)


class CountingStage(MedvolModule):
    """A cascade stage whose weight grows by one every optimizer step and whose score follows `SCORES`.

    Later stages start from `init_from` and keep the weight they started from in `started_from`.
    """

    def __init__(self, stage: int = 1, size: int = 8, previous_stages: list[str] | None = None,
                 init_from: str | None = None) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.steps = nn.Parameter(torch.zeros(1))
        self.register_buffer("started_from", torch.full((1,), float("nan")))
        if init_from:
            state = torch.load(init_from, map_location="cpu", weights_only=True)["state_dict"]
            with torch.no_grad():
                self.steps.copy_(state["steps"])
                self.started_from.copy_(state["steps"])

    def training_step(self, batch: dict[str, Any], batch_idx: int) -> torch.Tensor:
        # SGD with lr 1 on -w adds exactly 1 per step.
        return -self.steps.sum() + 0 * batch["image"].sum()

    def validation_step(self, batch: dict[str, Any], batch_idx: int) -> None:
        score = SCORES[self.current_epoch] if self.hparams.stage == 1 else 0.0
        self.log("val/score", score, batch_size=batch["image"].shape[0])

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=1.0)


def _best_epoch(metrics_csv) -> int:
    """The epoch with the highest logged val/score, read from the stage's metrics.csv."""
    with open(metrics_csv, newline="") as handle:
        rows = [row for row in csv.DictReader(handle) if row.get("val/score")]
    scores = {int(row["epoch"]): float(row["val/score"]) for row in rows}
    assert sorted(scores) == [0, 1, 2], scores
    return max(scores, key=scores.get)


def test_stage_two_starts_from_the_best_epoch_of_stage_one_not_its_last(tmp_path):
    cfg = compose_cfg(tmp_path, [
        *TINY_DATA, "logger=csv", "~model", f"+model={{_target_:{CountingStage.__module__}.CountingStage,size:8}}",
        "model.size=${dataset.size}", "optimized_metric=val/score", "optimized_mode=max",
        "callbacks.volume_slices=null",
        "+cascade={stages:[1,2],from_run:null,stage1:{dataset:{size:8},trainer:{max_epochs:3}},"
        "stage2:{dataset:{size:16},trainer:{max_epochs:1}}}",
    ], tiny=False)
    run(cfg)
    stage1 = tmp_path / "stage1"
    best_epoch = _best_epoch(stage1 / "csv" / "metrics.csv")
    (epoch_file,) = (stage1 / "checkpoints").glob(f"epoch{best_epoch:03d}-*.ckpt")
    expected = torch.load(epoch_file, map_location="cpu", weights_only=True)["state_dict"]["steps"]
    last = torch.load(stage1 / "checkpoints" / "last.ckpt", map_location="cpu",
                      weights_only=True)["state_dict"]["steps"]
    assert 0 < float(expected) < float(last)

    handed_on = torch.load(stage1 / "best.ckpt", map_location="cpu", weights_only=True)["state_dict"]
    assert torch.equal(handed_on["steps"], expected)
    # The summary names the best epoch's score, not the last epoch's metric.
    summary = json.loads((tmp_path / "cascade_summary.json").read_text())
    assert summary["stage1"]["best_score"] == pytest.approx(SCORES[best_epoch])
    assert summary["stage1"]["metrics"]["val/score"] == pytest.approx(SCORES[-1])
    stage2 = torch.load(tmp_path / "stage2" / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=True)
    assert torch.equal(stage2["state_dict"]["started_from"], expected)


def _stage_with_last(tmp_path, callbacks: dict) -> Any:
    """A stage folder whose checkpoints/last.ckpt records `callbacks` (a checkpoint callback's state)."""
    stage_dir = tmp_path / "stage1"
    (stage_dir / "checkpoints").mkdir(parents=True)
    torch.save({"state_dict": {"steps": torch.ones(1)}, "callbacks": callbacks},
               stage_dir / "checkpoints" / "last.ckpt")
    return stage_dir


def test_a_missing_best_checkpoint_stops_the_cascade_with_a_line_naming_it(tmp_path):
    missing = tmp_path / "stage1" / "checkpoints" / "epoch001-gone.ckpt"
    stage_dir = _stage_with_last(tmp_path,
                                 {"StepCheckpoint": {"monitor": "val/score", "best_model_path": str(missing)}})
    with pytest.raises(MedvolError, match=f"best checkpoint {missing} .*does not exist"):
        best_checkpoint(stage_dir)
    assert not (stage_dir / "best.ckpt").exists()


def test_a_stage_without_a_monitored_metric_hands_on_its_last_checkpoint_and_says_so(tmp_path, caplog):
    stage_dir = _stage_with_last(tmp_path, {})
    with caplog.at_level(logging.INFO, logger="medvol"):
        best, score = best_checkpoint(stage_dir)
    assert score is None and "no best checkpoint" in caplog.text
    assert torch.equal(torch.load(best, weights_only=True)["state_dict"]["steps"], torch.ones(1))
