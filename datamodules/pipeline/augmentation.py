"""nnU-Net v2's default training augmentation, built from MONAI transforms (nnunetv2 2.8.1: the data loader's
`get_bbox`, `nnUNetTrainer.get_training_transforms`, batchgeneratorsv2's transforms).

Per training item, after the cache, image and label (and a masked z-score's mask) together:

| step | nnU-Net | here |
|---|---|---|
| patch | `initial_patch` about a voxel of a class picked uniformly (forced) or anywhere | `ForegroundPatchd` |
| rotation, p 0.2 | +-30 deg about every axis (in-plane +-180 deg if anisotropic) | `SpatialAugmentd` (`Affine`) |
| scaling, p 0.2 | one factor in [0.7, 1.4] (larger = smaller objects), the centre kept | `SpatialAugmentd` |
| Gaussian noise, p 0.1 | std in [0, 0.1] | `RandGaussianNoised` |
| Gaussian blur, p 0.2 | per channel p 0.5, sigma in [0.5, 1] per axis, mirrored edges | `RandGaussianSmooth` |
| brightness, p 0.15 | per channel, x [0.75, 1.25] | `RandScaleIntensity` |
| contrast, p 0.15 | per channel, x [0.75, 1.25] about the mean, range kept | `RandScaleIntensityFixedMean` |
| low resolution, p 0.25 | per channel p 0.5, zoom [0.5, 1] (in-plane if anisotropic) | `RandSimulateLowResolution` |
| gamma inverted, p 0.1; not, p 0.3 | per channel, [0.7, 1] or [1, 1.5] (even odds), stats kept | `RandAdjustContrast` |
| mirroring | every axis, p 0.5 each | `RandFlipd` |
| mask | a masked z-score's background back to 0 | `MaskImaged` |

Labels (and the z-score's mask) are resampled as batchgeneratorsv2's `SpatialTransform` resamples nnU-Net's
segmentation (`one_hot_linear`): each label's indicator linearly, the largest score wins, ties go to the nearest
neighbour, and outside the volume is a label of its own (nnU-Net's -1) that ends as background. Images are padded
with the channel's background value (0 for MR, as nnU-Net; a CT channel's clipped air where nnU-Net pads with 0, the
foreground mean after its CT normalization).
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Mapping, Sequence
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from monai.transforms import (
    Affine,
    CenterSpatialCrop,
    MapTransform,
    OneOf,
    RandAdjustContrast,
    RandFlipd,
    RandGaussianNoised,
    RandGaussianSmooth,
    Randomizable,
    RandScaleIntensity,
    RandScaleIntensityFixedMean,
    RandSimulateLowResolution,
)
from monai.utils import convert_to_tensor

from datamodules.pipeline.transforms import MASK_KEY

# Set per item by the oversampling sampler (`datamodules.pipeline.oversampling`): whether the item is one of the
# batch's samples forced onto the foreground.
FOREGROUND_KEY = "force_foreground"
ROTATION_P = 0.2
SCALING_P = 0.2
SCALING = (0.7, 1.4)
# batchgeneratorsv2's label scores: indicators times 1000, interpolated, held as float16 (near ties become ties, which
# the nearest neighbour settles); outside the volume the label -1, background once resampled.
SCORE_SCALE = 1000.0
OUTSIDE = -1


def one_hot_linear(label: torch.Tensor, sample: Callable[[torch.Tensor, str], torch.Tensor]) -> torch.Tensor:
    """A (C, ...) label volume (integer values per channel: a label map, region channels or a mask) resampled as
    batchgeneratorsv2's `SpatialTransform._apply_to_segmentation` with `mode_seg='bilinear'`, nnU-Net's setting.

    Per channel, every label value present (and the outside of the volume, where the sampling reaches it) gets its
    indicator resampled linearly (`sample(volume, "bilinear")`, zero padding) and scaled to float16 scores; the
    largest score wins (the smaller value on an exact tie), and where the nearest neighbour's label
    (`sample(volume, "nearest")`) has the top score it settles the voxel. Outside ends as 0, as nnU-Net's
    `RemoveLabelTansform(-1, 0)` does.

    Args:
        label: (C, D, H, W), integer-valued (any dtype).
        sample: resamples a (N, D, H, W) float32 volume onto the output grid with `bilinear` or `nearest`
            interpolation, zeros outside (the same geometry for both).
    """
    return torch.stack([one_hot_linear_channel(channel, sample) for channel in label])


def one_hot_linear_channel(channel: torch.Tensor, sample: Callable[[torch.Tensor, str], torch.Tensor]) -> torch.Tensor:
    """`one_hot_linear` of one (D, H, W) channel; int64."""
    values = torch.unique(channel).to(torch.int64)
    nearest = (sample((channel.double() - OUTSIDE).float()[None], "nearest")[0].round() + OUTSIDE).to(torch.int64)
    inside = sample(torch.full_like(channel, SCORE_SCALE, dtype=torch.float32)[None], "bilinear")[0]
    if bool((inside < SCORE_SCALE - 0.5).any()):
        # Some voxel's kernel reaches past the volume (by more than rounding): the outside is a label of its own.
        values = torch.cat([torch.tensor([OUTSIDE]), values])
    if len(values) == 1:
        return torch.full_like(nearest, int(values[0]))

    def score(value: int) -> torch.Tensor:
        if value == OUTSIDE:
            return (SCORE_SCALE - inside).half()
        return sample(((channel == value).float() * SCORE_SCALE)[None], "bilinear")[0].half()

    if len(values) == 2:
        # Two labels' scores sum to the scale: the second wins past half of it, a tie goes to the nearest.
        high = score(int(values[1]))
        result = torch.where(high > SCORE_SCALE / 2, values[1], values[0])
        settled = high == SCORE_SCALE / 2
    else:
        scores = torch.stack([score(int(v)) for v in values])
        best = scores.max(0).values
        result = values[scores.argmax(0)]
        index = torch.searchsorted(values, nearest.clamp(int(values[0]), int(values[-1]))).clamp(max=len(values) - 1)
        settled = (scores.gather(0, index[None])[0] == best) & torch.isin(nearest, values)
    result = torch.where(settled, nearest, result)
    return torch.where(result == OUTSIDE, torch.zeros_like(result), result)


def crop_padded(
    volume: torch.Tensor, lower: Sequence[int], size: Sequence[int], values: Sequence[float]
) -> torch.Tensor:
    """The box of `size` from corner `lower` (which may lie outside) of a (C, D, H, W) volume, the outside padded
    per channel with `values` (nnU-Net's `crop_and_pad_nd`)."""
    starts = [max(0, lo) for lo in lower]
    stops = [min(n, lo + s) for n, lo, s in zip(volume.shape[1:], lower, size, strict=True)]
    inner = volume[:, starts[0] : stops[0], starts[1] : stops[1], starts[2] : stops[2]]
    before = [st - lo for st, lo in zip(starts, lower, strict=True)]
    after = [s - b - (sp - st) for s, b, sp, st in zip(size, before, stops, starts, strict=True)]
    if not any(before) and not any(after):
        # A copy: the cached volume is never written, whatever a later step does in place.
        return inner.clone()
    pads = [p for axis in (2, 1, 0) for p in (before[axis], after[axis])]
    return torch.cat([F.pad(inner[c : c + 1], pads, value=float(v)) for c, v in enumerate(values)])


class ForegroundPatchd(Randomizable, MapTransform):
    """nnU-Net's training crop (`nnUNetDataLoader.get_bbox`): a box of `size` whose corner is drawn uniformly over
    the range that lets the final patch reach every border; a forced sample instead centres it on a voxel of a
    class (or region) drawn uniformly among those present, then a voxel drawn uniformly among that class's.

    Whether an item is forced comes from the sampler (`FOREGROUND_KEY`, the last 33% of each batch), or without one
    from a draw with probability `ratio`. A case without any foreground falls back to a random box.

    Args:
        keys: the image key first, then the label and mask keys (cropped alike, padded with 0).
        label_key: the label (a map of values, or binary region channels); None: random boxes only.
        size: the box (nnU-Net's initial patch, larger than the network's for rotation).
        final_size: the network's patch (the box may reach past the volume by half the difference).
        classes: per class or region, the label values it covers (region channels: ignored, one per channel).
        ratio: share of forced samples without a sampler.
        pad_values: per image channel, the background value outside the volume.
    """

    def __init__(
        self, keys: Sequence[str], label_key: str | None, size: Sequence[int], final_size: Sequence[int],
        classes: Sequence[Sequence[int]], ratio: float, pad_values: Sequence[float],
    ) -> None:
        MapTransform.__init__(self, keys, allow_missing_keys=True)
        self.label_key = label_key
        self.size, self.final_size = [int(s) for s in size], [int(s) for s in final_size]
        self.classes = [[int(v) for v in c] for c in classes]
        self.ratio = float(ratio)
        self.pad_values = [float(v) for v in pad_values]

    def randomize(self, data: Any = None) -> None:
        """Draws happen in `corner`, which needs the item's shape and labels."""

    def present(self, label: torch.Tensor) -> list[torch.Tensor]:
        """Per eligible class or region, a mask of its voxels (only those present)."""
        if label.shape[0] > 1:
            return [label[c] > 0 for c in range(label.shape[0]) if bool(label[c].any())]
        values = set(torch.unique(label).tolist())
        return [torch.isin(label[0], torch.tensor(c, dtype=label.dtype)) for c in self.classes if values & set(c)]

    def corner(self, shape: Sequence[int], label: torch.Tensor | None, forced: bool) -> list[int]:
        need = [max(s - f, 0) for s, f in zip(self.size, self.final_size, strict=True)]
        need = [max(n, s - d) if n + d < s else n for n, s, d in zip(need, self.size, shape, strict=True)]
        lower = [-n // 2 for n in need]
        upper = [d + n // 2 + n % 2 - s for d, n, s in zip(shape, need, self.size, strict=True)]
        eligible = self.present(label) if forced and label is not None else []
        if not eligible:
            return [int(self.R.randint(lo, up + 1)) for lo, up in zip(lower, upper, strict=True)]
        voxels = torch.nonzero(eligible[int(self.R.randint(len(eligible)))])
        voxel = voxels[int(self.R.randint(len(voxels)))].tolist()
        return [max(lo, v - s // 2) for lo, v, s in zip(lower, voxel, self.size, strict=True)]

    def __call__(self, data: Mapping[Hashable, Any]) -> dict[Hashable, Any]:
        d = dict(data)
        forced = d.pop(FOREGROUND_KEY, None)
        if forced is None:
            forced = bool(self.R.rand() < self.ratio)
        image = d[self.keys[0]]
        label = convert_to_tensor(d[self.label_key], track_meta=False) if self.label_key in d else None
        lower = self.corner(list(image.shape[1:]), label, bool(forced))
        for key in self.key_iterator(d):
            volume = convert_to_tensor(d[key], track_meta=False)
            values = self.pad_values if key == self.keys[0] else [0.0] * volume.shape[0]
            if len(values) != volume.shape[0]:
                values = [values[0]] * volume.shape[0]
            d[key] = crop_padded(volume, lower, self.size, values)
        return d


class SpatialAugmentd(Randomizable, MapTransform):
    """nnU-Net's `SpatialTransform` (no elastic deformation): with p 0.2 a rotation by angles drawn uniformly in
    [-rotation, rotation] about every axis, with p 0.2 one scale factor in [0.7, 1.4] for every axis (larger factors
    sample a larger region: smaller objects), both about the centre in one resampling (MONAI `Affine`), keeping the
    central `patch`; neither drawn: the central `patch` as it is. With `in_plane` (anisotropic patches) both act
    only in the plane across `axis`.

    Args:
        image_keys: images (trilinear, padded with `pad_values`).
        label_keys: labels and masks (one-hot linear, `one_hot_linear`, background outside).
        patch: the output size.
        rotation: the largest angle in radians.
        in_plane: rotate about `axis` only and scale the other two axes only.
        axis: the coarsest axis (anisotropic data).
        pad_values: per image channel, the background value.
    """

    def __init__(
        self, image_keys: Sequence[str], label_keys: Sequence[str], patch: Sequence[int], rotation: float,
        in_plane: bool, axis: int, pad_values: Sequence[float],
    ) -> None:
        MapTransform.__init__(self, [*image_keys, *label_keys], allow_missing_keys=True)
        self.image_keys, self.label_keys = list(image_keys), list(label_keys)
        self.patch = [int(p) for p in patch]
        self.rotation, self.in_plane, self.axis = float(rotation), bool(in_plane), int(axis)
        self.pad_values = [float(v) for v in pad_values]
        self.angles: list[float] = [0.0, 0.0, 0.0]
        self.scale = 1.0
        self.transformed = False

    def randomize(self, data: Any = None) -> None:
        rotate, scale = self.R.rand() < ROTATION_P, self.R.rand() < SCALING_P
        self.angles = [float(self.R.uniform(-self.rotation, self.rotation)) if rotate else 0.0 for _ in range(3)]
        if self.in_plane:
            self.angles = [a if i == self.axis else 0.0 for i, a in enumerate(self.angles)]
        self.scale = float(self.R.uniform(*SCALING)) if scale else 1.0
        self.transformed = rotate or scale

    def scales(self) -> list[float]:
        return [1.0 if self.in_plane and i == self.axis else self.scale for i in range(3)]

    def __call__(self, data: Mapping[Hashable, Any]) -> dict[Hashable, Any]:
        d = dict(data)
        self.randomize()
        keys = list(self.key_iterator(d))
        if not self.transformed:
            for key in keys:
                d[key] = CenterSpatialCrop(self.patch)(convert_to_tensor(d[key], track_meta=False))
            return d
        images = [k for k in keys if k in self.image_keys]
        labels = [k for k in keys if k not in self.image_keys]
        for group, image in ((images, True), (labels, False)):
            if not group:
                continue
            # One resampling per interpolation mode: the group's volumes side by side as channels.
            volumes = [convert_to_tensor(d[k], track_meta=False) for k in group]
            stacked = torch.cat([v.float() for v in volumes])
            shift = torch.zeros(stacked.shape[0])
            if image and any(self.pad_values):
                # Zero padding about each channel's background value pads with that value.
                values = self.pad_values if len(self.pad_values) == volumes[0].shape[0] else self.pad_values[:1] * len(
                    volumes[0])
                shift[: len(values)] = torch.tensor(values, dtype=torch.float32)
            shift = shift.view(-1, 1, 1, 1)
            if image:
                moved = self.resampled(stacked - shift, "bilinear") + shift
            else:
                moved = one_hot_linear(stacked.round(), self.resampled)
            start = 0
            for key, volume in zip(group, volumes, strict=True):
                part = moved[start : start + volume.shape[0]]
                start += volume.shape[0]
                d[key] = part if image else part.to(volume.dtype)
        return d

    def resampled(self, volume: torch.Tensor, mode: str) -> torch.Tensor:
        """`volume` (C, ...) rotated and scaled about its centre into the central `patch`, zeros outside."""
        affine = Affine(
            rotate_params=self.angles, scale_params=self.scales(), spatial_size=self.patch, mode=mode,
            padding_mode="zeros", image_only=True,
        )
        return convert_to_tensor(affine(volume), track_meta=False)


class PerChannel(Randomizable, MapTransform):
    """nnU-Net's `RandomTransform(apply_probability)` around a per-channel transform: with probability `prob` the
    item is augmented, then each channel with probability `p_per_channel`, each with its own draw of `transform` (a
    MONAI array transform whose own probability is 1). With `axis`, a channel is handed over as a stack of 2D
    slices across that axis (in-plane only, as nnU-Net's `ignore_axes` for anisotropic patches).

    Args:
        key: the image key.
        transform: the per-channel transform.
        prob: probability of augmenting the item.
        p_per_channel: probability per channel once the item is augmented.
        axis: the spatial axis left alone, or None.
    """

    def __init__(
        self, key: str, transform: Callable, prob: float, p_per_channel: float = 1.0, axis: int | None = None
    ) -> None:
        MapTransform.__init__(self, [key])
        self.transform, self.prob, self.p_per_channel, self.axis = transform, float(prob), float(p_per_channel), axis

    def set_random_state(self, seed: int | None = None, state: np.random.RandomState | None = None) -> PerChannel:
        super().set_random_state(seed, state)
        inner = self.transform.set_random_state if hasattr(self.transform, "set_random_state") else None
        if inner is not None:
            inner(seed=int(self.R.randint(2**31 - 1)))
        return self

    def randomize(self, data: Any = None) -> None:
        """Draws happen per channel in `__call__`."""

    def _one(self, channel: torch.Tensor) -> torch.Tensor:
        if self.axis is None:
            return convert_to_tensor(self.transform(channel), track_meta=False)
        slices = channel[0].movedim(self.axis, 0)
        return convert_to_tensor(self.transform(slices), track_meta=False).movedim(0, self.axis)[None]

    def __call__(self, data: Mapping[Hashable, Any]) -> dict[Hashable, Any]:
        d = dict(data)
        if self.R.rand() >= self.prob:
            return d
        image = convert_to_tensor(d[self.keys[0]], track_meta=False)
        channels = [
            self._one(image[c : c + 1]) if self.R.rand() < self.p_per_channel else image[c : c + 1]
            for c in range(image.shape[0])
        ]
        d[self.keys[0]] = torch.cat(channels).to(image.dtype)
        return d


class ReflectPadded(Randomizable):
    """`transform` on a volume mirrored `margin` voxels past its faces, then cut back: nnU-Net blurs with reflected
    borders (`blur_dimension`), MONAI's `GaussianSmooth` with zeros, which would darken a structure at the patch's
    edge."""

    def __init__(self, transform: Callable, margin: int) -> None:
        self.transform, self.margin = transform, int(margin)

    def set_random_state(self, seed: int | None = None, state: np.random.RandomState | None = None) -> ReflectPadded:
        super().set_random_state(seed, state)
        self.transform.set_random_state(seed=int(self.R.randint(2**31 - 1)))
        return self

    def randomize(self, data: Any = None) -> None:
        """The wrapped transform draws."""

    def __call__(self, volume: torch.Tensor) -> torch.Tensor:
        margins = [min(self.margin, size - 1) for size in volume.shape[1:]]
        pads = [m for axis in (2, 1, 0) for m in (margins[axis], margins[axis])]
        out = convert_to_tensor(self.transform(F.pad(volume[None], pads, mode="reflect")[0]), track_meta=False)
        return out[:, margins[0] : out.shape[1] - margins[0], margins[1] : out.shape[2] - margins[1],
                   margins[2] : out.shape[3] - margins[2]]


class MaskImaged(MapTransform):
    """nnU-Net's `MaskImageTransform`: the masked z-score's background (`MASK_KEY` 0) back to 0 in `channels` after
    augmentation; the mask then leaves the item."""

    def __init__(self, key: str, channels: Sequence[int]) -> None:
        super().__init__([key])
        self.channels = list(channels)

    def __call__(self, data: Mapping[Hashable, Any]) -> dict[Hashable, Any]:
        d = dict(data)
        mask = d.pop(MASK_KEY, None)
        if mask is None or not self.channels:
            return d
        image = convert_to_tensor(d[self.keys[0]], track_meta=False).clone()
        outside = convert_to_tensor(mask, track_meta=False)[0] == 0
        for c in self.channels:
            image[c][outside] = 0.0
        d[self.keys[0]] = image
        return d


def gamma(invert: bool) -> OneOf:
    """nnU-Net's gamma draw (`BGContrast((0.7, 1.5))`: even odds of [0.7, 1] and [1, 1.5]), statistics kept."""
    return OneOf([
        RandAdjustContrast(prob=1.0, gamma=(0.7, 1.0), invert_image=invert, retain_stats=True),
        RandAdjustContrast(prob=1.0, gamma=(1.0, 1.5), invert_image=invert, retain_stats=True),
    ])


def nnunet_augmentation(
    settings: Mapping[str, Any], image_key: str, label_key: str | None, pad_values: Sequence[float],
    mask_channels: Sequence[int], foreground_ratio: float,
) -> list[Callable]:
    """The whole chain for one training item (see the module's table).

    Args:
        settings: the plan's `augmentation` (`patch`, `initial_patch`, `rotation`, `in_plane`, `axis`, `classes`,
            `enabled`: false for the patch alone).
        image_key: the image key.
        label_key: the label key (None: no labels, random boxes only).
        pad_values: per image channel, the background value.
        mask_channels: channels normalized over the non-zero mask (re-zeroed at the end).
        foreground_ratio: forced share without the oversampling sampler.
    """
    labels = ([label_key] if label_key else []) + [MASK_KEY]
    axis = int(settings["axis"]) if settings.get("in_plane") else None
    if not settings.get("enabled", True):
        # nnU-Net's nnUNetTrainerNoDA: the patch itself, no margin for rotation, nothing else.
        return [
            ForegroundPatchd([image_key, *labels], label_key, settings["patch"], settings["patch"],
                             settings.get("classes") or [], foreground_ratio, pad_values),
            MaskImaged(image_key, mask_channels),
        ]
    chain: list[Callable] = [
        ForegroundPatchd(
            [image_key, *labels], label_key, settings["initial_patch"], settings["patch"],
            settings.get("classes") or [], foreground_ratio, pad_values,
        ),
        SpatialAugmentd(
            [image_key], labels, settings["patch"], settings["rotation"], bool(settings.get("in_plane")),
            int(settings.get("axis", 0)), pad_values,
        ),
        RandGaussianNoised([image_key], prob=0.1, mean=0.0, std=0.1),
        # MONAI's kernel reaches 4 sigma (at most 4 voxels here).
        PerChannel(image_key, ReflectPadded(RandGaussianSmooth((0.5, 1.0), (0.5, 1.0), (0.5, 1.0), prob=1.0), 4), 0.2,
                   0.5),
        PerChannel(image_key, RandScaleIntensity(factors=0.25, prob=1.0), 0.15),
        PerChannel(image_key, RandScaleIntensityFixedMean(prob=1.0, factors=0.25, preserve_range=True), 0.15),
        PerChannel(
            image_key,
            RandSimulateLowResolution(
                prob=1.0, downsample_mode="nearest-exact", upsample_mode="trilinear" if axis is None else "bilinear",
                zoom_range=(0.5, 1.0),
            ),
            0.25, 0.5, axis,
        ),
        PerChannel(image_key, gamma(invert=True), 0.1),
        PerChannel(image_key, gamma(invert=False), 0.3),
        *[RandFlipd([image_key, *labels], prob=0.5, spatial_axis=a, allow_missing_keys=True) for a in range(3)],
        MaskImaged(image_key, mask_channels),
    ]
    return chain
