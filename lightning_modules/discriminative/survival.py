"""`model=survival`: one log-risk per subject from a 3D ResNet (+ covariates), Cox loss, whole-set C-index and AUC."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from lightning_modules.discriminative.cox_loss import TIES, cox_loss
from lightning_modules.discriminative.outcome_module import OutcomeModule
from lightning_modules.discriminative.survival_metrics import SurvivalMetrics
from medvol.core.errors import MedvolError


class SurvivalModel(OutcomeModule):
    """Cox proportional-hazards network: `image` (+ `covariates`) -> log-risk; batch keys `time`, `event`.

    Under DDP the loss is the partial likelihood of the global batch: log-risks are gathered
    from every rank (with gradients), because a Cox risk set spans the batch and a per-rank
    loss would compare each subject with its rank's share only.

    Args:
        ties: `efron` or `breslow` handling of tied event times.
        horizons: follow-up times of the time-dependent AUC (`val/auc@h`), in the table's unit.
        **kwargs: network, optimizer and output settings of `OutcomeModule`.
    """

    prediction_file = "risks.csv"

    def __init__(self, ties: str = "efron", horizons: Sequence[float] = (), **kwargs: Any) -> None:
        super().__init__(outputs=1, **kwargs)
        if ties not in TIES:
            raise MedvolError(f"`model.ties` is {ties!r}; expected one of {list(TIES)}")
        self.save_hyperparameters(logger=False)
        self.ties = ties
        self.val_metrics = SurvivalMetrics(horizons)
        self.test_metrics = SurvivalMetrics(horizons)

    def check_training_split(self, table: dict[str, Any]) -> None:
        event = table.get("event")
        if event is not None and not bool((event > 0.5).any()):
            raise MedvolError(
                f"`dataset.event_column`: none of the {len(event)} training rows of {table['source']} has an event "
                "(event=1); the Cox loss needs events: check the column or the split"
            )

    def _gathered(self, tensor: torch.Tensor, with_grad: bool = False) -> torch.Tensor:
        if self.trainer.world_size == 1:
            return tensor
        return self.all_gather(tensor, sync_grads=with_grad).flatten(0, 1)

    def training_step(self, batch: dict[str, Any], batch_idx: int) -> torch.Tensor:
        log_risk = self(batch).squeeze(1)
        time = self._gathered(batch["time"])
        event = self._gathered(batch["event"])
        loss = cox_loss(self._gathered(log_risk, with_grad=True), time, event, self.ties)
        size = len(event)
        self.log("train/loss", loss, prog_bar=True, batch_size=size)
        self.log("train/events_per_batch", event.sum(), on_step=False, on_epoch=True, batch_size=size)
        self.log("train/batches_without_events", float(event.sum() == 0), on_step=False, on_epoch=True,
                 reduce_fx="sum", batch_size=size)
        return loss

    def _evaluate(self, batch: dict[str, Any], metrics: SurvivalMetrics) -> torch.Tensor:
        log_risk = self(batch).squeeze(1).float()
        metrics.update(log_risk, batch["time"], batch["event"])
        return log_risk

    def validation_step(self, batch: dict[str, Any], batch_idx: int) -> None:
        self._evaluate(batch, self.val_metrics)

    def test_step(self, batch: dict[str, Any], batch_idx: int) -> None:
        log_risk = self._evaluate(batch, self.test_metrics)
        self.add_prediction_rows(
            {"subject": str(s), "risk": float(r), "time": float(t), "event": int(e), "split": "test"}
            for s, r, t, e in zip(batch["subject"], log_risk, batch["time"], batch["event"], strict=True)
        )

    def export_about(self) -> dict[str, Any]:
        return {"output": "log risk (higher: an earlier event), predict.py's `risk` column"}

    def prediction_rows(self, batch: dict[str, Any], split: str) -> list[dict[str, Any]]:
        """Per subject the log risk, with its time and event where the batch has them."""
        log_risk = self(batch).squeeze(1).float()
        rows = []
        for i, subject in enumerate(batch["subject"]):
            row: dict[str, Any] = {"subject": str(subject), "risk": float(log_risk[i])}
            if "time" in batch and "event" in batch:
                row.update(time=float(batch["time"][i]), event=int(batch["event"][i]))
            rows.append({**row, "split": split})
        return rows

    def _log_metrics(self, metrics: SurvivalMetrics, prefix: str) -> None:
        values = metrics.compute()
        metrics.reset()
        # Logged once per epoch from the gathered set: identical on every rank, nothing left to reduce.
        self.log_dict({f"{prefix}/{k}": v for k, v in values.items()}, sync_dist=False, rank_zero_only=False)

    def on_validation_epoch_end(self) -> None:
        self._log_metrics(self.val_metrics, "val")

    def on_test_epoch_end(self) -> None:
        self._log_metrics(self.test_metrics, "test")
        super().on_test_epoch_end()
