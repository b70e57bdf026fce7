"""medvol's planner against nnU-Net v2's own (2.8.1), rule for rule: the values nnU-Net itself answered, recorded in
tests/data/nnunet_plans.json by `benchmarks/segmentation/nnunet_plans.py reference` (run in a venv that has
nnunetv2)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from medvol.core.errors import MedvolError
from medvol.volumes.network_topology import feature_map_size, pool_and_conv_props, reference
from medvol.volumes.plan import DataFingerprint, make_plan, nnunet_order, target_spacing

REFERENCE = json.loads((Path(__file__).resolve().parents[2] / "data" / "nnunet_plans.json").read_text())
PLANNED = {name: case for name, case in REFERENCE["planning"].items() if "given_patch" not in case}


def to_medvol(values, forward):
    """nnU-Net's transposed per-axis values in medvol's axes: untransposed, then the NIfTI order (reversed)."""
    untransposed = [None] * 3
    for position, axis in enumerate(forward):
        untransposed[axis] = values[position]
    return untransposed[::-1]


def fingerprint_of(case) -> DataFingerprint:
    recorded = case["fingerprint"]
    channels = [{"kind": "mr", "mean": 0.0, "std": 1.0, "low": 0.0, "high": 1.0}] * recorded["channels"]
    labels = {value: 100 for value in range(recorded["labels"])}
    return DataFingerprint(np.asarray(recorded["spacings"]), np.asarray(recorded["shapes"]),
                           np.full(len(recorded["spacings"]), 0.9), channels, labels)


@pytest.mark.parametrize("row", REFERENCE["topologies"], ids=lambda r: f"{r['spacing']}-{r['patch']}")
def test_pool_and_conv_props_and_the_vram_estimate_are_nnunets(row):
    topology = pool_and_conv_props(row["spacing"], row["patch"])
    assert topology.strides == row["strides"]
    assert topology.kernels == row["kernels"]
    assert topology.patch == row["patch_size"]
    assert feature_map_size(topology.patch, topology.strides, row["features"], row["outputs"]) == row[
        "feature_map_size"]


@pytest.mark.parametrize("name", sorted(PLANNED))
def test_the_plan_of_each_case_is_nnunets_3d_fullres(name):
    """Isotropic MR, 3x3x6, 0.8x0.8x4 thick slices, ACDC-like 1.5x1.5x10 (the 10th percentile in z) and CT
    0.7x0.7x2.5 at nnU-Net's defaults (8 GB, 32 filters): spacing, patch, batch, strides, kernels and the augmentation
    settings of the trainer, identical."""
    case = PLANNED[name]
    nnunet = case["nnunet"]
    forward = nnunet["transpose_forward"]
    plan = make_plan(fingerprint_of(case), 8192, 32)
    assert plan["spacing"] == pytest.approx(to_medvol(nnunet["spacing"], forward))
    assert plan["patch_size"] == to_medvol(nnunet["patch_size"], forward)
    assert plan["batch_size"] == nnunet["batch_size"]
    assert plan["strides"] == [to_medvol(s, forward) for s in nnunet["strides"]]
    assert plan["kernels"] == [to_medvol(k, forward) for k in nnunet["kernels"]]
    assert plan["features"] == nnunet["features"]
    assert plan["batch_dice"] == nnunet["batch_dice"]
    augmentation = nnunet["augmentation"]
    assert plan["augmentation"]["rotation"] == pytest.approx(augmentation["rotation"])
    assert plan["augmentation"]["in_plane"] == augmentation["in_plane"]
    assert plan["augmentation"]["initial_patch"] == to_medvol(augmentation["initial_patch"], forward)


def test_batch_dice_where_nnunet_would_add_a_low_resolution_configuration():
    """nnU-Net's planner sets `batch_dice` on its full-resolution plan where it also plans a 3d_lowres one (the patch
    covers under a quarter of the median image): the 0.7x0.7x2.5 mm CT, not the others (the reference holds both)."""
    answers = {name: case["nnunet"]["batch_dice"] for name, case in PLANNED.items()}
    assert answers["ct_0.7x0.7x2.5"] is True and answers["isotropic_mr"] is False
    plan = make_plan(fingerprint_of(PLANNED["ct_0.7x0.7x2.5"]), 8192, 32, {"batch_dice": False})
    assert plan["batch_dice"] is False and "batch_dice" in plan["overridden"]


def test_anisotropic_data_takes_the_10th_percentile_of_its_coarsest_axis():
    case = PLANNED["acdc_1.5x1.5x10"]
    spacing = target_spacing(np.asarray(case["fingerprint"]["spacings"]), np.asarray(case["fingerprint"]["shapes"]))
    median = np.median(np.asarray(case["fingerprint"]["spacings"]), axis=0)
    assert median[2] == 10.0 and spacing[2] == pytest.approx(np.percentile(
        np.asarray(case["fingerprint"]["spacings"])[:, 2], 10)) == pytest.approx(5.0)
    assert spacing[2] == pytest.approx(case["nnunet"]["spacing"][0])


def test_a_given_160x160x12_patch_gets_nnunets_topology_and_its_batch_rule():
    """nnU-Net pools the 12-voxel axis once and the others five times, all kernels 3 (the old rule gave 3 halvings
    and a [1,1,3] bottleneck); the batch fills the budget by nnU-Net's estimate of that network."""
    case = REFERENCE["planning"]["given_patch_160x160x12"]
    nnunet = case["nnunet"]
    forward = nnunet["transpose_forward"]
    plan = make_plan(fingerprint_of(case), 8192, 32, {"patch_size": case["given_patch"]})
    assert plan["patch_size"] == to_medvol(nnunet["patch_size"], forward) == [160, 160, 12]
    assert plan["strides"] == [to_medvol(s, forward) for s in nnunet["strides"]]
    assert plan["kernels"] == [to_medvol(k, forward) for k in nnunet["kernels"]] == [[3, 3, 3]] * 6
    assert sum(s[2] == 2 for s in plan["strides"]) == 1 and sum(s[0] == 2 for s in plan["strides"]) == 5
    recorded = case["fingerprint"]
    shapes = np.asarray(recorded["shapes"])
    voxels = float(np.prod(np.median(shapes, 0))) * len(shapes)
    expected = max(min(round(reference(8192) / nnunet["feature_map_size"] * 2),
                       round(voxels * 0.05 / np.prod(plan["patch_size"]))), 2)
    assert plan["batch_size"] == expected


def test_a_given_patch_over_the_budget_is_refused_in_one_line():
    case = REFERENCE["planning"]["given_patch_160x160x12"]
    with pytest.raises(MedvolError, match=r"`model.plan.patch_size`: a patch of 160x160x12 at batch 2 needs \d+ MiB, "
                                          r"over the 512 MiB budget"):
        make_plan(fingerprint_of(case), 512, 32, {"patch_size": [160, 160, 12]})


def test_a_given_batch_shrinks_the_patch_until_that_batch_fits():
    case = PLANNED["isotropic_mr"]
    derived = make_plan(fingerprint_of(case), 8192, 32)
    refitted = make_plan(fingerprint_of(case), 8192, 32, {"batch_size": 8})
    assert refitted["batch_size"] == 8
    assert np.prod(refitted["patch_size"]) < np.prod(derived["patch_size"])
    assert refitted["memory_estimate_mib"] <= 8192
    with pytest.raises(MedvolError, match=r"`model.plan.batch_size`: .* at batch 4000 needs"):
        make_plan(fingerprint_of(case), 64, 32, {"batch_size": 4000})


def test_medvol_axes_are_nnunets_reversed():
    assert nnunet_order([1, 2, 3]) == [3, 2, 1]
