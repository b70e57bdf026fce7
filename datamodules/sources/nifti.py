"""NIfTI volumes from a folder (file-name patterns) or from a CSV/JSON list, several files per subject as channels.

This is also the base of the other file-based datasets (brats, csv, patches, xray_ct): they
change how subjects are listed or what happens after loading, and share the transforms,
caching and data checks here.
"""

from __future__ import annotations

import csv
import re
from collections.abc import Callable, Hashable, Mapping, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

import nibabel as nib
import numpy as np
import torch
from monai.data.utils import worker_init_fn
from monai.transforms import Compose, MapTransform
from torch.utils.data import Dataset

from datamodules.pipeline.augmentation import nnunet_augmentation
from datamodules.pipeline.check import (
    LABEL_KEY,
    Problem,
    check_record,
    dataset_overrides,
    duplicate_subjects,
    preflight_error,
)
from datamodules.pipeline.disk_cache import file_stats
from datamodules.pipeline.transforms import (
    MASK_KEY,
    TransformSettings,
    deterministic_transforms,
    random_transforms,
    select_batch_keys,
)
from datamodules.pipeline.volume_datamodule import Record, VolumeDataModule, fingerprint_sample
from medvol.core.errors import MedvolError
from medvol.core.file_data import read_json
from medvol.core.subject_names import check_subject_id
from medvol.volumes.dicom_io import is_dicom_series, read_series
from medvol.volumes.intensity import intensity_keys
from medvol.volumes.plan import MODALITY_KINDS, DataFingerprint, channel_statistics
from medvol.volumes.source_grid import oriented_spacing
from medvol.volumes.volume_budget import load_nifti
from medvol.volumes.volume_reader import SERIES_KEY, volume_grid

# The keys a file-based dataset puts in its batch dicts (others in a record are bookkeeping).
# `source_affine` (4x4 float64), `source_shape` (3 ints) and `source_file` (path) describe the voxel grid of
# the first image file as stored (`source_series`: the SeriesInstanceUID of a DICOM series, else ''), so outputs can be
# mapped back onto it (`medvol.volumes.source_grid`); the `*intensity_*` keys say how the intensities were scaled, so
# outputs go back into the scan's units.
BATCH_KEYS = (
    "image", "cond", "label", MASK_KEY, "time", "event", "covariates", "class_label", "subject", "affine",
    "source_affine", "source_shape", "source_file", "source_series", "source_label_file",
    "intensity_low", "intensity_high", "cond_intensity_low", "cond_intensity_high", "intensity_range",
)


def pattern_regex(pattern: str) -> re.Pattern[str]:
    """A regex for a file pattern with `{subject}` (the id), `*` (any name part) and `**/` (any folders)."""
    parts = []
    for i, piece in enumerate(pattern.split("{subject}")):
        if i:
            parts.append("(?P<subject>[^/]+?)" if i == 1 else "(?P=subject)")
        parts.append(re.escape(piece).replace(r"\*\*/", "(?:.*/)?").replace(r"\*", "[^/]*"))
    return re.compile("".join(parts) + "$")


def series_pattern(pattern: str) -> str | None:
    """The pattern a DICOM series folder matches where `pattern` names a NIfTI file: without .nii.gz/.nii."""
    for suffix in (".nii.gz", ".nii"):
        if pattern.endswith(suffix):
            return pattern.removesuffix(suffix)
    return None


def match_files(root: Path, pattern: str) -> dict[str, list[Path]]:
    """Subject id -> files under `root` that match `pattern` (more than one file means a duplicate).

    A DICOM series folder stands where a NIfTI file would: it matches `pattern` itself (`{subject}/{modality}`)
    or, for a pattern of NIfTI files, its name without .nii.gz (`{subject}/t1/` for `{subject}/t1.nii.gz`).
    """
    if "{subject}" not in pattern:
        raise MedvolError(
            f"file pattern {pattern!r} has no `{{subject}}` part, so files cannot be told apart by subject"
        )
    found: dict[str, list[Path]] = {}
    folders = series_pattern(pattern)
    for candidate in [pattern, *([folders] if folders else [])]:
        regex = pattern_regex(candidate)
        for path in sorted(root.glob(candidate.replace("{subject}", "*"))):
            match = regex.match(path.relative_to(root).as_posix())
            if match and ((path.is_file() and candidate == pattern) or is_dicom_series(path)):
                found.setdefault(match.group("subject"), []).append(path)
    return found


def check_modality_kind(kind: str | Sequence[str], channels: int) -> list[str] | None:
    """`dataset.modality_kind` as one kind per image channel, or None for auto (from the data)."""
    kinds = [kind] * channels if isinstance(kind, str) else [str(k) for k in kind]
    if kinds and all(k == "auto" for k in kinds):
        return None
    if len(kinds) != channels or any(k not in MODALITY_KINDS for k in kinds):
        raise MedvolError(
            f"`dataset.modality_kind` is {kind!r}; expected auto, mr, ct or a list of mr/ct with one per image channel "
            f"({channels})"
        )
    return kinds


class StoreSourceGridd(MapTransform):
    """Record the grid of `key` as loaded from disk: `source_affine`, `source_shape`, `source_file`, `source_series`;
    and the file of `label_key` (`source_label_file`), which test-time metrics read as stored.

    Runs right after loading, before reorientation, resampling and crop/pad change the grid.
    """

    def __init__(self, key: str, label_key: str | None = None) -> None:
        super().__init__([key])
        self.label_key = label_key

    def __call__(self, data: Mapping[Hashable, Any]) -> dict[Hashable, Any]:
        d = dict(data)
        volume = d[self.keys[0]]
        d["source_affine"] = torch.as_tensor(np.asarray(volume.affine), dtype=torch.float64)
        d["source_shape"] = torch.tensor(volume.shape[1:4], dtype=torch.int64)
        filename = volume.meta.get("filename_or_obj", "")
        d["source_file"] = str(filename[0] if isinstance(filename, (list, tuple)) else filename)
        d["source_series"] = str(volume.meta.get(SERIES_KEY, ""))
        label = d.get(self.label_key) if self.label_key else None
        if label is not None and hasattr(label, "meta"):
            name = label.meta.get("filename_or_obj", "")
            d["source_label_file"] = str(name[0] if isinstance(name, (list, tuple)) else name)
        return d


# Labelled voxels the plan's intensity statistics keep over the whole training split, shared evenly by the subjects
# (nnU-Net samples 10^8; every labelled voxel of a dataset of this size).
FOREGROUND_SAMPLE = 10_000_000
# The fingerprint's record of the label values the dataset changed on loading: model value -> the files' value.
LABEL_FILE_VALUES = "label_file_values"


def read_voxels(path: str, series: str | None = None) -> np.ndarray:
    """A file's (or DICOM series folder's) voxels as float32, NaN/Inf as 0 (the data doctor reports them; the
    plan must not count them)."""
    if is_dicom_series(path):
        return np.nan_to_num(read_series(path, series)[0].astype(np.float32))
    return np.nan_to_num(np.asarray(load_nifti(path).dataobj, dtype=np.float32))


def channels_of(volume: np.ndarray) -> list[np.ndarray]:
    """A 3D volume as one channel, a 4D one (NIfTI's fourth axis, as MONAI loads it) as one per volume."""
    return [volume] if volume.ndim == 3 else [volume[..., k] for k in range(volume.shape[3])]


def sampled(values: np.ndarray, count: int) -> np.ndarray:
    """At most `count` of `values`, evenly strided (deterministic: the same plan from the same files)."""
    if values.size <= count:
        return values
    return values[np.linspace(0, values.size - 1, count).astype(np.int64)]


def oriented_extent(mask: np.ndarray, affine: np.ndarray, orientation: str | None) -> list[int]:
    """The bounding box of `mask`'s true voxels, in the axes after reorientation (whole volume when empty)."""
    where = np.nonzero(mask)
    box = [int(w.max() - w.min() + 1) for w in where] if where[0].size else list(mask.shape[:3])
    if not orientation:
        return box
    axes = nib.orientations.io_orientation(affine)
    target = nib.orientations.axcodes2ornt(tuple(orientation))
    order = nib.orientations.ornt_transform(axes, target)[:, 0].astype(int)
    return [box[int(np.nonzero(order == k)[0][0])] for k in range(3)]


class NiftiDataModule(VolumeDataModule):
    """NIfTI volumes, one subject per record, channels from several files.

    Args:
        root: folder of the volumes (used with `pattern`).
        list_file: a CSV (columns: subject, one per channel name, optional label) or JSON list of
            such objects; paths relative to the list's folder. Replaces `root`/`pattern`.
        pattern: file pattern under `root` with `{subject}` marking the id and `{modality}` the
            channel name, e.g. `{subject}/{modality}.nii.gz` or `**/{subject}_{modality}.nii.gz`.
        files: channel name -> own pattern, for channels whose files do not follow `pattern`.
        label_file: pattern of the label map, or null for none.
        image_modalities: channel names stacked into `image` (C, D, H, W).
        cond_modalities: channel names stacked into `cond` (e.g. the source of a translation).
        label_values: label values the data doctor accepts; null: any integers.
        transforms: `dataset.transforms` settings (see `TransformSettings`).
        series: for DICOM series folders holding several series, the one to read (UID or description).
        modality_kind: what a segmentation plan normalizes the image channels as: auto (CT where a channel
            holds air below -500, MR otherwise), mr, ct, or a list with one per image channel.
        **kwargs: split, loader and cache settings of `VolumeDataModule`.
    """

    def __init__(
        self,
        root: str | None = None,
        list_file: str | None = None,
        pattern: str = "{subject}/{modality}.nii.gz",
        files: Mapping[str, str] | None = None,
        label_file: str | None = None,
        image_modalities: Sequence[str] = ("image",),
        cond_modalities: Sequence[str] = (),
        label_values: Sequence[int] | None = None,
        transforms: Mapping[str, Any] | None = None,
        series: str | None = None,
        modality_kind: str | Sequence[str] = "auto",
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        self.series = series
        self.modality_kind = check_modality_kind(modality_kind, len(image_modalities))
        self.root = Path(root).expanduser() if root else None
        self.list_file = Path(list_file).expanduser() if list_file else None
        self.pattern = pattern
        self.files = dict(files or {})
        self.label_file = label_file
        self.image_modalities = list(image_modalities)
        self.cond_modalities = list(cond_modalities)
        self.label_values = list(label_values) if label_values is not None else None
        self.settings = TransformSettings.from_config(transforms)
        # Condition-only subjects (predict.py: a T1 for a T1 -> T2 model) have no `image`.
        if not self.image_modalities and not self.cond_modalities:
            raise MedvolError("`dataset.image_modalities` is empty; name at least one channel")
        self._listing: tuple[list[Record], list[Problem]] | None = None
        # Gives every loader worker its own seed for MONAI's random transforms (they hold their own RNG).
        self.worker_init_fn = worker_init_fn

    # Listing -------------------------------------------------------------------------------

    def channel_names(self) -> list[str]:
        return self.image_modalities + [m for m in self.cond_modalities if m not in self.image_modalities]

    @property
    def has_label(self) -> bool:
        """Whether the subjects come with label maps (a label pattern, list entry or column)."""
        return any(LABEL_KEY in record for record in self.subjects())

    def list_subjects(self) -> tuple[list[Record], list[Problem]]:
        """Records (with `files`: name -> path or None) and the problems found while listing."""
        if self.list_file is not None:
            return self._from_list_file()
        if self.root is None:
            raise MedvolError("set `dataset.root` (a folder of NIfTI files) or `dataset.list_file` (a CSV/JSON list)")
        if not self.root.is_dir():
            raise MedvolError(f"`dataset.root`: {self.root} is not a folder")
        patterns = {
            name: self.files.get(name, self.pattern.replace("{modality}", name)) for name in self.channel_names()
        }
        if self.label_file:
            patterns[LABEL_KEY] = self.label_file
        return self._from_patterns(self.root, patterns)

    def _from_patterns(self, root: Path, patterns: Mapping[str, str]) -> tuple[list[Record], list[Problem]]:
        matches = {name: match_files(root, pattern) for name, pattern in patterns.items()}
        problems = []
        subjects = sorted(set().union(*matches.values()))
        records = []
        for subject in subjects:
            files: dict[str, str | None] = {}
            for name, found in matches.items():
                paths = found.get(subject, [])
                if len(paths) > 1:
                    problems.append(
                        Problem(subject, str(paths[1]), f"duplicate subject: {len(paths)} {name} files match")
                    )
                files[name] = str(paths[0]) if paths else None
            records.append(self.make_record(subject, files))
        return records, problems

    def _from_list_file(self) -> tuple[list[Record], list[Problem]]:
        path = self.list_file
        assert path is not None
        if not path.is_file():
            raise MedvolError(f"`dataset.list_file`: no file at {path}; expected a CSV or JSON list of subjects")
        if path.suffix.lower() == ".json":
            rows = read_json(path, "a `dataset.list_file` (a JSON list of subjects)")
        else:
            try:
                with path.open(newline="") as handle:
                    rows = list(csv.DictReader(handle))
            except (OSError, UnicodeDecodeError, csv.Error) as err:
                raise MedvolError(f"`dataset.list_file`: cannot read {path} ({err})") from err
        if not isinstance(rows, list) or not all(isinstance(r, dict) for r in rows):
            raise MedvolError(
                f"`dataset.list_file`: {path} must be a list of objects (JSON) or a table with a header (CSV)"
            )
        needed = ["subject", *self.channel_names()]
        missing = [c for c in needed if rows and c not in rows[0]]
        if missing:
            raise MedvolError(
                f"`dataset.list_file`: {path} has no column {missing[0]!r}; "
                f"expected columns {needed} (+ optional label)"
            )
        has_label = bool(rows) and LABEL_KEY in rows[0]
        records = []
        for row in rows:
            files = {name: self._resolve(path.parent, row.get(name)) for name in self.channel_names()}
            if has_label:
                files[LABEL_KEY] = self._resolve(path.parent, row.get(LABEL_KEY))
            records.append(self.make_record(check_subject_id(row["subject"], str(path)), files))
        return records, duplicate_subjects(records, str(path))

    @staticmethod
    def _resolve(folder: Path, value: Any) -> str | None:
        if value is None or str(value).strip() == "":
            return None
        path = Path(str(value).strip()).expanduser()
        return str(path if path.is_absolute() else folder / path)

    def make_record(self, subject: str, files: dict[str, str | None]) -> Record:
        record: Record = {"subject": subject, "files": files}
        if self.image_modalities:
            record["image"] = [files[m] for m in self.image_modalities]
        if self.cond_modalities:
            record["cond"] = [files[m] for m in self.cond_modalities]
        if LABEL_KEY in files:
            record[LABEL_KEY] = files[LABEL_KEY]
        return record

    def source(self) -> str:
        """Where the subjects are listed (for messages)."""
        return str(self.list_file or self.root)

    def _listed(self) -> tuple[list[Record], list[Problem]]:
        if self._listing is None:
            self._listing = self.list_subjects()
        return self._listing

    def subjects(self) -> list[Record]:
        return self._listed()[0]

    # Checks --------------------------------------------------------------------------------

    def data_problems(self, full: bool) -> tuple[list[Problem], int]:
        """Every problem of the data (full: read all voxels; else headers and existence only), and the subject count."""
        records, problems = self._listed()
        if self.max_subjects:
            records = records[: self.max_subjects]
        problems = list(problems) + duplicate_subjects(records, self.source())
        problems = list(dict.fromkeys(problems))
        for record in records:
            problems += check_record(
                record, self.label_values, full, image_names=self.channel_names(), series=self.series,
                spacing=self.settings.spacing, orientation=self.settings.orientation,
            )
            problems += self.record_problems(record)
        return problems, len(records)

    def record_problems(self, record: Record) -> list[Problem]:
        """Problems of a record's values (not its files); tables with outcomes override it."""
        return []

    def preflight(self) -> None:
        records, _ = self._listed()
        if not records:
            raise MedvolError(
                f"no subjects found in {self.source()}; check `dataset.root` and `dataset.pattern`, or the list"
            )
        problems, _ = self.data_problems(full=False)
        if problems:
            raise preflight_error(problems, dataset_overrides())

    # Fingerprint ---------------------------------------------------------------------------

    def fingerprint(self) -> dict[str, Any]:
        """The training subjects' geometry and intensity scale (see `VolumeDataModule.fingerprint`).

        The spacing is `dataset.transforms.spacing` where set, else the per-axis median over every
        training subject's first image file (its header, in the axes after reorientation); `resampled`
        says which (a model trained on each subject's own grid predicts on each input's own grid). The
        intensity ends: the window in `window` mode; in `percentile` mode the per-channel median of
        the training subjects' percentile ends (of `FINGERPRINT_INTENSITY_SUBJECTS` of them, evenly spread).
        Where the dataset changes label values on loading (`label_value_map`), `label_file_values` gives the
        files' value of each changed model value.
        """
        records = self.training_records()
        orientation = self.settings.orientation
        spacing = self.settings.spacing
        spacings = (
            [oriented_spacing(volume_grid(r["image"][0], self.series)[1], orientation) for r in records]
            if spacing is None
            else []
        )
        # Masks predicted for files take the values the training files used (BraTS 2021's enhancing tumour: 4).
        changed = {str(used): int(raw) for raw, used in self.label_value_map().items()}
        return {
            "spacing": [float(s) for s in spacing or np.median(np.asarray(spacings), axis=0)],
            # False when training kept every subject's own grid: predict.py then keeps each input's own too.
            "resampled": spacing is not None, "orientation": orientation,
            "intensity": self.intensity_fingerprint(records), "subjects": len(records),
            **({LABEL_FILE_VALUES: changed} if changed else {}),
        }

    def plan_fingerprint(self) -> DataFingerprint:
        """What a segmentation plan is made from (`medvol.volumes.plan`), read from every training subject as
        nnU-Net's fingerprint extractor reads them: the spacing (in the axes after reorientation), the box of the
        voxels non-zero in any channel and the share of the volume it keeps, per image channel (a 4D file gives one
        per volume) the intensities of the labelled voxels (a subject whose label map is empty gives none; a subject
        without a label map, as an outcome model's, its non-zero voxels), and the label values
        with their voxel counts after the dataset's own mapping (`label_value_map`)."""
        self.assign_split()
        records = self.training_records()
        orientation, mapping = self.settings.orientation, self.label_value_map()
        spacings, shapes, relative = [], [], []
        values: list[list[np.ndarray]] = []
        minima: list[float] = []
        labels: dict[int, int] = {}
        label_files: dict[int, str] = {}
        share = max(1, FOREGROUND_SAMPLE // max(1, len(records)))
        for record in records:
            channels = [c for path in record["image"] for c in channels_of(read_voxels(path, self.series))]
            if not values:
                values, minima = [[] for _ in channels], [np.inf for _ in channels]
            if len(channels) != len(values):
                raise MedvolError(
                    f"subject {record['subject']} has {len(channels)} image channels, the first training subject "
                    f"{len(values)}; expected the same channels for every subject"
                )
            nonzero = np.any([c != 0 for c in channels], axis=0)
            affine = volume_grid(record["image"][0], self.series)[1]
            box = oriented_extent(nonzero, affine, orientation)
            shapes.append(box)
            spacings.append(oriented_spacing(affine, orientation))
            relative.append(float(np.prod(box)) / float(np.prod(nonzero.shape)))
            # Without a label map (an outcome table's scans) the body's voxels are the foreground.
            foreground = nonzero
            if record.get(LABEL_KEY):
                raw = np.rint(read_voxels(record[LABEL_KEY], self.series)).astype(np.int64)
                label = raw.copy()
                for stored, used in mapping.items():
                    label[raw == stored] = used
                foreground = label > 0
                for value, count in zip(*np.unique(label, return_counts=True), strict=True):
                    labels[int(value)] = labels.get(int(value), 0) + int(count)
                    label_files.setdefault(int(value), str(record[LABEL_KEY]))
            for i, channel in enumerate(channels):
                values[i].append(sampled(channel[foreground], share))
                minima[i] = min(minima[i], float(channel.min()))
        statistics = [channel_statistics(np.concatenate(v), m) for v, m in zip(values, minima, strict=True)]
        return DataFingerprint(
            np.asarray(spacings), np.asarray(shapes), np.asarray(relative), statistics, labels, label_files
        )

    def label_value_map(self) -> dict[int, int]:
        """Label values the dataset changes on loading (raw -> used: BraTS 2021's 4 -> 3); none by default."""
        return {}

    def intensity_fingerprint(self, records: list[Record]) -> dict[str, Any] | None:
        """Raw values mapped onto the ends of the model range per `image` channel, typical of `records`."""
        settings, channels = self.settings, len(self.image_modalities)
        if settings.intensity in ("none", "zscore"):
            return None
        if settings.intensity == "window":
            low, high = [settings.window[0]] * channels, [settings.window[1]] * channels
        else:
            chain = Compose(
                deterministic_transforms(
                    TransformSettings(**{**asdict(settings), "spatial_size": None}), ["image"], None, series=self.series
                )
            )
            low_key, high_key = intensity_keys("image")
            items = [chain({"image": record["image"]}) for record in fingerprint_sample(records)]
            low = np.median([item[low_key].tolist() for item in items], axis=0).tolist()
            high = np.median([item[high_key].tolist() for item in items], axis=0).tolist()
        return {"mode": settings.intensity, "low": low, "high": high, "range": list(settings.output_range)}

    # Datasets ------------------------------------------------------------------------------

    @property
    def label_key(self) -> str | None:
        return LABEL_KEY if self.has_label else None

    def label_transform(self) -> Callable | None:
        """Maps raw label values after loading (e.g. BraTS regions); none by default."""
        return None

    def extra_deterministic(self) -> list[Callable]:
        """Steps that run on raw intensities before scaling (e.g. DRRs); none by default."""
        return []

    def image_keys(self) -> list[str]:
        return [key for key, names in (("image", self.image_modalities), ("cond", self.cond_modalities)) if names]

    def batch_keys(self) -> list[str]:
        return list(BATCH_KEYS)

    def deterministic(self, stage: str) -> list[Callable]:
        chain = deterministic_transforms(
            self.settings,
            self.image_keys(),
            self.label_key,
            self.label_transform(),
            self.extra_deterministic(),
            self.series,
            keep_mask=stage == "train" and self.settings.augmentation is not None,
        )
        # After loading (the first step), before anything changes the grid.
        chain.insert(1, StoreSourceGridd(self.image_keys()[0], self.label_key))
        return chain

    def random(self, stage: str) -> list[Callable]:
        if stage != "train":
            return []
        settings = self.settings
        if settings.augmentation is None:
            return random_transforms(settings, self.image_keys(), self.label_key)
        plans = settings.normalization or []
        masked = [i for i, c in enumerate(plans) if c["kind"] == "mr" and c.get("use_mask", True)]
        return nnunet_augmentation(
            settings.augmentation, self.image_keys()[0], self.label_key, settings.background(max(1, len(plans))),
            masked if settings.uses_mask else [], settings.foreground_ratio,
        )

    def build_dataset(self, records: list[Record], stage: str) -> Dataset:
        deterministic = [*self.deterministic(stage), select_batch_keys(self.batch_keys())]
        files = [path for record in self.subjects() for path in record["files"].values() if path]
        fingerprint = {
            "class": type(self).__name__, "settings": asdict(self.settings), "extra": self.cache_key(),
            "files": file_stats(files),
        }
        return self.cached_dataset(records, deterministic, self.random(stage), stage, fingerprint=fingerprint)

    def item_voxels(self, record: Record) -> int:
        """Voxels of the cached item: `spatial_size`, or the first image's grid resampled to `spacing` (header only)."""
        if self.settings.spatial_size:
            return int(np.prod(self.settings.spatial_size))
        shape, affine = volume_grid(record["image"][0], self.series)
        shape = np.asarray(shape[:3], dtype=float)
        if self.settings.spacing:
            zooms = np.sqrt((affine[:3, :3] ** 2).sum(axis=0))
            shape = shape * zooms / np.asarray(self.settings.spacing)
        return int(np.prod(np.maximum(np.round(shape), 1)))

    def cache_key(self) -> dict[str, Any]:
        """What else, besides the transform settings, changes the cached items."""
        return {"image": self.image_modalities, "cond": self.cond_modalities, "label": self.label_key,
                **({"series": self.series} if self.series else {})}
