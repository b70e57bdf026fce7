"""Issue 50's rules against nnU-Net v2's own functions, whose answers on fixed inputs `benchmarks/nnunet_plans.py
rules` recorded in tests/data/nnunet_rules.pt (in a venv with nnunetv2 2.8.1 and batchgeneratorsv2; the file says
which made it): the losses with `batch_dice` and with an ignore label, the spatial augmentation's one-hot linear
label resampling, the predictor's mirrored logits, and the separate-z resampling of logits to the source grid.
MONAI's Dice loss is 1 - Dice where nnU-Net's is -Dice: medvol's losses are nnU-Net's plus 1."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from datamodules.pipeline.augmentation import one_hot_linear
from lightning_modules.segmentation.losses import build_loss

ROOT = Path(__file__).resolve().parents[3]
REFERENCE = torch.load(ROOT / "tests" / "data" / "nnunet_rules.pt", weights_only=True)
# nnU-Net's region channels of the recorded label maps (1 oedema, 2 core): WT [1, 2], TC [2], and [2] again.
REGIONS = ((1, 2), (2,), (2,))


def region_channels(labels: torch.Tensor) -> torch.Tensor:
    return torch.cat([torch.isin(labels, torch.tensor(r)) for r in REGIONS], 1).to(torch.uint8)


@pytest.mark.parametrize("batch_dice", [False, True])
def test_the_dice_losses_with_and_without_batch_dice_are_nnunets(batch_dice):
    logits, labels = REFERENCE["logits"].float(), REFERENCE["labels"]
    losses = REFERENCE["losses"]
    classes = build_loss("dice_ce", regions=False, batch_dice=batch_dice)(logits, labels)
    assert float(classes) - 1 == pytest.approx(losses["classes"][str(batch_dice)], abs=1e-6)
    regions = build_loss("dice_ce", regions=True, batch_dice=batch_dice)(logits, region_channels(labels))
    assert float(regions) - 1 == pytest.approx(losses["regions"][str(batch_dice)], abs=1e-6)
    # The two differ by more than the tolerance: the test tells them apart.
    assert abs(losses["classes"]["True"] - losses["classes"]["False"]) > 1e-4


def test_labels_are_resampled_one_hot_linearly_as_batchgeneratorsv2_resamples_them():
    """nnU-Net's SpatialTransform (border label -1, then 0) on one sampling grid: a label map of three values and one
    that reaches past the volume, and two region channels; voxel for voxel."""
    spatial = REFERENCE["spatial"]
    grid = spatial["grid"]

    def sample(volume: torch.Tensor, mode: str) -> torch.Tensor:
        return F.grid_sample(volume[None], grid[None], mode=mode, padding_mode="zeros", align_corners=False)[0]

    for name in ("labels", "regions"):
        ours = one_hot_linear(spatial[name].float(), sample)
        assert torch.equal(ours, spatial["out"][name].long()), name
    # Nearest-neighbour resampling (medvol's rule before) gives another map on the same grid.
    nearest = sample(spatial["labels"].float(), "nearest").long()
    assert not torch.equal(nearest, spatial["out"]["labels"].long())
