"""`model=classifier`: class logits from a 3D ResNet (+ covariates), cross-entropy, AUROC and (balanced) accuracy."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torchmetrics import MetricCollection
from torchmetrics.classification import MulticlassAccuracy, MulticlassAUROC, MulticlassRecall

from lightning_modules.discriminative.outcome_module import OutcomeModule
from medvol.core.errors import MedvolError


class ClassifierModel(OutcomeModule):
    """Binary or multiclass classification of the batch's `class_label` (int64, 0..num_classes-1).

    Metrics over the whole evaluation set, synced across ranks by torchmetrics (the AUROC
    concatenates every subject's probabilities, so it is the AUROC of the set, not a mean):
    `auroc` (one-vs-rest, macro), `accuracy` (micro) and `balanced_accuracy` (macro recall).

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
            "auroc": MulticlassAUROC(num_classes, average="macro", thresholds=None),
            "accuracy": MulticlassAccuracy(num_classes, average="micro"),
            "balanced_accuracy": MulticlassRecall(num_classes, average="macro"),
        })
        self.val_metrics = metrics.clone(prefix="val/")
        self.test_metrics = metrics.clone(prefix="test/")

    def check_training_split(self, table: dict[str, Any]) -> None:
        labels = table.get("class_label")
        if labels is None:
            return
        classes = sorted({int(v) for v in labels.tolist()})
        if len(classes) < 2:
            raise MedvolError(
                f"`dataset.class_column`: all {len(labels)} training rows of {table['source']} have class {classes[0]}; "
                "a classifier needs at least two classes"
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

    def _evaluate(self, batch: dict[str, Any], metrics: MetricCollection) -> torch.Tensor:
        probabilities = self(batch).float().softmax(dim=1)
        metrics.update(probabilities, batch[self.label_key])
        self.log_dict(metrics, batch_size=len(probabilities))
        return probabilities

    def validation_step(self, batch: dict[str, Any], batch_idx: int) -> None:
        self._evaluate(batch, self.val_metrics)

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
        probabilities = self._evaluate(batch, self.test_metrics)
        for subject, label, row in zip(batch["subject"], batch[self.label_key], probabilities, strict=True):
            self.add_prediction_rows([{
                "subject": str(subject), "class_label": int(label), "predicted": int(row.argmax()),
                **{f"p{c}": float(p) for c, p in enumerate(row)}, "split": "test",
            }])
