"""`OutcomeModule`, what survival and classification share: covariate statistics of the training split,
the checks of that split, the optimizer, and the per-subject table written at test time."""

from __future__ import annotations

import csv
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch

from lightning_modules.discriminative.outcome_module import OutcomeModule
from medvol.core.errors import MedvolError

TRAIN_COVARIATES = torch.tensor([[61.0, 0.0], [47.0, 1.0], [75.0, 1.0], [52.0, 0.0]])


class OneScore(OutcomeModule):
    """The smallest family: one score per subject, rows of subject and score; records the splits it checked."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(outputs=1, backbone="resnet10", widen_factor=0.125, **kwargs)
        self.checked: list[dict[str, Any]] = []

    def check_training_split(self, table: dict[str, Any]) -> None:
        self.checked.append(table)

    def prediction_rows(self, batch: dict[str, Any], split: str) -> list[dict[str, Any]]:
        pairs = zip(batch["subject"], batch["score"], strict=True)
        return [{"subject": s, "score": float(v), "split": split} for s, v in pairs]


def attach(module: OutcomeModule, tables: dict[str, dict[str, Any]] | None) -> list[str]:
    """Give `module` a trainer whose datamodule serves `tables` per split; returns the splits asked for."""
    asked: list[str] = []

    def split_outcomes(stage: str) -> dict[str, Any]:
        asked.append(stage)
        return tables[stage]

    datamodule = SimpleNamespace(split_outcomes=split_outcomes) if tables is not None else None
    module._trainer = SimpleNamespace(datamodule=datamodule, world_size=1, is_global_zero=True)
    return asked


def test_setup_fits_the_covariates_on_the_training_split_and_checks_it_only_for_fit():
    module = OneScore(num_covariates=2)
    table = {"covariates": TRAIN_COVARIATES, "source": "table.csv"}
    asked = attach(module, {"train": table})
    module.setup("fit")
    assert asked == ["train"] and module.checked == [table]
    np.testing.assert_allclose(module.net.covariates.mean.numpy(), TRAIN_COVARIATES.double().mean(0).numpy())
    np.testing.assert_allclose(module.net.covariates.std.numpy(), TRAIN_COVARIATES.numpy().std(0, dtype=np.float64))
    module.setup("test")
    assert module.checked == [table]


def test_fitted_statistics_are_never_refitted_on_other_data():
    module = OneScore(num_covariates=2)
    module.net.covariates.fit(TRAIN_COVARIATES)
    attach(module, {"train": {"covariates": TRAIN_COVARIATES * 10, "source": "other.csv"}})
    module.setup("test")
    np.testing.assert_allclose(module.net.covariates.mean.numpy(), TRAIN_COVARIATES.double().mean(0).numpy())


@pytest.mark.parametrize(("tables", "message"), [
    (None, "`model.num_covariates` is 2 but `dataset` gives no covariate table"),
    ({"train": {"covariates": TRAIN_COVARIATES[:, :1]}},
     "`model.num_covariates` is 2 but `dataset.covariate_columns` has 1"),
])
def test_covariates_the_data_cannot_supply_are_refused(tables, message):
    module = OneScore(num_covariates=2)
    attach(module, tables)
    with pytest.raises(MedvolError, match=message.replace("(", r"\(")):
        module.setup("fit")


def test_a_batch_without_the_covariates_the_network_needs_is_refused():
    module = OneScore(num_covariates=2)
    with pytest.raises(MedvolError, match="the batches have no `covariates`"):
        module({"image": torch.zeros(1, 1, 16, 16, 16)})
    with pytest.raises(MedvolError, match="`model.num_covariates` must be >= 0, got -1"):
        OneScore(num_covariates=-1)


def test_the_optimizer_gets_every_parameter_and_the_scheduler_its_optimizer():
    module = OneScore(optimizer=lambda params: torch.optim.SGD(params, lr=0.5),
                      scheduler=lambda optimizer: torch.optim.lr_scheduler.StepLR(optimizer, step_size=2))
    configured = module.configure_optimizers()
    optimizer = configured["optimizer"]
    assert sum(p.numel() for g in optimizer.param_groups for p in g["params"]) == sum(
        p.numel() for p in module.parameters())
    assert configured["lr_scheduler"].optimizer is optimizer
    default = OneScore().configure_optimizers()
    assert isinstance(default, torch.optim.Adam) and default.param_groups[0]["lr"] == 1e-4


def test_the_test_table_holds_every_subject_once_sorted_by_subject(tmp_path):
    module = OneScore(predictions_dir=str(tmp_path / "out"))
    attach(module, None)
    module.on_test_epoch_start()
    module.add_prediction_rows(module.prediction_rows({"subject": ["s10", "s02"], "score": [0.5, 1.5]}, "test"))
    module.add_prediction_rows(module.prediction_rows({"subject": ["s01"], "score": [2.5]}, "test"))
    module.on_test_epoch_end()
    with (tmp_path / "out" / "predictions.csv").open(newline="") as handle:
        rows = list(csv.DictReader(handle))
    assert rows == [
        {"subject": "s01", "score": "2.5", "split": "test"},
        {"subject": "s02", "score": "1.5", "split": "test"},
        {"subject": "s10", "score": "0.5", "split": "test"},
    ]
    assert module._rows == []
