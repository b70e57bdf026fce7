"""The survival plan's values (medvol/volumes/survival_plan.py), each worked out by hand from a fingerprint."""

from __future__ import annotations

import math

import numpy as np
import pytest

from medvol.volumes.plan import DataFingerprint
from medvol.volumes.survival_plan import (
    EVENTS_PER_BATCH,
    body_shape,
    describe_survival_plan,
    event_batch,
    fitted_spacing,
    make_survival_plan,
)

MR = {"kind": "mr", "mean": 300.0, "std": 50.0, "low": 200.0, "high": 420.0}
CT = {"kind": "ct", "mean": 30.0, "std": 200.0, "low": -900.0, "high": 1200.0}


def fingerprint(spacings, shapes, channels=(MR,)) -> DataFingerprint:
    return DataFingerprint(np.asarray(spacings, float), np.asarray(shapes, float), np.ones(len(spacings)),
                           list(channels))


@pytest.mark.parametrize(("rate", "subjects", "batch"), [
    (0.5, 100, 10),   # 5 / 0.5
    (0.6, 100, 9),    # ceil(5 / 0.6 = 8.3)
    (1.0, 100, 5),
    (0.6, 10, 5),     # at most half the training subjects: two steps an epoch
    (0.05, 1000, 64),  # 100 wanted, capped
    (1.0, 4, 2),
])
def test_the_batch_is_the_smallest_expected_to_hold_enough_events(rate, subjects, batch):
    assert event_batch(rate, subjects) == batch
    if 4 <= batch < 64 and batch < subjects // 2:
        assert rate * batch >= EVENTS_PER_BATCH > rate * (batch - 1)


def test_the_volume_holds_the_largest_body_rounded_up_to_eights():
    found = fingerprint([(2.0, 2.0, 2.0)] * 3, [(20, 30, 25), (22, 28, 26), (40, 30, 25)])
    # Largest extents 80 x 60 x 52 mm (the median body's: 44 x 60 x 50); at 4 mm 20 x 15 x 13 voxels, rounded up to
    # multiples of 8.
    assert body_shape(found, [4.0, 4.0, 4.0]) == [24, 16, 16]
    assert body_shape(found, [2.0, 2.0, 2.0]) == [40, 32, 32]


def test_the_median_spacing_is_coarsened_only_as_far_as_the_budget_needs():
    found = fingerprint([(1.0, 1.0, 2.0), (1.0, 1.0, 2.0), (2.0, 2.0, 4.0)], [(180, 200, 90), (170, 210, 80),
                                                                           (90, 100, 45)])
    assert fitted_spacing(found, 10**9) == [1.0, 1.0, 2.0]
    spacing = fitted_spacing(found, 48**3)
    ratio = np.asarray(spacing) / np.asarray([1.0, 1.0, 2.0])
    assert np.allclose(ratio, ratio[0], rtol=1e-3) and ratio[0] > 1
    assert math.prod(body_shape(found, spacing)) <= 48**3
    assert math.prod(body_shape(found, np.asarray(spacing) / 1.1)) > 48**3


def test_the_plan_normalizes_mr_per_volume_and_ct_with_the_datasets_statistics():
    found = fingerprint([(3.0, 3.0, 3.0)] * 4, [(30, 30, 30)] * 4, channels=(MR, CT))
    plan = make_survival_plan(found, [1, 0, 1, 1, 0, 1, 1, 1, 0, 1], 48**3)
    assert plan["normalization"] == [{"kind": "mr", "use_mask": True},
                                     {"kind": "ct", "clip": [-900.0, 1200.0], "mean": 30.0, "std": 200.0}]
    assert plan["spacing"] == [3.0, 3.0, 3.0] and plan["spatial_size"] == [32, 32, 32] and plan["crop_foreground"]
    # 7 events in 10 subjects: ceil(5 / 0.7) = 8 wanted, but at most half of the 10 training subjects.
    assert (plan["event_rate"], plan["batch_size"], plan["flip_prob"], plan["overridden"]) == (0.7, 5, 0.5, [])
    forced = make_survival_plan(found, [1] * 40, 48**3, {"batch_size": 6, "spacing": [5, 5, 5], "spatial_size": None},
                                kinds=["mr", "mr"])
    assert (forced["batch_size"], forced["spacing"], forced["spatial_size"]) == (6, [5.0, 5.0, 5.0], [24, 24, 24])
    assert forced["overridden"] == ["batch_size", "spacing"]
    assert forced["normalization"] == [{"kind": "mr", "use_mask": True}] * 2
    lines = describe_survival_plan(forced)
    assert "spacing 5x5x5 mm" in lines[0] and "batch 6" in lines[1] and lines[2].endswith("batch_size, spacing")
