"""predict.py's checks in one place: the command's values, the model's kind and the inputs' headers are checked
before the first file is written, each refusal one line naming the key and what was expected. A bad value of the
command stops it; an input the model cannot take is that subject's failure (`check_inputs`)."""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf

from lightning_modules.base import MedvolModule, class_path
from medvol.core.build import target_class
from medvol.core.errors import MedvolError
from medvol.run.generation import check_input_channels, check_refinable
from medvol.run.predict_batch import failure_reason
from medvol.run.predict_config import window_size
from medvol.run.predict_inputs import Inputs
from medvol.volumes.dicom_io import refuse_non_series_subjects
from medvol.volumes.prediction_writer import check_output_format
from medvol.volumes.sliding_window import BLEND_MODES
from medvol.volumes.volume_reader import check_volume_file

SPLITS = ("train", "val", "test")
DEFAULT_OVERLAP = 0.25
# torchmetrics' SSIM window: a Gaussian of sigma 1.5 (its default) spans int(3.5 * 1.5 + 0.5) * 2 + 1 voxels.
SSIM_GAUSSIAN = 11


# The outputs beside each subject's main one, by the command key that asks for them.
EXTRAS = {"codes": "codes", "probabilities": "save_probabilities"}


@dataclass(frozen=True)
class PredictRequest:
    """What the command asks of predict.py, checked and typed once, before the model is built (the job's part, checked
    with the subjects it splits, by `predict_batch.job_part`): every later stage reads these values rather than the
    command's config (only the inputs' search reads it, for the dataset it names)."""

    output_dir: Path
    output_format: str
    device: torch.device
    precision: str
    overlap: float
    mode: str
    roi: list[int] | None
    num_samples: int
    from_noise: bool
    source: Path | None
    spacing: Any
    num_parts: Any
    part_id: Any
    continue_prediction: bool
    segment_codes: dict[str, Any] | None
    extras: tuple[str, ...]


def predict_request(cfg: DictConfig, run: DictConfig) -> PredictRequest:
    """The command's values checked against the run (`check_predict`, the output format, the device, the precision,
    the window): one line and exit 2 for the first that is wrong."""
    overlap = check_predict(cfg, run)
    device = pick_device(str(cfg.device))
    codes = OmegaConf.to_container(cfg.segment_codes) if cfg.get("segment_codes") else None
    return PredictRequest(
        output_dir=Path(str(cfg.output_dir)).expanduser(),
        output_format=check_output_format(str(cfg.get("output_format", "nifti"))),
        device=device,
        precision=pick_precision(cfg.get("precision", "auto"), device, named=bool(cfg.get("preflight"))),
        overlap=overlap,
        mode=str(cfg.mode),
        roi=window_roi(cfg.roi, run) if cfg.get("roi") is not None else None,
        num_samples=int(cfg.get("num_samples", 1)),
        from_noise=from_noise(cfg),
        source=Path(str(cfg.input)).expanduser() if cfg.input is not None else None,
        spacing=cfg.get("spacing"),
        num_parts=cfg.get("num_parts"),
        part_id=cfg.get("part_id"),
        continue_prediction=bool(cfg.get("continue_prediction", True)),
        segment_codes=codes if isinstance(codes, dict) else None,
        extras=tuple(name for name, key in EXTRAS.items() if cfg.get(key)),
    )


def check_predict(cfg: DictConfig, run: DictConfig) -> float:
    """Refuse a bad `mode`, `overlap`, `split`, `num_samples` or a command naming no input; return the overlap:
    the model's own validation overlap where it has one (segmentation), so predict.py sees what test=true saw."""
    if cfg.mode not in BLEND_MODES:
        raise MedvolError(f"`mode` is {cfg.mode!r}; expected one of {list(BLEND_MODES)}")
    overlap = float(cfg.overlap if cfg.overlap is not None else run.model.get("overlap", DEFAULT_OVERLAP))
    if not 0.0 <= overlap < 1.0:
        raise MedvolError(f"`overlap` must be in [0, 1), got {overlap}")
    if cfg.split is not None and cfg.split not in SPLITS:
        raise MedvolError(f"`split` is {cfg.split!r}; expected one of {list(SPLITS)} or null")
    num_samples = cfg.get("num_samples", 1)
    if not isinstance(num_samples, int) or isinstance(num_samples, bool) or num_samples < 1:
        raise MedvolError(f"`num_samples` is {num_samples!r}; expected a whole number >= 1")
    if from_noise(cfg) and not target_class(run.model._target_).generates_from_noise(run.model):
        raise MedvolError(
            "`input` is not set; expected a NIfTI file, a folder of them, `split=test` for the run's test split, "
            "or a dataset (`dataset=nifti dataset.root=DIR`)"
        )
    return overlap


def from_noise(cfg: DictConfig) -> bool:
    """Whether the command names no input at all (no `input`, `split` or `dataset`): an unconditional generator
    (model=ldm) then writes `num_samples` volumes from noise alone."""
    return cfg.input is None and cfg.split is None and not cfg.get("dataset")


def pick_device(name: str) -> torch.device:
    """The device `device=` names: auto (the first GPU, else the CPU), cpu, cuda or cuda:N."""
    if name == "auto":
        if not torch.cuda.is_available():
            return torch.device("cpu")
        # Under torchrun each process predicts its share (`num_parts` from WORLD_SIZE) on its own GPU.
        local_rank = os.environ.get("LOCAL_RANK", "")
        return torch.device(f"cuda:{int(local_rank) % torch.cuda.device_count()}" if local_rank.isdigit() else "cuda")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise MedvolError(f"`device`: {name!r} was asked for, but no CUDA device is visible; use device=cpu or auto")
    if not (name == "cpu" or name.startswith("cuda")):
        raise MedvolError(f"`device` is {name!r}; expected auto, cpu, cuda or cuda:N")
    return torch.device(name)


PRECISIONS = ("auto", "32", "bf16")


def pick_precision(value: Any, device: torch.device, named: bool = False) -> str:
    """The precision `precision=` gives the networks on `device`: `32` or `bf16` (autocast); auto: bf16 on a GPU that
    has it, or for a card `preflight=` names (`named`: every card listed has it), else float32."""
    text = str(value)
    if text not in PRECISIONS:
        raise MedvolError(f"`precision` is {value!r}; expected auto, 32 or bf16")
    if text != "auto":
        return text
    return "bf16" if named or (device.type == "cuda" and torch.cuda.is_bf16_supported()) else "32"


def autocast_for(precision: str, device: torch.device) -> AbstractContextManager:
    """The networks' calls under `precision`: bf16 autocast on `device`'s kind, or nothing."""
    return torch.autocast(device.type, dtype=torch.bfloat16) if precision == "bf16" else nullcontext()


def check_samples(module: MedvolModule, num_samples: int) -> None:
    """Several samples only from a generative model (one that names the batch keys it generates from)."""
    if num_samples > 1 and not module.generation_inputs():
        raise MedvolError(
            f"`num_samples`={num_samples}: {class_path(module)} is not generative (its outputs are not samples); "
            "use num_samples=1"
        )


def check_radiograph_input(source: Path) -> None:
    """A model that generates a CT from radiographs reads a folder of them."""
    if not source.is_dir():
        raise MedvolError(
            f"`input`: {source} is not a folder; the model generates a CT from radiographs, expected a folder of "
            "<subject>_ap.nii.gz and <subject>_lateral.nii.gz files"
        )


def check_inputs(
    inputs: Inputs, run: DictConfig, module: MedvolModule, geometry: Mapping[str, Any], output_format: str = "nifti",
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
                    check_refinable(record, key, geometry, inputs.where)
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


def window_roi(roi: Sequence[int] | None, run: DictConfig) -> list[int]:
    """The sliding window: `roi=[D,H,W]` (`roi`), or the run's training patch or volume size."""
    roi = list(roi) if roi is not None else window_size(run)
    if len(roi) != 3 or min(int(r) for r in roi) < 1:
        raise MedvolError(f"`roi` is {roi}; expected three positive window sizes [D, H, W] or null")
    return roi
