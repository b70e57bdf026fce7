"""nnU-Net's default augmentation in MONAI transforms (datamodules/pipeline/augmentation.py): image and label stay
aligned through every step, the spatial step follows nnU-Net's conventions (scale > 1 shrinks objects, rotation in
the plane across the coarsest axis for anisotropic patches), and the forced samples sit on the foreground with the
class drawn uniformly, as nnU-Net's `get_bbox`."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from monai.transforms import Compose
from scipy import ndimage

from datamodules.pipeline.augmentation import (
    FOREGROUND_KEY,
    ForegroundPatchd,
    MaskImaged,
    PerChannel,
    SpatialAugmentd,
    crop_padded,
    nnunet_augmentation,
)
from datamodules.pipeline.transforms import MASK_KEY

SETTINGS = {"patch": [24, 24, 16], "initial_patch": [36, 36, 28], "rotation": np.deg2rad(30.0), "in_plane": False,
            "axis": 2, "classes": [[1], [2]], "enabled": True}


def painted(shape=(50, 60, 40)) -> dict:
    """A label (a box of class 1 holding a smaller class 2) painted bright into a two-channel image."""
    label = torch.zeros(1, *shape, dtype=torch.int64)
    label[0, 20:34, 22:38, 12:28] = 1
    label[0, 25:29, 28:32, 18:22] = 2
    image = torch.randn(2, *shape) * 0.05
    image[:, label[0] > 0] += 10.0
    return {"image": image, "label": label}


def assert_aligned(image: torch.Tensor, label: torch.Tensor) -> None:
    """Where the label is foreground the image is bright, elsewhere dark, except within 2 voxels of the label's
    edge, which blur and low resolution smear (the intensity steps keep the order of the values)."""
    mean = image.mean(0)
    bright = (mean > (mean.max() + mean.min()) / 2).numpy()
    foreground = (label[0] > 0).numpy()
    if foreground.any() and (~foreground).any():
        edge = ndimage.distance_transform_edt(foreground) + ndimage.distance_transform_edt(~foreground)
        disagree = bright != foreground
        assert not (disagree & (edge > 2.5)).any(), int((disagree & (edge > 2.5)).sum())


def test_image_and_label_stay_aligned_after_every_augmentation():
    chain = Compose(nnunet_augmentation(SETTINGS, "image", "label", [0.0, 0.0], [], 0.33)).set_random_state(3)
    item = painted()
    for i in range(60):
        out = chain({**item, FOREGROUND_KEY: i % 2 == 1})
        assert out["image"].shape == (2, 24, 24, 16) and out["label"].shape == (1, 24, 24, 16)
        assert set(torch.unique(out["label"]).tolist()) <= {0, 1, 2}
        assert_aligned(out["image"], out["label"])


@pytest.mark.parametrize("in_plane", [False, True])
def test_rotation_and_scaling_move_image_and_label_together(in_plane):
    spatial = SpatialAugmentd(["image"], ["label"], [40, 40, 30], np.pi if in_plane else np.deg2rad(30.0), in_plane, 2,
                              [0.0, 0.0])
    item = painted((40, 40, 30))
    spatial.set_random_state(0)
    moved = 0
    for _ in range(40):
        out = spatial(item)
        moved += spatial.transformed
        assert_aligned(out["image"], out["label"])
        if in_plane:
            assert spatial.angles[0] == spatial.angles[1] == 0.0 and spatial.scales()[2] == 1.0
    # p 0.2 each, drawn independently: rotated or scaled in 1 - 0.8^2 = 36% of the draws.
    assert 5 <= moved <= 25


def test_a_scale_above_one_shrinks_the_object_as_in_nnunet():
    """batchgeneratorsv2: `scaling` multiplies the sampling coordinates, larger = smaller objects; a factor s leaves
    1/s^3 of the voxels."""
    spatial = SpatialAugmentd(["image"], ["label"], [64, 64, 64], 0.0, False, 2, [0.0])
    label = torch.zeros(1, 64, 64, 64, dtype=torch.int64)
    label[0, 16:48, 16:48, 16:48] = 1
    item = {"image": label.float(), "label": label}
    spatial.randomize = lambda data=None: None
    spatial.angles, spatial.scale, spatial.transformed = [0.0, 0.0, 0.0], 1.25, True
    out = spatial(item)
    ratio = float((out["label"] > 0).sum()) / float((item["label"] > 0).sum())
    assert ratio == pytest.approx(1 / 1.25**3, rel=0.08)


def test_in_plane_rotation_keeps_the_coarsest_axis_slices_apart():
    """A slab one voxel thick across the coarsest axis stays in its slice whenever the in-plane mode rotates."""
    spatial = SpatialAugmentd(["image"], ["label"], [30, 30, 10], np.pi, True, 2, [0.0]).set_random_state(0)
    label = torch.zeros(1, 30, 30, 10, dtype=torch.int64)
    label[0, 5:25, 12:18, 4] = 1
    rotated = 0
    for _ in range(60):
        out = spatial({"image": label.float(), "label": label})
        if any(spatial.angles):
            rotated += 1
            assert spatial.angles[0] == spatial.angles[1] == 0.0
            assert out["label"][0, :, :, 4].sum() > 0 and out["label"][0, :, :, [3, 5]].sum() == 0
    assert rotated >= 3


def test_forced_samples_centre_a_class_drawn_uniformly_as_nnunet():
    """Class 2 has 64 voxels, class 1 over 3500: a forced patch centres class 2 half the time (a voxel drawn over all
    foreground would almost never pick it); an unforced patch is anywhere."""
    crop = ForegroundPatchd(["image", "label"], "label", [12, 12, 12], [12, 12, 12], [[1], [2]], 0.0, [0.0, 0.0])
    crop.set_random_state(0)
    item = painted()
    centres = []
    for _ in range(300):
        out = crop({**item, FOREGROUND_KEY: True})
        centres.append(int(out["label"][0, 6, 6, 6]))
    share = centres.count(2) / len(centres)
    assert 0.4 < share < 0.6 and 0 not in centres
    unforced = [int((crop({**item, FOREGROUND_KEY: False})["label"] > 0).any()) for _ in range(300)]
    assert sum(unforced) < 280


def test_a_box_past_the_volume_is_padded_with_each_channels_background():
    volume = torch.arange(2 * 4 * 4 * 4, dtype=torch.float32).reshape(2, 4, 4, 4)
    box = crop_padded(volume, [-2, 1, 0], [5, 3, 6], [-7.0, 3.0])
    expected = [np.pad(volume[c, :3, 1:4].numpy(), [(2, 0), (0, 0), (0, 2)], constant_values=v)
                for c, v in enumerate((-7.0, 3.0))]
    np.testing.assert_array_equal(box.numpy(), np.stack(expected))


def test_the_masked_background_is_zero_again_after_the_intensity_steps():
    image = torch.ones(2, 6, 6, 6) * 3.0
    mask = torch.zeros(1, 6, 6, 6, dtype=torch.uint8)
    mask[0, 1:5, 1:5, 1:5] = 1
    out = MaskImaged("image", [0])({"image": image, MASK_KEY: mask})
    assert MASK_KEY not in out
    assert (out["image"][0][mask[0] == 0] == 0).all() and (out["image"][0][mask[0] == 1] == 3).all()
    assert (out["image"][1] == 3).all()


def test_per_channel_steps_draw_per_channel_and_leave_the_other_axis_alone():
    calls = []

    def record(channel):
        calls.append(tuple(channel.shape))
        return channel + 1

    step = PerChannel("image", record, prob=1.0, p_per_channel=1.0, axis=2)
    out = step({"image": torch.zeros(3, 5, 6, 7)})
    assert calls == [(7, 5, 6)] * 3 and (out["image"] == 1).all()
