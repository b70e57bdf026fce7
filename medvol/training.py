"""`run(cfg)`: build everything from the composed config, train, optionally test, return the metrics."""

from __future__ import annotations

import logging
from typing import Any

import hydra
import pytorch_lightning as pl
import torch
from omegaconf import DictConfig, OmegaConf

from lightning_modules.base import MedvolModule
from medvol.checkpoint_check import check_checkpoint
from medvol.errors import MedvolError

log = logging.getLogger("medvol")


def instantiate_group(group: DictConfig | None, kind: str) -> list[Any]:
    """Instantiate every `_target_` entry of a callbacks/logger config dict; `null` entries are skipped."""
    objects: list[Any] = []
    if not group:
        return objects
    if not isinstance(group, DictConfig):
        raise MedvolError(f"`{kind}` must be a mapping of name -> config, got {type(group).__name__}")
    for name, entry in group.items():
        if entry is None:
            continue
        if not isinstance(entry, DictConfig) or "_target_" not in entry:
            raise MedvolError(f"`{kind}.{name}` has no `_target_`; expected a config with a `_target_` class path")
        objects.append(hydra.utils.instantiate(entry))
    return objects


def build_strategy(cfg: DictConfig | None) -> Any:
    """`strategy=<name>` configs either name a Lightning strategy (`name: auto`) or give a `_target_`."""
    if cfg is None:
        return "auto"
    if "_target_" in cfg:
        return hydra.utils.instantiate(cfg)
    return cfg.get("name", "auto")


def trainer_settings(cfg: DictConfig, module: MedvolModule) -> dict[str, Any]:
    """Trainer kwargs; for manual optimization, accumulation and clipping move into the module."""
    settings = OmegaConf.to_container(cfg.trainer, resolve=True)
    assert isinstance(settings, dict)
    if not module.automatic_optimization:
        module.set_manual_step_policy(
            accumulate_grad_batches=settings.pop("accumulate_grad_batches", 1) or 1,
            gradient_clip_val=settings.pop("gradient_clip_val", None),
            gradient_clip_algorithm=settings.pop("gradient_clip_algorithm", None) or "norm",
        )
    return settings


def run(cfg: DictConfig) -> dict[str, float]:
    """Train (and optionally test) as the config says; return the final metrics as floats."""
    if cfg.get("seed") is not None:
        pl.seed_everything(int(cfg.seed), workers=True)

    log.info("Building datamodule <%s>", cfg.dataset._target_)
    datamodule: pl.LightningDataModule = hydra.utils.instantiate(cfg.dataset)
    if hasattr(datamodule, "preflight"):
        datamodule.preflight()
    log.info("Building model <%s>", cfg.model._target_)
    module: MedvolModule = hydra.utils.instantiate(cfg.model)
    check_checkpoint(cfg.get("ckpt_path"), module)

    callbacks = instantiate_group(cfg.get("callbacks"), "callbacks")
    loggers = instantiate_group(cfg.get("logger"), "logger")
    settings = trainer_settings(cfg, module)
    settings.pop("_target_", None)
    trainer = pl.Trainer(**settings, callbacks=callbacks, logger=loggers or False, strategy=build_strategy(cfg.get("strategy")))

    hyperparameters = {k: OmegaConf.to_container(v, resolve=True) if OmegaConf.is_config(v) else v
                       for k, v in cfg.items() if k != "hydra"}
    for logger in loggers:
        logger.log_hyperparams(hyperparameters)

    if cfg.get("train", True):
        trainer.fit(module, datamodule=datamodule, ckpt_path=cfg.get("ckpt_path"), weights_only=False)
    metrics = {k: float(v) for k, v in trainer.callback_metrics.items() if torch.is_tensor(v) and v.numel() == 1}

    if cfg.get("test", False):
        best = trainer.checkpoint_callback.best_model_path if trainer.checkpoint_callback else ""
        if cfg.get("train", True):
            test_ckpt = best or None
        else:
            test_ckpt = cfg.get("ckpt_path")
        if test_ckpt is None and cfg.get("train", True):
            log.warning("No best checkpoint found; testing the weights at the end of training")
        trainer.test(module, datamodule=datamodule, ckpt_path=test_ckpt, weights_only=False)
        metrics.update({k: float(v) for k, v in trainer.callback_metrics.items() if k.startswith("test/")})
    return metrics
