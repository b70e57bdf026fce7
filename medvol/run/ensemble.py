"""Several trained segmentation models as one: the folds of a cross-validation (nnU-Net's 5-fold ensemble).

`predict.py run_dir=<sweep>` (the fold runs a `dataset.fold=0,1,2,3,4` sweep wrote) or `ckpt_path=[a, b, ...]`
gives predict.py several checkpoints. Each member computes its class probabilities on the model grid
(mirrored as `tta` says); the ensemble's are their mean, which the first member turns into what a user
receives (resampled onto the source grid, then the argmax and the post-processing). The members must
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
    """Members' probabilities averaged, then one member's outputs from them (`Segmenter.outputs_of`)."""

    def __init__(self, members: Sequence[Any]) -> None:
        if not members:
            raise MedvolError("an ensemble needs at least one checkpoint")
        self.members = list(members)

    def probabilities(self, image: torch.Tensor, window: SlidingWindow, tta: bool) -> torch.Tensor:
        total = None
        for member in self.members:
            probabilities = member.probabilities(image, window, tta)
            total = probabilities if total is None else total + probabilities.to(total.device)
        assert total is not None
        return total / len(self.members)

    def predict_volumes(
        self, batch: dict[str, Any], window: SlidingWindow, extras: Sequence[str] = ()
    ) -> dict[str, Any]:
        first = self.members[0]
        image = batch[first.hparams.image_key]
        return first.outputs_of(batch, self.probabilities(image, window, first.tta), extras)


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
