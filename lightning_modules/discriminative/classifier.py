"""`model=classifier`: class logits from a 3D ResNet (+ covariates), cross-entropy, AUROC and (balanced) accuracy."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torchmetrics import MeanMetric, Metric, MetricCollection
from torchmetrics.classification import MulticlassAccuracy, MulticlassAUROC, MulticlassRecall

from lightning_modules.discriminative.outcome_module import OutcomeModule
from medvol.core.errors import MedvolError

log = logging.getLogger("medvol")


class ClassifierModel(OutcomeModule):
    """Binary or multiclass classification of the batch's `class_label` (int64, 0..num_classes-1).

    Metrics over the whole evaluation set, synced across ranks by torchmetrics (the AUROC
    concatenates every subject's probabilities, so it is the AUROC of the set, not a mean):
    `auroc` (one-vs-rest, macro over the classes the set holds), `accuracy` (micro),
    `balanced_accuracy` (macro recall) and `loss` (mean cross-entropy). A set with a single class has
    no AUROC: it is logged as NaN (torchmetrics would give 0.0) with one warning naming the set and
    its class counts, and checkpointing falls back to `val/loss` (`fallback_metric` in the config).

    Args:
        num_classes: number of classes (2 for binary).
        class_weights: cross-entropy weight per class, or null for equal weights.
        label_key: batch key of the class index.
        **kwargs: network, optimizer and output settings of `OutcomeModule`.
    """

    prediction_file = "probabilities.csv"

    def __init__(
        self, num_classes: int = 2, class_weights: Sequence[float] | None = None, label_key: str = "class_label",
        **kwargs: Any,
    ) -> None:
        if num_classes < 2:
            raise MedvolError(f"`model.num_classes` must be >= 2, got {num_classes}")
        super().__init__(outputs=num_classes, **kwargs)
        if class_weights is not None and len(class_weights) != num_classes:
            raise MedvolError(
                f"`model.class_weights` has {len(class_weights)} values; expected one per class ({num_classes}) or null"
            )
        self.save_hyperparameters(logger=False)
        self.num_classes = num_classes
        self.label_key = label_key
        weights = torch.tensor(list(class_weights), dtype=torch.float32) if class_weights is not None else None
        self.register_buffer("class_weights", weights, persistent=False)
        metrics = MetricCollection({
            "accuracy": MulticlassAccuracy(num_classes, average="micro"),
            "balanced_accuracy": MulticlassRecall(num_classes, average="macro"),
        })
        self.val_metrics = metrics.clone(prefix="val/")
        self.test_metrics = metrics.clone(prefix="test/")
        # Per class, so the macro mean can leave out the classes a set does not hold.
        self.val_auroc = MulticlassAUROC(num_classes, average=None, thresholds=None)
        self.test_auroc = MulticlassAUROC(num_classes, average=None, thresholds=None)
        self.val_counts, self.test_counts = ClassCounts(num_classes), ClassCounts(num_classes)
        self.val_loss, self.test_loss = MeanMetric(), MeanMetric()
        self._warned: set[str] = set()

    def check_training_split(self, table: dict[str, Any]) -> None:
        labels = table.get("class_label")
        if labels is None:
            return
        classes = sorted({int(v) for v in labels.tolist()})
        if len(classes) < 2:
            raise MedvolError(
                f"`dataset.class_column`: all {len(labels)} training rows of {table['source']} have class "
                f"{classes[0]}; a classifier needs at least two classes"
            )
        if classes[-1] >= self.num_classes:
            raise MedvolError(
                f"`model.num_classes` is {self.num_classes} but {table['source']} has class {classes[-1]}; "
                f"expected classes 0..{self.num_classes - 1}"
            )

    def training_step(self, batch: dict[str, Any], batch_idx: int) -> torch.Tensor:
        logits = self(batch)
        loss = F.cross_entropy(logits.float(), batch[self.label_key], weight=self.class_weights)
        self.log("train/loss", loss, prog_bar=True, batch_size=len(logits))
        return loss

    def _evaluate(self, batch: dict[str, Any], stage: str) -> torch.Tensor:
        logits = self(batch).float()
        labels = batch[self.label_key]
        probabilities = logits.softmax(dim=1)
        getattr(self, f"{stage}_metrics").update(probabilities, labels)
        getattr(self, f"{stage}_auroc").update(probabilities, labels)
        getattr(self, f"{stage}_counts").update(labels)
        getattr(self, f"{stage}_loss").update(F.cross_entropy(logits, labels, weight=self.class_weights), len(labels))
        return probabilities

    def _log_epoch(self, stage: str) -> None:
        """The set's metrics (computed over all ranks), AUROC over the classes present; one warning for a one-class
        set."""
        counts = getattr(self, f"{stage}_counts").compute()
        auroc = set_auroc(getattr(self, f"{stage}_auroc").compute(), counts)
        if not torch.isfinite(auroc) and stage not in self._warned and not self.trainer.sanity_checking:
            self._warned.add(stage)
            if self.trainer.is_global_zero:
                held = ", ".join(f"class {c}: {int(n)}" for c, n in enumerate(counts.tolist()))
                log.warning("the %s set holds a single class (%s subjects): %s/auroc is undefined and logged as NaN",
                            stage, held, stage)
        values = {f"{stage}/auroc": auroc, **getattr(self, f"{stage}_metrics").compute(),
                  f"{stage}/loss": getattr(self, f"{stage}_loss").compute()}
        for name in ("metrics", "auroc", "counts", "loss"):
            getattr(self, f"{stage}_{name}").reset()
        # Computed from the gathered set: identical on every rank, nothing left to reduce.
        self.log_dict(values, sync_dist=False, rank_zero_only=False)

    def validation_step(self, batch: dict[str, Any], batch_idx: int) -> None:
        self._evaluate(batch, "val")

    def on_validation_epoch_end(self) -> None:
        self._log_epoch("val")

    def export_about(self) -> dict[str, Any]:
        return {"output": f"logits of the {self.num_classes} classes (their softmax: predict.py's p0, p1, ...)"}

    def prediction_rows(self, batch: dict[str, Any], split: str) -> list[dict[str, Any]]:
        """Per subject the predicted class and the class probabilities, with its label where the batch has one."""
        probabilities = self(batch).float().softmax(dim=1)
        rows = []
        for i, subject in enumerate(batch["subject"]):
            row: dict[str, Any] = {"subject": str(subject)}
            if self.label_key in batch:
                row["class_label"] = int(batch[self.label_key][i])
            row["predicted"] = int(probabilities[i].argmax())
            rows.append({**row, **{f"p{c}": float(p) for c, p in enumerate(probabilities[i])}, "split": split})
        return rows

    def test_step(self, batch: dict[str, Any], batch_idx: int) -> None:
        probabilities = self._evaluate(batch, "test")
        for subject, label, row in zip(batch["subject"], batch[self.label_key], probabilities, strict=True):
            self.add_prediction_rows([{
                "subject": str(subject), "class_label": int(label), "predicted": int(row.argmax()),
                **{f"p{c}": float(p) for c, p in enumerate(row)}, "split": "test",
            }])

    def on_test_epoch_end(self) -> None:
        self._log_epoch("test")
        super().on_test_epoch_end()


class ClassCounts(Metric):
    """Subjects per class over the whole set, summed over ranks."""

    def __init__(self, num_classes: int) -> None:
        super().__init__()
        self.add_state("counts", default=torch.zeros(num_classes, dtype=torch.long), dist_reduce_fx="sum")

    def update(self, labels: torch.Tensor) -> None:
        self.counts += torch.bincount(labels.long().flatten(), minlength=len(self.counts))

    def compute(self) -> torch.Tensor:
        return self.counts


def set_auroc(per_class: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """Macro one-vs-rest AUROC over the classes a set holds; NaN when it holds fewer than two (no AUROC exists)."""
    present = counts > 0
    if int(present.sum()) < 2:
        return torch.tensor(float("nan"), device=per_class.device)
    return per_class[present].float().mean()
