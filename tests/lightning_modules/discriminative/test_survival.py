"""`SurvivalModel`'s own steps: the Cox loss of the batch's log-risks, whole-set metrics, per-subject rows.

The network is replaced by one that returns each subject's `image` as its log-risk, so the
expected values can be worked out by hand or taken from lifelines on the same numbers.
"""

from __future__ import annotations

import itertools
import math
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch

from lightning_modules.discriminative.survival import SurvivalModel
from medvol.core.errors import MedvolError


class LogRiskNet(torch.nn.Module):
    """Stands in for the image network: each subject's one-value `image` is its log-risk."""

    covariates = None

    def forward(self, image: torch.Tensor, covariates: torch.Tensor | None) -> torch.Tensor:
        return image.view(-1, 1)


def survival_model(ties: str = "breslow") -> tuple[SurvivalModel, dict[str, Any]]:
    """The model under a one-process stand-in trainer, and the values it logs."""
    # One value per subject has no axes to mirror: test-time mirroring is tested below on volumes.
    module = SurvivalModel(ties=ties, backbone="resnet10", widen_factor=0.125, tta=False)
    module.net = LogRiskNet()
    module._trainer = SimpleNamespace(world_size=1, is_global_zero=True, datamodule=None, sanity_checking=False)
    logged: dict[str, Any] = {}
    module.log = lambda name, value, **kwargs: logged.__setitem__(name, float(value))
    module.log_dict = lambda values, **kwargs: logged.update({k: float(v) for k, v in values.items()})
    return module, logged


def batch(log_risk, time, event, subjects=None) -> dict[str, Any]:
    return {"image": torch.tensor(log_risk, dtype=torch.float32), "time": torch.tensor(time),
            "event": torch.tensor(event), "subject": subjects or [f"s{i}" for i in range(len(log_risk))]}


@pytest.mark.parametrize(("ties", "hand_sum"), [
    # exp(risk) = 1, 2, 1, 3; times 1, 1, 2, 3; events 1, 1, 0, 1. At t=1 both events share the risk set
    # {all} (sum 7): Breslow log1+log2-2log7; Efron log1+log2-log7-log(7-(1+2)/2). At t=3: log3-log3 = 0.
    ("breslow", 2 * math.log(7) - math.log(2)), ("efron", math.log(7) + math.log(5.5) - math.log(2)),
])
def test_the_training_loss_is_the_negative_partial_likelihood_of_the_batch(ties, hand_sum):
    module, logged = survival_model(ties)
    loss = module.training_step(batch(np.log([1.0, 2.0, 1.0, 3.0]), [1.0, 1.0, 2.0, 3.0], [1.0, 1.0, 0.0, 1.0]), 0)
    # The mean is over the distinct event times (2 here).
    assert float(loss) == pytest.approx(hand_sum / 2, abs=1e-5)
    assert logged["train/events_per_batch"] == 3.0 and logged["train/batches_without_events"] == 0.0


def test_validation_logs_the_c_index_of_the_whole_set_not_a_mean_over_batches():
    concordance_index = pytest.importorskip("lifelines.utils").concordance_index
    rng = np.random.default_rng(5)
    risk, time = rng.normal(size=20), rng.integers(1, 8, size=20).astype(float)
    event = (rng.random(20) < 0.6).astype(float)
    module, logged = survival_model()
    for start in range(0, 20, 3):
        part = slice(start, start + 3)
        module.validation_step(batch(risk[part], time[part], event[part]), 0)
    module.on_validation_epoch_end()
    # lifelines takes a predicted survival time: higher risk = shorter survival, so pass -risk.
    assert logged["val/cindex"] == pytest.approx(concordance_index(time, -risk, event), abs=1e-6)


def test_test_rows_hold_each_subjects_log_risk_time_and_event():
    module, _ = survival_model()
    module.on_test_epoch_start()
    module.test_step(batch([0.5, -1.0], [4.0, 2.0], [1.0, 0.0], ["b", "a"]), 0)
    assert module._rows == [
        {"subject": "b", "risk": 0.5, "time": 4.0, "event": 1, "split": "test"},
        {"subject": "a", "risk": -1.0, "time": 2.0, "event": 0, "split": "test"},
    ]


def test_prediction_rows_hold_the_follow_up_only_where_the_batch_has_it():
    module, _ = survival_model()
    rows = module.prediction_rows({"image": torch.tensor([0.25]), "subject": ["new"]}, "predict")
    assert rows == [{"subject": "new", "risk": 0.25, "split": "predict"}]
    rows = module.prediction_rows(batch([0.25], [3.0], [1.0], ["known"]), "predict")
    assert rows == [{"subject": "known", "risk": 0.25, "time": 3.0, "event": 1, "split": "predict"}]


def test_a_training_split_without_events_and_unknown_ties_are_refused():
    module, _ = survival_model()
    with pytest.raises(MedvolError, match="none of the 3 training rows of t.csv has an event"):
        module.check_training_split({"event": torch.zeros(3), "source": "t.csv"})
    module.check_training_split({"event": torch.tensor([0.0, 1.0, 0.0]), "source": "t.csv"})
    with pytest.raises(MedvolError, match="`model.ties` is 'exact'; expected one of"):
        SurvivalModel(ties="exact", backbone="resnet10", widen_factor=0.125)


class LinearRiskNet(torch.nn.Module):
    """A log-risk that depends on where each voxel is: the sum of the volume times a fixed weight volume."""

    covariates = None

    def __init__(self, weight: np.ndarray) -> None:
        super().__init__()
        self.weight = torch.tensor(weight, dtype=torch.float32)

    def forward(self, image: torch.Tensor, covariates: torch.Tensor | None) -> torch.Tensor:
        return (image[:, 0] * self.weight).sum(dim=(1, 2, 3)).view(-1, 1)


def test_mirroring_averages_the_log_risk_over_the_eight_mirrored_copies_and_is_off_with_tta_false():
    rng = np.random.default_rng(2)
    weight, volumes = rng.normal(size=(2, 3, 4)), rng.normal(size=(2, 1, 2, 3, 4))
    # By hand: the mean of w . flip(x) over every subset of the three axes is (the mean of flip(w)) . x.
    flips = [axes for size in range(4) for axes in itertools.combinations((0, 1, 2), size)]
    assert len(flips) == 8
    mean_weight = np.mean([np.flip(weight, axes) for axes in flips], axis=0)
    expected = (volumes[:, 0] * mean_weight).sum(axis=(1, 2, 3))
    module, _ = survival_model()
    module.net = LinearRiskNet(weight)
    image = torch.tensor(volumes, dtype=torch.float32)
    module.tta = False
    plain = module.prediction_rows({"image": image, "subject": ["a", "b"]}, "predict")
    assert [r["risk"] for r in plain] == pytest.approx((volumes[:, 0] * weight).sum(axis=(1, 2, 3)), abs=1e-5)
    module.tta = True
    for axes in flips:  # the mirrored mean is the same for every mirrored copy of the input
        flipped = torch.flip(image, [2 + a for a in axes])
        rows = module.prediction_rows({"image": flipped, "subject": ["a", "b"]}, "predict")
        assert [r["risk"] for r in rows] == pytest.approx(expected, abs=1e-5)
    module.on_test_epoch_start()
    module.test_step({**batch([0.0, 0.0], [4.0, 2.0], [1.0, 0.0], ["a", "b"]), "image": image}, 0)
    assert [r["risk"] for r in module._rows] == pytest.approx(expected, abs=1e-5)
