"""Training patches cut from whole-volume batches on the device: at random, or centred on the label."""

from __future__ import annotations

from collections.abc import Sequence

import torch

SAMPLINGS = ("random", "label_balanced")


def patch_origins(
    batch: int, label: torch.Tensor | None, shape: Sequence[int], size: Sequence[int], pos_ratio: float
) -> list[list[int]]:
    """One patch corner per sample; with a label, a `pos_ratio` share of the patches centre on a foreground voxel.

    Draws from torch's global generator, which Lightning seeds and medvol restores on resume.

    Args:
        batch: samples in the batch.
        label: (B, C, D, H, W) labels for label-balanced sampling, or None for uniform corners.
        shape: the volume's spatial shape.
        size: the patch size (not larger than `shape`).
        pos_ratio: share of foreground-centred patches.
    """
    origins = []
    highest = [n - p for n, p in zip(shape, size, strict=True)]
    for b in range(batch):
        corner = [int(torch.randint(0, h + 1, ())) for h in highest]
        if label is not None and float(torch.rand(())) < pos_ratio:
            foreground = torch.nonzero(label[b].amax(0) > 0)
            if len(foreground):
                centre = foreground[int(torch.randint(0, len(foreground), ()))].tolist()
                corner = [min(max(c - p // 2, 0), h) for c, p, h in zip(centre, size, highest, strict=True)]
        origins.append(corner)
    return origins


def cut_patches(volume: torch.Tensor, origins: Sequence[Sequence[int]], size: Sequence[int]) -> torch.Tensor:
    """(B, C, *size) patches of a (B, C, D, H, W) volume at the given corners."""
    return torch.stack(
        [
            volume[b, :, o[0] : o[0] + size[0], o[1] : o[1] + size[1], o[2] : o[2] + size[2]]
            for b, o in enumerate(origins)
        ]
    )
