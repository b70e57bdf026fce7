"""Several trained segmentation models as one: the folds of a cross-validation (nnU-Net's 5-fold ensemble).

`predict.py run_dir=<sweep>` (the fold runs a `dataset.fold=0,1,2,3,4` sweep wrote) or `ckpt_path=[a, b, ...]`
gives predict.py several checkpoints. Each member computes its class or region logits on the model grid
(mirrored as `tta` says); the ensemble's are their mean, as nnU-Net averages its folds' logits, which the first
member turns into what a user receives (resampled onto the source grid, then the softmax or sigmoid, the argmax or
threshold and the post-processing). The members must
preprocess alike (one plan: a fold sweep plans once from every fold's subjects), so one input pipeline
serves them all.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf

from medvol.core.errors import MedvolError
from medvol.volumes.sliding_window import SlidingWindow


class Ensemble:
    """Members' logits averaged, then one member's outputs from them (`Segmenter.outputs_of`)."""

    def __init__(self, members: Sequence[Any]) -> None:
        if not members:
            raise MedvolError("an ensemble needs at least one checkpoint")
        self.members = list(members)

    def logits(self, image: torch.Tensor, window: SlidingWindow, tta: bool) -> torch.Tensor:
        total = None
        for member in self.members:
            logits = member.logits(image, window, tta)
            total = logits if total is None else total + logits.to(total.device)
        assert total is not None
        return total / len(self.members)

    def predict_volumes(
        self, batch: dict[str, Any], window: SlidingWindow, extras: Sequence[str] = ()
    ) -> dict[str, Any]:
        first = self.members[0]
        image = batch[first.hparams.image_key]
        return first.outputs_of(batch, self.logits(image, window, first.tta), extras)


def same_preprocessing(runs: Sequence[DictConfig], checkpoints: Sequence[str]) -> None:
    """Refuse members whose runs preprocess differently (another spacing, normalization or crop)."""
    def transforms(run: DictConfig) -> Any:
        node = run.dataset.get("transforms")
        return OmegaConf.to_container(node, resolve=True) if node is not None else None

    first = transforms(runs[0])
    for run, checkpoint in zip(runs[1:], checkpoints[1:], strict=True):
        if transforms(run) != first:
            raise MedvolError(
                f"`ckpt_path`: {checkpoint} was trained with other preprocessing (dataset.transforms or plan) than "
                f"{checkpoints[0]}; an ensemble averages members that see the same grid"
            )
