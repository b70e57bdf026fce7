"""The segmentation networks (MONAI), chosen by `model.net`, and the input sizes each accepts."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from monai.networks.nets import DynUNet, SwinUNETR, UNet

from medvol.core.errors import MedvolError

NETWORKS = ("unet", "dynunet", "swinunetr")


def size_multiple(name: str, features: Sequence[int]) -> int:
    """Every spatial size a network is given must be a multiple of this (its total downsampling)."""
    if name == "swinunetr":
        return 32
    return 2 ** (len(features) - 1)


def build_network(name: str, in_channels: int, out_channels: int, features: Sequence[int], feature_size: int) -> torch.nn.Module:
    """A MONAI 3D network.

    Args:
        name: unet, dynunet or swinunetr.
        in_channels: image channels.
        out_channels: classes or regions.
        features: channels per resolution level (unet, dynunet); each level after the first halves the size.
        feature_size: SwinUNETR's embedding size (a multiple of 12).
    """
    features = [int(f) for f in features]
    if name not in NETWORKS:
        raise MedvolError(f"`model.net` is {name!r}; expected one of {list(NETWORKS)}")
    if len(features) < 2:
        raise MedvolError(f"`model.features` must list at least two levels, got {features}")
    if name == "unet":
        return UNet(3, in_channels, out_channels, channels=features, strides=[2] * (len(features) - 1), num_res_units=2)
    if name == "dynunet":
        levels = len(features)
        if levels < 3:
            raise MedvolError(f"`model.features` is {features}; model.net=dynunet needs at least three levels")
        return DynUNet(
            3, in_channels, out_channels, kernel_size=[3] * levels, strides=[1] + [2] * (levels - 1),
            upsample_kernel_size=[2] * (levels - 1), filters=features, res_block=True,
        )
    if feature_size % 12:
        raise MedvolError(f"`model.feature_size` is {feature_size}; SwinUNETR needs a multiple of 12")
    return SwinUNETR(in_channels=in_channels, out_channels=out_channels, feature_size=feature_size, spatial_dims=3)


def check_size(name: str, features: Sequence[int], shape: Sequence[int], key: str) -> None:
    """Raise a `MedvolError` naming `key` when `shape` is not a multiple of what the network needs."""
    multiple = size_multiple(name, features)
    if name == "swinunetr" and all(int(s) % 32 == 0 for s in shape) and min(int(s) for s in shape) < 64:
        raise MedvolError(
            f"`{key}` is {list(shape)}; model.net=swinunetr needs sizes of at least 64 (at 32 its deepest level "
            "is a single voxel, which instance norm cannot train on)"
        )
    if any(int(s) % multiple for s in shape):
        why = "SwinUNETR halves the size 5 times" if name == "swinunetr" else f"{len(features) - 1} halvings"
        raise MedvolError(
            f"`{key}` is {list(shape)}; model.net={name} needs every size divisible by {multiple} ({why}); "
            f"choose a patch size that is a multiple of {multiple}"
        )
