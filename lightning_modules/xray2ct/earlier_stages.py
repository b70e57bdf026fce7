"""The earlier stages a cascade stage generates through, and the stage it starts its weights from.

A new stage reads stages 1..k-1 from their best checkpoints (`model.previous_stages`); a stage restored from
its own checkpoint rebuilds them from the settings it recorded (their weights come with its state dict). Either
way each is checked against the stage that holds it.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
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
from medvol.core.module_size import check_module_bytes, first_mismatch, load_weights, on_meta

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
    weights = sampling_weights(checkpoint["state_dict"])
    # Shapes first, on the meta device: settings that build a larger network than its weights allocate nothing.
    source = f"`model.previous_stages`: {path}"
    shapes = on_meta(lambda: frozen_network(hparams), source)
    if first_mismatch(shapes, weights) is None:
        check_module_bytes(shapes, source)
        network = frozen_network(hparams)
        if not load_weights(network, weights, strict=False).unexpected_keys:
            return hparams, network
    raise MedvolError(
        f"{source} does not hold the network its settings describe "
        f"(stage {hparams['stage']}: neither EMA weights `ema.module.*` nor raw weights `network.*` fit); "
        "expected a finished stage's best.ckpt"
    )


def read_stages(paths: Sequence[str]) -> list[EarlierStage]:
    """Stages 1..k-1 from their best checkpoints, in order."""
    return [(*read_stage(path), path) for path in paths]


def rebuilt_stages(recorded: Sequence[Any]) -> list[EarlierStage]:
    """Stages 1..k-1 from the settings a stage's checkpoint recorded; their weights come with its state dict."""
    settings = [_container(s) for s in _container(recorded)]
    return [(s, frozen_network(s), "this checkpoint") for s in settings]


# What every stage of a cascade must share: the radiographs it is given (their names, size and field of view) and
# how their values relate to Hounsfield units (the window the CT maps onto the model's range, water's attenuation).
SHARED_SETTINGS = ("views", "xray_size", "window", "mu_water", "field_of_view")


def _listed(value: Any) -> Any:
    """A setting as a config shows it (tuples as lists)."""
    return [_listed(v) for v in value] if isinstance(value, (list, tuple)) else value


def _same(mine: Any, theirs: Any) -> bool:
    if isinstance(mine, (list, tuple)) and isinstance(theirs, (list, tuple)):
        return len(mine) == len(theirs) and all(_same(a, b) for a, b in zip(mine, theirs, strict=True))
    if isinstance(mine, (int, float)) and isinstance(theirs, (int, float)):
        return abs(float(mine) - float(theirs)) <= 1e-6 * max(1.0, abs(float(theirs)))
    return mine == theirs


def check_same_radiographs(
    settings: Mapping[str, Any], earlier: Mapping[str, Any], source: str, key_prefix: str = "model."
) -> None:
    """Refuse an earlier stage that saw other radiographs than this one (`SHARED_SETTINGS`; a setting either stage
    does not record, as checkpoints older than it, is not compared); `key_prefix` names this stage's settings."""
    for key in SHARED_SETTINGS:
        mine, theirs = _listed(_container(settings.get(key))), _listed(_container(earlier.get(key)))
        if mine is None or theirs is None or _same(mine, theirs):
            continue
        raise MedvolError(
            f"`{key_prefix}{key}` {mine} differs from the {key} {theirs} of stage {earlier.get('stage')} ({source}); "
            "every stage of a cascade sees the same radiographs (views, xray_size, field_of_view) in the same "
            "units (window, mu_water)"
        )


def start_from_stage(network: ViewConditionedDenoiser, path: str, stage: int) -> None:
    """Start stage `stage`'s network from the one the stage at `path` sampled with (see `load_from_previous_stage`)."""
    _, source = read_stage(path)
    skipped = load_from_previous_stage(network, source)
    log.info("stage %s starts from %s (%d tensors not carried over)", stage, path, len(skipped))
