"""`SlicePerceptualLoss`: LPIPS-style distance of unit-normalised feature maps of a local TorchScript network."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from lightning_modules.perceptual import SlicePerceptualLoss
from medvol.core.errors import MedvolError

WEIGHT = np.array([[1.0, 0.0, -1.0], [0.5, 0.5, 0.5], [0.0, 2.0, 0.0], [-1.0, 1.0, 1.0]])
# Values a float32 holds exactly, so the float64 reference and the network see the same weights.
BIAS = np.array([0.125, -0.25, 0.0, 0.375])


class TwoMaps(nn.Module):
    """A 1x1 convolution with the fixed WEIGHT and BIAS, and its ReLU: two feature maps."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 1)
        self.dropout = nn.Dropout(0.9)
        with torch.no_grad():
            self.conv.weight.copy_(torch.from_numpy(WEIGHT).view(4, 3, 1, 1))
            self.conv.bias.copy_(torch.from_numpy(BIAS))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        features = self.dropout(self.conv(x))
        return features, torch.relu(features)


@pytest.fixture
def feature_network(tmp_path) -> str:
    path = tmp_path / "features.pt"
    torch.jit.save(torch.jit.script(TwoMaps()), str(path))
    return str(path)


def numpy_distance(prediction: np.ndarray, target: np.ndarray) -> float:
    """The mean over both maps of the squared distance of channel-normalised features, summed over channels."""

    def maps(x: np.ndarray) -> list[np.ndarray]:
        features = np.einsum("oc,nchw->nohw", WEIGHT, x) + BIAS[None, :, None, None]
        return [features, np.maximum(features, 0)]

    def unit(f: np.ndarray) -> np.ndarray:
        return f / (np.linalg.norm(f, axis=1, keepdims=True) + 1e-10)

    pairs = zip(maps(prediction), maps(target), strict=True)
    return float(np.mean([((unit(p) - unit(t)) ** 2).sum(1).mean() for p, t in pairs]))


def slices(seed: int, channels: int) -> torch.Tensor:
    return torch.rand(2, channels, 5, 6, generator=torch.Generator().manual_seed(seed), dtype=torch.float64) * 2 - 1


def test_the_distance_equals_numpys_on_three_channel_slices(feature_network):
    loss = SlicePerceptualLoss(feature_network).double()
    prediction, target = slices(0, 3), slices(1, 3)
    assert float(loss(prediction, target)) == pytest.approx(numpy_distance(prediction.numpy(), target.numpy()),
                                                            rel=1e-7)
    assert float(loss(target, target)) == 0.0


def test_grey_slices_are_repeated_and_other_channel_counts_averaged_into_three_channels(feature_network):
    loss = SlicePerceptualLoss(feature_network).double()
    grey, other = slices(2, 1), slices(3, 1)
    expected = numpy_distance(np.repeat(grey.numpy(), 3, axis=1), np.repeat(other.numpy(), 3, axis=1))
    assert float(loss(grey, other)) == pytest.approx(expected, rel=1e-7)
    two, three = slices(4, 2), slices(5, 2)
    mean_two, mean_three = (np.repeat(x.numpy().mean(1, keepdims=True), 3, axis=1) for x in (two, three))
    assert float(loss(two, three)) == pytest.approx(numpy_distance(mean_two, mean_three), rel=1e-7)


def test_the_feature_network_stays_frozen_in_evaluation_mode_while_gradients_reach_the_prediction(feature_network):
    loss = SlicePerceptualLoss(feature_network).double().train()
    assert not loss.net.training
    prediction = slices(6, 3).requires_grad_(True)
    loss(prediction, slices(7, 3)).backward()
    assert prediction.grad is not None and prediction.grad.abs().sum() > 0
    assert all(not p.requires_grad and p.grad is None for p in loss.net.parameters())
    # Dropout (p=0.9) in training mode would make two evaluations differ.
    assert loss(prediction, slices(7, 3)).item() == loss(prediction, slices(7, 3)).item()


def test_a_missing_or_unreadable_feature_network_is_refused(tmp_path):
    with pytest.raises(MedvolError, match="`model.perceptual_model_path`: no file at"):
        SlicePerceptualLoss(str(tmp_path / "absent.pt"))
    state_dict = tmp_path / "state_dict.pt"
    torch.save(TwoMaps().state_dict(), state_dict)
    with pytest.raises(MedvolError, match="is not a TorchScript file"):
        SlicePerceptualLoss(str(state_dict))
