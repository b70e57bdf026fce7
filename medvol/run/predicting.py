"""`predict(cfg)`: a trained model's outputs for unseen whole volumes, written like `test=true` writes them.

The model family and its preprocessing come from the checkpoint's run (`<run>/.hydra/config.yaml`);
`model.*` and `dataset.*` given to `predict.py` are merged on top. Inputs are NIfTI files (one file
per subject, its channels the model's), or a dataset: the run's own with `split=test`, or another
chosen with `dataset=...`. A model that generates from radiographs (X-ray-to-CT) takes a folder
of `<subject>_<view>.nii.gz` radiographs as `input` instead (`medvol.run.radiographs`). Every other subject goes through the family's `predict_volumes` (sliding
windows of the training size where the forward is volume-to-volume) and `PredictionWriter`, the
code that writes `test=true` outputs: the source grid and units, the source header.
"""

from __future__ import annotations

import csv
import math
import re
import tempfile
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf, open_dict
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from torch.utils.data import Dataset, default_collate

from lightning_modules.base import MedvolModule, class_path
from medvol.core.build import build, target_class
from medvol.core.errors import MedvolError
from medvol.run.checkpoint_check import check_checkpoint_family, check_checkpoint_shapes
from medvol.run.generation import (
    check_condition_files,
    check_input_channels,
    check_refinable,
    intensity_record,
    lacks_targets,
    modality_field,
    on_model_grid,
    sampled_outputs,
    with_target_units,
    without_targets,
)
from medvol.run.noise_samples import write_noise_samples
from medvol.run.radiographs import ct_from_radiographs
from medvol.run.resolvers import run_dir_of_checkpoint
from medvol.volumes.prediction_writer import PredictionWriter
from medvol.volumes.sliding_window import BLEND_MODES, SlidingWindow

NIFTI_SUFFIXES = (".nii", ".nii.gz")
SPLITS = ("train", "val", "test")
DEFAULT_OVERLAP = 0.25
# The dataset class that reads input files given by path; the run's own transforms preprocess them.
FILE_DATASET = "datamodules.sources.nifti.NiftiDataModule"
# The keys of a dataset config that name the model's channels.
MODALITY_KEYS = ("image_modalities", "cond_modalities")
# Training-only settings dropped for prediction: every voxel of a subject is predicted.
WHOLE_VOLUME = {"spatial_size": None, "random_crop": None, "flip_prob": 0.0, "affine_prob": 0.0}


def is_nifti(path: Path) -> bool:
    return path.is_file() and path.name.endswith(NIFTI_SUFFIXES)


def subject_of(path: Path) -> str:
    """The subject id of an input file: its name without .nii/.nii.gz."""
    return path.name.removesuffix(".gz").removesuffix(".nii")


def run_config(ckpt_path: str) -> DictConfig:
    """The composed config of the run a checkpoint belongs to, with `paths.output_dir` pointed at that run."""
    path = Path(ckpt_path).expanduser()
    if not path.is_file():
        raise MedvolError(f"`ckpt_path`: no file at {path}; expected a .ckpt file of a medvol run, e.g. <run>/checkpoints/last.ckpt")
    run_dir = run_dir_of_checkpoint(str(path))
    if run_dir is None and path.name == "best.ckpt" and re.fullmatch(r"stage\d+", path.parent.name):
        run_dir = path.parent.parent
    if run_dir is None or not (run_dir / ".hydra" / "config.yaml").is_file():
        raise MedvolError(
            f"`ckpt_path`: {path} is not in a medvol run directory (no <run>/.hydra/config.yaml next to its "
            "checkpoints/ folder); expected a checkpoint written by train.py"
        )
    # A cascade stage's checkpoint (`<run>/stage<k>/best.ckpt` or `.../stage<k>/checkpoints/`) runs with that stage's config.
    stage_dir = next(
        (p for p in (path.parent, path.parent.parent) if re.fullmatch(r"stage\d+", p.name) and (p / "config.yaml").is_file()),
        None,
    )
    cfg = OmegaConf.load((stage_dir / "config.yaml") if stage_dir is not None else run_dir / ".hydra" / "config.yaml")
    assert isinstance(cfg, DictConfig)
    with open_dict(cfg):
        # `${hydra:runtime.output_dir}` means nothing outside that run's Hydra job: the run is where split.json is.
        cfg.paths.output_dir = str(run_dir)
    return cfg


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
    command's own `dataset.transforms.*` overrides (the group file's defaults would silently differ). A
    dataset of the run's own kind also keeps the run's modalities (the model's channels: a T1 -> T2 model's
    [t2] and [t1], not the group file's) unless the command sets them."""
    own = command_overrides("dataset.").get("dataset") or {}
    if run_dataset.get("_target_") == chosen.get("_target_"):
        for key in MODALITY_KEYS:
            if run_dataset.get(key) is not None and key in chosen and key not in own:
                with open_dict(chosen):
                    chosen[key] = run_dataset[key]
    if run_dataset.get("transforms") is None or chosen.get("transforms") is None:
        return chosen
    transforms = OmegaConf.merge(run_dataset.transforms, own.get("transforms") or {})
    with open_dict(chosen):
        chosen.transforms = transforms
    return chosen


def window_size(cfg: DictConfig) -> list[int]:
    """The training patch or volume size of a run: the sliding window for whole volumes."""
    dataset, model = cfg.dataset, cfg.model
    transforms = dataset.get("transforms") or {}
    for size in (model.get("patch_size"), transforms.get("random_crop"), dataset.get("patch_size"), transforms.get("spatial_size")):
        if size:
            return [int(s) for s in size]
    if dataset.get("size"):
        return [int(dataset.size)] * 3
    raise MedvolError("`roi`: the run's config names no patch or volume size; set `roi=[D,H,W]`")


def input_files(path: Path) -> list[Path]:
    """The NIfTI files `input` names: the file itself, or every .nii/.nii.gz directly in the folder."""
    if is_nifti(path):
        return [path]
    if path.is_dir():
        files = sorted(p for p in path.iterdir() if is_nifti(p))
        if files:
            return files
        raise MedvolError(f"`input`: {path} holds no .nii or .nii.gz files; expected a NIfTI file or a folder of them")
    raise MedvolError(f"`input`: no NIfTI file or folder at {path}; expected a .nii/.nii.gz file or a folder of them")


def check_output_dir(output_dir: Path, input_folders: list[Path]) -> None:
    """Refuse an output folder inside an input folder (`input=DIR`, a dataset's root): predictions must never
    land among (or on) the inputs. A file input is guarded file by file instead (`PredictionWriter(protected=...)`)."""
    out = output_dir.expanduser().resolve()
    for folder in input_folders:
        folder = folder.expanduser().resolve()
        if out == folder or folder in out.parents:
            raise MedvolError(
                f"`output_dir`: {output_dir} is inside the input folder {folder}; choose a folder outside it, "
                "so no input is ever overwritten"
            )


def input_geometry(spacing: Any, record: Mapping[str, Any] | None) -> dict[str, Any]:
    """The `dataset.transforms` geometry inputs are resampled to: the spacing (and orientation) the model was
    trained at, as its checkpoint records it, or `spacing=[...]`; `spacing=native` keeps each input's own."""
    record = record or {}
    geometry = {"orientation": record["orientation"]} if "orientation" in record else {}
    if spacing is None:
        return {**geometry, "spacing": record["spacing"]} if record.get("spacing") else geometry
    if spacing == "native":
        return {**geometry, "spacing": None}
    values = [spacing] * 3 if isinstance(spacing, (int, float)) else list(spacing) if OmegaConf.is_list(spacing) else None
    if values is None or len(values) != 3 or not all(isinstance(v, (int, float)) and v > 0 for v in values):
        raise MedvolError(f"`spacing` is {spacing}; expected null (the model's training spacing), native, a voxel size in mm or three")
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


@dataclass
class Inputs:
    """The subjects to predict: their dataset, its config, their records (files per batch key) and whether
    they are condition-only (a generative model's inputs without its target)."""

    dataset: Dataset
    config: DictConfig
    records: list[dict[str, Any]]
    condition_only: bool = False


def file_dataset(
    files: list[Path], run: DictConfig, override: Any, listing: Path, geometry: Mapping[str, Any], key: str = "image"
) -> Inputs:
    """A dataset over input files (one subject each), preprocessed with the run's transforms on whole volumes,
    resampled to `geometry`; the files are the `image` of each subject, or a generative model's `cond`."""
    with listing.open("w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(["subject", key])
        writer.writerows([subject_of(f), str(f.resolve())] for f in files)
    own = run.dataset.get("transforms")
    transforms = OmegaConf.to_container(own, resolve=True) if own is not None else {}
    assert isinstance(transforms, dict)
    config = OmegaConf.create({
        "_target_": FILE_DATASET, "list_file": str(listing), "image_modalities": [key] if key == "image" else [],
        "cond_modalities": [key] if key == "cond" else [],
        "transforms": {**transforms, **geometry, **WHOLE_VOLUME}, "num_workers": 0, "split_file": None,
    })
    config = merged(config, override)
    datamodule = build(config)
    records = datamodule.subjects()
    return Inputs(datamodule.build_dataset(records, "test"), config, records, condition_only=key != "image")


def dataset_subjects(
    run: DictConfig, override: Any, split: str | None, keep_crop: bool, generation: Mapping[str, int]
) -> Inputs:
    """Subjects of the run's dataset (or of the `dataset` given): one split as the run's split.json assigns
    them, or with `split` null every subject. For a generative model (`generation` names its condition
    keys), subjects without the target files are predicted from their conditions alone."""
    config = merged(run.dataset, override)
    with open_dict(config):
        config.cache = "none"
        config.num_workers = 0
        if split is None:
            config.split_file = None
        if not keep_crop and config.get("transforms") is not None:
            config.transforms = {**OmegaConf.to_container(config.transforms, resolve=True), **WHOLE_VOLUME}
    # In the run's config, so `${paths.output_dir}` and `${seed}` resolve against the run.
    whole = run.copy()
    with open_dict(whole):
        whole.dataset = config
    resolved = whole.dataset
    datamodule = build(resolved)
    listed = datamodule.subjects()
    # No subject listed at all may mean a folder of condition files only: the check below says which are missing.
    condition_only = bool(generation) and (not listed or lacks_targets(listed))
    if condition_only:
        # Every subject listed with its target files or its conditions needs all its condition files.
        check_condition_files(listed, resolved, generation)
        resolved = without_targets(resolved, generation)
        datamodule = build(resolved)
    if hasattr(datamodule, "preflight"):
        datamodule.preflight()
    if split is None:
        records = datamodule.subjects()
        return Inputs(datamodule.build_dataset(records, "test"), resolved, records, condition_only)
    datamodule.setup("test")
    if split not in datamodule.datasets:
        raise MedvolError(f"`split`: the dataset has no {split!r} split; expected one of {sorted(datamodule.datasets)}")
    by_id = {str(r["subject"]): r for r in datamodule.subjects()}
    records = [by_id[s] for s in datamodule.split[split]]
    return Inputs(datamodule.datasets[split], resolved, records, condition_only)


def load_module(run: DictConfig, ckpt_path: str, device: torch.device) -> MedvolModule:
    """The run's model with the checkpoint's weights, in eval mode on `device`; what the family restores from the
    checkpoint itself (`MedvolModule.restoring_settings`: e.g. X-ray-to-CT's earlier stages) over the run's config."""
    checkpoint = check_checkpoint_family(ckpt_path, run.model._target_)
    assert checkpoint is not None
    family = target_class(run.model._target_)
    module: MedvolModule = build(run.model, **family.restoring_settings(dict(checkpoint.get("hyper_parameters") or {})))
    check_checkpoint_shapes(ckpt_path, module, checkpoint)
    module.on_load_checkpoint(checkpoint)
    module.load_state_dict(checkpoint["state_dict"])
    return module.to(device).eval()


def pick_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise MedvolError(f"`device`: {name!r} was asked for, but no CUDA device is visible; use device=cpu or auto")
    if not (name == "cpu" or name.startswith("cuda")):
        raise MedvolError(f"`device` is {name!r}; expected auto, cpu, cuda or cuda:N")
    return torch.device(name)


def batches(dataset: Dataset) -> Iterator[dict[str, Any]]:
    """One subject per batch, collated as the test loader would."""
    for index in range(len(dataset)):  # type: ignore[arg-type]
        yield default_collate([dataset[index]])


def summary_line(rows: list[dict[str, Any]], count: int, output_dir: Path) -> str:
    """`predicted N subjects -> DIR` and the mean of every per-subject metric."""
    means = [f"{name} {value:.4g}" for name, value in mean_metrics(rows).items()]
    metrics = f"; mean {', '.join(means)}" if means else ""
    return f"predicted {count} subject{'s' if count != 1 else ''} -> {output_dir}{metrics}"


def predict(cfg: DictConfig) -> dict[str, float]:
    """Predict every subject the config names and write the outputs; return the mean per-subject metrics."""
    run = run_config(str(cfg.ckpt_path))
    run = merged(run, {"model": cfg.get("model") or {}})
    # The model's channel counts interpolate the run's dataset: resolve them before a dataset override.
    with open_dict(run):
        run.model = OmegaConf.create(OmegaConf.to_container(run.model, resolve=True))
    image_channels = len(run.dataset.image_modalities) if run.dataset.get("image_modalities") is not None else None
    if cfg.mode not in BLEND_MODES:
        raise MedvolError(f"`mode` is {cfg.mode!r}; expected one of {list(BLEND_MODES)}")
    # The model's own validation overlap where it has one (segmentation), so predict.py sees what test=true saw.
    overlap = float(cfg.overlap if cfg.overlap is not None else run.model.get("overlap", DEFAULT_OVERLAP))
    if not 0.0 <= overlap < 1.0:
        raise MedvolError(f"`overlap` must be in [0, 1), got {overlap}")
    if cfg.split is not None and cfg.split not in SPLITS:
        raise MedvolError(f"`split` is {cfg.split!r}; expected one of {list(SPLITS)} or null")
    num_samples = cfg.get("num_samples", 1)
    if not isinstance(num_samples, int) or isinstance(num_samples, bool) or num_samples < 1:
        raise MedvolError(f"`num_samples` is {num_samples!r}; expected a whole number >= 1")
    from_noise = cfg.input is None and cfg.split is None and not cfg.get("dataset")
    if from_noise and not target_class(run.model._target_).generates_from_noise(run.model):
        raise MedvolError(
            "`input` is not set; expected a NIfTI file, a folder of them, `split=test` for the run's test split, "
            "or a dataset (`dataset=nifti dataset.root=DIR`)"
        )

    output_dir = Path(str(cfg.output_dir)).expanduser()
    device = pick_device(str(cfg.device))
    module = load_module(run, str(cfg.ckpt_path), device)
    protected: list[Path] = []
    generation = module.generation_inputs()
    if from_noise:
        # An unconditional generator with no input: `num_samples` volumes from noise alone.
        count = write_noise_samples(module, input_geometry(cfg.get("spacing"), module.training_data), num_samples, output_dir)
        print(f"generated {count} sample{'s' if count != 1 else ''} -> {output_dir}")
        return {}
    if num_samples > 1 and not generation:
        raise MedvolError(
            f"`num_samples`={num_samples}: {class_path(module)} is not generative (its outputs are not samples); "
            "use num_samples=1"
        )
    if cfg.input is not None and "xray" in generation:
        source = Path(str(cfg.input)).expanduser()
        if not source.is_dir():
            raise MedvolError(
                f"`input`: {source} is not a folder; the model generates a CT from radiographs, expected a folder of "
                "<subject>_ap.nii.gz and <subject>_lateral.nii.gz files"
            )
        if num_samples > 1:
            raise MedvolError(f"`num_samples`={num_samples}: a CT from radiographs is written once per subject; use num_samples=1")
        check_output_dir(output_dir, [source])
        count = ct_from_radiographs(module, run, source, output_dir, device)
        print(summary_line([], count, output_dir))
        return {}
    geometry = input_geometry(cfg.get("spacing"), module.training_data)
    run = with_geometry(run, geometry)
    override = cfg.get("dataset")
    if override is not None and override.get("_target_"):
        override = with_run_transforms(run.dataset, override)
    with tempfile.TemporaryDirectory() as scratch:
        if cfg.input is not None:
            where = "input"
            source = Path(str(cfg.input)).expanduser()
            if source.is_dir():
                check_output_dir(output_dir, [source])
            # A file's outputs may go next to it (`<subject>_<name>.nii.gz`); the writer refuses to replace an input.
            protected = input_files(source)
            # A generative model's input files are its condition (a T1 for a T1 -> T2 model).
            key = next(iter(generation)) if generation else "image"
            if generation:
                modality_field(key)
            inputs = file_dataset(protected, run, override, Path(scratch) / "inputs.csv", geometry, key)
        else:
            where = "dataset.root"
            split = str(cfg.split) if cfg.split is not None else None
            inputs = dataset_subjects(run, override, split, bool(cfg.keep_crop), generation)
            check_output_dir(output_dir, [Path(str(inputs.config.root))] if inputs.config.get("root") else [])
        # Every input's header is checked before the first file is written.
        expected = {**({"image": image_channels} if image_channels and not inputs.condition_only else {}), **generation}
        check_input_channels(inputs.records, expected, where)
        refine = inputs.condition_only and module.refines_resolution
        if refine:
            for key in generation:
                check_refinable(inputs.records, key, geometry, where)
        target_units = intensity_record(module) if inputs.condition_only else None
        roi = list(cfg.roi) if cfg.roi is not None else window_size(run)
        if len(roi) != 3 or min(int(r) for r in roi) < 1:
            raise MedvolError(f"`roi` is {roi}; expected three positive window sizes [D, H, W] or null")
        window = SlidingWindow.of(
            roi, overlap=overlap, mode=str(cfg.mode),
            batch_size=int(cfg.sw_batch_size), device=device,
        )
        writer = PredictionWriter(output_dir, protected=protected)
        extras = ["codes"] if cfg.codes else []
        count = 0
        with Progress(
            TextColumn("[bold]predict"), BarColumn(), MofNCompleteColumn(), TextColumn("{task.description}"),
            TimeElapsedColumn(), transient=True,
        ) as progress:
            task = progress.add_task("", total=len(inputs.dataset))  # type: ignore[arg-type]
            for batch in batches(inputs.dataset):
                progress.update(task, description=str(batch["subject"][0]))
                with torch.no_grad():
                    if inputs.condition_only:
                        batch = with_target_units(batch, target_units)
                        outputs = sampled_outputs(module, batch, num_samples)
                    else:
                        outputs = module.predict_volumes(batch, window, extras)
                        if num_samples > 1:
                            outputs = sampled_outputs(module, batch, num_samples, first=outputs)
                writer.write(outputs, on_model_grid(batch) if refine else batch)
                count += 1
                progress.advance(task)
    writer.write_metrics()
    writer.write_predictions()
    print(summary_line(writer.rows, count, output_dir))
    return mean_metrics(writer.rows)


def mean_metrics(rows: list[dict[str, Any]]) -> dict[str, float]:
    """Per metric, the mean over the subjects where it is finite (HD95 is NaN for an empty mask)."""
    names = dict.fromkeys(key for row in rows for key in row if key != "subject")
    means = {}
    for name in names:
        values = [row[name] for row in rows if name in row and math.isfinite(row[name])]
        if values:
            means[name] = sum(values) / len(values)
    return means
