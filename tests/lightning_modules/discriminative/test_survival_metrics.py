"""The survival metrics against scikit-survival and lifelines on hand-made sets (not against torchsurv, which computes
them): Uno's C, the time-dependent AUC, Breslow's baseline hazard and the integrated Brier score. The references are
the dev extra's: a test whose reference is not installed is skipped (the GPU image has no scikit-survival)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from lightning_modules.discriminative.survival_metrics import (
    breslow_baseline,
    brier_grid,
    survival_metrics,
    survival_probabilities,
)


def hand_made_set(seed: int, n: int = 40) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """True log-hazards, follow-up times (distinct, so no event shares its time with a censoring: scikit-survival and
    torchsurv read such ties differently) and events (~30% censored)."""
    rng = np.random.default_rng(seed)
    risk = rng.normal(size=n)
    event_time = rng.exponential(20.0 * np.exp(-risk))
    censoring = rng.uniform(5.0, 60.0, n)
    time = np.minimum(event_time, censoring) + rng.uniform(0.0, 1e-3, n)
    return risk, time, event_time <= censoring


def metrics(risk, time, event, horizons=(), baseline=None) -> dict[str, float]:
    values = survival_metrics(torch.tensor(risk), torch.tensor(time), torch.tensor(event, dtype=torch.float64),
                              horizons, baseline)
    return {k: float(v) for k, v in values.items()}


@pytest.mark.parametrize("seed", [0, 3, 5])
def test_uno_c_and_the_time_dependent_auc_equal_scikit_survivals(seed):
    sksurv_metrics = pytest.importorskip("sksurv.metrics")
    risk, time, event = hand_made_set(seed)
    survival = pytest.importorskip("sksurv.util").Surv.from_arrays(event, time)
    horizons = [float(h) for h in np.percentile(time[event], [30, 70])]
    computed = metrics(risk, time, event, horizons)
    # The censoring distribution is estimated on the evaluated set itself, as medvol does.
    uno = sksurv_metrics.concordance_index_ipcw(survival, survival, risk)[0]
    assert computed["uno_cindex"] == pytest.approx(uno, abs=1e-6)
    auc, _ = sksurv_metrics.cumulative_dynamic_auc(survival, survival, risk, horizons)
    assert [computed[f"auc@{h:g}"] for h in horizons] == pytest.approx(auc.tolist(), abs=1e-6)
    # Censoring weights matter here: Uno's C is not Harrell's.
    assert abs(computed["uno_cindex"] - computed["cindex"]) > 1e-3


def test_breslows_baseline_gives_lifelines_survival_curves_of_a_fitted_cox_model():
    pd = pytest.importorskip("pandas")
    cox_model = pytest.importorskip("lifelines").CoxPHFitter
    rng = np.random.default_rng(3)
    frame = pd.DataFrame({"x": rng.normal(size=60)})
    frame["time"] = np.round(rng.exponential(10.0 * np.exp(-frame["x"])), 1) + 0.1  # ties included
    frame["event"] = (rng.random(60) < 0.75).astype(int)
    cox = cox_model(baseline_estimation_method="breslow").fit(frame, "time", "event")
    risk = cox.predict_log_partial_hazard(frame).to_numpy()
    # At event times: between them lifelines interpolates its curve, where the estimate is a step.
    at = np.unique(frame["time"][frame["event"] == 1])[[0, 5, 20, -1]]
    baseline = breslow_baseline(torch.tensor(risk), torch.tensor(frame["time"].to_numpy()),
                                torch.tensor(frame["event"].to_numpy(), dtype=torch.float64))
    computed = survival_probabilities(torch.tensor(risk), *baseline, torch.tensor(at)).numpy()
    expected = cox.predict_survival_function(frame, times=at).to_numpy().T
    np.testing.assert_allclose(computed, expected, atol=1e-6)
    # The same log-risks shifted by a constant give the same curves (the baseline absorbs it).
    shifted = breslow_baseline(torch.tensor(risk + 3.0), torch.tensor(frame["time"].to_numpy()),
                               torch.tensor(frame["event"].to_numpy(), dtype=torch.float64))
    np.testing.assert_allclose(survival_probabilities(torch.tensor(risk + 3.0), *shifted, torch.tensor(at)).numpy(),
                               expected, atol=1e-6)


@pytest.mark.parametrize("seed", [0, 4])
def test_the_integrated_brier_score_equals_scikit_survivals_with_the_baseline_of_other_subjects(seed):
    sksurv_metrics = pytest.importorskip("sksurv.metrics")
    breslow = pytest.importorskip("sksurv.linear_model.coxph").BreslowEstimator
    risk, time, event = hand_made_set(seed, 50)
    train_risk, train_time, train_event = hand_made_set(seed + 100, 50)
    estimator = breslow().fit(train_risk, train_event, train_time)
    baseline = breslow_baseline(torch.tensor(train_risk), torch.tensor(train_time),
                                torch.tensor(train_event, dtype=torch.float64))
    grid = brier_grid(torch.tensor(time)).numpy()
    curves = np.stack([f(grid) for f in estimator.get_survival_function(risk)])
    survival = pytest.importorskip("sksurv.util").Surv.from_arrays(event, time)
    expected = sksurv_metrics.integrated_brier_score(survival, survival, curves, grid)
    assert metrics(risk, time, event, baseline=baseline)["ibs"] == pytest.approx(expected, abs=1e-6)
    # A risk that knows nothing scores worse than the fitted one.
    assert metrics(np.zeros_like(risk), time, event, baseline=baseline)["ibs"] > expected


def test_no_baseline_or_a_baseline_without_events_gives_no_brier_score():
    risk, time, event = hand_made_set(5)
    assert "ibs" not in metrics(risk, time, event)
    empty = breslow_baseline(torch.tensor(risk), torch.tensor(time), torch.zeros(len(risk), dtype=torch.float64))
    assert empty[0].numel() == 0 and "ibs" not in metrics(risk, time, event, baseline=empty)
