"""A segmentation run's plan (`medvol.volumes.plan`): made from the training data at a run's first start and
written to `<run>/plan.json`; a resumed run and predict.py read that file back, so all three see the same
spacing, crop, normalization, patch, network and labels, bit for bit.

The plan is applied as config values (`with_plan`): the dataset's transforms (nnU-Net's preprocessing and
augmentation), its batch size and epoch length, and the model's network, patch, labels, deep supervision,
background padding and learning-rate decay, and the trainer's gradient clipping. `model.plan.*` keys give any value
instead of deriving it; `model.plan.use=false` keeps the config as written. A model whose `num_classes` is null
takes its classes from the data: the plan's labels, or without a plan the dataset's own (`label_names`).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytorch_lightning as pl
from omegaconf import DictConfig, OmegaConf, open_dict

from lightning_modules.segmentation.segmentation import Segmenter
from medvol.core.build import target_class
from medvol.core.errors import MedvolError
from medvol.core.literal_text import literal_names
from medvol.run.survival_planning import is_survival_plan, survival_planned, with_survival_plan
from medvol.run.world import global_rank
from medvol.volumes.plan import (
    PLAN_FILE,
    background_values,
    describe,
    fitted,
    make_plan,
    network,
    read_plan,
    write_plan,
)
from medvol.volumes.survival_plan import describe_survival_plan

log = logging.getLogger("medvol")

# nnU-Net's GPU memory target (8 GB); on a CPU a budget that keeps an epoch of a small dataset to minutes. Both in
# nnU-Net's calibration of its feature-map estimate (`medvol.volumes.network_topology`).
CPU_BUDGET_MIB = 512
GPU_BUDGET_MIB = 8192
BASE_FEATURES = {"cpu": 16, "gpu": 32}
# nnU-Net clips the gradient norm at 12 every step.
GRADIENT_CLIP = 12.0
# Plan keys a user may give instead (`model.plan.<key>=...`); the others of the node steer how it is made.
GIVEN_KEYS = (
    "spacing", "patch_size", "batch_size", "features", "foreground_ratio", "deep_supervision", "poly_power",
    "crop_foreground", "iterations_per_epoch", "augmentation", "batch_dice",
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
    """The plan values the config gives: `model.plan.<key>`, `model.num_classes`, and a `dataset.transforms.spacing`
    set by hand."""
    node = OmegaConf.to_container(cfg.model.plan, resolve=True)
    assert isinstance(node, dict)
    given = {key: node.get(key) for key in GIVEN_KEYS if node.get(key) is not None}
    spacing = (cfg.dataset.get("transforms") or {}).get("spacing")
    if spacing is not None and "spacing" not in given:
        given["spacing"] = [float(s) for s in spacing]
    if cfg.model.get("num_classes") is not None:
        given["num_classes"] = int(cfg.model.num_classes)
    return given


def memory_budget(cfg: DictConfig, accelerator: str) -> float:
    """MiB one step may take (nnU-Net's calibration): `model.plan.memory_budget_mib`, else the device's default."""
    mib = cfg.model.plan.get("memory_budget_mib")
    if mib is not None:
        if float(mib) <= 0:
            raise MedvolError(f"`model.plan.memory_budget_mib` is {mib}; expected a positive number of MiB or null")
        return float(mib)
    return float(GPU_BUDGET_MIB if accelerator == "gpu" else CPU_BUDGET_MIB)


def model_regions(cfg: DictConfig, datamodule: pl.LightningDataModule) -> dict[str, list[int]] | None:
    """The regions the model predicts: `model.regions`, else the dataset's own (an nnU-Net dataset.json's)."""
    regions = cfg.model.get("regions")
    if regions is not None:
        return {str(k): [int(v) for v in values] for k, values in regions.items()}
    own = getattr(datamodule, "label_regions_of_data", None)
    return own() if callable(own) else None


def data_ignore_label(cfg: DictConfig, datamodule: pl.LightningDataModule) -> int | None:
    """The label value of voxels without truth: `model.ignore_label`, else the dataset's (nnU-Net's `ignore`)."""
    given = cfg.model.get("ignore_label")
    if given is not None:
        return int(given)
    own = getattr(datamodule, "ignore_label_of_data", None)
    return own() if callable(own) else None


def planned(
    cfg: DictConfig, datamodule: pl.LightningDataModule, accelerator: str, recorded: bool = False, write: bool = True
) -> tuple[DictConfig, list[str]]:
    """`cfg` with the run's plan applied, and the plan's lines to print; without a plan `cfg` with the dataset's
    classes where `model.num_classes` is null.

    The plan of `<run>/plan.json` where the run has one (a resume), else one made from the training
    subjects and written there by rank 0 (not with `write=false`: a named card's preflight). A config that is the
    run's record (`recorded`: a resume) holds the plan already: it is described, not applied again.
    """
    if not wants_plan(cfg):
        return (cfg if recorded else with_data_classes(cfg, datamodule)), []
    path = plan_path(cfg)
    survival = cfg.model.plan.get("family") == "survival"
    if recorded:
        if not path.is_file():
            return cfg, []
        plan = read_plan(path)
        shown = describe_survival_plan(plan) if survival else describe(plan)
        return cfg, [*shown, f"plan: as recorded in {path} (the run's record holds it, applied)"]
    if survival:
        return survival_planned(cfg, datamodule, path, accelerator)
    if path.is_file():
        plan = read_plan(path)
        return with_plan(cfg, plan), [*describe(plan), f"plan: read from {path}"]
    if not hasattr(datamodule, "plan_fingerprint"):
        raise MedvolError(
            f"`model.plan.use=true`: the dataset {cfg.dataset._target_} has no files to plan from; expected a file "
            "dataset (dataset=nifti, brats, nnunet) or model.plan.use=false"
        )
    device = "gpu" if accelerator == "gpu" else "cpu"
    base = int(cfg.model.plan.get("base_features") or BASE_FEATURES[device])
    regions = model_regions(cfg, datamodule)
    names = getattr(datamodule, "label_names", None)
    listed = names() if callable(names) and not regions else None
    class_names = None if listed is None else literal_names(listed, "the dataset's label names")
    plan = make_plan(
        datamodule.plan_fingerprint(), memory_budget(cfg, accelerator), base, given_values(cfg),
        getattr(datamodule, "modality_kind", None), regions,
        declared_classes=len(class_names) + 1 if class_names else None, ignore_label=data_ignore_label(cfg, datamodule),
    )
    plan["regions"] = regions if cfg.model.get("regions") is None else None
    plan["class_names"] = class_names
    # How many files a subject's channels came in, so predict.py groups its input files alike.
    plan["channel_files"] = len(getattr(datamodule, "image_modalities", []) or []) or 1
    if not write:
        return with_plan(cfg, plan), [*describe(plan), "plan: made from the data, not written (a card's preflight)"]
    if global_rank() == 0:
        write_plan(plan, path)
    return with_plan(cfg, plan), [*describe(plan), f"plan: written to {path}"]


def plan_before_data(cfg: DictConfig, accelerator: str, recorded: bool = False) -> DictConfig | None:
    """`cfg` with the network the run will train, where that is known before any data is read: a resume's record
    (`recorded`: it holds its plan and classes), the run folder's plan.json, or a plan the config gives whole
    (`with_config_plan`); None where the plan or a segmenter's classes come from the data."""
    if recorded:
        return cfg
    if not wants_plan(cfg):
        return cfg if classes_known(cfg) else None
    if cfg.model.plan.get("family") == "survival":
        # An outcome model's plan sets its crop and network depth; no step of its family is predicted.
        return cfg
    path = plan_path(cfg)
    if path.is_file():
        return with_plan(cfg, read_plan(path))
    return with_config_plan(cfg, accelerator)


def classes_known(cfg: DictConfig) -> bool:
    """Whether the model's outputs are set by the config: not a segmenter, or its classes or regions given."""
    model = cfg.model
    if not issubclass(target_class(model._target_), Segmenter):
        return True
    return model.get("num_classes") is not None or model.get("regions") is not None


def with_config_plan(cfg: DictConfig, accelerator: str) -> DictConfig | None:
    """`cfg` with the plan's network where the config gives what the data would otherwise decide: the spacing (its
    ratios set the strides and kernels), the patch, the batch (else capped by the dataset's voxels) and the classes
    or regions; None otherwise. The same search as `make_plan`'s (`fitted`, `network`), refused alike where the given
    patch and batch exceed the budget."""
    given = given_values(cfg)
    if not {"spacing", "patch_size", "batch_size"} <= set(given) or not classes_known(cfg):
        return None
    regions = cfg.model.get("regions")
    outputs = len(regions) + 1 if regions else int(given["num_classes"])
    base = int(cfg.model.plan.get("base_features") or BASE_FEATURES["gpu" if accelerator == "gpu" else "cpu"])
    fit = fitted(given["spacing"], given["patch_size"], memory_budget(cfg, accelerator), base, outputs, 0.0, given)
    cfg = cfg.copy()
    with open_dict(cfg):
        with_network(cfg, network(fit, given))
    return cfg


def with_network(cfg: DictConfig, layout: dict[str, Any]) -> None:
    """Set a plan's network (`medvol.volumes.plan.network`) on `cfg` (open for new keys): nnU-Net's DynUNet, its
    patch and its batch."""
    cfg.dataset.batch_size = layout["batch_size"]
    cfg.model.net = "dynunet"
    cfg.model.res_block = False
    cfg.model.transposed_bias = True
    cfg.model.features = layout["features"]
    cfg.model.strides = layout["strides"]
    cfg.model.kernels = layout["kernels"]
    cfg.model.patch_size = list(layout["patch_size"])
    cfg.model.patch_sampling = "random"
    cfg.model.deep_supervision = layout["deep_supervision"]


def with_data_classes(cfg: DictConfig, datamodule: pl.LightningDataModule) -> DictConfig:
    """A segmentation config whose `model.num_classes` is null and has no regions, with the dataset's classes."""
    model = cfg.model
    if not issubclass(target_class(model._target_), Segmenter):
        return cfg
    ignore = data_ignore_label(cfg, datamodule)
    if ignore is not None and model.get("ignore_label") is None:
        cfg = cfg.copy()
        with open_dict(cfg):
            cfg.model.ignore_label = ignore
        model = cfg.model
    if model.get("num_classes") is not None or model.get("regions") is not None:
        return cfg
    names = getattr(datamodule, "label_names", None)
    if not callable(names) or names() is None:
        raise MedvolError(
            f"`model.num_classes` is null and {cfg.dataset._target_} does not say its classes; set "
            "model.num_classes (background included) or plan from the data (model.plan.use=true)"
        )
    cfg = cfg.copy()
    with open_dict(cfg):
        cfg.model.num_classes = len(names()) + 1
        if cfg.model.get("class_names") is None:
            cfg.model.class_names = literal_names(names(), "the dataset's label names")
    return cfg


def with_plan(cfg: DictConfig, plan: dict[str, Any]) -> DictConfig:
    """`cfg` with `plan`'s values in the dataset's transforms, batch and epoch, in the model and the trainer."""
    cfg = cfg.copy()
    patch = list(plan["patch_size"])
    regions = cfg.model.get("regions")
    if OmegaConf.is_config(regions):
        regions = OmegaConf.to_container(regions, resolve=True)
    regions = regions if regions is not None else plan.get("regions")
    classes = plan.get("num_classes")
    foreground = (
        [list(v) for v in regions.values()] if regions else [[k] for k in range(1, int(classes or 2))]
    )
    augment = plan["augmentation"]
    with open_dict(cfg):
        own = OmegaConf.to_container(cfg.dataset.transforms, resolve=True)
        assert isinstance(own, dict)
        cfg.dataset.transforms = {**own, **{
            "spacing": plan["spacing"], "intensity": "zscore", "normalization": plan["normalization"],
            "resampling": plan.get("resampling", "nnunet"), "crop_foreground": plan["crop_foreground"],
            "spatial_size": None, "random_crop": None, "pad_to": None, "foreground_crop": None,
            "foreground_ratio": plan["foreground_ratio"], "flip_prob": 0.0, "affine_prob": 0.0,
            "augmentation": {
                "patch": patch, "initial_patch": augment["initial_patch"], "rotation": augment["rotation"],
                "in_plane": augment["in_plane"], "axis": augment["axis"], "classes": foreground,
                "enabled": augment.get("enabled", True),
            },
        }}
        with_network(cfg, plan)
        cfg.dataset.iterations_per_epoch = plan["iterations_per_epoch"]
        cfg.dataset.oversample_foreground = plan["foreground_ratio"]
        # Volumes cropped to their own non-zero region differ in shape: evaluated one at a time.
        cfg.dataset.val_batch_size = 1
        # Left to its interpolation without the plan's count: a run's reader applies the plan before the record's
        # dataset values are set, when `in_channels` cannot resolve yet.
        if "channels" in plan:
            cfg.model.in_channels = plan["channels"]
        cfg.model.batch_dice = bool(plan.get("batch_dice", False))
        if cfg.model.get("ignore_label") is None and plan.get("ignore_label") is not None:
            cfg.model.ignore_label = int(plan["ignore_label"])
        cfg.model.pad_value = background_values(plan["normalization"])
        if cfg.model.get("regions") is None and plan.get("regions"):
            cfg.model.regions = plan["regions"]
        if not regions and classes:
            if cfg.model.get("num_classes") is None:
                cfg.model.num_classes = int(classes)
            # The dataset's names (BraTS's NCR, ED, ET; dataset.json's) whenever they name these classes, also where
            # `model.num_classes` was given.
            names, planned_names = cfg.model.get("class_names"), plan.get("class_names")
            count = int(cfg.model.num_classes) - 1
            if names is None or len(names) != count:
                cfg.model.class_names = (
                    list(planned_names) if planned_names and len(planned_names) == count
                    else [f"class{k}" for k in range(1, count + 1)]
                )
        if cfg.model.get("scheduler") is None:
            cfg.model.scheduler = poly_decay(cfg, plan["poly_power"])
        if cfg.trainer.get("gradient_clip_val") is None:
            cfg.trainer.gradient_clip_val = GRADIENT_CLIP
    return cfg


def poly_decay(cfg: DictConfig, power: float) -> dict[str, Any]:
    """nnU-Net's polynomial learning-rate decay to 0 over the run's epochs (stepped per epoch)."""
    epochs = cfg.trainer.get("max_epochs")
    epochs = int(epochs) if epochs is not None and int(epochs) > 0 else DEFAULT_EPOCHS
    return {
        "_target_": "torch.optim.lr_scheduler.PolynomialLR", "_partial_": True, "total_iters": epochs, "power": power
    }


def with_run_plan(run: DictConfig, run_dir: Path) -> DictConfig:
    """An old run's config (one written before run records) with the plan of `run_dir` applied, as training applied
    it; as it is without one (`medvol.run.run_record.legacy_record`)."""
    path = run_dir / PLAN_FILE
    if not path.is_file():
        return run
    plan = read_plan(path)
    return with_survival_plan(run, plan) if is_survival_plan(plan) else with_plan(run, plan)
