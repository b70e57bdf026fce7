"""The schema of a run's `plan.json` (`medvol.volumes.plan`, `medvol.volumes.survival_plan`): what a plan read back
from a run folder may hold, checked before any value of it reaches a config.

A plan sets the spacing volumes are resampled to, the patch and batch a step allocates and the network's widths, so
every number is bounded here as well as typed; a file outside the schema is refused in one line naming the key.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from medvol.core.errors import MedvolError
from medvol.core.file_data import read_json

Spacing = Annotated[float, Field(gt=0, le=1e4, allow_inf_nan=False)]
Size = Annotated[int, Field(ge=1, le=4096)]
Step = Annotated[int, Field(ge=1, le=16)]
Count = Annotated[int, Field(ge=0, le=10**7)]
Fraction = Annotated[float, Field(ge=0, le=1, allow_inf_nan=False)]
Finite = Annotated[float, Field(allow_inf_nan=False)]
Name = Annotated[str, Field(max_length=256)]
Triple = Annotated[list[Spacing], Field(min_length=3, max_length=3)]
Grid = Annotated[list[Size], Field(min_length=3, max_length=3)]
StrideTriple = Annotated[list[Step], Field(min_length=3, max_length=3)]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class Channel(_Strict):
    """One image channel's normalization: MR (z-score, over the non-zero mask with `use_mask`) or CT (clip, z-score)."""

    kind: Literal["mr", "ct"]
    use_mask: bool | None = None
    clip: Annotated[list[Finite], Field(min_length=2, max_length=2)] | None = None
    mean: Finite | None = None
    std: Annotated[float, Field(gt=0, allow_inf_nan=False)] | None = None


class Augmentation(_Strict):
    rotation: Finite
    in_plane: bool
    axis: Annotated[int, Field(ge=0, le=2)]
    initial_patch: Grid
    enabled: bool = True


class SegmentationPlan(_Strict):
    """A segmentation run's plan, nnU-Net's values (`medvol.volumes.plan.make_plan`)."""

    spacing: Triple
    normalization: Annotated[list[Channel], Field(min_length=1, max_length=64)]
    resampling: Literal["nnunet", "linear"] = "nnunet"
    crop_foreground: bool
    median_shape: Annotated[list[Annotated[int, Field(ge=1, le=10**6)]], Field(min_length=3, max_length=3)]
    patch_size: Grid
    batch_size: Size
    features: Annotated[list[Size], Field(min_length=1, max_length=12)]
    strides: Annotated[list[StrideTriple], Field(min_length=1, max_length=12)]
    kernels: Annotated[list[StrideTriple], Field(min_length=1, max_length=12)]
    channels: Annotated[int, Field(ge=1, le=64)] | None = None
    num_classes: Annotated[int, Field(ge=2, le=1024)] | None = None
    labels: dict[Name, Count]
    ignore_label: Annotated[int, Field(ge=1, le=2**16)] | None = None
    augmentation: Augmentation
    foreground_ratio: Fraction
    deep_supervision: bool
    # Written since issue 50; a plan without it took the Dice per sample.
    batch_dice: bool = False
    poly_power: Annotated[float, Field(gt=0, le=100, allow_inf_nan=False)]
    iterations_per_epoch: Annotated[int, Field(ge=1, le=10**7)]
    memory_budget_mib: Annotated[float, Field(gt=0, allow_inf_nan=False)]
    memory_estimate_mib: Annotated[float, Field(ge=0, allow_inf_nan=False)]
    subjects: Count
    overridden: list[Name]
    regions: dict[Name, Annotated[list[Count], Field(max_length=256)]] | None = None
    class_names: Annotated[list[Name], Field(max_length=1024)] | None = None
    channel_files: Annotated[int, Field(ge=1, le=64)] = 1


class SurvivalPlan(_Strict):
    """A survival run's plan (`medvol.volumes.survival_plan.make_survival_plan`)."""

    family: Literal["survival"]
    spacing: Triple
    crop_foreground: bool
    spatial_size: Grid
    normalization: Annotated[list[Channel], Field(min_length=1, max_length=64)]
    batch_size: Size
    flip_prob: Fraction
    event_rate: Fraction
    expected_events_per_batch: Annotated[float, Field(ge=0, allow_inf_nan=False)]
    voxel_budget: Annotated[int, Field(ge=1)]
    subjects: Count
    overridden: list[Name]


def checked_plan(value: Any, source: Path | str) -> dict[str, Any]:
    """`value` (a plan read from `source`) as a plain dict once it fits its family's schema, else one line."""
    schema = SurvivalPlan if isinstance(value, dict) and "family" in value else SegmentationPlan
    try:
        return schema.model_validate(value).model_dump(exclude_unset=True)
    except ValidationError as err:
        first = err.errors()[0]
        where = ".".join(str(p) for p in first["loc"]) or "<root>"
        raise MedvolError(
            f"{source}: `{where}` {first['msg'].lower()}; expected a plan written by medvol (the run's plan.json)"
        ) from None


def read_plan_file(path: Path) -> dict[str, Any]:
    """The plan at `path`, read as data and checked against its schema."""
    return checked_plan(read_json(path, "a run's plan (plan.json)"), path)
