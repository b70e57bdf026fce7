"""The stage network: a view encoder whose tokens a 3D diffusion UNet attends to by cross-attention."""

from __future__ import annotations

import inspect
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from monai.networks.nets import DiffusionModelUNet
from torch import nn

from lightning_modules.diffusion.checkpointing import checkpoint_unet
from lightning_modules.xray2ct.view_encoder import ViewEncoder
from medvol.core.errors import MedvolError

# The condition channels of a stage >= 2 before x_t: the upsampled previous stage, then z, y, x coordinates.
CONDITION_CHANNELS = 4


class ViewConditionedDenoiser(nn.Module):
    """Predicts the diffusion target of a CT stage from x_t, the step, the X-ray tokens and (stage >= 2) the
    previous stage.

    The input is `cat([previous, coordinates, x_t])` on channels from stage 2 on (the condition
    first, as in Fast-DDPM; `coordinates` are the three global-coordinate channels that tell a crop
    or a sampling window where it lies in the body), `x_t` alone at stage 1.

    The view tokens reach the UNet by cross-attention at the `attention_levels` only. MONAI's
    transformer block at such a level also runs self-attention over every token of that level, so
    the full-resolution level (level 0: one token per voxel) never carries attention: a stage
    trained on 64^3 crops with 4 levels attends at 16^3 and 8^3 tokens per crop, through PyTorch's
    fused `scaled_dot_product_attention` (`use_flash_attention`), never materialising the matrix.

    Args:
        num_views: radiographs per subject.
        xray_size: (H, W) of each view.
        cascaded: True from stage 2 on (one extra input channel).
        token_dim: width of the view tokens = the UNet's cross-attention dim.
        encoder_channels: strided stages of the view encoder.
        channels: UNet channels per level.
        attention_levels: UNet levels with (self + cross) attention; never level 0 (full resolution).
        num_res_blocks: residual blocks per UNet level.
        num_head_channels: channels per attention head.
        norm_num_groups: GroupNorm groups (must divide every UNet channel count).
        use_flash_attention: fused attention (PyTorch's SDPA) instead of MONAI's explicit attention matrix.
        activation_checkpointing: recompute the activations of each residual and attention block of the
            UNet in the backward pass (MONAI's UNet has no such option): less memory per voxel for
            about a third more compute.
    """

    def __init__(
        self,
        num_views: int = 2,
        xray_size: Sequence[int] = (32, 32),
        cascaded: bool = False,
        token_dim: int = 32,
        encoder_channels: Sequence[int] = (16, 32),
        channels: Sequence[int] = (16, 32, 32),
        attention_levels: Sequence[bool] = (False, False, True),
        num_res_blocks: int = 1,
        num_head_channels: int = 16,
        norm_num_groups: int = 8,
        use_flash_attention: bool = True,
        activation_checkpointing: bool = False,
    ) -> None:
        super().__init__()
        if attention_levels and bool(attention_levels[0]):
            raise MedvolError(
                f"`model.attention_levels` {list(attention_levels)} puts attention at level 0, where MONAI's "
                "transformer block self-attends over every voxel; expected attention at the coarser levels only (e.g. "
                "[false, false, true, true])"
            )
        self.cascaded = bool(cascaded)
        self.encoder = ViewEncoder(
            num_views, (int(xray_size[0]), int(xray_size[1])), token_dim, tuple(encoder_channels)
        )
        self.unet = DiffusionModelUNet(
            spatial_dims=3,
            in_channels=1 + CONDITION_CHANNELS if self.cascaded else 1,
            out_channels=1,
            channels=tuple(channels),
            attention_levels=tuple(bool(a) for a in attention_levels),
            num_res_blocks=num_res_blocks,
            num_head_channels=num_head_channels,
            norm_num_groups=norm_num_groups,
            with_conditioning=True,
            cross_attention_dim=token_dim,
            use_flash_attention=bool(use_flash_attention),
        )
        self.downsampling = 2 ** (len(channels) - 1)
        if activation_checkpointing:
            checkpoint_unet(self.unet)

    def forward(
        self, x_t: torch.Tensor, t: torch.Tensor, views: torch.Tensor, previous: torch.Tensor | None = None,
        coordinates: torch.Tensor | None = None,
    ) -> torch.Tensor:
        tokens = self.encoder(views)
        if not self.cascaded:
            return self.unet(x_t, t, context=tokens)
        if previous is None or coordinates is None:
            raise ValueError("a cascaded stage needs the previous stage's volume and the coordinate channels")
        return self.unet(torch.cat([previous, coordinates, x_t], dim=1), t, context=tokens)


# What a stage's data fixes; every other argument of the denoiser is a setting of `model=xray2ct`.
FROM_THE_STAGE = ("num_views", "xray_size", "cascaded")
NETWORK_SETTINGS = tuple(
    name for name in inspect.signature(ViewConditionedDenoiser).parameters if name not in FROM_THE_STAGE
)


def network_settings(hparams: Mapping[str, Any]) -> dict[str, Any]:
    """The `ViewConditionedDenoiser` arguments of a stage, from its hyperparameters (the denoiser's defaults for
    any left out)."""
    settings = {key: hparams[key] for key in NETWORK_SETTINGS if key in hparams}
    settings["num_views"] = len(hparams["views"])
    settings["xray_size"] = hparams["xray_size"]
    settings["cascaded"] = int(hparams["stage"]) > 1
    return settings


@torch.no_grad()
def load_from_previous_stage(network: ViewConditionedDenoiser, previous: ViewConditionedDenoiser) -> list[str]:
    """Start `network` from `previous`'s weights; the new condition input channels (previous, coordinates) start
    at zero.

    Returns the names of the tensors that could not be copied (shape mismatch other than the
    first convolution's input channels), which the caller reports.
    """
    skipped = []
    source = previous.state_dict()
    for name, tensor in network.state_dict().items():
        if name not in source:
            skipped.append(name)
            continue
        weights = source[name]
        if weights.shape == tensor.shape:
            tensor.copy_(weights)
        elif (
            tensor.ndim == 5 and weights.shape[1] == 1 and tensor.shape[1] == 1 + CONDITION_CHANNELS
            and weights.shape[0] == tensor.shape[0]
        ):
            # First convolution: input channels are [previous, coordinates, x_t]; x_t's filters carry over.
            tensor.zero_()
            tensor[:, -1:].copy_(weights)
        else:
            skipped.append(name)
    return skipped


@torch.no_grad()
def zero_output(network: ViewConditionedDenoiser) -> None:
    """Zero the UNet's output convolution (as MONAI initialises it), so the network predicts 0 whatever its input."""
    for tensor in network.unet.out[-1].parameters():
        tensor.zero_()
