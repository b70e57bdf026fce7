"""Several trained segmentation models as one: the folds of a cross-validation (nnU-Net's 5-fold ensemble).

`predict.py run_dir=<sweep>` (the fold runs a `dataset.fold=0,1,2,3,4` sweep wrote) or `ckpt_path=[a, b, ...]`
gives predict.py several checkpoints. Each member computes its class or region logits on the model grid
(mirrored as `tta` says); the ensemble's are their mean, as nnU-Net averages its folds' logits, which the first
member turns into what a user receives (resampled onto the source grid, then the softmax or sigmoid, the argmax or
threshold and the post-processing). The members must
preprocess alike (one plan: a fold sweep plans once from every fold's subjects), so one input pipeline
serves them all.

`predictor(runs, device, ...)` builds the model that predicts from the opened runs (`medvol.run.trained_run`): the
first run's model, or the members' ensemble, with a segmentation run's post-processing decision and the command's
`tta`; what the command asks of a model that cannot give it (several checkpoints, `tta`, post-processing or samples of
a model that has none) is refused in one line.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from lightning_modules.base import MedvolModule, class_path
from lightning_modules.segmentation.postprocessing import postprocessing_switch
from medvol.core.errors import MedvolError
from medvol.run.fold_records import applied_postprocessing, read_volume_range
from medvol.run.resolvers import run_dir_of_checkpoint
from medvol.run.trained_run import TrainedRuns
from medvol.volumes.sliding_window import SlidingWindow


class Ensemble:
    """Members' logits averaged, then one member's outputs from them (`Segmenter.outputs_of`). In everything else
    (its training data, inputs, post-processing, the window's memory plan) the first member stands for them all: they
    preprocess alike."""

    def __init__(self, members: Sequence[Any]) -> None:
        if not members:
            raise MedvolError("an ensemble needs at least one checkpoint")
        self.members = list(members)

    def __getattr__(self, name: str) -> Any:
        if name == "members":
            raise AttributeError(name)
        return getattr(self.members[0], name)

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


def predictor(
    runs: TrainedRuns, device: torch.device, tta: Any = None, postprocessing: Any = None,
    save_probabilities: bool = False, num_samples: int = 1, from_noise: bool = False, progress: bool = False,
) -> Any:
    """The model that predicts, on `device`: the first run's model, or for several runs their ensemble; for
    segmentation with `tta` (null: the model's own) and the post-processing recorded for the run (or for the sweep,
    for its folds) as `postprocessing` (null: the model's `postprocessing`, auto by default) lets it apply. With
    `progress`, a generative model logs its walk (steps, windows) and its decoding (slabs) as it goes. Several
    `num_samples` come from a generative model only (or `from_noise`, an unconditional generator's draws)."""
    module: MedvolModule = runs.first.module(device)
    if progress and hasattr(module, "progress"):
        module.progress = True
    if num_samples > 1 and not from_noise and not module.generation_inputs():
        raise MedvolError(
            f"`num_samples`={num_samples}: {class_path(module)} is not generative (its outputs are not samples); "
            "use num_samples=1"
        )
    checkpoints = runs.checkpoints
    if tta is not None and hasattr(module, "tta"):
        module.tta = bool(tta)
    if not hasattr(module, "probabilities"):
        if len(checkpoints) > 1 or (tta is not None and not hasattr(module, "tta")) or save_probabilities or \
                postprocessing is not None:
            raise MedvolError(
                "several checkpoints (`ckpt_path=[...]`, `run_dir`), `tta`, `postprocessing` and `save_probabilities` "
                f"apply to segmentation (`tta` also to survival); {checkpoints[0]} is a {type(module).__name__}"
            )
        return module
    own = run_dir_of_checkpoint(checkpoints[0])
    decided_in = runs.decided_in if runs.decided_in is not None else own
    switch = postprocessing_switch(
        module.hparams.get("postprocessing", "auto") if postprocessing is None else postprocessing,
        "postprocessing" if postprocessing is not None else "model.postprocessing",
    )
    module.postprocessing, module.postprocessing_note = applied_postprocessing(
        decided_in, switch, module.postprocessing
    )
    module.volume_range = read_volume_range(own) if own is not None else {}
    if len(checkpoints) == 1:
        return module
    return Ensemble([module, *(member.module(device) for member in runs.members[1:])])
