"""The earlier stages a cascade stage generates through, and the stage it starts its weights from.

A new stage reads stages 1..k-1 from their best checkpoints (`model.previous_stages`); a stage restored from
its own checkpoint rebuilds them from the settings it recorded (their weights come with its state dict). Either
way each is checked against the stage that holds it.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig, ListConfig, OmegaConf

from lightning_modules.xray2ct.denoiser import (
    ViewConditionedDenoiser,
    load_from_previous_stage,
    network_settings,
)
from medvol.core.checkpoint_read import load_checkpoint
from medvol.core.errors import MedvolError

log = logging.getLogger("medvol")

# An earlier stage: its settings, its frozen network, and where it came from (for refusals).
EarlierStage = tuple[dict[str, Any], ViewConditionedDenoiser, str]
EXPECTED = "a finished stage's best.ckpt"


def _container(value: Any) -> Any:
    """A config node as plain Python (a checkpoint's or Hydra's lists and dicts); other values as they are."""
    return OmegaConf.to_container(value, resolve=True) if isinstance(value, (DictConfig, ListConfig)) else value


def frozen_network(settings: dict[str, Any]) -> ViewConditionedDenoiser:
    """An earlier stage's network as its settings build it, in eval mode and without gradients."""
    return ViewConditionedDenoiser(**network_settings(settings)).eval().requires_grad_(False)


def sampling_weights(state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The weights a stage sampled with: its EMA copy, or its trained network where it kept none (`ema_decay=null`)."""
    prefix = "ema.module." if any(k.startswith("ema.module.") for k in state_dict) else "network."
    return {k[len(prefix):]: v for k, v in state_dict.items() if k.startswith(prefix)}


def read_stage(path: str) -> tuple[dict[str, Any], ViewConditionedDenoiser]:
    """A finished stage's hyperparameters and the network it sampled with (EMA, else raw), from its checkpoint."""
    if not Path(path).is_file():
        raise MedvolError(f"`model.previous_stages`: {path} does not exist; expected {EXPECTED}")
    checkpoint = load_checkpoint(Path(path), "model.previous_stages", EXPECTED)
    if not isinstance(checkpoint, dict):
        raise MedvolError(f"`model.previous_stages`: {path} is not an X-ray-to-CT stage checkpoint")
    hparams = dict(checkpoint.get("hyper_parameters", {}))
    if "stage" not in hparams or "views" not in hparams:
        raise MedvolError(f"`model.previous_stages`: {path} is not an X-ray-to-CT stage checkpoint")
    network = frozen_network(hparams)
    try:
        network.load_state_dict(sampling_weights(checkpoint["state_dict"]))
    except RuntimeError:
        raise MedvolError(
            f"`model.previous_stages`: {path} does not hold the network its settings describe "
            f"(stage {hparams['stage']}: neither EMA weights `ema.module.*` nor raw weights `network.*` fit); "
            "expected a finished stage's best.ckpt"
        ) from None
    return hparams, network


def read_stages(paths: Sequence[str]) -> list[EarlierStage]:
    """Stages 1..k-1 from their best checkpoints, in order."""
    return [(*read_stage(path), path) for path in paths]


def rebuilt_stages(recorded: Sequence[Any]) -> list[EarlierStage]:
    """Stages 1..k-1 from the settings a stage's checkpoint recorded; their weights come with its state dict."""
    settings = [_container(s) for s in _container(recorded)]
    return [(s, frozen_network(s), "this checkpoint") for s in settings]


def check_same_views(views: Sequence[str], earlier: dict[str, Any], source: str) -> None:
    """Refuse an earlier stage that saw other radiographs than this one."""
    if list(earlier["views"]) != list(views):
        raise MedvolError(
            f"`model.views` {list(views)} differ from the views {list(earlier['views'])} of stage "
            f"{earlier['stage']} ({source}); every stage sees the same radiographs"
        )


def start_from_stage(network: ViewConditionedDenoiser, path: str, stage: int) -> None:
    """Start stage `stage`'s network from the one the stage at `path` sampled with (see `load_from_previous_stage`)."""
    _, source = read_stage(path)
    skipped = load_from_previous_stage(network, source)
    log.info("stage %s starts from %s (%d tensors not carried over)", stage, path, len(skipped))
