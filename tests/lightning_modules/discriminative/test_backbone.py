"""`build_backbone`: MONAI ResNets without their classifier, their feature width, and local weights only."""

from __future__ import annotations

import pytest
import torch
from monai.networks.nets import resnet10

from lightning_modules.discriminative.backbone import build_backbone, load_local_weights
from medvol.core.errors import MedvolError


@pytest.mark.parametrize(("name", "widen_factor", "width"), [
    # MONAI's last stage has 512 planes; resnet50's bottleneck blocks expand them 4-fold.
    ("resnet10", 0.125, 64), ("resnet18", 0.25, 128), ("resnet50", 0.0625, 128),
])
def test_the_stated_feature_width_is_the_width_the_network_returns(name, widen_factor, width):
    network, features = build_backbone(name, in_channels=2, widen_factor=widen_factor)
    out = network.eval()(torch.randn(3, 2, 16, 16, 16))
    assert features == width
    assert out.shape == (3, width)


def test_an_unknown_backbone_is_refused_with_the_known_names():
    with pytest.raises(MedvolError, match=r"`model.backbone` is 'resnet11'; expected one of \['resnet10'"):
        build_backbone("resnet11", 1)


def reference_weights(in_channels: int = 1) -> dict[str, torch.Tensor]:
    """A MedicalNet-style checkpoint: DataParallel's `module.` prefix, a classifier of its own, under `state_dict`."""
    torch.manual_seed(3)
    network = resnet10(spatial_dims=3, n_input_channels=in_channels, num_classes=5, widen_factor=0.125)
    return {f"module.{k}": v for k, v in network.state_dict().items()}


def test_local_weights_are_loaded_without_prefix_or_classifier(tmp_path):
    weights = reference_weights()
    path = tmp_path / "medicalnet.pth"
    torch.save({"state_dict": weights}, path)
    network, _ = build_backbone("resnet10", 1, widen_factor=0.125, pretrained_path=str(path))
    loaded = network.state_dict()
    assert not any(k.startswith("fc.") for k in loaded)
    for key, value in loaded.items():
        assert torch.equal(value, weights[f"module.{key}"]), key


@pytest.mark.parametrize(("content", "message"), [
    (None, "no file at"),
    (b"not a checkpoint", "is not a readable checkpoint"),
    ([1, 2], "holds no state dict"),
    ("two channels", r"does not fit `model.backbone` \(0 missing, 1 mis-shaped tensors, e.g. 'conv1.weight'\)"),
])
def test_weights_that_cannot_serve_the_backbone_are_refused_with_one_reason(tmp_path, content, message):
    path = tmp_path / "weights.pt"
    if isinstance(content, bytes):
        path.write_bytes(content)
    elif content == "two channels":
        torch.save(reference_weights(in_channels=2), path)
    elif content is not None:
        torch.save(content, path)
    network, _ = build_backbone("resnet10", 1, widen_factor=0.125)
    with pytest.raises(MedvolError, match=message):
        load_local_weights(network, str(path))
