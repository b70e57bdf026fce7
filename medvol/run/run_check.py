"""Checks the values that only Lightning, PyTorch or a loader would reject, so they cost one line before anything
runs."""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf

from medvol.core.build import build, target_class
from medvol.core.errors import MedvolError
from medvol.run.checkpoint_check import check_checkpoint_family
from medvol.run.resolvers import label_regions
from medvol.run.world import World, check_launch, check_strategy, plan_world

CONF_DIR = Path(__file__).resolve().parents[2] / "conf"

PRECISIONS = ("64-true", "32-true", "16-true", "16-mixed", "bf16-true", "bf16-mixed", "64", "32", "16", "bf16")
_BATCH_LIMITS = (
    "limit_train_batches",
    "limit_val_batches",
    "limit_test_batches",
    "limit_predict_batches",
    "overfit_batches",
)
# key -> (smallest whole number allowed, whether null is allowed, what it means)
_COUNTS = {
    "max_epochs": (-1, True, "-1 for no limit"),
    "min_epochs": (0, True, ""),
    "max_steps": (-1, True, "-1 for no limit"),
    "min_steps": (0, True, ""),
    "check_val_every_n_epoch": (1, True, "null to validate by `val_check_interval` only"),
    "log_every_n_steps": (0, True, ""),
    "num_sanity_val_steps": (-1, True, "-1 for the whole validation set"),
    "accumulate_grad_batches": (1, True, ""),
}


def _whole(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def check_trainer(trainer: Mapping[str, Any], accelerator: str) -> None:
    """Raise `MedvolError` naming the first `trainer.*` value Lightning would refuse.

    Args:
        trainer: the resolved `trainer` config.
        accelerator: `cpu` or `gpu`, as `medvol.run.world.plan_world` decided.
    """
    for key, (smallest, nullable, meaning) in _COUNTS.items():
        value = trainer.get(key)
        if (value is None and nullable) or (_whole(value) and value >= smallest):
            continue
        hint = f" ({meaning})" if meaning else ""
        raise MedvolError(f"`trainer.{key}`: got {value!r}; expected a whole number >= {smallest}{hint}")
    for key in _BATCH_LIMITS:
        value = trainer.get(key)
        if value is None or (_whole(value) and value >= 0) or (isinstance(value, float) and 0.0 <= value <= 1.0):
            continue
        raise MedvolError(
            f"`trainer.{key}`: got {value!r}; expected a fraction in [0, 1], a whole number of batches >= 0, "
            "or null for all"
        )
    interval = trainer.get("val_check_interval")
    if not (
        interval is None or (_whole(interval) and interval > 0) or (isinstance(interval, float) and 0 < interval <= 1)
    ):
        raise MedvolError(
            f"`trainer.val_check_interval`: got {interval!r}; expected a fraction of an epoch in (0, "
            "1] or a number of batches > 0"
        )
    clip = trainer.get("gradient_clip_val")
    if not (clip is None or (_number(clip) and clip >= 0)):
        raise MedvolError(f"`trainer.gradient_clip_val`: got {clip!r}; expected a number >= 0 or null")
    algorithm = trainer.get("gradient_clip_algorithm")
    if algorithm not in (None, "norm", "value"):
        raise MedvolError(f"`trainer.gradient_clip_algorithm`: got {algorithm!r}; expected `norm` or `value`")
    fast = trainer.get("fast_dev_run")
    if not (isinstance(fast, bool) or fast is None or (_whole(fast) and fast >= 0)):
        raise MedvolError(f"`trainer.fast_dev_run`: got {fast!r}; expected true, false or a number of batches >= 0")
    precision = trainer.get("precision")
    if precision is not None and str(precision) not in PRECISIONS:
        raise MedvolError(f"`trainer.precision`: got {precision!r}; expected one of {', '.join(PRECISIONS)}")
    if accelerator == "cpu" and str(precision) in ("16-mixed", "16"):
        raise MedvolError(
            f"`trainer.precision`: got {precision!r} on the CPU, where float16 mixed precision is not supported; "
            "use 32-true or bf16-mixed, or a GPU (`hardware=gpu`)"
        )


def missing_values(cfg: DictConfig) -> list[str]:
    """Dotted keys whose value is still `???` (a group file's "you must give this"), Hydra's own node aside."""

    def walk(value: Any, key: str) -> list[str]:
        if isinstance(value, dict):
            return [m for k, v in value.items() for m in walk(v, f"{key}.{k}")]
        if isinstance(value, list):
            return [m for i, v in enumerate(value) for m in walk(v, f"{key}[{i}]")]
        return [key] if value == "???" else []

    found = []
    for key in cfg:
        if key == "hydra":
            continue
        if OmegaConf.is_missing(cfg, key):
            found.append(str(key))
        elif OmegaConf.is_config(value := cfg[key]):
            # Unresolved: `???` must be seen as written, and interpolations may need Hydra's runtime.
            found += walk(OmegaConf.to_container(value, resolve=False), str(key))
    return found


def check_run(cfg: DictConfig) -> None:
    """Raise `MedvolError` for a required value left out, a `dataset.*` key the dataset does not take, or a bad
    `seed`, `optimized_mode`, `dataset.num_workers` or `model.optimizer` value."""
    missing = missing_values(cfg)
    if missing:
        raise MedvolError(
            f"`{missing[0]}` has no value and this config needs one; give it on the command line, e.g. {missing[0]}=..."
        )
    check_dataset_settings(cfg)
    seed = cfg.get("seed")
    if seed is not None and not _whole(seed):
        raise MedvolError(f"`seed`: got {seed!r}; expected a whole number or null for a random run")
    mode = cfg.get("optimized_mode", "max")
    if mode not in ("min", "max"):
        raise MedvolError(f"`optimized_mode`: got {mode!r}; expected `min` or `max`")
    workers = cfg.dataset.get("num_workers") if cfg.get("dataset") is not None else None
    if workers is not None and not (_whole(workers) and workers >= 0):
        raise MedvolError(
            f"`dataset.num_workers`: got {workers!r}; expected a whole number >= 0 (0: load in the main process)"
        )
    optimizer = cfg.model.get("optimizer") if cfg.get("model") is not None else None
    if isinstance(optimizer, DictConfig) and "_target_" in optimizer and optimizer.get("_partial_"):
        # PyTorch checks lr, betas, weight decay ... only when the module builds its optimizers inside `fit`.
        factory = build(optimizer)
        try:
            factory([torch.nn.Parameter(torch.zeros(1))])
        except (ValueError, TypeError) as err:
            raise MedvolError(f"`model.optimizer`: {err}; check its values ({_values(optimizer)})") from None


def check_label_regions(cfg: DictConfig) -> None:
    """Raise `MedvolError` when a model's `regions` differ from the region channels `dataset.label_regions` delivers.

    `model.regions` follows `dataset.label_regions` unless set by hand; set to other regions (or to
    null, classes), the model would read the dataset's channels as something they are not.
    """
    names = cfg.dataset.get("label_regions") if cfg.get("dataset") is not None else None
    if not names or cfg.get("model") is None or "regions" not in cfg.model:
        return
    names = [str(n) for n in names]
    wanted = label_regions(names)
    assert wanted is not None
    given = cfg.model.regions
    given = OmegaConf.to_container(given, resolve=True) if OmegaConf.is_config(given) else given
    if not isinstance(given, dict) or {k: sorted(int(v) for v in values) for k, values in given.items()} != wanted \
            or list(given) != list(wanted):
        shown = "null (classes)" if given is None else str(given)
        raise MedvolError(
            f"`model.regions` is {shown}, but `dataset.label_regions=[{','.join(names)}]` gives one label channel per "
            f"region, {wanted}; leave `model.regions` out (it follows `dataset.label_regions`) or make the two agree"
        )


def _values(node: DictConfig) -> str:
    return ", ".join(f"{k}={v}" for k, v in node.items() if not str(k).startswith("_"))


def constructor_settings(cls: type) -> set[str] | None:
    """The keyword arguments `cls(...)` accepts: its `__init__`'s, and its bases' while each passes `**kwargs` on;
    None when one takes `**kwargs` without a base to pass them to (anything goes)."""
    names: set[str] = set()
    for klass in cls.__mro__:
        if "__init__" not in vars(klass) or klass is object:
            continue
        parameters = list(inspect.signature(klass.__init__).parameters.values())[1:]
        names |= {p.name for p in parameters if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
        if not any(p.kind is p.VAR_KEYWORD for p in parameters):
            return names
    return None


def check_dataset_settings(cfg: DictConfig) -> None:
    """Raise `MedvolError` naming a `dataset.*` key the chosen dataset does not take (a preset's key for another
    dataset, a misspelling), before Hydra's multi-line TypeError would stop the run at the dataset's construction."""
    dataset = cfg.get("dataset")
    if not isinstance(dataset, DictConfig) or "_target_" not in dataset:
        return
    cls = target_class(str(dataset._target_))
    accepted = constructor_settings(cls) if isinstance(cls, type) else None
    if accepted is None:
        return
    unknown = [str(k) for k in dataset if not str(k).startswith("_") and str(k) not in accepted]
    if unknown:
        option = dataset_option(str(dataset._target_))
        listing = (f"; `python train.py dataset={option} --cfg job --package dataset` lists its config"
                   if option else "")
        raise MedvolError(
            f"`dataset.{unknown[0]}`: {cls.__name__} ({dataset._target_}) takes no such setting; its settings: "
            f"{', '.join(sorted(accepted))}{listing}"
        )


def dataset_option(target: str) -> str | None:
    """The `dataset=` option whose group file builds `target` (the first, by name), for a command to paste."""
    for path in sorted((CONF_DIR / "dataset").glob("*.yaml")):
        if OmegaConf.load(path).get("_target_") == target:
            return path.stem
    return None


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
