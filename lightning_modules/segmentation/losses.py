"""Segmentation losses for the two label modes.

MONAI's `DiceCELoss(sigmoid=True)` still applies softmax cross-entropy when the input has more
than one channel (MONAI 1.6: binary cross-entropy only for a single channel), which couples
overlapping regions such as BraTS WT/TC/ET as if they were exclusive classes. Regions therefore
get Dice plus a per-channel binary cross-entropy, built here.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from monai.losses import DiceCELoss, DiceFocalLoss, DiceLoss

from medvol.core.errors import MedvolError

LOSSES = ("dice_ce", "dice_focal")


class DiceBCELoss(torch.nn.Module):
    """Sigmoid Dice plus binary cross-entropy per channel, for overlapping binary regions.

    Args:
        lambda_dice: weight of the Dice term.
        lambda_bce: weight of the binary cross-entropy term.
        batch: the Dice over the whole batch (nnU-Net's `batch_dice`) rather than per sample.
    """

    def __init__(self, lambda_dice: float = 1.0, lambda_bce: float = 1.0, batch: bool = False) -> None:
        super().__init__()
        self.dice = DiceLoss(sigmoid=True, batch=batch)
        self.lambda_dice = lambda_dice
        self.lambda_bce = lambda_bce

    def forward(self, logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        target = target.to(logits.dtype)
        bce = F.binary_cross_entropy_with_logits(logits, target)
        return self.lambda_dice * self.dice(logits, target) + self.lambda_bce * bce


class AnnotatedDiceCELoss(torch.nn.Module):
    """Dice plus cross-entropy on the annotated voxels only, as nnU-Net's losses with an ignore label
    (`DC_and_CE_loss(ignore_label=...)`, `DC_and_BCE_loss(use_ignore_label=True)`): the Dice of probabilities and
    targets zeroed where not annotated; for classes the cross-entropy's mean over the annotated voxels (0 without
    any), for regions the binary cross-entropy summed over the regions and averaged over the annotated voxels
    (nnU-Net's masked sum; R times its unmasked mean over R regions).

    Args:
        regions: sigmoid regions (targets (B, R, ...) binary channels) or softmax classes (targets (B, 1, ...) label
            maps, the background's Dice left out).
        batch: the Dice over the whole batch rather than per sample.
    """

    def __init__(self, regions: bool, batch: bool = False) -> None:
        super().__init__()
        self.regions = regions
        self.dice = DiceLoss(include_background=regions, batch=batch)

    def forward(self, logits: torch.Tensor, target: torch.Tensor, annotated: torch.Tensor) -> torch.Tensor:
        mask = annotated.to(logits.dtype)
        voxels = mask.sum().clamp_min(1e-8)
        if self.regions:
            target = target.to(logits.dtype)
            dice = self.dice(torch.sigmoid(logits) * mask, target * mask)
            cross = F.binary_cross_entropy_with_logits(logits, target, reduction="none")
            return dice + (cross * mask).sum() / voxels
        one_hot = F.one_hot(target[:, 0].long(), logits.shape[1]).movedim(-1, 1).to(logits.dtype)
        dice = self.dice(torch.softmax(logits, 1) * mask, one_hot * mask)
        cross = F.cross_entropy(logits, target[:, 0].long(), reduction="none")
        return dice + (cross * mask[:, 0]).sum() / voxels


def build_loss(
    name: str, regions: bool, batch_dice: bool = False, ignore_label: int | None = None
) -> torch.nn.Module:
    """The loss `name` (dice_ce or dice_focal) for overlapping regions (sigmoid) or exclusive classes (softmax).

    Class targets are (B, 1, ...) label maps, one-hot encoded inside the loss; region targets are
    (B, R, ...) binary channels. As nnU-Net's `DC_and_CE_loss` / `DC_and_BCE_loss`: the classes' Dice leaves the
    background out (the cross-entropy keeps it), regions keep every channel; both smoothed by 1e-5; with
    `batch_dice` each channel's Dice sums its overlap and sizes over the whole batch before the ratio (nnU-Net's
    `MemoryEfficientSoftDiceLoss(batch_dice=True)`), else per sample. With an ignore label the loss takes the
    annotated voxels' mask as a third argument (`AnnotatedDiceCELoss`).
    """
    if name not in LOSSES:
        raise MedvolError(f"`model.loss` is {name!r}; expected one of {list(LOSSES)}")
    if ignore_label is not None:
        if name != "dice_ce":
            raise MedvolError(
                f"`model.loss` is {name!r} and `model.ignore_label` is {ignore_label}; an ignore label needs "
                "model.loss=dice_ce (nnU-Net's Dice + cross-entropy on the annotated voxels)"
            )
        return AnnotatedDiceCELoss(regions, batch_dice)
    if regions:
        return DiceBCELoss(batch=batch_dice) if name == "dice_ce" else DiceFocalLoss(sigmoid=True, batch=batch_dice)
    if name == "dice_ce":
        return DiceCELoss(include_background=False, softmax=True, to_onehot_y=True, batch=batch_dice)
    return DiceFocalLoss(include_background=False, softmax=True, to_onehot_y=True, batch=batch_dice)
