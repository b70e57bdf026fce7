"""predict.py from radiographs alone: a CT generated from each subject's `<subject>_<view>.nii.gz` (or `.dcm`) files.

A model that generates from the batch key `xray` (X-ray-to-CT: `generation_inputs() == {"xray": V}`)
is given a folder of 2D radiographs, one file per view and subject, as
`python -m datamodules.sources.example_data xray_ct` writes them: 1 - I/I0 in [0, 1), the pixel
spacing (rows, columns) in mm and the orientation in the header's affine (sform or qform): where
in the patient (RAS) the rows and the columns run. Each view is put into the projector's display
convention (`medvol.volumes.projection.VIEW_FRAME`: rows from the head down, AP columns from the
patient's right to left, lateral columns from front to back) by turning and mirroring it as its
affine says (a DICOM radiograph `<subject>_<view>.dcm`, CR or DX, gets its affine from PatientOrientation and
its pixel spacing and its values from its stored range, MONOCHROME1 inverted: `medvol.volumes.dicom_radiograph`):
a PA film (seen from behind, the patient's right on the viewer's right) is, under the
parallel-beam projector, the AP view mirrored, and a right lateral the left one mirrored. A view
with no orientation, an oblique one, one in another plane than its name says (a lateral labelled
AP), values outside the model's 1 - I/I0 in [0, 1] (a raw 12-bit detector image), or a size or
pixel spacing other than the model was trained with (from its run's dataset: the CT grid's field of
view over the view size) is refused; each with one line naming the file before anything is written. Each subject's
views go through the family's `generate_volumes` (the sampling code of `test=true`), and its CT is
written in HU as `<subject>_ct.nii.gz` on the stage's grid: its size and spacing, RAS, centred on
the origin as the training volumes were. HU beyond the window is written as generated (no clamp).
With `num_samples=N > 1`, N seeded draws `<subject>_ct_<k>.nii.gz` (draw 0 is the single-sample CT)
and their voxel-wise `<subject>_ct_mean.nii.gz` and `<subject>_ct_std.nii.gz` (HU; the spread
scaled without the window's offset), as `medvol.run.generation.sampled_outputs` gives them.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import nibabel as nib
import numpy as np
import torch
from omegaconf import DictConfig

from lightning_modules.base import MedvolModule
from medvol.core.console import log_file
from medvol.core.errors import MedvolError
from medvol.run.generation import sampled_outputs
from medvol.run.predict_batch import LOG_FILE, peak_memory, summary_line
from medvol.run.predict_inputs import check_output_dir
from medvol.volumes.dicom_radiograph import read_radiograph
from medvol.volumes.projection import VIEW_FRAME, view_pixel_spacing
from medvol.volumes.volume_budget import load_nifti

if TYPE_CHECKING:
    from medvol.run.predict_check import PredictRequest

log = logging.getLogger("medvol")

# The files a view may be: a 2D NIfTI, or a DICOM radiograph (CR, DX) as `medvol.volumes.dicom_radiograph` reads it.
RADIOGRAPH_SUFFIXES = (".nii.gz", ".nii", ".dcm")
# A view's pixel spacing counts as the training one within this relative margin.
SPACING_TOLERANCE = 1e-3
# A file axis runs along a patient axis when its direction is within ~25 degrees of it (cosine 0.9).
ALIGNMENT = 0.9
# RAS (axis, sign) -> the direction's name.
TOWARD = {(0, 1): "right", (0, -1): "left", (1, 1): "front", (1, -1): "back", (2, 1): "head", (2, -1): "feet"}
PLANES = {frozenset({0, 2}): "coronal (an AP view's)", frozenset({1, 2}): "sagittal (a lateral view's)",
          frozenset({0, 1}): "axial (no radiograph's)"}


@dataclass(frozen=True)
class ViewGeometry:
    """What the model's radiographs were: view names, (rows, columns), and the CT grid they were projected from."""

    views: list[str]
    size: tuple[int, int]
    grid: tuple[int, int, int]
    spacing: tuple[float, float, float]
    output_range: tuple[float, float]

    def pixel_spacing(self, view: str) -> tuple[float, float]:
        """(row, column) mm of a view (`view_pixel_spacing` over the CT grid's extent)."""
        return view_pixel_spacing(view, [g * d for g, d in zip(self.grid, self.spacing, strict=True)], self.size)

    def affine(self) -> np.ndarray:
        """The RAS affine of the CT grid, centred on the origin (as the training phantoms and crops)."""
        affine = np.diag([*self.spacing, 1.0])
        affine[:3, 3] = -np.asarray(self.spacing) * (np.asarray(self.grid) - 1) / 2
        return affine


def view_geometry(run: DictConfig) -> ViewGeometry:
    """The radiograph geometry of a run's dataset (`synthetic` with views, or `xray_ct`)."""
    dataset = run.dataset
    transforms = dataset.get("transforms") or {}
    if transforms:
        grid, spacing = transforms.get("spatial_size"), transforms.get("spacing")
        output_range = transforms.get("output_range") or (-1.0, 1.0)
    else:
        size, step = dataset.get("size"), dataset.get("spacing")
        grid = [size] * 3 if isinstance(size, int) else size
        spacing = [step] * 3 if isinstance(step, (int, float)) else step
        output_range = (-1.0, 1.0)
    if not grid or not spacing:
        raise MedvolError(
            "the model's run resamples its CTs to no fixed grid (`dataset.transforms.spatial_size` and `.spacing`), so "
            "the pixel spacing of its radiographs is unknown; predict from radiographs needs a run with both set"
        )
    rows, columns = (int(s) for s in dataset.xray_size)
    return ViewGeometry(
        list(dataset.views),
        (rows, columns),
        tuple(int(g) for g in grid),
        tuple(float(s) for s in spacing),  # type: ignore[arg-type]
        (float(output_range[0]), float(output_range[1])),
    )


def _radiograph_stem(path: Path) -> str | None:
    """`<subject>_<view>` of a radiograph file (`.nii`, `.nii.gz` or a DICOM `.dcm`), None for any other file."""
    for suffix in RADIOGRAPH_SUFFIXES:
        if path.name.lower().endswith(suffix) and len(path.name) > len(suffix):
            return path.name[: -len(suffix)]
    return None


def radiograph_subjects(folder: Path, geometry: ViewGeometry) -> dict[str, dict[str, Path]]:
    """subject -> view -> file, for every `<subject>_<view>.nii(.gz)` or `.dcm` in `folder`; each subject must have
    every view, each view one file."""
    found: dict[str, dict[str, Path]] = {}
    for path in sorted(folder.iterdir()):
        stem = _radiograph_stem(path)
        if stem is None or not path.is_file():
            continue
        for view in geometry.views:
            if stem.endswith(f"_{view}"):
                subject = stem.removesuffix(f"_{view}")
                if view in found.get(subject, {}):
                    raise MedvolError(
                        f"`input`: subject {subject} has two {view} views ({found[subject][view].name} and "
                        f"{path.name}); expected one file per view"
                    )
                found.setdefault(subject, {})[view] = path
    if not found:
        names = " and ".join(f"<subject>_{v}.nii.gz" for v in geometry.views)
        raise MedvolError(f"`input`: {folder} holds no radiographs; expected {names} (or .dcm) per subject")
    for subject, views in found.items():
        missing = [v for v in geometry.views if v not in views]
        if missing:
            raise MedvolError(
                f"`input`: subject {subject} has no {' or '.join(missing)} view "
                f"({', '.join(f'{subject}_{m}.nii.gz' for m in missing)}); the model generates from the views "
                f"{geometry.views} of every subject"
            )
    return found


def _direction(vector: np.ndarray) -> tuple[int, int] | None:
    """The RAS (axis, sign) a file axis runs along, or None when it runs along none (oblique, or no length)."""
    length = float(np.linalg.norm(vector))
    if length == 0.0:
        return None
    axis = int(np.argmax(np.abs(vector)))
    return (axis, int(np.sign(vector[axis]))) if abs(vector[axis]) / length >= ALIGNMENT else None


def in_view_frame(
    image: nib.Nifti1Image, data: np.ndarray, path: Path, view: str
) -> tuple[np.ndarray, tuple[float, float]]:
    """The pixels turned (and mirrored, a PA film's or a right lateral's) into the projector's frame for `view`
    (`VIEW_FRAME`) and their (row, column) spacing in mm, from the file's affine; refused when the file has no usable
    orientation or lies in another plane."""
    if int(image.header["sform_code"]) == 0 and int(image.header["qform_code"]) == 0:
        raise MedvolError(
            f"`input`: {path.name} has no orientation (sform and qform codes 0); expected a 2D NIfTI whose affine says "
            "where its rows and columns run in the patient, as `python -m datamodules.sources.example_data xray_ct "
            "example_xrays` writes them"
        )
    affine = np.asarray(image.affine, dtype=np.float64)
    axes = [_direction(affine[:3, 0]), _direction(affine[:3, 1])]
    if None in axes:
        raise MedvolError(
            f"`input`: {path.name}'s rows or columns run obliquely to the patient's axes; expected them along "
            "the head-feet axis and one other patient axis"
        )
    rows, columns = axes[0], axes[1]
    expected = VIEW_FRAME[view]
    plane = frozenset({rows[0], columns[0]})
    if plane != frozenset({expected[0][0], expected[1][0]}):
        raise MedvolError(
            f"`input`: {path.name} is named a {view} view but its orientation puts it in the "
            f"{PLANES.get(plane, 'an odd')} plane (rows toward the {TOWARD[rows]}, columns toward the "
            f"{TOWARD[columns]}); give the view its own name"
        )
    spacing = (float(np.linalg.norm(affine[:3, 0])), float(np.linalg.norm(affine[:3, 1])))
    transposed = rows[0] != expected[0][0]
    if transposed:
        data, rows, columns, spacing = data.T, columns, rows, (spacing[1], spacing[0])
    # A parallel-beam projection seen from the other side is the same image mirrored: the affine says which way.
    flip_rows, flip_columns = rows[1] != expected[0][1], columns[1] != expected[1][1]
    data = data[::-1] if flip_rows else data
    data = data[:, ::-1] if flip_columns else data
    return np.ascontiguousarray(data), spacing


def check_values(data: np.ndarray, stored: np.dtype, path: Path) -> None:
    """Refuse pixel values outside the range the model learned: 1 - I/I0 in [0, 1], finite."""
    if data.size and np.isfinite(data).all() and float(data.min()) >= 0.0 and float(data.max()) <= 1.0:
        return
    finite = data[np.isfinite(data)]
    span = f"{float(finite.min()):g}..{float(finite.max()):g}" if finite.size else "no finite value"
    kind = f" (stored as {stored}: detector counts?)" if np.issubdtype(stored, np.integer) else ""
    raise MedvolError(
        f"`input`: {path.name} holds values {span}{kind}{'' if np.isfinite(data).all() else ' and NaN or Inf'}; "
        "the model learned radiographs as 1 - I/I0 in [0, 1] (a DRR's attenuation); convert the view to that range"
    )


def read_view(path: Path, view: str, geometry: ViewGeometry) -> np.ndarray:
    """One radiograph as (rows, columns) in the projector's frame, refused unless its values are 1 - I/I0 in [0, 1],
    its orientation fits its view name and its size and pixel spacing are the training views'."""
    if path.name.lower().endswith(".dcm"):
        radiograph = read_radiograph(path)
        data, image = radiograph.pixels, nib.Nifti1Image(radiograph.pixels, radiograph.affine)
    else:
        image = load_nifti(path)
        data = np.asarray(image.dataobj, dtype=np.float32)
        check_values(data, image.get_data_dtype(), path)
        data = data.reshape(data.shape[:2]) if data.ndim > 2 and int(np.prod(data.shape[2:])) == 1 else data
    data, spacing = in_view_frame(image, data, path, view)
    if data.shape != geometry.size:
        raise MedvolError(
            f"`input`: {path.name} is a {'x'.join(map(str, data.shape))} image; the model was trained on "
            f"{geometry.size[0]}x{geometry.size[1]} {view} radiographs"
        )
    expected = geometry.pixel_spacing(view)
    if not np.allclose(spacing, expected, rtol=SPACING_TOLERANCE, atol=0.0):
        raise MedvolError(
            f"`input`: {path.name} has pixels of {spacing[0]:g} x {spacing[1]:g} mm; "
            f"the model's {view} radiographs have {expected[0]:g} x {expected[1]:g} mm (rows x columns); "
            "resample the view to that spacing"
        )
    return data


def model_views(folder: Path, geometry: ViewGeometry) -> dict[str, torch.Tensor]:
    """subject -> (V, H, W) views in the model's range, in the model's view order, every file checked."""
    low, high = geometry.output_range
    views = {}
    for subject, files in radiograph_subjects(folder, geometry).items():
        radiographs = torch.from_numpy(np.stack([read_view(files[v], v, geometry) for v in geometry.views]))
        views[subject] = low + radiographs * (high - low)
    return views


def in_hounsfield(
    volume: torch.Tensor, window: Sequence[float], output_range: Sequence[float], spread: bool
) -> np.ndarray:
    """Model units -> HU by the window's linear map, unclamped; a spread (std) takes the scale without the offset."""
    scale = (float(window[1]) - float(window[0])) / (float(output_range[1]) - float(output_range[0]))
    if spread:
        return (volume.float().cpu() * scale).numpy().astype(np.float32)
    return (float(window[0]) + (volume.float().cpu() - float(output_range[0])) * scale).numpy().astype(np.float32)


def ct_from_radiographs(
    module: MedvolModule, run: DictConfig, folder: Path, output_dir: Path, device: torch.device, num_samples: int = 1
) -> int:
    """Write `<subject>_ct.nii.gz` (HU) for every subject in `folder`, or with `num_samples` > 1 the draws, their mean
    and std; every file is checked before the first write."""
    geometry = view_geometry(run)
    views = model_views(folder, geometry)
    output_dir.mkdir(parents=True, exist_ok=True)
    for subject, radiographs in views.items():
        batch: dict[str, Any] = {"xray": radiographs[None].to(device), "subject": [subject]}
        outputs = sampled_outputs(module, batch, num_samples)
        spreads = set(outputs.get("spreads") or [])
        for name, volume in outputs["volumes"].items():
            hounsfield = in_hounsfield(volume[0, 0], outputs["window"], geometry.output_range, name in spreads)
            nib.save(nib.Nifti1Image(hounsfield, geometry.affine()), str(output_dir / f"{subject}_{name}.nii.gz"))
    return len(views)


def radiograph_cts(request: PredictRequest, module: MedvolModule, run: DictConfig) -> dict[str, float]:
    """A CT for each subject of the request's folder of radiographs (`ct_from_radiographs`), logged beside them."""
    source, output_dir = request.source, request.output_dir
    if source is None or not source.is_dir():
        raise MedvolError(
            f"`input`: {source} is not a folder; the model generates a CT from radiographs, expected a folder of "
            "<subject>_ap.nii.gz and <subject>_lateral.nii.gz files"
        )
    check_output_dir(output_dir, [source])
    with log_file(output_dir / LOG_FILE):
        count = ct_from_radiographs(module, run, source, output_dir, request.device, request.num_samples)
        log.info(summary_line([], count, output_dir))
        log.info(peak_memory(request.device))
    return {}
