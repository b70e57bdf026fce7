"""What survival and classification share: the image(+covariates) network, train-split statistics, gathered predictions.

Data protocol: a datamodule that has `split_outcomes(stage)` (the CSV table does) returns the
outcome columns of every subject of a split, on every rank; the module takes its covariate
statistics and its sanity checks of the training split from it. Other datamodules (the
synthetic phantoms) simply provide the batch keys.
"""

from __future__ import annotations

import csv
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from pytorch_lightning.utilities import move_data_to_device

from lightning_modules.base import DYNAMIC_AXES, ExportedNetwork, MedvolModule, spatial_examples
from lightning_modules.discriminative.fusion_net import ImageCovariateNet
from medvol.core.errors import MedvolError
from medvol.volumes.sliding_window import SlidingWindow


class OutcomeModule(MedvolModule, ABC):
    """A LightningModule predicting one outcome per subject from `image` (and `covariates`).

    Args:
        outputs: network outputs per subject.
        backbone: resnet10, resnet18, resnet34 or resnet50 (MONAI, random initialisation).
        in_channels: image channels.
        num_covariates: length of the batch's `covariates` vector; 0 for image only.
        covariate_names: the covariates' names (the table's columns), for the per-subject tables; null names
            them covariate_0, covariate_1, ...
        widen_factor: backbone width scale (1.0 is the published network).
        dropout: dropout before the head.
        pretrained_path: local backbone weights; nothing is downloaded.
        compile: `torch.compile` the network (GPU runs).
        optimizer: partial optimizer (given the parameters).
        scheduler: optional partial LR scheduler, stepped once per epoch.
        image_key: batch key of the volume.
        predictions_dir: where `test` writes the per-subject table; null writes none.
    """

    prediction_file = "predictions.csv"
    # One prediction pooled from the whole volume: predict.py gives it volumes of the training size.
    fixed_input_size = True

    def __init__(
        self,
        outputs: int,
        backbone: str = "resnet18",
        in_channels: int = 1,
        num_covariates: int = 0,
        covariate_names: Sequence[str] | None = None,
        widen_factor: float = 1.0,
        dropout: float = 0.0,
        pretrained_path: str | None = None,
        compile: bool = False,
        optimizer: Callable[..., torch.optim.Optimizer] | None = None,
        scheduler: Callable[..., Any] | None = None,
        image_key: str = "image",
        predictions_dir: str | None = None,
    ) -> None:
        super().__init__()
        if num_covariates < 0:
            raise MedvolError(f"`model.num_covariates` must be >= 0, got {num_covariates}")
        names = [str(n) for n in covariate_names] if covariate_names is not None else None
        if names is not None and len(names) != num_covariates:
            raise MedvolError(
                f"`model.covariate_names` has {len(names)} names ({names}) but `model.num_covariates` is "
                f"{num_covariates}; expected one name per covariate"
            )
        self.covariate_names = names or [f"covariate_{i}" for i in range(num_covariates)]
        self.net = ImageCovariateNet(
            outputs, backbone, in_channels, num_covariates, widen_factor, dropout, pretrained_path
        )
        if compile:
            self.net.compile()
        self.optimizer_factory = optimizer or (lambda params: torch.optim.Adam(params, lr=1e-4))
        self.scheduler_factory = scheduler
        self.image_key = image_key
        self.predictions_dir = Path(predictions_dir) if predictions_dir else None
        self._rows: list[dict[str, Any]] = []

    def forward(self, batch: dict[str, Any]) -> torch.Tensor:
        covariates = None
        if self.net.covariates is not None:
            if "covariates" not in batch:
                raise MedvolError(
                    f"`model.num_covariates` is {self.net.covariates.mean.numel()} but the batches have no "
                    "`covariates`; set `dataset.covariate_columns` or model.num_covariates=0"
                )
            covariates = batch["covariates"]
        return self.net(batch[self.image_key], covariates)

    def covariate_values(self, batch: dict[str, Any], index: int) -> dict[str, float]:
        """Subject `index`'s covariates as the table gave them (before standardisation), by name; none without."""
        if not self.covariate_names or "covariates" not in batch:
            return {}
        values = batch["covariates"][index].tolist()
        return {name: float(v) for name, v in zip(self.covariate_names, values, strict=True)}

    def configure_optimizers(self) -> Any:
        optimizer = self.optimizer_factory(self.parameters())
        if self.scheduler_factory is None:
            return optimizer
        return {"optimizer": optimizer, "lr_scheduler": self.scheduler_factory(optimizer)}

    # Training-split statistics and checks ----------------------------------------------------

    def split_outcomes(self, stage: str) -> dict[str, Any] | None:
        """The datamodule's outcome table of a whole split (all ranks' subjects), or None if it has none."""
        datamodule = getattr(self.trainer, "datamodule", None)
        table = getattr(datamodule, "split_outcomes", None)
        return table(stage) if callable(table) else None

    def check_training_split(self, table: dict[str, Any]) -> None:
        """Family-specific checks of the training split's outcomes (raise `MedvolError`)."""

    def setup(self, stage: str) -> None:
        table = self.split_outcomes("train")
        if table is not None and stage == "fit":
            self.check_training_split(table)
        scaler = self.net.covariates
        if scaler is None or bool(scaler.fitted):
            return
        if table is None or table.get("covariates") is None:
            raise MedvolError(
                f"`model.num_covariates` is {scaler.mean.numel()} but `dataset` gives no covariate table; "
                "use dataset=csv with `dataset.covariate_columns`, or model.num_covariates=0"
            )
        covariates = table["covariates"]
        if covariates.shape[1] != scaler.mean.numel():
            raise MedvolError(
                f"`model.num_covariates` is {scaler.mean.numel()} but `dataset.covariate_columns` has "
                f"{covariates.shape[1]}"
            )
        # Fitted before a resumed checkpoint is loaded, which then puts the original statistics back.
        scaler.fit(covariates)

    # Per-subject predictions at test time ----------------------------------------------------

    @abstractmethod
    def prediction_rows(self, batch: dict[str, Any], split: str) -> list[dict[str, Any]]:
        """One row per subject of the batch (its prediction, and its reference where the batch has one)."""

    def predict_volumes(
        self, batch: dict[str, Any], window: SlidingWindow, extras: Sequence[str] = ()
    ) -> dict[str, Any]:
        """The rows of `predictions.csv` for whole volumes (`predict.py`): the network sees the whole volume."""
        return {"rows": self.prediction_rows(move_data_to_device(batch, self.device), "predict")}

    def exported_networks(self, size: Sequence[int]) -> list[ExportedNetwork]:
        """The network on a whole volume (adaptive pooling: any size of at least the network's 32x halving) and,
        where it was trained with them, the raw covariates (standardised inside, with the training split's
        statistics)."""
        image, larger = spatial_examples(self.net.backbone.conv1.in_channels, size, [32, 32, 32])
        inputs, seconds, dynamic = {"image": image}, {"image": larger}, {"image": DYNAMIC_AXES, "output": {0: "batch"}}
        if self.net.covariates is not None:
            count = self.net.covariates.mean.numel()
            generator = torch.Generator().manual_seed(1)
            inputs["covariates"] = torch.randn(1, count, generator=generator)
            seconds["covariates"] = torch.randn(2, count, generator=generator)
            dynamic["covariates"] = {0: "batch"}
        return [ExportedNetwork("network", self.net.eval(), inputs, "output", dynamic, seconds, self.export_about())]

    def not_exportable(self) -> str:
        return (
            "predict.py gives it one row per subject (predictions.csv) from the whole volume, not a volume a bundle's "
            "sliding window writes; format=onnx or format=torchscript exports the network (docs/export.md)"
        )

    def export_about(self) -> dict[str, Any]:
        """What the network's output means (the families say)."""
        return {}

    def add_prediction_rows(self, rows: Sequence[dict[str, Any]]) -> None:
        self._rows.extend(rows)

    def on_test_epoch_start(self) -> None:
        self._rows = []

    def on_test_epoch_end(self) -> None:
        rows = self._rows
        if dist.is_available() and dist.is_initialized() and self.trainer.world_size > 1:
            gathered: list[list[dict[str, Any]] | None] = [None] * self.trainer.world_size
            dist.all_gather_object(gathered, rows)
            rows = [row for part in gathered for row in part or []]
        self._rows = []
        if self.predictions_dir is None or not self.trainer.is_global_zero:
            return
        rows = sorted(rows, key=lambda row: str(row["subject"]))
        self.predictions_dir.mkdir(parents=True, exist_ok=True)
        with (self.predictions_dir / self.prediction_file).open("w", newline="") as handle:
            writer = csv.DictWriter(handle, fieldnames=list(rows[0]) if rows else ["subject"])
            writer.writeheader()
            writer.writerows(rows)
