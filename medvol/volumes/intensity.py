"""Intensity scaling into model units and its inverse, so outputs go back to the scan's units (HU for CT)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

# Batch key of the model-unit range the scaled volumes were mapped onto (2,), e.g. [-1, 1].
INTENSITY_RANGE_KEY = "intensity_range"


def intensity_keys(key: str) -> tuple[str, str]:
    """Batch keys of the raw values mapped onto the ends of the output range, per channel of `key`.

    `image` -> (`intensity_low`, `intensity_high`); any other key, e.g. `cond` ->
    (`cond_intensity_low`, `cond_intensity_high`).
    """
    prefix = "" if key == "image" else f"{key}_"
    return f"{prefix}intensity_low", f"{prefix}intensity_high"


def scale_to_range(
    volume: torch.Tensor, low: float, high: float, output_range: Sequence[float]
) -> torch.Tensor:
    """Clip `volume` to [low, high] and map it linearly onto `output_range`.

    A constant volume (high - low ~ 0) becomes all zeros instead of 0/0 = NaN, and
    non-finite voxels take the low end, so one bad file cannot turn a run's loss into NaN.
    """
    out_low, out_high = float(output_range[0]), float(output_range[1])
    width = high - low
    if not np.isfinite(width) or width <= 1e-8 * max(abs(low), abs(high), 1.0):
        return torch.zeros_like(volume, dtype=torch.float32)
    # One copy, then in place: large volumes should not cost several temporaries each.
    scaled = torch.nan_to_num(volume.float(), nan=low, posinf=high, neginf=low)
    return scaled.clamp_(low, high).sub_(low).mul_((out_high - out_low) / width).add_(out_low)


def scale_from_range(
    volume: torch.Tensor, low: float, high: float, output_range: Sequence[float]
) -> torch.Tensor:
    """The inverse of `scale_to_range` inside the window: model units in `output_range` -> raw units in [low, high].

    Values outside `output_range` are clamped first, as `scale_to_range` clips; differentiable.
    """
    out_low, out_high = float(output_range[0]), float(output_range[1])
    unit = (volume.clamp(out_low, out_high) - out_low) / (out_high - out_low)
    return unit * (high - low) + low


def scale_from_range_unclamped(
    volume: torch.Tensor, low: float, high: float, output_range: Sequence[float]
) -> torch.Tensor:
    """`scale_from_range` without the clamp: values beyond `output_range` map beyond [low, high] (HU a model
    generated above its window stays above it)."""
    out_low, out_high = float(output_range[0]), float(output_range[1])
    return (volume - out_low) / (out_high - out_low) * (high - low) + low


def scale_spread(
    volume: torch.Tensor, low: float, high: float, output_range: Sequence[float]
) -> torch.Tensor:
    """A spread (e.g. a voxel-wise standard deviation) in model units -> raw units: the slope of `scale_from_range`."""
    out_low, out_high = float(output_range[0]), float(output_range[1])
    return volume * ((high - low) / (out_high - out_low))
