"""Write a model's output volumes as NIfTI on the source scan's grid and in its units: one code path for
`test=true` (the NiftiPredictionWriter callback) and `predict.py`, so the two never disagree."""

from __future__ import annotations

import csv
import os
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from medvol.core.errors import MedvolError
from medvol.core.run_files import open_in, replace_in, writable_path
from medvol.core.subject_names import SubjectFiles
from medvol.volumes.dicom_io import series_geometry
from medvol.volumes.dicom_write import write_derived_series, write_segmentation
from medvol.volumes.intensity import (
    INTENSITY_RANGE_KEY,
    intensity_keys,
    scale_from_range,
    scale_from_range_unclamped,
    scale_spread,
)
from medvol.volumes.nifti_io import save_volume
from medvol.volumes.segmentation_report import (
    INDEX_FILE,
    render_picture,
    structure_volumes,
    volume_column,
    write_index,
)
from medvol.volumes.source_grid import to_source_grid
from medvol.volumes.volume_reader import VolumeReader

SOURCE_KEYS = ("source_affine", "source_shape")
OUTPUT_FORMATS = ("nifti", "dicom", "both")
# A label map's data type, as nnU-Net writes masks: the smallest unsigned type holding its largest label value.
MASK_DTYPES = (np.uint8, np.uint16, np.uint32)


def mask_dtype(largest: int) -> type[np.unsignedinteger]:
    """The data type of a label map whose largest label value is `largest`: uint8 up to 255, uint16 up to 65535 (the
    rule of nnU-Net's exported masks; a MONAI bundle of medvol writes the same)."""
    return next(t for t in MASK_DTYPES if largest <= np.iinfo(t).max)


def check_output_format(value: str) -> str:
    """`output_format` as given, or a refusal naming the choices."""
    if value not in OUTPUT_FORMATS:
        raise MedvolError(f"`output_format` is {value!r}; expected one of {list(OUTPUT_FORMATS)}")
    return value


@dataclass
class PlannedVolume:
    """One output volume on its way to disk: where, what, on which grid, and the DICOM series it came from."""

    path: Path
    volume: torch.Tensor
    affine: Any
    header: Any
    name: str
    source_series: str = ""
    source_folder: str = ""
    segments: dict[str, list[int]] | None = None
    subject: str = ""
    index: int = 0
    # The batch key whose units an image output is in (`image`, `cond`): its channel names say its modality.
    units: str = "image"


def to_source_units(
    volume: torch.Tensor, batch: Mapping[str, Any], index: int, key: str = "image",
    window: tuple[float, float] | None = None, spread: bool = False, clamp: bool = True,
) -> torch.Tensor:
    """A (C, D, H, W) float volume in model units -> the units of the scan it came from.

    The batch says how its `key` volume was scaled (`intensity_low`/`intensity_high` per channel and
    `intensity_range`, recorded by the dataset's intensity transform): that scaling is inverted per
    channel (percentile bounds are per subject). Without those keys a model's `window` (raw low, high
    mapped onto [-1, 1]) is inverted; without either the volume stays as it is.

    Args:
        volume: one sample's (C, D, H, W) float volume.
        batch: the batch it was computed from.
        index: the sample's index in the batch.
        key: the batch key whose units the volume is in (`image`; `cond` for a condition panel).
        window: a model's (low, high) raw window, used when the batch carries no scaling record.
        spread: the volume is a spread (a standard deviation): only scaled, neither shifted nor clipped.
        clamp: clip to the raw range first (the data's own range); False maps values beyond it beyond it.
    """
    convert = scale_spread if spread else scale_from_range if clamp else scale_from_range_unclamped
    low_key, high_key = intensity_keys(key)
    if batch.get(low_key) is not None and batch.get(INTENSITY_RANGE_KEY) is not None:
        lows, highs = batch[low_key][index].cpu().tolist(), batch[high_key][index].cpu().tolist()
        out_range = batch[INTENSITY_RANGE_KEY][index].cpu().tolist()
        if len(lows) == 1:
            lows, highs = lows * volume.shape[0], highs * volume.shape[0]
        if len(lows) != volume.shape[0]:
            raise ValueError(
                f"a {volume.shape[0]}-channel output cannot take the scaling of {len(lows)} `{key}` channels"
            )
        return torch.stack([convert(c, lo, hi, out_range) for c, lo, hi in zip(volume, lows, highs, strict=True)])
    if window is not None:
        return convert(volume, float(window[0]), float(window[1]), (-1.0, 1.0))
    return volume


class PredictionWriter:
    """Saves output `volumes` as `<output_dir>/<subject>_<name>.nii.gz` and collects per-subject metric rows.

    Batches from files carry the grid of the source scan (`source_affine`, `source_shape`,
    `source_file`): each volume is mapped back onto it (`medvol.volumes.source_grid`: orientation,
    resampling and crop/pad undone; nearest for integer label maps, linear otherwise) and written
    with the source header, so it has the scan's own shape and affine. Without those keys
    (synthetic data, already on its own grid) a volume is written with the batch's `affine`.
    Float volumes go back into the scan's units (`to_source_units`); a model names the batch key
    whose units a volume has in `"units"` (name -> key, default `image`), and the volumes that are
    spreads (standard deviations: scaled, not shifted) in `"spreads"`. Integer volumes are label
    maps: with a batch `label_values` ((B, K): the file's value of each model label, e.g. BraTS
    2021's 0, 1, 2, 4) they are written with the values the input used. Patch batches (with
    `patch_origin`) stay on the patch grid and add the patch corner to the name. An `"arrays"`
    output (name -> (B, ...) tensor, e.g. a VQ-GAN's codes) is saved as `<subject>_<name>.npy`; a
    `"rows"` output (per-subject dicts: risks, class probabilities) goes to `predictions.csv`. Volumes a model
    names in `"as_is"` are already on the grid they are written on (the source grid where the batch has one,
    e.g. segmentation probabilities of the resampled logits) and in their final units: written as they are.
    A `volumes` entry may be a list of per-sample tensors (source grids differ in shape from sample to sample).

    With `output_format` dicom or both, the volumes of subjects read from a DICOM series (a batch's
    `source_series`) are also written for a PACS (`medvol.volumes.dicom_write`): label maps as
    `<subject>_<name>.dcm`, a DICOM-SEG with one segment per class or region (a model's `"segments"` output,
    name -> label values; else one per value found), images as a derived series in `<subject>_<name>/`.

    Args:
        output_dir: folder for the files.
        skip: names of `volumes` entries not to write (the input and label are already on disk).
        protected: input files no output may replace (`predict.py`'s inputs): a batch that would write onto one
            is refused before any of its files is written.
        output_format: nifti, dicom (only for subjects read from DICOM series) or both.
        segment_codes: DICOM-SEG segment name -> its SNOMED CT `category` and/or `type`
            (`medvol.volumes.segment_codes`; unnamed segments are coded from their names).
        channels: batch key -> the dataset's channel names (`image_modalities`, `cond_modalities`): a derived
            series of an output in a `ct` channel's units is a CT, in a `t2` channel's an MR.
        nnunet_names: inputs read as an nnU-Net folder: a label map is `<subject>.nii.gz`, as nnU-Net names it.
        root: the output folder `output_dir` lies in (default: itself): no file or folder below it is written through
            a symbolic link (`medvol.core.run_files`). Subject ids become file names through
            `medvol.core.subject_names` (`../x` is written as `.._x`; two ids sharing a name are refused).

    Label maps are written as uint8 (uint16 past label value 255; `mask_dtype`), as nnU-Net writes masks. Each NIfTI,
    picture and array file is written under a partial name and renamed into place: no file under its final name is
    ever half written.
    """

    def __init__(
        self, output_dir: str | Path, skip: Iterable[str] = ("input", "label"), protected: Iterable[str | Path] = (),
        output_format: str = "nifti", segment_codes: Mapping[str, Any] | None = None,
        channels: Mapping[str, Any] | None = None, root: str | Path | None = None, nnunet_names: bool = False,
    ) -> None:
        self.output_dir = Path(output_dir)
        self.root = Path(root) if root is not None else self.output_dir
        self.names = SubjectFiles()
        self.output_format = check_output_format(output_format)
        self.segment_codes = dict(segment_codes or {})
        self.channels = {key: [str(c) for c in names or []] for key, names in (channels or {}).items()}
        self.skip = set(skip)
        self.nnunet_names = nnunet_names
        self.protected = {Path(p).expanduser().resolve() for p in protected}
        self.rows: list[dict[str, Any]] = []
        self.prediction_rows: list[dict[str, Any]] = []
        # The report (`medvol.volumes.segmentation_report`): per subject its picture, the structures' names, and the
        # training range of their volumes (a model's `"volume_range"` output).
        self.pictures: dict[str, str] = {}
        self.structures: list[str] = []
        self.volume_range: dict[str, list[float]] = {}

    def write(self, outputs: Mapping[str, Any], batch: Mapping[str, Any]) -> list[Path]:
        """Write one batch's volumes (a `test_step` output) and keep its `subject_metrics` rows; the files written."""
        subjects = batch.get("subject")
        if subjects is None:
            return []
        stems = [self.names.stem(s) for s in subjects]
        planned = [(self.output_dir / f"{stem}_{name}.npy", array[i])
                   for name, array in (outputs.get("arrays") or {}).items() for i, stem in enumerate(stems)]
        volumes = self._volumes(outputs, batch, [str(s) for s in subjects]) \
            if "volumes" in outputs and batch.get("affine") is not None else []
        for path in [p for p, _ in planned] + [v.path for v in volumes]:
            self._check_target(path)
        if self.output_format == "dicom":
            self._refuse_without_a_series(volumes)
        self.prediction_rows.extend(outputs.get("rows") or [])
        metrics = outputs.get("subject_metrics") or {}
        rows = [
            {"subject": str(subject), **{name: float(values[i]) for name, values in metrics.items()}}
            for i, subject in enumerate(subjects)
        ]
        self.volume_range.update(outputs.get("volume_range") or {})
        written = [self._report(v, outputs, batch, rows[v.index]) for v in volumes if v.segments]
        self.rows.extend(row for row in rows if len(row) > 1)
        written += [self._write_array(array, path) for path, array in planned]
        if self.output_format != "dicom":
            written += [self._atomic(v.path, lambda path, v=v: save_volume(self._data(v), path, v.affine,
                                                                           header=v.header)) for v in volumes]
        if self.output_format != "nifti":
            written += [path for v in volumes if v.source_series for path in self._write_dicom(v)]
        return written

    def _report(
        self, planned: PlannedVolume, outputs: Mapping[str, Any], batch: Mapping[str, Any], row: dict[str, Any]
    ) -> Path:
        """A label map's structure volumes (into the subject's metrics row) and its picture on the scan."""
        segments = planned.segments or {}
        label_map = planned.volume.numpy()
        label_map = label_map[0] if label_map.ndim == 4 else label_map
        affine = np.asarray(planned.affine.detach().cpu() if torch.is_tensor(planned.affine) else planned.affine)
        volumes = structure_volumes(label_map, segments, affine)
        row.update({volume_column(name): value for name, value in volumes.items()})
        self.structures = list(dict.fromkeys([*self.structures, *segments]))
        scan = self._scan(planned, outputs, label_map.shape)
        path = self.output_dir / f"{planned.path.name.removesuffix('.nii.gz')}.png"
        self._check_target(path)
        self.pictures[planned.subject] = path.name
        return self._atomic(path, lambda partial: render_picture(
            scan, label_map, segments, affine, volumes, planned.subject, partial))

    @staticmethod
    def _scan(planned: PlannedVolume, outputs: Mapping[str, Any], shape: tuple[int, ...]) -> np.ndarray:
        """The scan under a label map: its source file's first channel where the map is on that file's grid, else
        the model's input (first channel), else a blank."""
        if planned.header is not None:
            reader = VolumeReader()
            array = np.asarray(reader.get_data(reader.read(str(planned.header)))[0], dtype=np.float32)
            array = array[..., 0] if array.ndim == 4 else array
            if array.shape == tuple(shape):
                return array
        image = (outputs.get("volumes") or {}).get("input")
        if image is not None and tuple(image[planned.index].shape[1:]) == tuple(shape):
            return image[planned.index][0].detach().float().cpu().numpy()
        return np.zeros(shape, dtype=np.float32)

    @staticmethod
    def _refuse_without_a_series(volumes: list[PlannedVolume]) -> None:
        for planned in volumes:
            if not planned.source_series:
                raise MedvolError(
                    f"`output_format`: dicom, but {planned.path.name} comes from no DICOM series (a NIfTI input, "
                    "or a patch); DICOM outputs need a DICOM source series: use output_format=nifti or both"
                )

    def _write_dicom(self, planned: PlannedVolume) -> list[Path]:
        """The DICOM-SEG (a label map) or derived series (an image) of one output, beside its NIfTI name."""
        geometry = series_geometry(planned.source_folder, planned.source_series)
        stem = planned.path.name.removesuffix(".nii.gz")
        volume = planned.volume.numpy()
        volume = volume[0] if volume.ndim == 4 and volume.shape[0] == 1 else volume
        if not torch.is_floating_point(planned.volume):
            segments = planned.segments or {f"label {v}": [int(v)] for v in sorted(set(volume.flat)) if v != 0}
            target = self.output_dir / f"{stem}.dcm"
            self._check_target(target)
            description = f"medvol {planned.name}"
            return [write_segmentation(volume, geometry, target, segments, description, self.segment_codes)]
        if volume.ndim != 3:
            raise MedvolError(
                f"`output_format`: {stem} has {volume.shape[0]} channels; a derived DICOM series holds one"
            )
        names = self.channels.get(planned.units) or []
        channel = names[0] if len(names) == 1 else None
        folder = writable_path(self.root, self.output_dir / stem)
        return write_derived_series(volume, geometry, folder, f"medvol {planned.name}", channel)

    def _check_target(self, path: Path) -> None:
        """`path` may be written: it replaces no input, and neither it nor a folder below `root` is a link."""
        writable_path(self.root, path)
        if path.expanduser().resolve() in self.protected:
            raise MedvolError(
                f"`output_dir`: the output {path} would replace the input file {path.resolve()}; "
                "choose another `output_dir`"
            )

    def _write_array(self, array: torch.Tensor, path: Path) -> Path:
        return replace_in(self.root, path, lambda handle: np.save(handle, array.detach().cpu().numpy()), "wb")

    def _atomic(self, path: Path, write: Callable[[Path], Any]) -> Path:
        """`path` written by `write` (a library that opens a file by name) under a partial name beside it, then
        renamed into place: a reader, or a job resumed after a kill, never finds half a file under the final name."""
        suffix = ".nii.gz" if path.name.endswith(".nii.gz") else path.suffix
        partial = path.with_name(f".{path.name[: len(path.name) - len(suffix)]}.partial-{os.getpid()}{suffix}")
        writable_path(self.root, partial)
        try:
            write(partial)
            os.replace(partial, path)
        except BaseException:
            partial.unlink(missing_ok=True)
            raise
        return path

    @staticmethod
    def _data(planned: PlannedVolume) -> torch.Tensor | np.ndarray:
        """A volume as written: a label map as `mask_dtype` of its largest possible value (its segments' or its
        own), a float volume as it is."""
        if torch.is_floating_point(planned.volume):
            return planned.volume
        values = [int(v) for group in (planned.segments or {}).values() for v in group]
        largest = max([0, int(planned.volume.max()) if planned.volume.numel() else 0, *values])
        return planned.volume.numpy().astype(mask_dtype(largest))

    def _volumes(
        self, outputs: Mapping[str, Any], batch: Mapping[str, Any], subjects: list[str]
    ) -> list[PlannedVolume]:
        """Every volume to write, on the source grid and in source units."""
        affines, origins = batch["affine"], batch.get("patch_origin")
        on_source = origins is None and all(batch.get(k) is not None for k in SOURCE_KEYS)
        sources = batch.get("source_file")
        label_values = batch.get("label_values")
        series = batch.get("source_series")
        units = outputs.get("units") or {}
        spreads = set(outputs.get("spreads") or ())
        as_is = set(outputs.get("as_is") or ())
        planned = []
        for name, batch_volumes in outputs["volumes"].items():
            if name in self.skip:
                continue
            for i, subject in enumerate(subjects):
                stem = self.names.stem(subject)
                if origins is not None:
                    stem += "_patch" + "-".join(str(int(v)) for v in origins[i])
                volume = batch_volumes[i].detach().cpu()
                is_label = not torch.is_floating_point(volume)
                if is_label and label_values is not None:
                    lookup = label_values[i].cpu()
                    volume = lookup[volume.long().clamp(0, len(lookup) - 1)]
                elif not is_label and name not in as_is:
                    volume = to_source_units(
                        volume.float(),
                        batch,
                        i,
                        units.get(name, "image"),
                        outputs.get("window"),
                        spread=name in spreads,
                        clamp=not outputs.get("unclamped", False),
                    )
                affine, header, segments = affines[i], None, outputs.get("segments")
                if is_label and label_values is not None and segments:
                    segments = {n: [int(lookup[v]) for v in values] for n, values in segments.items()}
                if on_source:
                    if name not in as_is:
                        grid = (batch["source_affine"][i], batch["source_shape"][i])
                        # Cropped-away voxels: background for labels, the darkest output value for intensities.
                        fill = 0.0 if is_label else float(volume.min())
                        volume = to_source_grid(volume, grid, affines[i], "nearest" if is_label else "linear", fill)
                    affine = batch["source_affine"][i]
                    source_file = sources[i] if sources is not None else ""
                    header = source_file if source_file and Path(source_file).is_file() else None
                source_series = str(series[i]) if on_source and series is not None else ""
                source_folder = str(sources[i]) if source_series and sources is not None else ""
                # nnU-Net names a case's mask after the case alone.
                file_name = f"{stem}.nii.gz" if is_label and self.nnunet_names and origins is None else \
                    f"{stem}_{name}.nii.gz"
                planned.append(
                    PlannedVolume(
                        self.output_dir / file_name,
                        volume,
                        affine,
                        header,
                        name,
                        source_series,
                        source_folder,
                        dict(segments) if is_label and segments else None,
                        subject,
                        i,
                        units.get(name, "image"),
                    )
                )
        return planned

    def write_metrics(self, rows: list[dict[str, Any]] | None = None) -> Path | None:
        """Write `rows` (default: the collected ones) to `<output_dir>/metrics.csv`, sorted by subject, and, where
        label maps were written, the page of every subject's picture (`index.html`)."""
        rows = self.rows if rows is None else rows
        path = self._write_table(rows, "metrics.csv")
        if self.structures and rows:
            self._check_target(self.output_dir / INDEX_FILE)
            pictures = {str(r["subject"]): self.names.stem(r["subject"]) for r in rows}
            pictures = {s: self.pictures.get(s, self._picture_name(stem)) for s, stem in pictures.items()}
            write_index(self.output_dir, rows, pictures, self.structures, self.volume_range)
        return path

    def _picture_name(self, stem: str) -> str:
        """A picture another rank wrote for `stem` (the first label map's), by its name on disk."""
        found = sorted(self.output_dir.glob(f"{stem}_*.png"))
        return found[0].name if found else ""

    def write_predictions(self) -> Path | None:
        """Write the collected `"rows"` outputs (risks, class probabilities) to `<output_dir>/predictions.csv`."""
        return self._write_table(self.prediction_rows, "predictions.csv")

    def _write_table(self, rows: list[dict[str, Any]], name: str) -> Path | None:
        if not rows:
            return None
        rows = sorted(rows, key=lambda row: row["subject"])
        columns = list(dict.fromkeys(key for row in rows for key in row))
        path = self.output_dir / name
        self._check_target(path)
        with open_in(self.root, path, "w", newline="") as handle:
            writer = csv.DictWriter(handle, fieldnames=columns)
            writer.writeheader()
            writer.writerows(rows)
        return path
