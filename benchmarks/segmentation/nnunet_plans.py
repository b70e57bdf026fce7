"""nnU-Net v2's own planner as the reference for medvol's (issue 40), and the two planners side by side.

    /work/nnunet-venv/bin/python benchmarks/segmentation/nnunet_plans.py reference [--out tests/data/nnunet_plans.json]
    .venv/bin/python benchmarks/segmentation/nnunet_plans.py compare [--out outputs/benchmarks/nnunet-plans]
    /work/nnunet-venv/bin/python benchmarks/segmentation/nnunet_plans.py step [--out tests/data/nnunet_step.pt]
    /work/nnunet-venv/bin/python benchmarks/segmentation/nnunet_plans.py rules [--out tests/data/nnunet_rules.pt]

`reference` runs in a venv of its own that has nnunetv2 2.8.1 (`pip install nnunetv2==2.8.1`: it brings a CUDA
torch, which must never enter the project's .venv; everything here runs on the CPU). It records what nnU-Net
itself answers, as the test data `tests/medvol/volumes/test_nnunet_rules.py` compares medvol's planner with:

- six planning cases (isotropic MR, 3x3x6 mm, 0.8x0.8x4 mm thick slices, ACDC-like 1.5x1.5x10 mm with some 5 mm
  cases, CT 0.7x0.7x2.5 mm, and a 1 mm dataset whose patch is given as 160x160x12): each a dataset fingerprint
  (spacings and cropped shapes per case, as `nnUNetv2_extract_fingerprint` writes it) planned by
  `ExperimentPlanner(...).plan_experiment()`; its 3d_fullres spacing, patch, batch, strides, kernels and
  transposition, and the trainer's augmentation settings for that patch
  (`configure_rotation_dummyDA_mirroring_and_inital_patch_size`);
- `get_pool_and_conv_props` and the VRAM estimate (`compute_conv_feature_map_size` of the planned
  PlainConvUNet) on a few patches, fractional median shapes included;
- `plan_and_preprocess`'s fingerprint and normalization choice on tiny synthetic NIfTI datasets: MR with and
  without a zero background (the non-zero mask rule), and CT with one lesion-free subject (the statistics).

Regenerate after an nnU-Net upgrade with the first command line above; the file says which nnunetv2 made it.

`step` (nnU-Net's venv) records nnU-Net's own training step as the reference for medvol's
(`tests/lightning_modules/segmentation/test_nnunet_step.py`): a PlainConvUNet of 4 stages at 2-16 filters with its
He initialisation, its deep-supervision loss for 3 regions (targets pooled by batchgeneratorsv2), clip_grad_norm_(12)
and SGD, three steps on one fixed batch; weights and image rounded to float16 so the file holds them exactly. With
`--plans`, a real plan's network, batch and patch (`benchmarks/segmentation/segmentation.py same-step` uses it).

`rules` (nnU-Net's venv) records nnU-Net's own answers for the rules of issue 50 as the reference of
`tests/lightning_modules/segmentation/test_nnunet_rules.py` (`tests/data/nnunet_rules.pt`): its Dice + CE and
Dice + BCE losses with `batch_dice` on and off and with an ignore label, batchgeneratorsv2's one-hot linear
resampling of a label map and of region channels in its SpatialTransform (on a given sampling grid, nnU-Net's
padding label -1 turned into 0 as its `RemoveLabelTansform` does), the predictor's mirrored logits
(`_internal_maybe_mirror_and_predict`) and the resampling of logits onto the scan's grid
(`resample_data_or_seg_to_shape` as its plans' `resampling_fn_probabilities`, and the axis
`determine_do_sep_z_and_axis` resamples apart) where the scan, the model grid or neither is over 3x anisotropic.

`gpu-step` (nnU-Net's packages: its venv, or on the GPU the round's wheels) times nnU-Net's own training step at its
BraTS plan (128^3, batch 2, bf16) on the card `benchmarks/segmentation/segmentation.py gpu` times medvol's planned step
on (`benchmarks/gpu_round.py`'s `nnunet-step`).

`compare` (project venv; calls the nnU-Net venv for nnU-Net's side) writes four datasets as files (BraTS layout on
the MNI152 brain at 4 mm and 2 mm, the same brains at 0.9x0.9x4 mm thick slices, and CT phantoms at 0.7x0.7x2.5
mm with one lesion-free subject), runs nnU-Net's fingerprint extraction and planner on them
(nnU-Net's raw layout, linked), and medvol's planner on the same files (`plan_fingerprint` + `make_plan` at
nnU-Net's defaults: 8 GB, 32 filters), and prints both side by side as a markdown table.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root, for a direct run
from benchmarks.common import ROOT, table_header  # noqa: E402

NNUNET_PYTHON = os.environ.get("NNUNET_PYTHON", "/work/nnunet-venv/bin/python")

# medvol's axes (the NIfTI voxel axes, x y z); nnU-Net reads them reversed. Per case: spacing and cropped shape.
PLANNING_CASES: dict[str, dict[str, Any]] = {
    "isotropic_mr": {"spacing": [[1.0, 1.0, 1.0]], "shape": [140, 172, 138], "channels": 4, "labels": 4,
                     "cases": 40, "jitter": 0.12},
    "mr_3x3x6": {"spacing": [[3.0, 3.0, 6.0]], "shape": [62, 76, 26], "channels": 2, "labels": 3, "cases": 30,
                 "jitter": 0.1},
    "thick_slices_0.8x0.8x4": {"spacing": [[0.8, 0.8, 4.0]], "shape": [300, 290, 28], "channels": 1, "labels": 3,
                               "cases": 30, "jitter": 0.1},
    # ACDC: mostly 10 mm slices, a sixth of the cases at 5 or 6.5 mm: nnU-Net takes the 10th percentile in z.
    "acdc_1.5x1.5x10": {"spacing": [[1.5, 1.5, 10.0]] * 5 + [[1.4, 1.4, 5.0], [1.6, 1.6, 6.5]], "shape": [220, 230, 10],
                        "channels": 1, "labels": 4, "cases": 100, "jitter": 0.1},
    "ct_0.7x0.7x2.5": {"spacing": [[0.7, 0.7, 2.5]], "shape": [480, 400, 160], "channels": 1, "labels": 3,
                       "cases": 40, "jitter": 0.15},
    "given_patch_160x160x12": {"spacing": [[1.0, 1.0, 1.0]], "shape": [170, 180, 40], "channels": 1, "labels": 2,
                               "cases": 20, "jitter": 0.05, "given_patch": [160, 160, 12]},
}
# get_pool_and_conv_props on (spacing, patch) in nnU-Net's order, fractional sizes included.
TOPOLOGIES = [
    ([1.0, 1.0, 1.0], [12, 160, 160]), ([1.0, 1.0, 1.0], [160, 160, 12]), ([4.0, 0.8, 0.8], [32, 128, 128]),
    ([6.0, 3.0, 3.0], [26, 62, 76]), ([10.0, 1.5, 1.5], [10, 224, 224]), ([2.5, 0.7, 0.7], [80.5, 192, 160]),
    ([3.0, 1.0, 1.0], [20, 139.5, 97]), ([1.0, 1.0, 1.0], [7, 7, 7]),
]


def case_table(case: dict[str, Any]) -> tuple[list[list[float]], list[list[int]]]:
    """Deterministic per-case spacings and cropped shapes (medvol order) around the case's values."""
    import numpy as np

    rng = np.random.default_rng(0)
    spacings, shapes = [], []
    for i in range(case["cases"]):
        spacings.append([float(s) for s in case["spacing"][i % len(case["spacing"])]])
        jitter = rng.uniform(1 - case["jitter"], 1 + case["jitter"], 3)
        shapes.append([max(4, int(round(s * j))) for s, j in zip(case["shape"], jitter, strict=True)])
    return spacings, shapes


# ---- reference: nnU-Net's answers (nnU-Net venv) ------------------------------------------------------------------


def nnunet_environment(work: Path) -> None:
    for name in ("nnUNet_raw", "nnUNet_preprocessed", "nnUNet_results"):
        (work / name).mkdir(parents=True, exist_ok=True)
        os.environ[name] = str(work / name)


def write_raw(raw: Path, name: str, channels: list[str], labels: dict[str, Any], cases: dict[str, Any],
              num_training: int | None = None) -> None:
    """An nnU-Net raw dataset: imagesTr/<case>_XXXX.nii.gz, labelsTr/<case>.nii.gz, dataset.json.
    `cases`: case -> (list of channel arrays, label array, spacing in medvol order)."""
    import nibabel as nib
    import numpy as np

    folder = raw / name
    (folder / "imagesTr").mkdir(parents=True, exist_ok=True)
    (folder / "labelsTr").mkdir(parents=True, exist_ok=True)
    for case, (images, label, spacing) in cases.items():
        affine = np.diag([*spacing, 1.0])
        for c, image in enumerate(images):
            path = folder / "imagesTr" / f"{case}_{c:04d}.nii.gz"
            nib.save(nib.Nifti1Image(np.asarray(image, np.float32), affine), str(path))
        nib.save(nib.Nifti1Image(np.asarray(label, np.uint8), affine), str(folder / "labelsTr" / f"{case}.nii.gz"))
    (folder / "dataset.json").write_text(json.dumps({
        "channel_names": {str(i): n for i, n in enumerate(channels)}, "labels": labels,
        "numTraining": num_training or len(cases), "file_ending": ".nii.gz",
    }, indent=2))


def plan_from_fingerprint(work: Path, number: int, name: str, case: dict[str, Any]) -> dict[str, Any]:
    """nnU-Net's ExperimentPlanner on a written fingerprint (one tiny case on disk for the reader)."""
    import numpy as np
    from nnunetv2.experiment_planning.experiment_planners.default_experiment_planner import ExperimentPlanner

    dataset = f"Dataset{number:03d}_{name.replace('.', 'p')}"
    spacings, shapes = case_table(case)
    channels = ["CT" if name.startswith("ct") else f"MR{i}" for i in range(case["channels"])]
    labels = {"background": 0, **{f"class{i}": i for i in range(1, case["labels"])}}
    tiny = np.ones((6, 6, 6), np.float32)
    write_raw(Path(os.environ["nnUNet_raw"]), dataset, channels, labels,
              {"case000": ([tiny] * case["channels"], np.zeros((6, 6, 6)), spacings[0])}, num_training=case["cases"])
    preprocessed = Path(os.environ["nnUNet_preprocessed"]) / dataset
    preprocessed.mkdir(parents=True, exist_ok=True)
    # nnU-Net's fingerprint holds its own axis order: the medvol (NIfTI) axes reversed.
    fingerprint = {
        "spacings": [s[::-1] for s in spacings], "shapes_after_crop": [s[::-1] for s in shapes],
        "foreground_intensity_properties_per_channel": {
            str(i): {"mean": 40.0, "median": 40.0, "std": 20.0, "min": -100.0, "max": 200.0,
                     "percentile_99_5": 180.0, "percentile_00_5": -80.0} for i in range(case["channels"])},
        "median_relative_size_after_cropping": 0.9,
    }
    (preprocessed / "dataset_fingerprint.json").write_text(json.dumps(fingerprint))
    planner = ExperimentPlanner(dataset)
    if "given_patch" in case:
        # nnU-Net's planner takes no patch: its topology and VRAM estimate of the given one, at its target spacing.
        spacing = planner.determine_fullres_target_spacing()
        forward, _ = planner.determine_transpose()
        patch = [case["given_patch"][::-1][a] for a in forward]
        return {
            "fingerprint": {"spacings": spacings, "shapes": shapes, "channels": case["channels"],
                            "labels": case["labels"]},
            "given_patch": case["given_patch"],
            "nnunet": {"transpose_forward": [int(a) for a in forward], "spacing": [float(s) for s in spacing[forward]],
                       **topology_of([float(s) for s in spacing[forward]], patch, case["labels"])},
        }
    plans = planner.plan_experiment()
    full = plans["configurations"]["3d_fullres"]
    arch = full["architecture"]["arch_kwargs"]
    return {
        "fingerprint": {"spacings": spacings, "shapes": shapes, "channels": case["channels"], "labels": case["labels"]},
        "nnunet": {
            "transpose_forward": plans["transpose_forward"], "spacing": full["spacing"],
            "median_image_size_in_voxels": full["median_image_size_in_voxels"], "patch_size": full["patch_size"],
            "batch_size": full["batch_size"], "strides": arch["strides"], "kernels": arch["kernel_sizes"],
            "features": arch["features_per_stage"], "augmentation": trainer_augmentation(full["patch_size"]),
            "batch_dice": full["batch_dice"],
        },
    }


def trainer_augmentation(patch: list[int]) -> dict[str, Any]:
    """The trainer's own `configure_rotation_dummyDA_mirroring_and_inital_patch_size` for `patch` (transposed)."""
    from types import SimpleNamespace

    from nnunetv2.training.nnUNetTrainer.nnUNetTrainer import nnUNetTrainer

    trainer = SimpleNamespace(configuration_manager=SimpleNamespace(patch_size=patch), print_to_log_file=print)
    rotation, in_plane, initial, mirror = nnUNetTrainer.configure_rotation_dummyDA_mirroring_and_inital_patch_size(
        trainer
    )
    return {"rotation": float(max(abs(r) for r in rotation)), "in_plane": bool(in_plane),
            "initial_patch": [int(i) for i in initial], "mirror_axes": list(mirror)}


def topology_of(spacing: list[float], patch: list[float], outputs: int) -> dict[str, Any]:
    """nnU-Net's get_pool_and_conv_props of `patch` and the VRAM estimate of the PlainConvUNet it plans (32 filters)."""
    from nnunetv2.experiment_planning.experiment_planners.default_experiment_planner import ExperimentPlanner
    from nnunetv2.experiment_planning.experiment_planners.network_topology import get_pool_and_conv_props

    pools, strides, kernels, padded, _ = get_pool_and_conv_props(spacing, patch, 4, 999999)
    features = [min(32 * 2**i, 320) for i in range(len(strides))]
    arch = {
        "n_stages": len(strides), "features_per_stage": features, "conv_op": "torch.nn.modules.conv.Conv3d",
        "kernel_sizes": [list(k) for k in kernels], "strides": [list(s) for s in strides],
        "n_conv_per_stage": [2] * len(strides), "n_conv_per_stage_decoder": [2] * (len(strides) - 1),
        "conv_bias": True, "norm_op": "torch.nn.modules.instancenorm.InstanceNorm3d",
        "norm_op_kwargs": {"eps": 1e-5, "affine": True}, "dropout_op": None, "dropout_op_kwargs": None,
        "nonlin": "torch.nn.LeakyReLU", "nonlin_kwargs": {"inplace": True},
    }
    estimate = ExperimentPlanner.static_estimate_VRAM_usage(
        tuple(int(p) for p in padded), 4, outputs, "dynamic_network_architectures.architectures.unet.PlainConvUNet",
        arch, ("conv_op", "norm_op", "dropout_op", "nonlin"),
    )
    return {
        "pools": [int(p) for p in pools], "strides": [list(s) for s in strides], "kernels": [list(k) for k in kernels],
        "patch_size": [int(p) for p in padded], "features": features, "outputs": outputs,
        "feature_map_size": int(estimate),
    }


def topology_reference() -> list[dict[str, Any]]:
    return [{"spacing": spacing, "patch": patch, **topology_of(spacing, patch, 3)} for spacing, patch in TOPOLOGIES]


def tiny_datasets() -> dict[str, tuple[dict[str, Any], list[str]]]:
    """Tiny NIfTI datasets for the fingerprint rules (deterministic; the test writes the same ones):
    dataset name -> (case -> (channel arrays, label, spacing in medvol order), channel names)."""
    import numpy as np

    rng = np.random.default_rng(1)
    shape = (40, 36, 30)
    background, no_background, ct = {}, {}, {}
    for i in range(6):
        # MR inside a zero background that cropping removes (>25% of the volume): the non-zero mask normalizes.
        image = np.zeros(shape, np.float32)
        image[8:30, 6:28, 5:24] = rng.normal(300, 40, (22, 22, 19))
        label = np.zeros(shape, np.uint8)
        label[14 + i % 3:20 + i % 3, 12:18, 10:16] = 1
        background[f"mr{i:03d}"] = ([image, image * 0.5 + 10 * (image > 0)], label, [1.0, 1.0, 1.0])
        # Integer MR with no zero background at all: no mask (nnU-Net z-scores the whole volume).
        whole = np.round(rng.normal(200, 30, shape)).astype(np.float32) + 100
        no_background[f"mr{i:03d}"] = ([whole], label, [1.0, 1.0, 1.0])
        body = np.full(shape, -1000.0, np.float32)
        body[4:36, 4:32, 3:27] = rng.normal(40, 20, (32, 28, 24))
        lesion = np.zeros(shape, np.uint8)
        if i != 2:  # one lesion-free subject: nnU-Net takes none of its voxels
            lesion[10 + i:18 + i, 10:17, 8:15] = 1
            body[lesion > 0] += 60.0
        ct[f"ct{i:03d}"] = ([body], lesion, [0.7, 0.7, 2.5])
    return {
        "Dataset901_MaskRule": (background, ["T1", "T2"]), "Dataset902_NoBackground": (no_background, ["T1"]),
        "Dataset903_CTLesionFree": (ct, ["CT"]),
    }


def fingerprint_reference(work: Path) -> dict[str, Any]:
    """plan_and_preprocess's fingerprint and normalization choice on the tiny NIfTI datasets."""
    from nnunetv2.experiment_planning.plan_and_preprocess_api import extract_fingerprints, plan_experiments

    raw = Path(os.environ["nnUNet_raw"])
    datasets = tiny_datasets()
    for name, (cases, channels) in datasets.items():
        write_raw(raw, name, channels, {"background": 0, "lesion": 1}, cases)
    ids = [int(name[7:10]) for name in datasets]
    extract_fingerprints(ids, num_processes=1, check_dataset_integrity=False, clean=True, verbose=False)
    plan_experiments(ids)
    results = {}
    for name in datasets:
        preprocessed = Path(os.environ["nnUNet_preprocessed"]) / name
        fingerprint = json.loads((preprocessed / "dataset_fingerprint.json").read_text())
        plans = json.loads((preprocessed / "nnUNetPlans.json").read_text())
        full = plans["configurations"]["3d_fullres"]
        results[name] = {
            "median_relative_size_after_cropping": fingerprint["median_relative_size_after_cropping"],
            "normalization_schemes": full["normalization_schemes"], "use_mask_for_norm": full["use_mask_for_norm"],
            "foreground_intensity_properties_per_channel": fingerprint["foreground_intensity_properties_per_channel"],
            "spacing": full["spacing"], "transpose_forward": plans["transpose_forward"],
        }
    return results


def reference(args: argparse.Namespace) -> None:
    import nnunetv2

    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        nnunet_environment(work)
        planning = {name: plan_from_fingerprint(work, 800 + i, name, case)
                    for i, (name, case) in enumerate(PLANNING_CASES.items())}
        record = {
            "made_by": f"nnunetv2 {getattr(nnunetv2, '__version__', '2.8.1')}: {' '.join(sys.argv)}",
            "axes": "fingerprints in medvol's axes (NIfTI voxel order); nnU-Net's values in its own transposed order",
            "planning": planning, "topologies": topology_reference(), "fingerprints": fingerprint_reference(work),
        }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(record, indent=1) + "\n")
    print(f"wrote {args.out}")


# ---- step: nnU-Net's training step as the reference for medvol's -------------------------------------------------

# The test's network: nnU-Net's PlainConvUNet of 4 stages as its planner writes it, at 2-16 filters so that its
# weights are a small file; 2 channels, the 3 BraTS regions, batch 2 of 16^3.
TINY_ARCHITECTURE: dict[str, Any] = {
    "network_class_name": "dynamic_network_architectures.architectures.unet.PlainConvUNet",
    "arch_kwargs": {
        "n_stages": 4, "features_per_stage": [2, 4, 8, 16], "conv_op": "torch.nn.modules.conv.Conv3d",
        "kernel_sizes": [[3, 3, 3]] * 4, "strides": [[1, 1, 1], [2, 2, 2], [2, 2, 2], [2, 2, 2]],
        "n_conv_per_stage": [2, 2, 2, 2], "n_conv_per_stage_decoder": [2, 2, 2], "conv_bias": True,
        "norm_op": "torch.nn.modules.instancenorm.InstanceNorm3d", "norm_op_kwargs": {"eps": 1e-05, "affine": True},
        "dropout_op": None, "dropout_op_kwargs": None, "nonlin": "torch.nn.LeakyReLU",
        "nonlin_kwargs": {"inplace": True},
    },
    "_kw_requires_import": ["conv_op", "norm_op", "dropout_op", "nonlin"],
}
TINY_BATCH = {"channels": 2, "batch": 2, "patch": [16, 16, 16], "batch_dice": False}


def nested_regions(batch: int, patch: list[int]) -> Any:
    """(batch, 3, *patch) WT/TC/ET region channels of nested balls at per-sample centres, uint8; the last sample has
    a WT without core or enhancing voxels (the Dice's empty-target branch)."""
    import numpy as np

    grid = np.stack(np.meshgrid(*[np.arange(n) for n in patch], indexing="ij"), -1).astype(np.float32)
    out = np.zeros((batch, 3, *patch), np.uint8)
    size = min(patch)
    for b in range(batch):
        centre = np.asarray(patch, np.float32) * (0.35 + 0.3 * b / max(1, batch - 1)) + 0.3
        distance = np.sqrt(((grid - centre) ** 2).sum(-1))
        out[b, 0] = distance < 0.3 * size
        if b < batch - 1:
            out[b, 1] = distance < 0.17 * size
            out[b, 2] = (distance < 0.17 * size) & (distance >= 0.08 * size)
    return out


def dynunet_parameter(name: str, stages: int) -> str | None:
    """The parameter of MONAI's DynUNet (res_block=False, deep supervision, trans_bias=True) that holds nnU-Net
    PlainConvUNet's `name` (`stages` stages); None for the convolutions' biases before an instance norm, which DynUNet
    leaves out (zero at nnU-Net's initialisation, and removed with their gradient by the norm)."""
    encoder = re.fullmatch(r"encoder\.stages\.(\d+)\.0\.convs\.(\d+)\.(conv|norm)\.(weight|bias)", name)
    decoder = re.fullmatch(r"decoder\.stages\.(\d+)\.convs\.(\d+)\.(conv|norm)\.(weight|bias)", name)
    for match, is_encoder in ((encoder, True), (decoder, False)):
        if match:
            stage, conv, kind, field = int(match[1]), int(match[2]) + 1, match[3], match[4]
            if kind == "conv" and field == "bias":
                return None
            encoder_blocks = ["input_block", *[f"downsamples.{i}" for i in range(stages - 2)], "bottleneck"]
            block = encoder_blocks[stage] if is_encoder else f"upsamples.{stage}.conv_block"
            return f"{block}.conv{conv}.conv.weight" if kind == "conv" else f"{block}.norm{conv}.{field}"
    transposed = re.fullmatch(r"decoder\.transpconvs\.(\d+)\.(weight|bias)", name)
    if transposed:
        return f"upsamples.{transposed[1]}.transp_conv.conv.{transposed[2]}"
    head = re.fullmatch(r"decoder\.seg_layers\.(\d+)\.(weight|bias)", name)
    if head:
        # nnU-Net's seg_layers run from the coarsest decoder stage (0) to the full resolution (stages - 2).
        level = stages - 2 - int(head[1])
        return f"{'output_block' if level == 0 else f'deep_supervision_heads.{level - 1}'}.conv.conv.{head[2]}"
    raise ValueError(f"no DynUNet parameter for nnU-Net's {name}")


def load_nnunet_weights(net: Any, record: dict[str, Any]) -> None:
    """Load a `step_record`'s initial PlainConvUNet weights into MONAI's DynUNet `net` (every parameter of `net` must
    get one; nnU-Net's convolution biases before an instance norm must be zero; a DynUNet without transposed biases,
    `trans_bias=False`, takes nnU-Net's zero ones as absent)."""
    import torch

    values = record["initial"].float().split([torch.Size(s).numel() for s in record["shapes"]])
    mapped = {}
    for name, shape, value in zip(record["names"], record["shapes"], values, strict=True):
        ours = dynunet_parameter(name, record["stages"])
        if ours is None:
            if value.any():
                raise ValueError(f"nnU-Net's {name} is not zero: DynUNet has no such bias")
        else:
            mapped[ours] = value.reshape(shape)
    own = dict(net.named_parameters())
    for name in [n for n in mapped if n not in own and n.endswith("transp_conv.conv.bias")]:
        if mapped.pop(name).any():
            raise ValueError(f"nnU-Net's transposed convolution bias {name} is not zero: the DynUNet has none")
    missing = set(own) - set(mapped)
    if missing:
        raise ValueError(f"DynUNet parameters without an nnU-Net counterpart: {sorted(missing)}")
    net.load_state_dict(mapped, strict=False)


def nnunet_network_and_loss(
    architecture: dict[str, Any], channels: int, batch_dice: bool, regions: int = 3
) -> tuple[Any, Any, list]:
    """In nnU-Net's venv: its network for a plan's `architecture` (`get_network_from_plans`: its He initialisation,
    deep supervision, `regions` outputs), the loss of `nnUNetTrainer._build_loss` for regions
    (DeepSupervisionWrapper over DC_and_BCE_loss with MemoryEfficientSoftDiceLoss, weights 1/2^i with the lowest 0,
    normalised) and the heads' scales (`_get_deep_supervision_scales`)."""
    import numpy as np
    from nnunetv2.training.loss.compound_losses import DC_and_BCE_loss
    from nnunetv2.training.loss.deep_supervision import DeepSupervisionWrapper
    from nnunetv2.training.loss.dice import MemoryEfficientSoftDiceLoss
    from nnunetv2.utilities.get_network_from_plans import get_network_from_plans

    net = get_network_from_plans(architecture["network_class_name"], architecture["arch_kwargs"],
                                 architecture["_kw_requires_import"], channels, regions, deep_supervision=True)
    scales = [list(i) for i in 1 / np.cumprod(np.vstack(architecture["arch_kwargs"]["strides"]), axis=0)][:-1]
    weights = np.array([1 / (2**i) for i in range(len(scales))])
    weights[-1] = 0
    loss = DeepSupervisionWrapper(DC_and_BCE_loss({}, {"batch_dice": batch_dice, "do_bg": True, "smooth": 1e-5,
                                                       "ddp": False}, dice_class=MemoryEfficientSoftDiceLoss),
                                  weights / weights.sum())
    return net, loss, scales


def step_record(architecture: dict[str, Any], channels: int, batch: int, patch: list[int], batch_dice: bool,
                steps: int) -> dict[str, Any]:
    """nnU-Net's own training step, `steps` times on one fixed batch (random image, `nested_regions` targets):
    `nnunet_network_and_loss`, the targets pooled by batchgeneratorsv2's DownsampleSegForDSTransform, SGD (Nesterov
    0.99, 1e-2, weight decay 3e-5) after clip_grad_norm_(12) as `train_step`. Weights and image are rounded to
    float16 first, so that the file stores them exactly. Returns the initial weights (flat, with names and shapes),
    the image, each step's loss, and the first step's output norm per head and gradient norm per parameter."""
    import torch
    from batchgeneratorsv2.transforms.utils.deep_supervision_downsampling import DownsampleSegForDSTransform

    torch.set_num_threads(1)
    torch.manual_seed(0)
    net, loss, scales = nnunet_network_and_loss(architecture, channels, batch_dice)
    with torch.no_grad():
        for parameter in net.parameters():
            parameter.copy_(parameter.half().float())
    image = torch.randn(batch, channels, *patch).half()
    regions = torch.from_numpy(nested_regions(batch, patch))
    pooling = DownsampleSegForDSTransform(scales)
    per_sample = [pooling._apply_to_segmentation(regions[b]) for b in range(batch)]
    targets = [torch.stack([sample[k] for sample in per_sample]) for k in range(len(scales))]
    named = list(net.named_parameters())
    record: dict[str, Any] = {
        # One flat float16 tensor (a file of one storage), with each parameter's name and shape.
        "initial": torch.cat([p.detach().half().flatten() for _, p in named]),
        "names": [name for name, _ in named], "shapes": [list(p.shape) for _, p in named], "image": image,
        "stages": len(architecture["arch_kwargs"]["features_per_stage"]), "losses": [],
    }
    optimizer = torch.optim.SGD(net.parameters(), 1e-2, momentum=0.99, nesterov=True, weight_decay=3e-5)
    for step in range(steps):
        optimizer.zero_grad(set_to_none=True)
        outputs = net(image.float())
        value = loss(outputs, targets)
        value.backward()
        if step == 0:
            record["output_norms"] = [float(o.detach().double().norm()) for o in outputs]
            # The coarsest head (weight 0) takes no gradient.
            record["grad_norms"] = {name: float(p.grad.double().norm()) for name, p in net.named_parameters()
                                    if p.grad is not None}
        torch.nn.utils.clip_grad_norm_(net.parameters(), 12)
        optimizer.step()
        record["losses"].append(float(value.detach()))
    return record


def step(args: argparse.Namespace) -> None:
    import nnunetv2
    import torch

    if args.plans:
        configuration = json.loads(Path(args.plans).read_text())["configurations"]["3d_fullres"]
        architecture, setting = configuration["architecture"], {
            "channels": args.channels, "batch": int(configuration["batch_size"]),
            "patch": [int(p) for p in configuration["patch_size"]], "batch_dice": configuration["batch_dice"],
        }
    else:
        architecture, setting = TINY_ARCHITECTURE, TINY_BATCH
    record = step_record(architecture, steps=args.steps, **setting)
    record["made_by"] = f"nnunetv2 {getattr(nnunetv2, '__version__', '2.8.1')}, torch {torch.__version__}"
    record["setting"] = setting
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    torch.save(record, args.out)
    print(f"wrote {args.out}")


# ---- rules: nnU-Net's answers for issue 50's rules ---------------------------------------------------------------

RULES_SHAPE = (2, 3, 10, 12, 9)
IGNORE = 3


def rules_record() -> dict[str, Any]:
    """nnU-Net's losses, label resampling, mirrored logits and logit resampling on fixed inputs (float16-exact)."""
    import numpy as np
    import torch
    from batchgeneratorsv2.transforms.spatial.spatial import SpatialTransform, create_affine_matrix_3d
    from nnunetv2.inference.predict_from_raw_data import nnUNetPredictor
    from nnunetv2.preprocessing.resampling.default_resampling import (
        determine_do_sep_z_and_axis,
        resample_data_or_seg_to_shape,
    )
    from nnunetv2.training.loss.compound_losses import DC_and_BCE_loss, DC_and_CE_loss
    from nnunetv2.training.loss.dice import MemoryEfficientSoftDiceLoss

    torch.manual_seed(0)
    torch.set_num_threads(1)
    record: dict[str, Any] = {}
    batch, channels, *spatial = RULES_SHAPE
    logits = (torch.randn(RULES_SHAPE) * 2).half()
    # Classes 0-2 in blobs (some voxels ignore, 3), and three nested regions.
    grid = np.stack(np.meshgrid(*[np.arange(n) for n in spatial], indexing="ij"), -1).astype(np.float32)
    labels = np.zeros((batch, 1, *spatial), np.int64)
    for b in range(batch):
        distance = np.sqrt(((grid - np.asarray(spatial) * (0.4 + 0.2 * b)) ** 2).sum(-1))
        labels[b, 0][distance < 4.5] = 1
        labels[b, 0][distance < 2.5] = 2
    ignored = labels.copy()
    ignored[:, :, :3] = IGNORE
    record.update(logits=logits, labels=torch.from_numpy(labels), ignored=torch.from_numpy(ignored))

    def classes_loss(batch_dice: bool, ignore: int | None, target: np.ndarray) -> float:
        loss = DC_and_CE_loss({"batch_dice": batch_dice, "smooth": 1e-5, "do_bg": False, "ddp": False}, {},
                              weight_ce=1, weight_dice=1, ignore_label=ignore, dice_class=MemoryEfficientSoftDiceLoss)
        return float(loss(logits.float(), torch.from_numpy(target)))

    def region_target(target: np.ndarray, ignore: bool) -> torch.Tensor:
        # nnU-Net's ConvertSegmentationToRegionsTransform of (oedema 1, core 2) as WT [1, 2], TC [2], and the ignore
        # label's channel last where there is one.
        regions = [(1, 2), (2,), (2,)]
        out = [np.isin(target[:, 0], r) for r in regions] + ([target[:, 0] == IGNORE] if ignore else [])
        return torch.from_numpy(np.stack(out, 1).astype(np.float32))

    def regions_loss(batch_dice: bool, ignore: bool, target: np.ndarray) -> float:
        loss = DC_and_BCE_loss({}, {"batch_dice": batch_dice, "do_bg": True, "smooth": 1e-5, "ddp": False},
                               use_ignore_label=ignore, dice_class=MemoryEfficientSoftDiceLoss)
        return float(loss(logits.float(), region_target(target, ignore)))

    record["losses"] = {
        "classes": {str(bd): classes_loss(bd, None, labels) for bd in (False, True)},
        "regions": {str(bd): regions_loss(bd, False, labels) for bd in (False, True)},
        "classes_ignore": {str(bd): classes_loss(bd, IGNORE, ignored) for bd in (False, True)},
        "regions_ignore": {str(bd): regions_loss(bd, True, ignored) for bd in (False, True)},
    }

    # The spatial transform's label resampling on a sampling grid of a rotation and scaling about the centre.
    seg = np.zeros((1, 16, 14, 12), np.int16)
    shape = seg.shape[1:]
    box = np.stack(np.meshgrid(*[np.arange(n) for n in shape], indexing="ij"), -1).astype(np.float32)
    seg[0][np.sqrt(((box - np.asarray(shape) * 0.45) ** 2).sum(-1)) < 5] = 1
    seg[0][np.sqrt(((box - np.asarray(shape) * 0.55) ** 2).sum(-1)) < 3] = 2
    seg[0, 12:, :, :2] = 3
    regions = np.stack([seg[0] > 0, seg[0] == 2]).astype(np.int16)
    patch = (14, 12, 10)
    transform = SpatialTransform(patch, 0, False, p_rotation=1, p_scaling=1, border_mode_seg="constant",
                                 padding_value_seg=-1)
    matrix = create_affine_matrix_3d([0.3, -0.2, 0.5], [1.15, 0.9, 1.05])
    # batchgeneratorsv2's grid: the patch's centred identity grid through the matrix, about the image centre, in
    # grid_sample's normalised (x = last axis) coordinates, corners not aligned.
    centred = np.stack(np.meshgrid(*[np.arange(p) - (p - 1) / 2 for p in patch], indexing="ij"), -1)
    moved = centred @ matrix.T + (np.asarray(shape) - 1) / 2
    normalised = (2 * moved + 1) / np.asarray(shape) - 1
    sample_grid = torch.from_numpy(normalised[..., ::-1].copy()).float()
    resampled = {}
    for name, volume in (("labels", seg), ("regions", regions)):
        out = transform._apply_to_segmentation(torch.from_numpy(volume), grid=sample_grid)
        out[out == -1] = 0
        resampled[name] = out
    record["spatial"] = {"labels": torch.from_numpy(seg), "regions": torch.from_numpy(regions), "grid": sample_grid,
                         "out": resampled, "patch": list(patch)}

    # The predictor's mirrored logits of a fixed network (one 3x3x3 convolution).
    net = torch.nn.Conv3d(2, 3, 3, padding=1)
    with torch.no_grad():
        for parameter in net.parameters():
            parameter.copy_(parameter.half().float())
    image = torch.randn(1, 2, 8, 10, 6).half()
    predictor = nnUNetPredictor(device=torch.device("cpu"), use_mirroring=True, verbose=False)
    predictor.network = net
    predictor.allowed_mirroring_axes = (0, 1, 2)
    with torch.no_grad():
        mirrored = predictor._internal_maybe_mirror_and_predict(image.float())
    record["mirroring"] = {"weight": net.weight.detach().half(), "bias": net.bias.detach().half(), "image": image,
                           "logits": mirrored}

    # Logits of a model grid onto a scan of the same extent as the plans' `resampling_fn_probabilities` takes them
    # (nnU-Net's axes z, y, x), with the axis it resamples apart: the scan over 3x anisotropic (6 -> 8 mm slices), the
    # model grid over 3x (7 -> 3.5 mm), neither (2x both: every axis linear).
    cases = {"separate_z": ([8, 10, 12], [6.0, 2.0, 2.0], [8.0, 2.0, 2.0], [6, 10, 12]),
             "model_anisotropic": ([4, 10, 12], [7.0, 2.0, 2.0], [3.5, 2.5, 2.0], [8, 8, 12]),
             "under_3x": ([6, 9, 12], [4.0, 2.0, 2.0], [3.0, 1.5, 2.0], [8, 12, 12])}
    record["resampling"] = {}
    for name, (shape, model_spacing, source_spacing, source_shape) in cases.items():
        coarse = (torch.randn(3, *shape) * 3).half()
        resampled = resample_data_or_seg_to_shape(coarse.float().numpy(), source_shape, model_spacing, source_spacing,
                                                  is_seg=False, order=1, order_z=0, force_separate_z=None)
        separate, axis = determine_do_sep_z_and_axis(None, model_spacing, source_spacing)
        record["resampling"][name] = {
            "logits": coarse, "model_spacing": model_spacing, "source_spacing": source_spacing,
            "source_shape": source_shape, "out": torch.from_numpy(np.asarray(resampled)),
            "separate_axis": int(axis) if separate else -1}
    return record


def rules(args: argparse.Namespace) -> None:
    import nnunetv2
    import torch

    record = rules_record()
    record["made_by"] = f"nnunetv2 {getattr(nnunetv2, '__version__', '2.8.1')}, torch {torch.__version__}"
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    torch.save(record, args.out)
    print(f"wrote {args.out}")


def brats_architecture(size: int) -> dict[str, Any]:
    """nnU-Net's 3d_fullres network for BraTS at 1 mm on a size^3 patch: its pooling and kernels
    (`get_pool_and_conv_props`), 32 filters doubling to 320 a stage, two convolutions a stage, instance norm, leaky ReLU
    (what `nnUNetv2_plan_and_preprocess` writes for BraTS; `benchmarks/segmentation/segmentation.py gpu`'s DynUNet is
    medvol's plan of the same)."""
    from nnunetv2.experiment_planning.experiment_planners.network_topology import get_pool_and_conv_props

    _, strides, kernels, _, _ = get_pool_and_conv_props([1.0, 1.0, 1.0], [size] * 3, 4, 999999)
    stages = len(strides)
    return {"network_class_name": "dynamic_network_architectures.architectures.unet.PlainConvUNet",
            "_kw_requires_import": ["conv_op", "norm_op", "dropout_op", "nonlin"], "arch_kwargs": {
                "n_stages": stages, "features_per_stage": [min(32 * 2**i, 320) for i in range(stages)],
                "conv_op": "torch.nn.modules.conv.Conv3d", "kernel_sizes": [list(k) for k in kernels],
                "strides": [list(s) for s in strides], "n_conv_per_stage": [2] * stages,
                "n_conv_per_stage_decoder": [2] * (stages - 1), "conv_bias": True,
                "norm_op": "torch.nn.modules.instancenorm.InstanceNorm3d",
                "norm_op_kwargs": {"eps": 1e-5, "affine": True}, "dropout_op": None, "dropout_op_kwargs": None,
                "nonlin": "torch.nn.LeakyReLU", "nonlin_kwargs": {"inplace": True}}}


def gpu_step(args: argparse.Namespace) -> None:
    """nnU-Net's own training step at its BraTS plan, timed as `benchmarks/segmentation/segmentation.py gpu` times
    medvol's: the PlainConvUNet and deep-supervision loss of `nnunet_network_and_loss`, 4 channels, 3 regions, on one
    fixed batch (its targets pooled to every head by nearest-neighbour striding, as nnU-Net's loader pools them before
    the step), `nnUNetTrainer.train_step`'s backward, clip_grad_norm_(12) and SGD (Nesterov 0.99, 1e-2), bf16 autocast
    on a GPU, cuDNN benchmarking on as nnU-Net sets it; the median of `--steps` steps after 3."""
    import statistics
    import time

    import torch

    device = torch.device(args.device)
    cuda = device.type == "cuda"
    torch.backends.cudnn.benchmark = cuda
    torch.manual_seed(0)
    architecture = brats_architecture(args.size)
    net, loss, scales = nnunet_network_and_loss(architecture, 4, batch_dice=True)
    net = net.to(device)
    optimizer = torch.optim.SGD(net.parameters(), 1e-2, momentum=0.99, nesterov=True, weight_decay=3e-5)
    image = torch.randn(args.batch, 4, *[args.size] * 3, device=device)
    regions = torch.from_numpy(nested_regions(args.batch, [args.size] * 3)).to(device)
    targets = [regions[:, :, ::round(1 / s[0]), ::round(1 / s[1]), ::round(1 / s[2])].float() for s in scales]

    def train_step() -> float:
        began = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=cuda):
            value = loss(net(image), targets)
        value.backward()
        torch.nn.utils.clip_grad_norm_(net.parameters(), 12)
        optimizer.step()
        if cuda:
            torch.cuda.synchronize(device)
        return time.perf_counter() - began

    warmup = 3 if cuda else 1
    for _ in range(warmup):
        train_step()
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
    seconds = statistics.median(train_step() for _ in range(args.steps))
    result = {"net": "nnU-Net PlainConvUNet", "device": torch.cuda.get_device_name(device) if cuda else "cpu",
              "batch": args.batch, "size": args.size, "features": architecture["arch_kwargs"]["features_per_stage"],
              "parameters_m": sum(p.numel() for p in net.parameters()) / 1e6, "step_ms": seconds * 1000,
              "samples_per_s": args.batch / seconds,
              "peak_gib": torch.cuda.max_memory_allocated(device) / 2**30 if cuda else None}
    print(json.dumps(result))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))


# ---- compare: both planners on the same files (item 7) --------------------------------------------------------------

COMPARED = {
    # name: (writer, spacing, subjects)
    "brats_4mm": ("brats", (4.0, 4.0, 4.0), 24),
    "brats_2mm": ("brats", (2.0, 2.0, 2.0), 24),
    "brats_thick_0.9x0.9x4mm": ("brats", (0.9, 0.9, 4.0), 16),
    "ct_0.7x0.7x2.5mm": ("ct", (0.7, 0.7, 2.5), 16),
}
BRATS_FILES = ("t1", "t1ce", "t2", "flair")


def write_ct_phantoms(root: Path, subjects: int, spacing: tuple[float, ...]) -> None:
    """CT head phantoms (HU, air at -1000) at `spacing` in nnU-Net's raw layout; subject 1 lesion-free."""
    from datamodules.sources.phantom import make_phantom

    cases = {}
    for index in range(subjects):
        phantom = make_phantom(0, index, (128, 128, 48))
        label = phantom.label.astype("uint8") * (index != 1)
        cases[f"ct_{index:03d}"] = ([phantom.channels["ct"]], label, list(spacing))
    write_raw(root.parent, root.name, ["CT"], {"background": 0, "core": 1, "oedema": 2}, cases)


def brats_as_raw(brats: Path, raw: Path) -> None:
    """The BraTS case folders linked into nnU-Net's raw layout (the files themselves, not copies)."""
    (raw / "imagesTr").mkdir(parents=True, exist_ok=True)
    (raw / "labelsTr").mkdir(parents=True, exist_ok=True)
    cases = sorted(p.name for p in brats.iterdir() if p.is_dir())
    for case in cases:
        for k, name in enumerate(BRATS_FILES):
            link = raw / "imagesTr" / f"{case}_{k:04d}.nii.gz"
            if not link.exists():
                link.symlink_to(brats / case / f"{case}_{name}.nii.gz")
        link = raw / "labelsTr" / f"{case}.nii.gz"
        if not link.exists():
            link.symlink_to(brats / case / f"{case}_seg.nii.gz")
    (raw / "dataset.json").write_text(json.dumps({
        "channel_names": {str(k): n for k, n in enumerate(BRATS_FILES)},
        # BraTS 2021 stores ET as 4: nnU-Net plans on the label count (background + 3 regions, as medvol's regions).
        "labels": {"background": 0, "whole tumor": [1, 2, 4], "tumor core": [1, 4], "enhancing tumor": 4},
        "regions_class_order": [2, 1, 4], "numTraining": len(cases), "file_ending": ".nii.gz",
    }, indent=2))


def plan_raw(args: argparse.Namespace) -> None:
    """nnU-Net venv: fingerprint and plan the raw datasets named, print their 3d_fullres plans as JSON."""
    from nnunetv2.experiment_planning.plan_and_preprocess_api import extract_fingerprints, plan_experiments

    os.environ["nnUNet_raw"], os.environ["nnUNet_preprocessed"] = args.raw, args.preprocessed
    os.environ.setdefault("nnUNet_results", args.preprocessed)
    ids = [int(name[7:10]) for name in args.names]
    extract_fingerprints(ids, num_processes=1, check_dataset_integrity=False, clean=True, verbose=False)
    plan_experiments(ids)
    answers = {}
    for name in args.names:
        plans = json.loads((Path(args.preprocessed) / name / "nnUNetPlans.json").read_text())
        full = plans["configurations"]["3d_fullres"]
        arch = full["architecture"]["arch_kwargs"]
        answers[name] = {
            "transpose_forward": plans["transpose_forward"], "spacing": full["spacing"],
            "patch_size": full["patch_size"], "batch_size": full["batch_size"], "strides": arch["strides"],
            "kernels": arch["kernel_sizes"], "normalization": full["normalization_schemes"],
            "use_mask_for_norm": full["use_mask_for_norm"],
        }
    print("NNUNET_PLANS " + json.dumps(answers))


def untransposed(values: list[Any], forward: list[int]) -> list[Any]:
    out: list[Any] = [None] * 3
    for position, axis in enumerate(forward):
        out[axis] = values[position]
    return out[::-1]


def compare(args: argparse.Namespace) -> None:
    """Project venv: write the datasets, plan them with nnU-Net (its venv) and medvol, print the table."""
    sys.path.insert(0, str(ROOT))
    from datamodules.sources.brain_lesions import write_brain_lesions
    from datamodules.sources.brats import BratsDataModule
    from datamodules.sources.nnunet_raw import NnunetDataModule
    from medvol.run.resolvers import nnunet_channels
    from medvol.volumes.plan import make_plan

    out = Path(args.out).resolve()
    raw, preprocessed = out / "nnUNet_raw", out / "nnUNet_preprocessed"
    names, medvol = {}, {}
    for number, (name, (kind, spacing, subjects)) in enumerate(COMPARED.items(), start=950):
        dataset = f"Dataset{number}_{name.replace('.', 'p')}"
        names[name] = dataset
        if kind == "brats":
            brats = out / f"brats-{name}"
            if not brats.is_dir():
                write_brain_lesions(brats, subjects, spacing, seed=0)
            brats_as_raw(brats, raw / dataset)
            data = BratsDataModule(root=str(brats), label_regions=["WT", "TC", "ET"], val_fraction=0.0,
                                   test_fraction=0.0, split_file=None)
            regions = {"WT": [1, 2, 3], "TC": [1, 3], "ET": [3]}
        else:
            if not (raw / dataset).is_dir():
                write_ct_phantoms(raw / dataset, subjects, spacing)
            data = NnunetDataModule(root=str(raw / dataset), image_modalities=nnunet_channels(str(raw / dataset)),
                                    val_fraction=0.0, test_fraction=0.0, split_file=None)
            regions = None
        fingerprint = data.plan_fingerprint()
        medvol[name] = {
            "nnU-Net defaults (8 GB, 32 filters)": make_plan(fingerprint, 8192, 32, kinds=data.modality_kind,
                                                             regions=regions),
            "CPU default (512 MiB, 16 filters)": make_plan(fingerprint, 512, 16, kinds=data.modality_kind,
                                                           regions=regions),
        }
    result = subprocess.run(
        [NNUNET_PYTHON, __file__, "plan-raw", "--raw", str(raw), "--preprocessed", str(preprocessed),
         "--names", *names.values()],
        capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    line = next((x for x in result.stdout.splitlines() if x.startswith("NNUNET_PLANS ")), None)
    if line is None:
        raise SystemExit(f"nnU-Net's planner failed: {result.stderr[-3000:]}")
    nnunet = json.loads(line.removeprefix("NNUNET_PLANS "))
    print(table_header([
        "data", "planner", "spacing (mm)", "patch", "batch", "strides (after the first)", "kernels", "normalization"
    ]))
    for name, dataset in names.items():
        theirs = nnunet[dataset]
        forward = theirs["transpose_forward"]
        rows = {"nnU-Net 2.8.1 `nnUNetPlans.json`": {
            "spacing": untransposed(theirs["spacing"], forward), "patch": untransposed(theirs["patch_size"], forward),
            "batch": theirs["batch_size"], "strides": [untransposed(x, forward) for x in theirs["strides"]],
            "kernels": [untransposed(x, forward) for x in theirs["kernels"]],
            "normalization": [f"{n.removesuffix('Normalization')}{' masked' if m else ''}"
                              for n, m in zip(theirs["normalization"], theirs["use_mask_for_norm"], strict=True)],
        }}
        for planner, plan in medvol[name].items():
            rows[f"medvol, {planner}"] = {
                "spacing": plan["spacing"], "patch": plan["patch_size"], "batch": plan["batch_size"],
                "strides": plan["strides"], "kernels": plan["kernels"],
                "normalization": [("CT" if c["kind"] == "ct" else "ZScore") + (" masked" if c.get("use_mask") else "")
                                  for c in plan["normalization"]],
            }
        reference_row = rows["nnU-Net 2.8.1 `nnUNetPlans.json`"]
        for planner, row in rows.items():
            same = "" if planner.startswith("nnU-Net") else (
                " **identical**" if all(_close(row[k], reference_row[k]) for k in row) else "")
            print(f"| {name} | {planner}{same} | {'x'.join(f'{s:.3g}' for s in row['spacing'])} | "
                  f"{'x'.join(map(str, row['patch']))} | {row['batch']} | "
                  f"{' '.join(''.join(map(str, x)) for x in row['strides'][1:])} | "
                  f"{' '.join(''.join(map(str, x)) for x in row['kernels'])} | {', '.join(row['normalization'])} |")


def _close(a: Any, b: Any) -> bool:
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_close(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, float) or isinstance(b, float):
        return abs(float(a) - float(b)) <= 1e-4 * max(1.0, abs(float(b)))
    return a == b


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="task", required=True)
    ref = sub.add_parser("reference")
    ref.add_argument("--out", default=str(ROOT / "tests" / "data" / "nnunet_plans.json"))
    both = sub.add_parser("compare")
    both.add_argument("--out", default="outputs/benchmarks/nnunet-plans")
    one = sub.add_parser("step")
    one.add_argument("--plans", help="an nnUNetPlans.json (its 3d_fullres network, batch and patch); none: the test's")
    one.add_argument("--channels", type=int, default=4, help="image channels with --plans")
    one.add_argument("--steps", type=int, default=3)
    one.add_argument("--out", default=str(ROOT / "tests" / "data" / "nnunet_step.pt"))
    recorded = sub.add_parser("rules")
    recorded.add_argument("--out", default=str(ROOT / "tests" / "data" / "nnunet_rules.pt"))
    gpu = sub.add_parser("gpu-step", help="nnU-Net's training step at its BraTS plan, timed (benchmarks/gpu_round.py)")
    gpu.add_argument("--size", type=int, default=128)
    gpu.add_argument("--batch", type=int, default=2)
    gpu.add_argument("--steps", type=int, default=5)
    gpu.add_argument("--device", default="cuda")
    gpu.add_argument("--json", help="also write the figures to this file")
    raw = sub.add_parser("plan-raw")
    raw.add_argument("--raw", required=True)
    raw.add_argument("--preprocessed", required=True)
    raw.add_argument("--names", nargs="+", required=True)
    args = parser.parse_args()
    if args.task == "reference":
        reference(args)
    elif args.task == "step":
        step(args)
    elif args.task == "rules":
        rules(args)
    elif args.task == "compare":
        compare(args)
    elif args.task == "gpu-step":
        gpu_step(args)
    else:
        plan_raw(args)


if __name__ == "__main__":
    main()
