"""predict.py's subjects predicted as one job: the inputs found (`medvol.run.predict_inputs`), this process's share of
them and those not done already (`medvol.run.predict_batch`), each input's header checked against the model, then one
subject at a time read, predicted through the family's `predict_volumes` (sliding windows of the training size where
the forward is volume-to-volume) and written by `PredictionWriter`, the code that writes `test=true` outputs: the
source grid and units, the source header. A subject that fails is its own row in the log; the job goes on.
"""

from __future__ import annotations

import logging
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig

from datamodules.sources.nifti import LABEL_FILE_VALUES
from lightning_modules.base import MedvolModule
from medvol.core.console import log_file
from medvol.core.errors import MedvolError, failure_reason
from medvol.run.generation import (
    check_input_channels,
    check_refinable,
    intensity_record,
    on_model_grid,
    sampled_outputs,
    with_target_units,
)
from medvol.run.predict_batch import (
    LOG_FILE,
    DoneRecords,
    SubjectLog,
    SubjectsFailed,
    checkpoint_identity,
    job_part,
    part_positions,
    peak_memory,
    summary_line,
)
from medvol.run.predict_check import PredictRequest
from medvol.run.predict_config import NO_WINDOW
from medvol.run.predict_inputs import Inputs, find_inputs, subject_batch
from medvol.run.trained_model import mean_metrics
from medvol.volumes.dicom_io import refuse_non_series_subjects
from medvol.volumes.prediction_writer import PredictionWriter
from medvol.volumes.sliding_window import SlidingWindow
from medvol.volumes.volume_reader import check_volume_file

log = logging.getLogger("medvol")

# torchmetrics' SSIM window: a Gaussian of sigma 1.5 (its default) spans int(3.5 * 1.5 + 0.5) * 2 + 1 voxels.
SSIM_GAUSSIAN = 11


def predict_job(
    request: PredictRequest, model: Any, run: DictConfig, checkpoints: Sequence[str], sw_batch_size: int
) -> dict[str, float]:
    """Every subject's outputs written (this job's part of them, those not done already), one at a time; the mean
    per-subject metrics returned."""
    output_dir, device = request.output_dir, request.device
    with tempfile.TemporaryDirectory() as scratch:
        inputs = find_inputs(request, run, model, Path(scratch))
        subjects = [str(record["subject"]) for record in inputs.records]
        num_parts, part_id = job_part(request.num_parts, request.part_id)
        share = part_positions(subjects, num_parts, part_id)
        records = DoneRecords(output_dir, checkpoint_identity(checkpoints))
        done = {i for i in share if records.read(subjects[i])} if request.continue_prediction else set()
        todo = [i for i in share if i not in done]
        refine, problems = check_inputs(inputs, run, model, request.output_format, todo)
        if todo and len(problems) == len(todo) and not done:
            # Not one subject this command could predict: a refusal, before any output.
            raise MedvolError(problems[todo[0]])
        if request.roi is None:
            raise MedvolError(NO_WINDOW)
        window = SlidingWindow.of(request.roi, overlap=request.overlap, mode=request.mode, batch_size=sw_batch_size,
                                  device=device)
        writer = PredictionWriter(
            output_dir, protected=inputs.protected, output_format=request.output_format,
            segment_codes=request.segment_codes,
            channels={key: run.dataset.get(f"{key}_modalities") for key in ("image", "cond")},
            nnunet_names=inputs.nnunet_names,
        )
        with log_file(output_dir / LOG_FILE):
            log.info("predict: %s on %d subject(s) from %s", ", ".join(checkpoints), len(subjects), inputs.where)
            if num_parts > 1:
                log.info("part %d of %d (part_id of num_parts): %d of the %d subjects", part_id, num_parts,
                         len(share), len(subjects))
            if done:
                log.info("%d subject(s) of %d already done in %s: skipped (continue_prediction=false predicts them "
                         "again)", len(done), len(share), output_dir)
            if hasattr(model, "postprocessing"):
                log.info("%s", model.postprocessing_note or model.postprocessing.describe())
            failed = predict_subjects(
                model, inputs, window, writer, request.num_samples, refine, request.extras,
                label_file_values(model), todo, problems, records,
            )
            if failed and len(failed) == len(todo) and not done:
                # Not one subject could be predicted (an output that would replace an input, say): a refusal.
                raise MedvolError(next(iter(failed.values())))
            tables_of_done(writer, records, subjects)
            writer.write_metrics()
            writer.write_predictions()
            log.info(summary_line(writer.rows, len(todo) - len(failed), output_dir, failed, len(todo)))
            log.info(peak_memory(device))
    if failed:
        names = ", ".join(list(failed)[:5]) + (", ..." if len(failed) > 5 else "")
        first, reason = next(iter(failed.items()))
        raise SubjectsFailed(
            f"{len(failed)} of {len(todo)} subjects failed ({names}); listed in {output_dir / LOG_FILE}, every other "
            f"subject written; {first}: {reason}"
        )
    return mean_metrics(writer.rows)


def check_inputs(
    inputs: Inputs, run: DictConfig, module: MedvolModule, output_format: str = "nifti",
    positions: Sequence[int] | None = None,
) -> tuple[bool, dict[int, str]]:
    """Each input's header against the model (a 3D volume of the size the model takes, channels; a coarse scan for a
    model that refines resolution; DICOM series for DICOM outputs), before the first file is written: return whether
    the outputs go on the model's grid (refined), and per position of `inputs.records` (those of `positions`, default
    all) that fails, its one-line reason."""
    generation = module.generation_inputs()
    image_channels = len(run.dataset.image_modalities) if run.dataset.get("image_modalities") is not None else None
    expected = {**({"image": image_channels} if image_channels and not inputs.condition_only else {}), **generation}
    refine = inputs.condition_only and module.refines_resolution
    smallest = smallest_input(module)
    problems = {}
    for position in range(len(inputs.records)) if positions is None else positions:
        record = [inputs.records[position]]
        try:
            check_input_sizes(inputs, smallest, record)
            check_input_channels(record, expected, inputs.where)
            if output_format == "dicom":
                refuse_non_series_subjects(record)
            if refine:
                for key in generation:
                    check_refinable(record, key, inputs.geometry, inputs.where)
        except Exception as err:  # noqa: BLE001 - a file no reader can open is that subject's failure, in one line
            problems[position] = failure_reason(err)
    return refine, problems


def check_input_sizes(
    inputs: Inputs, smallest: tuple[tuple[int, int, int], str] | None = None,
    records: Sequence[Mapping[str, Any]] | None = None,
) -> None:
    """Input files' headers (those of `records`, default every input), before the first output is written: a 3D
    volume holding all its voxels, within the memory budget as read and on the grid its dataset resamples it to (a
    header of 10^12 voxels, or of few voxels 120 mm wide), and on that grid at least `smallest` ((D, H, W), why) where
    the model needs as many."""
    transforms = inputs.config.get("transforms") or {}
    spacing, orientation = transforms.get("spacing"), transforms.get("orientation")
    for record in inputs.records if records is None else records:
        for path in (record.get("files") or {}).values():
            if path is not None:
                check_volume_file(path, spacing, orientation, inputs.config.get("series"), smallest)


def smallest_input(module: MedvolModule) -> tuple[tuple[int, int, int], str] | None:
    """The fewest voxels per axis (D, H, W) a whole volume needs in `module` at predict, and why; None where any size
    goes (the sliding window pads a volume smaller than its window: the network itself takes every size).

    A family that scores each subject by SSIM on the whole volume (`ssim_kernel_size`, torchmetrics' Gaussian SSIM)
    needs its window to fit: torchmetrics reflects half its 11-voxel Gaussian at each edge of D and H (more voxels
    than that), and along W only half of `ssim_kernel_size`, where the padded axis must still span the Gaussian."""
    kernel = (getattr(module, "hparams", None) or {}).get("ssim_kernel_size")
    if not kernel:
        return None
    half = int(kernel) // 2
    sizes = (SSIM_GAUSSIAN // 2 + 1, SSIM_GAUSSIAN // 2 + 1, max(half + 1, SSIM_GAUSSIAN - 2 * half))
    return sizes, f"its per-subject SSIM's {SSIM_GAUSSIAN}-voxel Gaussian window, ssim_kernel_size {int(kernel)}"


def label_file_values(module: MedvolModule) -> list[int] | None:
    """Per label value a segmentation model writes (0..K-1), the value its training files used, where its dataset
    changed them on loading (BraTS 2021's enhancing tumour: 3 in the model, 4 in the files; the checkpoint's
    `training_data` records it); None where they are the model's own."""
    changed = (module.training_data or {}).get(LABEL_FILE_VALUES)
    scheme = getattr(module, "scheme", None)
    if not changed or scheme is None:
        return None
    return [int(changed.get(str(value), value)) for value in range(scheme.num_classes)]


def predict_subjects(
    module: Any, inputs: Inputs, window: SlidingWindow, writer: PredictionWriter, num_samples: int,
    refine: bool, extras: Sequence[str], label_values: list[int] | None = None, positions: Sequence[int] | None = None,
    problems: Mapping[int, str] | None = None, records: DoneRecords | None = None,
) -> dict[str, str]:
    """The outputs of the subjects at `positions` of `inputs` (default all), each written as it comes and, with
    `records`, marked done; one log line per subject with the time left. A subject that fails (its reason in
    `problems` already, or an error while it is read, predicted or written) is logged and left for the next: return
    the failed subjects and why. Masks of subjects whose batch does not say its files' label values (input files) are
    written with `label_values`."""
    positions = range(len(inputs.records)) if positions is None else positions
    problems = problems or {}
    progress = SubjectLog(len(positions))
    failed: dict[str, str] = {}
    for position in positions:
        subject = str(inputs.records[position]["subject"])
        problem = problems.get(position)
        if problem is None:
            try:
                predict_subject(module, inputs, position, window, writer, num_samples, refine, extras, label_values,
                                records)
            except Exception as err:  # noqa: BLE001 - one subject's failure is its row; the job goes on
                problem = failure_reason(err)
                log.debug("%s failed", subject, exc_info=True)
        if problem is not None:
            failed[subject] = problem
        log.info(progress.line(subject, problem))
    return failed


def predict_subject(
    module: Any, inputs: Inputs, position: int, window: SlidingWindow, writer: PredictionWriter, num_samples: int,
    refine: bool, extras: Sequence[str], label_values: list[int] | None, records: DoneRecords | None,
) -> None:
    """One subject's outputs written, then (with `records`) its record: the subject is done."""
    batch = subject_batch(inputs.dataset, position)
    with torch.no_grad():
        if inputs.condition_only:
            batch = with_target_units(batch, intensity_record(module))
            outputs = sampled_outputs(module, batch, num_samples)
        else:
            outputs = module.predict_volumes(batch, window, extras)
            if num_samples > 1:
                outputs = sampled_outputs(module, batch, num_samples, first=outputs)
    if label_values is not None and batch.get("label_values") is None:
        batch = {**batch, "label_values": torch.tensor([label_values] * len(batch["subject"]))}
    rows, predictions = len(writer.rows), len(writer.prediction_rows)
    files = writer.write(outputs, on_model_grid(batch) if refine else batch)
    if records is not None:
        records.write(str(batch["subject"][0]), files, writer.rows[rows:], writer.prediction_rows[predictions:],
                      writer.structures)


def tables_of_done(writer: PredictionWriter, records: DoneRecords, subjects: Sequence[str]) -> None:
    """The writer's table rows made those of every done subject of the job (this run's, earlier runs', other
    parts'), so metrics.csv, predictions.csv and the report list them all."""
    rows: list[dict[str, Any]] = []
    predictions: list[dict[str, Any]] = []
    structures = list(writer.structures)
    for subject in subjects:
        record = records.read(subject)
        if record is None:
            continue
        rows += [row for row in record.get("metrics") or [] if isinstance(row, dict)]
        predictions += [row for row in record.get("predictions") or [] if isinstance(row, dict)]
        structures += [str(name) for name in record.get("structures") or []]
    writer.rows, writer.prediction_rows = rows, predictions
    writer.structures = list(dict.fromkeys(structures))
