"""predict.py's command read once: every value the later stages use checked and typed into one `PredictRequest`,
against the opened run (`medvol.run.trained_run`), before the model is built; each refusal one line naming the key and
what was expected. No later stage reads the command's config."""

from __future__ import annotations

import os
from collections.abc import Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf

from medvol.core.build import target_class
from medvol.core.errors import MedvolError
from medvol.run.predict_config import own_window, window_size
from medvol.run.settings_bounds import AUTO, PredictSizes, check_predict_sizes
from medvol.volumes.prediction_writer import check_output_format
from medvol.volumes.sliding_window import BLEND_MODES

SPLITS = ("train", "val", "test")
DEFAULT_OVERLAP = 0.25


# The outputs beside each subject's main one, by the command key that asks for them.
EXTRAS = {"codes": "codes", "probabilities": "save_probabilities"}


@dataclass(frozen=True)
class PredictRequest:
    """What the command asks of predict.py, checked and typed once against the opened run, before the model is built
    (the job's part is checked with the subjects it splits, by `predict_batch.job_part`; the spacing with the inputs'
    geometry, by `predict_config.input_geometry`): every later stage reads these values, never the command's config.

    `roi` is the sliding window (`roi=[D,H,W]` or the run's training size; None where the run names none), `sizes`
    the window batches and decoder slab (`auto` or a number), `card` the GPU `preflight=` names (None: the device's
    own), `dataset` the command's `dataset=...` (None: the run's)."""

    output_dir: Path
    output_format: str
    device: torch.device
    precision: str
    overlap: float
    mode: str
    roi: list[int] | None
    sizes: PredictSizes
    card: str | None
    num_samples: int
    from_noise: bool
    source: Path | None
    split: str | None
    dataset: DictConfig | None
    keep_crop: bool
    series: str | None
    covariates: Path | None
    spacing: Any
    num_parts: Any
    part_id: Any
    continue_prediction: bool
    segment_codes: dict[str, Any] | None
    extras: tuple[str, ...]
    tta: bool | None
    postprocessing: Any
    save_probabilities: bool


def predict_request(cfg: DictConfig, run: DictConfig) -> PredictRequest:
    """The command's values checked against the run (`check_predict`, the output format, the device, the precision,
    the window and its batches): one line and exit 2 for the first that is wrong."""
    overlap = check_predict(cfg, run)
    device = pick_device(str(cfg.device))
    codes = OmegaConf.to_container(cfg.segment_codes) if cfg.get("segment_codes") else None
    card = cfg.get("preflight")
    sizes = check_predict_sizes({key: cfg.get(key, AUTO) for key in PredictSizes.model_fields}, "predict.py")
    dataset, covariates = cfg.get("dataset"), cfg.get("covariates")
    return PredictRequest(
        output_dir=Path(str(cfg.output_dir)).expanduser(),
        output_format=check_output_format(str(cfg.get("output_format", "nifti"))),
        device=device,
        precision=pick_precision(cfg.get("precision", "auto"), device, named=bool(card)),
        overlap=overlap,
        mode=str(cfg.mode),
        roi=window_roi(cfg.roi, run) if cfg.get("roi") is not None else own_window(run),
        sizes=sizes,
        card=str(card) if card else None,
        num_samples=int(cfg.get("num_samples", 1)),
        from_noise=from_noise(cfg),
        source=Path(str(cfg.input)).expanduser() if cfg.input is not None else None,
        split=str(cfg.split) if cfg.split is not None else None,
        dataset=dataset if dataset else None,
        keep_crop=switch(cfg, "keep_crop", False),
        series=str(cfg.series) if cfg.get("series") is not None else None,
        covariates=Path(str(covariates)).expanduser() if covariates else None,
        spacing=cfg.get("spacing"),
        num_parts=cfg.get("num_parts"),
        part_id=cfg.get("part_id"),
        continue_prediction=switch(cfg, "continue_prediction", True),
        segment_codes=codes if isinstance(codes, dict) else None,
        extras=tuple(name for name, key in EXTRAS.items() if cfg.get(key)),
        tta=switch(cfg, "tta", None),
        postprocessing=cfg.get("postprocessing"),
        save_probabilities=switch(cfg, "save_probabilities", False),
    )


def switch(cfg: DictConfig, key: str, default: bool | None) -> bool | None:
    """`key` as true or false (or null where its default is null), refused in one line otherwise."""
    value = cfg.get(key, default)
    if value is None and default is None:
        return None
    if not isinstance(value, bool):
        allowed = "true, false or null" if default is None else "true or false"
        raise MedvolError(f"`{key}` is {value!r}; expected {allowed}")
    return value


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


def window_roi(roi: Sequence[int] | None, run: DictConfig) -> list[int]:
    """The sliding window: `roi=[D,H,W]` (`roi`), or the run's training patch or volume size."""
    roi = list(roi) if roi is not None else window_size(run)
    if len(roi) != 3 or min(int(r) for r in roi) < 1:
        raise MedvolError(f"`roi` is {roi}; expected three positive window sizes [D, H, W] or null")
    return roi
