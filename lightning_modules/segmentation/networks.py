"""The segmentation networks (MONAI), chosen by `model.net`, and the input sizes each accepts."""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from monai.networks.nets import DynUNet, SwinUNETR, UNet

from medvol.core.errors import MedvolError

NETWORKS = ("unet", "dynunet", "swinunetr")


def size_multiple(name: str, features: Sequence[int], strides: Sequence[Sequence[int]] | None = None) -> list[int]:
    """Every spatial size a network is given must be a multiple of this, per axis (its total downsampling)."""
    if name == "swinunetr":
        return [32] * 3
    if name == "dynunet" and strides:
        return [math.prod(int(s[axis]) for s in strides) for axis in range(3)]
    return [2 ** (len(features) - 1)] * 3


def level_settings(
    features: Sequence[int], kernels: Sequence[Sequence[int]] | None, strides: Sequence[Sequence[int]] | None
) -> tuple[list[list[int]], list[list[int]]]:
    """DynUNet's kernels and strides per level: as given (a plan's, anisotropic), else 3 and 2 everywhere."""
    levels = len(features)
    kernels = [list(k) for k in kernels] if kernels else [[3, 3, 3]] * levels
    strides = [list(s) for s in strides] if strides else [[1, 1, 1]] + [[2, 2, 2]] * (levels - 1)
    if len(kernels) != levels or len(strides) != levels:
        raise MedvolError(
            f"`model.kernels` and `model.strides` list {len(kernels)} and {len(strides)} levels; expected one per "
            f"`model.features` level ({levels})"
        )
    return kernels, strides


def build_network(
    name: str, in_channels: int, out_channels: int, features: Sequence[int], feature_size: int,
    kernels: Sequence[Sequence[int]] | None = None, strides: Sequence[Sequence[int]] | None = None,
    deep_supervision: bool = False, res_block: bool = True, transposed_bias: bool = False,
) -> torch.nn.Module:
    """A MONAI 3D network.

    Args:
        name: unet, dynunet or swinunetr.
        in_channels: image channels.
        out_channels: classes or regions.
        features: channels per resolution level (unet, dynunet); each level after the first halves the size.
        feature_size: SwinUNETR's embedding size (a multiple of 12).
        kernels: dynunet: kernel size per level and axis (null: 3).
        strides: dynunet: stride per level and axis, the first [1, 1, 1] (null: 2 after the first level).
        deep_supervision: dynunet: extra outputs from the coarser decoder levels while training.
        res_block: dynunet: residual blocks, or two plain convolutions per stage (nnU-Net's PlainConvUNet).
        transposed_bias: dynunet: a bias on the transposed convolutions that upsample (PlainConvUNet's `conv_bias`).
            The other convolutions have none: each feeds an instance norm, which removes a bias and its gradient.
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
        kernels, strides = level_settings(features, kernels, strides)
        return DynUNet(
            3, in_channels, out_channels, kernel_size=kernels, strides=strides, upsample_kernel_size=strides[1:],
            filters=features, res_block=res_block, deep_supervision=deep_supervision,
            deep_supr_num=supervised_heads(levels) if deep_supervision else 1, trans_bias=transposed_bias,
        )
    if feature_size % 12:
        raise MedvolError(f"`model.feature_size` is {feature_size}; SwinUNETR needs a multiple of 12")
    # Fused attention (PyTorch's SDPA) where MONAI runs it, without gradients: the same windowed attention.
    return SwinUNETR(in_channels=in_channels, out_channels=out_channels, feature_size=feature_size, spatial_dims=3,
                     use_flash_attention=True)


def supervised_heads(levels: int) -> int:
    """Deep-supervision heads below the full-resolution output: every decoder level but the coarsest (nnU-Net)."""
    return max(1, levels - 2)


def check_size(
    name: str, features: Sequence[int], shape: Sequence[int], key: str, strides: Sequence[Sequence[int]] | None = None
) -> None:
    """Raise a `MedvolError` naming `key` when `shape` is not a multiple of what the network needs."""
    multiples = size_multiple(name, features, strides)
    if name == "swinunetr" and all(int(s) % 32 == 0 for s in shape) and min(int(s) for s in shape) < 64:
        raise MedvolError(
            f"`{key}` is {list(shape)}; model.net=swinunetr needs sizes of at least 64 (at 32 its deepest level "
            "is a single voxel, which instance norm cannot train on)"
        )
    if any(int(s) % m for s, m in zip(shape, multiples, strict=True)):
        multiple = multiples[0] if len(set(multiples)) == 1 else multiples
        why = "SwinUNETR halves the size 5 times" if name == "swinunetr" else f"{len(features) - 1} halvings"
        raise MedvolError(
            f"`{key}` is {list(shape)}; model.net={name} needs every size divisible by {multiple} ({why}); "
            f"choose a patch size that is a multiple of {multiple}"
        )
