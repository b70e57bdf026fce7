"""Kaplan-Meier curves of the risk groups and their log-rank test against lifelines; the figure drawn from them."""

from __future__ import annotations

import math

import numpy as np
import pytest

from lightning_modules.discriminative.risk_groups import COLOURS, kaplan_meier, km_figure, risk_groups


def cohort(seed: int, n: int = 41) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Risks, follow-up (rounded: events and censorings share times) and events of a set whose risk matters."""
    rng = np.random.default_rng(seed)
    risk = rng.normal(size=n)
    event_time = rng.exponential(20.0 * np.exp(-risk))
    censoring = rng.uniform(5.0, 60.0, n)
    return risk, np.round(np.minimum(event_time, censoring)), event_time <= censoring


@pytest.mark.parametrize("seed", [0, 1])
def test_each_groups_curve_is_lifelines_kaplan_meier_estimate(seed):
    KaplanMeierFitter = pytest.importorskip("lifelines").KaplanMeierFitter
    risk, time, event = cohort(seed)
    result = risk_groups(risk, time, event)
    high = risk > np.median(risk)
    for name, members in (("high risk", high), ("low risk", ~high)):
        group = result.groups[name]
        fitted = KaplanMeierFitter().fit(time[members], event[members])
        grid = np.linspace(0.0, time.max() + 5, 200)
        expected = fitted.survival_function_at_times(grid).to_numpy()
        np.testing.assert_allclose(group.at(grid), expected, atol=1e-12)
        assert (group.subjects, group.events) == (int(members.sum()), int(event[members].sum()))
        np.testing.assert_array_equal(group.censored, np.sort(time[members & ~event]))
    # The median subject goes with the low-risk group: 20 above it, 21 at or below.
    assert (result.groups["high risk"].subjects, result.groups["low risk"].subjects) == (20, 21)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_the_log_rank_p_value_is_lifelines(seed):
    logrank_test = pytest.importorskip("lifelines.statistics").logrank_test
    risk, time, event = cohort(seed)
    high = risk > np.median(risk)
    expected = logrank_test(time[high], time[~high], event[high], event[~high]).p_value
    assert risk_groups(risk, time, event).p_value == pytest.approx(expected, rel=1e-9)


def test_a_set_without_events_has_flat_curves_and_no_p_value():
    result = risk_groups(np.arange(6.0), np.arange(1.0, 7.0), np.zeros(6))
    assert math.isnan(result.p_value)
    for group in result.groups.values():
        assert group.events == 0 and np.all(group.at(np.array([0.0, 10.0])) == 1.0)
    assert kaplan_meier(np.array([2.0]), np.array([True])).at(np.array([1.0, 2.0])).tolist() == [1.0, 0.0]


def test_the_figure_draws_both_curves_in_their_colours():
    risk, time, event = cohort(0)
    image = km_figure(risk_groups(risk, time, event), "test set")
    assert image.shape == (520, 760, 3) and image.dtype == np.uint8
    for colour in COLOURS.values():
        assert (np.abs(image.astype(int) - colour).sum(-1) == 0).sum() > 200
