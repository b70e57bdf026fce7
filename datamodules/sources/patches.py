"""Large volumes trained as patches: each step loads a volume and draws `patches_per_volume` patches from it.

As in the CTPA VQ-GAN setup (512x512x604 volumes, ~80 patches of 128^3 per volume per
step). A loader batch of `batch_size` volumes becomes `batch_size * patches_per_volume`
patches. Each patch carries its own `affine` (the volume's, shifted to the patch corner),
`patch_origin` (voxel index of the corner) and `volume_shape` (the grid it was cut from), so outputs
can be written or stitched in place and a model can know where in the volume a patch lies.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Hashable, Mapping, Sequence
from typing import Any

import numpy as np
import torch
from monai.data import list_data_collate
from monai.transforms import EnsureTyped, MapTransform, Randomizable, SpatialPadd
from monai.transforms.utils import generate_pos_neg_label_crop_centers, map_binary_to_indices

from datamodules.sources.nifti import BATCH_KEYS, NiftiDataModule
from medvol.core.errors import MedvolError

SAMPLING = ("grid", "random", "label_balanced")


def grid_origins(shape: Sequence[int], patch: Sequence[int], stride: Sequence[int]) -> list[tuple[int, ...]]:
    """Patch corners every `stride` voxels, plus a last one flush with the far edge, so the grid covers the volume."""
    per_axis = []
    for n, p, s in zip(shape, patch, stride, strict=True):
        starts = list(range(0, max(n - p, 0) + 1, s))
        if starts[-1] + p < n:
            starts.append(n - p)
        per_axis.append(starts)
    return list(itertools.product(*per_axis))


class PatchSamplesd(Randomizable, MapTransform):
    """Cut `num_patches` patches out of a (C, D, H, W) item; returns a list of items, one per patch.

    Args:
        keys: volumes cut alike (image, cond, label).
        patch_size: patch edge lengths.
        stride: grid step (grid sampling).
        num_patches: patches per volume.
        sampling: grid (random grid cells when training, evenly spread ones otherwise), random, or
            label_balanced (a `pos_ratio` share centred on label > 0).
        train: draw at random; otherwise take a fixed, evenly spread set of grid cells.
        label_key: the label, for label_balanced sampling.
        pos_ratio: share of foreground-centred patches (label_balanced).
    """

    def __init__(
        self,
        keys: Sequence[str],
        patch_size: Sequence[int],
        stride: Sequence[int],
        num_patches: int,
        sampling: str = "grid",
        train: bool = True,
        label_key: str | None = None,
        pos_ratio: float = 0.5,
    ) -> None:
        MapTransform.__init__(self, keys, allow_missing_keys=True)
        self.patch_size = [int(p) for p in patch_size]
        self.stride = [int(s) for s in stride]
        self.num_patches = num_patches
        self.sampling = sampling
        self.train = train
        self.label_key = label_key
        self.pos_ratio = pos_ratio

    def _origins(self, data: Mapping[Hashable, Any], shape: Sequence[int]) -> list[tuple[int, ...]]:
        if not self.train or self.sampling == "grid":
            grid = grid_origins(shape, self.patch_size, self.stride)
            if not self.train:
                picks = np.unique(np.linspace(0, len(grid) - 1, min(self.num_patches, len(grid))).round().astype(int))
            else:
                picks = self.R.choice(len(grid), self.num_patches, replace=self.num_patches > len(grid))
            return [grid[i] for i in picks]
        if self.sampling == "random":
            return [tuple(int(self.R.randint(0, n - p + 1)) for n, p in zip(shape, self.patch_size, strict=True))
                    for _ in range(self.num_patches)]
        label = data[self.label_key]
        foreground, background = map_binary_to_indices(label)
        centres = generate_pos_neg_label_crop_centers(
            self.patch_size, self.num_patches, self.pos_ratio, shape, foreground, background, self.R
        )
        return [tuple(int(c) - p // 2 for c, p in zip(centre, self.patch_size, strict=True)) for centre in centres]

    def randomize(self, data: Any = None) -> None:
        """Randomness is drawn in `_origins`, from this transform's own state."""

    def __call__(self, data: Mapping[Hashable, Any]) -> list[dict[Hashable, Any]]:
        keys = [k for k in self.key_iterator(dict(data))]
        shape = tuple(data[keys[0]].shape[1:])
        patches = []
        for origin in self._origins(data, shape):
            item = dict(data)
            window = tuple(slice(o, o + p) for o, p in zip(origin, self.patch_size, strict=True))
            for key in keys:
                item[key] = data[key][(slice(None), *window)]
            if "affine" in data:
                affine = data["affine"].clone()
                affine[:3, 3] += affine[:3, :3] @ torch.tensor(origin, dtype=affine.dtype)
                item["affine"] = affine
            item["patch_origin"] = torch.tensor(origin, dtype=torch.int64)
            item["volume_shape"] = torch.tensor(shape, dtype=torch.int64)
            patches.append(item)
        return patches


class PatchesDataModule(NiftiDataModule):
    """Large NIfTI volumes (listed as for `nifti`) trained as patches.

    Args:
        patch_size: patch edge lengths (volumes smaller than this are padded).
        stride: grid step; equal to `patch_size` for non-overlapping patches.
        patches_per_volume: patches drawn from each volume per step.
        sampling: grid, random or label_balanced (needs `label_file`).
        pos_ratio: share of label-centred patches for label_balanced sampling.
        **kwargs: listing, transforms, split, loader and cache settings of `NiftiDataModule`.
    """

    def __init__(
        self,
        patch_size: Sequence[int] = (128, 128, 128),
        stride: Sequence[int] | None = None,
        patches_per_volume: int = 8,
        sampling: str = "grid",
        pos_ratio: float = 0.5,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        self.patch_size = [int(p) for p in patch_size]
        self.stride = [int(s) for s in (stride or patch_size)]
        if len(self.patch_size) != 3 or min(self.patch_size) < 1:
            raise MedvolError(f"`dataset.patch_size` must be three positive ints, got {list(patch_size)}")
        if len(self.stride) != 3 or min(self.stride) < 1:
            raise MedvolError(f"`dataset.stride` must be three positive ints, got {list(self.stride)}")
        if sampling not in SAMPLING:
            raise MedvolError(f"`dataset.sampling` is {sampling!r}; expected one of {list(SAMPLING)}")
        if sampling == "label_balanced" and not (self.label_file or self.list_file):
            raise MedvolError("`dataset.sampling=label_balanced` needs label maps: set `dataset.label_file`")
        if patches_per_volume < 1:
            raise MedvolError(f"`dataset.patches_per_volume` must be >= 1, got {patches_per_volume}")
        if not 0.0 <= pos_ratio <= 1.0:
            raise MedvolError(f"`dataset.pos_ratio` must be in [0, 1], got {pos_ratio}")
        self.patches_per_volume = patches_per_volume
        self.sampling = sampling
        self.pos_ratio = pos_ratio
        # Items are lists of patches; MONAI's collate flattens them into one batch.
        self.collate_fn = list_data_collate

    def batch_keys(self) -> list[str]:
        return [*BATCH_KEYS, "patch_origin", "volume_shape"]

    def deterministic(self, stage: str) -> list[Callable]:
        chain = super().deterministic(stage)
        low = self.settings.output_range[0] if self.settings.intensity != "none" else 0.0
        # Padded at the far end only, so the stored affine still maps voxel (0, 0, 0).
        chain.append(SpatialPadd(self.image_keys(), self.patch_size, method="end", value=low))
        keys = self.image_keys()
        if self.label_key:
            chain.append(SpatialPadd([self.label_key], self.patch_size, method="end", value=0))
            keys.append(self.label_key)
        # Padding brings MONAI's metadata back: plain tensors again, as the cache holds for every dataset.
        chain.append(EnsureTyped(keys, track_meta=False))
        return chain

    def random(self, stage: str) -> list[Callable]:
        keys = self.image_keys() + ([self.label_key] if self.label_key else [])
        sampler = PatchSamplesd(
            keys, self.patch_size, self.stride, self.patches_per_volume, self.sampling, train=stage == "train",
            label_key=self.label_key, pos_ratio=self.pos_ratio,
        )
        # Augmentations run per patch, after cutting: cheaper than on the whole volume.
        return [sampler, *super().random(stage)]

    def cache_key(self) -> dict[str, Any]:
        return {**super().cache_key(), "patch_size": self.patch_size}
