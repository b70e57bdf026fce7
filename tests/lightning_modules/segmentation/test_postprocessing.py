"""Largest-component post-processing, chosen by nnU-Net's rule: kept where it helps, dropped where it hurts."""

from __future__ import annotations

import numpy as np
import pytest
from scipy import ndimage

from lightning_modules.segmentation.label_scheme import LabelScheme
from lightning_modules.segmentation.postprocessing import ALL_FOREGROUND, Postprocessing, choose, keep_largest
from medvol.core.errors import MedvolError

CLASSES = LabelScheme(num_classes=3, class_names=["core", "oedema"])


def blob(shape: tuple[int, int, int], corner: tuple[int, int, int], size: int, value: int, into=None) -> np.ndarray:
    out = np.zeros(shape, dtype=np.uint8) if into is None else into
    a, b, c = corner
    out[a:a + size, b:b + size, c:c + size] = value
    return out


def loaders(pairs):
    return [lambda p=p, t=t: (p, t) for p, t in pairs]


def test_keep_largest_drops_the_smaller_components_of_the_named_values_only():
    seg = blob((12, 12, 12), (0, 0, 0), 4, 1)
    blob((12, 12, 12), (8, 8, 8), 2, 1, seg)  # a smaller class-1 piece
    blob((12, 12, 12), (0, 8, 0), 2, 2, seg)  # class 2, untouched when only class 1 is named
    seg[4, 4, 4] = 1  # touches the big cube only through a corner: 26-connected, so kept
    out = keep_largest(seg, [1])
    expected_mask = ndimage.label(seg == 1, structure=np.ones((3, 3, 3)))[0] == 1
    assert np.array_equal(out == 1, expected_mask) and int((out == 1).sum()) == 64 + 1
    assert np.array_equal(out == 2, seg == 2)
    # Both classes as one: class 2's cube is a separate component of the foreground, smaller: gone.
    assert int((keep_largest(seg, [1, 2]) == 2).sum()) == 0


def test_chosen_where_it_helps_every_class():
    shape = (16, 16, 16)
    pairs = []
    for shift in range(3):
        truth = blob(shape, (2 + shift, 2, 2), 5, 1)
        blob(shape, (2 + shift, 7, 2), 4, 2, truth)  # oedema touching the core: one foreground component
        prediction = truth.copy()
        prediction[14, 14, 14] = 1  # a distant false positive of each class
        prediction[14, 1, 14] = 2
        pairs.append((prediction, truth))
    decision = choose(CLASSES, loaders(pairs))
    # All foreground as one mask removes both specks: every class improves, so that step is kept; after it,
    # per class there is nothing left to gain, so no per-class step is added.
    assert decision.steps == ((ALL_FOREGROUND, (1, 2)),)
    assert decision.scores["dice_after"]["core"] == pytest.approx(1.0)
    assert decision.scores["dice_before"]["core"] == pytest.approx(2 * 125 / (126 + 125))
    assert np.array_equal(decision(pairs[0][0]), pairs[0][1])


def test_dropped_where_it_hurts_and_per_class_steps_judged_on_their_own_class():
    shape = (16, 16, 16)
    pairs = []
    for _ in range(2):
        # Class 1 truly has two separate lesions; class 2 one blob and, predicted, a false speck.
        truth = blob(shape, (1, 1, 1), 4, 1)
        blob(shape, (10, 10, 10), 3, 1, truth)
        blob(shape, (1, 10, 1), 3, 2, truth)
        prediction = truth.copy()
        prediction[14, 1, 14] = 2
        pairs.append((prediction, truth))
    decision = choose(CLASSES, loaders(pairs))
    # All foreground as one would delete a true class-1 lesion (class 1 worse): refused. Class 1 alone: worse,
    # refused. Class 2 alone: removes the speck, better: kept.
    assert decision.steps == (("oedema", (2,)),)
    assert decision.scores["dice_after"]["core"] == pytest.approx(1.0)
    assert decision.scores["dice_after"]["oedema"] == pytest.approx(1.0)


def test_regions_are_judged_as_regions_and_the_decision_survives_json():
    scheme = LabelScheme(regions={"WT": [1, 2, 3], "TC": [1, 3], "ET": [3]})
    shape = (14, 14, 14)
    truth = blob(shape, (2, 2, 2), 6, 2)
    blob(shape, (3, 3, 3), 3, 1, truth)
    blob(shape, (4, 4, 4), 1, 3, truth)
    prediction = truth.copy()
    prediction[12, 12, 12] = 3  # a false enhancing voxel: in WT, TC and ET
    decision = choose(scheme, loaders([(prediction, truth)]))
    assert decision.steps == ((ALL_FOREGROUND, (1, 2, 3)),)
    again = Postprocessing.from_json(decision.to_json(), "postprocessing.json")
    assert again.steps == decision.steps and np.array_equal(again(prediction), truth)
    with pytest.raises(MedvolError, match="postprocessing.json: expected"):
        Postprocessing.from_json({"steps": [{"name": "WT"}]}, "postprocessing.json")
    with pytest.raises(MedvolError, match="no validation predictions"):
        choose(scheme, [])
