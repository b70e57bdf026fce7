"""The pieces of issue 28/35's `real` head-to-head (`segmentation.py real`) that issue 50's protocol
(`segmentation_protocol.py`) runs too: the datasets' files and their nnU-Net raw layout, the medvol arm as a user
types it, the Dice/HD95 scoring of a folder of masks, GNU time's figures of a command, and the record of a finished
arm. Both scripts import it, so the protocol needs nothing of segmentation.py, which runs it as `segmentation.py
protocol`: the imports go one way.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from benchmarks.common import ROOT, child_env

MODALITIES = ("t1", "t1ce", "t2", "flair")
STRUCTURES = {
    "brats": {"WT": (1, 2, 4), "TC": (1, 4), "ET": (4,)},
    "ct": {"organ": (1,), "lesion": (2,)},
}
TO_NNUNET = {"brats": {2: 1, 1: 2, 4: 3}, "ct": {1: 1, 2: 2}}
NNUNET_LABELS = {
    "brats": {"background": 0, "whole tumor": [1, 2, 3], "tumor core": [2, 3], "enhancing tumor": [3]},
    "ct": {"background": 0, "organ": 1, "lesion": 2},
}
NNUNET_CHANNELS = {"brats": {"0": "T1", "1": "T1ce", "2": "T2", "3": "Flair"}, "ct": {"0": "CT"}}
# The trainer the nnU-Net arm trains with: nnU-Net's own, with the epochs and iterations of the budget
# (found by nnUNetv2_train and nnUNetv2_predict through nnU-Net's `nnUNet_extTrainer` search path).
BUDGET_TRAINER = '''import os

import torch

from nnunetv2.training.nnUNetTrainer.nnUNetTrainer import nnUNetTrainer


class nnUNetTrainer_medvolBudget(nnUNetTrainer):
    """nnU-Net's default trainer with the optimizer steps of medvol's run: epochs x iterations per epoch."""

    def __init__(self, plans: dict, configuration: str, fold: int, dataset_json: dict,
                 device: torch.device = torch.device("cuda")):
        super().__init__(plans, configuration, fold, dataset_json, device)
        self.num_epochs = int(os.environ.get("MEDVOL_NNUNET_EPOCHS", "1"))
        self.num_iterations_per_epoch = int(os.environ.get("MEDVOL_NNUNET_ITERATIONS", "250"))
        self.num_val_iterations_per_epoch = int(os.environ.get("MEDVOL_NNUNET_VAL_ITERATIONS", "50"))
'''
TRAINER_NAME = "nnUNetTrainer_medvolBudget"


def case_files(root: Path, subject: str) -> dict[str, str]:
    return {name: str(root / subject / f"{subject}_{name}.nii.gz") for name in (*MODALITIES, "seg")}


def image_files(kind: str, root: Path, subject: str) -> list[str]:
    if kind == "ct":
        return [str(root / subject / "ct.nii.gz")]
    if kind == "raw":
        return [str(p) for p in sorted((root / "imagesTr").glob(f"{subject}_[0-9][0-9][0-9][0-9].nii.gz"))]
    return [case_files(root, subject)[m] for m in MODALITIES]


def label_file(kind: str, root: Path, subject: str) -> str:
    """The label file of `subject`: a BraTS case's seg, a CT case's, or an nnU-Net raw dataset's labelsTr file."""
    if kind == "raw":
        return str(root / "labelsTr" / f"{subject}.nii.gz")
    return str(root / subject / "seg.nii.gz") if kind == "ct" else case_files(root, subject)["seg"]


def structure_scores(seg: Any, truth: Any, structures: dict[str, tuple[int, ...]], spacing: list[float]) -> dict:
    """Dice and HD95 (mm) per structure of a label map against the truth. Dice as nnU-Net's `compute_metrics` scores
    it: 2 TP / (2 TP + FP + FN), NaN for a structure absent from both (left out of the means, not 1: MONAI's
    `compute_dice(ignore_empty=False)` would count it as a perfect score); HD95 as MONAI computes it (NaN or inf
    where a mask is empty, left out of the means too)."""
    import numpy as np
    import torch
    from monai.metrics import compute_hausdorff_distance

    scores = {}
    for name, values in structures.items():
        predicted, expected = np.isin(seg, values), np.isin(truth, values)
        overlap, total = int((predicted & expected).sum()), int(predicted.sum()) + int(expected.sum())
        scores[f"dice_{name}"] = 2.0 * overlap / total if total else float("nan")
    masks = torch.from_numpy(np.stack([np.isin(seg, v) for v in structures.values()])[None].astype(np.uint8))
    target = torch.from_numpy(np.stack([np.isin(truth, v) for v in structures.values()])[None].astype(np.uint8))
    hd95 = compute_hausdorff_distance(masks, target, include_background=True, percentile=95, spacing=spacing)[0]
    scores.update({f"hd95_{n}": float(h) for n, h in zip(structures, hd95, strict=True)})
    return scores


def mean_scores(rows: list[dict[str, float]]) -> dict[str, float]:
    """Per score, the mean over the subjects where it is finite; NaN where it is finite for none (an HD95 of masks
    that are empty for every subject is undefined, not 0 mm)."""
    import math

    means = {}
    for k in rows[0]:
        finite = [r[k] for r in rows if math.isfinite(r[k])]
        means[k] = sum(finite) / len(finite) if finite else float("nan")
    return means


def score_folder(
    kind: str, root: Path, folder: Path, subjects: list[str], name: str, back: dict | None = None,
    structures: dict[str, tuple[int, ...]] | None = None,
) -> dict:
    """Mean scores of the masks `folder/<name with {subject}>` against the dataset's label files (`structures`:
    name -> label values in the files; the kind's by default)."""
    return mean_scores(subject_scores(kind, root, folder, subjects, name, back, structures))


def subject_scores(
    kind: str, root: Path, folder: Path, subjects: list[str], name: str, back: dict | None = None,
    structures: dict[str, tuple[int, ...]] | None = None,
) -> list[dict[str, float]]:
    """`score_folder`'s scores of each subject, in the order of `subjects`."""
    import nibabel as nib
    import numpy as np

    rows = []
    for subject in subjects:
        truth = nib.load(label_file(kind, root, subject))
        seg = np.asarray(nib.load(str(folder / name.format(subject=subject))).dataobj).astype(np.int64)
        if back:
            mapped = np.zeros_like(seg)
            for ours, theirs in back.items():
                mapped[seg == ours] = theirs
            seg = mapped
        spacing = [float(z) for z in truth.header.get_zooms()[:3]]
        rows.append(structure_scores(seg, np.asarray(truth.dataobj), structures or STRUCTURES[kind], spacing))
    return rows


def timed(
    command: list[str], log: Path, env: dict[str, str] | None = None, cwd: Path | None = None
) -> tuple[float, float]:
    """Run `command` under GNU time; (wall seconds, peak resident memory of its largest process in MiB). Its output
    goes to `log`; a failure stops the benchmark with the log's tail."""
    start = time.perf_counter()
    result = subprocess.run(
        ["/usr/bin/time", "-f", "MEDVOL_PEAK_KB %M", *command], capture_output=True, text=True, cwd=cwd,
        env={**child_env(), **(env or {})},
    )
    wall = time.perf_counter() - start
    log.write_text(result.stdout + result.stderr)
    if result.returncode:
        tail = (result.stdout + result.stderr)[-3000:]
        raise SystemExit(f"{command[0]} ... failed ({result.returncode}), see {log}:\n{tail}")
    peak = [line for line in result.stderr.splitlines() if line.startswith("MEDVOL_PEAK_KB")]
    return wall, float(peak[-1].split()[1]) / 1024 if peak else float("nan")


def medvol_arm(
    kind: str, root: Path, split_file: Path, out: Path, epochs: int, test: list[str], extra: Sequence[str] = (),
    dataset: Sequence[str] | None = None, structures: dict[str, tuple[int, ...]] | None = None,
    prefix: Sequence[str] = (), env: dict[str, str] | None = None,
) -> dict[str, Any]:
    """`python train.py model=segmentation dataset=...` as a user types it (the plan, its validation after training;
    `extra` overrides; every command after `prefix`, e.g. taskset, with `env`), then, as nnU-Net is tested,
    `python predict.py ckpt_path=<last.ckpt> split=test postprocessing=false` (the final checkpoint, mirroring, no
    post-processing); the best-validation checkpoint
    predicted alike and scored apart (`scores_best`). The training loop's data wait read from the run's telemetry."""
    dataset = list(dataset) if dataset is not None else (
        ["dataset=brats", "dataset.label_regions=[WT,TC,ET]"] if kind == "brats"
        else ["dataset=nifti", "dataset.image_modalities=[ct]", "dataset.label_file='{subject}/seg.nii.gz'",
              "model.num_classes=3", "model.class_names=[organ,lesion]"]
    )
    command = [
        *prefix, sys.executable, str(ROOT / "train.py"), "model=segmentation", *dataset, f"dataset.root={root}",
        f"trainer.max_epochs={epochs}", "hardware=cpu", f"dataset.split_file={split_file}",
        "callbacks.progress_bar=null", "logger=csv", f"hydra.run.dir={out}", *extra,
    ]
    train_wall, train_peak = timed(command, out.parent / f"{out.name}.train.log", env, cwd=out.parent)
    summary = json.loads((out / "summary.json").read_text())
    walls, peaks, scores = {}, [train_peak], {}
    for which, checkpoint in (("final", out / "checkpoints" / "last.ckpt"), ("best", summary["best_checkpoint"])):
        predicted = out / ("test-predictions" if which == "final" else "test-predictions-best")
        walls[which], peak = timed(
            [*prefix, sys.executable, str(ROOT / "predict.py"), f"ckpt_path={checkpoint}", "split=test",
             f"output_dir={predicted}", "device=cpu", "postprocessing=false"],
            out.parent / f"{out.name}.predict-{which}.log", env, cwd=out.parent,
        )
        peaks.append(peak)
        scores[which] = score_folder(kind, root, predicted, test, "{subject}_seg.nii.gz", structures=structures)
    plan = json.loads((out / "plan.json").read_text()) if (out / "plan.json").is_file() else {}
    telemetry = summary.get("telemetry", {})
    return {
        "scores": scores["final"], "scores_best": scores["best"], "checkpoint": "last.ckpt",
        "best_checkpoint": Path(summary["best_checkpoint"]).name, "steps": int(summary["global_step"]),
        "epochs": epochs, "batch": plan.get("batch_size"), "patch": plan.get("patch_size"),
        "features": plan.get("features"), "spacing": plan.get("spacing"), "train_s": train_wall,
        "predict_s": walls["final"], "peak_mib": max(peaks),
        "steps_per_epoch": int(summary["global_step"]) // max(1, epochs),
        "data_wait": telemetry.get("data_wait_fraction"), "step_s": telemetry.get("step_time_ms", 0.0) / 1000,
        "epoch_s": telemetry.get("epoch_seconds"),
    }


def raw_folder(raw: Path, name: str) -> Path:
    """nnU-Net's raw dataset folder `name` under `raw`, with its imagesTr, labelsTr and imagesTs."""
    folder = raw / name
    for sub in ("imagesTr", "labelsTr", "imagesTs"):
        (folder / sub).mkdir(parents=True, exist_ok=True)
    return folder


def raw_subjects(split: dict[str, list[str]]) -> Iterator[tuple[str, str]]:
    """(images folder, subject) for every subject of `split`: training and validation in imagesTr, test in
    imagesTs."""
    for stage, images in (("train", "imagesTr"), ("val", "imagesTr"), ("test", "imagesTs")):
        for subject in split[stage]:
            yield images, subject


def linked(target: Path, path: str | Path) -> None:
    """`target` a link to `path` unless it is there already (an arm rerun on the same folder)."""
    if not target.exists():
        target.symlink_to(path)


def nnunet_dataset(kind: str, root: Path, raw: Path, dataset_id: int, split: dict[str, list[str]]) -> str:
    """The files in nnU-Net's raw layout (imagesTr/labelsTr/imagesTs, its label values, dataset.json); its name."""
    import nibabel as nib
    import numpy as np

    name = f"Dataset{dataset_id:03d}_medvol{kind.capitalize()}"
    folder = raw_folder(raw, name)
    for images, subject in raw_subjects(split):
        for channel, path in enumerate(image_files(kind, root, subject)):
            linked(folder / images / f"{subject}_{channel:04d}.nii.gz", path)
        if images == "imagesTr":
            label = nib.load(label_file(kind, root, subject))
            values = np.asarray(label.dataobj).astype(np.uint8)
            converted = np.zeros_like(values)
            for ours, theirs in TO_NNUNET[kind].items():
                converted[values == ours] = theirs
            nib.save(nib.Nifti1Image(converted, label.affine), str(folder / "labelsTr" / f"{subject}.nii.gz"))
    record = {
        "channel_names": NNUNET_CHANNELS[kind], "labels": NNUNET_LABELS[kind],
        "numTraining": len(split["train"]) + len(split["val"]), "file_ending": ".nii.gz",
    }
    if kind == "brats":
        record["regions_class_order"] = [1, 2, 3]
    (folder / "dataset.json").write_text(json.dumps(record, indent=2))
    return name


def recorded(arm_dir: Path) -> dict[str, Any] | None:
    """The figures a finished arm recorded (`<arm_dir>/result.json`), or None."""
    record = arm_dir / "result.json"
    return json.loads(record.read_text()) if record.is_file() else None


def finished(arm_dir: Path, compute: Any) -> dict[str, Any]:
    """An arm's figures: those it recorded (a finished arm of an interrupted benchmark), else computed now (in a
    fresh folder) and recorded."""
    result = recorded(arm_dir)
    if result is not None:
        return result
    shutil.rmtree(arm_dir, ignore_errors=True)
    result = compute()
    arm_dir.mkdir(parents=True, exist_ok=True)  # a result computed elsewhere (a run that is this one too)
    (arm_dir / "result.json").write_text(json.dumps(result, indent=2))
    return result


def comma_list(value: str) -> list[str]:
    return [v for v in value.split(",") if v]
