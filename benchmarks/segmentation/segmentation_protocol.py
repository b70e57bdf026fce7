"""Issue 50's head to head with nnU-Net v2, like for like: one command per dataset.

    .venv/bin/python benchmarks/segmentation/segmentation.py protocol --dataset brats|tissue|thick
        [--arms medvol16,medvol32,nnunet] [--budgets steps,wall] [--seeds 0,1,2] [--steps 1250]
        [--iterations 250] [--subjects 48] [--nnunet-venv /work/nnunet-venv] [--cores 1] [--cpus 0]
        [--out outputs/benchmarks/segmentation-protocol]
        [--docs docs/benchmarks/segmentation.md]

The datasets (real anatomy: the MNI152 templates inside nilearn's wheel, deformed per subject,
`datamodules.sources.brain_lesions`):

- `brats`: BraTS-2021 case folders with nested lesions at 4 mm, four MR contrasts, three overlapping regions
  (WT/TC/ET, sigmoid), read by `dataset=brats dataset.label_regions=[WT,TC,ET]`;
- `tissue`: grey and white matter as exclusive classes (softmax) on the same deformed brains without lesions, one
  T1 channel at 5 mm, an nnU-Net raw dataset read by `dataset=nnunet`;
- `thick`: the lesion brains of `brats` at 4 mm in-plane with 12 and 16 mm slices (subjects alternate: 3 and 4
  times anisotropic, so the 16 mm ones take nnU-Net's separate-z resampling), an nnU-Net raw dataset (nnU-Net's
  BraTS labels and regions) read by `dataset=nnunet`.

`tissue` and `thick` are at the spacings that keep nnU-Net's 1,250 steps under 30 minutes a core: chosen from 100
steps (65 s and 48 s for 50 steps and 10 validation batches), then measured whole beside another run: 28.1 minutes
at 5 mm, 21.5 at 4 x 4 x 12/16 mm (docs/benchmarks/segmentation.md). At 4 mm, `tissue` would take brats's 53-58 minutes.

Every arm sees the same files, the same split (15% test, 15% validation: nnU-Net's fold 0 in `splits_final.json`)
and is scored the same way: the test subjects' masks from the FINAL checkpoint, mirrored, without post-processing,
against the label files, Dice by nnU-Net's `compute_metrics` rule (NaN where a structure is absent from both, left
out of the means). medvol's best-validation checkpoint is predicted alike and reported apart.

Arms: `medvol16` and `medvol32`, medvol's default command (`python train.py model=segmentation ... hardware=cpu`)
at 16 base filters (the CPU default) and at 32 (nnU-Net's), each `seed=<s>`; `nnunet`, nnU-Net v2 through its
own command line (`nnUNetv2_plan_and_preprocess` at the CPU plan's budget, `-gpu_memory_target 0.5`, the
calibration of medvol's 512 MiB; `nnUNetv2_train` fold 0 with nnU-Net's trainer cut to `--steps`; `nnUNetv2_predict`
with the final checkpoint), one run per seed (nnU-Net takes no seed). Budgets: `steps`, `--steps` optimizer steps
for every arm (1,250 = nnU-Net's 5 epochs of 250 batches); `wall`, each medvol arm trained for as many epochs as
fit the wall time of nnU-Net's run of the same seed (its training command, start to end): epochs from the arm's
own step and validation times, read from its `steps` run or, without one, from a one-epoch calibration run; where
that gives the timing run's own epochs, the wall run is that run (the same command), recorded as such. Every
process is pinned to `--cores` cores (`taskset`, one thread each, nnU-Net's CPU thread count set to the pinned
cores: its `run_training` asks `multiprocessing.cpu_count()`, which ignores the pinning), the last ones or those
`--cpus` names: two commands side by side, each with its own arms on its own core (a command that needs nnU-Net's
reference for the wall budget is started once that run's `result.json` is there, or it would train nnU-Net again).

Each finished run is recorded (`<out>/<dataset>/<arm>-<budget>-seed<s>/result.json`) and skipped when the command
is run again; the table of every recorded run of the dataset (mean and spread over seeds) goes to `<out>/<dataset>/
results.md` and, with `--docs`, between the dataset's markers in that file; below it, per test subject, the
reference's voxels per structure and each arm's Dice (`<dataset> subjects` markers): a structure of one voxel
scores 0 or 1, so a few such subjects can carry a difference of the means.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import statistics
import sys
from collections.abc import Sequence
from functools import partial
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root, for a direct run
from benchmarks.segmentation import head_to_head  # noqa: E402

# nnU-Net's BraTS convention (1 oedema, 2 necrosis, 3 enhancing; regions), as `head_to_head` converts BraTS files.
NNUNET_BRATS_LABELS = {"background": 0, "whole tumor": [1, 2, 3], "tumor core": [2, 3], "enhancing tumor": [3]}
TISSUE_LABELS = {"background": 0, "grey matter": 1, "white matter": 2}
DATASETS: dict[str, dict[str, Any]] = {
    "brats": {"kind": "brats", "spacings": [(4.0, 4.0, 4.0)], "structures": head_to_head.STRUCTURES["brats"],
              "medvol": ["dataset=brats", "dataset.label_regions=[WT,TC,ET]"]},
    "tissue": {"kind": "raw", "spacings": [(5.0, 5.0, 5.0)], "structures": {"GM": (1,), "WM": (2,)},
               "medvol": ["dataset=nnunet"]},
    "thick": {"kind": "raw", "spacings": [(4.0, 4.0, 12.0), (4.0, 4.0, 16.0)],
              "structures": {"WT": (1, 2, 3), "TC": (2, 3), "ET": (3,)}, "medvol": ["dataset=nnunet"]},
}
ARMS = {"medvol16": ["model.plan.base_features=16"], "medvol32": ["model.plan.base_features=32"], "nnunet": None}
BUDGETS = ("steps", "wall")
# nnU-Net's GPU memory target in GB for the nnU-Net arm: medvol's CPU budget (512 MiB of the same calibration).
NNUNET_MEMORY_GB = 0.5
MARKER = "<!-- segmentation protocol: {dataset} {edge} -->"


# ---- the data -----------------------------------------------------------------------------------------------------


def write_raw_json(raw: Path, channels: Sequence[str], labels: dict[str, Any], cases: int, regions: bool) -> None:
    record: dict[str, Any] = {"channel_names": {str(i): c for i, c in enumerate(channels)}, "labels": labels,
                              "numTraining": cases, "file_ending": ".nii.gz"}
    if regions:
        record["regions_class_order"] = [1, 2, 3]
    (raw / "dataset.json").write_text(json.dumps(record, indent=2))


def save_case(raw: Path, case: str, images: Sequence[Any], label: Any, spacing: Sequence[float]) -> None:
    import nibabel as nib
    import numpy as np

    affine = np.diag([*[float(s) for s in spacing], 1.0])
    for folder in ("imagesTr", "labelsTr"):
        (raw / folder).mkdir(parents=True, exist_ok=True)
    for channel, image in enumerate(images):
        nib.save(nib.Nifti1Image(np.asarray(image, np.float32), affine),
                 str(raw / "imagesTr" / f"{case}_{channel:04d}.nii.gz"))
    nib.save(nib.Nifti1Image(np.asarray(label, np.uint8), affine), str(raw / "labelsTr" / f"{case}.nii.gz"))


def write_brain_tissue(raw: Path, subjects: int, spacing: Sequence[float], seed: int = 0) -> Path:
    """An nnU-Net raw dataset of deformed MNI152 brains without lesions: one T1 channel, labels 1 grey matter and
    2 white matter, the tissue of the largest template probability inside the brain (CSF and outside: 0)."""
    import numpy as np
    from scipy import ndimage

    from datamodules.sources.brain_lesions import contrast, deformation, resample, template

    gm, wm, csf = template()
    for index in range(subjects):
        rng = np.random.default_rng([seed, index])
        coordinates = deformation(gm.shape, rng)
        warped = [ndimage.map_coordinates(t, coordinates, order=1) for t in (csf, gm, wm)]
        brain = sum(warped) > 0.3
        label = np.where(brain, np.argmax(np.stack(warped), 0), 0).astype(np.uint8)
        empty = np.zeros_like(gm)
        image = contrast("t1", [*warped, empty, empty, empty], rng)
        save_case(raw, f"brain_{index:04d}", [resample(image, spacing, label=False)],
                  resample(label, spacing, label=True), spacing)
    write_raw_json(raw, ["T1"], TISSUE_LABELS, subjects, regions=False)
    return raw


def write_thick_lesions(raw: Path, subjects: int, spacings: Sequence[Sequence[float]], seed: int = 0) -> Path:
    """An nnU-Net raw dataset of the `brats` brains (four contrasts, nested lesions) at thick slices: subject i at
    spacings[i % len(spacings)], labels in nnU-Net's BraTS convention, WT/TC/ET regions in dataset.json."""
    import numpy as np

    from datamodules.sources.brain_lesions import CONTRASTS, resample, subject_volumes, template

    gm, wm, csf = template()
    for index in range(subjects):
        rng = np.random.default_rng([seed, index])
        spacing = spacings[index % len(spacings)]
        volumes = subject_volumes(gm, wm, csf, rng)
        label = resample(volumes["seg"], spacing, label=True)
        converted = np.zeros_like(label)
        for ours, theirs in head_to_head.TO_NNUNET["brats"].items():
            converted[label == ours] = theirs
        save_case(raw, f"thick_{index:04d}", [resample(volumes[c], spacing, label=False) for c in CONTRASTS],
                  converted, spacing)
    write_raw_json(raw, [c.upper() for c in CONTRASTS], NNUNET_BRATS_LABELS, subjects, regions=True)
    return raw


def prepared(dataset: str, out: Path, subjects: int, scale: float, seed: int) -> tuple[Path, list[str]]:
    """The dataset's files (written once) and its subjects."""
    setting = DATASETS[dataset]
    spacings = [tuple(s * scale for s in spacing) for spacing in setting["spacings"]]
    tag = "-".join("x".join(f"{s:g}" for s in spacing) for spacing in spacings)
    root = out / f"data-{subjects}s-{tag}mm"
    if not root.is_dir():
        partial_root = root.with_name(root.name + ".partial")
        shutil.rmtree(partial_root, ignore_errors=True)
        if dataset == "brats":
            from datamodules.sources.brain_lesions import write_brain_lesions

            write_brain_lesions(partial_root, subjects, spacings[0], seed=seed)
        elif dataset == "tissue":
            write_brain_tissue(partial_root, subjects, spacings[0], seed=seed)
        else:
            write_thick_lesions(partial_root, subjects, spacings, seed=seed)
        partial_root.replace(root)
    if setting["kind"] == "raw":
        ids = sorted(p.name.removesuffix(".nii.gz") for p in (root / "labelsTr").glob("*.nii.gz"))
    else:
        ids = sorted(p.name for p in root.iterdir() if p.is_dir())
    return root, ids


def nnunet_view(dataset: str, root: Path, raw: Path, dataset_id: int, split: dict[str, list[str]]) -> str:
    """The files as nnU-Net's raw dataset of the arm (linked): training and validation subjects in imagesTr/labelsTr,
    the test subjects in imagesTs (never seen by nnU-Net's planner)."""
    kind = DATASETS[dataset]["kind"]
    if kind != "raw":
        return head_to_head.nnunet_dataset(kind, root, raw, dataset_id, split)
    name = f"Dataset{dataset_id:03d}_medvol{dataset.capitalize()}"
    folder = head_to_head.raw_folder(raw, name)
    for images, subject in head_to_head.raw_subjects(split):
        for path in head_to_head.image_files(kind, root, subject):
            head_to_head.linked(folder / images / Path(path).name, path)
        if images == "imagesTr":
            head_to_head.linked(folder / "labelsTr" / f"{subject}.nii.gz", head_to_head.label_file(kind, root, subject))
    record = json.loads((root / "dataset.json").read_text())
    record["numTraining"] = len(split["train"]) + len(split["val"])
    (folder / "dataset.json").write_text(json.dumps(record, indent=2))
    return name


# ---- the arms -----------------------------------------------------------------------------------------------------


def chosen_cpus(cores: int, cpus: Sequence[int] | None) -> list[int]:
    """The cores the arms run on: `cpus` where given (two protocol commands side by side, one core each), else the
    last `cores` of those this process may use."""
    available = sorted(os.sched_getaffinity(0))
    if cpus:
        missing = sorted(set(cpus) - set(available))
        if missing:
            raise SystemExit(f"--cpus {','.join(map(str, cpus))}: cores {missing} are not available; "
                             f"expected some of {available}")
        return sorted(set(cpus))
    return available[-cores:] if cores < len(available) else available


def pinned(cpus: Sequence[int]) -> list[str]:
    """The command prefix that pins a process and its children to `cpus`, nicely."""
    return ["taskset", "-c", ",".join(map(str, cpus)), "nice", "-n", "5"]


def thread_env(cpus: Sequence[int]) -> dict[str, str]:
    return {"OMP_NUM_THREADS": str(len(cpus)), "MKL_NUM_THREADS": str(len(cpus))}


# nnU-Net's entry points asked for the pinned cores' count: on the CPU `run_training` and `predict_entry_point` set
# torch's threads to `multiprocessing.cpu_count()`, the machine's cores whatever the pinning.
NNUNET_LAUNCHER = """import multiprocessing, os, sys

multiprocessing.cpu_count = lambda: len(os.sched_getaffinity(0))
if __name__ == "__main__":  # nnU-Net's worker processes import this file again
    entry = sys.argv[1]
    sys.argv = sys.argv[1:]
    if entry == "train":
        from nnunetv2.run.run_training import run_training_entry as main
    elif entry == "predict":
        from nnunetv2.inference.predict_from_raw_data import predict_entry_point as main
    else:
        from nnunetv2.experiment_planning.plan_and_preprocess_entrypoints import plan_and_preprocess_entry as main
    main()
"""


def nnunet_run(
    dataset: str, root: Path, split: dict[str, list[str]], out: Path, venv: Path, steps: int, iterations: int,
    val_iterations: int, cpus: Sequence[int], dataset_id: int,
) -> dict[str, Any]:
    """nnU-Net v2 through its own entry points on the arm's raw view: plan and preprocess at the CPU budget, train
    fold 0 (= the split's train/val) for `steps` steps, predict the test subjects with the final checkpoint (its
    mirroring, no post-processing); scored like medvol's."""
    raw, preprocessed, results = out / "nnUNet_raw", out / "nnUNet_preprocessed", out / "nnUNet_results"
    trainers = out / "trainers"
    trainers.mkdir(parents=True, exist_ok=True)
    (trainers / f"{head_to_head.TRAINER_NAME}.py").write_text(head_to_head.BUDGET_TRAINER)
    (out / "launch.py").write_text(NNUNET_LAUNCHER)
    name = nnunet_view(dataset, root, raw, dataset_id, split)
    env = {
        "nnUNet_raw": str(raw), "nnUNet_preprocessed": str(preprocessed), "nnUNet_results": str(results),
        # Augmentation in the training process itself (its SingleThreadedAugmenter): no worker to share the core.
        "nnUNet_extTrainer": str(trainers), "nnUNet_n_proc_DA": "0", "nnUNet_compile": "f",
        # nnU-Net's default of 8 processes for its pools (preprocessing, export) on one pinned core only lengthens
        # its reference time: one.
        "nnUNet_def_n_proc": "1",
        "MEDVOL_NNUNET_EPOCHS": str(max(1, steps // iterations)), "MEDVOL_NNUNET_ITERATIONS": str(iterations),
        "MEDVOL_NNUNET_VAL_ITERATIONS": str(val_iterations), **thread_env(cpus),
    }
    python = [*pinned(cpus), str(venv / "bin" / "python"), str(out / "launch.py")]
    plan_wall, plan_peak = head_to_head.timed(
        [*python, "plan", "-d", str(dataset_id), "-c", "3d_fullres", "-np", "1", "-npfp", "1", "-gpu_memory_target",
         str(NNUNET_MEMORY_GB)], out / "plan.log", {**env, "nnUNet_n_proc_DA": "1"},
    )
    (preprocessed / name / "splits_final.json").write_text(json.dumps([{"train": split["train"], "val": split["val"]}]))
    train_wall, train_peak = head_to_head.timed(
        [*python, "train", str(dataset_id), "3d_fullres", "0", "-tr", head_to_head.TRAINER_NAME, "-device", "cpu"],
        out / "train.log", env,
    )
    predicted = out / "test-predictions"
    predict_wall, predict_peak = head_to_head.timed(
        [*python, "predict", "-i", str(raw / name / "imagesTs"), "-o", str(predicted), "-d", str(dataset_id), "-c",
         "3d_fullres", "-f", "0", "-tr", head_to_head.TRAINER_NAME, "-chk", "checkpoint_final.pth", "-device", "cpu",
         "-npp", "1", "-nps", "1", "--disable_progress_bar"], out / "predict.log", env,
    )
    plans = json.loads((preprocessed / name / "nnUNetPlans.json").read_text())["configurations"]["3d_fullres"]
    scores = head_to_head.score_folder(DATASETS[dataset]["kind"], root, predicted, split["test"], "{subject}.nii.gz",
                                  nnunet_labels_back(dataset), DATASETS[dataset]["structures"])
    epochs = max(1, steps // iterations)
    return {
        "scores": scores, "checkpoint": "checkpoint_final.pth", "steps": epochs * iterations, "epochs": epochs,
        "batch": plans["batch_size"], "patch": plans["patch_size"], "spacing": plans["spacing"],
        "features": plans["architecture"]["arch_kwargs"]["features_per_stage"], "batch_dice": plans["batch_dice"],
        "train_s": train_wall, "predict_s": predict_wall, "plan_s": plan_wall,
        "peak_mib": max(plan_peak, train_peak, predict_peak),
    }


def nnunet_labels_back(dataset: str) -> dict[int, int] | None:
    """nnU-Net's label values -> the dataset's files' (BraTS files: `head_to_head` converted their labels), or None."""
    if DATASETS[dataset]["kind"] != "brats":
        return None
    return {theirs: ours for ours, theirs in head_to_head.TO_NNUNET["brats"].items()}


def medvol_run(
    dataset: str, root: Path, split_file: Path, test: list[str], out: Path, width: list[str], epochs: int,
    iterations: int, seed: int, cpus: Sequence[int], note: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """medvol's default command for `epochs` epochs of `iterations` batches, pinned to `cpus`
    (`head_to_head.medvol_arm`: the final and the best checkpoint scored); `note` recorded with the result."""
    result = head_to_head.medvol_arm(
        DATASETS[dataset]["kind"], root, split_file, out, epochs, test,
        [*width, f"seed={seed}", f"model.plan.iterations_per_epoch={iterations}"], dataset=DATASETS[dataset]["medvol"],
        structures=DATASETS[dataset]["structures"], prefix=pinned(cpus), env=thread_env(cpus),
    )
    return {**result, **(note or {})}


def wall_epochs(reference_s: float, timing: dict[str, Any], iterations: int) -> int:
    """Epochs of `iterations` batches that fit `reference_s` seconds of training command: the arm's fixed cost (its
    command's wall time beyond its epochs: start, plan, the validation after training) and its epoch (steps at its
    step time, plus the epoch's validation), from a run of the arm."""
    calibrated = timing["epochs"]
    epoch_s, step_s = float(timing["epoch_s"]), float(timing["step_s"])
    validation_s = max(0.0, epoch_s - timing["steps"] / calibrated * step_s)
    fixed_s = max(0.0, float(timing["train_s"]) - calibrated * epoch_s)
    per_epoch = iterations * step_s + validation_s
    return max(1, round((reference_s - fixed_s) / per_epoch))


def run_protocol(args: argparse.Namespace) -> Path:
    """Every requested arm, budget and seed of one dataset; the table; its file."""
    import torch

    from datamodules.pipeline.split import make_split, save_split

    torch.set_num_threads(1)
    dataset = args.dataset
    out = Path(args.out).resolve() / dataset
    out.mkdir(parents=True, exist_ok=True)
    root, ids = prepared(dataset, out, args.subjects, args.spacing_scale, args.data_seed)
    split = make_split(ids, 0.15, 0.15, args.data_seed)
    split_file = out / "split.json"
    save_split(split_file, split, args.data_seed)
    epochs = max(1, args.steps // args.iterations)
    cpus = chosen_cpus(args.cores, args.cpus)
    for seed in args.seeds:
        reference = None
        if "nnunet" in args.arms:
            folder = out / f"nnunet-steps-seed{seed}"
            reference = head_to_head.finished(folder, partial(
                nnunet_run, dataset, root, split, folder, Path(args.nnunet_venv), args.steps, args.iterations,
                args.val_iterations, cpus, 600 + 10 * list(DATASETS).index(dataset) + seed,
            ))
        for arm in [a for a in args.arms if a != "nnunet"]:
            def trained(folder: Path, arm_epochs: int, note: dict[str, Any] | None = None, arm: str = arm,
                        seed: int = seed) -> dict[str, Any]:
                return head_to_head.finished(folder, partial(
                    medvol_run, dataset, root, split_file, split["test"], folder, ARMS[arm], arm_epochs,
                    args.iterations, seed, cpus, note,
                ))

            timed_by = out / f"{arm}-steps-seed{seed}"
            timing = trained(timed_by, epochs) if "steps" in args.budgets else head_to_head.recorded(timed_by)
            if "wall" not in args.budgets:
                continue
            wall_s = reference["train_s"] if reference else args.wall_seconds
            if wall_s is None:
                raise SystemExit("the wall budget needs the nnunet arm (its training time) or --wall-seconds")
            if timing is None:
                timed_by = out / f"{arm}-calibration-seed{seed}"
                timing = trained(timed_by, 1)
            wall = wall_epochs(wall_s, timing, args.iterations)
            folder = out / f"{arm}-wall-seed{seed}"
            if wall == timing["epochs"]:
                same_run(folder, timing, timed_by, wall_s)
            else:
                trained(folder, wall, {"wall_reference_s": wall_s})
    table = protocol_table(dataset, out, args)
    subjects = subject_table(dataset, out, root, split["test"])
    (out / "results.md").write_text(f"{table}\n\n{subjects}\n")
    print(f"{table}\n\n{subjects}")
    if args.docs:
        write_into(Path(args.docs), dataset, table)
        write_into(Path(args.docs), f"{dataset} subjects", subjects)
    return out


# ---- the table ----------------------------------------------------------------------------------------------------


def same_run(folder: Path, timing: dict[str, Any], timed_by: Path, wall_s: float) -> dict[str, Any]:
    """The wall run recorded as the finished run `timed_by` (its result `timing`): the same command (arm, seed,
    epochs) as the wall budget gives, so the same run."""
    return head_to_head.finished(folder, partial(dict, timing, wall_reference_s=wall_s, same_run_as=timed_by.name))


def recorded_runs(out: Path) -> dict[tuple[str, str], list[dict[str, Any]]]:
    """Every finished run of a dataset's folder by (arm, budget), with its seed and folder name; nnU-Net's serve both
    budgets."""
    runs: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for record in sorted(out.glob("*-seed*/result.json")):
        arm, budget, seed = record.parent.name.rsplit("-", 2)
        if budget == "calibration":
            continue
        result = {**json.loads(record.read_text()), "seed": int(seed.removeprefix("seed")),
                  "folder": record.parent.name}
        budgets = BUDGETS if arm == "nnunet" else (budget,)
        for each in budgets:
            runs.setdefault((arm, each), []).append(result)
    return runs


def spread(values: Sequence[float]) -> str:
    finite = [v for v in values if math.isfinite(v)]
    if not finite:
        return "-"
    if len(finite) == 1:
        return f"{finite[0]:.3f}"
    return f"{statistics.mean(finite):.3f} ± {statistics.stdev(finite):.3f}"


def mean_dice(scores: dict[str, float], names: Sequence[str]) -> float:
    """The mean Dice over the structures scored (a structure absent from every test subject left out)."""
    finite = [scores[f"dice_{n}"] for n in names if math.isfinite(scores[f"dice_{n}"])]
    return statistics.fmean(finite) if finite else float("nan")


def reproducing_command(dataset: str, runs: dict[tuple[str, str], list[dict[str, Any]]],
                        args: argparse.Namespace) -> str:
    """The command that records every run of the table: its arms, budgets and seeds (not only this invocation's),
    and each option that changes a result where it is not the default."""
    arms = [a for a in ARMS if any(arm == a for arm, _ in runs)] or args.arms
    budgets = [b for b in BUDGETS if any(budget == b and arm != "nnunet" for arm, budget in runs)] or args.budgets
    seeds = sorted({r["seed"] for results in runs.values() for r in results}) or args.seeds
    command = (f"python benchmarks/segmentation/segmentation.py protocol --dataset {dataset} --arms {','.join(arms)} "
               f"--budgets {','.join(budgets)} --seeds {','.join(map(str, seeds))} --steps {args.steps} "
               f"--iterations {args.iterations} --subjects {args.subjects} --cores {args.cores}")
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    for option in ("val_iterations", "wall_seconds", "spacing_scale", "data_seed"):
        value = getattr(args, option)
        if value != parser.get_default(option):
            command += f" --{option.replace('_', '-')} {value:g}"
    return command


def protocol_table(dataset: str, out: Path, args: argparse.Namespace) -> str:
    """One markdown table of every recorded run: per arm and budget the runs, steps, plan, training time, Dice per
    structure and its mean (final checkpoint; mean ± standard deviation over runs), medvol's best checkpoint apart."""
    names = list(DATASETS[dataset]["structures"])
    runs = recorded_runs(out)
    lines = [
        f"`{reproducing_command(dataset, runs, args)}`", "",
        "| arm | budget | runs (seeds) | optimizer steps | patch, batch, filters | train (min) | "
        + " | ".join(f"Dice {n}" for n in names) + " | mean Dice | mean Dice, best checkpoint |",
        "|" + "---|" * (len(names) + 8),
    ]
    for (arm, budget), results in sorted(runs.items(), key=lambda item: (BUDGETS.index(item[0][1]), item[0][0])):
        means = [mean_dice(r["scores"], names) for r in results]
        best = [mean_dice(r["scores_best"], names) for r in results if "scores_best" in r]
        first = results[0]
        patch = "x".join(map(str, first.get("patch") or []))
        plan = f"{patch}, {first.get('batch')}, {(first.get('features') or [0])[0]}"
        seeds = ",".join(str(r["seed"]) for r in results)
        lines.append(
            f"| {arm} | {budget} | {len(results)} ({seeds}) | {statistics.fmean([r['steps'] for r in results]):.0f} | "
            f"{plan} | "
            f"{statistics.fmean([r['train_s'] for r in results]) / 60:.1f} | "
            + " | ".join(spread([r["scores"][f"dice_{n}"] for r in results]) for n in names)
            + f" | {spread(means)} | {spread(best) if best else '-'} |"
        )
    return "\n".join(lines)


def subject_table(dataset: str, out: Path, root: Path, test: Sequence[str]) -> str:
    """Per test subject: its label file's voxel size, the reference's voxels per structure, and per arm and budget
    the Dice of each structure (final checkpoint; the mean over the recorded seeds, `-` where absent from both):
    which subjects a difference of the means comes from. A structure of a single voxel scores 0 or 1."""
    import nibabel as nib
    import numpy as np

    kind, structures = DATASETS[dataset]["kind"], DATASETS[dataset]["structures"]
    columns: dict[str, list[list[dict[str, float]]]] = {}
    seeds: dict[str, list[str]] = {}
    for (arm, budget), results in sorted(recorded_runs(out).items(), key=lambda i: (BUDGETS.index(i[0][1]), i[0][0])):
        if arm == "nnunet" and budget != "steps":
            continue
        column = arm if arm == "nnunet" else f"{arm} {budget}"
        name, back = ("{subject}.nii.gz", nnunet_labels_back(dataset)) if arm == "nnunet" else (
            "{subject}_seg.nii.gz", None)
        for result in results:
            folder = out / result.get("same_run_as", result["folder"]) / "test-predictions"
            seeds.setdefault(column, []).append(str(result["seed"]))
            columns.setdefault(column, []).append(
                head_to_head.subject_scores(kind, root, folder, list(test), name, back, structures))
    names = "/".join(structures)
    lines = [
        f"| test subject | voxel (mm) | reference voxels {names} | "
        + " | ".join(f"{column} (seeds {','.join(seeds[column])}): Dice {names}" for column in columns) + " |",
        "|" + "---|" * (len(columns) + 3),
    ]
    for index, subject in enumerate(test):
        truth = nib.load(head_to_head.label_file(kind, root, subject))
        labels = np.asarray(truth.dataobj)
        voxel = "x".join(f"{float(z):g}" for z in truth.header.get_zooms()[:3])
        counts = "/".join(str(int(np.isin(labels, values).sum())) for values in structures.values())
        cells = []
        for runs in columns.values():
            means = []
            for n in structures:
                finite = [r[index][f"dice_{n}"] for r in runs if math.isfinite(r[index][f"dice_{n}"])]
                means.append(f"{statistics.fmean(finite):.2f}" if finite else "-")
            cells.append("/".join(means))
        lines.append(f"| {subject} | {voxel} | {counts} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def write_into(docs: Path, dataset: str, table: str) -> None:
    """`table` between the dataset's markers in `docs` (added at the end where they are missing)."""
    start, end = MARKER.format(dataset=dataset, edge="start"), MARKER.format(dataset=dataset, edge="end")
    text = docs.read_text() if docs.is_file() else ""
    block = f"{start}\n{table}\n{end}"
    if start in text and end in text:
        text = text[: text.index(start)] + block + text[text.index(end) + len(end):]
    else:
        text = text.rstrip("\n") + ("\n\n" if text else "") + block + "\n"
    docs.write_text(text)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--dataset", required=True, choices=list(DATASETS))
    parser.add_argument("--arms", type=head_to_head.comma_list, default=list(ARMS), help="medvol16,medvol32,nnunet")
    parser.add_argument("--budgets", type=head_to_head.comma_list, default=list(BUDGETS), help="steps,wall")
    parser.add_argument("--seeds", type=lambda v: [int(s) for s in head_to_head.comma_list(v)], default=[0, 1, 2])
    parser.add_argument("--steps", type=int, default=1250, help="optimizer steps of the steps budget (nnU-Net's too)")
    parser.add_argument("--iterations", type=int, default=250, help="batches an epoch (every arm)")
    parser.add_argument("--val-iterations", type=int, default=50, help="nnU-Net's validation batches an epoch")
    parser.add_argument("--wall-seconds", type=float, default=None, help="the wall budget without an nnunet arm")
    parser.add_argument("--subjects", type=int, default=48)
    parser.add_argument("--spacing-scale", type=float, default=1.0, help="every spacing times this (a toy check)")
    parser.add_argument("--data-seed", type=int, default=0)
    parser.add_argument("--cores", type=int, default=1, help="cores each arm is pinned to (taskset)")
    parser.add_argument("--cpus", type=lambda v: [int(c) for c in head_to_head.comma_list(v)], default=None,
                        help="the cores themselves (e.g. 0 for one command and 1 for another run beside it)")
    parser.add_argument("--nnunet-venv", default="/work/nnunet-venv")
    parser.add_argument("--out", default="outputs/benchmarks/segmentation-protocol")
    parser.add_argument("--docs", default=None, help="write the table between the dataset's markers in this file")


def check(args: argparse.Namespace) -> None:
    unknown = [a for a in args.arms if a not in ARMS] + [b for b in args.budgets if b not in BUDGETS]
    if unknown:
        raise SystemExit(f"unknown arms or budgets {unknown}; expected arms {list(ARMS)}, budgets {list(BUDGETS)}")
    if args.steps < args.iterations or args.steps % args.iterations:
        raise SystemExit(f"--steps {args.steps} must be a multiple of --iterations {args.iterations}")
    if "nnunet" in args.arms and not (Path(args.nnunet_venv) / "bin" / "python").is_file():
        raise SystemExit(f"--nnunet-venv {args.nnunet_venv} has no bin/python (a venv with nnunetv2 2.8.1)")
    if shutil.which("taskset") is None:
        raise SystemExit("taskset (util-linux) is needed to pin the arms to their cores")
