"""predict.py's inputs found (files, a folder, a dataset's split) and their outputs guarded.

Inputs are NIfTI files (one file per subject, its channels the model's), BraTS case folders, or a dataset: the
run's own with `split=test`, or another chosen with `dataset=...`. They are preprocessed with the run's
transforms on whole volumes. Outputs never land inside an input folder, and a file input's never on
the file itself (`PredictionWriter(protected=...)`).
"""

from __future__ import annotations

import csv
import logging
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from omegaconf import DictConfig, OmegaConf, open_dict
from torch.utils.data import Dataset, default_collate

from datamodules.sources.brats import BratsDataModule, case_folders
from datamodules.sources.nnunet_raw import NnunetDataModule
from lightning_modules.base import MedvolModule
from medvol.core.build import build, target_class
from medvol.core.errors import MedvolError, refusal_within
from medvol.run.channel_files import CHANNEL_FILE, channel_groups, files_per_subject
from medvol.run.generation import check_condition_files, lacks_targets, modality_field, without_targets
from medvol.run.planning import plan_path
from medvol.run.predict_config import input_geometry, merged, with_geometry, with_run_transforms
from medvol.volumes.dicom_io import series_folders, series_geometry

if TYPE_CHECKING:
    from medvol.run.predict_check import PredictRequest

log = logging.getLogger("medvol")

NIFTI_SUFFIXES = (".nii", ".nii.gz")
# The dataset class that reads input files given by path; the run's own transforms preprocess them.
FILE_DATASET = "datamodules.sources.nifti.NiftiDataModule"
# The same files with covariates per subject (a model trained on image + covariates).
COVARIATE_DATASET = "datamodules.sources.csv_table.CsvDataModule"
# Where a model with covariates finds those of `input`'s subjects when `covariates` is not given: beside them.
COVARIATE_FILE = "covariates.csv"
# What reads BraTS case folders given as `input`: the `dataset=brats` group file.
BRATS_GROUP_FILE = Path(__file__).resolve().parents[2] / "conf" / "dataset" / "brats.yaml"
# Training-only settings dropped for prediction: every voxel of a subject is predicted.
WHOLE_VOLUME = {"spatial_size": None, "random_crop": None, "flip_prob": 0.0, "affine_prob": 0.0}


def prediction_transforms(run: DictConfig, keep_crop: bool) -> dict[str, Any]:
    """`WHOLE_VOLUME`, but keeping the run's crop/pad (`spatial_size`) with `keep_crop` or for a model that reads
    volumes at the training size (`MedvolModule.fixed_input_size`: survival, classification)."""
    target = (run.get("model") or {}).get("_target_")
    keeps = keep_crop or (target is not None and bool(getattr(target_class(str(target)), "fixed_input_size", False)))
    return {k: v for k, v in WHOLE_VOLUME.items() if not (keeps and k == "spatial_size")}


def is_nifti(path: Path) -> bool:
    return path.is_file() and path.name.endswith(NIFTI_SUFFIXES)


def subject_of(path: Path) -> str:
    """The subject id of an input file: its name without .nii/.nii.gz."""
    return path.name.removesuffix(".gz").removesuffix(".nii")


def input_files(path: Path) -> list[Path]:
    """The inputs `input` names: the NIfTI file itself, every .nii/.nii.gz directly in the folder, or DICOM
    series folders (the folder itself, or its subfolders: one subject each, named by its folder)."""
    if is_nifti(path):
        return [path]
    if path.is_dir():
        entries = list(path.iterdir())
        files = sorted(p for p in entries if is_nifti(p))
        if files:
            # A folder of scans often holds other files (reports, thumbnails, exports): counted, never opened.
            others = sum(1 for p in entries if p.is_file() and not is_nifti(p))
            if others:
                log.info("input: %s: %d file(s) that are not .nii/.nii.gz skipped", path, others)
            return files
        files = series_folders(path)
        if files:
            return files
        raise MedvolError(
            f"`input`: {path} holds no .nii or .nii.gz files and no DICOM series; expected a NIfTI file, a folder "
            "of them, a DICOM series folder or a folder of series folders"
        )
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


@dataclass
class Inputs:
    """The subjects to predict: their dataset, its config, their records (files per batch key), whether
    they are condition-only (a generative model's inputs without its target), where they came from."""

    dataset: Dataset
    config: DictConfig
    records: list[dict[str, Any]]
    condition_only: bool = False
    # The config key that named them (in error lines), and the input files no output may replace.
    where: str = "dataset.root"
    protected: list[Path] = field(default_factory=list)
    # Read as an nnU-Net folder (`<case>_0000.nii.gz` files, a raw dataset): label maps named as nnU-Net names them.
    nnunet_names: bool = False
    # The `dataset.transforms` geometry the inputs are resampled to (`input_geometry`).
    geometry: dict[str, Any] = field(default_factory=dict)


def model_covariates(run: DictConfig) -> list[str]:
    """The covariate columns the run's model takes (an outcome model trained with `dataset.covariate_columns`)."""
    model = run.get("model") or {}
    if not int(model.get("num_covariates") or 0):
        return []
    return [str(c) for c in model.get("covariate_names") or run.dataset.get("covariate_columns") or []]


def covariate_table(path: Path, names: list[str], subjects: list[str]) -> dict[str, list[float]]:
    """Per subject of `subjects`, its covariates `names` from the CSV table at `path` (column `subject`)."""
    try:
        with path.open(newline="") as handle:
            reader = csv.DictReader(handle)
            rows = list(reader)
            header = reader.fieldnames or []
    except (OSError, csv.Error, UnicodeDecodeError) as err:
        raise MedvolError(f"`covariates`: cannot read {path} ({err})") from err
    missing = [c for c in ["subject", *names] if c not in header]
    if missing:
        raise MedvolError(
            f"`covariates`: {path} has no column {missing[0]!r}; expected columns subject, {', '.join(names)} "
            f"(its columns are {header})"
        )
    table: dict[str, list[float]] = {}
    for number, row in enumerate(rows, start=2):
        values = []
        for name in names:
            try:
                value = float(str(row[name]).strip())
            except ValueError:
                value = float("nan")
            if value != value or value in (float("inf"), float("-inf")):
                raise MedvolError(f"`covariates`: {path.name}:{number}: {name}={row[name]!r}: expected a number")
            values.append(value)
        table[str(row["subject"]).strip()] = values
    absent = [s for s in subjects if s not in table]
    if absent:
        raise MedvolError(
            f"`covariates`: {path} has no row for subject {absent[0]!r} ({len(absent)} of the {len(subjects)} inputs "
            "have none); expected one row per input file, named by the file without .nii.gz"
        )
    return {s: table[s] for s in subjects}


def input_covariates(
    given: Path | None, run: DictConfig, source: Path, subjects: list[str]
) -> tuple[list[str], dict[str, list[float]]]:
    """The covariate names the model takes and, per input file's subject, their values: from `covariates`, else
    from `covariates.csv` beside the inputs; none for a model without covariates."""
    names = model_covariates(run)
    if not names:
        return [], {}
    path = given if given is not None else (source if source.is_dir() else source.parent) / COVARIATE_FILE
    if not path.is_file():
        where = f"no file at {path}" if given else f"none given and no {COVARIATE_FILE} beside the inputs ({path})"
        raise MedvolError(
            f"`covariates`: the model takes covariates {names}: {where}; expected a CSV table with columns subject, "
            f"{', '.join(names)} (covariates=FILE.csv)"
        )
    return names, covariate_table(path, names, subjects)


def file_dataset(
    files: list[Path] | dict[str, list[Path]], run: DictConfig, override: Any, listing: Path,
    geometry: Mapping[str, Any], key: str = "image", series: str | None = None, covariate_names: Sequence[str] = (),
    covariates: Mapping[str, list[float]] | None = None,
) -> Inputs:
    """A dataset over input files (one subject each, or per subject its channel files), preprocessed with the run's
    transforms on whole volumes, resampled to `geometry`; the files are the `image` of each subject, or a generative
    model's `cond`; with `covariate_names`, each subject's `covariates` too."""
    subjects = files if isinstance(files, dict) else {subject_of(f): [f] for f in files}
    width = max(len(group) for group in subjects.values())
    channels = [key] if width == 1 else [f"{key}_{k:04d}" for k in range(width)]
    names = list(covariate_names)
    with listing.open("w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(["subject", *channels, *names])
        writer.writerows([subject, *(str(f.resolve()) for f in group), *(covariates or {}).get(subject, [])]
                         for subject, group in subjects.items())
    listed = (
        {"_target_": COVARIATE_DATASET, "csv_path": str(listing), "time_column": None, "event_column": None,
         "covariate_columns": names}
        if names else {"_target_": FILE_DATASET, "list_file": str(listing)}
    )
    config = OmegaConf.create({
        **listed, "image_modalities": channels if key == "image" else [],
        "cond_modalities": channels if key == "cond" else [],
        "transforms": file_transforms(run, geometry), "num_workers": 0,
        "split_file": None,
        "series": series,
    })
    config = merged(config, override)
    datamodule = build(config)
    records = datamodule.subjects()
    return Inputs(datamodule.build_dataset(records, "test"), config, records, condition_only=key != "image")


def file_transforms(run: DictConfig, geometry: Mapping[str, Any]) -> dict[str, Any]:
    """The `dataset.transforms` input files are read with: the run's own, resampled to `geometry`, on whole
    volumes (what an exported bundle's preprocessing is built from too)."""
    own = run.dataset.get("transforms")
    transforms = OmegaConf.to_container(own, resolve=True) if own is not None else {}
    assert isinstance(transforms, dict)
    return {**transforms, **geometry, **prediction_transforms(run, False)}


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
        if config.get("transforms") is not None:
            config.transforms = {
                **OmegaConf.to_container(config.transforms, resolve=True), **prediction_transforms(run, keep_crop)
            }
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


def brats_dataset(run: DictConfig, root: Path, cases: list[Path]) -> DictConfig:
    """BraTS case folders given as `input` (one case, or a folder of them), read as `dataset=brats
    dataset.root=<input>` reads them: the run's own BraTS settings, or for another run the BraTS group file with the
    run's modalities and transforms; labels where every case has its segmentation (then scored, as with `split=`)."""
    labelled = all(any(p.name.removesuffix(".nii.gz").endswith(("_seg", "-seg")) for p in case.iterdir())
                   for case in cases)
    if target_class(str(run.dataset._target_)) is BratsDataModule:
        return OmegaConf.create({"root": str(root), "label": labelled})
    chosen = OmegaConf.load(BRATS_GROUP_FILE)
    assert isinstance(chosen, DictConfig)
    chosen.root, chosen.label = str(root), labelled
    return with_run_transforms(run.dataset, chosen)


def subject_batch(dataset: Dataset, index: int) -> dict[str, Any]:
    """Subject `index` as a batch of one, collated as the test loader would; a refusal inside the transforms (MONAI
    wraps it in `applying transform ...`) passed on as its one line."""
    try:
        item = dataset[index]
    except RuntimeError as err:
        own = refusal_within(err)
        if own is None:
            raise
        raise own from None
    return default_collate([item])


def batches(dataset: Dataset) -> Iterator[dict[str, Any]]:
    """Every subject of `dataset`, one per batch (`subject_batch`)."""
    for index in range(len(dataset)):  # type: ignore[arg-type]
        yield subject_batch(dataset, index)


def find_inputs(request: PredictRequest, run: DictConfig, module: MedvolModule, scratch: Path) -> Inputs:
    """The subjects the request's `input` (a file or a folder of files, BraTS case folders) or dataset names, read at
    the model's geometry (`input_geometry`: the training spacing, or the request's `spacing`), the output folder
    checked against theirs."""
    geometry = input_geometry(request.spacing, module.training_data, module.refines_resolution)
    run = with_geometry(run, geometry)
    generation = module.generation_inputs()
    override = request.dataset
    if override is not None and override.get("_target_"):
        override = with_run_transforms(run.dataset, override)
    source = request.source
    if source is None:
        inputs = split_inputs(run, override, request, generation)
    else:
        if source.is_dir():
            check_output_dir(request.output_dir, [source])
        cases = case_folders(source)
        inputs = (
            dataset_subjects(run, brats_dataset(run, source, cases), None, request.keep_crop, generation) if cases
            else file_inputs(run, override, request, source, generation, scratch / "inputs.csv", geometry)
        )
        inputs.where = "input"
    inputs.geometry = geometry
    return inputs


def split_inputs(run: DictConfig, override: Any, request: PredictRequest, generation: Mapping[str, int]) -> Inputs:
    """The subjects of the run's dataset (or the one the request names): its `split`, or all of them."""
    inputs = dataset_subjects(run, override, request.split, request.keep_crop, generation)
    check_output_dir(request.output_dir, [Path(str(inputs.config.root))] if inputs.config.get("root") else [])
    inputs.nnunet_names = issubclass(target_class(str(inputs.config._target_)), NnunetDataModule)
    return inputs


def file_inputs(
    run: DictConfig, override: Any, request: PredictRequest, source: Path, generation: Mapping[str, int],
    listing: Path, geometry: Mapping[str, Any],
) -> Inputs:
    """The input files `source` names (a file, a folder of them, DICOM series folders), one subject each or, for
    nnU-Net's `<case>_XXXX` files, one per case; with a model's covariates beside them."""
    files = input_files(source)
    # A generative model's input files are its condition (a T1 for a T1 -> T2 model).
    key = next(iter(generation)) if generation else "image"
    if generation:
        modality_field(key)
    # Several series in a folder, gaps, mixed slices: refused for every input before the first is read.
    for folder in (f for f in files if f.is_dir()):
        series_geometry(folder, request.series)
    # nnU-Net's <case>_XXXX files of one case are one subject's channels, as training took them.
    groups = channel_groups(files, files_per_subject(run, plan_path(run))) if key == "image" else files
    subjects = list(groups) if isinstance(groups, dict) else [subject_of(f) for f in groups]
    names, covariates = input_covariates(request.covariates, run, source, subjects) if not generation else ([], {})
    inputs = file_dataset(groups, run, override, listing, geometry, key, request.series, names, covariates)
    # A file's outputs may go next to it (`<subject>_<name>.nii.gz`); the writer refuses to replace an input.
    inputs.protected = files
    inputs.nnunet_names = isinstance(groups, dict) and all(CHANNEL_FILE.match(f.name) for f in files)
    return inputs
