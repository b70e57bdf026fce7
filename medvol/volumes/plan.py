"""A segmentation plan from the data's own fingerprint, as nnU-Net makes one (Isensee et al., Nature Methods 2021).

The fingerprint (`DataFingerprint`) is what the training subjects' files say: their voxel spacings,
the size of their non-zero region, and per image channel the intensities inside the foreground.
The plan (`make_plan`) derives from it, with no tuning by hand:

- the target spacing: the per-axis median of the spacings;
- per channel, the normalization: MR a z-score over each volume's non-zero voxels; CT a clip to the
  foreground's 0.5-99.5 percentiles, then a z-score with the dataset's foreground mean and deviation;
- the patch: the median cropped shape at the target spacing, shrunk (its longest axis in mm first)
  until one training step's activations fit the memory budget; the batch fills what is left (>= 2);
- the network (DynUNet): per level, strides that halve only the axes that are fine enough relative to
  the coarsest one and big enough, and 3x3x3 kernels except 1 along an axis still much coarser than
  the others (anisotropic data), as nnU-Net's `get_pool_and_conv_props`;
- 33% of the patches centred on the foreground, deep supervision, a polynomial learning-rate decay.

Every value can be given instead (`overrides`); the plan records which were.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

PLAN_FILE = "plan.json"
MODALITY_KINDS = ("mr", "ct")
# A CT channel holds air at about -1000 HU; no MR scan has voxels this far below zero.
CT_MINIMUM = -500.0
CT_PERCENTILES = (0.5, 99.5)
# nnU-Net's limits: no feature map smaller than 4 voxels, at most 5 halvings, filters capped.
MIN_FEATURE_SIZE = 4
MAX_HALVINGS = 5
MAX_FILTERS = 320
# An axis is halved only while its spacing is within twice the finest one (nnU-Net's anisotropy rule).
ANISOTROPY = 2.0
FOREGROUND_RATIO = 1 / 3
# Largest share of the dataset's voxels one batch may hold (nnU-Net's 5%).
BATCH_SHARE = 0.05
POLY_POWER = 0.9
# Activation tensors autograd keeps per voxel and filter in one DynUNet level (conv, norm and activation
# outputs of two residual convolutions, in the encoder and again in the decoder, the skip, the transposed
# convolution; measured with autograd's saved-tensor hooks: tests/medvol/volumes/test_plan.py).
TENSORS_PER_LEVEL = 20
BYTES = 4


@dataclass
class DataFingerprint:
    """What the training subjects' files say.

    Args:
        spacings: (N, 3) voxel sizes in mm, one row per subject (every subject's header).
        shapes: (N', 3) shapes of the non-zero region in voxels at each subject's own spacing.
        shape_spacings: (N', 3) the spacings of the subjects in `shapes`.
        channels: per image channel, `kind` (mr/ct, as the data suggests) and the foreground intensities'
            `mean`, `std`, `low` and `high` (the CT percentiles).
    """

    spacings: np.ndarray
    shapes: np.ndarray
    shape_spacings: np.ndarray
    channels: list[dict[str, Any]]


def channel_statistics(values: np.ndarray, minimum: float) -> dict[str, Any]:
    """One channel's foreground intensities `values` (mean, std, the CT clip percentiles) and its kind: CT where
    the whole volumes' `minimum` is air, MR otherwise."""
    values = values[np.isfinite(values)].astype(np.float64)
    kind = "ct" if minimum < CT_MINIMUM else "mr"
    if values.size == 0:
        return {"kind": kind, "mean": 0.0, "std": 1.0, "low": 0.0, "high": 0.0}
    low, high = np.percentile(values, CT_PERCENTILES)
    return {
        "kind": kind, "mean": float(values.mean()), "std": float(values.std()), "low": float(low), "high": float(high)
    }


def target_spacing(spacings: np.ndarray) -> list[float]:
    return [float(s) for s in np.median(np.asarray(spacings, dtype=np.float64), axis=0)]


def median_shape(shapes: np.ndarray, shape_spacings: np.ndarray, spacing: Sequence[float]) -> list[int]:
    """The median non-zero region in voxels once resampled to `spacing`."""
    resampled = np.asarray(shapes, dtype=np.float64) * np.asarray(shape_spacings) / np.asarray(spacing)
    return [max(1, int(round(s))) for s in np.median(resampled, axis=0)]


def normalization(channels: Sequence[Mapping[str, Any]], kinds: Sequence[str]) -> list[dict[str, Any]]:
    """Per channel: `{kind: mr}`, or `{kind: ct, clip: [low, high], mean, std}` with the CT statistics."""
    plan = []
    for stats, kind in zip(channels, kinds, strict=True):
        if kind == "mr":
            plan.append({"kind": "mr"})
            continue
        plan.append(
            {"kind": "ct", "clip": [stats["low"], stats["high"]], "mean": stats["mean"], "std": max(stats["std"], 1e-8)}
        )
    return plan


def topology(patch: Sequence[int], spacing: Sequence[float]) -> tuple[list[int], list[list[int]], list[list[int]]]:
    """Strides and kernels per level for `patch` at `spacing`, and the patch rounded up to what they divide.

    Each level halves the axes whose current spacing is within `ANISOTROPY` of the finest and whose
    size stays >= 2 * MIN_FEATURE_SIZE; an axis still coarser than that gets a kernel of 1.
    """
    size, current = [int(p) for p in patch], [float(s) for s in spacing]
    strides, kernels = [[1, 1, 1]], [[3 if c <= ANISOTROPY * min(current) else 1 for c in current]]
    halvings = [0, 0, 0]
    while len(strides) <= MAX_HALVINGS:
        finest = min(current)
        step = [
            2 if c <= ANISOTROPY * finest and s >= 2 * MIN_FEATURE_SIZE else 1
            for c, s in zip(current, size, strict=True)
        ]
        if step == [1, 1, 1]:
            break
        size = [s // t for s, t in zip(size, step, strict=True)]
        current = [c * t for c, t in zip(current, step, strict=True)]
        halvings = [h + (t == 2) for h, t in zip(halvings, step, strict=True)]
        strides.append(step)
        kernels.append([3 if c <= ANISOTROPY * min(current) else 1 for c in current])
    # Rounded up, as nnU-Net pads the patch: a patch of the median shape still holds a whole median volume.
    rounded = [-(-int(p) // 2**h) * 2**h for p, h in zip(patch, halvings, strict=True)]
    return rounded, strides, kernels


def filters(levels: int, base: int) -> list[int]:
    return [min(base * 2**i, MAX_FILTERS) for i in range(levels)]


def activation_bytes(
    patch: Sequence[int], batch: int, strides: Sequence[Sequence[int]], features: Sequence[int]
) -> int:
    """Bytes of the activations one training step keeps for backpropagation (float32), level by level."""
    voxels, total = float(np.prod(patch)), 0.0
    for step, width in zip(strides, features, strict=True):
        voxels /= float(np.prod(step))
        total += voxels * width * TENSORS_PER_LEVEL
    return int(total * batch * BYTES)


def fit_patch(
    shape: Sequence[int], spacing: Sequence[float], budget: int, base: int, dataset_voxels: float, min_batch: int = 2
) -> tuple[list[int], int, list[list[int]], list[list[int]], list[int]]:
    """The largest patch up to `shape` whose `min_batch` steps fit `budget`, then the batch that fills it.

    Shrinks the axis longest in mm by 10% at a time (nnU-Net shrinks the axis largest relative to the median
    shape). The batch grows past `min_batch` only while one batch holds at most `BATCH_SHARE` of the
    `dataset_voxels` (nnU-Net's cap: a small dataset keeps several steps an epoch).
    """
    patch = [max(2 * MIN_FEATURE_SIZE, int(s)) for s in shape]
    while True:
        rounded, strides, kernels = topology(patch, spacing)
        features = filters(len(strides), base)
        if activation_bytes(rounded, min_batch, strides, features) <= budget or max(patch) <= 2 * MIN_FEATURE_SIZE:
            break
        axis = int(np.argmax([p * s if p > 2 * MIN_FEATURE_SIZE else 0 for p, s in zip(patch, spacing, strict=True)]))
        patch[axis] = max(2 * MIN_FEATURE_SIZE, int(patch[axis] * 0.9))
    batch = max(1, min_batch)
    cap = max(min_batch, int(BATCH_SHARE * dataset_voxels / float(np.prod(rounded))))
    while activation_bytes(rounded, batch + 1, strides, features) <= budget and batch < cap:
        batch += 1
    return rounded, batch, strides, kernels, features


def make_plan(
    fingerprint: DataFingerprint, budget: int, base: int, overrides: Mapping[str, Any] | None = None,
    kinds: Sequence[str] | None = None,
) -> dict[str, Any]:
    """The plan of `fingerprint` under a memory `budget` (bytes) with `base` filters at full resolution.

    Args:
        fingerprint: the training subjects' data.
        budget: bytes one training step's activations may take.
        base: filters of the first level (doubling per level up to `MAX_FILTERS`).
        overrides: plan keys given instead of derived (spacing, normalization kinds via `kinds`, patch_size,
            batch_size, features, foreground_ratio, deep_supervision, poly_power); null values are ignored.
        kinds: per channel mr/ct, instead of what the data suggests.
    """
    given = {k: v for k, v in (overrides or {}).items() if v is not None}
    spacing = [float(s) for s in given.get("spacing") or target_spacing(fingerprint.spacings)]
    kinds = list(kinds or [c["kind"] for c in fingerprint.channels])
    shape = median_shape(fingerprint.shapes, fingerprint.shape_spacings, spacing)
    subjects = len(fingerprint.spacings)
    patch, batch, strides, kernels, features = fit_patch(shape, spacing, budget, base, subjects * float(np.prod(shape)))
    if given.get("patch_size"):
        patch, strides, kernels = topology(given["patch_size"], spacing)
        features = filters(len(strides), base)
    features = [int(f) for f in given.get("features") or features][: len(strides)]
    strides, kernels = strides[: len(features)], kernels[: len(features)]
    # No more samples a step than training subjects (an epoch is at least one step).
    batch = int(given.get("batch_size") or min(batch, max(1, subjects)))
    return {
        "spacing": spacing,
        "normalization": normalization(fingerprint.channels, kinds),
        "crop_foreground": bool(given.get("crop_foreground", True)),
        "median_shape": shape,
        "patch_size": patch,
        "batch_size": batch,
        "features": features,
        "strides": strides,
        "kernels": kernels,
        "foreground_ratio": float(given.get("foreground_ratio", FOREGROUND_RATIO)),
        # DynUNet supervises the decoder levels between the coarsest and the output: none with two levels.
        "deep_supervision": bool(given.get("deep_supervision", True)) and len(features) >= 3,
        "poly_power": float(given.get("poly_power", POLY_POWER)),
        "memory_budget": int(budget),
        "memory_estimate": activation_bytes(patch, batch, strides, features),
        "subjects": int(subjects),
        "overridden": sorted(given),
    }


def background_values(normalization_plan: Sequence[Mapping[str, Any]]) -> list[float]:
    """Per channel, the value a background voxel has after normalization: 0 for MR (the z-score leaves
    zeros at 0), the clipped low end in z units for CT."""
    values = []
    for channel in normalization_plan:
        if channel["kind"] == "ct":
            values.append((float(channel["clip"][0]) - float(channel["mean"])) / float(channel["std"]))
        else:
            values.append(0.0)
    return values


def describe(plan: Mapping[str, Any]) -> list[str]:
    """The plan in a few lines, for the start of a run."""
    kinds = ", ".join(c["kind"] for c in plan["normalization"])
    x = "x".join
    return [
        f"plan: spacing {x(f'{s:g}' for s in plan['spacing'])} mm, normalization per channel [{kinds}], "
        f"crop to the non-zero region {'on' if plan['crop_foreground'] else 'off'}, median shape "
        f"{x(map(str, plan['median_shape']))}",
        f"plan: patch {x(map(str, plan['patch_size']))}, batch {plan['batch_size']} "
        f"(estimate {plan['memory_estimate'] / 2**20:.0f} MiB of a {plan['memory_budget'] / 2**20:.0f} MiB budget), "
        f"{plan['foreground_ratio']:.0%} foreground patches",
        f"plan: DynUNet filters {plan['features']}, strides {plan['strides']}, kernels {plan['kernels']}, "
        f"deep supervision {'on' if plan['deep_supervision'] else 'off'}, poly LR decay (power {plan['poly_power']:g})",
        *([f"plan: given instead of derived: {', '.join(plan['overridden'])}"] if plan["overridden"] else []),
    ]


def write_plan(plan: Mapping[str, Any], path: Path) -> None:
    """Written whole or not at all (a rename), so another rank never reads half a plan."""
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(f".{path.name}.partial")
    partial.write_text(json.dumps(plan, indent=2) + "\n")
    partial.replace(path)


def read_plan(path: Path) -> dict[str, Any]:
    return dict(json.loads(path.read_text()))
