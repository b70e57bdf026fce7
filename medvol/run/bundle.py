"""A trained model as a MONAI bundle that runs without medvol: what predict.py does, in MONAI's own transforms.

`write_bundle` writes the bundle layout of MONAI's specification:

    configs/metadata.json    every key the specification makes mandatory, the inputs' channels, spacing and
                             units, the outputs' classes or units; the run's plan and label names under `medvol`
    configs/inference.json   `python -m monai.bundle run --config_file configs/inference.json --bundle_root DIR
                             --dataset_dir SCANS --output_dir OUT`: every NIfTI file of SCANS through the run's
                             preprocessing (orientation, spacing, crop, normalization), the sliding window of
                             predict.py (window, overlap, Gaussian blending, padding), the output resampled onto
                             the scan's own grid, and for segmentation the argmax or threshold and the run's
                             post-processing; `<scan>_seg.nii.gz` or `<scan>_reconstruction.nii.gz` in OUT
    models/model.ts          the window network (`MedvolModule.bundle_network`: mirroring and the softmax or
                             sigmoid inside for segmentation), TorchScript: no medvol class is needed to load it
    README.md                the command

The preprocessing is built in one place (`preprocessing`) from the run's `dataset.transforms` after the plan
(`<run>/plan.json`) was applied, exactly the settings predict.py's dataset gets.
"""

from __future__ import annotations

import json
import warnings
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import nibabel
import numpy
import torch
from monai import __version__ as monai_version
from omegaconf import DictConfig, OmegaConf

from datamodules.pipeline.transforms import TransformSettings
from lightning_modules.base import MedvolModule
from medvol.core.errors import MedvolError
from medvol.run.predict_config import input_geometry, with_geometry
from medvol.run.predict_inputs import WHOLE_VOLUME
from medvol.run.resolvers import run_dir_of_checkpoint
from medvol.volumes.plan import PLAN_FILE, read_plan, separate_axis

# Keys the bundle specification makes mandatory in configs/metadata.json, and in each of network_data_format's
# inputs and outputs (MONAI's "MONAI Bundle Specification", metadata.json).
METADATA_KEYS = (
    "version", "monai_version", "pytorch_version", "numpy_version", "optional_packages_version", "task",
    "description", "authors", "copyright", "network_data_format",
)
TENSOR_KEYS = (
    "type", "format", "modality", "num_channels", "spatial_shape", "dtype", "value_range", "is_patch_data",
    "channel_def",
)
SOURCE_KEY = "source"
# `dataset.transforms` keys that only training applies (random crops, flips, affine); predict.py never does.
TRAINING_ONLY = ("random_crop", "foreground_crop", "foreground_ratio", "flip_prob", "affine_prob", "rotate_range",
                 "scale_range")
MODEL_FILE = "models/model.ts"


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
    config = inference_config(module, settings, size, segmentation)
    (folder / "configs" / "inference.json").write_text(json.dumps(config, indent=2) + "\n")
    metadata = bundle_metadata(module, run, ckpt, settings, size, channels, segmentation)
    metadata["authors"], metadata["copyright"] = authors, owner
    problem = metadata_problem(metadata)
    if problem:
        raise MedvolError(f"`format=bundle`: the metadata written is incomplete ({problem})")
    (folder / "configs" / "metadata.json").write_text(json.dumps(metadata, indent=2) + "\n")
    (folder / "README.md").write_text(readme(metadata, segmentation))
    return {"bundle": {"model": MODEL_FILE, "configs": ["configs/inference.json", "configs/metadata.json"]}}


def inference_settings(module: MedvolModule, run: DictConfig) -> dict[str, Any]:
    """The run's `dataset.transforms` as predict.py applies them by default: at the spacing the model was trained
    at, on whole volumes, without the training-only random steps."""
    geometry = input_geometry(None, module.training_data, module.refines_resolution)
    transforms = with_geometry(run, geometry).dataset.get("transforms")
    settings = {**(OmegaConf.to_container(transforms, resolve=True) if transforms is not None else {}), **WHOLE_VOLUME}
    return {k: v for k, v in settings.items() if k not in TRAINING_ONLY}


def preprocessing(settings: Mapping[str, Any], channels: int) -> list[dict[str, Any]]:
    """predict.py's preprocessing of one scan as MONAI transforms (bundle config entries), from the run's
    `dataset.transforms` with the plan applied: load, the source grid kept for the inverse, orientation, then spacing
    (linear), the crop to the non-zero region and the intensity step, or with `resampling: nnunet` (the planned
    default) nnU-Net's order: crop, normalize, resample (cubic splines; a target over 3x anisotropic has its coarse
    axis resampled apart, by nearest neighbour), and last the padding up to the window."""
    steps: list[dict[str, Any]] = [
        {"_target_": "LoadImaged", "keys": "image", "image_only": True, "ensure_channel_first": True,
         "dtype": "$numpy.float32"},
        {"_target_": "CopyItemsd", "keys": "image", "names": SOURCE_KEY},
    ]
    nnunet = settings.get("resampling") == "nnunet"
    if settings.get("orientation"):
        steps.append({"_target_": "Orientationd", "keys": "image", "axcodes": settings["orientation"], "labels": None})
    if settings.get("spacing") and not nnunet:
        steps.append({"_target_": "Spacingd", "keys": "image", "pixdim": [float(s) for s in settings["spacing"]],
                      "mode": "bilinear"})
    if settings.get("crop_foreground"):
        steps.append({"_target_": "CropForegroundd", "keys": "image", "source_key": "image",
                      "select_fn": "$lambda x: (x != 0).any(0, keepdim=True)", "allow_smaller": True})
    steps += intensity_steps(settings, channels)
    if settings.get("spacing") and nnunet:
        steps += planned_spacing_steps([float(s) for s in settings["spacing"]])
    if settings.get("pad_to"):
        value = single(background(settings, channels), "the padding's background")
        steps.append({"_target_": "SpatialPadd", "keys": "image", "spatial_size": [int(s) for s in settings["pad_to"]],
                      "mode": "constant", "value": value})
    return steps


def planned_spacing_steps(spacing: list[float]) -> list[dict[str, Any]]:
    """`PlannedSpacingd` for an image: cubic splines (edges repeated); where the target spacing is over 3x
    anisotropic, first the other axes (a pixdim of 0 keeps the scan's own), then its coarse axis by nearest
    neighbour. A scan anisotropic beyond the target's rule (predict resamples its own coarse axis apart) is the
    one case the bundle resamples otherwise (docs/export.md)."""
    axis = separate_axis(spacing, spacing)
    if axis is None:
        return [{"_target_": "Spacingd", "keys": "image", "pixdim": spacing, "mode": 3, "padding_mode": "nearest"}]
    in_plane = [0.0 if i == axis else s for i, s in enumerate(spacing)]
    return [
        {"_target_": "Spacingd", "keys": "image", "pixdim": in_plane, "mode": 3, "padding_mode": "nearest"},
        {"_target_": "Spacingd", "keys": "image", "pixdim": spacing, "mode": "nearest", "padding_mode": "nearest"},
    ]


def intensity_steps(settings: Mapping[str, Any], channels: int) -> list[dict[str, Any]]:
    """The intensity step: the plan's per-channel z-score (MR over the non-zero voxels; CT clipped, then the
    dataset's z-score), or a percentile or window scaling onto the output range whose per-scan ends are kept in
    the item (`intensity_low`, `intensity_high`) for the inverse."""
    mode = settings.get("intensity", "percentile")
    low, high = (float(v) for v in settings.get("output_range", [-1.0, 1.0]))
    if mode == "zscore":
        plan = settings.get("normalization") or [{"kind": "mr"}] * channels
        kinds = {c["kind"] for c in plan}
        if kinds == {"mr"}:
            # The plan's mask rule: over the non-zero voxels where cropping to them removes a quarter of the volume.
            masked = any(c.get("use_mask", True) for c in plan)
            return [{"_target_": "NormalizeIntensityd", "keys": "image", "nonzero": masked, "channel_wise": True}]
        if kinds == {"ct"} and len(plan) == 1:
            clip_low, clip_high = (float(v) for v in plan[0]["clip"])
            mean, std = float(plan[0]["mean"]), float(plan[0]["std"])
            return [{"_target_": "ScaleIntensityRanged", "keys": "image", "a_min": clip_low, "a_max": clip_high,
                     "b_min": (clip_low - mean) / std, "b_max": (clip_high - mean) / std, "clip": True}]
        raise MedvolError(
            f"`format=bundle`: the plan normalizes its channels as {[c['kind'] for c in plan]}; a bundle exports "
            "MR channels or one CT channel (export format=onnx for the network)"
        )
    if mode == "percentile":
        lower, upper = (float(v) for v in settings.get("percentiles", [0.5, 99.5]))
        ends = (f"$lambda d: {{**d, 'intensity_low': [float(numpy.percentile(c, {lower})) for c in "
                f"d['image'].numpy()], 'intensity_high': [float(numpy.percentile(c, {upper})) for c in "
                "d['image'].numpy()]}")
        return [
            {"_target_": "Lambda", "func": ends},
            {"_target_": "ScaleIntensityRangePercentilesd", "keys": "image", "lower": lower, "upper": upper,
             "b_min": low, "b_max": high, "clip": True, "channel_wise": True},
        ]
    if mode == "window":
        window_low, window_high = (float(v) for v in settings.get("window", [-1000.0, 1000.0]))
        ends = (f"$lambda d: {{**d, 'intensity_low': [{window_low}] * d['image'].shape[0], "
                f"'intensity_high': [{window_high}] * d['image'].shape[0]}}")
        return [
            {"_target_": "Lambda", "func": ends},
            {"_target_": "ScaleIntensityRanged", "keys": "image", "a_min": window_low, "a_max": window_high,
             "b_min": low, "b_max": high, "clip": True},
        ]
    return []


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


def postprocessing(module: MedvolModule, settings: Mapping[str, Any], segmentation: bool) -> list[dict[str, Any]]:
    """The window's output back onto the scan's grid (linear, as predict.py), then for segmentation the argmax
    or threshold into label values and the run's post-processing; for an image, the scan's units first."""
    resample = {"_target_": "ResampleToMatchd", "keys": "pred", "key_dst": SOURCE_KEY, "mode": "bilinear",
                "padding_mode": "zeros" if segmentation else "border", "dtype": "$torch.float32"}
    if not segmentation:
        low, high = (float(v) for v in settings.get("output_range", [-1.0, 1.0]))
        units = []
        if settings.get("intensity") in ("percentile", "window"):
            units = [{"_target_": "Lambda", "func": (
                f"$lambda d: {{**d, 'pred': torch.stack([(c.clamp({low}, {high}) - {low}) / {high - low} * (hi - lo) "
                "+ lo for c, lo, hi in zip(d['pred'], d['intensity_low'], d['intensity_high'])])}")}]
        return [*units, resample,
                {"_target_": "SaveImaged", "keys": "pred", "output_dir": "@output_dir",
                 "output_postfix": "reconstruction", "separate_folder": False, "resample": False,
                 "output_dtype": "$numpy.float32", "print_log": False}]
    scheme = module.scheme  # type: ignore[attr-defined]
    if scheme.is_regions:
        order = sorted(range(len(scheme.regions)), key=lambda i: -len(list(scheme.regions.values())[i]))
        paint = [(i, int(scheme.region_values[list(scheme.regions)[i]])) for i in order]
        labels = {"_target_": "Lambdad", "keys": "pred", "func": (
            f"$lambda p: functools.reduce(lambda m, cv: torch.where(p[cv[0]:cv[0] + 1] > {float(scheme.threshold)}, "
            f"cv[1], m), {paint}, torch.zeros_like(p[:1], dtype=torch.int64))")}
    else:
        labels = {"_target_": "AsDiscreted", "keys": "pred", "argmax": True}
    largest = [
        {"_target_": "KeepLargestConnectedComponentd", "keys": "pred", "applied_labels": [int(v) for v in values],
         "independent": False, "connectivity": 3}
        for _, values in module.postprocessing.steps  # type: ignore[attr-defined]
    ]
    return [resample, labels, *largest,
            {"_target_": "SaveImaged", "keys": "pred", "output_dir": "@output_dir", "output_postfix": "seg",
             "separate_folder": False, "resample": False, "output_dtype": "$numpy.int16", "print_log": False}]


def inference_config(
    module: MedvolModule, settings: Mapping[str, Any], size: Sequence[int], segmentation: bool
) -> dict[str, Any]:
    """configs/inference.json: the model zoo's ids (`bundle_root`, `dataset_dir`, `output_dir`, `network`,
    `preprocessing`, `inferer`, `postprocessing`, `run`), a plain loop over the scans (no ignite needed)."""
    channels = int(module.hparams.get("in_channels", 1))
    pad = single(list(getattr(module, "pad_value", None) or [0.0]), "the window padding") if segmentation else 0.0
    overlap = float(module.hparams.get("overlap", 0.25)) if segmentation else 0.25
    each = ("$[@postprocessing({**item, 'pred': monai.data.MetaTensor(@inferer(item['image'][None].to(@device), "
            "@network)[0].float().cpu(), meta=item['image'].meta)}) for item in @dataset]")
    return {
        "imports": ["$import functools", "$import glob", "$import os", "$import numpy", "$import torch",
                    "$import monai"],
        "bundle_root": ".",
        "dataset_dir": "scans",
        "output_dir": "$@bundle_root + '/eval'",
        "device": "$torch.device('cuda' if torch.cuda.is_available() else 'cpu')",
        "datalist": "$sorted(glob.glob(os.path.join(@dataset_dir, '*.nii')) + "
                    "glob.glob(os.path.join(@dataset_dir, '*.nii.gz')))",
        "network": f"$torch.jit.load(os.path.join(@bundle_root, '{MODEL_FILE}'), map_location=@device).eval()",
        "preprocessing": {"_target_": "Compose", "transforms": preprocessing(settings, channels)},
        "dataset": {"_target_": "Dataset", "data": "$[{'image': f} for f in @datalist]",
                    "transform": "@preprocessing"},
        "inferer": {"_target_": "SlidingWindowInferer", "roi_size": [int(s) for s in size], "sw_batch_size": 4,
                    "overlap": overlap, "mode": "gaussian", "padding_mode": "constant", "cval": pad},
        "postprocessing": {"_target_": "Compose", "transforms": postprocessing(module, settings, segmentation)},
        "initialize": ["$torch.set_grad_enabled(False)", "$os.makedirs(@output_dir, exist_ok=True)"],
        "run": [each],
        "finalize": [],
    }


def bundle_metadata(
    module: MedvolModule, run: DictConfig, ckpt: str, settings: Mapping[str, Any], size: Sequence[int],
    channels: int, segmentation: bool,
) -> dict[str, Any]:
    """configs/metadata.json: the specification's mandatory keys, and medvol's record (plan, labels, units)."""
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
        # models/model.ts gives per window the probabilities predict.py blends: softmax classes (one-hot `labels`
        # in the specification's words) or sigmoid regions (`classes`: several may hold at a voxel).
        scheme = module.scheme  # type: ignore[attr-defined]
        classes = scheme.names if scheme.is_regions else ["background", *scheme.names]
        outputs = {"pred": {
            "type": "image", "format": "classes" if scheme.is_regions else "labels", "modality": "n/a",
            "num_channels": len(classes), "spatial_shape": window, "dtype": "float32", "value_range": [0, 1],
            "is_patch_data": True, "channel_def": {str(i): f"probability of {n}" for i, n in enumerate(classes)},
        }}
        written = {"file": "<scan>_seg.nii.gz", "dtype": "int16", "grid": "the scan's own", "labels": (
            {n: [int(v) for v in values] for n, values in scheme.regions.items()} if scheme.is_regions else
            {str(i): n for i, n in enumerate(classes)}),
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
        "optional_packages_version": {"nibabel": nibabel.__version__},
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
    output = "<scan>_seg.nii.gz (label map)" if segmentation else "<scan>_reconstruction.nii.gz"
    return (
        f"# {metadata['name']}\n\n{metadata['description']}.\n\n"
        "Needs MONAI, PyTorch, numpy and nibabel (not medvol), and fire for MONAI's command line "
        "(`pip install monai nibabel fire`):\n\n"
        "```bash\npython -m monai.bundle run --config_file configs/inference.json --bundle_root . "
        "--dataset_dir scans/ --output_dir out/\n```\n\n"
        f"Every `.nii`/`.nii.gz` file in `scans/` (one subject per file; a 4D file's last axis holds the channels) "
        f"gives `out/{output}` on the scan's own grid, as medvol's predict.py writes it. `configs/metadata.json` "
        "says what the network expects (channels, spacing, intensity) and gives, under `medvol`, the training plan "
        "and the label names.\n"
    )
