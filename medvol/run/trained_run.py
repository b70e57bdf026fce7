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

`open_trained_runs(ckpt_path, run_dir, model)` opens what a predict command names: one checkpoint, a list of them, or
a fold sweep's folder (each fold's validated checkpoint), every member read and checked before the first is built,
and an ensemble's members held to one preprocessing.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf, open_dict

from lightning_modules.base import MedvolModule
from medvol.core.build import build_model, target_class
from medvol.core.errors import MedvolError
from medvol.run.checkpoint_check import check_checkpoint_family, check_checkpoint_shapes
from medvol.run.fold_records import fold_checkpoints
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


@dataclass(frozen=True)
class TrainedRuns:
    """The runs a predict command names, opened: one, or an ensemble's members (the first stands for them all: one
    preprocessing), and the folder whose post-processing decision applies (a fold sweep's; None: the run's own)."""

    members: list[TrainedRun]
    decided_in: Path | None

    @property
    def first(self) -> TrainedRun:
        return self.members[0]

    @property
    def checkpoints(self) -> list[str]:
        return [member.ckpt_path for member in self.members]


def open_trained_runs(ckpt_path: Any, run_dir: Any = None, model: Any = None) -> TrainedRuns:
    """The runs of `ckpt_path` (one path or a list) or of `run_dir` (a fold sweep: each fold's validated checkpoint,
    the sweep's post-processing decision), each opened by `open_trained_run` with the command's `model`, before any is
    built; an ensemble's members must preprocess alike."""
    checkpoints, decided_in = named_checkpoints(ckpt_path, run_dir)
    members = [open_trained_run(path, model) for path in checkpoints]
    same_preprocessing([member.config for member in members], checkpoints)
    return TrainedRuns(members, decided_in)


def named_checkpoints(ckpt: Any, run_dir: Any) -> tuple[list[str], Path | None]:
    """The checkpoints a command names (one, or an ensemble's) and the folder whose post-processing applies:
    `run_dir` (a fold sweep: each fold's validated checkpoint, the sweep's decision), or `ckpt_path` (one path or
    a list; a single run's own decision)."""
    if run_dir is not None and ckpt is not None:
        raise MedvolError("`run_dir` and `ckpt_path` are both set; give one: a fold sweep's folder or checkpoints")
    if run_dir is not None:
        folder = Path(str(run_dir)).expanduser()
        if not folder.is_dir():
            raise MedvolError(f"`run_dir`: no folder at {folder}; expected a fold sweep's folder (-m dataset.fold=...)")
        return fold_checkpoints(folder), folder
    if ckpt is None:
        raise MedvolError(
            "`ckpt_path` is not set; expected a checkpoint of a medvol run (<run>/checkpoints/last.ckpt), a list of "
            "them, or run_dir=<sweep> for a cross-validation's folds"
        )
    paths = [str(p) for p in ckpt] if OmegaConf.is_list(ckpt) or isinstance(ckpt, (list, tuple)) else [str(ckpt)]
    if not paths:
        raise MedvolError("`ckpt_path` is an empty list; expected one checkpoint or several")
    return paths, None


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
