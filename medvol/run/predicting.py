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
import resource
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf

from datamodules.sources.nifti import LABEL_FILE_VALUES
from lightning_modules.base import MedvolModule
from lightning_modules.segmentation.postprocessing import postprocessing_switch
from medvol.core.checkpoint_read import TRUST_KEY, checkpoints_trusted
from medvol.core.console import log_file
from medvol.core.errors import MedvolError
from medvol.run.ensemble import Ensemble, same_preprocessing
from medvol.run.fold_records import applied_postprocessing, fold_checkpoints, read_volume_range
from medvol.run.generation import intensity_record, on_model_grid, sampled_outputs, with_target_units
from medvol.run.inference_preflight import plan_inference
from medvol.run.noise_samples import noise_geometry, write_noise_samples
from medvol.run.predict_batch import (
    DoneRecords,
    SubjectLog,
    SubjectsFailed,
    checkpoint_identity,
    failure_reason,
    job_part,
    part_positions,
)
from medvol.run.predict_check import (
    PredictRequest,
    autocast_for,
    check_inputs,
    check_radiograph_input,
    check_samples,
    predict_request,
    window_roi,
)
from medvol.run.predict_config import input_geometry, with_geometry
from medvol.run.predict_inputs import Inputs, check_output_dir, find_inputs, subject_batch
from medvol.run.radiographs import ct_from_radiographs
from medvol.run.resolvers import run_dir_of_checkpoint
from medvol.run.trained_model import mean_metrics
from medvol.run.trained_run import open_trained_run
from medvol.volumes.prediction_writer import PredictionWriter
from medvol.volumes.sliding_window import SlidingWindow

log = logging.getLogger("medvol")
# Beside the outputs, as train.py writes train.log in its run: what the console showed (predict.py logs to
# stdout) plus the library warnings the console drops.
LOG_FILE = "predict.log"


def predict(cfg: DictConfig) -> dict[str, float]:
    """Predict every subject the config names and write the outputs; return the mean per-subject metrics.

    Checkpoints are read as data unless this command says `trust_checkpoints=true`; the run's own config
    never grants it."""
    with checkpoints_trusted(cfg.get(TRUST_KEY, False)):
        return _predicted(cfg)


def _predicted(cfg: DictConfig) -> dict[str, float]:
    checkpoints, decided_in = member_checkpoints(cfg)
    trained = open_trained_run(checkpoints[0], cfg.get("model"))
    run = trained.config
    request = predict_request(cfg, run)
    module = trained.module(request.device)
    if hasattr(module, "progress"):
        # A generative model logs its walk (steps, windows) and its decoding (slabs) as it goes.
        module.progress = True
    predictor = segmentation_predictor(cfg, module, run, checkpoints, decided_in, request.device)
    # The window batches and the decoder slab from the predicted peak of a call, before any subject is read (an
    # ensemble's members are called one after the other: the first stands for them).
    plan = plan_inference(cfg, module, lambda: window_roi(request.roi, run), request.device, request.precision)
    if plan.named:
        # `preflight=<card>`: the plan for that card, nothing read or written.
        return {}
    plan.apply(module)
    with autocast_for(request.precision, request.device):
        if request.from_noise:
            return noise_samples(module, request.spacing, request.output_dir, request.num_samples, request.device)
        check_samples(module, request.num_samples)
        if request.source is not None and "xray" in module.generation_inputs():
            return from_radiographs(module, run, request.source, request.output_dir, request.num_samples,
                                    request.device)
        # The inputs the command names (a file, a folder, a split or a dataset), read at the model's geometry.
        geometry = input_geometry(request.spacing, module.training_data, module.refines_resolution)
        run = with_geometry(run, geometry)
        return _outputs(cfg, module, predictor, run, checkpoints, request, geometry, plan.sw_batch_size)


def _outputs(
    cfg: DictConfig, module: MedvolModule, predictor: Any, run: DictConfig, checkpoints: list[str],
    request: PredictRequest, geometry: dict[str, Any], sw_batch_size: int,
) -> dict[str, float]:
    """Every subject's outputs written (this job's part of them, those not done already), one at a time."""
    output_dir, device = request.output_dir, request.device
    with tempfile.TemporaryDirectory() as scratch:
        inputs = find_inputs(cfg, run, module.generation_inputs(), Path(scratch), geometry)
        subjects = [str(record["subject"]) for record in inputs.records]
        num_parts, part_id = job_part(request.num_parts, request.part_id)
        share = part_positions(subjects, num_parts, part_id)
        records = DoneRecords(output_dir, checkpoint_identity(checkpoints))
        done = {i for i in share if records.read(subjects[i])} if request.continue_prediction else set()
        todo = [i for i in share if i not in done]
        refine, problems = check_inputs(inputs, run, module, geometry, request.output_format, todo)
        if todo and len(problems) == len(todo) and not done:
            # Not one subject this command could predict: a refusal, before any output.
            raise MedvolError(problems[todo[0]])
        window = SlidingWindow.of(
            window_roi(request.roi, run), overlap=request.overlap, mode=request.mode, batch_size=sw_batch_size,
            device=device,
        )
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
            if hasattr(module, "postprocessing"):
                log.info("%s", module.postprocessing_note or module.postprocessing.describe())
            failed = predict_subjects(
                predictor, inputs, window, writer, request.num_samples, refine, request.extras,
                label_file_values(module), todo, problems, records,
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


def member_checkpoints(cfg: DictConfig) -> tuple[list[str], Path | None]:
    """The checkpoints to predict with (one, or an ensemble's) and the folder whose post-processing applies:
    `run_dir` (a fold sweep: each fold's validated checkpoint, the sweep's decision), or `ckpt_path` (one path or
    a list; a single run's own decision)."""
    run_dir, ckpt = cfg.get("run_dir"), cfg.get("ckpt_path")
    if run_dir is not None and ckpt is not None:
        raise MedvolError("`run_dir` and `ckpt_path` are both set; give one: a fold sweep's folder or checkpoints")
    if run_dir is not None:
        folder = Path(str(run_dir)).expanduser()
        if not folder.is_dir():
            raise MedvolError(f"`run_dir`: no folder at {folder}; expected a fold sweep's folder (-m dataset.fold=...)")
        return fold_checkpoints(folder), folder
    if ckpt is None:
        raise MedvolError(
            "`ckpt_path` is not set; expected a checkpoint of a medvol run (<run>/checkpoints/last.ckpt), a list of "
            "them, or run_dir=<sweep> for a cross-validation's folds"
        )
    paths = [str(p) for p in ckpt] if OmegaConf.is_list(ckpt) else [str(ckpt)]
    if not paths:
        raise MedvolError("`ckpt_path` is an empty list; expected one checkpoint or several")
    return paths, None


def segmentation_predictor(
    cfg: DictConfig, module: MedvolModule, run: DictConfig, checkpoints: list[str], decided_in: Path | None,
    device: torch.device,
) -> Any:
    """The model that predicts: `module`, or for several checkpoints their ensemble; for segmentation with the
    command's `tta` and the post-processing recorded for the run (or for the sweep, for its folds) as the command's
    `postprocessing` (null: the model's `postprocessing`, auto by default) lets it apply."""
    if cfg.get("tta") is not None and hasattr(module, "tta"):
        module.tta = bool(cfg.tta)
    if not hasattr(module, "probabilities"):
        if len(checkpoints) > 1 or (cfg.get("tta") is not None and not hasattr(module, "tta")) or cfg.get(
                "save_probabilities") or cfg.get("postprocessing") is not None:
            raise MedvolError(
                "several checkpoints (`ckpt_path=[...]`, `run_dir`), `tta`, `postprocessing` and `save_probabilities` "
                f"apply to segmentation (`tta` also to survival); {checkpoints[0]} is a {type(module).__name__}"
            )
        return module
    if decided_in is None:
        decided_in = run_dir_of_checkpoint(checkpoints[0])
    given = cfg.get("postprocessing")
    switch = postprocessing_switch(
        module.hparams.get("postprocessing", "auto") if given is None else given,
        "postprocessing" if given is not None else "model.postprocessing",
    )
    module.postprocessing, module.postprocessing_note = applied_postprocessing(
        decided_in, switch, module.postprocessing
    )
    own = run_dir_of_checkpoint(checkpoints[0])
    module.volume_range = read_volume_range(own) if own is not None else {}
    if len(checkpoints) == 1:
        return module
    others = [open_trained_run(c, cfg.get("model")) for c in checkpoints[1:]]
    same_preprocessing([run, *(other.config for other in others)], checkpoints)
    members = [module, *(other.module(device) for other in others)]
    return Ensemble(members)


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


def from_radiographs(
    module: MedvolModule, run: DictConfig, source: Path, output_dir: Path, num_samples: int, device: torch.device
) -> dict[str, float]:
    """A CT for each subject of a folder of radiographs (`medvol.run.radiographs`)."""
    check_radiograph_input(source)
    check_output_dir(output_dir, [source])
    with log_file(output_dir / LOG_FILE):
        count = ct_from_radiographs(module, run, source, output_dir, device, num_samples)
        log.info(summary_line([], count, output_dir))
        log.info(peak_memory(device))
    return {}


def noise_samples(
    module: MedvolModule, spacing: Any, output_dir: Path, num_samples: int, device: torch.device
) -> dict[str, float]:
    """`num_samples` volumes from noise alone, for an unconditional generator given no input (`noise_samples`)."""
    with log_file(output_dir / LOG_FILE):
        count = write_noise_samples(module, noise_geometry(spacing, module.training_data), num_samples, output_dir)
        log.info("generated %d sample%s -> %s", count, "s" if count != 1 else "", output_dir)
        log.info(peak_memory(device))
    return {}


def peak_memory(device: torch.device) -> str:
    """The most memory the prediction held: on a GPU its allocated peak, else the process's peak resident set."""
    if device.type == "cuda":
        return f"peak GPU memory: {torch.cuda.max_memory_allocated(device) / 2**30:.2f} GiB"
    return f"peak host memory: {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20:.2f} GiB"


def summary_line(
    rows: list[dict[str, Any]], count: int, output_dir: Path, failed: Mapping[str, str] | None = None,
    total: int | None = None,
) -> str:
    """`predicted N subjects -> DIR` (`N of M` where some of the `total` failed), the mean of every per-subject metric,
    and a line per failed subject with its reason."""
    means = [f"{name} {value:.4g}" for name, value in mean_metrics(rows).items()]
    metrics = f"; mean {', '.join(means)}" if means else ""
    failed = failed or {}
    total = count if total is None else total
    counted = f"{count} of {total}" if failed else str(count)
    lines = [f"predicted {counted} subject{'s' if total != 1 else ''} -> {output_dir}{metrics}"]
    if failed:
        lines[0] += f"; {len(failed)} failed:"
        lines += [f"  failed: {subject}: {reason}" for subject, reason in failed.items()]
    return "\n".join(lines)
