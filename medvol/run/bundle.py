"""A trained model as a MONAI bundle that runs without medvol: what predict.py does, in MONAI's own transforms.

`write_bundle` writes the bundle layout of MONAI's specification:

    configs/metadata.json    every key the specification makes mandatory (`required_packages_version`: every
                             package the config imports beyond MONAI's own requirements), the inputs' channels,
                             spacing and units, the outputs' classes or units; the run's plan, label names and the
                             label values written under `medvol`
    configs/inference.json   `python -m monai.bundle run --config_file configs/inference.json --bundle_root DIR
                             --dataset_dir SCANS --output_dir OUT`: every NIfTI file of SCANS through the run's
                             preprocessing (orientation, spacing, crop, normalization), the sliding window of
                             predict.py (window, overlap, Gaussian blending, padding), the output resampled onto
                             the scan's own grid, and for segmentation the argmax or threshold, the run's
                             post-processing and the training files' label values; `<scan>_seg.nii.gz` or
                             `<scan>_reconstruction.nii.gz` in OUT
    models/model.ts          the window network (`MedvolModule.bundle_network`: for segmentation the logits
                             averaged over the mirrored copies), TorchScript: no medvol class is needed to load it
    README.md                the command

The settings are those predict.py reads an input file with (`inference_settings`: the run's `dataset.transforms`
after the plan, `<run>/plan.json`, was applied). MONAI's transforms do what they can; nnU-Net's steps that MONAI
has none for (the filled non-zero mask of the z-score, the separate resampling of an anisotropic axis decided per
scan, the logits' resampling onto the scan's grid as nnU-Net's, the largest connected component) are helper
expressions in the config (`HELPERS`), each the one medvol runs, written with numpy, scipy and torch.
"""

from __future__ import annotations

import importlib.metadata
import json
import re
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy
import torch
from monai import __version__ as monai_version
from monai.bundle.utils import EXPR_KEY, ID_REF_KEY, MACRO_KEY
from omegaconf import DictConfig

from datamodules.pipeline.transforms import TransformSettings
from lightning_modules.base import MedvolModule
from medvol.core.errors import MedvolError
from medvol.run.predict_config import input_geometry, with_geometry
from medvol.run.predict_inputs import file_transforms
from medvol.run.predict_job import label_file_values
from medvol.run.resolvers import run_dir_of_checkpoint
from medvol.volumes.plan import ANISOTROPY, PLAN_FILE, read_plan
from medvol.volumes.prediction_writer import mask_dtype

# The packages a bundle imports beyond MONAI's own requirements, with their versions: MONAI 1.6's name for what
# earlier specifications called `optional_packages_version` (MONAI reads that old name as this one).
PACKAGES_KEY = "required_packages_version"
# Keys the bundle specification makes mandatory in configs/metadata.json, and in each of network_data_format's
# inputs and outputs (MONAI's "MONAI Bundle Specification", metadata.json).
METADATA_KEYS = (
    "version", "monai_version", "pytorch_version", "numpy_version", "required_packages_version", "task",
    "description", "authors", "copyright", "network_data_format",
)
TENSOR_KEYS = (
    "type", "format", "modality", "num_channels", "spatial_shape", "dtype", "value_range", "is_patch_data",
    "channel_def",
)
SOURCE_KEY = "source"
# `dataset.transforms` keys that only training applies (random crops, flips, affine, nnU-Net's augmentation);
# predict.py never does.
TRAINING_ONLY = ("random_crop", "foreground_crop", "foreground_ratio", "flip_prob", "affine_prob", "rotate_range",
                 "scale_range", "augmentation")
MODEL_FILE = "models/model.ts"
# What MONAI's config reads at the start of a string (`$` Python, `@` a reference, `%` a macro that loads a file) and
# has no escape for: a value a file gave (an orientation, a label or channel name) that starts with one is refused.
MONAI_SYNTAX = (EXPR_KEY, ID_REF_KEY, MACRO_KEY)
# How each transform's `_desc_` names the step of predict.py it does.
DESCRIPTION_PREFIX = "as predict.py's "


def traced(network: torch.nn.Module, inputs: Mapping[str, torch.Tensor]) -> torch.jit.ScriptModule:
    """`network` traced on `inputs` (its Python control flow fixed at their shapes; tensors' sizes stay free)."""
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")
        return torch.jit.trace(network.eval(), tuple(inputs.values()), check_trace=False)


def write_bundle(
    folder: Path, module: MedvolModule, run: DictConfig, ckpt: str, size: Sequence[int], authors: str, owner: str
) -> dict[str, Any]:
    """The bundle of `module` (trained in `run`, read from `ckpt`) in `folder`, its metadata naming `authors` and the
    copyright holder `owner`; its record for export.json."""
    network = module.bundle_network()
    assert network is not None
    channels = int(module.hparams.get("in_channels", 1))
    settings = inference_settings(module, run)
    (folder / "configs").mkdir(parents=True)
    (folder / "models").mkdir()
    example = torch.randn(1, channels, *[int(s) for s in size], generator=torch.Generator().manual_seed(0))
    traced(network, {"image": example}).save(str(folder / MODEL_FILE))
    segmentation = hasattr(module, "probabilities")
    steps = BundleSteps()
    config = inference_config(module, settings, size, segmentation, steps)
    (folder / "configs" / "inference.json").write_text(json.dumps(config, indent=2) + "\n")
    packages = {name: importlib.metadata.version(name) for name in sorted(steps.packages)}
    metadata = bundle_metadata(module, run, ckpt, settings, size, channels, segmentation, packages)
    metadata["authors"], metadata["copyright"] = authors, owner
    as_text(metadata, "configs/metadata.json")
    problem = metadata_problem(metadata)
    if problem:
        raise MedvolError(f"`format=bundle`: the metadata written is incomplete ({problem})")
    (folder / "configs" / "metadata.json").write_text(json.dumps(metadata, indent=2) + "\n")
    (folder / "README.md").write_text(readme(metadata, segmentation))
    return {"bundle": {"model": MODEL_FILE, "configs": ["configs/inference.json", "configs/metadata.json"]}}


def inference_settings(module: MedvolModule, run: DictConfig) -> dict[str, Any]:
    """The `dataset.transforms` predict.py reads an input file with (`file_transforms`: the run's own, at the
    spacing the model was trained at, on whole volumes), every setting the run left out at its default, without
    the training-only steps."""
    geometry = input_geometry(None, module.training_data, module.refines_resolution)
    settings = asdict(TransformSettings.from_config(file_transforms(with_geometry(run, geometry), geometry)))
    return {k: v for k, v in settings.items() if k not in TRAINING_ONLY}


class BundleSteps:
    """The transforms of inference.json, each described (`_desc_`) by the step of predict.py it does, and what
    they need: the helper functions (config ids -> expressions) they call, and the packages beyond PyTorch, numpy
    and MONAI that they import (`metadata.json`'s `required_packages_version`)."""

    def __init__(self) -> None:
        # LoadImaged and SaveImaged read and write NIfTI through nibabel.
        self.packages: set[str] = {"nibabel"}
        self.helpers: dict[str, str] = {}

    def helper(self, name: str) -> str:
        """A reference to the helper `name`, added with the helpers it calls and the packages it imports."""
        expression, packages = HELPERS[name]
        self.packages |= set(packages)
        for called in re.findall(r"@(\w+)", expression):
            self.helper(called)
        self.helpers[name] = expression
        return f"@{name}"

    def imports(self) -> list[str]:
        """inference.json's `imports`: what its expressions name, the packages its helpers use among them."""
        return [*BASE_IMPORTS, *(IMPORTS[p] for p in sorted(self.packages) if p in IMPORTS)]

    def preprocessing(self, settings: Mapping[str, Any], channels: int) -> list[dict[str, Any]]:
        """predict.py's preprocessing of one scan as MONAI transforms: load, the source grid kept for the inverse,
        orientation, then spacing (linear), the crop to the non-zero region and the intensity step, or with
        `resampling: nnunet` (the planned default) nnU-Net's order: crop, normalize, resample (cubic splines; a
        coarse axis over 3x the others, in the scan's spacing or else the target's, apart by nearest neighbour),
        and last the padding up to the window."""
        steps: list[dict[str, Any]] = [
            step("LoadVolumed", "LoadImaged", keys="image", image_only=True, ensure_channel_first=True,
                 dtype="$numpy.float32"),
            step("StoreSourceGridd", "CopyItemsd", keys="image", names=SOURCE_KEY),
        ]
        nnunet = settings.get("resampling") == "nnunet"
        if settings.get("orientation"):
            steps.append(step("Orientationd", "Orientationd", keys="image",
                              axcodes=as_text(settings["orientation"], "dataset.transforms.orientation"), labels=None))
        if settings.get("spacing") and not nnunet:
            steps.append(step("Spacingd", "Spacingd", keys="image", pixdim=[float(s) for s in settings["spacing"]],
                              mode="bilinear"))
        if settings.get("crop_foreground"):
            steps.append(step("CropForegroundd", "CropForegroundd", keys="image", source_key="image",
                              select_fn="$lambda x: (x != 0).any(0, keepdim=True)", allow_smaller=True))
        steps += self.intensity(settings, channels)
        if settings.get("spacing") and nnunet:
            spacing = [float(s) for s in settings["spacing"]]
            steps.append(step("PlannedSpacingd", "Lambdad", keys="image",
                              func=f"$lambda x: {self.helper('planned_spacing')}(x, {spacing})"))
            self.packages.add("scipy")  # MONAI's spline resampling is scipy.ndimage's
        if settings.get("pad_to"):
            value = single(background(settings, channels), "the padding's background")
            steps.append(step("BackgroundPadd", "SpatialPadd", keys="image",
                              spatial_size=[int(s) for s in settings["pad_to"]], mode="constant", value=value))
        return steps

    def intensity(self, settings: Mapping[str, Any], channels: int) -> list[dict[str, Any]]:
        """The intensity step: the plan's per-channel normalization (`PlannedNormalized`: MR a z-score, over the
        filled non-zero mask of all channels where the plan says; CT clipped, then the dataset's z-score), or a
        percentile or window scaling onto the output range whose per-scan ends are kept in the item
        (`intensity_low`, `intensity_high`) for the inverse."""
        mode = settings.get("intensity")
        low, high = (float(v) for v in settings.get("output_range", [-1.0, 1.0]))
        if mode == "zscore":
            plan = [dict(c) for c in settings.get("normalization") or [{"kind": "mr", "use_mask": True}] * channels]
            masked = any(c["kind"] == "mr" and c.get("use_mask", True) for c in plan)
            mask = f"{self.helper('nonzero_mask')}(v)" if masked else "None"
            return [step("PlannedNormalized", "Lambdad", keys="image", func=(
                f"$lambda x: (lambda v: monai.utils.convert_to_dst_type({self.helper('normalized')}(v, "
                f"{literal(plan, 'dataset.transforms.normalization')}, "
                f"{mask}), x, dtype=torch.float32)[0])(torch.nan_to_num(x.as_tensor().double()))"))]
        if mode == "percentile":
            lower, upper = (float(v) for v in settings.get("percentiles", [0.5, 99.5]))
            ends = (f"$lambda d: {{**d, 'intensity_low': [float(numpy.percentile(c, {lower})) for c in "
                    f"d['image'].numpy()], 'intensity_high': [float(numpy.percentile(c, {upper})) for c in "
                    "d['image'].numpy()]}")
            return [
                step("SafeScaleIntensityd", "Lambda", func=ends),
                step("SafeScaleIntensityd", "ScaleIntensityRangePercentilesd", keys="image", lower=lower,
                     upper=upper, b_min=low, b_max=high, clip=True, channel_wise=True),
            ]
        if mode == "window":
            window_low, window_high = (float(v) for v in settings.get("window", [-1000.0, 1000.0]))
            ends = (f"$lambda d: {{**d, 'intensity_low': [{window_low}] * d['image'].shape[0], "
                    f"'intensity_high': [{window_high}] * d['image'].shape[0]}}")
            return [
                step("SafeScaleIntensityd", "Lambda", func=ends),
                step("SafeScaleIntensityd", "ScaleIntensityRanged", keys="image", a_min=window_low,
                     a_max=window_high, b_min=low, b_max=high, clip=True),
            ]
        return []

    def postprocessing(self, module: MedvolModule, settings: Mapping[str, Any],
                       segmentation: bool) -> list[dict[str, Any]]:
        """The window's output back onto the scan's grid as predict.py does: a segmentation's logits as nnU-Net's
        (`logits_to_source_grid`: linear within the model grid's extent, a coarse axis of anisotropic data by
        nearest neighbour, the background beyond), then the softmax or sigmoid, the threshold or argmax, the run's
        post-processing and the training files' label values; an image linearly (`to_source_grid`) and in the
        scan's units."""
        if not segmentation:
            return [*self.units(settings), step("to_source_grid", "Lambda", func=(
                "$lambda d: {**d, 'pred': (lambda p, low: monai.transforms.ResampleToMatch(mode='bilinear', "
                "padding_mode='zeros', dtype=torch.float32)(p - low, d['" + SOURCE_KEY + "']) + low)(d['pred'], "
                "float(d['pred'].min()))}")), save("reconstruction", "$numpy.float32")]
        scheme = module.scheme  # type: ignore[attr-defined]
        # Voxels the model grid does not cover are background: logits whose softmax or sigmoid is the background.
        # The result carries the scan's meta: its affine, and the file name SaveImaged names the output after.
        fill = "[" + ", ".join("float('-inf')" if v == float("-inf") else repr(v)
                               for v in scheme.background_logits()) + "]"
        resample = step("logits_to_source_grid", "Lambda", func=(
            f"$lambda d: {{**d, 'pred': monai.data.MetaTensor({self.helper('logits_to_source')}(d['pred'], "
            f"d['{SOURCE_KEY}'], {fill}), meta=dict(d['{SOURCE_KEY}'].meta))}}"))
        activation = step("activation", "Lambdad", keys="pred", func=(
            "$lambda p: torch.sigmoid(p)" if scheme.is_regions else "$lambda p: torch.softmax(p, 0)"))
        if scheme.is_regions:
            order = sorted(range(len(scheme.regions)), key=lambda i: -len(list(scheme.regions.values())[i]))
            paint = [(i, int(scheme.region_values[list(scheme.regions)[i]])) for i in order]
            threshold = float(scheme.threshold)
            labels = step("label_maps", "Lambdad", keys="pred", func=(
                f"$lambda p: functools.reduce(lambda m, cv: torch.where(p[cv[0]:cv[0] + 1] > {threshold}, cv[1], m), "
                f"{paint}, torch.zeros_like(p[:1], dtype=torch.int64))"))
        else:
            labels = step("label_maps", "AsDiscreted", keys="pred", argmax=True, dtype="$torch.int64")
        largest = [
            step("Postprocessing", "Lambdad", keys="pred",
                 func=f"$lambda m: {self.helper('keep_largest')}(m, {[int(v) for v in values]})")
            for _, values in module.postprocessing.steps  # type: ignore[attr-defined]
        ]
        lookup = label_file_values(module)
        values = [] if lookup is None else [step("label_values", "Lambdad", keys="pred", func=(
            f"$lambda m: monai.utils.convert_to_dst_type(torch.tensor({lookup})[m.as_tensor().long()], m)[0]"))]
        return [resample, activation, labels, *largest, *values, save("seg", f"$numpy.{written_mask_dtype(module)}")]

    @staticmethod
    def units(settings: Mapping[str, Any]) -> list[dict[str, Any]]:
        """A reconstruction back into the scan's units: the percentile or window scaling inverted per channel with
        the scan's own ends, as predict.py's writer does (`to_source_units`); z units stay."""
        if settings.get("intensity") not in ("percentile", "window"):
            return []
        low, high = (float(v) for v in settings.get("output_range", [-1.0, 1.0]))
        return [step("to_source_units", "Lambda", func=(
            f"$lambda d: {{**d, 'pred': torch.stack([(c.clamp({low}, {high}) - {low}) / {high - low} * (hi - lo) "
            "+ lo for c, lo, hi in zip(d['pred'], d['intensity_low'], d['intensity_high'])])}"))]


def step(medvol_step: str, target: str, **arguments: Any) -> dict[str, Any]:
    """A transform of inference.json, described (`_desc_`, which MONAI does not pass on) by the step of predict.py
    it does: a transform of medvol's dataset (`PlannedNormalized`), or a function its model or writer calls."""
    return {"_target_": target, "_desc_": f"{DESCRIPTION_PREFIX}{medvol_step}", **arguments}


def save(postfix: str, dtype: str) -> dict[str, Any]:
    return step("save_volume", "SaveImaged", keys="pred", output_dir="@output_dir", output_postfix=postfix,
                separate_folder=False, resample=False, output_dtype=dtype, print_log=False)


# inference.json's helper functions (config id -> expression, the packages it imports beyond PyTorch, numpy and
# MONAI): the steps of predict.py that MONAI has no transform for, written as medvol runs them (no `@` operator:
# MONAI's config reads `@` as a reference).
HELPERS: dict[str, tuple[str, tuple[str, ...]]] = {
    # `datamodules.pipeline.transforms.nonzero_mask` (nnU-Net's `create_nonzero_mask`): the voxels non-zero in any
    # channel, holes filled.
    "nonzero_mask": ("$lambda v: torch.from_numpy(ndimage.binary_fill_holes((v != 0).any(0).numpy()))", ("scipy",)),
    # `PlannedNormalized` on (C, D, H, W) float64 values: per channel its plan's z-score (masked MR, MR, CT).
    "normalized": ("$lambda v, plans, mask: torch.stack([@normalized_channel(c, p, mask) for c, p in zip(v, plans)])",
                   ()),
    "normalized_channel": (
        "$lambda c, p, mask: ((c.clamp(p['clip'][0], p['clip'][1]) - p['mean']) / max(p['std'], 1e-8)) "
        "if p['kind'] == 'ct' else ((c - c.mean()) / max(float(c.std(unbiased=False)), 1e-8)) "
        "if not p.get('use_mask', True) else torch.where(mask, (c - c[mask].mean()) / "
        "max(float(c[mask].std(unbiased=False)), 1e-8), torch.zeros_like(c)) if bool(mask.any()) "
        "else torch.zeros_like(c)", ()),
    # `medvol.volumes.plan.separate_axis`: the coarse axis resampled apart, of the scan's spacing or else the
    # target's where over 3x anisotropic; None where neither is, or no axis is alone.
    "separate_axis": (
        "$lambda current, target: next((int(numpy.nonzero(numpy.asarray(s).max() / numpy.asarray(s) == 1)[0][0]) "
        "if int((numpy.asarray(s).max() / numpy.asarray(s) == 1).sum()) == 1 else None for s in (current, target) "
        f"if max(s) / min(s) > {ANISOTROPY}), None)", ()),
    # `PlannedSpacingd` on an image: cubic splines (edges repeated) to the target, or with a separate axis the
    # others first (that axis kept), then that axis by nearest neighbour.
    "planned_spacing": (
        "$lambda x, target: (lambda current: (lambda axis: functools.reduce(lambda v, step: "
        "monai.transforms.Spacing(step[0], mode=step[1], padding_mode='nearest')(v), [(target, 3)] if axis is None "
        "else [([c if i == axis else t for i, (c, t) in enumerate(zip(current, target))], 3), (target, 'nearest')], "
        "x))(@separate_axis(current, target)))([float(s) for s in x.pixdim[:3]])", ()),
    # `medvol.volumes.source_grid.logits_to_source_grid`: (C, D, H, W) logits on the model grid onto the source's grid,
    # source row blocks at a time: each voxel's position on the model grid (`source_positions`), held at the outermost
    # voxel centres, the separate axis at its nearest slice, looked up linearly; beyond half a voxel, `fill`.
    "logits_to_source": (
        "$lambda p, source, fill: (lambda mapping, shape: (lambda apart: torch.cat([@logits_rows("
        "p.as_tensor().float(), mapping, apart, numpy.arange(start, min(start + 64, shape[0])), shape, fill) for "
        "start in range(0, shape[0], 64)], 1))(@separate_axis(list(numpy.sqrt((p.affine.numpy()[:3, :3] ** 2).sum(0)"
        ")), [float(numpy.sqrt((source.affine.numpy()[:3, :3] ** 2).sum(0))[int(numpy.argmax(numpy.abs("
        "mapping[k, :3])))]) for k in range(3)])))(numpy.matmul(numpy.linalg.inv(p.affine.numpy().astype("
        "numpy.float64)), source.affine.numpy().astype(numpy.float64)), [int(n) for n in source.shape[1:]])", ()),
    "logits_rows": (
        "$lambda p, mapping, apart, rows, shape, fill: (lambda coords, size: (lambda nearest: (lambda inside: "
        "torch.tensor(fill, dtype=p.dtype).reshape(-1, 1).expand(p.shape[0], len(coords)).clone().masked_scatter("
        "torch.from_numpy(inside)[None].expand(p.shape[0], -1), torch.nn.functional.grid_sample(p[None], "
        "torch.from_numpy((numpy.where(numpy.arange(3) == (-1 if apart is None else apart), nearest, numpy.clip("
        "coords, 0, size - 1))[inside] / numpy.maximum(size - 1, 1) * 2 - 1)[:, ::-1].copy()).to(p.dtype).reshape("
        "1, -1, 1, 1, 3), mode='bilinear', padding_mode='border', align_corners=True)[0, :, :, 0, 0].contiguous())"
        ".reshape(p.shape[0], len(rows), shape[1], shape[2]))(numpy.all((nearest >= 0) & (nearest < size), axis=1)))("
        "numpy.floor(coords + 0.5)))(numpy.stack(numpy.meshgrid(rows, numpy.arange(shape[1]), numpy.arange(shape[2]), "
        "indexing='ij'), -1).reshape(-1, 3).dot(mapping[:3, :3].T) + mapping[:3, 3], numpy.asarray(p.shape[1:]))",
        ()),
    # `lightning_modules.segmentation.postprocessing.keep_largest` on a (1, D, H, W) label map: the voxels of
    # `values` outside their largest 26-connected component set to 0.
    "keep_largest": (
        "$lambda m, values: (lambda mask: (lambda found: m if found[1] < 2 else m.masked_fill(torch.from_numpy(mask "
        "& (found[0] != numpy.bincount(found[0].ravel())[1:].argmax() + 1))[None], 0))(ndimage.label(mask, "
        "structure=numpy.ones((3, 3, 3), dtype=bool))))(numpy.isin(m.as_tensor()[0].numpy(), values))", ("scipy",)),
}
# The modules inference.json's expressions name (the standard library's, and MONAI's own requirements), and how
# it imports each package a helper uses.
BASE_IMPORTS = ("$import functools", "$import glob", "$import os", "$import numpy", "$import torch", "$import monai")
IMPORTS = {"scipy": "$import scipy.ndimage as ndimage"}


def as_text(value: Any, where: str) -> Any:
    """`value` (a string, or a tree of them: keys too), refused in one line where a string in it starts with MONAI's
    config syntax (`MONAI_SYNTAX`), which MONAI would run, look up or load rather than read as text."""
    if isinstance(value, Mapping):
        for key, item in value.items():
            as_text(key, where)
            as_text(item, f"{where}.{key}")
    elif isinstance(value, (list, tuple)):
        for index, item in enumerate(value):
            as_text(item, f"{where}[{index}]")
    elif isinstance(value, str) and value.startswith(MONAI_SYNTAX):
        read = {EXPR_KEY: "Python", ID_REF_KEY: "a reference", MACRO_KEY: "a macro"}[value[0]]
        raise MedvolError(
            f"`format=bundle`: `{where}` is {value[:60]!r}, which MONAI's config would read as {read}; expected text "
            f"that starts with none of {', '.join(MONAI_SYNTAX)}"
        )
    return value


def literal(value: Any, where: str) -> str:
    """`value` as a Python literal inside one of inference.json's expressions, refused where a string in it holds
    `@` (MONAI rewrites `@name` anywhere in an expression into a lookup) or starts with MONAI's syntax."""
    as_text(value, where)
    written = repr(value)
    if ID_REF_KEY in written:
        raise MedvolError(
            f"`format=bundle`: `{where}` holds {ID_REF_KEY!r} ({written[:60]}), which MONAI's config reads as a "
            "reference inside an expression; expected values without it"
        )
    return written


def background(settings: Mapping[str, Any], channels: int) -> list[float]:
    """Per channel, the value a background voxel has after the intensity step (as the dataset pads)."""
    known = {k: v for k, v in settings.items() if k in TransformSettings.__dataclass_fields__}
    return TransformSettings.from_config(known).background(channels)


def single(values: Sequence[float], what: str) -> float:
    if len(set(values)) != 1:
        raise MedvolError(
            f"`format=bundle`: {what} differs between channels ({list(values)}); MONAI pads every channel with one "
            "value, so export format=onnx for the network"
        )
    return float(values[0])


def inference_config(
    module: MedvolModule, settings: Mapping[str, Any], size: Sequence[int], segmentation: bool, steps: BundleSteps
) -> dict[str, Any]:
    """configs/inference.json: the model zoo's ids (`bundle_root`, `dataset_dir`, `output_dir`, `network`,
    `preprocessing`, `inferer`, `postprocessing`, `run`), a plain loop over the scans (no ignite needed), and the
    helper functions its steps call (`steps` collects them and the packages they import)."""
    channels = int(module.hparams.get("in_channels", 1))
    preprocessing = steps.preprocessing(settings, channels)
    postprocessing = steps.postprocessing(module, settings, segmentation)
    pad = single(list(getattr(module, "pad_value", None) or [0.0]), "the window padding") if segmentation else 0.0
    overlap = float(module.hparams.get("overlap", 0.25)) if segmentation else 0.25
    each = ("$[@postprocessing({**item, 'pred': monai.data.MetaTensor(@inferer(item['image'][None].to(@device), "
            "@network)[0].float().cpu(), meta=item['image'].meta)}) for item in @dataset]")
    return {
        "imports": steps.imports(),
        "bundle_root": ".",
        "dataset_dir": "scans",
        "output_dir": "$@bundle_root + '/eval'",
        "device": "$torch.device('cuda' if torch.cuda.is_available() else 'cpu')",
        "datalist": "$sorted(glob.glob(os.path.join(@dataset_dir, '*.nii')) + "
                    "glob.glob(os.path.join(@dataset_dir, '*.nii.gz')))",
        "network": f"$torch.jit.load(os.path.join(@bundle_root, '{MODEL_FILE}'), map_location=@device).eval()",
        **steps.helpers,
        "preprocessing": {"_target_": "Compose", "transforms": preprocessing},
        "dataset": {"_target_": "Dataset", "data": "$[{'image': f} for f in @datalist]",
                    "transform": "@preprocessing"},
        "inferer": {"_target_": "SlidingWindowInferer", "roi_size": [int(s) for s in size], "sw_batch_size": 4,
                    "overlap": overlap, "mode": "gaussian", "padding_mode": "constant", "cval": pad},
        "postprocessing": {"_target_": "Compose", "transforms": postprocessing},
        "initialize": ["$torch.set_grad_enabled(False)", "$os.makedirs(@output_dir, exist_ok=True)"],
        "run": [each],
        # What initialize turned off, back on (PyTorch's default) for a bundle run inside a user's process (a notebook).
        "finalize": ["$torch.set_grad_enabled(True)"],
    }


def bundle_metadata(
    module: MedvolModule, run: DictConfig, ckpt: str, settings: Mapping[str, Any], size: Sequence[int],
    channels: int, segmentation: bool, packages: Mapping[str, str],
) -> dict[str, Any]:
    """configs/metadata.json: the specification's mandatory keys (`packages`: what the config imports beyond
    MONAI's own requirements, with their versions), and medvol's record (plan, labels, units)."""
    dataset = run.dataset
    names = list(dataset.get("image_modalities") or [f"channel{c}" for c in range(channels)])
    spacing = settings.get("spacing")
    kind = "CT" if any(c.get("kind") == "ct" for c in settings.get("normalization") or []) or \
        settings.get("intensity") == "window" else "MR"
    units = {
        "zscore": "z-score per the plan's normalization (MR: over the non-zero voxels; CT: clipped, dataset z-score)",
        "percentile": f"percentiles {settings.get('percentiles')} mapped onto {settings.get('output_range')}",
        "window": f"window {settings.get('window')} mapped onto {settings.get('output_range')}",
    }.get(str(settings.get("intensity")), "as stored")
    inputs = {"image": {
        "type": "image", "format": "magnitude", "modality": kind, "num_channels": channels,
        "spatial_shape": [int(s) for s in size], "dtype": "float32", "value_range": [],
        "is_patch_data": True, "channel_def": {str(i): str(n) for i, n in enumerate(names)},
        "spacing_mm": [float(s) for s in spacing] if spacing else "each scan's own",
        "orientation": settings.get("orientation"), "intensity": units,
    }}
    window = [int(s) for s in size]
    if segmentation:
        # models/model.ts gives per window the logits predict.py blends (mirrored copies averaged): of softmax
        # classes (one-hot `labels` in the specification's words) or of sigmoid regions (`classes`: several may hold
        # at a voxel); the softmax or sigmoid comes once they are on the scan's grid, as nnU-Net's.
        scheme = module.scheme  # type: ignore[attr-defined]
        classes = scheme.names if scheme.is_regions else ["background", *scheme.names]
        outputs = {"pred": {
            "type": "image", "format": "classes" if scheme.is_regions else "labels", "modality": "n/a",
            "num_channels": len(classes), "spatial_shape": window, "dtype": "float32", "value_range": [],
            "is_patch_data": True, "channel_def": {str(i): f"logit of {n}" for i, n in enumerate(classes)},
        }}
        lookup = label_file_values(module) or list(range(scheme.num_classes))
        labels = ({n: [lookup[v] for v in values] for n, values in scheme.segments.items()} if scheme.is_regions
                  else {str(lookup[i]): n for i, n in enumerate(classes)})
        written = {"file": "<scan>_seg.nii.gz", "dtype": written_mask_dtype(module), "grid": "the scan's own",
                   "labels": labels,
                   "rule": f"regions painted largest first where their probability > {float(scheme.threshold)}"
                   if scheme.is_regions else "argmax of the probabilities"}
        task = f"3D segmentation of {', '.join(scheme.names)}"
    else:
        outputs = {"pred": {
            "type": "image", "format": "magnitude", "modality": kind, "num_channels": channels,
            "spatial_shape": window, "dtype": "float32", "value_range": [-1, 1], "is_patch_data": True,
            "channel_def": {str(i): f"{n} reconstructed, in model units" for i, n in enumerate(names)},
        }}
        written = {"file": "<scan>_reconstruction.nii.gz", "dtype": "float32", "grid": "the scan's own",
                   "units": "the scan's own (the intensity scaling undone)"}
        task = "3D VQ-GAN reconstruction"
    run_dir = run_dir_of_checkpoint(ckpt)
    plan_file = run_dir / PLAN_FILE if run_dir is not None else None
    return {
        "version": "0.1.0",
        "changelog": {"0.1.0": f"exported by medvol export.py from {Path(ckpt).name}"},
        "monai_version": monai_version,
        "pytorch_version": torch.__version__.split("+")[0],
        "numpy_version": numpy.__version__,
        PACKAGES_KEY: dict(packages),
        "name": f"medvol_{type(module).__name__.lower()}",
        "task": task,
        "description": f"{task}, trained with medvol; the whole predict.py pipeline (preprocessing, sliding window"
                       f"{', mirroring' if getattr(module, 'tta', False) else ''}, outputs on each scan's grid)",
        "authors": "",
        "copyright": "",
        "network_data_format": {"inputs": inputs, "outputs": outputs},
        "medvol": {
            "plan": read_plan(plan_file) if plan_file is not None and plan_file.is_file() else None,
            "labels": getattr(getattr(module, "scheme", None), "names", None),
            "output_file": written,
            "training_data": module.training_data or {},
        },
    }


def written_mask_dtype(module: MedvolModule) -> str:
    """The numpy type of the label maps a segmentation bundle writes: predict.py's (`mask_dtype` of the largest label
    value written, the training files' where they differ from the model's), uint8 as nnU-Net's below 256."""
    values = label_file_values(module) or list(range(module.scheme.num_classes))  # type: ignore[attr-defined]
    return numpy.dtype(mask_dtype(max(values))).name


def metadata_problem(metadata: Mapping[str, Any]) -> str | None:
    """What a metadata.json lacks of the bundle specification's mandatory keys, or None."""
    missing = [key for key in METADATA_KEYS if key not in metadata]
    if missing:
        return f"missing {', '.join(missing)}"
    data_format = metadata["network_data_format"]
    if not isinstance(data_format, Mapping) or not {"inputs", "outputs"} <= set(data_format):
        return "network_data_format needs inputs and outputs"
    for side in ("inputs", "outputs"):
        for name, tensor in data_format[side].items():
            lacking = [key for key in TENSOR_KEYS if key not in tensor]
            if lacking:
                return f"network_data_format.{side}.{name} lacks {', '.join(lacking)}"
    return None


def readme(metadata: Mapping[str, Any], segmentation: bool) -> str:
    written = metadata["medvol"]["output_file"]
    output = f"<scan>_seg.nii.gz (label map, {written['dtype']})" if segmentation else "<scan>_reconstruction.nii.gz"
    packages = list(metadata[PACKAGES_KEY])
    image = metadata["network_data_format"]["inputs"]["image"]
    channels = "; ".join(f"{index}: {name}" for index, name in image["channel_def"].items())
    labels = written.get("labels") or {}
    label_lines = "".join(f"- `{name}`: {value}\n" for name, value in labels.items())
    return (
        f"# {metadata['name']}\n\n{metadata['description']}.\n\n"
        f"Needs MONAI, PyTorch, numpy and {', '.join(packages)} (not medvol; `{PACKAGES_KEY}` in "
        "`configs/metadata.json` gives the versions it was exported with), and fire for MONAI's command line "
        f"(`pip install monai {' '.join(packages)} fire`):\n\n"
        "```bash\npython -m monai.bundle run --config_file configs/inference.json --bundle_root . "
        "--dataset_dir scans/ --output_dir out/\n```\n\n"
        f"Every `.nii`/`.nii.gz` file in `scans/` (one subject per file; a 4D file's last axis holds the channels) "
        f"gives `out/{output}` on the scan's own grid, as medvol's predict.py writes it. `configs/metadata.json` "
        "says what the network expects (channels, spacing, intensity) and gives, under `medvol`, the training plan "
        "and the label names.\n\n"
        f"## Channels\n\nIn this order, {image['num_channels']} channel(s) (a 4D file's last axis; nnU-Net's "
        f"`<case>_0000` ... files in their index order): {channels}.\n"
        + (f"\n## Labels written\n\n{written.get('rule', '')}:\n\n{label_lines}" if segmentation else "")
    )
