"""Digitally reconstructed radiographs (DRRs): the X-ray projector shared by the X-ray datasets and X-ray-to-CT losses.

A DRR here is a parallel-beam line integral of the linear attenuation coefficient, which is
derived from Hounsfield units as mu = mu_water * (1 + HU / 1000), clipped at 0 (air). The
radiograph value is 1 - exp(-integral) (bright bone, dark air). Everything is differentiable
and takes leading batch dimensions, so a loss can compare the projections of a predicted CT
with the input views using the very function that made them.

Display convention (radiological, as a radiologist reads the film): rows run from the head down;
an AP view is seen from the front, so its columns run from the patient's right to left (the
patient's right on the viewer's left); a lateral view is seen from the patient's left, so its
columns run from anterior to posterior (the face on the viewer's left). `VIEW_FRAME` says the same
in RAS axes, for reading a radiograph file's orientation.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

# Spatial axis of an (x, y, z) RAS volume that each view integrates along.
VIEW_AXES = {"ap": 1, "lateral": 0}
# Per view, the RAS direction (axis, sign) its rows and its columns advance in: rows toward the feet (-z);
# AP columns toward the patient's left (-x), lateral columns toward the back (-y).
VIEW_FRAME = {"ap": ((2, -1), (0, -1)), "lateral": ((2, -1), (1, -1))}
AIR_HU = -1000.0


def drr(hounsfield: torch.Tensor, spacing: float | torch.Tensor, axis: int, mu_water: float) -> torch.Tensor:
    """Radiographs of (..., x, y, z) HU volumes: line integrals of attenuation along spatial `axis` (0..2), in [0, 1).

    `spacing` is the voxel size in mm along `axis`: a float, or a tensor of the leading shape.
    Rows of the result run along z from head (top) to feet; columns along the other in-plane axis, from its
    high end down (`VIEW_FRAME`: AP from the patient's right to left, lateral from front to back).
    """
    mu = mu_water * (1.0 + hounsfield.float() / 1000.0).clamp(min=0.0)
    if torch.is_tensor(spacing):
        spacing = spacing.to(mu).reshape(*spacing.shape, 1, 1)
    path_integral = mu.sum(dim=axis - 3) * spacing
    radiograph = 1.0 - torch.exp(-path_integral)
    return radiograph.transpose(-1, -2).flip(-2).flip(-1)


def view_pixel_spacing(view: str, extent: Sequence[float], size: Sequence[int]) -> tuple[float, float]:
    """(row, column) mm of a `view` resized to `size` (rows, columns) from a volume spanning `extent` (x, y, z) mm.

    Rows run along z (head to feet); columns along the in-plane axis the view does not integrate
    over (x for ap, y for lateral).
    """
    across = 1 - VIEW_AXES[view]
    return float(extent[2]) / int(size[0]), float(extent[across]) / int(size[1])


def voxel_spacing(affine: torch.Tensor) -> torch.Tensor:
    """Voxel sizes (..., 3) in mm from (..., 4, 4) affines."""
    return affine[..., :3, :3].double().pow(2).sum(dim=-2).sqrt().float()


def radiographs(
    hounsfield: torch.Tensor,
    spacing: torch.Tensor,
    views: Sequence[str],
    size: Sequence[int],
    mu_water: float = 0.02,
    output_range: Sequence[float] = (-1.0, 1.0),
) -> torch.Tensor:
    """The `views` of (B, x, y, z) HU volumes as (B, V, H, W) images in `output_range`.

    Args:
        hounsfield: RAS-oriented CT volumes in Hounsfield units.
        spacing: (B, 3) voxel sizes in mm (see `voxel_spacing`).
        views: names from `VIEW_AXES`.
        size: (H, W) of every view (bilinear, antialiased resize).
        mu_water: attenuation of water per mm (about 0.02 at 70 keV).
        output_range: the range [0, 1) of the radiograph is mapped onto.
    """
    low, high = float(output_range[0]), float(output_range[1])
    images = []
    for view in views:
        axis = VIEW_AXES[view]
        image = drr(hounsfield, spacing[:, axis], axis, mu_water)
        images.append(
            F.interpolate(image[:, None], size=tuple(int(s) for s in size), mode="bilinear", antialias=True)[:, 0]
        )
    return torch.stack(images, dim=1).clamp(0, 1) * (high - low) + low


def back_project(
    views: torch.Tensor,
    spacing: torch.Tensor,
    view_names: Sequence[str],
    size: Sequence[int],
    mu_water: float = 0.02,
    output_range: Sequence[float] = (-1.0, 1.0),
) -> torch.Tensor:
    """The mean of the views' unfiltered back-projections: (B, V, H, W) views -> (B, x, y, z) HU volumes.

    Each view's path integral, spread evenly along its rays, gives a volume that projects exactly
    onto that view; the views' volumes are averaged. A baseline for X-ray-to-CT, not a reconstruction.

    Args:
        views: radiographs in `output_range`, as `radiographs` makes them.
        spacing: (B, 3) voxel sizes in mm of the volume to fill.
        view_names: names from `VIEW_AXES`, in the order of the views.
        size: (x, y, z) of the volume.
        mu_water: attenuation of water per mm, as the projector used.
        output_range: the range of the views.
    """
    low, high = float(output_range[0]), float(output_range[1])
    x, y, z = (int(s) for s in size)
    volumes = []
    for index, view in enumerate(view_names):
        axis = VIEW_AXES[view]
        radiograph = ((views[:, index].float() - low) / (high - low)).clamp(0.0, 1.0 - 1e-6)
        path_integral = -torch.log1p(-radiograph)
        across = (y, x) if axis == 0 else (x, y)
        # (z from head, other axis from its high end) on the view grid -> (other axis, z) on the volume grid.
        grid = F.interpolate(path_integral[:, None], size=(z, across[1]), mode="bilinear", align_corners=False)[:, 0]
        grid = grid.flip(-1).flip(-2).transpose(-1, -2)
        length = across[0] * spacing[:, axis].reshape(-1, 1, 1)
        mu = (grid / length).unsqueeze(axis + 1).expand(-1, x, y, z)
        volumes.append(1000.0 * (mu / mu_water - 1.0))
    return torch.stack(volumes).mean(dim=0)
