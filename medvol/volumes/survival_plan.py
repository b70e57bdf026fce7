"""A survival plan from the data: what a whole-volume Cox model needs to see, derived from the training subjects.

A survival network (`model=survival`) sees each subject's whole body at once, so where a segmentation plan
(`medvol.volumes.plan`) fits a patch into memory, this one fits the volume: from the same fingerprint (the
training subjects' spacings, non-zero regions and foreground intensities per image channel):

- crop to the body: every volume is cropped to its non-zero region, then padded (centred) to the largest
  training body at the target spacing, so the network spends no voxels on air and no body is cut;
- the target spacing: the per-axis median spacing, coarsened by one factor on every axis until that volume
  holds at most the device's voxel budget (a whole volume per sample, on a CPU a small one);
- per channel, the normalization: MR a z-score over each volume's own body voxels (the gain of a scan
  differs from subject to subject; the lesions a risk model reads stay brighter than the tissue around
  them, where a per-volume percentile scale dims the volumes whose lesions set the percentile); CT the
  dataset's clip and z-score (`medvol.volumes.plan.normalization`), so Hounsfield units keep their meaning;
- the batch: a Cox partial likelihood compares each event with the subjects of its batch still at risk, so
  a batch needs events: the smallest batch expected to hold `EVENTS_PER_BATCH` events at the training
  split's event rate, at most half the training subjects (two steps an epoch). Five: with one or two
  events (a batch of 2) most steps rank a single pair, with ten an epoch has half the steps (measured on
  the real-anatomy table: docs/benchmarks/training.md);
- mirroring: each training volume flipped along each axis with probability `FLIP_PROB`, as nnU-Net mirrors
  its patches (a lesion's burden does not depend on its side; on a table of tens to hundreds of subjects
  it keeps the network from learning the subjects by heart: docs/benchmarks/training.md);
- a cosine learning-rate decay to 0 over the run's epochs, where the model gives no scheduler.

Every value can be given instead (`overrides`); the plan records which were.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from medvol.volumes.plan import DataFingerprint, normalization, target_spacing

# Voxels of one planned volume: on a CPU what trains a 3D ResNet in minutes, on a GPU about the MACE seed's
# 256 x 256 x 64 CT.
VOXEL_BUDGET = {"cpu": 48**3, "gpu": 160**3}
EVENTS_PER_BATCH = 5
FLIP_PROB = 0.5
MIN_BATCH = 4
MAX_BATCH = 64
# The planned volume's sides are multiples of this (the ResNet halves the grid five times; a multiple of 8 keeps
# the last feature maps whole on volumes of a few tens of voxels).
SIDE_MULTIPLE = 8


def body_shape(fingerprint: DataFingerprint, spacing: Sequence[float]) -> list[int]:
    """The largest non-zero region of the sampled training subjects at `spacing`, per axis, in voxels, rounded up
    to a multiple of `SIDE_MULTIPLE`."""
    extent = np.asarray(fingerprint.shapes, dtype=np.float64) * np.asarray(fingerprint.spacings)
    largest = extent.max(axis=0) / np.asarray(spacing, dtype=np.float64)
    return [int(math.ceil(s / SIDE_MULTIPLE - 1e-6) * SIDE_MULTIPLE) for s in largest]


def fitted_spacing(fingerprint: DataFingerprint, budget: int) -> list[float]:
    """nnU-Net's target spacing (the median, the 10th percentile along a much coarser axis), coarsened by one factor
    on all axes until the largest body fits `budget` voxels."""
    spacing = np.asarray(target_spacing(fingerprint.spacings, fingerprint.shapes), dtype=np.float64)
    while int(np.prod(body_shape(fingerprint, spacing))) > budget:
        spacing = spacing * 1.1
    return [round(float(s), 3) for s in spacing]


def body_normalization(fingerprint: DataFingerprint, kinds: Sequence[str]) -> list[dict[str, Any]]:
    """Segmentation's normalization per channel, MR always z-scored over the non-zero mask: the plan crops each
    volume to its body, and the air left around it would otherwise weigh on a body's statistics (the defaults
    were measured so, docs/survival.md)."""
    plan = normalization(fingerprint.channels, kinds, fingerprint.relative_sizes)
    return [{**channel, "use_mask": True} if channel["kind"] == "mr" else channel for channel in plan]


def event_batch(event_rate: float, training_subjects: int) -> int:
    """The smallest batch expected to hold `EVENTS_PER_BATCH` events, within [MIN_BATCH, MAX_BATCH] and at most
    half the training subjects."""
    wanted = math.ceil(EVENTS_PER_BATCH / max(event_rate, 1e-6))
    return int(max(1, min(max(MIN_BATCH, wanted), MAX_BATCH, training_subjects // 2)))


def make_survival_plan(
    fingerprint: DataFingerprint, events: Sequence[float], budget: int, overrides: Mapping[str, Any] | None = None,
    kinds: Sequence[str] | None = None,
) -> dict[str, Any]:
    """The plan of `fingerprint` and the training split's `events` (1 event, 0 censored) for a `budget` of voxels.

    Args:
        fingerprint: the training subjects' files (`NiftiDataModule.plan_fingerprint`).
        events: the training split's event indicators.
        budget: voxels of one planned volume.
        overrides: plan keys given instead of derived (spacing, spatial_size, batch_size, crop_foreground,
            flip_prob); null values are ignored.
        kinds: per channel mr/ct, instead of what the data suggests.
    """
    given = {k: v for k, v in (overrides or {}).items() if v is not None}
    spacing = [float(s) for s in given.get("spacing") or fitted_spacing(fingerprint, budget)]
    size = [int(s) for s in given.get("spatial_size") or body_shape(fingerprint, spacing)]
    kinds = list(kinds or [c["kind"] for c in fingerprint.channels])
    events = np.asarray(events, dtype=np.float64)
    rate = float((events > 0.5).mean()) if events.size else 0.0
    batch = int(given.get("batch_size") or event_batch(rate, int(events.size)))
    return {
        "family": "survival",
        "spacing": spacing,
        "crop_foreground": bool(given.get("crop_foreground", True)),
        "spatial_size": size,
        "normalization": body_normalization(fingerprint, kinds),
        "batch_size": batch,
        "flip_prob": float(given.get("flip_prob", FLIP_PROB)),
        "event_rate": round(rate, 4),
        "expected_events_per_batch": round(rate * batch, 2),
        "voxel_budget": int(budget),
        "subjects": int(events.size),
        "overridden": sorted(given),
    }


def describe_survival_plan(plan: Mapping[str, Any]) -> list[str]:
    """The plan in a few lines, for the start of a run."""
    x = "x".join
    kinds = ", ".join(
        "mr: z-score over the body" if c["kind"] == "mr" else f"ct: clip {c['clip'][0]:.4g}..{c['clip'][1]:.4g}, "
        f"z-score ({c['mean']:.4g}, {c['std']:.4g})" for c in plan["normalization"]
    )
    crop = "cropped to the non-zero region, then padded" if plan["crop_foreground"] else "padded or cropped"
    size = plan["spatial_size"]
    return [
        f"plan: spacing {x(f'{s:g}' for s in plan['spacing'])} mm, volumes {crop} to {x(map(str, size))} "
        f"({int(np.prod(size))} voxels, budget {plan['voxel_budget']}), normalization per channel [{kinds}]",
        f"plan: batch {plan['batch_size']} (training event rate {plan['event_rate']:.2f} over {plan['subjects']} "
        f"subjects: ~{plan['expected_events_per_batch']:g} events per Cox risk set), training volumes flipped along "
        f"each axis with probability {plan['flip_prob']:g}",
        *([f"plan: given instead of derived: {', '.join(plan['overridden'])}"] if plan["overridden"] else []),
    ]
