"""Map a volume from the model's voxel grid back onto the voxel grid of the file it came from.

The transforms between a file and the model (reorientation, resampling to a spacing, crop and
pad) all change the voxel-to-world affine and nothing else of the geometry, so the model grid's
affine and the source file's affine and shape are enough to undo them: every source voxel is
looked up at its world position in the model grid. Labels take the nearest voxel (values stay
exact integers), intensities are interpolated linearly; source voxels outside the model grid
(cropped away) take `fill`.

`oriented_spacing` says what voxel size a file has once reoriented (in the axes the model sees).

A segmentation's logits go back as nnU-Net's do (`logits_to_source_grid`, its `resample_data_or_seg_to_shape` with
the plans' `resampling_fn_probabilities`): linearly within the model grid's extent (the edge voxels held up to half a
voxel beyond, as its resampling of the cropped box repeats its edge), the background beyond; and where either grid
is over 3x anisotropic, the coarse axis by nearest neighbour and only the others linearly.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import nibabel as nib
import numpy as np
import torch
import torch.nn.functional as F

from medvol.volumes.plan import separate_axis
from medvol.volumes.volume_budget import load_nifti
from medvol.volumes.volume_reader import VolumeReader

MODES = ("nearest", "linear")
# Source voxels per lookup chunk: bounds the float64 coordinate buffers to ~50 MB.
_CHUNK_VOXELS = 2_000_000


@dataclass(frozen=True)
class SourceGrid:
    """The voxel grid of a source file: its 4x4 voxel-to-world `affine` and spatial `shape` (D, H, W).

    Args:
        affine: 4x4 voxel-to-world matrix of the file (NIfTI world, mm).
        shape: the file's three spatial dimensions.
        header: the file's NIfTI header when read from a file (carried over when writing).
    """

    affine: np.ndarray
    shape: tuple[int, int, int]
    header: nib.Nifti1Header | None = None

    @classmethod
    def from_file(cls, path: str | Path) -> SourceGrid:
        """The grid of a NIfTI file, from its header only (no voxels are read)."""
        image = load_nifti(path)
        return cls(np.asarray(image.affine, dtype=np.float64), tuple(int(s) for s in image.shape[:3]), image.header)


def as_source_grid(
    source: SourceGrid | str | Path | tuple[torch.Tensor | np.ndarray, Sequence[int] | torch.Tensor],
) -> SourceGrid:
    """A `SourceGrid` from a grid, a NIfTI path, or an (affine, shape) pair such as a batch's
    `source_affine`/`source_shape`."""
    if isinstance(source, SourceGrid):
        return source
    if isinstance(source, (str, Path)):
        return SourceGrid.from_file(source)
    affine, shape = source
    matrix = affine.detach().cpu().numpy() if isinstance(affine, torch.Tensor) else np.asarray(affine)
    sizes = shape.tolist() if isinstance(shape, torch.Tensor) else list(shape)
    return SourceGrid(matrix.astype(np.float64), tuple(int(s) for s in sizes))


def oriented_spacing(affine: torch.Tensor | np.ndarray, orientation: str | None) -> list[float]:
    """The voxel size (mm) along each axis of a grid once reoriented to `orientation`.

    Args:
        affine: 4x4 voxel-to-world matrix of the grid as stored.
        orientation: axis codes the volume is reoriented to (e.g. RAS, as MONAI's `Orientationd` does
            with nibabel's closest-axis rule, also for oblique grids); None keeps the stored axes.
    """
    matrix = affine.detach().cpu().numpy() if isinstance(affine, torch.Tensor) else np.asarray(affine)
    matrix = matrix.astype(np.float64)
    zooms = np.sqrt((matrix[:3, :3] ** 2).sum(axis=0))
    if not orientation:
        return [float(z) for z in zooms]
    # Row i: the axis stored axis i becomes, and whether it flips.
    transform = nib.orientations.ornt_transform(
        nib.orientations.io_orientation(matrix), nib.orientations.axcodes2ornt(tuple(orientation))
    )
    spacing = [0.0] * 3
    for axis, (target, _) in enumerate(transform):
        spacing[int(target)] = float(zooms[axis])
    return spacing


def source_positions(grid: SourceGrid, mapping: np.ndarray) -> Iterator[tuple[int, int, np.ndarray]]:
    """Blocks of the source grid's rows (along its first axis, about `_CHUNK_VOXELS` voxels each): (start, stop, the
    (N, 3) positions of their voxels on the model grid in voxel indices), `mapping` taking source voxel indices to
    model ones."""
    rows = max(1, _CHUNK_VOXELS // max(1, grid.shape[1] * grid.shape[2]))
    for start in range(0, grid.shape[0], rows):
        stop = min(start + rows, grid.shape[0])
        index = np.stack(
            np.meshgrid(np.arange(start, stop), np.arange(grid.shape[1]), np.arange(grid.shape[2]), indexing="ij"), -1
        ).reshape(-1, 3)
        yield start, stop, index @ mapping[:3, :3].T + mapping[:3, 3]


def to_source_grid(
    volume: torch.Tensor,
    source: SourceGrid | str | Path | tuple[torch.Tensor | np.ndarray, Sequence[int] | torch.Tensor],
    transformed_affine: torch.Tensor | np.ndarray,
    mode: str = "nearest",
    fill: float | Sequence[float] = 0.0,
) -> torch.Tensor:
    """Resample `volume` from the model grid onto the source file's grid.

    Args:
        volume: (C, D, H, W) or (D, H, W) on the model grid; integer volumes (label maps) need `nearest`.
        source: the source grid: a `SourceGrid`, the source NIfTI path, or (affine, shape).
        transformed_affine: 4x4 voxel-to-world matrix of the model grid (a batch's `affine`).
        mode: `nearest` (labels) or `linear` (intensities).
        fill: value of source voxels the model grid does not cover (cropped away); one per channel or one for all
            (class probabilities: 1 for the background, 0 for the others).

    Returns:
        (C, *source shape), or (*source shape) for a 3D input, same dtype and device as `volume`.
    """
    if mode not in MODES:
        raise ValueError(f"`mode` must be one of {list(MODES)}, got {mode!r}")
    if volume.ndim not in (3, 4):
        raise ValueError(f"`volume` must be (D, H, W) or (C, D, H, W), got shape {tuple(volume.shape)}")
    if mode == "linear" and not torch.is_floating_point(volume):
        raise ValueError(f"`mode` linear needs a floating-point volume, got {volume.dtype}; use nearest for label maps")
    grid = as_source_grid(source)
    model_affine = (
        transformed_affine.detach().cpu().numpy()
        if isinstance(transformed_affine, torch.Tensor)
        else transformed_affine
    )
    # Source voxel index -> model voxel index.
    mapping = np.linalg.inv(np.asarray(model_affine, dtype=np.float64)) @ grid.affine
    channels = volume if volume.ndim == 4 else volume[None]
    model_shape = channels.shape[1:]
    fills = [float(f) for f in fill] if isinstance(fill, Sequence) else [float(fill)] * channels.shape[0]
    if len(fills) != channels.shape[0]:
        raise ValueError(f"`fill` has {len(fills)} values; expected one per channel ({channels.shape[0]}) or one")
    per_channel = torch.tensor(fills, dtype=channels.dtype if channels.is_floating_point() else torch.float64)
    out = channels.new_empty((channels.shape[0], *grid.shape))
    for c, value in enumerate(fills):
        out[c] = value
    for start, stop, coords in source_positions(grid, mapping):
        block = out[:, start:stop]
        if mode == "nearest":
            nearest = np.rint(coords).astype(np.int64)
            inside = np.all((nearest >= 0) & (nearest < np.asarray(model_shape)), axis=1)
            picked = torch.from_numpy(nearest[inside]).to(volume.device)
            flat = block.reshape(block.shape[0], -1)
            flat[:, torch.from_numpy(inside).to(volume.device)] = channels[:, picked[:, 0], picked[:, 1], picked[:, 2]]
            out[:, start:stop] = flat.reshape(block.shape)
        else:
            # grid_sample wants (x, y, z) = (W, H, D) order in [-1, 1], corners aligned with voxel centres.
            scale = np.asarray([max(n - 1, 1) for n in model_shape], dtype=np.float64)
            normalised = (coords / scale * 2 - 1)[:, ::-1].copy()
            sample_grid = torch.from_numpy(normalised).to(device=volume.device, dtype=channels.dtype)
            sample_grid = sample_grid.reshape(1, stop - start, grid.shape[1], grid.shape[2], 3)
            offset = per_channel.to(channels.device).reshape(-1, 1, 1, 1)
            sampled = F.grid_sample(
                (channels - offset)[None], sample_grid, mode="bilinear", padding_mode="zeros", align_corners=True
            )[0]
            out[:, start:stop] = sampled + offset
    return out if volume.ndim == 4 else out[0]


def logits_to_source_grid(
    logits: torch.Tensor,
    source: SourceGrid | str | Path | tuple[torch.Tensor | np.ndarray, Sequence[int] | torch.Tensor],
    transformed_affine: torch.Tensor | np.ndarray,
    fill: Sequence[float],
) -> torch.Tensor:
    """(C, D, H, W) logits on the model grid -> (C, *source shape) on the source grid, as nnU-Net resamples them.

    A source voxel whose centre lies within the model grid's extent (its nearest model voxel exists) takes the
    logits interpolated linearly there, its position held at the outermost voxel centres (nnU-Net resizes the
    cropped box edge to edge and repeats the edge); one beyond takes `fill` (logits whose softmax or sigmoid is the
    background: the box nnU-Net pads). Where the model grid's spacing, else the source's, is over 3x anisotropic
    (`medvol.volumes.plan.separate_axis`, nnU-Net's `determine_do_sep_z_and_axis`), that coarse axis is looked up by
    its nearest model slice (nnU-Net's order 0 along it, rounding halves up as scipy's `map_coordinates`) and only the
    others linearly.

    Args:
        logits: (C, D, H, W) on the model grid.
        source: the source grid: a `SourceGrid`, the source NIfTI path, or (affine, shape).
        transformed_affine: 4x4 voxel-to-world matrix of the model grid.
        fill: per channel, the logit of a voxel the model grid does not cover (may be infinite).
    """
    grid = as_source_grid(source)
    model_affine = np.asarray(
        transformed_affine.detach().cpu().numpy() if isinstance(transformed_affine, torch.Tensor)
        else transformed_affine, dtype=np.float64,
    )
    # Source voxel index -> model voxel index; per model axis the spacings of both grids along it.
    mapping = np.linalg.inv(model_affine) @ grid.affine
    model_spacing = np.sqrt((model_affine[:3, :3] ** 2).sum(axis=0))
    source_zooms = np.sqrt((grid.affine[:3, :3] ** 2).sum(axis=0))
    source_spacing = [float(source_zooms[int(np.argmax(np.abs(mapping[k, :3])))]) for k in range(3)]
    apart = separate_axis(list(model_spacing), source_spacing)
    shape = np.asarray(logits.shape[1:])
    out = logits.new_empty((logits.shape[0], *grid.shape))
    for c, value in enumerate(fill):
        out[c] = float(value)
    for start, stop, coords in source_positions(grid, mapping):
        nearest = np.floor(coords + 0.5)
        inside = np.all((nearest >= 0) & (nearest < shape), axis=1)
        held = np.clip(coords[inside], 0, shape - 1)
        if apart is not None:
            held[:, apart] = nearest[inside][:, apart]
        # grid_sample wants (x, y, z) = (W, H, D) order in [-1, 1], corners aligned with voxel centres.
        normalised = (held / np.maximum(shape - 1, 1) * 2 - 1)[:, ::-1].copy()
        sample_grid = torch.from_numpy(normalised).to(device=logits.device, dtype=logits.dtype).reshape(1, -1, 1, 1, 3)
        sampled = F.grid_sample(logits[None], sample_grid, mode="bilinear", padding_mode="border", align_corners=True)
        block = out[:, start:stop].reshape(logits.shape[0], -1)
        block[:, torch.from_numpy(inside).to(logits.device)] = sampled[0, :, :, 0, 0]
        out[:, start:stop] = block.reshape(logits.shape[0], stop - start, *grid.shape[1:])
    return out


def label_on_source_grid(
    path: str | Path,
    source: SourceGrid | str | Path | tuple[torch.Tensor | np.ndarray, Sequence[int] | torch.Tensor],
) -> torch.Tensor:
    """The label map stored at `path` (a NIfTI file or a DICOM series folder) on the source grid, int64 (D, H, W):
    as stored where the two grids agree (the usual case), else each source voxel's nearest label voxel."""
    reader = VolumeReader()
    array, meta = reader.get_data(reader.read(str(path)))
    label = torch.from_numpy(np.rint(np.asarray(array, dtype=np.float64)).astype(np.int64))
    affine = np.asarray(meta["affine"], dtype=np.float64)
    grid = as_source_grid(source)
    if tuple(label.shape) == tuple(grid.shape) and np.allclose(affine, grid.affine, atol=1e-4):
        return label
    return to_source_grid(label, grid, affine, "nearest")
