"""`predict(cfg)`: a trained model's outputs for unseen whole volumes, written like `test=true` writes them.

The model family and its preprocessing come from the checkpoint's run (`<run>/.hydra/config.yaml`);
`model.*` and `dataset.*` given to `predict.py` are merged on top. Inputs are NIfTI files (one file
per subject, its channels the model's), or a dataset: the run's own with `split=test`, or another
chosen with `dataset=...`. Every subject goes through the family's `predict_volumes` (sliding
windows of the training size where the forward is volume-to-volume) and `PredictionWriter`, the
code that writes `test=true` outputs: the source grid and units, the source header.
"""

from __future__ import annotations

import csv
import math
import tempfile
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import torch
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf, open_dict
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from torch.utils.data import Dataset, default_collate

from lightning_modules.base import MedvolModule
from medvol.core.build import build
from medvol.core.errors import MedvolError
from medvol.run.checkpoint_check import check_checkpoint
from medvol.run.resolvers import run_dir_of_checkpoint
from medvol.volumes.prediction_writer import PredictionWriter
from medvol.volumes.sliding_window import BLEND_MODES, SlidingWindow

NIFTI_SUFFIXES = (".nii", ".nii.gz")
SPLITS = ("train", "val", "test")
DEFAULT_OVERLAP = 0.25
# The dataset class that reads input files given by path; the run's own transforms preprocess them.
FILE_DATASET = "datamodules.sources.nifti.NiftiDataModule"
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
    if run_dir is None or not (run_dir / ".hydra" / "config.yaml").is_file():
        raise MedvolError(
            f"`ckpt_path`: {path} is not in a medvol run directory (no <run>/.hydra/config.yaml next to its "
            "checkpoints/ folder); expected a checkpoint written by train.py"
        )
    cfg = OmegaConf.load(run_dir / ".hydra" / "config.yaml")
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
    command's own `dataset.transforms.*` overrides (the group file's defaults would silently differ)."""
    if run_dataset.get("transforms") is None or chosen.get("transforms") is None:
        return chosen
    own = command_overrides("dataset.transforms.")
    transforms = OmegaConf.merge(run_dataset.transforms, own.dataset.transforms if own else {})
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


def file_dataset(files: list[Path], run: DictConfig, override: Any, listing: Path) -> tuple[Dataset, DictConfig]:
    """A dataset over input files (one subject each), preprocessed with the run's transforms on whole volumes."""
    with listing.open("w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(["subject", "image"])
        writer.writerows([subject_of(f), str(f.resolve())] for f in files)
    own = run.dataset.get("transforms")
    transforms = OmegaConf.to_container(own, resolve=True) if own is not None else {}
    assert isinstance(transforms, dict)
    config = OmegaConf.create({
        "_target_": FILE_DATASET, "list_file": str(listing), "image_modalities": ["image"],
        "transforms": {**transforms, **WHOLE_VOLUME}, "num_workers": 0, "split_file": None,
    })
    config = merged(config, override)
    datamodule = build(config)
    return datamodule.build_dataset(datamodule.subjects(), "test"), config


def dataset_subjects(run: DictConfig, override: Any, split: str | None, keep_crop: bool) -> tuple[Dataset, DictConfig]:
    """Subjects of the run's dataset (or of the `dataset` given): one split as the run's split.json assigns
    them, or with `split` null every subject."""
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
    if hasattr(datamodule, "preflight"):
        datamodule.preflight()
    if split is None:
        return datamodule.build_dataset(datamodule.subjects(), "test"), resolved
    datamodule.setup("test")
    if split not in datamodule.datasets:
        raise MedvolError(f"`split`: the dataset has no {split!r} split; expected one of {sorted(datamodule.datasets)}")
    return datamodule.datasets[split], resolved


def load_module(run: DictConfig, ckpt_path: str, device: torch.device) -> MedvolModule:
    """The run's model with the checkpoint's weights, in eval mode on `device`."""
    module: MedvolModule = build(run.model)
    check_checkpoint(ckpt_path, module)
    checkpoint = torch.load(Path(ckpt_path).expanduser(), map_location="cpu", weights_only=False)
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
    expected_channels = len(run.dataset.image_modalities) if run.dataset.get("image_modalities") is not None else None
    if cfg.mode not in BLEND_MODES:
        raise MedvolError(f"`mode` is {cfg.mode!r}; expected one of {list(BLEND_MODES)}")
    # The model's own validation overlap where it has one (segmentation), so predict.py sees what test=true saw.
    overlap = float(cfg.overlap if cfg.overlap is not None else run.model.get("overlap", DEFAULT_OVERLAP))
    if not 0.0 <= overlap < 1.0:
        raise MedvolError(f"`overlap` must be in [0, 1), got {overlap}")
    if cfg.split is not None and cfg.split not in SPLITS:
        raise MedvolError(f"`split` is {cfg.split!r}; expected one of {list(SPLITS)} or null")
    override = cfg.get("dataset")
    if override is not None and override.get("_target_"):
        override = with_run_transforms(run.dataset, override)
    if cfg.input is None and cfg.split is None and not override:
        raise MedvolError(
            "`input` is not set; expected a NIfTI file, a folder of them, `split=test` for the run's test split, "
            "or a dataset (`dataset=nifti dataset.root=DIR`)"
        )

    output_dir = Path(str(cfg.output_dir)).expanduser()
    device = pick_device(str(cfg.device))
    module = load_module(run, str(cfg.ckpt_path), device)
    inputs: list[Path] = []
    with tempfile.TemporaryDirectory() as scratch:
        if cfg.input is not None:
            source = Path(str(cfg.input)).expanduser()
            if source.is_dir():
                check_output_dir(output_dir, [source])
            # A file's outputs may go next to it (`<subject>_<name>.nii.gz`); the writer refuses to replace an input.
            inputs = input_files(source)
            dataset, _ = file_dataset(inputs, run, override, Path(scratch) / "inputs.csv")
        else:
            split = str(cfg.split) if cfg.split is not None else None
            dataset, resolved = dataset_subjects(run, override, split, bool(cfg.keep_crop))
            check_output_dir(output_dir, [Path(str(resolved.root))] if resolved.get("root") else [])
        roi = list(cfg.roi) if cfg.roi is not None else window_size(run)
        if len(roi) != 3 or min(int(r) for r in roi) < 1:
            raise MedvolError(f"`roi` is {roi}; expected three positive window sizes [D, H, W] or null")
        window = SlidingWindow.of(
            roi, overlap=overlap, mode=str(cfg.mode),
            batch_size=int(cfg.sw_batch_size), device=device,
        )
        writer = PredictionWriter(output_dir, protected=inputs)
        extras = ["codes"] if cfg.codes else []
        count = 0
        with Progress(
            TextColumn("[bold]predict"), BarColumn(), MofNCompleteColumn(), TextColumn("{task.description}"),
            TimeElapsedColumn(), transient=True,
        ) as progress:
            task = progress.add_task("", total=len(dataset))  # type: ignore[arg-type]
            for batch in batches(dataset):
                check_channels(batch, expected_channels)
                progress.update(task, description=str(batch["subject"][0]))
                with torch.no_grad():
                    outputs = module.predict_volumes(batch, window, extras)
                writer.write(outputs, batch)
                count += 1
                progress.advance(task)
    writer.write_metrics()
    writer.write_predictions()
    print(summary_line(writer.rows, count, output_dir))
    return mean_metrics(writer.rows)


def check_channels(batch: Mapping[str, Any], expected: int | None) -> None:
    """Refuse an input whose channel count is not the one the model was trained with."""
    got = int(batch["image"].shape[1])
    if expected is not None and got != expected:
        raise MedvolError(
            f"`input`: subject {batch['subject'][0]} has {got} channel{'s' if got != 1 else ''}, but the model was trained "
            f"on {expected} (`dataset.image_modalities` of its run); give {expected}-channel volumes"
        )


def mean_metrics(rows: list[dict[str, Any]]) -> dict[str, float]:
    """Per metric, the mean over the subjects where it is finite (HD95 is NaN for an empty mask)."""
    names = dict.fromkeys(key for row in rows for key in row if key != "subject")
    means = {}
    for name in names:
        values = [row[name] for row in rows if name in row and math.isfinite(row[name])]
        if values:
            means[name] = sum(values) / len(values)
    return means
