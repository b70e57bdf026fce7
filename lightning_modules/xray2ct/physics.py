"""Projection consistency: the radiographs of a predicted CT should equal the input views."""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

from lightning_modules.xray2ct.body_metrics import to_hounsfield
from medvol.volumes.projection import radiographs, voxel_spacing


class ProjectionLoss(torch.nn.Module):
    """L1 between the DRRs of a volume in model units and the batch's views (the same projector as the data).

    The volume is mapped back to Hounsfield units with the dataset's window (linearly, unclamped), projected with
    `medvol.volumes.projection.radiographs` at each sample's voxel spacing, and compared with the
    views. It is zero for the true CT when the views were made from it within the window, and
    differentiable with respect to the volume.

    Args:
        views: view names in the order of the batch's `xray` channels.
        window: the HU window the dataset mapped onto `output_range`.
        output_range: the model's intensity range (and the views').
        mu_water: attenuation of water per mm, as the dataset used.
    """

    def __init__(
        self, views: Sequence[str], window: Sequence[float] = (-1000.0, 1000.0),
        output_range: Sequence[float] = (-1.0, 1.0), mu_water: float = 0.02,
    ) -> None:
        super().__init__()
        self.views = list(views)
        self.window = (float(window[0]), float(window[1]))
        self.output_range = (float(output_range[0]), float(output_range[1]))
        self.mu_water = mu_water

    def project(self, volume: torch.Tensor, affine: torch.Tensor, size: Sequence[int]) -> torch.Tensor:
        """(B, 1, x, y, z) model-unit volumes -> (B, V, H, W) views in `output_range`."""
        # Unclamped: a voxel predicted beyond the window (bone, metal) still projects, and gets a gradient.
        hounsfield = to_hounsfield(volume[:, 0], self.window, self.output_range)
        return radiographs(hounsfield, voxel_spacing(affine), self.views, size, self.mu_water, self.output_range)

    def forward(self, volume: torch.Tensor, views: torch.Tensor, affine: torch.Tensor) -> torch.Tensor:
        return F.l1_loss(self.project(volume, affine, views.shape[-2:]), views.float())
