"""Issue 50's protocol arithmetic, worked by hand: how many epochs fill nnU-Net's wall time, which runs a table row
holds, how Dice is averaged (nnU-Net's rule: a structure absent from both sides is NaN and left out), and which
cores an arm is pinned to. The runs themselves are measurements (docs/benchmarks/segmentation.md), not tests."""

from __future__ import annotations

import json
import math
import os

import pytest

from benchmarks.segmentation import segmentation_protocol as protocol


def test_wall_epochs_fill_the_reference_time_after_the_fixed_cost():
    # A 5-epoch run of 250 steps at 1 s a step: 300 s an epoch (50 s of it validation), 1600 s in all (100 s fixed).
    timing = {"epochs": 5, "steps": 1250, "step_s": 1.0, "epoch_s": 300.0, "train_s": 1600.0}
    assert protocol.wall_epochs(3400.0, timing, 250) == 11  # (3400 - 100) / (250 + 50)
    assert protocol.wall_epochs(1600.0, timing, 250) == 5  # its own time: the same run
    assert protocol.wall_epochs(50.0, timing, 250) == 1  # never less than one epoch
    # Half the batches an epoch: 125 s of steps + 50 s of validation.
    assert protocol.wall_epochs(3600.0, timing, 125) == 20  # (3600 - 100) / 175


def test_recorded_runs_serve_nnunet_to_both_budgets_and_leave_out_calibrations(tmp_path):
    for name, dice in [("nnunet-steps-seed0", 0.9), ("medvol16-steps-seed0", 0.8), ("medvol16-wall-seed0", 0.85),
                       ("medvol16-wall-seed1", 0.87), ("medvol32-calibration-seed0", 0.1)]:
        (tmp_path / name).mkdir()
        (tmp_path / name / "result.json").write_text(json.dumps({"scores": {"dice_WT": dice}}))
    (tmp_path / "medvol32-steps-seed0").mkdir()  # unfinished: no result
    runs = protocol.recorded_runs(tmp_path)
    assert sorted(runs) == [("medvol16", "steps"), ("medvol16", "wall"), ("nnunet", "steps"), ("nnunet", "wall")]
    assert [(r["seed"], r["scores"]["dice_WT"]) for r in runs[("medvol16", "wall")]] == [(0, 0.85), (1, 0.87)]
    assert runs[("nnunet", "wall")] == runs[("nnunet", "steps")]


def test_mean_dice_leaves_out_a_structure_absent_from_every_subject_and_spread_is_the_sample_deviation():
    scores = {"dice_WT": 0.9, "dice_TC": 0.6, "dice_ET": float("nan")}
    assert protocol.mean_dice(scores, ["WT", "TC", "ET"]) == pytest.approx(0.75)
    assert math.isnan(protocol.mean_dice({"dice_ET": float("nan")}, ["ET"]))
    assert protocol.spread([0.7, 0.8, 0.9]) == "0.800 ± 0.100"  # stdev with n - 1: sqrt(0.02 / 2)
    assert protocol.spread([0.5, float("nan")]) == "0.500"
    assert protocol.spread([float("nan")]) == "-"


def test_the_table_goes_between_its_dataset_markers_and_nowhere_else(tmp_path):
    docs = tmp_path / "BENCHMARKS.md"
    docs.write_text("# Figures\n\nbefore\n")
    protocol.write_into(docs, "tissue", "| old |")
    protocol.write_into(docs, "brats", "| brats |")
    protocol.write_into(docs, "tissue", "| new |")
    text = docs.read_text()
    assert text.startswith("# Figures\n\nbefore\n")
    assert "| old |" not in text and text.count("| new |") == 1 and text.count("| brats |") == 1
    start, end = (protocol.MARKER.format(dataset="tissue", edge=e) for e in ("start", "end"))
    assert text.index(start) < text.index("| new |") < text.index(end)


def test_an_arm_is_pinned_to_the_cores_asked_for_and_a_missing_core_is_refused():
    available = sorted(os.sched_getaffinity(0))
    assert protocol.chosen_cpus(1, None) == available[-1:]
    assert protocol.chosen_cpus(1, [available[0]]) == available[:1]
    assert protocol.pinned([available[0]])[:3] == ["taskset", "-c", str(available[0])]
    assert protocol.thread_env([0, 1]) == {"OMP_NUM_THREADS": "2", "MKL_NUM_THREADS": "2"}
    with pytest.raises(SystemExit, match="not available"):
        protocol.chosen_cpus(1, [max(available) + 1])


def test_a_wall_run_with_its_timing_runs_epochs_is_recorded_as_that_run(tmp_path):
    timed_by = tmp_path / "medvol32-steps-seed0"
    timed_by.mkdir()
    (timed_by / "result.json").write_text(json.dumps({"epochs": 5, "scores": {"dice_WT": 0.86}}))
    protocol.same_run(tmp_path / "medvol32-wall-seed0", protocol.head_to_head.recorded(timed_by), timed_by, 3176.0)
    recorded = protocol.head_to_head.recorded(tmp_path / "medvol32-wall-seed0")
    assert recorded == {"epochs": 5, "scores": {"dice_WT": 0.86}, "wall_reference_s": 3176.0,
                        "same_run_as": "medvol32-steps-seed0"}
    wall = [{**recorded, "seed": 0, "folder": "medvol32-wall-seed0"}]
    assert protocol.recorded_runs(tmp_path)[("medvol32", "wall")] == wall


def test_the_tables_command_records_every_run_in_it_with_the_options_that_change_a_result(tmp_path):
    import argparse
    import shlex

    for name in ["nnunet-steps-seed0", "nnunet-steps-seed2", "medvol16-steps-seed0", "medvol16-wall-seed2"]:
        (tmp_path / name).mkdir()
        (tmp_path / name / "result.json").write_text(json.dumps({"scores": {"dice_GM": 0.8}}))
    parser = argparse.ArgumentParser()
    protocol.add_arguments(parser)
    # This invocation ran one seed and one arm; the table holds two seeds and two arms.
    asked = parser.parse_args(["--dataset", "tissue", "--seeds", "2", "--arms", "medvol16", "--spacing-scale",
                               "1.25", "--val-iterations", "10", "--cpus", "1", "--out", str(tmp_path)])
    command = protocol.reproducing_command("tissue", protocol.recorded_runs(tmp_path), asked)
    words = shlex.split(command)
    assert words[:3] == ["python", "benchmarks/segmentation/segmentation.py", "protocol"]
    again = parser.parse_args(words[3:])
    assert again.seeds == [0, 2] and again.arms == ["medvol16", "nnunet"] and again.budgets == ["steps", "wall"]
    for option in ("dataset", "steps", "iterations", "val_iterations", "subjects", "spacing_scale", "data_seed",
                   "wall_seconds", "cores"):
        assert getattr(again, option) == getattr(asked, option), option
    # Defaults are left out: the command stays the one the docs give.
    plain = parser.parse_args(["--dataset", "tissue"])
    assert "--spacing-scale" not in protocol.reproducing_command("tissue", {}, plain)


def test_the_subject_table_gives_each_test_subjects_reference_voxels_and_each_arms_dice_over_its_seeds(tmp_path):
    """A hand-worked thick dataset of two test subjects (raw labels: 1 oedema, 2 necrosis, 3 enhancing) and its runs:
    nnU-Net's and medvol16's at two seeds; the wall run of seed 0 is its steps run. One subject's tumour core and
    enhancing tumour are a single voxel: seed 0 finds it (Dice 1), seed 1 does not (0), so the mean is 0.50."""
    import nibabel as nib
    import numpy as np

    root = tmp_path / "data"
    (root / "labelsTr").mkdir(parents=True)
    affine = np.diag([4.0, 4.0, 16.0, 1.0])
    big = np.zeros((6, 6, 3), np.uint8)
    big[1:4, 1:4, 1] = 1  # 9 voxels of whole tumour
    big[2, 2, 1] = 3  # one of them the core and the enhancing tumour
    small = np.zeros((6, 6, 3), np.uint8)
    small[0:2, 0, 0] = 1  # 2 voxels of oedema: no core, no enhancing tumour
    for subject, label in (("s1", big), ("s2", small)):
        nib.save(nib.Nifti1Image(label, affine), str(root / "labelsTr" / f"{subject}.nii.gz"))

    def run(folder: str, masks: dict[str, np.ndarray], name: str, result: dict | None = None) -> None:
        (tmp_path / folder / "test-predictions").mkdir(parents=True)
        (tmp_path / folder / "result.json").write_text(json.dumps(result or {}))
        for subject, mask in masks.items():
            path = tmp_path / folder / "test-predictions" / name.format(subject=subject)
            nib.save(nib.Nifti1Image(mask.astype(np.uint8), affine), str(path))

    missed = big.copy()
    missed[2, 2, 1] = 1  # the single core voxel predicted oedema
    grown = small.copy()
    grown[0:2, 1, 0] = 1  # 4 voxels against 2: WT Dice 2 * 2 / 6
    run("nnunet-steps-seed0", {"s1": big, "s2": small}, "{subject}.nii.gz")
    run("medvol16-steps-seed0", {"s1": big, "s2": grown}, "{subject}_seg.nii.gz")
    run("medvol16-steps-seed1", {"s1": missed, "s2": small}, "{subject}_seg.nii.gz")
    run("medvol16-wall-seed0", {}, "{subject}_seg.nii.gz", {"same_run_as": "medvol16-steps-seed0"})

    table = protocol.subject_table("thick", tmp_path, root, ["s1", "s2"]).splitlines()
    assert table[0] == ("| test subject | voxel (mm) | reference voxels WT/TC/ET | "
                        "medvol16 steps (seeds 0,1): Dice WT/TC/ET | nnunet (seeds 0): Dice WT/TC/ET | "
                        "medvol16 wall (seeds 0): Dice WT/TC/ET |")
    assert table[2] == "| s1 | 4x4x16 | 9/1/1 | 1.00/0.50/0.50 | 1.00/1.00/1.00 | 1.00/1.00/1.00 |"
    # WT: (2 * 2 / 6 + 1) / 2; no core or enhancing tumour on either side: left out, shown as "-".
    assert table[3] == "| s2 | 4x4x16 | 2/0/0 | 0.83/-/- | 1.00/-/- | 0.67/-/- |"
