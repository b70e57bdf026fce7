"""A trained run's model loaded for inference, and the mean of per-subject metric rows: what predict.py and a
segmentation run's validation after training share, without the rest of predict.py's stages."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig

from lightning_modules.base import MedvolModule
from medvol.core.build import build_model, target_class
from medvol.run.checkpoint_check import check_checkpoint_family, check_checkpoint_shapes
from medvol.run.run_record import check_restored
from medvol.run.settings_bounds import check_checkpoint_settings


def load_module(run: DictConfig, ckpt_path: str, device: torch.device) -> MedvolModule:
    """The run's model with the checkpoint's weights, in eval mode on `device`; what the family restores from the
    checkpoint itself (`MedvolModule.restoring_settings`: e.g. X-ray-to-CT's earlier stages) over the run's config."""
    checkpoint = check_checkpoint_family(ckpt_path, run.model._target_)
    assert checkpoint is not None
    family = target_class(run.model._target_)
    restored = family.restoring_settings(dict(checkpoint.get("hyper_parameters") or {}))
    # Hydra would build a `_target_` inside them: what a checkpoint restores (plain data, `load_checkpoint` checked it)
    # holds values of the run's types only, as a run's record does.
    check_restored(restored, run.model, Path(ckpt_path))
    check_checkpoint_settings(run.model._target_, restored, checkpoint, ckpt_path)
    check_checkpoint_shapes(ckpt_path, lambda: build_model(run.model, **restored), checkpoint)
    module: MedvolModule = build_model(run.model, **restored)
    module.on_load_checkpoint(checkpoint)
    module.load_state_dict(checkpoint["state_dict"])
    return module.to(device).eval()


def mean_metrics(rows: list[dict[str, Any]]) -> dict[str, float]:
    """Per metric, the mean over the subjects where it is finite (HD95 is NaN for an empty mask)."""
    names = dict.fromkeys(key for row in rows for key in row if key != "subject")
    means = {}
    for name in names:
        values = [row[name] for row in rows if name in row and math.isfinite(row[name])]
        if values:
            means[name] = sum(values) / len(values)
    return means
