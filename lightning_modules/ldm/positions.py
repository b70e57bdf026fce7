"""Where a latent lies in its whole volume: three coordinate channels (PatchDDM, Bieder et al. 2023).

A model trained on crops sees no boundary of the body and cannot know where lungs belong; given each latent
voxel's place in the whole volume, it learns anatomy by position, and a whole volume sampled window by window
(or at once) puts the anatomy where the training volumes have it.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def latent_coordinates(
    origin: torch.Tensor, volume: torch.Tensor, latent_size: Sequence[int], downsample: Sequence[int]
) -> torch.Tensor:
    """(B, 3, D, H, W) coordinates of a latent grid's voxels in their whole image volumes, each axis from -1 to 1.

    Args:
        origin: (B, 3) image voxel index of the crop's corner in its volume (zeros for a whole volume).
        volume: (B, 3) image voxels of the whole volume per axis.
        latent_size: (D, H, W) of the latent crop.
        downsample: image voxels per latent voxel per axis.

    Latent voxel i of axis a covers image voxels origin + d i .. origin + d (i + 1) - 1; its coordinate is the
    centre of those, origin + d i + (d - 1) / 2, scaled so that the volume's first and last voxel centres are -1 and 1.
    """
    origin, volume = origin.double(), volume.double()
    axes = []
    for axis, (size, factor) in enumerate(zip(latent_size, downsample, strict=True)):
        centres = origin[:, axis, None] + factor * torch.arange(size, dtype=torch.float64, device=origin.device)
        centres = centres + (factor - 1) / 2
        axes.append(2 * centres / (volume[:, axis, None] - 1).clamp_min(1.0) - 1)
    d, h, w = (int(s) for s in latent_size)
    grid = torch.stack([
        axes[0][:, :, None, None].expand(-1, d, h, w),
        axes[1][:, None, :, None].expand(-1, d, h, w),
        axes[2][:, None, None, :].expand(-1, d, h, w),
    ], dim=1)
    return grid.float()
