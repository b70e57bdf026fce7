"""Write volumes as NIfTI on the voxel grid they came from: the source affine, and the source header when given."""

from __future__ import annotations

from pathlib import Path

import nibabel as nib
import numpy as np
import torch


def save_volume(
    volume: torch.Tensor | np.ndarray,
    path: str | Path,
    affine: torch.Tensor | np.ndarray,
    header: nib.Nifti1Header | str | Path | None = None,
) -> Path:
    """Save a (D, H, W) or (C, D, H, W) volume to `path` (.nii or .nii.gz).

    Channels go to the fourth NIfTI axis. The batch's `affine` places the volume in the
    source's world space; `header` (a NIfTI header, or the path of the source file) carries
    over its units, descriptions and codes. Integer tensors (label maps) keep an integer type.

    Args:
        volume: the volume; batch dicts give (C, D, H, W) per sample.
        path: output file; parent folders are created.
        affine: 4x4 voxel-to-world matrix (the batch's `affine` for that sample).
        header: source header or source file; None writes a fresh header.
    """
    data = volume.detach().cpu().numpy() if isinstance(volume, torch.Tensor) else np.asarray(volume)
    if data.ndim == 4:
        data = data[0] if data.shape[0] == 1 else np.moveaxis(data, 0, -1)
    if data.ndim not in (3, 4):
        raise ValueError(f"`volume` must be (D, H, W) or (C, D, H, W), got shape {tuple(volume.shape)}")
    if data.dtype == np.float64:
        data = data.astype(np.float32)
    elif data.dtype == np.int64:
        data = data.astype(np.int32)
    elif data.dtype == bool:
        data = data.astype(np.uint8)
    matrix = affine.detach().cpu().numpy() if isinstance(affine, torch.Tensor) else np.asarray(affine)
    if isinstance(header, (str, Path)):
        header = nib.load(str(header)).header
    image = nib.Nifti1Image(data, matrix.astype(np.float64), header=header.copy() if header is not None else None)
    # The data type is the volume's, not the source's (a float reconstruction of an int16 scan).
    image.set_data_dtype(data.dtype)
    image.header.set_qform(matrix, code=1)
    image.header.set_sform(matrix, code=1)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    nib.save(image, str(path))
    return path
