"""A trained run's settings as a reader sees them: the run's config recovered from its record (`run_config`, which
`medvol.run.trained_run` opens a run with), the command's `dataset=` read as the run preprocessed, the training window,
and the geometry inputs are resampled to (`input_geometry`).

The model family and its preprocessing come from the checkpoint's run (its record, `<run>/run.json` or a cascade
stage's `<run>/stage<k>/run.json`; `medvol.run.run_record`); `model.*` and `dataset.*` given to `predict.py` are
merged on top.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf, open_dict

from medvol.core.build import target_class
from medvol.core.errors import MedvolError
from medvol.run.resolvers import run_dir_of_checkpoint
from medvol.run.run_record import RECORD_FILE, legacy_record, read_record, settled

CONF_DIR = Path(__file__).resolve().parents[2] / "conf"

# Where a run's config names no training size to slide a window of.
NO_WINDOW = "`roi`: the run's config names no patch or volume size; set `roi=[D,H,W]`"
# The keys of a dataset config that name the model's channels.
MODALITY_KEYS = ("image_modalities", "cond_modalities")


def reader_paths(run_dir: Path) -> dict[str, str]:
    """`paths` for a run read outside its training command: medvol's defaults resolved here (the cache and data under
    this working directory), with `output_dir` the run's folder."""
    tree = OmegaConf.create({"paths": OmegaConf.load(CONF_DIR / "paths" / "default.yaml")})
    with open_dict(tree):
        tree.paths.output_dir = str(run_dir)
    paths = OmegaConf.to_container(tree.paths, resolve=True)
    assert isinstance(paths, dict)
    return {str(k): str(v) for k, v in paths.items()}


def run_config(ckpt_path: str, named: tuple[str, ...] = ()) -> DictConfig:
    """The settings of the run a checkpoint belongs to: medvol's config composed from its record's choices with the
    record's values set on it (`medvol.run.run_record`: read as data, never re-planned; an old run's config converted
    by the same path), `paths.output_dir` the folder the run (or cascade stage) wrote. `named`: the keys where this
    command names a class itself (`model`)."""
    path = Path(ckpt_path).expanduser()
    if not path.is_file():
        raise MedvolError(
            f"`ckpt_path`: no file at {path}; expected a .ckpt file of a medvol run, e.g. <run>/checkpoints/last.ckpt"
        )
    run_dir = run_dir_of_checkpoint(str(path))
    if run_dir is None and path.name == "best.ckpt" and re.fullmatch(r"stage\d+", path.parent.name):
        run_dir = path.parent.parent
    if run_dir is None or not (run_dir / ".hydra").is_dir():
        raise MedvolError(
            f"`ckpt_path`: {path} is not in a medvol run directory (no <run>/.hydra/ next to its checkpoints/ "
            "folder); expected a checkpoint written by train.py"
        )
    # A cascade stage's checkpoint (`<run>/stage<k>/best.ckpt` or `.../stage<k>/checkpoints/`) runs with that stage's
    # settings.
    stage_dir = next(
        (p for p in (path.parent, path.parent.parent) if re.fullmatch(r"stage\d+", p.name) and p.parent == run_dir),
        None,
    )
    folder = stage_dir if stage_dir is not None else run_dir
    paths = reader_paths(folder)
    record = read_record(folder)
    source = folder / RECORD_FILE
    if record is None:
        config_file = folder / "config.yaml" if stage_dir is not None else run_dir / ".hydra" / "config.yaml"
        if not config_file.is_file():
            raise MedvolError(
                f"`ckpt_path`: {folder} holds neither a run record ({RECORD_FILE}) nor a run's config; expected a "
                "checkpoint written by train.py"
            )
        record, source = legacy_record(config_file, run_dir, paths), config_file
    return settled(record, paths, source, named=named, folder=folder)


def merged(base: DictConfig, override: Any) -> DictConfig:
    """`base` with the keys of `override` merged on top; an `override` naming another `_target_` replaces it."""
    if not override:
        return base
    if override.get("_target_") not in (None, base.get("_target_")):
        return override
    result = OmegaConf.merge(base, override)
    assert isinstance(result, DictConfig)
    return result


def command_overrides(prefix: str) -> DictConfig:
    """The `prefix...=value` overrides of this command line (inside a Hydra app; empty otherwise)."""
    if not HydraConfig.initialized():
        return OmegaConf.create({})
    dotlist = [o.lstrip("+") for o in HydraConfig.get().overrides.task if o.lstrip("+").startswith(prefix)]
    return OmegaConf.from_dotlist(dotlist)


def with_run_transforms(run_dataset: DictConfig, chosen: DictConfig) -> DictConfig:
    """A dataset chosen with `dataset=NAME`, preprocessed as the run was: the run's `transforms`, then the
    command's own `dataset.transforms.*` overrides (the group file's defaults would silently differ). It also
    reads the run's modalities (the model's channels: a T1 -> T2 model's [t2] and [t1], not the group file's),
    unless the command sets them, where it is of the run's own kind or names its modalities as the run did (BraTS's
    t1, t1ce, t2, flair: a T1 -> T2 model trained on the phantoms reads BraTS folders)."""
    own = command_overrides("dataset.").get("dataset") or {}
    same_kind = run_dataset.get("_target_") == chosen.get("_target_")
    named = getattr(target_class(str(chosen._target_)), "modality_names", None) if chosen.get("_target_") else None
    for key in MODALITY_KEYS:
        names = run_dataset.get(key)
        if names is None or key not in chosen or key in own:
            continue
        if same_kind or (named is not None and set(names) <= set(named)):
            with open_dict(chosen):
                chosen[key] = list(names)
    if run_dataset.get("transforms") is None or chosen.get("transforms") is None:
        return chosen
    transforms = OmegaConf.merge(run_dataset.transforms, own.get("transforms") or {})
    with open_dict(chosen):
        chosen.transforms = transforms
    return chosen


def window_size(cfg: DictConfig) -> list[int]:
    """The training patch or volume size of a run: the sliding window for whole volumes."""
    size = own_window(cfg)
    if size is None:
        raise MedvolError(NO_WINDOW)
    return size


def own_window(cfg: DictConfig) -> list[int] | None:
    """The training patch or volume size of a run, or None where its config names none."""
    dataset, model = cfg.dataset, cfg.model
    transforms = dataset.get("transforms") or {}
    for size in (
        model.get("patch_size"),
        transforms.get("random_crop"),
        dataset.get("patch_size"),
        transforms.get("spatial_size"),
    ):
        if size:
            return [int(s) for s in size]
    if dataset.get("size"):
        return [int(dataset.size)] * 3
    return None


def input_geometry(spacing: Any, record: Mapping[str, Any] | None, refines: bool = False) -> dict[str, Any]:
    """The `dataset.transforms` geometry inputs are resampled to: the spacing (and orientation) the model was
    trained at, as its checkpoint records it, or `spacing=[...]`; `spacing=native` keeps each input's own, as
    does a model trained on each subject's own grid (`resampled` false), unless it `refines` the resolution."""
    record = record or {}
    geometry = {"orientation": record["orientation"]} if "orientation" in record else {}
    if spacing is None:
        kept = record.get("resampled") is False and not refines
        return {**geometry, "spacing": record["spacing"]} if record.get("spacing") and not kept else geometry
    if spacing == "native":
        return {**geometry, "spacing": None}
    values = (
        [spacing] * 3 if isinstance(spacing, (int, float)) else list(spacing) if OmegaConf.is_list(spacing) else None
    )
    if values is None or len(values) != 3 or not all(isinstance(v, (int, float)) and v > 0 for v in values):
        raise MedvolError(
            f"`spacing` is {spacing}; expected null (the model's training spacing), native, a voxel size in mm or three"
        )
    return {**geometry, "spacing": [float(v) for v in values]}


def with_geometry(run: DictConfig, geometry: Mapping[str, Any]) -> DictConfig:
    """The run's config with its dataset's transforms resampling to `geometry` (datasets without transforms,
    such as the synthetic phantoms, are generated on their own grid)."""
    if not geometry or run.dataset.get("transforms") is None:
        return run
    run = run.copy()
    with open_dict(run):
        run.dataset.transforms = OmegaConf.merge(run.dataset.transforms, dict(geometry))
    return run
