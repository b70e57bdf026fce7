"""`predict(cfg)`: a trained model's outputs for unseen whole volumes, written like `test=true` writes them.

predict.py runs in stages, as nnU-Net's inference does: the run's config recovered and merged
(`medvol.run.predict_config`), the checks (`medvol.run.predict_check`), the inputs found and their
outputs guarded (`medvol.run.predict_inputs`), then the loop here. A model that generates from
radiographs (X-ray-to-CT) takes a folder of `<subject>_<view>.nii.gz` radiographs as `input` instead
(`medvol.run.radiographs`). Every other subject goes through the family's `predict_volumes` (sliding
windows of the training size where the forward is volume-to-volume) and `PredictionWriter`, the
code that writes `test=true` outputs: the source grid and units, the source header.
"""

from __future__ import annotations

import logging
import math
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from lightning_modules.base import MedvolModule
from medvol.core.build import build_model, target_class
from medvol.core.console import log_file
from medvol.run.checkpoint_check import check_checkpoint_family, check_checkpoint_shapes
from medvol.run.generation import intensity_record, on_model_grid, sampled_outputs, with_target_units
from medvol.run.noise_samples import noise_geometry, write_noise_samples
from medvol.run.predict_check import (
    check_inputs,
    check_predict,
    check_radiograph_input,
    check_samples,
    from_noise,
    pick_device,
    window_roi,
)
from medvol.run.predict_config import input_geometry, recovered_run, with_geometry
from medvol.run.predict_inputs import Inputs, batches, check_output_dir, find_inputs
from medvol.run.radiographs import ct_from_radiographs
from medvol.volumes.prediction_writer import PredictionWriter, check_output_format
from medvol.volumes.sliding_window import SlidingWindow

log = logging.getLogger("medvol")
# Beside the outputs, as train.py writes train.log in its run: what the console showed (predict.py logs to
# stdout) plus the library warnings the console drops.
LOG_FILE = "predict.log"


def predict(cfg: DictConfig) -> dict[str, float]:
    """Predict every subject the config names and write the outputs; return the mean per-subject metrics."""
    run = recovered_run(cfg)
    overlap = check_predict(cfg, run)
    output_format = check_output_format(str(cfg.get("output_format", "nifti")))
    output_dir = Path(str(cfg.output_dir)).expanduser()
    device = pick_device(str(cfg.device))
    module = load_module(run, str(cfg.ckpt_path), device)
    num_samples = int(cfg.get("num_samples", 1))
    if from_noise(cfg):
        return noise_samples(module, cfg.get("spacing"), output_dir, num_samples)
    check_samples(module, num_samples)
    if cfg.input is not None and "xray" in module.generation_inputs():
        return from_radiographs(module, run, Path(str(cfg.input)).expanduser(), output_dir, num_samples, device)
    geometry = input_geometry(cfg.get("spacing"), module.training_data, module.refines_resolution)
    run = with_geometry(run, geometry)
    with tempfile.TemporaryDirectory() as scratch:
        inputs = find_inputs(cfg, run, module.generation_inputs(), Path(scratch), geometry)
        refine = check_inputs(inputs, run, module, geometry, output_format)
        window = SlidingWindow.of(
            window_roi(cfg, run), overlap=overlap, mode=str(cfg.mode), batch_size=int(cfg.sw_batch_size), device=device,
        )
        writer = PredictionWriter(output_dir, protected=inputs.protected, output_format=output_format)
        with log_file(output_dir / LOG_FILE):
            log.info("predict: %s on %d subject(s) from %s", cfg.ckpt_path, len(inputs.dataset), inputs.where)
            count = predict_subjects(
                module, inputs, window, writer, num_samples, refine, ["codes"] if cfg.codes else []
            )
            writer.write_metrics()
            writer.write_predictions()
            log.info(summary_line(writer.rows, count, output_dir))
    return mean_metrics(writer.rows)


def predict_subjects(
    module: MedvolModule, inputs: Inputs, window: SlidingWindow, writer: PredictionWriter, num_samples: int,
    refine: bool, extras: Sequence[str],
) -> int:
    """Each subject's outputs, written as they come, under a progress bar; return how many subjects."""
    target_units = intensity_record(module) if inputs.condition_only else None
    with Progress(
        TextColumn("[bold]predict"), BarColumn(), MofNCompleteColumn(), TextColumn("{task.description}"),
        TimeElapsedColumn(), transient=True,
    ) as progress:
        task = progress.add_task("", total=len(inputs.dataset))  # type: ignore[arg-type]
        for batch in batches(inputs.dataset):
            progress.update(task, description=str(batch["subject"][0]))
            with torch.no_grad():
                if inputs.condition_only:
                    batch = with_target_units(batch, target_units)
                    outputs = sampled_outputs(module, batch, num_samples)
                else:
                    outputs = module.predict_volumes(batch, window, extras)
                    if num_samples > 1:
                        outputs = sampled_outputs(module, batch, num_samples, first=outputs)
            writer.write(outputs, on_model_grid(batch) if refine else batch)
            progress.advance(task)
    return len(inputs.dataset)  # type: ignore[arg-type]


def from_radiographs(
    module: MedvolModule, run: DictConfig, source: Path, output_dir: Path, num_samples: int, device: torch.device
) -> dict[str, float]:
    """A CT for each subject of a folder of radiographs (`medvol.run.radiographs`)."""
    check_radiograph_input(source)
    check_output_dir(output_dir, [source])
    with log_file(output_dir / LOG_FILE):
        count = ct_from_radiographs(module, run, source, output_dir, device, num_samples)
        log.info(summary_line([], count, output_dir))
    return {}


def noise_samples(module: MedvolModule, spacing: Any, output_dir: Path, num_samples: int) -> dict[str, float]:
    """`num_samples` volumes from noise alone, for an unconditional generator given no input (`noise_samples`)."""
    with log_file(output_dir / LOG_FILE):
        count = write_noise_samples(module, noise_geometry(spacing, module.training_data), num_samples, output_dir)
        log.info("generated %d sample%s -> %s", count, "s" if count != 1 else "", output_dir)
    return {}


def load_module(run: DictConfig, ckpt_path: str, device: torch.device) -> MedvolModule:
    """The run's model with the checkpoint's weights, in eval mode on `device`; what the family restores from the
    checkpoint itself (`MedvolModule.restoring_settings`: e.g. X-ray-to-CT's earlier stages) over the run's config."""
    checkpoint = check_checkpoint_family(ckpt_path, run.model._target_)
    assert checkpoint is not None
    family = target_class(run.model._target_)
    module: MedvolModule = build_model(
        run.model, **family.restoring_settings(dict(checkpoint.get("hyper_parameters") or {}))
    )
    check_checkpoint_shapes(ckpt_path, module, checkpoint)
    module.on_load_checkpoint(checkpoint)
    module.load_state_dict(checkpoint["state_dict"])
    return module.to(device).eval()


def summary_line(rows: list[dict[str, Any]], count: int, output_dir: Path) -> str:
    """`predicted N subjects -> DIR` and the mean of every per-subject metric."""
    means = [f"{name} {value:.4g}" for name, value in mean_metrics(rows).items()]
    metrics = f"; mean {', '.join(means)}" if means else ""
    return f"predicted {count} subject{'s' if count != 1 else ''} -> {output_dir}{metrics}"


def mean_metrics(rows: list[dict[str, Any]]) -> dict[str, float]:
    """Per metric, the mean over the subjects where it is finite (HD95 is NaN for an empty mask)."""
    names = dict.fromkeys(key for row in rows for key in row if key != "subject")
    means = {}
    for name in names:
        values = [row[name] for row in rows if name in row and math.isfinite(row[name])]
        if values:
            means[name] = sum(values) / len(values)
    return means
