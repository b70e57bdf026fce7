"""`model=survival`: one log-risk per subject from a 3D ResNet (+ covariates), Cox loss, whole-set C-index, AUC and
Brier score, Kaplan-Meier curves of the test set's risk groups."""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from typing import Any

import torch
from PIL import Image

from lightning_modules.discriminative.cox_loss import TIES, cox_loss
from lightning_modules.discriminative.outcome_module import OutcomeModule
from lightning_modules.discriminative.risk_groups import km_figure, risk_groups
from lightning_modules.discriminative.survival_metrics import (
    SurvivalMetrics,
    breslow_baseline,
    horizon_name,
    survival_probabilities,
)
from medvol.core.errors import MedvolError
from medvol.core.step import logging_step
from medvol.volumes.mirroring import SPATIAL_AXES, mirror_combinations

# Checkpoint key of the Breslow baseline hazard (plain lists) of the validation set under the checkpoint's weights.
BASELINE_KEY = "medvol_survival_baseline"
KM_FILE = "km_risk_groups.png"
KM_TAG = "test/km_risk_groups"
# The validation metrics that rank subjects: logged as NaN where the set has no comparable pair, so that the
# checkpoint callback finds its monitored key and falls back to `model.fallback_monitor`.
RANKING = ("cindex", "uno_cindex")

log = logging.getLogger("medvol")


class SurvivalModel(OutcomeModule):
    """Cox proportional-hazards network: `image` (+ `covariates`) -> log-risk; batch keys `time`, `event`.

    Under DDP the loss is the partial likelihood of the global batch: log-risks are gathered
    from every rank (with gradients), because a Cox risk set spans the batch and a per-rank
    loss would compare each subject with its rank's share only.

    Every validation epoch fits Breslow's baseline hazard to the validation set's log-risks (held-out
    subjects, the weights of that epoch) and keeps it in the checkpoints; the tested checkpoint's
    baseline turns each test subject's log-risk into a survival curve (`test/ibs`, the `survival@h`
    columns). A validation set without a comparable pair (no event before another subject's follow-up
    ends) cannot rank anything: its C-indices and AUCs are logged as NaN with one warning, and the
    checkpoints are chosen by `model.fallback_monitor` (the epoch: the latest). At test time the subjects
    above the median risk and the others get Kaplan-Meier curves
    and a log-rank test (`test/logrank_p`, `km_risk_groups.png` beside `risks.csv`, and the loggers' images).

    Args:
        ties: `efron` or `breslow` handling of tied event times.
        horizons: follow-up times of the time-dependent AUC (`val/auc@h`) and of the survival columns, in the
            table's unit.
        tta: in validation, test and predict.py, each subject's log-risk is the mean over its volume's copies
            mirrored along every spatial axis (8 network calls), as the plan's training flips saw them: the risk
            of a lesion does not depend on its side, and the mean of the copies varies less than one call.
        **kwargs: network, optimizer and output settings of `OutcomeModule`.
    """

    prediction_file = "risks.csv"

    def __init__(self, ties: str = "efron", horizons: Sequence[float] = (), tta: bool = True, **kwargs: Any) -> None:
        super().__init__(outputs=1, **kwargs)
        if ties not in TIES:
            raise MedvolError(f"`model.ties` is {ties!r}; expected one of {list(TIES)}")
        self.save_hyperparameters(logger=False)
        self.ties = ties
        self.horizons = [float(h) for h in horizons]
        self.tta = bool(tta)
        self.val_metrics = SurvivalMetrics(horizons)
        self.test_metrics = SurvivalMetrics(horizons)
        # Breslow's (event times, cumulative baseline hazard) of the last validation epoch, or of the loaded checkpoint.
        self.baseline: tuple[torch.Tensor, torch.Tensor] | None = None
        self._warned = False

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

    def log_risk(self, batch: dict[str, Any]) -> torch.Tensor:
        """(B,) log-risks of a held-out batch: with `tta` the mean over the image's mirrored copies (the covariates
        as they are)."""
        if not self.tta:
            return self(batch).squeeze(1).float()
        combos = mirror_combinations(SPATIAL_AXES)
        image = batch[self.image_key]
        total = sum(self({**batch, self.image_key: torch.flip(image, [2 + a for a in combo])}).squeeze(1).float()
                    for combo in combos)
        return total / len(combos)

    def _evaluate(self, batch: dict[str, Any], metrics: SurvivalMetrics) -> torch.Tensor:
        log_risk = self.log_risk(batch)
        metrics.update(log_risk, batch["time"], batch["event"])
        return log_risk

    def validation_step(self, batch: dict[str, Any], batch_idx: int) -> None:
        self._evaluate(batch, self.val_metrics)

    def test_step(self, batch: dict[str, Any], batch_idx: int) -> None:
        log_risk = self._evaluate(batch, self.test_metrics)
        self.add_prediction_rows(self.rows(batch, log_risk, "test"))

    def export_about(self) -> dict[str, Any]:
        about = {"output": "log risk (higher: an earlier event), predict.py's `risk` column"}
        if self.tta:
            about["mirroring"] = ("predict.py's risk is the mean of this output over the volume's 8 copies mirrored "
                                  "along every spatial axis; the exported network is one call")
        return about

    def prediction_rows(self, batch: dict[str, Any], split: str) -> list[dict[str, Any]]:
        """Per subject the log risk, its covariates, its time and event where the batch has them, and its survival
        probability at each horizon where a baseline hazard is known."""
        return self.rows(batch, self.log_risk(batch), split)

    def rows(self, batch: dict[str, Any], log_risk: torch.Tensor, split: str) -> list[dict[str, Any]]:
        survival = None
        if self.baseline is not None and self.horizons:
            survival = survival_probabilities(log_risk, *self.baseline, torch.tensor(self.horizons))
        rows = []
        for i, subject in enumerate(batch["subject"]):
            row: dict[str, Any] = {"subject": str(subject), "risk": float(log_risk[i])}
            if "time" in batch and "event" in batch:
                row.update(time=float(batch["time"][i]), event=int(batch["event"][i]))
            row.update(self.covariate_values(batch, i))
            if survival is not None:
                row.update({f"survival@{h:g}": float(p) for h, p in zip(self.horizons, survival[i], strict=True)})
            rows.append({**row, "split": split})
        return rows

    def _log_metrics(self, metrics: SurvivalMetrics, prefix: str) -> None:
        values = metrics.compute()
        metrics.reset()
        if prefix == "val" and "cindex" not in values and metrics.gathered is not None:
            undefined = [*RANKING, *(horizon_name(h) for h in self.horizons)]
            values = {**dict.fromkeys(undefined, torch.tensor(float("nan"))), **values}
            if not self._warned and not self.trainer.sanity_checking and self.trainer.is_global_zero:
                self._warned = True
                _, _, event = metrics.gathered
                log.warning(
                    "the validation set (%d subjects, %d events) has no comparable pair (no event before another "
                    "subject's follow-up ends): val/cindex is undefined and logged as NaN", len(event),
                    int((event > 0.5).sum()),
                )
        # Logged once per epoch from the gathered set: identical on every rank, nothing left to reduce.
        self.log_dict({f"{prefix}/{k}": v for k, v in values.items()}, sync_dist=False, rank_zero_only=False)

    def on_validation_epoch_end(self) -> None:
        self._log_metrics(self.val_metrics, "val")
        if self.val_metrics.gathered is not None and not self.trainer.sanity_checking:
            self.baseline = breslow_baseline(*self.val_metrics.gathered)

    def on_test_epoch_start(self) -> None:
        super().on_test_epoch_start()
        self.test_metrics.baseline = self.baseline

    def on_test_epoch_end(self) -> None:
        self._log_metrics(self.test_metrics, "test")
        if self.test_metrics.gathered is not None:
            self._risk_groups(*self.test_metrics.gathered)
        super().on_test_epoch_end()

    def _risk_groups(self, risk: torch.Tensor, time: torch.Tensor, event: torch.Tensor) -> None:
        """Kaplan-Meier curves of the test set above and below its median risk: the log-rank p-value logged, the
        figure written beside `risks.csv` and sent to every image-capable logger (rank 0)."""
        # The gathered set is on the metric's device (a GPU's in a GPU run); numpy takes host memory only.
        groups = risk_groups(*(values.cpu().numpy() for values in (risk, time, event)))
        if math.isfinite(groups.p_value):
            self.log("test/logrank_p", groups.p_value, sync_dist=False, rank_zero_only=False)
        if not self.trainer.is_global_zero:
            return
        image = km_figure(groups, f"test set: {len(risk)} subjects, split at the median risk {groups.median_risk:.3g}")
        if self.predictions_dir is not None:
            self.predictions_dir.mkdir(parents=True, exist_ok=True)
            Image.fromarray(image).save(self.predictions_dir / KM_FILE)
        step = logging_step(self.trainer)
        for logger in self.trainer.loggers:
            experiment = getattr(logger, "experiment", None)
            if hasattr(experiment, "add_image"):
                experiment.add_image(KM_TAG, image, global_step=step, dataformats="HWC")
            elif hasattr(logger, "log_image"):
                logger.log_image(key=KM_TAG, images=[image], step=step)

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        super().on_save_checkpoint(checkpoint)
        if self.baseline is not None:
            time, hazard = self.baseline
            checkpoint[BASELINE_KEY] = {"time": time.tolist(), "cumulative_hazard": hazard.tolist()}

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        super().on_load_checkpoint(checkpoint)
        saved = checkpoint.get(BASELINE_KEY)
        if saved:
            self.baseline = tuple(torch.tensor(saved[k], dtype=torch.float64) for k in ("time", "cumulative_hazard"))
