"""MONAI transform chains built from the `dataset.transforms` config, and a normaliser that never divides by zero.

A chain is split in two: the deterministic part (load, orientation, spacing, intensity,
crop/pad) is what a cache stores; the random part (flips, crops, affine) runs on every
draw, after the cache, and only for training.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass, field, fields
from itertools import permutations, product
from typing import Any

import numpy as np
import torch
from monai.transforms import (
    CropForegroundd,
    EnsureTyped,
    MapTransform,
    Orientationd,
    RandAffined,
    RandCropByPosNegLabeld,
    RandFlipd,
    Randomizable,
    RandSpatialCropd,
    ResizeWithPadOrCropd,
    SelectItemsd,
    Spacing,
    Spacingd,
    SpatialPad,
    SpatialPadd,
)
from monai.utils import convert_to_dst_type, convert_to_tensor
from scipy import ndimage

from medvol.core.errors import MedvolError
from medvol.volumes.intensity import INTENSITY_RANGE_KEY, intensity_keys, scale_to_range
from medvol.volumes.plan import MODALITY_KINDS, background_values, separate_axis
from medvol.volumes.volume_budget import check_resampled_size, check_volume_size
from medvol.volumes.volume_reader import LoadVolumed

INTENSITY_MODES = ("percentile", "window", "zscore", "none")
RESAMPLINGS = ("linear", "nnunet")
# The 48 orientations: each axis once, one of L/R, one of A/P, one of S/I, in any order (MONAI's axis codes). Only
# these reach Orientationd, and a MONAI bundle's config (where a string starting with `$` is Python).
AXIS_CODES = frozenset("".join(codes) for axes in permutations(("LR", "AP", "SI")) for codes in product(*axes))
# The hole-filled non-zero mask a masked z-score used, carried with the image so augmentation can re-zero the
# background as nnU-Net's MaskImageTransform does (training only; dropped before the batch).
MASK_KEY = "norm_mask"


@dataclass
class TransformSettings:
    """What `dataset.transforms` may set (see docs/data.md).

    Args:
        orientation: axis codes to reorient to (e.g. RAS); null keeps the stored orientation.
        spacing: voxel size in mm to resample to; null keeps the stored spacing.
        intensity: `percentile` (per channel, for MR), `window` (fixed range, e.g. HU for CT), `zscore` (per
            channel as `normalization` says; what a segmentation plan sets) or `none`.
        normalization: `zscore` mode, per image channel: `{kind: mr, use_mask}` (z-score; with `use_mask` over the
            voxels inside the hole-filled non-zero mask of all channels, zeros outside) or `{kind: ct, clip: [low,
            high], mean, std}` (clip, then the dataset's z-score); null: mr with the mask for every channel.
        resampling: `linear` (every key at `spacing` in one step: images trilinear, labels nearest, before the
            intensity step) or `nnunet` (nnU-Net's preprocessing: crop, normalize, then resample images with cubic
            splines and labels class by class linearly, an anisotropic axis apart with nearest; a plan sets it).
        crop_foreground: crop every volume to the bounding box of its non-zero image voxels (any channel).
        percentiles: lower and upper percentile mapped to the ends of `output_range`.
        window: lower and upper raw value (e.g. HU) mapped to the ends of `output_range`.
        output_range: [-1, 1] or [0, 1]; values beyond the percentiles/window are clipped.
        spatial_size: centre crop / pad to this size (pad value: the low end of `output_range`).
        pad_to: pad volumes smaller than this with the background value (none larger is cropped).
        random_crop: training only: random crop of this size after crop/pad.
        foreground_crop: training only: a crop of this size centred on a label voxel with probability
            `foreground_ratio`, anywhere otherwise (MONAI's RandCropByPosNegLabeld).
        foreground_ratio: share of the `foreground_crop` crops centred on the label.
        flip_prob: training only: probability of a flip along each axis.
        affine_prob: training only: probability of a random rotation/scaling.
        rotate_range: radians, per axis, for the random affine.
        scale_range: relative, per axis, for the random affine.
        augmentation: training only: nnU-Net's default augmentation (`datamodules.pipeline.augmentation`), as a
            plan sets it: `patch` (what the network gets), `initial_patch` (the larger patch cut before rotating),
            `rotation` (radians), `in_plane` and `axis` (anisotropic patches: rotation and scaling in-plane about
            `axis` only), `classes` (label values per class or region the forced foreground samples pick from);
            null: none (then `flip_prob`, `affine_prob` and the crops above apply).
    """

    orientation: str | None = "RAS"
    spacing: list[float] | None = None
    intensity: str = "percentile"
    percentiles: list[float] = field(default_factory=lambda: [0.5, 99.5])
    window: list[float] = field(default_factory=lambda: [-1000.0, 1000.0])
    output_range: list[float] = field(default_factory=lambda: [-1.0, 1.0])
    normalization: list[dict[str, Any]] | None = None
    resampling: str = "linear"
    crop_foreground: bool = False
    spatial_size: list[int] | None = None
    pad_to: list[int] | None = None
    random_crop: list[int] | None = None
    foreground_crop: list[int] | None = None
    foreground_ratio: float = 1 / 3
    flip_prob: float = 0.0
    affine_prob: float = 0.0
    rotate_range: list[float] = field(default_factory=lambda: [0.1, 0.1, 0.1])
    scale_range: list[float] = field(default_factory=lambda: [0.1, 0.1, 0.1])
    augmentation: dict[str, Any] | None = None

    @classmethod
    def from_config(cls, config: Mapping[str, Any] | None) -> TransformSettings:
        """Validate a `dataset.transforms` mapping; unknown keys and bad values raise `MedvolError`."""
        config = dict(config or {})
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(config) - known)
        if unknown:
            raise MedvolError(
                f"`dataset.transforms.{unknown[0]}` is not a transform setting; expected one of {sorted(known)}"
            )
        settings = cls(**{k: plain(v) for k, v in config.items()})
        if settings.orientation is not None and settings.orientation not in AXIS_CODES:
            shown = repr(settings.orientation)[:80]
            raise MedvolError(
                f"`dataset.transforms.orientation` is {shown}; expected null or one of the 48 axis codes (3 letters: "
                "one of L/R, one of A/P, one of S/I, e.g. RAS)"
            )
        if settings.intensity not in INTENSITY_MODES:
            raise MedvolError(
                f"`dataset.transforms.intensity` is {settings.intensity!r}; expected one of {list(INTENSITY_MODES)}"
            )
        for name in ("percentiles", "window", "output_range"):
            low, high = _pair(getattr(settings, name), name)
            if not low < high:
                raise MedvolError(f"`dataset.transforms.{name}` must be [low, high] with low < high, got {[low, high]}")
        if settings.output_range not in ([-1.0, 1.0], [0.0, 1.0]):
            raise MedvolError(
                f"`dataset.transforms.output_range` is {settings.output_range}; expected [-1, 1] or [0, 1]"
            )
        if not 0 <= settings.percentiles[0] < settings.percentiles[1] <= 100:
            raise MedvolError(f"`dataset.transforms.percentiles` must lie in [0, 100], got {settings.percentiles}")
        check_normalization(settings.normalization)
        if settings.resampling not in RESAMPLINGS:
            raise MedvolError(
                f"`dataset.transforms.resampling` is {settings.resampling!r}; expected one of {list(RESAMPLINGS)}"
            )
        for name in ("spacing", "spatial_size", "pad_to", "random_crop", "foreground_crop"):
            value = getattr(settings, name)
            if value is not None and (len(value) != 3 or min(value) <= 0):
                raise MedvolError(f"`dataset.transforms.{name}` must be three positive numbers or null, got {value}")
        # A run's saved config or plan sets these too: each is a volume the chain allocates.
        sizes = {name: getattr(settings, name) for name in ("spatial_size", "pad_to", "random_crop", "foreground_crop")}
        sizes.update({f"augmentation.{k}": v for k, v in (settings.augmentation or {}).items() if k.endswith("patch")})
        for name, size in sizes.items():
            if size is not None:
                check_volume_size(f"`dataset.transforms.{name}`", size, "asks for", before="building the dataset")
        for name in ("flip_prob", "affine_prob", "foreground_ratio"):
            if not 0.0 <= getattr(settings, name) <= 1.0:
                raise MedvolError(f"`dataset.transforms.{name}` must be in [0, 1], got {getattr(settings, name)}")
        return settings

    @property
    def has_random_spatial(self) -> bool:
        return (
            bool(self.random_crop or self.foreground_crop or self.augmentation) or self.flip_prob > 0
            or self.affine_prob > 0
        )

    @property
    def uses_mask(self) -> bool:
        """Whether a masked z-score normalizes some channel (its mask then travels with the item)."""
        return self.intensity == "zscore" and any(c.get("use_mask", True) and c["kind"] == "mr"
                                                  for c in self.normalization or [{"kind": "mr"}])

    def background(self, channels: int) -> list[float]:
        """Per image channel, the value background voxels (and padding) have in model units."""
        if self.intensity == "zscore":
            return background_values(self.normalization or [{"kind": "mr"}] * channels)
        low = self.output_range[0] if self.intensity != "none" else 0.0
        return [low] * channels


def plain(value: Any) -> Any:
    """A config value as plain lists and dicts (OmegaConf containers included)."""
    if isinstance(value, Mapping):
        return {str(k): plain(v) for k, v in value.items()}
    if isinstance(value, Sequence) and not isinstance(value, str):
        return [plain(v) for v in value]
    return value


def check_normalization(channels: list[dict[str, Any]] | None) -> None:
    """Raise `MedvolError` unless `normalization` lists {kind: mr} or {kind: ct, clip, mean, std} entries."""
    for i, channel in enumerate(channels or []):
        kind = channel.get("kind") if isinstance(channel, Mapping) else None
        if kind not in MODALITY_KINDS:
            raise MedvolError(f"`dataset.transforms.normalization[{i}]` is {channel}; expected kind mr or ct")
        if kind == "ct" and not ({"clip", "mean", "std"} <= set(channel) and float(channel["std"]) > 0):
            raise MedvolError(
                f"`dataset.transforms.normalization[{i}]` is {channel}; a ct channel needs clip: [low, high], mean "
                "and std > 0 (the dataset's foreground statistics)"
            )


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
            scaled = torch.stack(
                [scale_to_range(c, *b, self.output_range) for c, b in zip(volume, bounds, strict=True)]
            )
            low_key, high_key = intensity_keys(str(key))
            d[low_key] = torch.tensor([b[0] for b in bounds], dtype=torch.float64)
            d[high_key] = torch.tensor([b[1] for b in bounds], dtype=torch.float64)
            d[INTENSITY_RANGE_KEY] = torch.tensor(self.output_range, dtype=torch.float64)
            # Written back into the input's type, so MONAI's metadata (the affine) survives.
            d[key] = convert_to_dst_type(scaled, d[key], dtype=torch.float32)[0]
        return d


class PlannedNormalized(MapTransform):
    """Per-channel normalization of a segmentation plan, as nnU-Net's normalization schemes.

    MR channels (`ZScoreNormalization`): a z-score; with `use_mask` over the voxels inside the non-zero mask
    (the voxels non-zero in any channel, holes filled: nnU-Net's `create_nonzero_mask`), zeros outside, else over
    the whole volume. CT channels (`CTNormalization`): clip to the dataset's labelled percentiles, then z-score
    with the dataset's labelled mean and deviation. Where a mask was used it is stored under `MASK_KEY` (same grid,
    uint8), for augmentation to re-zero the background. No intensity record is written: a z-score has no bounded
    range for `medvol.volumes.intensity` to invert, so written inputs stay in z units.

    Args:
        keys: keys of the (C, D, H, W) volumes.
        channels: per channel, {kind: mr, use_mask} or {kind: ct, clip: [low, high], mean, std}.
        keep_mask: store the mask under `MASK_KEY` (training items).
    """

    def __init__(self, keys: Sequence[str], channels: Sequence[Mapping[str, Any]], keep_mask: bool = False) -> None:
        super().__init__(keys, allow_missing_keys=True)
        self.channels = [dict(c) for c in channels]
        self.keep_mask = keep_mask

    @staticmethod
    def _channel(values: torch.Tensor, plan: Mapping[str, Any], mask: torch.Tensor | None) -> torch.Tensor:
        values = torch.nan_to_num(values.double())
        if plan["kind"] == "ct":
            low, high = (float(v) for v in plan["clip"])
            return ((values.clamp(low, high) - float(plan["mean"])) / max(float(plan["std"]), 1e-8)).float()
        if mask is None:
            return ((values - values.mean()) / max(float(values.std(unbiased=False)), 1e-8)).float()
        inside = values[mask]
        out = torch.zeros_like(values)
        if inside.numel():
            out[mask] = (inside - inside.mean()) / max(float(inside.std(unbiased=False)), 1e-8)
        return out.float()

    def __call__(self, data: Mapping[Hashable, Any]) -> dict[Hashable, Any]:
        d = dict(data)
        for key in self.key_iterator(d):
            volume = convert_to_tensor(d[key], track_meta=False)
            plans = self.channels or [{"kind": "mr", "use_mask": True}] * volume.shape[0]
            if len(plans) != volume.shape[0]:
                raise MedvolError(
                    f"`dataset.transforms.normalization` lists {len(plans)} channels; "
                    f"the `{key}` volume has {volume.shape[0]}"
                )
            masked = [p["kind"] == "mr" and p.get("use_mask", True) for p in plans]
            mask = nonzero_mask(volume) if any(masked) else None
            normalized = torch.stack([
                self._channel(c, p, mask if m else None) for c, p, m in zip(volume, plans, masked, strict=True)
            ])
            d[key] = convert_to_dst_type(normalized, d[key], dtype=torch.float32)[0]
            if mask is not None and self.keep_mask:
                d[MASK_KEY] = convert_to_dst_type(mask[None].to(torch.uint8), d[key], dtype=torch.uint8)[0]
        return d


def nonzero_mask(volume: torch.Tensor) -> torch.Tensor:
    """nnU-Net's `create_nonzero_mask`: the voxels non-zero in any channel of a (C, D, H, W) volume, holes filled."""
    union = (torch.nan_to_num(volume) != 0).any(0).numpy()
    return torch.from_numpy(ndimage.binary_fill_holes(union))


class PlannedSpacingd(MapTransform):
    """nnU-Net's resampling to `spacing` (`resample_data_or_seg_to_shape`), with MONAI's `Spacing`: images by cubic
    splines, label maps (and the normalization mask) class by class linearly, each class where its resampled mask
    reaches 0.5 (in value order, as `resize_segmentation`). An axis coarser than 3x the others, in the volume's
    spacing or else in the target's (`medvol.volumes.plan.separate_axis`), is resampled apart: the others first
    as above, then that axis by nearest neighbour.

    Args:
        image_keys: keys of the images.
        label_keys: keys of label maps (one channel of values, or binary region channels).
        spacing: the target voxel size in mm.
    """

    def __init__(self, image_keys: Sequence[str], label_keys: Sequence[str], spacing: Sequence[float]) -> None:
        super().__init__([*image_keys, *label_keys], allow_missing_keys=True)
        self.image_keys, self.label_keys = list(image_keys), list(label_keys)
        self.spacing = [float(s) for s in spacing]

    def __call__(self, data: Mapping[Hashable, Any]) -> dict[Hashable, Any]:
        d = dict(data)
        reference = d[self.image_keys[0]]
        current = [float(s) for s in reference.pixdim[:3]]
        axis = separate_axis(current, self.spacing)
        steps = [(self.spacing, False)]
        if axis is not None:
            in_plane = list(self.spacing)
            in_plane[axis] = current[axis]
            steps = [(in_plane, False), (self.spacing, True)]
        for pixdim, nearest in steps:
            for key in self.key_iterator(d):
                check_grid(d[key], pixdim)
                if key in self.image_keys:
                    d[key] = Spacing(pixdim, mode="nearest" if nearest else 3, padding_mode="nearest")(d[key])
                else:
                    d[key] = resampled_labels(d[key], pixdim, nearest)
        return d


def check_grid(volume: Any, pixdim: Sequence[float]) -> None:
    """Refuse a (C, D, H, W) MetaTensor whose grid at `pixdim` mm would exceed the memory budget, before `Spacing`
    allocates it (`check_resampled_size`; the data checks refuse it from the headers before this)."""
    source = volume.meta.get("filename_or_obj") or "a volume"
    spatial = [int(n) for n in volume.shape[1:]]
    check_resampled_size(source, [*spatial, int(volume.shape[0])], np.asarray(volume.affine), pixdim, None)


class ResampleBudgetd(MapTransform):
    """`check_grid` for every key: placed before `Spacingd`, which would allocate the grid whatever its size.

    Args:
        keys: the keys `Spacingd` resamples.
        pixdim: its target spacing in mm.
    """

    def __init__(self, keys: Sequence[str], pixdim: Sequence[float]) -> None:
        super().__init__(keys, allow_missing_keys=True)
        self.pixdim = [float(s) for s in pixdim]

    def __call__(self, data: Mapping[Hashable, Any]) -> dict[Hashable, Any]:
        for key in self.key_iterator(data):
            check_grid(data[key], self.pixdim)
        return dict(data)


def resampled_labels(label: Any, pixdim: Sequence[float], nearest: bool) -> Any:
    """A label map at `pixdim`: nearest neighbour, or per class linearly with a 0.5 cut (binary region channels each
    on their own)."""
    if nearest:
        return Spacing(pixdim, mode="nearest")(label)
    if label.shape[0] > 1:
        return torch.cat([resampled_labels(label[c : c + 1], pixdim, nearest) for c in range(label.shape[0])])
    values = torch.unique(convert_to_tensor(label, track_meta=False)).tolist()
    onehot = torch.cat([(label == v).float() for v in values]) if values else label.float()
    resampled = Spacing(pixdim, mode="bilinear", padding_mode="border")(convert_to_dst_type(onehot, label)[0])
    out = torch.zeros_like(convert_to_tensor(resampled[:1], track_meta=False))
    for channel, value in enumerate(values):
        out[convert_to_tensor(resampled[channel : channel + 1], track_meta=False) >= 0.5] = value
    return convert_to_dst_type(out, resampled[:1], dtype=label.dtype)[0]


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
    keep_mask: bool = False,
) -> list[Callable]:
    """Load (NIfTI files or DICOM series folders) -> channel-first -> orientation -> spacing -> (label mapping) ->
    intensity -> crop/pad -> plain tensors; with `resampling: nnunet` nnU-Net's order instead: crop -> normalize ->
    resample (`PlannedSpacingd`).

    Args:
        settings: the validated `dataset.transforms`.
        image_keys: keys holding lists of image files (stacked as channels), e.g. image, cond.
        label_key: key of the label map file, or None.
        label_transform: maps raw label values (e.g. BraTS 4 -> 3, or regions).
        before_intensity: extra steps that need raw values (e.g. DRRs from Hounsfield units).
        series: the DICOM series (UID or description) to read from folders holding several.
        keep_mask: keep a masked z-score's mask under `MASK_KEY` (training items that augmentation re-zeroes).
    """
    image_keys = list(image_keys)
    all_keys = image_keys + ([label_key] if label_key else [])
    modes = ["bilinear"] * len(image_keys) + (["nearest"] if label_key else [])
    nnunet = settings.resampling == "nnunet"
    keep_mask = keep_mask and settings.uses_mask
    chain: list[Callable] = [
        LoadVolumed(all_keys, series, image_only=True, ensure_channel_first=True, dtype=np.float32),
    ]
    if settings.orientation:
        chain.append(Orientationd(all_keys, axcodes=settings.orientation, labels=None))
    if settings.spacing and not nnunet:
        chain.append(ResampleBudgetd(all_keys, settings.spacing))
        chain.append(Spacingd(all_keys, pixdim=settings.spacing, mode=modes))
    if label_key and label_transform is not None:
        chain.append(label_transform)
    if settings.crop_foreground:
        # The non-zero voxels of any image channel, before intensity scaling moves the zeros.
        chain.append(CropForegroundd(all_keys, source_key=image_keys[0], select_fn=_any_nonzero, allow_smaller=True))
    chain.extend(before_intensity)
    if settings.intensity == "zscore":
        chain.append(PlannedNormalized(image_keys[:1], settings.normalization or [], keep_mask))
    elif settings.intensity != "none":
        chain.append(
            SafeScaleIntensityd(
                image_keys, settings.intensity, settings.percentiles, settings.window, settings.output_range
            )
        )
    labels = ([label_key] if label_key else []) + ([MASK_KEY] if keep_mask else [])
    if settings.spacing and nnunet:
        # nnU-Net normalizes before resampling, so the non-zero mask still fits the image exactly.
        chain.append(PlannedSpacingd(image_keys, labels, settings.spacing))
    for size, pad_only in ((settings.spatial_size, False), (settings.pad_to, True)):
        if size:
            chain.extend(_resize(settings, image_keys, labels, size, pad_only))
    chain.append(StoreAffined(image_keys[0]))
    # Plain tensors from here on: cheaper to cache, and random transforms cannot grow metadata in the cache.
    chain.append(EnsureTyped(image_keys, dtype=torch.float32, track_meta=False))
    if label_key:
        chain.append(EnsureTyped([label_key], dtype=torch.int64, track_meta=False))
    if keep_mask:
        chain.append(EnsureTyped([MASK_KEY], dtype=torch.uint8, track_meta=False))
    return chain


def _any_nonzero(volume: Any) -> Any:
    """A (1, D, H, W) mask of the voxels where any channel is non-zero (CropForeground's `select_fn`)."""
    return (volume != 0).any(0, keepdim=True)


def _resize(
    settings: TransformSettings, image_keys: list[str], label_keys: list[str], size: list[int], pad_only: bool
) -> list[Callable]:
    """Crop/pad (or only pad) every volume to `size`: images with their background value, labels with 0."""
    if pad_only:
        values = settings.background(len(settings.normalization or [None]))
        steps: list[Callable] = [BackgroundPadd(image_keys[:1], size, values)]
        steps += [SpatialPadd([key], size, mode="constant", value=settings.background(1)[0]) for key in image_keys[1:]]
        return steps + ([SpatialPadd(label_keys, size, mode="constant", value=0)] if label_keys else [])
    low = settings.background(1)[0]
    steps = [ResizeWithPadOrCropd(image_keys, size, mode="constant", value=low)]
    return steps + ([ResizeWithPadOrCropd(label_keys, size, mode="constant", value=0)] if label_keys else [])


class BackgroundPadd(MapTransform):
    """Pad volumes smaller than `size` (symmetrically, as MONAI's SpatialPad), each channel with its own
    background value (a CT channel's clipped air in z units, 0 for MR); the affine follows the padding."""

    def __init__(self, keys: Sequence[str], size: Sequence[int], values: Sequence[float]) -> None:
        super().__init__(keys, allow_missing_keys=True)
        self.pads = [SpatialPad(list(size), mode="constant", value=float(v)) for v in values]

    def __call__(self, data: Mapping[Hashable, Any]) -> dict[Hashable, Any]:
        d = dict(data)
        for key in self.key_iterator(d):
            volume = d[key]
            pads = self.pads if len(self.pads) == volume.shape[0] else [self.pads[0]] * volume.shape[0]
            d[key] = torch.cat([pad(volume[i : i + 1]) for i, pad in enumerate(pads)])
        return d


class ForegroundCropd(Randomizable, MapTransform):
    """One crop of `size` centred on a label voxel with probability `ratio`, anywhere otherwise: MONAI's
    RandCropByPosNegLabeld with one sample, returned as the item itself rather than a list of one."""

    def __init__(self, keys: Sequence[str], label_key: str, size: Sequence[int], ratio: float) -> None:
        MapTransform.__init__(self, keys)
        self.crop = RandCropByPosNegLabeld(
            keys, label_key, list(size), pos=ratio, neg=1.0 - ratio, num_samples=1, allow_smaller=True
        )

    def set_random_state(self, seed: int | None = None, state: np.random.RandomState | None = None) -> ForegroundCropd:
        self.crop.set_random_state(seed, state)
        return self

    def randomize(self, data: Any = None) -> None:
        """The wrapped crop draws its own centres."""

    def __call__(self, data: Mapping[Hashable, Any]) -> dict[Hashable, Any]:
        return dict(self.crop(data)[0])


def random_transforms(settings: TransformSettings, keys: Sequence[str], label_key: str | None) -> list[Callable]:
    """Training augmentation, applied with the same random draw to every key."""
    keys = list(keys) + ([label_key] if label_key else [])
    chain: list[Callable] = []
    if settings.random_crop:
        chain.append(RandSpatialCropd(keys, roi_size=settings.random_crop, random_size=False))
    if settings.foreground_crop and label_key:
        chain.append(ForegroundCropd(keys, label_key, settings.foreground_crop, settings.foreground_ratio))
    elif settings.foreground_crop:
        chain.append(RandSpatialCropd(keys, roi_size=settings.foreground_crop, random_size=False))
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
