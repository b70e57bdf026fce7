"""A segmentation run's plan (`medvol.volumes.plan`): made from the training data at a run's first start and
written to `<run>/plan.json`; a resumed run and predict.py read that file back, so all three see the same
spacing, crop, normalization, patch and network, bit for bit.

The plan is applied as config values (`with_plan`): the dataset's transforms, its batch size, and the model's
network, patch, deep supervision, background padding and learning-rate decay. `model.plan.*` keys give any value
instead of deriving it; `model.plan.use=false` keeps the config as written.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytorch_lightning as pl
import torch
from omegaconf import DictConfig, OmegaConf, open_dict

from medvol.core.build import target_class
from medvol.core.errors import MedvolError
from medvol.run.survival_planning import is_survival_plan, survival_planned, with_survival_plan
from medvol.run.world import global_rank
from medvol.volumes.plan import PLAN_FILE, background_values, describe, make_plan, read_plan, write_plan

log = logging.getLogger("medvol")

# Activation memory one training step may take: on a CPU small enough for an epoch in minutes, on a GPU
# a share of the device's memory (the estimate counts activations only, not the workspace).
CPU_BUDGET_MIB = 512
GPU_SHARE = 0.5
BASE_FEATURES = {"cpu": 16, "gpu": 32}
# Plan keys a user may give instead (`model.plan.<key>=...`); the others of the node steer how it is made.
GIVEN_KEYS = (
    "spacing", "patch_size", "batch_size", "features", "foreground_ratio", "deep_supervision", "poly_power",
    "crop_foreground",
)
USES = ("auto", True, False)
# Lightning's own default when neither max_epochs nor max_steps is set.
DEFAULT_EPOCHS = 1000


def plan_path(cfg: DictConfig) -> Path:
    return Path(str(cfg.paths.output_dir)) / PLAN_FILE


def wants_plan(cfg: DictConfig) -> bool:
    """`model.plan.use`: true, false, or auto (a plan for a file dataset, none for the synthetic phantoms)."""
    node = cfg.model.get("plan")
    if node is None:
        return False
    use = node.get("use", "auto")
    if use not in USES:
        raise MedvolError(f"`model.plan.use` is {use!r}; expected auto, true or false")
    if use != "auto":
        return bool(use)
    return cfg.dataset.get("transforms") is not None and hasattr(target_class(cfg.dataset._target_), "plan_fingerprint")


def given_values(cfg: DictConfig) -> dict[str, Any]:
    """The plan values the config gives: `model.plan.<key>`, and a `dataset.transforms.spacing` set by hand."""
    node = OmegaConf.to_container(cfg.model.plan, resolve=True)
    assert isinstance(node, dict)
    given = {key: node.get(key) for key in GIVEN_KEYS if node.get(key) is not None}
    spacing = (cfg.dataset.get("transforms") or {}).get("spacing")
    if spacing is not None and "spacing" not in given:
        given["spacing"] = [float(s) for s in spacing]
    return given


def memory_budget(cfg: DictConfig, accelerator: str) -> int:
    """Bytes of activations one step may take: `model.plan.memory_budget_mib`, else the device's default."""
    mib = cfg.model.plan.get("memory_budget_mib")
    if mib is not None:
        if float(mib) <= 0:
            raise MedvolError(f"`model.plan.memory_budget_mib` is {mib}; expected a positive number of MiB or null")
        return int(float(mib) * 2**20)
    if accelerator == "gpu" and torch.cuda.is_available():
        return int(GPU_SHARE * torch.cuda.get_device_properties(0).total_memory)
    return CPU_BUDGET_MIB * 2**20


def planned(cfg: DictConfig, datamodule: pl.LightningDataModule, accelerator: str) -> tuple[DictConfig, list[str]]:
    """`cfg` with the run's plan applied, and the plan's lines to print; `cfg` itself without a plan.

    The plan of `<run>/plan.json` where the run has one (a resume), else one made from the training
    subjects and written there by rank 0.
    """
    if not wants_plan(cfg):
        return cfg, []
    path = plan_path(cfg)
    if cfg.model.plan.get("family") == "survival":
        return survival_planned(cfg, datamodule, path, accelerator)
    if path.is_file():
        plan = read_plan(path)
    else:
        if not hasattr(datamodule, "plan_fingerprint"):
            raise MedvolError(
                f"`model.plan.use=true`: the dataset {cfg.dataset._target_} has no files to plan from; expected a file "
                "dataset (dataset=nifti, brats) or model.plan.use=false"
            )
        device = "gpu" if accelerator == "gpu" else "cpu"
        base = int(cfg.model.plan.get("base_features") or BASE_FEATURES[device])
        plan = make_plan(
            datamodule.plan_fingerprint(), memory_budget(cfg, accelerator), base, given_values(cfg),
            getattr(datamodule, "modality_kind", None),
        )
        if global_rank() == 0:
            write_plan(plan, path)
    return with_plan(cfg, plan), [*describe(plan), f"plan: written to {path}"]


def with_plan(cfg: DictConfig, plan: dict[str, Any]) -> DictConfig:
    """`cfg` with `plan`'s values in the dataset's transforms and batch size and in the model."""
    cfg = cfg.copy()
    patch = list(plan["patch_size"])
    with open_dict(cfg):
        own = OmegaConf.to_container(cfg.dataset.transforms, resolve=True)
        assert isinstance(own, dict)
        cfg.dataset.transforms = {**own, **{
            "spacing": plan["spacing"], "intensity": "zscore", "normalization": plan["normalization"],
            "crop_foreground": plan["crop_foreground"], "spatial_size": None, "random_crop": None,
            "pad_to": patch, "foreground_crop": patch, "foreground_ratio": plan["foreground_ratio"],
        }}
        cfg.dataset.batch_size = plan["batch_size"]
        # Volumes cropped to their own non-zero region differ in shape: evaluated one at a time.
        cfg.dataset.val_batch_size = 1
        cfg.model.net = "dynunet"
        cfg.model.features = plan["features"]
        cfg.model.strides = plan["strides"]
        cfg.model.kernels = plan["kernels"]
        cfg.model.patch_size = patch
        cfg.model.patch_sampling = "random"
        cfg.model.deep_supervision = plan["deep_supervision"]
        cfg.model.pad_value = background_values(plan["normalization"])
        if cfg.model.get("scheduler") is None:
            cfg.model.scheduler = poly_decay(cfg, plan["poly_power"])
    return cfg


def poly_decay(cfg: DictConfig, power: float) -> dict[str, Any]:
    """nnU-Net's polynomial learning-rate decay to 0 over the run's epochs (stepped per epoch)."""
    epochs = cfg.trainer.get("max_epochs")
    epochs = int(epochs) if epochs is not None and int(epochs) > 0 else DEFAULT_EPOCHS
    return {
        "_target_": "torch.optim.lr_scheduler.PolynomialLR", "_partial_": True, "total_iters": epochs, "power": power
    }


def with_run_plan(run: DictConfig) -> DictConfig:
    """A trained run's config with its plan applied (predict.py), as training applied it; as it is without one."""
    path = plan_path(run)
    if not path.is_file():
        return run
    plan = read_plan(path)
    return with_survival_plan(run, plan) if is_survival_plan(plan) else with_plan(run, plan)
