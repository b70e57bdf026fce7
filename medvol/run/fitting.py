"""A run's model fitted: the model built from its planned config and checked against the checkpoint it continues, the
Trainer with the run's callbacks, loggers, strategy and plugins, the run's record written, then `fit`, the segmentation
run's validation on the source grids (`medvol.run.cross_validation`) and, with `test=true`, the test split."""

from __future__ import annotations

import logging
from typing import Any

import pytorch_lightning as pl
import torch
from omegaconf import DictConfig, OmegaConf

from lightning_modules.base import MedvolModule
from medvol.core.atomic_checkpoint import checkpoint_io_plugins
from medvol.core.build import build, build_model
from medvol.core.checkpoint_read import weights_only
from medvol.core.console import print_config_tree
from medvol.core.errors import MedvolError
from medvol.core.sync_batchnorm import layer_sync_plugins
from medvol.run.batch_arithmetic import BatchArithmetic, scale_learning_rates
from medvol.run.checkpoint_check import check_checkpoint_shapes
from medvol.run.cross_validation import after_training
from medvol.run.fingerprint import RecordFingerprint
from medvol.run.run_record import write_run_record
from medvol.run.start_summary import split_sizes, start_summary
from medvol.run.world import World, build_strategy, global_rank, requeued_checkpoint
from medvol.volumes.dicom_io import refuse_non_series_subjects

log = logging.getLogger("medvol")


def fit_run(
    cfg: DictConfig, world: World, datamodule: pl.LightningDataModule, plan_lines: list[str],
    checkpoint: dict[str, Any] | None = None,
) -> dict[str, float]:
    """Build the model and the Trainer from the planned `cfg`, fit, validate and test as it says; the final metrics.

    Everything is built and checked before the first line is printed: a refused command prints only its error.
    `checkpoint`: `ckpt_path` as `run_check.checked_config` read it (Lightning restores from the file itself)."""
    if cfg.get("test") and cfg.get("output_format") == "dicom" and hasattr(datamodule, "subjects"):
        refuse_non_series_subjects(datamodule.subjects())
    model_cfg, lr_lines = scale_learning_rates(cfg.model, str(cfg.get("lr_scaling", "none")), world.size)
    check_checkpoint_shapes(cfg.get("ckpt_path"), lambda: build_model(model_cfg), checkpoint)
    module: MedvolModule = build_model(model_cfg)
    if hasattr(module, "cached_transform") and hasattr(datamodule, "add_cached_transform"):
        # A latent model's encoder runs once per subject inside the dataset's cache (docs/ldm.md).
        datamodule.add_cached_transform(*module.cached_transform())

    # Not a config group entry: every run records its data's fingerprint for predict.py.
    callbacks = [*instantiate_group(cfg.get("callbacks"), "callbacks"), RecordFingerprint()]
    loggers = instantiate_group(cfg.get("logger"), "logger")
    settings = trainer_settings(cfg, module)
    settings.pop("_target_", None)
    strategy = build_strategy(cfg.get("strategy"), world, manual_optimization=not module.automatic_optimization)
    plugins = [*layer_sync_plugins(settings, world.accelerator, world.size), *checkpoint_io_plugins(strategy)]

    if global_rank() == 0:
        if cfg.get("print_config", False):
            print_config_tree(cfg)
        # A few lines that say what the run is (its record, .hydra/config.yaml and run.json, holds the rest).
        for line in start_summary(cfg, world, split_sizes(datamodule), plan_lines):
            log.info("%s", line)
    trainer = pl.Trainer(
        **settings, callbacks=callbacks, logger=loggers or False, strategy=strategy, plugins=plugins or None
    )
    arithmetic = BatchArithmetic(
        int(cfg.dataset.batch_size), trainer.world_size, int(cfg.trainer.get("accumulate_grad_batches") or 1)
    )
    if trainer.is_global_zero:
        log.info("%s", arithmetic.describe())
        for line in lr_lines:
            log.info("learning rate %s", line)

    record_hyperparameters(loggers, cfg, model_cfg, arithmetic.effective)

    ckpt_path = cfg.get("ckpt_path") or requeued_checkpoint(str(cfg.paths.output_dir))
    if trainer.is_global_zero:
        # What predict.py, export.py and a resume read back: this config as it trains, once (medvol.run.run_record).
        write_run_record(cfg)
    if cfg.get("train", True):
        trainer.fit(module, datamodule=datamodule, ckpt_path=ckpt_path, weights_only=weights_only())
    metrics = {k: float(v) for k, v in trainer.callback_metrics.items() if torch.is_tensor(v) and v.numel() == 1}
    # Segmentation: the best checkpoint on the validation subjects' source grids, and its post-processing.
    metrics.update(after_training(cfg, trainer, module))

    if cfg.get("test", False):
        metrics.update(tested(trainer, module, datamodule, cfg))
    return metrics


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
        objects.append(build(entry))
    return objects


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


def record_hyperparameters(loggers: list[Any], cfg: DictConfig, model_cfg: DictConfig, effective_batch: int) -> None:
    """The run's whole config (the model's with its scaled learning rates) and the effective batch, to every logger."""
    hyperparameters = {k: OmegaConf.to_container(v, resolve=True) if OmegaConf.is_config(v) else v
                       for k, v in cfg.items() if k != "hydra"}
    hyperparameters["model"] = OmegaConf.to_container(model_cfg, resolve=True)
    hyperparameters["effective_batch_size"] = effective_batch
    for logger in loggers:
        logger.log_hyperparams(hyperparameters)


def tested(
    trainer: pl.Trainer, module: MedvolModule, datamodule: pl.LightningDataModule, cfg: DictConfig
) -> dict[str, float]:
    """The test split's metrics: after training with the best checkpoint, in a test-only run (train=false) with the
    given one."""
    if cfg.get("train", True):
        test_ckpt = getattr(trainer.checkpoint_callback, "best_model_path", "") or None
        if test_ckpt is None:
            log.warning("No best checkpoint found; testing the weights at the end of training")
    else:
        test_ckpt = cfg.get("ckpt_path")
    trainer.test(module, datamodule=datamodule, ckpt_path=test_ckpt, weights_only=weights_only())
    return {k: float(v) for k, v in trainer.callback_metrics.items() if k.startswith("test/")}
