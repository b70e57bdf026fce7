"""nnU-Net's preprocessing in the planned chain (datamodules/pipeline/transforms.py: `PlannedSpacingd`): cubic images,
labels class by class linearly with a 0.5 cut, an anisotropic axis apart by nearest neighbour; checked against
numpy's interpolation and nnU-Net's rule for the separate axis (`determine_do_sep_z_and_axis`)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from monai.data import MetaTensor
from monai.transforms import Spacing

from datamodules.pipeline.transforms import PlannedSpacingd, resampled_labels
from medvol.volumes.plan import separate_axis


@pytest.mark.parametrize(
    ("current", "target", "axis"),
    [
        ([1.0, 1.0, 4.0], [1.0, 1.0, 2.0], 2),  # the volume itself over 3x anisotropic
        ([1.0, 1.0, 3.0], [1.0, 1.0, 3.0], None),  # exactly 3: not over nnU-Net's threshold
        ([1.0, 1.0, 1.0], [5.0, 1.0, 1.0], 0),  # isotropic volume, anisotropic target
        ([0.24, 1.25, 1.25], [0.24, 1.25, 1.25], None),  # two coarsest axes: nothing apart
    ],
)
def test_the_axis_resampled_apart_follows_nnunets_rule(current, target, axis):
    assert separate_axis(current, target) == axis


def grid(values: np.ndarray, spacing) -> MetaTensor:
    return MetaTensor(torch.as_tensor(values), affine=torch.diag(torch.tensor([*spacing, 1.0], dtype=torch.float64)))


def test_an_anisotropic_axis_is_resampled_by_nearest_after_the_others():
    """Every output slice across the coarse axis is one of the input slices resampled in-plane, unchanged (nearest):
    nothing is interpolated between two 4 mm slices."""
    rng = np.random.default_rng(0)
    image = grid(rng.normal(size=(1, 10, 9, 5)).astype(np.float32), (1.0, 1.0, 4.0))
    out = PlannedSpacingd(["image"], [], [0.5, 0.5, 2.0])({"image": image})["image"]
    in_plane = Spacing([0.5, 0.5, 4.0], mode=3, padding_mode="nearest")(image)
    assert out.shape[3] > image.shape[3]
    for k in range(out.shape[3]):
        assert any(torch.allclose(out[0, :, :, k], in_plane[0, :, :, j]) for j in range(in_plane.shape[3]))


def test_labels_are_resampled_class_by_class_linearly_with_a_half_cut():
    """Upsampled by 2 along x: output voxel i lies at input position i / 2; per class the one-hot mask is
    interpolated linearly (numpy's interp) and each class takes the voxels where it reaches 0.5, in value order."""
    row = np.array([0, 0, 0, 1, 1, 2, 0, 0, 0], np.int64)
    label = grid(np.broadcast_to(row[None, :, None, None], (1, 9, 2, 2)).copy(), (1.0, 1.0, 1.0))
    out = resampled_labels(label, [0.5, 1.0, 1.0], nearest=False)
    positions = np.arange(out.shape[1]) / 2.0
    expected = np.zeros(len(positions), np.int64)
    for value in (0, 1, 2):
        expected[np.interp(positions, np.arange(9), (row == value).astype(float)) >= 0.5] = value
    np.testing.assert_array_equal(np.asarray(out[0, :, 0, 0]), expected)
    assert out.dtype == label.dtype
