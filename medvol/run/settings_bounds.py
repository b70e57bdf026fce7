"""The values a run's files give, bounded where they are read: one schema per model family.

A run record (`run.json`), an old run's config and a checkpoint's hyper-parameters set sizes, counts and fractions
that predict.py, export.py and a resume act on without asking: a window of 512^3 voxels, an overlap of 0.99 (1100x
the windows), 10^6 sampling steps, a codebook of 2^28 codes. Each family's schema bounds them with limits a real
run never reaches (every preset in conf/experiment lies well inside them) but that stop a file from taking the
machine's memory or time; the sizes are held against the memory budget too (`medvol.volumes.volume_budget`). The
dataset's transforms are checked for every family: the orientation is one of the 48 axis codes (it reaches a MONAI
bundle's config, where a string starting with `$` is Python), the spacing positive and finite.

`check_run_settings` checks a run's whole resolved config, `check_checkpoint_settings` what a checkpoint restores
over it (and its training-data record); each refusal is one line naming the file, the key, the value and the range.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, PlainValidator, ValidationError

from datamodules.pipeline.transforms import AXIS_CODES
from medvol.core.errors import MedvolError
from medvol.volumes.volume_budget import check_volume_size

# nnU-Net predicts with tiles half a window apart (tile_step_size 0.5); every medvol default and preset uses at most
# that. Windows grow as 1 / (1 - overlap)^3: 8x a tiling without overlap at 0.5, 1000x at 0.9, 10^6x at 0.99.
MAX_OVERLAP = 0.5
# The network's window (a training patch, a crop, a sampling window): the largest preset's is 128^3 (BraTS, Fast-DDPM
# at 128^3) and a whole stage-3 X-ray volume 256^3; a 512^3 window is 8x that.
MAX_WINDOW_VOXELS = 256**3
# A whole volume (sampled, padded to, a stage's grid): CTPA scans are 512 x 512 x 608.
MAX_VOLUME_EDGE = 2048
# Windows one network call takes (the GPU round's largest fitting batch on an H100 is 32).
MAX_WINDOW_BATCH = 64
# Diffusion steps: DDPM's schedules have 1000; improved DDPM's 4000.
MAX_DIFFUSION_STEPS = 10_000
# Channels of one network level (the presets' widest: 512), and the classes of a segmentation or classifier
# (TotalSegmentator has 117 structures).
MAX_FEATURES = 4096
MAX_CLASSES = 1024
MAX_CODES = 2**17
MAX_LEVELS = 16
MAX_KERNEL = 63


def _refusal(accepted: str, test: Callable[[Any], bool]) -> PlainValidator:
    def check(value: Any) -> Any:
        if not test(value):
            raise ValueError(accepted)
        return value

    return PlainValidator(check)


def _whole(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def whole(low: int, high: int) -> Any:
    return Annotated[int, _refusal(f"a whole number in [{low}, {high}]", lambda v: _whole(v) and low <= v <= high)]


def number(low: float, high: float) -> Any:
    return Annotated[float, _refusal(f"a number in [{low}, {high}]", lambda v: _number(v) and low <= v <= high)]


def widths(high: int) -> Any:
    """A list of channel counts (a network's levels), each in [1, high], at most `MAX_LEVELS` of them."""
    return Annotated[list[int], _refusal(
        f"a list of at most {MAX_LEVELS} whole numbers in [1, {high}]",
        lambda v: isinstance(v, list) and len(v) <= MAX_LEVELS and all(_whole(w) and 1 <= w <= high for w in v))]


def _edges(value: Any) -> list[int] | None:
    """A size as its three edges (an int is a cube), or None where it is not one."""
    edges = [value] * 3 if _whole(value) else value
    if isinstance(edges, list) and len(edges) == 3 and all(_whole(e) and 1 <= e <= MAX_VOLUME_EDGE for e in edges):
        return edges
    return None


Window = Annotated[Any, _refusal(
    f"null or three whole numbers [D, H, W] (or one for a cube) of at most {MAX_WINDOW_VOXELS:,} voxels in all "
    f"({round(MAX_WINDOW_VOXELS ** (1 / 3))}^3)",
    lambda v: v is None or (e := _edges(v)) is not None and math.prod(e) <= MAX_WINDOW_VOXELS)]
Volume = Annotated[Any, _refusal(
    f"null or three whole numbers [D, H, W] (or one for a cube), each in [1, {MAX_VOLUME_EDGE}]",
    lambda v: v is None or _edges(v) is not None)]
Orientation = Annotated[Any, _refusal(
    "null or one of the 48 axis codes (3 letters: one of L/R, one of A/P, one of S/I, e.g. RAS)",
    lambda v: v is None or v in AXIS_CODES)]
Spacing = Annotated[Any, _refusal(
    "null or three positive, finite voxel sizes in mm",
    lambda v: v is None or isinstance(v, list) and len(v) == 3 and all(_number(s) and s > 0 for s in v))]
Overlap = number(0.0, MAX_OVERLAP)
WindowBatch = whole(1, MAX_WINDOW_BATCH)
# predict.py's window batches: `auto` (sized from the predicted peak of a call, `medvol.run.inference_preflight`) or a
# whole number within the same bounds.
AUTO = "auto"
PlannedWindowBatch = Annotated[Any, _refusal(
    f"{AUTO} or a whole number in [1, {MAX_WINDOW_BATCH}]",
    lambda v: v == AUTO or _whole(v) and 1 <= v <= MAX_WINDOW_BATCH)]
# The LDM's decoder slab (values on the device at once), and predict.py's: `auto` there.
MAX_SLAB_ELEMENTS = 2**31
PlannedSlab = Annotated[Any, _refusal(
    f"{AUTO} or a whole number of values in [1, 2^31]",
    lambda v: v == AUTO or _whole(v) and 1 <= v <= MAX_SLAB_ELEMENTS)]
Steps = Annotated[Any, _refusal(
    f"null, a whole number of steps in [1, {MAX_DIFFUSION_STEPS}] or a list of at most that many steps in "
    f"[0, {MAX_DIFFUSION_STEPS})",
    lambda v: v is None or _whole(v) and 1 <= v <= MAX_DIFFUSION_STEPS or isinstance(v, list)
    and 1 <= len(v) <= MAX_DIFFUSION_STEPS and all(_whole(s) and 0 <= s < MAX_DIFFUSION_STEPS for s in v))]


class Bounded(BaseModel):
    """Keys a schema does not name are left to the reader that uses them."""

    model_config = ConfigDict(extra="allow")


class Transforms(Bounded):
    """`dataset.transforms` (and a checkpoint's training-data record): where a volume is resampled to."""

    orientation: Orientation = None
    spacing: Spacing = None
    spatial_size: Volume = None
    pad_to: Volume = None
    random_crop: Window = None
    foreground_crop: Window = None


class Dataset(Bounded):
    transforms: Transforms | None = None
    patch_size: Window = None
    size: Volume = None
    batch_size: whole(1, 4096) = 1


class Model(Bounded):
    """What predict.py reads of every family: the window (`window_size`), its overlap and its batch."""

    patch_size: Window = None
    overlap: Overlap = 0.25
    sw_batch_size: WindowBatch = 1


class Diffusion(Model):
    """The diffusion core's settings (`lightning_modules/diffusion`), shared by Fast-DDPM, the LDM and X-ray-to-CT."""

    num_train_timesteps: whole(1, MAX_DIFFUSION_STEPS) = 1000
    timesteps: Steps = None
    sampling_timesteps: Steps = None
    sampling_window: Window = None
    sampling_window_overlap: Overlap = 0.5
    sampling_window_batch_size: WindowBatch = 1
    mmd_size: whole(1, 256) = 16
    diversity_size: whole(1, 256) = 32
    ssim_kernel_size: whole(1, MAX_KERNEL) = 7


class DiffusionNetwork(Bounded):
    channels: widths(MAX_FEATURES) = []
    num_res_blocks: whole(1, MAX_LEVELS) = 1
    num_head_channels: whole(1, MAX_FEATURES) = 8
    norm_num_groups: whole(1, MAX_FEATURES) = 8


class FastDDPM(Diffusion):
    network: DiffusionNetwork | None = None
    image_channels: whole(1, MAX_FEATURES) = 1
    cond_channels: whole(0, MAX_FEATURES) = 0
    downsample_factor: whole(1, 64) = 2


class VQGAN(Model):
    in_channels: whole(1, MAX_FEATURES) = 1
    embedding_dim: whole(1, MAX_FEATURES) = 8
    n_codes: whole(1, MAX_CODES) = 512
    n_hiddens: whole(1, MAX_FEATURES) = 16
    downsample: Annotated[Any, _refusal(
        "three whole numbers in [1, 64]",
        lambda v: isinstance(v, list) and len(v) == 3 and all(_whole(d) and 1 <= d <= 64 for d in v))] = [4, 4, 4]
    disc_channels: whole(1, MAX_FEATURES) = 16
    disc_layers: whole(1, MAX_LEVELS) = 3
    ssim_kernel_size: whole(1, MAX_KERNEL) = 11


class LDM(Diffusion):
    network: DiffusionNetwork | None = None
    cond_channels: whole(0, MAX_FEATURES) = 0
    sample_size: Volume = None
    decode_slab_elements: Annotated[Any, _refusal(
        "null or a whole number of values in [1, 2^31]",
        lambda v: v is None or _whole(v) and 1 <= v <= MAX_SLAB_ELEMENTS)] = None
    first_stage_settings: VQGAN | None = None


class XrayToCT(Diffusion):
    stage: whole(1, MAX_LEVELS) = 1
    size: Volume = None
    crop_size: Window = None
    xray_size: Annotated[Any, _refusal(
        f"two whole numbers in [1, {MAX_VOLUME_EDGE}]",
        lambda v: isinstance(v, list) and len(v) == 2 and all(_whole(s) and 1 <= s <= MAX_VOLUME_EDGE for s in v))] \
        = [32, 32]
    token_dim: whole(1, MAX_FEATURES) = 32
    encoder_channels: widths(MAX_FEATURES) = []
    channels: widths(MAX_FEATURES) = []
    num_res_blocks: whole(1, MAX_LEVELS) = 1
    num_head_channels: whole(1, MAX_FEATURES) = 16
    norm_num_groups: whole(1, MAX_FEATURES) = 8
    previous_settings: list[XrayToCT] | None = None


class Discriminative(Model):
    """Survival and the classifier: a 3D ResNet over the image, beside the table's covariates."""

    in_channels: whole(1, MAX_FEATURES) = 1
    num_covariates: whole(0, 100_000) = 0
    num_classes: whole(2, MAX_CLASSES) = 2
    widen_factor: number(0.01, 64.0) = 1.0
    horizons: Annotated[Any, _refusal(
        "a list of at most 1000 finite follow-up times",
        lambda v: isinstance(v, list) and len(v) <= 1000 and all(_number(h) for h in v))] = []


class Segmentation(Model):
    in_channels: whole(1, MAX_FEATURES) = 1
    num_classes: Annotated[Any, _refusal(
        f"null or a whole number in [2, {MAX_CLASSES}]", lambda v: v is None or _whole(v) and 2 <= v <= MAX_CLASSES)] \
        = None
    features: widths(MAX_FEATURES) = []
    feature_size: whole(1, MAX_FEATURES) = 24


class PredictSizes(Bounded):
    """predict.py's own window batches (its sliding window's, the diffusion walk's sampling windows') and the LDM's
    decoder slab: `auto` or a number within the bounds of a run's own."""

    sw_batch_size: PlannedWindowBatch = AUTO
    sampling_window_batch_size: PlannedWindowBatch = AUTO
    decode_slab_elements: PlannedSlab = AUTO


def check_predict_sizes(values: Mapping[str, Any], source: str) -> PredictSizes:
    """predict.py's `sw_batch_size`, `sampling_window_batch_size` and `decode_slab_elements`, refused in one line
    beyond their bounds."""
    try:
        return PredictSizes.model_validate(dict(values))
    except ValidationError as err:
        raise _refused(err, source) from None


# Each family by the package of its class (`model._target_`); a class of the user's own gets the common bounds.
FAMILIES: dict[str, type[Model]] = {
    "lightning_modules.vqgan.": VQGAN,
    "lightning_modules.diffusion.": FastDDPM,
    "lightning_modules.ldm.": LDM,
    "lightning_modules.xray2ct.": XrayToCT,
    "lightning_modules.discriminative.": Discriminative,
    "lightning_modules.segmentation.": Segmentation,
}


def family_schema(target: Any) -> type[Model]:
    """The schema of the family whose class is `target` (a class path)."""
    for package, schema in FAMILIES.items():
        if isinstance(target, str) and target.startswith(package):
            return schema
    return Model


def _key(location: tuple[Any, ...]) -> str:
    key = ""
    for part in location:
        key += f"[{part}]" if isinstance(part, int) else f".{part}" if key else str(part)
    return key


def _refused(err: ValidationError, source: str | Path, prefix: str = "") -> MedvolError:
    first = err.errors()[0]
    key = _key((*([prefix] if prefix else []), *first["loc"]))
    accepted = first["msg"].removeprefix("Value error, ")
    if first["type"] == "missing":
        accepted = "a value"
    value = repr(first.get("input"))
    shown = value if len(value) <= 80 else value[:77] + "..."
    return MedvolError(f"{source}: `{key}` is {shown}; expected {accepted}")


def check_run_settings(config: Mapping[str, Any], source: str | Path, target: str | None = None) -> None:
    """Refuse, in one line naming `source`, the key, its value and the accepted range, a run's config (resolved, as
    plain data: a record's values) whose model or dataset holds a value beyond its family's bounds or the memory
    budget; the family is the class `target`, else the config's `model._target_`."""
    model, dataset = config.get("model"), config.get("dataset")
    if not isinstance(model, Mapping) or not isinstance(dataset, Mapping):
        return
    family = family_schema(target if target is not None else model.get("_target_"))
    checked: dict[str, BaseModel] = {}
    for key, schema, values in (("model", family, model), ("dataset", Dataset, dataset)):
        try:
            checked[key] = schema.model_validate(dict(values))
        except ValidationError as err:
            raise _refused(err, source, key) from None
    _check_budget(checked, source)


def check_checkpoint_settings(target: Any, restored: Mapping[str, Any], checkpoint: Mapping[str, Any],
                              source: str | Path) -> None:
    """Refuse, in one line, what a checkpoint restores over its run's config (`restored`, for the family of class
    `target`: classes, channels, earlier stages' and first stages' settings) and its training-data record
    (`medvol_data`: the orientation and spacing inputs are resampled to) beyond the family's bounds."""
    from lightning_modules.base import DATA_KEY

    try:
        family_schema(target).model_validate(dict(restored))
    except ValidationError as err:
        raise _refused(err, source, "hyper_parameters") from None
    record = checkpoint.get(DATA_KEY)
    if isinstance(record, Mapping):
        try:
            Transforms.model_validate({k: record[k] for k in ("orientation", "spacing") if k in record})
        except ValidationError as err:
            raise _refused(err, source, DATA_KEY) from None


# The sizes a run's config sets, by their schema's key: each is a volume the network or the pipeline allocates.
SIZES = {"model": ("patch_size", "sample_size", "size", "crop_size", "sampling_window"),
         "dataset": ("patch_size", "size"),
         "dataset.transforms": ("spatial_size", "pad_to", "random_crop", "foreground_crop")}


def _check_budget(checked: Mapping[str, BaseModel], source: str | Path) -> None:
    """Every volume and window a run's config sets, as float32 against the memory budget."""
    transforms = getattr(checked["dataset"], "transforms", None)
    nodes = {"model": checked["model"], "dataset": checked["dataset"], "dataset.transforms": transforms}
    volumes = {f"{node}.{name}": getattr(nodes[node], name, None) for node, names in SIZES.items() for name in names}
    for key, size in volumes.items():
        if size is not None:
            check_volume_size(f"{source}: `{key}`", _edges(size) or [], "asks for", before="building anything")
