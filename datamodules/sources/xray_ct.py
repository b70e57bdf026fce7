"""CT volumes with orthogonal X-ray views computed from them as digitally reconstructed radiographs (DRRs).

The projector is `medvol.volumes.projection.drr`; the radiograph is scaled to the output range.
Views go into the batch key `xray` (V, H, W): `ap` (front to back, along the RAS y axis)
and `lateral` (side to side, along x); rows run from head to feet.

The views belong to the patient, not to a cascade stage: they are projected from the CT on its own
grid (after reorientation, before any resampling) over the field of view in millimetres that the
stage's CT keeps (`spatial_size` x `spacing`), so stages whose grids cover the same millimetres
condition on the same radiographs, as a patient has one pair whatever the stage (docs/xray2ct.md).
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Mapping, Sequence
from typing import Any

import numpy as np
import torch
from monai.transforms import MapTransform, Orientationd, ResizeWithPadOrCrop, ResizeWithPadOrCropd

from datamodules.sources.nifti import BATCH_KEYS, NiftiDataModule
from medvol.core.errors import MedvolError
from medvol.volumes.projection import AIR_HU, VIEW_AXES, radiographs, voxel_spacing


class DRRd(MapTransform):
    """Adds `output_key` (V, H, W): one DRR per view of the HU volume under `key` (RAS-oriented, first channel).

    Args:
        key: the CT volume in Hounsfield units, with its affine (MetaTensor).
        views: from `ap` and `lateral`.
        size: (H, W) of every view.
        mu_water: attenuation of water per mm (about 0.02 at 70 keV).
        output_range: [-1, 1] or [0, 1].
        output_key: batch key of the views.
        field_of_view: (x, y, z) mm projected, centred on the volume (cropped, or padded with air); None: all of it.
        field_of_view_voxels: the same in voxels of the volume's own grid, for a stage that keeps each scan's grid.
    """

    def __init__(
        self, key: str, views: Sequence[str], size: Sequence[int], mu_water: float = 0.02,
        output_range: Sequence[float] = (-1.0, 1.0), output_key: str = "xray",
        field_of_view: Sequence[float] | None = None, field_of_view_voxels: Sequence[int] | None = None,
    ) -> None:
        super().__init__([key])
        self.views = list(views)
        self.size = [int(s) for s in size]
        self.mu_water = mu_water
        self.output_range = [float(r) for r in output_range]
        self.output_key = output_key
        self.field_of_view = [float(f) for f in field_of_view] if field_of_view else None
        self.field_of_view_voxels = [int(v) for v in field_of_view_voxels] if field_of_view_voxels else None

    def _voxels(self, spacing: torch.Tensor) -> list[int] | None:
        """The field of view in voxels of this grid (None: the whole volume)."""
        if self.field_of_view:
            return [max(1, round(mm / float(s))) for mm, s in zip(self.field_of_view, spacing, strict=True)]
        return self.field_of_view_voxels

    def __call__(self, data: Mapping[Hashable, Any]) -> dict[Hashable, Any]:
        d = dict(data)
        volume = d[self.keys[0]]
        spacing = voxel_spacing(torch.as_tensor(np.asarray(volume.affine)))
        voxels = self._voxels(spacing)
        if voxels is not None:
            volume = ResizeWithPadOrCrop(voxels, mode="constant", value=AIR_HU)(volume[:1])
        hounsfield = torch.as_tensor(np.asarray(volume[:1]))
        spacing = spacing[None]
        views = radiographs(hounsfield, spacing, self.views, self.size, self.mu_water, self.output_range)
        d[self.output_key] = views[0].float()
        return d


class XrayCtDataModule(NiftiDataModule):
    """CT volumes (listed as for `nifti`, in Hounsfield units) with DRR X-ray views under `xray`.

    Args:
        views: X-ray views to compute, from ap and lateral.
        xray_size: (H, W) of each view.
        mu_water: attenuation of water per mm.
        **kwargs: listing, transforms, split, loader and cache settings of `NiftiDataModule`.
    """

    def __init__(
        self, views: Sequence[str] = ("ap", "lateral"), xray_size: Sequence[int] = (128, 128), mu_water: float = 0.02,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        unknown = [v for v in views if v not in VIEW_AXES]
        if unknown or not views:
            raise MedvolError(f"`dataset.views`: {list(views)}; expected some of {list(VIEW_AXES)}")
        if len(xray_size) != 2 or min(xray_size) < 1:
            raise MedvolError(f"`dataset.xray_size` must be two positive ints (H, W), got {list(xray_size)}")
        if self.settings.orientation != "RAS":
            raise MedvolError(
                f"`dataset.transforms.orientation` is {self.settings.orientation!r}; DRR views need RAS-oriented CT"
            )
        if self.settings.has_random_spatial:
            raise MedvolError(
                "`dataset.transforms` random_crop/flip_prob/affine_prob would move the CT away from its X-ray views; "
                "set them to null/0 for dataset=xray_ct"
            )
        if len(self.image_modalities) != 1:
            raise MedvolError(f"`dataset.image_modalities` must name the one CT channel, got {self.image_modalities}")
        self.views = list(views)
        self.xray_size = [int(s) for s in xray_size]
        self.mu_water = mu_water

    def extra_deterministic(self) -> list[Callable]:
        if not self.settings.spatial_size:
            return []
        # The CT target padded with air, not with the intensity window's low end.
        return [ResizeWithPadOrCropd(["image"], self.settings.spatial_size, mode="constant", value=AIR_HU)]

    def deterministic(self, stage: str) -> list[Callable]:
        chain = super().deterministic(stage)
        # On the scan's own grid, in RAS (checked above): after reorientation, before resampling.
        after = next(i for i, step in enumerate(chain) if isinstance(step, Orientationd)) + 1
        chain.insert(after, self.views_step())
        return chain

    def views_step(self) -> DRRd:
        """The DRRs of the field of view the stage's CT keeps, in mm where it resamples, else in its own voxels."""
        size, spacing = self.settings.spatial_size, self.settings.spacing
        millimetres = [n * s for n, s in zip(size, spacing, strict=True)] if size and spacing else None
        return DRRd(
            "image", self.views, self.xray_size, self.mu_water, self.settings.output_range,
            field_of_view=millimetres, field_of_view_voxels=None if spacing else size,
        )

    def batch_keys(self) -> list[str]:
        return [*BATCH_KEYS, "xray"]

    def cache_key(self) -> dict[str, Any]:
        return {**super().cache_key(), "views": self.views, "xray_size": self.xray_size, "mu_water": self.mu_water}
