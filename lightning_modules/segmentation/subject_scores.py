"""Per-subject Dice and HD95 (MONAI), gathered from every rank and averaged over subjects."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from monai.metrics import compute_dice, compute_hausdorff_distance
from torchmetrics import Metric
from torchmetrics.utilities import dim_zero_cat


def subject_scores(
    masks: torch.Tensor, target: torch.Tensor, spacing: Sequence[Sequence[float]] | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Dice and 95th-percentile Hausdorff distance per sample and channel, as MONAI's metric classes compute them.

    Dice is NaN where both the prediction and the target are empty (a class absent from the case is left out of
    the means, as nnU-Net's `compute_metrics` does; MONAI's `ignore_empty=True` would also drop a prediction of an
    absent class, which nnU-Net scores 0); HD95 is in mm when `spacing` is given and NaN where the prediction or
    the target is empty.

    Args:
        masks: (B, C, D, H, W) binary predictions.
        target: (B, C, D, H, W) binary targets.
        spacing: per sample, the voxel size in mm; None measures in voxels.

    Returns:
        Dice (B, C) and HD95 (B, C), float32 on the CPU.
    """
    dice = compute_dice(masks, target, include_background=True, ignore_empty=False)
    absent = (masks.flatten(2).sum(-1) == 0) & (target.flatten(2).sum(-1) == 0)
    dice = torch.where(absent.to(dice.device), torch.full_like(dice, float("nan")), dice)
    hd95 = compute_hausdorff_distance(masks, target, include_background=True, percentile=95, spacing=spacing)
    hd95 = torch.where(torch.isfinite(hd95), hd95, torch.full_like(hd95, float("nan")))
    return dice.float().cpu(), hd95.float().cpu()


class SubjectScores(Metric):
    """Rows of per-subject scores; `compute` gathers them from all ranks and averages each column over subjects.

    Concatenating rows (rather than summing) keeps each subject counted once whatever the ranks'
    shares, and NaN entries (an HD95 without two non-empty masks) are left out of their column's mean.
    """

    full_state_update = False

    def __init__(self, columns: int) -> None:
        super().__init__()
        self.columns = columns
        self.add_state("rows", default=[], dist_reduce_fx="cat")

    def update(self, rows: torch.Tensor) -> None:
        self.rows.append(rows.to(self.device, torch.float32).reshape(-1, self.columns))

    def compute(self) -> torch.Tensor:
        rows = dim_zero_cat(self.rows)
        return rows.nanmean(0)
