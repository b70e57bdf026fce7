"""A segmentation plan from the data's own fingerprint, made by nnU-Net v2's rules (nnunetv2 2.8.1:
`DatasetFingerprintExtractor`, `ExperimentPlanner`, `get_pool_and_conv_props`, the trainer's defaults).

The fingerprint (`DataFingerprint`) is what the training subjects' files say: their voxel spacings, the shape
of their non-zero region and the share of the volume it keeps, per image channel the intensities of the
labelled voxels, and the label values with their voxel counts. The plan (`make_plan`) derives from it:

- the target spacing: the per-axis median; for anisotropic data (the coarsest axis over 3x the next, and 3x
  fewer voxels along it) that axis takes the 10th percentile of its spacings (never finer than the others);
- per channel, the normalization: MR a z-score, over one non-zero mask for all channels only where cropping to
  the non-zero region keeps under 3/4 of the median volume; CT a clip to the labelled voxels' 0.5-99.5
  percentiles, then a z-score with their mean and deviation (a subject without labels contributes nothing);
- the patch, batch and network: nnU-Net's topology and patch search (`medvol.volumes.network_topology`), in
  nnU-Net's axis order (the NIfTI axes reversed, the coarsest spacing first), under a memory budget in MiB
  of nnU-Net's own calibration (its 8 GB target is 8192);
- the classes present and their voxel counts; the number of classes from them unless given;
- the augmentation's rotation range, its in-plane mode for anisotropic patches and the larger patch the
  loader cuts before rotating (the trainer's `configure_rotation_dummyDA_mirroring_and_inital_patch_size`);
- 33% of each batch's samples forced onto a foreground class, deep supervision, 250 batches an epoch,
  a polynomial learning-rate decay;
- the Dice over the whole batch (`batch_dice`) where nnU-Net's planner would add a low-resolution configuration
  (the patch covers under a quarter of the median image): nnU-Net then sets `batch_dice` on its 3d_fullres plan.

Every value can be given instead (`overrides`); the plan records which were. A given patch or batch is
refitted to the budget (the other one shrinks), or refused in one line when even the smallest does not fit.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from medvol.core.errors import MedvolError
from medvol.volumes.network_topology import (
    MIN_BATCH,
    batch_size,
    estimate_mib,
    feature_map_size,
    filters,
    fit_patch,
    pool_and_conv_props,
    reference,
)

PLAN_FILE = "plan.json"
MODALITY_KINDS = ("mr", "ct")
# A CT channel holds air at about -1000 HU; no MR scan has voxels this far below zero.
CT_MINIMUM = -500.0
CT_PERCENTILES = (0.5, 99.5)
# nnU-Net's ANISO_THRESHOLD: the coarsest axis counts as anisotropic beyond 3x the others.
ANISOTROPY = 3.0
LOW_RESOLUTION_PERCENTILE = 10
# The non-zero mask normalizes MR channels where cropping to it keeps less than this share of the volume.
MASK_SHARE = 0.75
FOREGROUND_RATIO = 0.33
POLY_POWER = 0.9
ITERATIONS_PER_EPOCH = 250
# The trainer's rotation: +-30 degrees about every axis, +-180 in-plane for anisotropic patches; the loader's
# larger patch assumes scales down to 0.85.
ROTATION = np.deg2rad(30.0)
IN_PLANE_ROTATION = np.deg2rad(180.0)
INITIAL_PATCH_SCALE = 0.85
# nnU-Net's 3d_lowres search: a patch under this share of the median image asks for a coarser configuration, whose
# spacing grows by this factor a round (the coarsest axes first) until its patch covers the share; the configuration
# is dropped where its median image is under half the full-resolution one's voxels.
LOW_RESOLUTION_SHARE = 0.25
LOW_RESOLUTION_STEP = 1.03
LOW_RESOLUTION_MIN_RATIO = 2.0


@dataclass
class DataFingerprint:
    """What the training subjects' files say, in medvol's axes (after reorientation).

    Args:
        spacings: (N, 3) voxel sizes in mm, one row per subject.
        shapes: (N, 3) shapes of each subject's non-zero region in voxels at its own spacing.
        relative_sizes: (N,) the share of each volume its non-zero region's box keeps.
        channels: per image channel, `kind` (mr/ct, as the data suggests) and the labelled voxels' `mean`,
            `std`, `low` and `high` (the CT percentiles); None where no subject has a labelled voxel.
        labels: label value -> voxels of it over the training subjects (after the dataset's own mapping).
        label_files: label value -> the first label file holding it (named when a value is refused).
    """

    spacings: np.ndarray
    shapes: np.ndarray
    relative_sizes: np.ndarray
    channels: list[dict[str, Any]]
    labels: dict[int, int] = field(default_factory=dict)
    label_files: dict[int, str] = field(default_factory=dict)


def channel_statistics(values: np.ndarray, minimum: float) -> dict[str, Any]:
    """One channel's labelled intensities `values` (mean, std, the CT clip percentiles) and its kind: CT where the
    whole volumes' `minimum` is air, MR otherwise. Subjects without labelled voxels give no values."""
    values = values[np.isfinite(values)].astype(np.float64)
    kind = "ct" if minimum < CT_MINIMUM else "mr"
    if values.size == 0:
        return {"kind": kind, "mean": None, "std": None, "low": None, "high": None}
    low, high = np.percentile(values, CT_PERCENTILES)
    return {
        "kind": kind, "mean": float(values.mean()), "std": float(values.std()), "low": float(low), "high": float(high)
    }


def nnunet_order(values: Sequence[Any]) -> list[Any]:
    """medvol's axes (RAS, the NIfTI voxel axes) as nnU-Net reads them (SimpleITK: reversed), and back."""
    return list(values)[::-1]


def target_spacing(spacings: np.ndarray, shapes: np.ndarray) -> list[float]:
    """nnU-Net's `determine_fullres_target_spacing`: the median, except the 10th percentile along a coarsest axis
    that is over 3x the others in spacing and has 3x fewer voxels (kept at least as fine as the others)."""
    spacings = np.asarray([nnunet_order(s) for s in spacings], dtype=np.float64)
    sizes = np.asarray([nnunet_order(s) for s in shapes], dtype=np.float64)
    target = np.percentile(spacings, 50, 0)
    target_size = np.percentile(sizes, 50, 0)
    worst = int(np.argmax(target))
    others = [i for i in range(3) if i != worst]
    aniso_spacing = target[worst] > ANISOTROPY * max(target[i] for i in others)
    aniso_voxels = target_size[worst] * ANISOTROPY < min(target_size[i] for i in others)
    if aniso_spacing and aniso_voxels:
        low_resolution = np.percentile(spacings[:, worst], LOW_RESOLUTION_PERCENTILE)
        finest_other = max(target[i] for i in others)
        if low_resolution < finest_other:
            low_resolution = max(finest_other, low_resolution) + 1e-5
        target[worst] = low_resolution
    return [float(s) for s in nnunet_order(target)]


def resampled_shapes(shapes: np.ndarray, spacings: np.ndarray, spacing: Sequence[float]) -> np.ndarray:
    """Each subject's non-zero region in voxels at `spacing` (nnU-Net's `compute_new_shape`: rounded per axis)."""
    return np.asarray([
        [int(round(s / t * n)) for s, t, n in zip(own, spacing, shape, strict=True)]
        for shape, own in zip(shapes, spacings, strict=True)
    ])


def separate_axis(current: Sequence[float], target: Sequence[float]) -> int | None:
    """The axis nnU-Net resamples apart (nearest, after the others in-plane): the one coarsest axis of the current
    spacing where that is over 3x anisotropic, else of the target's; None when neither is, or no axis is alone."""
    for spacing in (current, target):
        spacing = np.asarray(spacing, dtype=np.float64)
        if spacing.max() / spacing.min() > ANISOTROPY:
            axes = np.nonzero(spacing.max() / spacing == 1)[0]
            return int(axes[0]) if len(axes) == 1 else None
    return None


def normalization(
    channels: Sequence[Mapping[str, Any]], kinds: Sequence[str], relative_sizes: np.ndarray
) -> list[dict[str, Any]]:
    """Per channel: `{kind: mr, use_mask}` (the non-zero mask where cropping to it keeps < 3/4 of the median
    volume) or `{kind: ct, clip: [low, high], mean, std}` with the labelled voxels' statistics."""
    use_mask = bool(np.median(relative_sizes) < MASK_SHARE) if len(relative_sizes) else False
    plan = []
    for i, (stats, kind) in enumerate(zip(channels, kinds, strict=True)):
        if kind == "mr":
            plan.append({"kind": "mr", "use_mask": use_mask})
            continue
        if stats.get("mean") is None:
            raise MedvolError(
                f"image channel {i} is normalized as CT, but no training subject has a labelled voxel to take its "
                "statistics from; expected label maps with foreground, or `dataset.modality_kind=mr`"
            )
        plan.append({
            "kind": "ct", "clip": [stats["low"], stats["high"]], "mean": stats["mean"], "std": max(stats["std"], 1e-8)
        })
    return plan


def label_classes(
    fingerprint: DataFingerprint, num_classes: int | None, regions: bool, declared: int | None = None,
    ignore_label: int | None = None,
) -> int | None:
    """The number of classes: `num_classes` where given, else the classes the dataset `declared` (BraTS's four, an
    nnU-Net dataset.json's labels), whether or not every one occurs in the training subjects (every label value must
    lie below it); else from the label values present, which must run 0..K-1 as nnU-Net requires (the ignore label
    is none of them). None for regions."""
    values = sorted(v for v in fingerprint.labels if v != ignore_label)
    if regions:
        return None
    for count, source in ((num_classes, f"`model.num_classes={num_classes}`"), (declared, "the dataset's classes")):
        if count is None:
            continue
        outside = [v for v in values if not 0 <= v < int(count)]
        if outside:
            raise MedvolError(
                f"label value {outside[0]} in {fingerprint.label_files.get(outside[0], 'a label file')} is outside "
                f"the classes 0..{int(count) - 1} of {source}; fix the label file or the number of classes"
            )
        return int(count)
    if not values:
        return None
    missing = sorted(set(range(max(values) + 1)) - set(values))
    if min(values) < 0 or missing:
        bad = min(values) if min(values) < 0 else max(values)
        raise MedvolError(
            f"label value {bad} in {fingerprint.label_files.get(bad, 'a label file')} is outside consecutive classes: "
            f"the training labels hold {values}; expected 0..K-1 (0 background), or set `model.num_classes`"
        )
    return max(2, max(values) + 1)


def augmentation(patch: Sequence[int], spacing: Sequence[float]) -> dict[str, Any]:
    """The trainer's spatial augmentation settings for `patch` (medvol axes): in-plane only (+-180 degrees about the
    coarsest axis, that axis neither rotated nor scaled nor enlarged) when the patch is over 3x shorter along the
    coarsest spacing than its longest side, else +-30 degrees about every axis; and the patch the loader cuts
    before rotating (`get_patch_size`: the patch rotated by the largest angle about each axis, over 0.85)."""
    order = transposition(spacing)
    transposed = [int(nnunet_order(patch)[a]) for a in order]
    in_plane = max(transposed) / transposed[0] > ANISOTROPY
    angle = min(IN_PLANE_ROTATION if in_plane else ROTATION, np.pi / 2)
    coords = np.asarray(transposed, dtype=np.float64)
    final = np.copy(coords)
    for axis in range(3):
        final = np.max(np.vstack((np.abs(coords @ rotation_matrix(axis, angle)), final)), 0)
    initial = (final / INITIAL_PATCH_SCALE).astype(int)
    if in_plane:
        initial[0] = transposed[0]
    return {
        "rotation": float(IN_PLANE_ROTATION if in_plane else ROTATION), "in_plane": bool(in_plane),
        "axis": 2 - order[0], "initial_patch": [int(p) for p in to_medvol(list(initial), order)],
    }


def rotation_matrix(axis: int, angle: float) -> np.ndarray:
    """batchgenerators' rotation matrix about `axis` (x, y or z of nnU-Net's axes)."""
    c, s = np.cos(angle), np.sin(angle)
    if axis == 0:
        return np.array([[1, 0, 0], [0, c, -s], [0, s, c]])
    if axis == 1:
        return np.array([[c, 0, s], [0, 1, 0], [-s, 0, c]])
    return np.array([[c, -s, 0], [s, c, 0], [0, 0, 1]])


def transposition(spacing: Sequence[float]) -> list[int]:
    """nnU-Net's `transpose_forward` of a spacing in medvol's axes: its coarsest axis first, the others in order."""
    nn = nnunet_order(spacing)
    coarsest = int(np.argmax(nn))
    return [coarsest] + [i for i in range(3) if i != coarsest]


def to_medvol(values: Sequence[Any], order: Sequence[int]) -> list[Any]:
    """Per-axis values in nnU-Net's transposed order back in medvol's axes."""
    untransposed = [None] * 3
    for position, axis in enumerate(order):
        untransposed[axis] = values[position]
    return nnunet_order(untransposed)


def fitted(
    spacing: Sequence[float], shape: Sequence[float], budget_mib: float, base: int, outputs: int, voxels: float,
    given: Mapping[str, Any],
) -> dict[str, Any]:
    """Patch, batch and network in medvol's axes: nnU-Net's search, or a given patch (the batch fills the budget) or
    batch (the patch shrinks until that batch fits); refused in one line when nothing fits the budget."""
    order = transposition(spacing)
    nn_spacing = [nnunet_order(spacing)[a] for a in order]
    nn_shape = [nnunet_order(shape)[a] for a in order]
    limit = reference(budget_mib)
    batch_given = int(given.get("batch_size") or 0)
    if given.get("patch_size"):
        topology = pool_and_conv_props(nn_spacing, [nnunet_order(given["patch_size"])[a] for a in order])
        features = filters(len(topology.strides), base)
        estimate = feature_map_size(topology.patch, topology.strides, features, outputs)
        batch = batch_given or batch_size(limit, estimate, voxels, topology.patch)
        key = "model.plan.patch_size"
    else:
        # A given batch of B samples searches under the budget a batch of 2 would have per sample.
        fit = fit_patch(nn_spacing, nn_shape, budget_mib * MIN_BATCH / (batch_given or MIN_BATCH), base, outputs,
                        voxels)
        topology, features, estimate = fit.topology, fit.features, fit.estimate
        batch = batch_given or fit.batch
        key = "model.plan.batch_size" if batch_given else "model.plan.memory_budget_mib"
    # The budget holds the smallest batch (nnU-Net's batch rounds to the nearest sample and may pass it slightly).
    needed = estimate_mib(estimate, batch_given or MIN_BATCH)
    if needed > budget_mib * (1 + 1e-9):
        patch = "x".join(str(p) for p in to_medvol(topology.patch, order))
        raise MedvolError(
            f"`{key}`: a patch of {patch} at batch {batch_given or MIN_BATCH} needs {needed:.0f} MiB, over the "
            f"{budget_mib:.0f} MiB budget (`model.plan.memory_budget_mib`); give a smaller patch or batch, or raise it"
        )
    return {
        "patch_size": [int(p) for p in to_medvol(topology.patch, order)],
        "strides": [[int(s) for s in to_medvol(step, order)] for step in topology.strides],
        "kernels": [[int(k) for k in to_medvol(kernel, order)] for kernel in topology.kernels],
        "features": features, "batch_size": int(batch), "estimate": int(estimate),
    }


def low_resolution_configuration(
    spacing: Sequence[float], median_shape: Sequence[float], patch: Sequence[int], budget_mib: float, base: int,
    outputs: int,
) -> bool:
    """Whether nnU-Net's planner would add a 3d_lowres configuration beside the full-resolution one (`plan_experiment`):
    while the patch covers under a quarter of the median image, the spacing grows 3% a round (only the axes over 2x
    finer than the coarsest, while there are such axes) and the patch is searched again at that spacing; kept where
    the median image shrank at least twofold. nnU-Net's full-resolution plan then takes the Dice over the batch
    (`batch_dice`), its low-resolution one (and a full-resolution plan alone) per sample. Axes in medvol's order."""
    order = transposition(spacing)
    full = np.asarray([nnunet_order(spacing)[a] for a in order], dtype=np.float64)
    median = np.asarray([nnunet_order(median_shape)[a] for a in order], dtype=np.float64)
    patch_voxels = float(np.prod([nnunet_order(patch)[a] for a in order], dtype=np.float64))
    median_voxels = float(np.prod(median))
    coarse = full.copy()
    searched = False
    while patch_voxels / median_voxels < LOW_RESOLUTION_SHARE:
        finer = coarse.max() / coarse > 2
        if finer.any():
            coarse[finer] *= LOW_RESOLUTION_STEP
        else:
            coarse *= LOW_RESOLUTION_STEP
        shape = full / coarse * median
        median_voxels = float(np.prod(shape))
        fit = fit_patch(list(coarse), [round(s) for s in shape], budget_mib, base, outputs, 0.0)
        patch_voxels = float(np.prod(fit.topology.patch, dtype=np.float64))
        searched = True
    return searched and float(np.prod(median)) / median_voxels >= LOW_RESOLUTION_MIN_RATIO


def network(fit: Mapping[str, Any], given: Mapping[str, Any]) -> dict[str, Any]:
    """The network a plan trains from `fitted`'s search and the `given` values: patch, batch, filters, strides and
    kernels per level (as many levels as filters), deep supervision."""
    features = [int(f) for f in given.get("features") or fit["features"]][: len(fit["strides"])]
    return {
        "patch_size": fit["patch_size"], "batch_size": fit["batch_size"], "features": features,
        "strides": fit["strides"][: len(features)], "kernels": fit["kernels"][: len(features)],
        # DynUNet supervises the decoder stages between the coarsest and the output: none with two stages.
        "deep_supervision": bool(given.get("deep_supervision", True)) and len(features) >= 3,
    }


def make_plan(
    fingerprint: DataFingerprint, budget_mib: float, base: int, overrides: Mapping[str, Any] | None = None,
    kinds: Sequence[str] | None = None, regions: Mapping[str, Sequence[int]] | None = None,
    declared_classes: int | None = None, ignore_label: int | None = None,
) -> dict[str, Any]:
    """The plan of `fingerprint` under a memory budget (MiB, nnU-Net's calibration) with `base` filters at full
    resolution.

    Args:
        fingerprint: the training subjects' data.
        budget_mib: nnU-Net's GPU memory target in MiB (its default 8 GB: 8192).
        base: filters of the first stage (doubling per stage up to 320).
        overrides: plan keys given instead of derived (spacing, patch_size, batch_size, features, num_classes,
            foreground_ratio, deep_supervision, poly_power, crop_foreground, iterations_per_epoch, augmentation: false
            for none, nnU-Net's `nnUNetTrainerNoDA`, batch_dice); None ignored.
        kinds: per channel mr/ct, instead of what the data suggests.
        regions: the model's regions (name -> label values), whose count sets the network's outputs.
        declared_classes: the classes the dataset declares (background included), where it does.
        ignore_label: the label value of voxels without truth (nnU-Net's `ignore`): not a class.
    """
    given = {k: v for k, v in (overrides or {}).items() if v is not None}
    spacing = [float(s) for s in given.get("spacing") or target_spacing(fingerprint.spacings, fingerprint.shapes)]
    kinds = list(kinds or [c["kind"] for c in fingerprint.channels])
    shapes = resampled_shapes(fingerprint.shapes, fingerprint.spacings, spacing)
    median = [float(m) for m in np.median(shapes, 0)]
    subjects = len(fingerprint.spacings)
    classes = label_classes(fingerprint, given.get("num_classes"), bool(regions), declared_classes, ignore_label)
    # nnU-Net counts its dataset.json labels: background and every class, or background and every region.
    outputs = len(regions) + 1 if regions else classes or 2
    fit = fitted(spacing, median, budget_mib, base, outputs, float(np.prod(median)) * subjects, given)
    layout = network(fit, given)
    return {
        "spacing": spacing,
        "normalization": normalization(fingerprint.channels, kinds, fingerprint.relative_sizes),
        "resampling": "nnunet",
        "crop_foreground": bool(given.get("crop_foreground", True)),
        "median_shape": [int(round(m)) for m in median],
        **layout,
        "channels": len(fingerprint.channels),
        "num_classes": classes,
        "labels": {str(k): int(v) for k, v in sorted(fingerprint.labels.items())},
        "ignore_label": ignore_label,
        "augmentation": {**augmentation(fit["patch_size"], spacing), "enabled": bool(given.get("augmentation", True))},
        "foreground_ratio": float(given.get("foreground_ratio", FOREGROUND_RATIO)),
        "batch_dice": bool(given["batch_dice"]) if "batch_dice" in given else low_resolution_configuration(
            spacing, median, fit["patch_size"], budget_mib, base, outputs
        ),
        "poly_power": float(given.get("poly_power", POLY_POWER)),
        "iterations_per_epoch": int(given.get("iterations_per_epoch", ITERATIONS_PER_EPOCH)),
        "memory_budget_mib": float(budget_mib),
        "memory_estimate_mib": round(estimate_mib(fit["estimate"], fit["batch_size"]), 1),
        "subjects": int(subjects),
        "overridden": sorted(given),
    }


def background_values(normalization_plan: Sequence[Mapping[str, Any]]) -> list[float]:
    """Per channel, the value a background voxel has after normalization: 0 for MR (the masked z-score leaves zeros
    at 0, and nnU-Net pads with 0), the clipped low end in z units for CT."""
    values = []
    for channel in normalization_plan:
        if channel["kind"] == "ct":
            values.append((float(channel["clip"][0]) - float(channel["mean"])) / float(channel["std"]))
        else:
            values.append(0.0)
    return values


def describe(plan: Mapping[str, Any]) -> list[str]:
    """The plan in a few lines, for the start of a run."""
    kinds = ", ".join(c["kind"] + (" masked" if c.get("use_mask") else "") for c in plan["normalization"])
    x = "x".join
    augment = plan["augmentation"]
    classes = plan.get("num_classes")
    return [
        f"plan: spacing {x(f'{s:g}' for s in plan['spacing'])} mm, normalization per channel [{kinds}], "
        f"crop to the non-zero region {'on' if plan['crop_foreground'] else 'off'}, median shape "
        f"{x(map(str, plan['median_shape']))}",
        f"plan: labels {plan['labels']} (voxels per value)" + (f", {classes} classes" if classes else ""),
        f"plan: patch {x(map(str, plan['patch_size']))}, batch {plan['batch_size']} "
        f"(estimate {plan['memory_estimate_mib']:.0f} MiB of a {plan['memory_budget_mib']:.0f} MiB budget), "
        f"{plan['iterations_per_epoch']} batches an epoch, {plan['foreground_ratio']:.0%} foreground samples a batch",
        f"plan: DynUNet filters {plan['features']}, strides {plan['strides']}, kernels {plan['kernels']}, "
        f"deep supervision {'on' if plan['deep_supervision'] else 'off'}, Dice "
        f"{'over the batch' if plan.get('batch_dice') else 'per sample'}, poly LR decay (power {plan['poly_power']:g})",
        (f"plan: augmentation as nnU-Net's: rotation +-{np.rad2deg(augment['rotation']):.0f} deg "
         f"{'in-plane' if augment['in_plane'] else 'about every axis'}, cut at {x(map(str, augment['initial_patch']))}"
         if augment.get("enabled", True) else "plan: augmentation off (model.plan.augmentation=false)"),
        *([f"plan: given instead of derived: {', '.join(plan['overridden'])}"] if plan["overridden"] else []),
    ]


def write_plan(plan: Mapping[str, Any], path: Path) -> None:
    """Written whole or not at all (a rename), so another rank never reads half a plan."""
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(f".{path.name}.partial")
    partial.write_text(json.dumps(plan, indent=2) + "\n")
    partial.replace(path)


def read_plan(path: Path) -> dict[str, Any]:
    """The plan a run wrote, read as data and checked against its schema (`medvol.volumes.plan_record`)."""
    from medvol.volumes.plan_record import read_plan_file

    return read_plan_file(path)
