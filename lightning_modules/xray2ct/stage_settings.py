"""A cascade stage's grids as its settings give them, and the refusals of settings no stage can be built from."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from lightning_modules.diffusion.diffusion_module import sampling_window_size
from medvol.core.errors import MedvolError


def as_size(size: int | Sequence[int]) -> list[int]:
    """A volume size as three ints (an int means a cube)."""
    return [int(size)] * 3 if isinstance(size, int) else [int(s) for s in size]


def crop_of(settings: dict[str, Any]) -> list[int]:
    """The volume a stage's network trains on: its whole grid at stage 1, else `crop_size` (null: whole) within
    the grid."""
    size = as_size(settings["size"])
    crop = settings.get("crop_size")
    if int(settings["stage"]) == 1 or crop is None:
        return size
    return [min(c, s) for c, s in zip(as_size(crop), size, strict=True)]


def window_of(settings: dict[str, Any]) -> list[int]:
    """The window a stage samples with: its `sampling_window`, by default the volume its network trained on."""
    return list(sampling_window_size(settings.get("sampling_window")) or crop_of(settings))


def check_stage(
    stage: int, previous_stages: Sequence[str], previous_settings: Sequence[Any] | None, previous_sampling_noise: float
) -> None:
    """Refuse a stage below 1, earlier stages that are not stages 1..k-1 (the checkpoints a new stage reads, or the
    settings a restored stage's checkpoint recorded: `previous_settings` not None), and a negative hand-off noise."""
    if int(stage) < 1:
        raise MedvolError(f"`model.stage` must be >= 1, got {stage}")
    if previous_settings is not None:
        if len(previous_settings) != int(stage) - 1:
            raise MedvolError(
                f"`model.previous_settings` holds {len(previous_settings)} earlier stage(s) for stage {stage}; "
                f"expected {int(stage) - 1}, as a stage's checkpoint records them"
            )
    elif len(previous_stages) != int(stage) - 1:
        raise MedvolError(
            f"`model.previous_stages` lists {len(previous_stages)} checkpoint(s) for stage {stage}; expected the "
            f"best checkpoints of stages 1..{int(stage) - 1} (run the cascade with `experiment=xray2ct_cascade`)"
        )
    if not float(previous_sampling_noise) >= 0.0:
        raise MedvolError(f"`model.previous_sampling_noise` must be a std >= 0, got {previous_sampling_noise}")


def check_grids(settings: dict[str, Any], downsampling: int) -> None:
    """Refuse a stage volume, training crop or sampling window that the network's `downsampling` does not divide,
    a crop that is no [D, H, W] of positive ints, and a window larger than the volume."""
    stage, size, crop_size = settings["stage"], as_size(settings["size"]), settings.get("crop_size")
    if any(s % downsampling for s in size):
        raise MedvolError(
            f"stage {stage} volume size {size} must divide by the network's downsampling "
            f"{downsampling} (2 ** (len(model.channels) - 1)); change the stage's size"
        )
    if crop_size is not None and (len(as_size(crop_size)) != 3 or min(as_size(crop_size)) < 1):
        raise MedvolError(
            f"`model.crop_size`: got {crop_size!r}; expected a crop size [D, H, W] of positive ints or null"
        )
    crop = crop_of(settings)
    if any(c % downsampling for c in crop):
        raise MedvolError(
            f"stage {stage}: the training crop {crop} (`model.crop_size` within the volume {size}) must "
            f"divide by the network's downsampling {downsampling}; change `model.crop_size`"
        )
    window_size = window_of(settings)
    if any(w % downsampling or w > s for w, s in zip(window_size, size, strict=True)):
        raise MedvolError(
            f"stage {stage}: `model.sampling_window` {list(window_size)} must divide by the network's downsampling "
            f"{downsampling} and fit in the stage's volume {size}"
        )
