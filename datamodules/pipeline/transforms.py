"""MONAI transform chains built from the `dataset.transforms` config, and a normaliser that never divides by zero.

A chain is split in two: the deterministic part (load, orientation, spacing, intensity,
crop/pad) is what a cache stores; the random part (flips, crops, affine) runs on every
draw, after the cache, and only for training.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass, field, fields
from typing import Any

import numpy as np
import torch
from monai.transforms import (
    EnsureTyped,
    MapTransform,
    Orientationd,
    RandAffined,
    RandFlipd,
    RandSpatialCropd,
    ResizeWithPadOrCropd,
    SelectItemsd,
    Spacingd,
)
from monai.utils import convert_to_dst_type, convert_to_tensor

from medvol.core.errors import MedvolError
from medvol.volumes.intensity import INTENSITY_RANGE_KEY, intensity_keys, scale_to_range
from medvol.volumes.volume_reader import LoadVolumed

INTENSITY_MODES = ("percentile", "window", "none")


@dataclass
class TransformSettings:
    """What `dataset.transforms` may set (see docs/data.md).

    Args:
        orientation: axis codes to reorient to (e.g. RAS); null keeps the stored orientation.
        spacing: voxel size in mm to resample to; null keeps the stored spacing.
        intensity: `percentile` (per channel, for MR), `window` (fixed range, e.g. HU for CT) or `none`.
        percentiles: lower and upper percentile mapped to the ends of `output_range`.
        window: lower and upper raw value (e.g. HU) mapped to the ends of `output_range`.
        output_range: [-1, 1] or [0, 1]; values beyond the percentiles/window are clipped.
        spatial_size: centre crop / pad to this size (pad value: the low end of `output_range`).
        random_crop: training only: random crop of this size after crop/pad.
        flip_prob: training only: probability of a flip along each axis.
        affine_prob: training only: probability of a random rotation/scaling.
        rotate_range: radians, per axis, for the random affine.
        scale_range: relative, per axis, for the random affine.
    """

    orientation: str | None = "RAS"
    spacing: list[float] | None = None
    intensity: str = "percentile"
    percentiles: list[float] = field(default_factory=lambda: [0.5, 99.5])
    window: list[float] = field(default_factory=lambda: [-1000.0, 1000.0])
    output_range: list[float] = field(default_factory=lambda: [-1.0, 1.0])
    spatial_size: list[int] | None = None
    random_crop: list[int] | None = None
    flip_prob: float = 0.0
    affine_prob: float = 0.0
    rotate_range: list[float] = field(default_factory=lambda: [0.1, 0.1, 0.1])
    scale_range: list[float] = field(default_factory=lambda: [0.1, 0.1, 0.1])

    @classmethod
    def from_config(cls, config: Mapping[str, Any] | None) -> TransformSettings:
        """Validate a `dataset.transforms` mapping; unknown keys and bad values raise `MedvolError`."""
        config = dict(config or {})
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(config) - known)
        if unknown:
            raise MedvolError(f"`dataset.transforms.{unknown[0]}` is not a transform setting; expected one of {sorted(known)}")
        settings = cls(**{k: list(v) if isinstance(v, Sequence) and not isinstance(v, str) else v for k, v in config.items()})
        if settings.intensity not in INTENSITY_MODES:
            raise MedvolError(f"`dataset.transforms.intensity` is {settings.intensity!r}; expected one of {list(INTENSITY_MODES)}")
        for name in ("percentiles", "window", "output_range"):
            low, high = _pair(getattr(settings, name), name)
            if not low < high:
                raise MedvolError(f"`dataset.transforms.{name}` must be [low, high] with low < high, got {[low, high]}")
        if settings.output_range not in ([-1.0, 1.0], [0.0, 1.0]):
            raise MedvolError(f"`dataset.transforms.output_range` is {settings.output_range}; expected [-1, 1] or [0, 1]")
        if not 0 <= settings.percentiles[0] < settings.percentiles[1] <= 100:
            raise MedvolError(f"`dataset.transforms.percentiles` must lie in [0, 100], got {settings.percentiles}")
        for name in ("spacing", "spatial_size", "random_crop"):
            value = getattr(settings, name)
            if value is not None and (len(value) != 3 or min(value) <= 0):
                raise MedvolError(f"`dataset.transforms.{name}` must be three positive numbers or null, got {value}")
        for name in ("flip_prob", "affine_prob"):
            if not 0.0 <= getattr(settings, name) <= 1.0:
                raise MedvolError(f"`dataset.transforms.{name}` must be in [0, 1], got {getattr(settings, name)}")
        return settings

    @property
    def has_random_spatial(self) -> bool:
        return bool(self.random_crop) or self.flip_prob > 0 or self.affine_prob > 0


def _pair(value: Sequence[float], name: str) -> tuple[float, float]:
    if len(value) != 2:
        raise MedvolError(f"`dataset.transforms.{name}` must be two numbers [low, high], got {list(value)}")
    return float(value[0]), float(value[1])


class SafeScaleIntensityd(MapTransform):
    """Per-channel intensity scaling by percentiles or a fixed window, safe for constant and NaN volumes.

    The item says how it was scaled, so outputs can be written back in the scan's units
    (`medvol.volumes.intensity.intensity_keys`): per scaled key the raw value mapped onto each end of
    `output_range`, per channel (`intensity_low`/`intensity_high` for `image`, `cond_intensity_low`/...
    for `cond`), and `intensity_range` (the output range).

    Args:
        keys: keys of the (C, D, H, W) volumes to scale.
        mode: `percentile` or `window`.
        percentiles: lower/upper percentile (percentile mode), computed over finite voxels.
        window: lower/upper raw value (window mode).
        output_range: target range.
    """

    def __init__(
        self,
        keys: Sequence[str],
        mode: str,
        percentiles: Sequence[float] = (0.5, 99.5),
        window: Sequence[float] = (-1000.0, 1000.0),
        output_range: Sequence[float] = (-1.0, 1.0),
    ) -> None:
        super().__init__(keys, allow_missing_keys=True)
        self.mode = mode
        self.percentiles = [float(p) for p in percentiles]
        self.window = [float(w) for w in window]
        self.output_range = [float(r) for r in output_range]

    def _bounds(self, channel: torch.Tensor) -> tuple[float, float]:
        if self.mode == "window":
            return self.window[0], self.window[1]
        finite = torch.isfinite(channel)
        values = channel.numpy() if bool(finite.all()) else channel[finite].numpy()
        if values.size == 0:
            return 0.0, 0.0
        low, high = np.percentile(values, self.percentiles)
        return float(low), float(high)

    def __call__(self, data: Mapping[Hashable, Any]) -> dict[Hashable, Any]:
        d = dict(data)
        for key in self.key_iterator(d):
            volume = convert_to_tensor(d[key], track_meta=False)
            bounds = [self._bounds(c.cpu()) for c in volume]
            scaled = torch.stack([scale_to_range(c, *b, self.output_range) for c, b in zip(volume, bounds, strict=True)])
            low_key, high_key = intensity_keys(str(key))
            d[low_key] = torch.tensor([b[0] for b in bounds], dtype=torch.float64)
            d[high_key] = torch.tensor([b[1] for b in bounds], dtype=torch.float64)
            d[INTENSITY_RANGE_KEY] = torch.tensor(self.output_range, dtype=torch.float64)
            # Written back into the input's type, so MONAI's metadata (the affine) survives.
            d[key] = convert_to_dst_type(scaled, d[key], dtype=torch.float32)[0]
        return d


class StoreAffined(MapTransform):
    """Copy the affine of `key`'s voxel grid (after orientation, spacing and crop) into `affine` (4x4 float64)."""

    def __init__(self, key: str, output_key: str = "affine") -> None:
        super().__init__([key])
        self.output_key = output_key

    def __call__(self, data: Mapping[Hashable, Any]) -> dict[Hashable, Any]:
        d = dict(data)
        d[self.output_key] = torch.as_tensor(np.asarray(d[self.keys[0]].affine), dtype=torch.float64)
        return d


def deterministic_transforms(
    settings: TransformSettings,
    image_keys: Sequence[str],
    label_key: str | None,
    label_transform: Callable[[dict[Hashable, Any]], dict[Hashable, Any]] | None = None,
    before_intensity: Sequence[Callable] = (),
    series: str | None = None,
) -> list[Callable]:
    """Load (NIfTI files or DICOM series folders) -> channel-first -> orientation -> spacing -> (label mapping) -> intensity -> crop/pad -> plain tensors.

    Args:
        settings: the validated `dataset.transforms`.
        image_keys: keys holding lists of image files (stacked as channels), e.g. image, cond.
        label_key: key of the label map file, or None.
        label_transform: maps raw label values (e.g. BraTS 4 -> 3, or regions).
        before_intensity: extra steps that need raw values (e.g. DRRs from Hounsfield units).
        series: the DICOM series (UID or description) to read from folders holding several.
    """
    image_keys = list(image_keys)
    all_keys = image_keys + ([label_key] if label_key else [])
    modes = ["bilinear"] * len(image_keys) + (["nearest"] if label_key else [])
    chain: list[Callable] = [
        LoadVolumed(all_keys, series, image_only=True, ensure_channel_first=True, dtype=np.float32),
    ]
    if settings.orientation:
        chain.append(Orientationd(all_keys, axcodes=settings.orientation, labels=None))
    if settings.spacing:
        chain.append(Spacingd(all_keys, pixdim=settings.spacing, mode=modes))
    if label_key and label_transform is not None:
        chain.append(label_transform)
    chain.extend(before_intensity)
    if settings.intensity != "none":
        chain.append(
            SafeScaleIntensityd(image_keys, settings.intensity, settings.percentiles, settings.window, settings.output_range)
        )
    if settings.spatial_size:
        low = settings.output_range[0] if settings.intensity != "none" else 0.0
        chain.append(ResizeWithPadOrCropd(image_keys, settings.spatial_size, mode="constant", value=low))
        if label_key:
            chain.append(ResizeWithPadOrCropd([label_key], settings.spatial_size, mode="constant", value=0))
    chain.append(StoreAffined(image_keys[0]))
    # Plain tensors from here on: cheaper to cache, and random transforms cannot grow metadata in the cache.
    chain.append(EnsureTyped(image_keys, dtype=torch.float32, track_meta=False))
    if label_key:
        chain.append(EnsureTyped([label_key], dtype=torch.int64, track_meta=False))
    return chain


def random_transforms(settings: TransformSettings, keys: Sequence[str], label_key: str | None) -> list[Callable]:
    """Training augmentation, applied with the same random draw to every key."""
    keys = list(keys) + ([label_key] if label_key else [])
    chain: list[Callable] = []
    if settings.random_crop:
        chain.append(RandSpatialCropd(keys, roi_size=settings.random_crop, random_size=False))
    if settings.flip_prob > 0:
        chain.extend(RandFlipd(keys, prob=settings.flip_prob, spatial_axis=axis) for axis in range(3))
    if settings.affine_prob > 0:
        modes = ["bilinear"] * (len(keys) - (1 if label_key else 0)) + (["nearest"] if label_key else [])
        chain.append(
            RandAffined(
                keys, prob=settings.affine_prob, rotate_range=settings.rotate_range,
                scale_range=settings.scale_range, mode=modes, padding_mode="border",
            )
        )
    return chain


def select_batch_keys(keys: Sequence[str]) -> SelectItemsd:
    """Keep only the batch-dict keys, so bookkeeping fields (file lists, None paths) never reach collate."""
    return SelectItemsd(list(keys), allow_missing_keys=True)
