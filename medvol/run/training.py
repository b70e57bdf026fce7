"""`run(cfg)`: build everything from the composed config, train, optionally test, return the metrics."""

from __future__ import annotations

import logging
import math
from typing import Any

import pytorch_lightning as pl
import torch
from omegaconf import DictConfig, OmegaConf

from lightning_modules.base import MedvolModule
from medvol.core.atomic_checkpoint import checkpoint_io_plugins
from medvol.core.build import build, build_model, target_class
from medvol.core.checkpoint_read import TRUST_KEY, checkpoints_trusted, weights_only
from medvol.core.console import print_config_tree
from medvol.core.errors import MedvolError
from medvol.core.process_group import release_at_exit, run_started
from medvol.core.run_files import refuse_links
from medvol.core.sync_batchnorm import layer_sync_plugins
from medvol.run.batch_arithmetic import BatchArithmetic, scale_learning_rates
from medvol.run.cascade import run_cascade
from medvol.run.checkpoint_check import check_checkpoint_family, check_checkpoint_shapes
from medvol.run.cross_validation import after_training
from medvol.run.fingerprint import RecordFingerprint
from medvol.run.launch import local_ranks
from medvol.run.planning import planned
from medvol.run.preflight import Preflight, preflight
from medvol.run.resolvers import run_dir_of_checkpoint
from medvol.run.resume import resumed
from medvol.run.run_check import check_label_regions, check_run, check_trainer
from medvol.run.run_record import write_run_record
from medvol.run.start_summary import split_sizes, start_summary
from medvol.run.world import (
    World,
    build_strategy,
    check_launch,
    check_strategy,
    global_rank,
    plan_world,
    requeued_checkpoint,
    starts_own_ranks,
)
from medvol.volumes.dicom_io import refuse_non_series_subjects

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


def check_config(cfg: DictConfig) -> World:
    """Every check that needs no data or model built: bad values and checkpoints stop here, before anything is
    written."""
    return checked_config(cfg)[0]


def checked_config(cfg: DictConfig) -> tuple[World, dict[str, Any] | None]:
    """`check_config`'s checks; also the checkpoint `ckpt_path` names, read once (tensors memory-mapped) for the
    shapes' check after planning."""
    world = plan_world(cfg.trainer)
    check_trainer(OmegaConf.to_container(cfg.trainer, resolve=True), world.accelerator)
    check_run(cfg)
    check_label_regions(cfg)
    check_strategy(cfg.get("strategy"), world)
    check_launch(world)
    checkpoint = check_checkpoint_family(cfg.get("ckpt_path"), str(cfg.model._target_))
    family = target_class(str(cfg.model._target_))
    if hasattr(family, "check_settings"):
        family.check_settings(cfg.model)
    return world, checkpoint


def sweep_objective(metrics: dict[str, float], metric: str | None, mode: str = "max") -> float | None:
    """What a Hydra sweeper receives: `metric`'s value, or the worst value for `mode` where it is undefined.

    A sweeper given NaN fails the trial (Optuna) or ranks it at random; an undefined metric (the AUROC
    of a one-class validation set) is the worst result a trial can have.
    """
    if not metric or metric not in metrics:
        return None
    value = float(metrics[metric])
    if not math.isnan(value):
        return value
    log.warning(
        "`%s` is undefined (NaN) for this run: the sweeper receives %s", metric, "-inf" if mode == "max" else "inf"
    )
    return -math.inf if mode == "max" else math.inf


def run(cfg: DictConfig, settled: bool = False) -> dict[str, float]:
    """Train (and optionally test) as the config says; return the final metrics as floats.

    With `trainer.devices=N > 1` on one node and no external launcher, this process becomes
    rank 0 and starts the other ranks itself (see `medvol.run.launch`). A config with a `cascade`
    node runs its stages one after another (see `medvol.run.cascade`). Checkpoints are read as data unless the
    command says `trust_checkpoints=true` (`medvol.core.checkpoint_read`). A `ckpt_path` inside a run continues
    that run: its record with this command's overrides on top (`medvol.run.resume`). `settled`: `cfg` is rank 0's
    planned config (ranks 1..N-1 of `medvol.run.launch`): planned and fitted already, as a record is.
    """
    refuse_a_linked_run(cfg.get("ckpt_path"))
    with checkpoints_trusted(cfg.get(TRUST_KEY, False)):
        cfg, record = resumed(cfg)
        return _stages_or_run(cfg, recorded=settled or record is not None)


def refuse_a_linked_run(ckpt_path: str | None) -> None:
    """A resume continues a run folder that may come from someone else: one that holds a symbolic link anywhere is
    refused in one line before anything is written (`medvol.core.run_files`), as every writer refuses one too."""
    run_dir = run_dir_of_checkpoint(ckpt_path)
    if run_dir is not None:
        refuse_links(run_dir)


def command_ckpt_path(argv: list[str]) -> str | None:
    """The `ckpt_path=` a command line gives (the last one), before Hydra composes: Hydra opens a resumed run's
    train.log and writes its `.hydra/resume-<stamp>/` first."""
    given = [value for key, _, value in (a.partition("=") for a in argv) if key.lstrip("+") == "ckpt_path"]
    return given[-1].strip("'\"") if given else None


def _stages_or_run(cfg: DictConfig, recorded: bool = False) -> dict[str, float]:
    if cfg.get("cascade"):
        if global_rank() == 0 and not cfg.get("preflight"):
            write_run_record(cfg)
        return run_cascade(cfg, _stages_or_run, check_config)
    checked = preflight(cfg, recorded)
    if checked.stop:
        return {}
    world, checkpoint = checked_config(cfg)
    if global_rank() != 0:
        # Rank 0 alone prints; the others still report warnings and errors.
        logging.getLogger().setLevel(logging.WARNING)
        log.setLevel(logging.WARNING)
    if cfg.get("seed") is not None:
        pl.seed_everything(int(cfg.seed), workers=True, verbose=False)
    prepared = _planned_data(cfg, world, recorded, checked)
    if prepared is None:
        return {}
    cfg, datamodule, plan_lines = prepared
    if starts_own_ranks(cfg.get("strategy"), world):
        with local_ranks(cfg, world.devices):
            return _run(cfg, world, datamodule, plan_lines, checkpoint)
    run_started()
    metrics = _run(cfg, world, datamodule, plan_lines, checkpoint)
    # Gloo's threads abort a process whose group outlives the interpreter (see medvol.core.process_group).
    release_at_exit()
    return metrics


def _planned_data(cfg: DictConfig, world: World, recorded: bool, checked: Preflight) -> tuple[
        DictConfig, pl.LightningDataModule, list[str]] | None:
    """The run's config with its plan (and `hardware.fit`'s batch), its datamodule and the plan's lines; made before
    a rank starts, so the ranks this process starts receive the planned config. A preflight that waited for the plan
    runs here, before the cache is built; None where a named card's preflight ends the run."""
    datamodule: pl.LightningDataModule = build(cfg.dataset)
    if hasattr(datamodule, "preflight"):
        datamodule.preflight()
    named = bool(cfg.get("preflight"))
    # A named card's preflight plans as that card's run would (nnU-Net's GPU budget and filters) and writes no plan.
    cfg, plan_lines = planned(cfg, datamodule, "gpu" if named else world.accelerator, recorded, write=not named)
    if checked.after_planning:
        checked = preflight(cfg, recorded, planned=True)
        if checked.stop:
            return None
    if checked.batch is not None and checked.batch != cfg.dataset.get("batch_size"):
        cfg = cfg.copy()
        cfg.dataset.batch_size = checked.batch
        plan_lines = [*plan_lines, f"hardware.fit: dataset.batch_size={checked.batch}, the largest that fits"]
    if plan_lines:
        datamodule = build(cfg.dataset)
        # The plan's spacing (from the data, or a resumed run's plan.json) makes new grids: checked from the headers.
        if hasattr(datamodule, "preflight"):
            datamodule.preflight()
    return cfg, datamodule, plan_lines


def _run(
    cfg: DictConfig, world: World, datamodule: pl.LightningDataModule, plan_lines: list[str],
    checkpoint: dict[str, Any] | None = None,
) -> dict[str, float]:
    # Everything is built and checked before the first line is printed: a refused command prints only its error.
    # `checkpoint`: `ckpt_path` as `checked_config` read it (Lightning restores from the file itself).
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
