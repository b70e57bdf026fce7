"""A trained run opened once: one checked, typed object that predict, export and a segmentation run's validation
take and go forward with.

`open_trained_run(ckpt_path)` reads each file once, in one direction:

1. the run's settings: its record (`<run>/run.json`, or a cascade stage's) settled on medvol's own config, the run's
   `plan.json` applied, the command's `model.*` merged on top (`medvol.run.predict_config.run_config`), or the
   caller's own config where it already holds the run's (a segmentation run validating its own checkpoint);
2. the checkpoint, read once as data (tensors memory-mapped, `medvol.run.checkpoint_check.read_checkpoint`): its
   family against the settings', what the family restores from it (`MedvolModule.restoring_settings`: e.g. the
   X-ray-to-CT cascade's earlier stages) checked as a record's values are, and every weight's shape against the model
   built on the meta device, with its size against the memory budget.

Nothing is allocated until `TrainedRun.module(device)` builds the model from the held checkpoint.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf, open_dict

from lightning_modules.base import MedvolModule
from medvol.core.build import build_model, target_class
from medvol.run.checkpoint_check import check_checkpoint_family, check_checkpoint_shapes
from medvol.run.predict_config import merged, run_config
from medvol.run.run_record import check_restored
from medvol.run.settings_bounds import check_checkpoint_settings


@dataclass(frozen=True)
class TrainedRun:
    """A checkpoint and the run that wrote it, read and checked.

    Attributes:
        ckpt_path: the checkpoint, as the command named it.
        config: the run's settings (record, plan, the command's `model.*`), the model's resolved.
        checkpoint: the checkpoint's contents, read once (tensors memory-mapped).
        restored: the constructor arguments the family takes from the checkpoint over `config.model`.
    """

    ckpt_path: str
    config: DictConfig
    checkpoint: Mapping[str, Any]
    restored: dict[str, Any]

    def module(self, device: torch.device) -> MedvolModule:
        """The run's model with the checkpoint's weights, in eval mode on `device`."""
        module: MedvolModule = build_model(self.config.model, **self.restored)
        module.on_load_checkpoint(dict(self.checkpoint))
        module.load_state_dict(self.checkpoint["state_dict"])
        return module.to(device).eval()


def open_trained_run(ckpt_path: str, model: Any = None, config: DictConfig | None = None) -> TrainedRun:
    """The run of `ckpt_path`, read and checked before anything is built: its settings from its record with the
    command's `model` settings merged on top (or `config`, where the caller holds the run's own), its checkpoint read
    once and held against them."""
    if config is None:
        own = model or {}
        config = merged(run_config(ckpt_path, ("model",) if own.get("_target_") else ()), {"model": own})
        # The command's own `model.*` may interpolate the run's values: resolved before a dataset override.
        with open_dict(config):
            config.model = OmegaConf.create(OmegaConf.to_container(config.model, resolve=True))
    target = str(config.model._target_)
    checkpoint = check_checkpoint_family(ckpt_path, target)
    assert checkpoint is not None
    restored = target_class(target).restoring_settings(dict(checkpoint.get("hyper_parameters") or {}))
    # Hydra would build a `_target_` inside them: what a checkpoint restores (plain data, `load_checkpoint` checked it)
    # holds values of the run's types only, as a run's record does.
    check_restored(restored, config.model, Path(ckpt_path))
    check_checkpoint_settings(target, restored, checkpoint, ckpt_path)
    check_checkpoint_shapes(ckpt_path, lambda: build_model(config.model, **restored), checkpoint)
    return TrainedRun(str(ckpt_path), config, checkpoint, restored)
