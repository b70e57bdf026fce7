"""A segmentation run's validation after training, its post-processing, and the cross-validation of a fold sweep.

After training, the best checkpoint predicts every validation subject as predict.py would (whole volumes,
mirroring, logits resampled onto the source grid before the softmax and the argmax) into `<run>/validation/`: the
masks, `metrics.csv` (Dice and HD95 of what a user receives) and, per subject, the predicted and reference
label maps in the model's label values (`label_maps/<subject>.npz`). nnU-Net's post-processing rule is
applied to them (`lightning_modules.segmentation.postprocessing.choose`) and the decision written to
`<run>/postprocessing.json`; chosen on one split's few subjects it is not applied unless asked
(`model.postprocessing=true`, predict.py's `postprocessing=true`).

A sweep over `dataset.fold=0,1,2,3,4` holds five such runs, each validated on its own fold. When the sweep
ends (`CrossValidationSummary`, a Hydra callback), the folds' validations are read once: the cross-validation
Dice per fold and over all subjects goes to `<sweep>/cross_validation.json`, and the post-processing chosen on
every fold's predictions together to `<sweep>/postprocessing.json`, which `predict.py run_dir=<sweep>` (the
five folds' ensemble) applies, as nnU-Net applies the decision it makes on its cross-validation folds.
"""

from __future__ import annotations

import csv
import logging
import math
import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytorch_lightning as pl
import torch
from hydra.experimental.callback import Callback
from omegaconf import DictConfig

from lightning_modules.segmentation.label_scheme import LabelScheme
from lightning_modules.segmentation.postprocessing import Postprocessing, choose
from lightning_modules.segmentation.segmentation import Segmenter
from medvol.core.build import build
from medvol.core.run_files import open_in
from medvol.core.subject_names import SubjectFiles
from medvol.run.fold_records import (
    FOLD_FILE,
    LABEL_MAPS_DIR,
    POSTPROCESSING_FILE,
    SUMMARY_FILE,
    VALIDATION_DIR,
    VOLUMES_FILE,
    applied_postprocessing,
    fold_runs,
    read_volume_range,
    write_json,
)
from medvol.run.predict_config import window_size
from medvol.run.predict_inputs import batches, dataset_subjects
from medvol.run.trained_model import mean_metrics
from medvol.run.trained_run import open_trained_run
from medvol.volumes.prediction_writer import PredictionWriter
from medvol.volumes.segmentation_report import structure_volumes
from medvol.volumes.sliding_window import SlidingWindow
from medvol.volumes.volume_reader import VolumeReader

log = logging.getLogger("medvol")



def after_training(cfg: DictConfig, trainer: pl.Trainer, module: pl.LightningModule) -> dict[str, float]:
    """A segmentation run's validation on the source grid and its post-processing (rank 0; the others wait);
    the mean `validation/*` metrics. The test then applies the recorded post-processing as `model.postprocessing`
    lets it (`applied_postprocessing`; a run that did not train, `train=false`, too). Nothing for other families."""
    if not isinstance(module, Segmenter):
        return {}
    metrics: dict[str, float] = {}
    run_dir = Path(str(cfg.paths.output_dir))
    switch = cfg.model.get("postprocessing", "auto")
    if not cfg.get("train", True):
        module.postprocessing, module.postprocessing_note = applied_postprocessing(
            run_dir, switch, module.postprocessing
        )
        module.volume_range = read_volume_range(run_dir)
        return metrics
    if trainer.is_global_zero:
        callback = trainer.checkpoint_callback
        checkpoint = getattr(callback, "best_model_path", "") or getattr(callback, "last_model_path", "")
        if checkpoint:
            metrics = validate(cfg, checkpoint, trainer.strategy.root_device)
    trainer.strategy.barrier("medvol-final-validation")
    module.postprocessing, module.postprocessing_note = applied_postprocessing(run_dir, switch, module.postprocessing)
    module.volume_range = read_volume_range(run_dir)
    if trainer.is_global_zero:
        log.info("%s", module.postprocessing_note)
    return metrics


def validate(cfg: DictConfig, checkpoint: str, device: torch.device) -> dict[str, float]:
    """`checkpoint` on the run's validation subjects, written to `<run>/validation/`; the post-processing chosen
    on them written to `<run>/postprocessing.json`; the mean metrics (`validation/dice_<name>`, ...)."""
    run_dir = Path(str(cfg.paths.output_dir))
    out = run_dir / VALIDATION_DIR
    module = open_trained_run(checkpoint, config=cfg).module(device)
    assert isinstance(module, Segmenter)
    # The decision is made on the raw predictions.
    module.postprocessing = Postprocessing()
    inputs = dataset_subjects(cfg, None, "val", False, {})
    window = SlidingWindow.of(
        window_size(cfg), overlap=float(cfg.model.overlap), mode="gaussian", batch_size=int(cfg.model.sw_batch_size),
        device=device,
    )
    writer = PredictionWriter(out, skip=("input", "label", "reference"), root=run_dir)
    maps = out / LABEL_MAPS_DIR
    names = SubjectFiles()
    subjects, label_values = [], None
    for batch in batches(inputs.dataset):
        label_values = batch.get("label_values")
        with torch.no_grad():
            outputs = module.predict_volumes(batch, window, ["reference"])
        writer.write(outputs, batch)
        for i, subject in enumerate(batch["subject"]):
            prediction, reference = outputs["volumes"]["seg"][i], outputs["volumes"]["reference"][i]
            with open_in(run_dir, label_map_file(maps, subject, names), "wb") as handle:
                np.savez_compressed(handle, prediction=label_array(prediction), reference=label_array(reference))
            subjects.append(str(subject))
    write_json(run_dir / VOLUMES_FILE, training_volumes(
        cfg, module.scheme.segments, label_values[0].tolist() if label_values is not None else None
    ), run_dir)
    module.volume_range = writer.volume_range = read_volume_range(run_dir)
    writer.write_metrics()
    fold = cfg.dataset.get("fold")
    scheme = module.scheme
    labels = {"num_classes": scheme.num_classes, "regions": scheme.regions or None, "class_names": scheme.class_names,
              "threshold": scheme.threshold, "ignore_label": scheme.ignore_label}
    # Relative to the run, so that a moved sweep still finds it (and a record read back names nothing outside).
    write_json(out / FOLD_FILE, {
        "fold": fold, "checkpoint": os.path.relpath(Path(checkpoint).resolve(), run_dir.resolve()), "labels": labels,
        "subjects": subjects,
    }, run_dir)
    decision = choose(module.scheme, cases(maps, subjects), folds=1)
    write_json(run_dir / POSTPROCESSING_FILE, decision.to_json(), run_dir)
    means = {k: v for k, v in mean_metrics(writer.rows).items() if not k.startswith("volume_")}
    names = module.scheme.names
    metrics = {f"validation/{k}": v for k, v in means.items()}
    if all(f"dice_{n}" in means for n in names):
        metrics["validation/dice"] = float(np.mean([means[f"dice_{n}"] for n in names]))
    log.info(
        "validation on the source grid (%d subjects%s, checkpoint %s): %s",
        len(subjects), f", fold {fold}" if fold is not None else "", Path(checkpoint).name,
        ", ".join(f"{k.removeprefix('validation/')} {v:.4f}" for k, v in metrics.items()),
    )
    log.info("chosen on the validation split: %s (%s)", decision.describe(), run_dir / POSTPROCESSING_FILE)
    return metrics


def training_volumes(
    cfg: DictConfig, segments: dict[str, list[int]], label_values: list[int] | None, count: int = 32
) -> dict[str, dict[str, float]]:
    """Per structure, the smallest, median and largest volume (ml) in up to `count` training label files (evenly
    spread): the range a prediction's volume is flagged outside of (`medvol.volumes.segmentation_report`)."""
    datamodule = build(cfg.dataset)
    datamodule.assign_split()
    records = [r for r in datamodule.training_records() if r.get("label")]
    if len(records) > count:
        records = [records[round(i * (len(records) - 1) / (count - 1))] for i in range(count)]
    # The structures in the files' own values (BraTS 2021's 4 for the model's 3).
    in_files = {n: [label_values[v] if label_values else v for v in values] for n, values in segments.items()}
    volumes: dict[str, list[float]] = {name: [] for name in segments}
    reader = VolumeReader()
    for record in records:
        array, meta = reader.get_data(reader.read(str(record["label"])))
        found = structure_volumes(np.rint(np.asarray(array)), in_files, np.asarray(meta["affine"]))
        for name, value in found.items():
            volumes[name].append(value)
    return {
        name: {"min": min(v), "median": float(np.median(v)), "max": max(v), "subjects": len(v)}
        for name, v in volumes.items() if v
    }


def label_array(volume: torch.Tensor) -> np.ndarray:
    """A (1, D, H, W) or (D, H, W) label map as the smallest integer array that holds it."""
    array = volume.detach().cpu().numpy()
    array = array[0] if array.ndim == 4 else array
    return array.astype(np.uint8 if array.max(initial=0) < 256 and array.min(initial=0) >= 0 else np.int32)


def label_map_file(folder: Path, subject: str, names: SubjectFiles | None = None) -> Path:
    """`label_maps/<subject>.npz`, the subject id made a file name inside `folder` (`medvol.core.subject_names`)."""
    return folder / f"{(names or SubjectFiles()).stem(subject)}.npz"


def cases(folder: Path, subjects: Sequence[str]) -> list[Callable[[], tuple[np.ndarray, np.ndarray]]]:
    """Per subject, a loader of its (prediction, reference) label maps: read when a trial needs them, so every
    fold's subjects are never all in memory."""

    def loader(subject: str) -> Callable[[], tuple[np.ndarray, np.ndarray]]:
        def load() -> tuple[np.ndarray, np.ndarray]:
            with np.load(label_map_file(folder, subject)) as record:
                return record["prediction"], record["reference"]

        return load

    return [loader(s) for s in subjects]


# ---- the sweep ----------------------------------------------------------------------------------------------------


def summarise_sweep(sweep_dir: Path) -> dict[str, Any] | None:
    """The cross-validation of the sweep's fold runs (`cross_validation.json`) and the post-processing chosen on
    all their validation predictions (`postprocessing.json`), both written into the sweep; None without folds."""
    runs = fold_runs(sweep_dir)
    if not runs:
        return None
    per_fold, all_rows, all_cases = {}, [], []
    for fold, run_dir, record in runs:
        rows = read_rows(run_dir / VALIDATION_DIR / "metrics.csv")
        all_rows.extend(rows)
        all_cases.extend(cases(run_dir / VALIDATION_DIR / LABEL_MAPS_DIR, record.subjects))
        per_fold[str(fold)] = {"run_dir": str(run_dir), "checkpoint": record.checkpoint,
                               "subjects": len(record.subjects), **mean_metrics(rows)}
    names = [k.removeprefix("dice_") for k in (all_rows[0] if all_rows else {}) if k.startswith("dice_")]
    pooled = mean_metrics(all_rows)
    summary = {
        "folds": per_fold,
        # Every subject once, validated by the fold that did not train on it: the cross-validation figure.
        "all_subjects": {**pooled, "dice": float(np.mean([pooled[f"dice_{n}"] for n in names])) if names else None},
        "mean_over_folds": {
            k: float(np.mean([f[k] for f in per_fold.values() if k in f and math.isfinite(f[k])]))
            for k in pooled
        },
    }
    decision = choose(LabelScheme(**runs[0][2].labels.model_dump()), all_cases, folds=len(runs))
    summary["postprocessing"] = decision.to_json()
    write_json(sweep_dir / SUMMARY_FILE, summary)
    write_json(sweep_dir / POSTPROCESSING_FILE, decision.to_json())
    log.info(
        "cross-validation of %d folds (%d subjects) -> %s: %s", len(runs), len(all_rows), sweep_dir / SUMMARY_FILE,
        ", ".join(f"dice_{n} {pooled[f'dice_{n}']:.4f}" for n in names),
    )
    log.info("chosen on %d folds: %s (%s; predict.py run_dir=%s applies it)", len(runs), decision.describe(),
             sweep_dir / POSTPROCESSING_FILE, sweep_dir)
    return summary


def read_rows(path: Path) -> list[dict[str, Any]]:
    with path.open() as handle:
        return [
            {k: (v if k == "subject" else float(v) if v not in ("", "nan") else math.nan) for k, v in row.items()}
            for row in csv.DictReader(handle)
        ]


class CrossValidationSummary(Callback):
    """Hydra callback: when a `-m` sweep ends, summarise its fold runs once (`summarise_sweep`)."""

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        sweep_dir = Path(str(config.hydra.sweep.dir))
        if sweep_dir.is_dir():
            summarise_sweep(sweep_dir)
