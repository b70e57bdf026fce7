"""A survival run's plan (`medvol.volumes.survival_plan`): made from the training subjects at a run's first start and
written to `<run>/plan.json`, read back by a resumed run and by predict.py, as a segmentation run's plan is
(`medvol.run.planning`, which hands survival runs to this module).

The plan is applied as config values (`with_survival_plan`): the dataset's spacing, crop to the body, size,
intensity normalization, training flips and batch size, and a cosine decay where the model has no scheduler.
`model.plan.<key>` gives any value instead of deriving it (spacing, spatial_size, batch_size, crop_foreground,
flip_prob), as does a `dataset.transforms.spacing` set by hand; the dataset's own `spatial_size` and `batch_size`
give way to the plan's (the start says so); `model.plan.use=false` keeps the config as written.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytorch_lightning as pl
from omegaconf import DictConfig, OmegaConf, open_dict

from medvol.core.errors import MedvolError
from medvol.run.world import global_rank
from medvol.volumes.plan import read_plan, write_plan
from medvol.volumes.survival_plan import VOXEL_BUDGET, describe_survival_plan, make_survival_plan

GIVEN_KEYS = ("spacing", "spatial_size", "batch_size", "crop_foreground", "flip_prob")
# Lightning's own default when neither max_epochs nor max_steps is set.
DEFAULT_EPOCHS = 1000


def is_survival_plan(plan: dict[str, Any]) -> bool:
    return plan.get("family") == "survival"


def given_values(cfg: DictConfig) -> dict[str, Any]:
    """The plan values the config gives: `model.plan.<key>`, and a `dataset.transforms.spacing` set by hand."""
    node = OmegaConf.to_container(cfg.model.plan, resolve=True)
    assert isinstance(node, dict)
    given = {key: node.get(key) for key in GIVEN_KEYS if node.get(key) is not None}
    spacing = (cfg.dataset.get("transforms") or {}).get("spacing")
    if spacing is not None and "spacing" not in given:
        given["spacing"] = [float(s) for s in spacing]
    return given


def replaced_values(cfg: DictConfig, plan: dict[str, Any]) -> list[str]:
    """Lines saying which of the dataset's own values (its size, its batch) give way to the plan's."""
    transforms = cfg.dataset.get("transforms") or {}
    own = {"spatial_size": (f"`dataset.transforms.spatial_size` {list(transforms.get('spatial_size') or []) or None}",
                            [int(s) for s in transforms.get("spatial_size") or []] or None),
           "batch_size": (f"`dataset.batch_size` {cfg.dataset.get('batch_size')}", cfg.dataset.get("batch_size"))}
    return [
        f"plan: {name} gives way to the plan's {plan[key]} (`model.plan.{key}` chooses one)"
        for key, (name, value) in own.items() if value is not None and value != plan[key]
    ]


def voxel_budget(cfg: DictConfig, accelerator: str) -> int:
    """Voxels of one planned volume: `model.plan.voxel_budget`, else the device's default."""
    budget = cfg.model.plan.get("voxel_budget")
    if budget is not None:
        if int(budget) <= 0:
            raise MedvolError(f"`model.plan.voxel_budget` is {budget}; expected a positive number of voxels or null")
        return int(budget)
    return VOXEL_BUDGET["gpu" if accelerator == "gpu" else "cpu"]


def survival_planned(cfg: DictConfig, datamodule: pl.LightningDataModule, path: Path, accelerator: str
                     ) -> tuple[DictConfig, list[str]]:
    """`cfg` with the run's survival plan applied (`path` where the run has one, else made and written there by
    rank 0), and the plan's lines to print."""
    found = path.is_file()
    if found:
        plan = read_plan(path)
    else:
        if not hasattr(datamodule, "plan_fingerprint") or not hasattr(datamodule, "split_outcomes"):
            raise MedvolError(
                f"`model.plan.use=true`: the dataset {cfg.dataset._target_} has no outcome table to plan from; "
                "expected dataset=csv or model.plan.use=false"
            )
        fingerprint = datamodule.plan_fingerprint()
        table = datamodule.split_outcomes("train")
        events = table["event"].tolist() if table.get("event") is not None else []
        plan = make_survival_plan(
            fingerprint, events, voxel_budget(cfg, accelerator), given_values(cfg),
            getattr(datamodule, "modality_kind", None),
        )
        if global_rank() == 0:
            write_plan(plan, path)
    applied = with_survival_plan(cfg, plan)
    decay = []
    if cfg.model.get("scheduler") is None:
        decay = [f"plan: learning rate: cosine decay to 0 over {applied.model.scheduler.T_max} epochs"]
    where = f"plan: read from {path}" if found else f"plan: written to {path}"
    return applied, [*describe_survival_plan(plan), *decay, *replaced_values(cfg, plan), where]


def with_survival_plan(cfg: DictConfig, plan: dict[str, Any]) -> DictConfig:
    """`cfg` with `plan`'s values in the dataset's transforms and batch size, and a cosine decay where the model has
    no scheduler."""
    cfg = cfg.copy()
    with open_dict(cfg):
        own = OmegaConf.to_container(cfg.dataset.transforms, resolve=True)
        assert isinstance(own, dict)
        cfg.dataset.transforms = {**own, **{
            "spacing": plan["spacing"], "crop_foreground": plan["crop_foreground"], "intensity": "zscore",
            "normalization": plan["normalization"], "spatial_size": plan["spatial_size"], "pad_to": None,
            "flip_prob": plan["flip_prob"],
        }}
        cfg.dataset.batch_size = plan["batch_size"]
        if cfg.model.get("scheduler") is None:
            cfg.model.scheduler = cosine_decay(cfg)
    return cfg


def cosine_decay(cfg: DictConfig) -> dict[str, Any]:
    """A cosine learning-rate decay to 0 over the run's epochs (stepped per epoch)."""
    epochs = cfg.trainer.get("max_epochs")
    epochs = int(epochs) if epochs is not None and int(epochs) > 0 else DEFAULT_EPOCHS
    return {"_target_": "torch.optim.lr_scheduler.CosineAnnealingLR", "_partial_": True, "T_max": epochs}
