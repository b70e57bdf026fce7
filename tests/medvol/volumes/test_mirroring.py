"""Test-time mirroring: every flip combination, each copy's logits flipped back before the average (nnU-Net v2's;
tests/lightning_modules/segmentation/test_nnunet_rules.py holds it to nnU-Net's own predictor)."""

from __future__ import annotations

import torch

from lightning_modules.segmentation.segmentation import Segmenter
from medvol.volumes.mirroring import MirrorAveraged, mirror_combinations


class RampAlongDepth(torch.nn.Module):
    """logits = input + 0.7 x (depth index): an output that is not mirror-symmetric along D only."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ramp = torch.arange(x.shape[2], dtype=x.dtype).reshape(1, 1, -1, 1, 1)
        return x + 0.7 * ramp


def test_every_subset_of_the_axes_once_the_plain_call_first():
    combos = mirror_combinations((0, 1, 2))
    assert combos[0] == () and len(combos) == 8 and len(set(combos)) == 8
    assert set(combos) == {(), (0,), (1,), (2,), (0, 1), (0, 2), (1, 2), (0, 1, 2)}


def test_mirrored_copies_are_flipped_back_before_averaging_an_asymmetric_output():
    # By hand: a flip along D turns the ramp 0.7 i into 0.7 (D - 1 - i) once flipped back; flips along H or W
    # change nothing. Half the 8 copies flip D, so the mean is x + 0.7 (D - 1) / 2 everywhere, in x's own
    # orientation (a copy not flipped back would put x upside down; a flip of the wrong dim would mix channels).
    x = torch.randn(2, 3, 5, 4, 6, generator=torch.Generator().manual_seed(0))
    averaged = MirrorAveraged(RampAlongDepth())(x)
    torch.testing.assert_close(averaged, x + 0.7 * (5 - 1) / 2)
    plain = MirrorAveraged(RampAlongDepth(), axes=())(x)
    torch.testing.assert_close(plain, RampAlongDepth()(x))


def test_the_logits_are_averaged_not_the_softmax():
    x = torch.zeros(1, 2, 4, 1, 1)
    x[:, 1, 0] = 6.0  # class 1 certain at depth 0, the background elsewhere

    # Class 1's logit climbs 3 per voxel along depth: a network the mirrored copies disagree on.
    ramp = torch.stack([torch.zeros(4), 3.0 * torch.arange(4.0)]).reshape(1, 2, 4, 1, 1)

    def class_one_ramp(v: torch.Tensor) -> torch.Tensor:
        return v + ramp

    asymmetric = MirrorAveraged(class_one_ramp, axes=(0,))(x)
    plain = class_one_ramp(x)
    flipped_back = torch.flip(class_one_ramp(torch.flip(x, [2])), [2])
    torch.testing.assert_close(asymmetric, (plain + flipped_back) / 2)
    # The softmax of the mean differs from the mean of the softmax where the copies disagree.
    softmax_mean = (torch.softmax(plain, 1) + torch.softmax(flipped_back, 1)) / 2
    assert not torch.allclose(torch.softmax(asymmetric, 1), softmax_mean)


class ClassOneRamp(torch.nn.Module):
    """Class 1's logit rises along D (0.7 per voxel), the background's does not."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ramp = torch.arange(x.shape[2], dtype=x.dtype).reshape(1, -1, 1, 1)
        return torch.stack([x[:, 0], x[:, 1] + 0.7 * ramp], 1)


def test_the_segmenter_mirrors_when_asked_and_takes_the_softmax_of_the_flipped_back_logits():
    module = Segmenter(in_channels=2, num_classes=2, features=[4, 8], patch_size=[4, 4, 4])
    module.net = ClassOneRamp()
    volume = torch.randn(1, 2, 4, 4, 4, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        mirrored, plain = module.probabilities(volume, tta=True), module.probabilities(volume, tta=False)
    depth = torch.arange(4.0).reshape(4, 1, 1)
    x0, x1 = volume[0, 0], volume[0, 1]
    # Flipped along D, a voxel at depth i sees the ramp of depth 3 - i; H and W flips change nothing: the mean logit
    # of class 1 is x1 + 0.7 x 1.5 everywhere.
    by_hand = torch.sigmoid(x1 + 0.7 * 1.5 - x0)
    torch.testing.assert_close(plain[0, 1], torch.sigmoid(x1 + 0.7 * depth - x0))
    torch.testing.assert_close(mirrored[0, 1], by_hand)
    torch.testing.assert_close(mirrored.sum(1), torch.ones(1, 4, 4, 4))
