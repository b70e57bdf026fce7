"""nnU-Net v2's network topology and patch search, rule for rule (nnunetv2 2.8.1: `network_topology.py`,
`ExperimentPlanner.get_plans_for_configuration`, `PlainConvUNet.compute_conv_feature_map_size`).

Every function here works in nnU-Net's axis order: the caller hands it the spacing and shapes transposed as
nnU-Net transposes them (the axis of the coarsest spacing first) and maps the results back
(`medvol.volumes.plan`). The reference values these functions are tested against come from nnU-Net itself
(`benchmarks/segmentation/nnunet_plans.py`, `tests/data/nnunet_plans.json`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

# No feature map of the bottleneck smaller than 4 voxels along an axis that was pooled.
MIN_FEATURE_SIZE = 4
MAX_FILTERS = 320
# An axis pools while its spacing is under twice the finest spacing among the axes that can still pool.
POOL_RATIO = 2.0
# nnU-Net's VRAM reference: PlainConvUNet feature-map voxels of a batch-2 3D step that fit its 8 GB target.
REFERENCE_FEATURE_MAPS = 560_000_000
REFERENCE_BATCH = 2
REFERENCE_MIB = 8 * 1024
MIN_BATCH = 2
# Largest share of the dataset's voxels one batch may hold.
BATCH_SHARE = 0.05
# Convolutions per encoder and decoder stage (nnU-Net's `n_conv_per_stage`).
CONVS_PER_STAGE = 2


@dataclass
class Topology:
    """Strides (the first [1, 1, 1]) and kernels per stage, the patch padded to what they divide."""

    strides: list[list[int]]
    kernels: list[list[int]]
    patch: list[int]

    @property
    def divisor(self) -> list[int]:
        return [int(np.prod([s[axis] for s in self.strides])) for axis in range(len(self.patch))]


def pad_shape(shape: Sequence[float], divisor: Sequence[int]) -> list[int]:
    """`shape` rounded up to a multiple of `divisor` per axis (nnU-Net's `pad_shape`, fractional sizes included)."""
    padded = []
    for size, d in zip(shape, divisor, strict=True):
        rest = size % d
        padded.append(int(size + d - rest - (d if rest == 0 else 0)))
    return padded


def pool_and_conv_props(spacing: Sequence[float], patch: Sequence[float]) -> Topology:
    """nnU-Net's `get_pool_and_conv_props`: pool every axis that is big enough (>= 8 voxels) and whose spacing is
    under twice the finest among those axes (a lone axis only from 12 voxels on); a kernel turns from 1 to 3 once
    its axis is within twice the finest spacing and stays 3; the bottleneck is 3x3x3."""
    dim = len(spacing)
    current_spacing, current_size = [float(s) for s in spacing], [float(p) for p in patch]
    strides, kernels = [[1] * dim], []
    pools, kernel = [0] * dim, [1] * dim
    while True:
        valid = [i for i in range(dim) if current_size[i] >= 2 * MIN_FEATURE_SIZE]
        if not valid:
            break
        finest = min(current_spacing[i] for i in valid)
        valid = [i for i in valid if current_spacing[i] / finest < POOL_RATIO]
        if len(valid) == 1 and current_size[valid[0]] < 3 * MIN_FEATURE_SIZE:
            break
        if not valid:
            break
        for d in range(dim):
            if kernel[d] != 3 and current_spacing[d] / min(current_spacing) < POOL_RATIO:
                kernel[d] = 3
        step = [1] * dim
        for v in valid:
            step[v] = 2
            pools[v] += 1
            current_spacing[v] *= 2
            current_size[v] = float(np.ceil(current_size[v] / 2))
        strides.append(step)
        kernels.append(list(kernel))
    kernels.append([3] * dim)
    return Topology(strides, kernels, pad_shape(patch, [2**p for p in pools]))


def filters(stages: int, base: int) -> list[int]:
    return [min(base * 2**i, MAX_FILTERS) for i in range(stages)]


def feature_map_size(patch: Sequence[int], strides: Sequence[Sequence[int]], features: Sequence[int],
                     outputs: int) -> int:
    """nnU-Net's VRAM estimate of one sample: `PlainConvUNet.compute_conv_feature_map_size` (two convolutions per
    encoder stage; per decoder stage two convolutions, the transposed convolution, and the segmentation output at
    full resolution), `outputs` the label count including background."""
    sizes, size = [], [int(p) for p in patch]
    for step in strides:
        size = [s // t for s, t in zip(size, step, strict=True)]
        sizes.append(int(np.prod(size, dtype=np.int64)))
    total = sum(CONVS_PER_STAGE * f * v for f, v in zip(features, sizes, strict=True))
    for stage in range(len(features) - 1):
        total += (CONVS_PER_STAGE + 1) * features[stage] * sizes[stage]
    # The segmentation layer sits on the last decoder stage: a single-stage network has none.
    return int(total + (outputs * sizes[0] if len(features) > 1 else 0))


def reference(budget_mib: float) -> float:
    """nnU-Net's feature-map reference for a batch-2 step, scaled to a budget in MiB (its 8 GB target = 1)."""
    return REFERENCE_FEATURE_MAPS * budget_mib / REFERENCE_MIB


def initial_patch(spacing: Sequence[float], median_shape: Sequence[float]) -> list[float]:
    """The patch nnU-Net starts from: the volume of 256^3 with the aspect of 1/spacing, clipped to the median."""
    inverse = 1.0 / np.asarray(spacing, dtype=np.float64)
    start = [round(i) for i in inverse * (256**3 / np.prod(inverse)) ** (1 / 3)]
    return [min(s, m) for s, m in zip(start, median_shape, strict=True)]


@dataclass
class PatchFit:
    topology: Topology
    batch: int
    estimate: int
    features: list[int]


def fit_patch(
    spacing: Sequence[float], median_shape: Sequence[float], budget_mib: float, base: int, outputs: int,
    dataset_voxels: float,
) -> PatchFit:
    """nnU-Net's patch and batch search: the topology of the initial patch; while a batch of 2 exceeds the budget,
    shrink the axis largest relative to the median shape by its current divisor (recomputed once, as nnU-Net
    does); then the batch that fills the budget, capped so one batch holds at most 5% of the dataset's voxels."""
    topology = pool_and_conv_props(spacing, initial_patch(spacing, median_shape))
    features = filters(len(topology.strides), base)
    estimate = feature_map_size(topology.patch, topology.strides, features, outputs)
    limit = reference(budget_mib)
    while estimate / REFERENCE_BATCH * MIN_BATCH > limit:
        patch = list(topology.patch)
        # Beyond nnU-Net: a budget too small for any patch stops at the smallest one (the caller refuses it).
        if max(patch) <= 2 * MIN_FEATURE_SIZE:
            break
        ratios = [p / m if p > 2 * MIN_FEATURE_SIZE else -np.inf for p, m in zip(patch, median_shape, strict=True)]
        axis = int(np.argsort(ratios)[-1])
        trial = list(patch)
        trial[axis] -= topology.divisor[axis]
        patch[axis] -= pool_and_conv_props(spacing, trial).divisor[axis]
        topology = pool_and_conv_props(spacing, patch)
        features = filters(len(topology.strides), base)
        estimate = feature_map_size(topology.patch, topology.strides, features, outputs)
    return PatchFit(topology, batch_size(limit, estimate, dataset_voxels, topology.patch), estimate, features)


def batch_size(limit: float, estimate: int, dataset_voxels: float, patch: Sequence[int]) -> int:
    """The batch that fills the budget's feature-map `limit`, capped so one batch holds at most 5% of the dataset's
    voxels, and at least 2 (nnU-Net's rule)."""
    batch = round(limit / estimate * REFERENCE_BATCH)
    cap = round(dataset_voxels * BATCH_SHARE / np.prod(patch, dtype=np.float64))
    return max(min(batch, cap), MIN_BATCH)


def estimate_mib(estimate: int, batch: int) -> float:
    """A feature-map estimate of one sample as MiB of nnU-Net's calibration (its reference fills 8 GB at batch 2)."""
    return estimate * batch / REFERENCE_BATCH / REFERENCE_FEATURE_MAPS * REFERENCE_MIB
