"""MONAI 3D ResNet feature extractors, randomly initialised or loaded from a local weights file."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from monai.networks.nets import ResNet, resnet10, resnet18, resnet34, resnet50
from monai.networks.nets.resnet import get_inplanes
from torch import nn

from medvol.core.checkpoint_read import load_checkpoint
from medvol.core.errors import MedvolError
from medvol.core.module_size import load_weights

BACKBONES: dict[str, Callable[..., ResNet]] = {
    "resnet10": resnet10,
    "resnet18": resnet18,
    "resnet34": resnet34,
    "resnet50": resnet50,
}


def build_backbone(
    name: str, in_channels: int, widen_factor: float = 1.0, pretrained_path: str | None = None
) -> tuple[nn.Module, int]:
    """A ResNet without its classifier, mapping (B, C, D, H, W) to (B, F) pooled features.

    Args:
        name: resnet10, resnet18, resnet34 or resnet50.
        in_channels: image channels.
        widen_factor: scales every layer's width (1.0 is the published network).
        pretrained_path: a local state dict (e.g. MedicalNet weights); nothing is downloaded.

    Returns:
        The network and its feature width F.
    """
    if name not in BACKBONES:
        raise MedvolError(f"`model.backbone` is {name!r}; expected one of {list(BACKBONES)}")
    # MONAI's defaults (3 input channels, 400 classes, optional download) suit video, not CT: set them all.
    network = BACKBONES[name](
        pretrained=False, spatial_dims=3, n_input_channels=int(in_channels), num_classes=1, feed_forward=False,
        widen_factor=float(widen_factor),
    )
    features = int(get_inplanes()[-1] * float(widen_factor)) * network.layer4[-1].expansion
    if pretrained_path:
        load_local_weights(network, pretrained_path)
    return network, int(features)


def load_local_weights(network: nn.Module, path: str) -> None:
    """Load a local checkpoint into `network`; a DataParallel `module.` prefix and classifier keys are dropped."""
    file = Path(path).expanduser()
    if not file.is_file():
        raise MedvolError(f"`model.pretrained_path`: no file at {file}; expected a local state dict (.pt/.pth)")
    loaded = load_checkpoint(file, "model.pretrained_path", "a local state dict (.pt/.pth), e.g. MedicalNet weights")
    state = loaded.get("state_dict", loaded) if isinstance(loaded, dict) else None
    if not isinstance(state, dict):
        raise MedvolError(f"`model.pretrained_path`: {file} holds no state dict")
    state = {k.removeprefix("module."): v for k, v in state.items() if not k.removeprefix("module.").startswith("fc.")}
    own = network.state_dict()
    missing = sorted(set(own) - set(state))
    mismatched = sorted(k for k in own if k in state and tuple(state[k].shape) != tuple(own[k].shape))
    if missing or mismatched:
        key = (missing or mismatched)[0]
        raise MedvolError(
            f"`model.pretrained_path`: {file} does not fit `model.backbone` ({len(missing)} missing, "
            f"{len(mismatched)} mis-shaped tensors, e.g. {key!r}); check the backbone and `dataset.image_modalities`"
        )
    load_weights(network, {k: state[k] for k in own})
