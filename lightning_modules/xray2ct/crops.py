"""Where a crop lies in the body: global-coordinate channels, and random crops cut jointly from a stage's inputs."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from monai.transforms import SpatialCrop
from monai.utils import convert_to_tensor


def coordinate_channels(size: Sequence[int], batch_size: int, device: torch.device | None = None) -> torch.Tensor:
    """(B, 3, D, H, W) global coordinates of every voxel of a `size` grid: z, y, x, each from -1 to 1 across the grid.

    A crop or sampling window cut from these channels carries its own place in the whole volume.
    """
    axes = [torch.linspace(-1.0, 1.0, int(n), device=device) for n in size]
    grid = torch.stack(torch.meshgrid(*axes, indexing="ij"))
    return grid.unsqueeze(0).expand(batch_size, -1, -1, -1, -1)


def random_crops(volumes: Sequence[torch.Tensor], crop: Sequence[int]) -> list[torch.Tensor]:
    """The same random `crop` of each sample cut from every (B, C_i, D, H, W) volume (target, condition, coordinates).

    One start per sample, drawn uniformly from torch's RNG (so the run's seed fixes it), cut with
    MONAI's `SpatialCrop` from the volumes stacked on channels, so they stay aligned voxel for voxel.
    """
    channels = [v.shape[1] for v in volumes]
    stacked = torch.cat(list(volumes), dim=1)
    grid = stacked.shape[2:]
    samples = []
    for sample in stacked:
        start = [int(torch.randint(0, n - c + 1, ())) for n, c in zip(grid, crop, strict=True)]
        cropper = SpatialCrop(roi_start=start, roi_end=[s + c for s, c in zip(start, crop, strict=True)])
        samples.append(convert_to_tensor(cropper(sample), track_meta=False))
    return list(torch.stack(samples).split(channels, dim=1))
