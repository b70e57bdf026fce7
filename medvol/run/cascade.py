"""Progressive cascades as one command: train stage 1, then stage 2 from stage 1's best weights, and so on.

A config with a `cascade` node (see `conf/experiment/xray2ct_cascade.yaml`) runs each listed
stage as an ordinary medvol run in `<run>/stage<k>/`, with the stage's own settings merged over
the job's config (`cascade.stage<k>`: epochs, learning rate, batch size, volume size, ...).
Stage k gets the best checkpoints of stages 1..k-1 (`model.previous_stages`) and starts from
stage k-1's best weights (`model.init_from`); `cascade.handoff` names other keys for these, or
hands stage k-1's best checkpoint to one key alone (`experiment=ldm_cpu`: the VQ-GAN's to the
latent model's `model.first_stage_ckpt`). A stage's `model` naming another `_target_` replaces the
job's model (a VQ-GAN stage, then a latent diffusion stage). Each finished stage's best checkpoint is copied
to `<run>/stage<k>/best.ckpt`, which later stages read and nothing overwrites.

- `ckpt_path=<run>/stage<k>/checkpoints/last.ckpt` resumes stage k in its folder, then goes on
  with the later stages.
- `cascade.stages=[2] cascade.from_run=<run>` runs stage 2 alone, with stage 1 from that run.
"""

from __future__ import annotations

import json
import logging
import re
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf, open_dict

from medvol.core.build import target_class
from medvol.core.checkpoint_read import load_checkpoint
from medvol.core.errors import MedvolError

log = logging.getLogger("medvol")
STAGE_DIR = re.compile(r"stage(\d+)")


def stage_of_checkpoint(ckpt_path: str | None) -> tuple[Path, int] | None:
    """(cascade run dir, stage) for `<run>/stage<k>/checkpoints/<file>`, else None."""
    if not ckpt_path:
        return None
    stage_dir = Path(str(ckpt_path)).expanduser().resolve().parent.parent
    match = STAGE_DIR.fullmatch(stage_dir.name)
    return (stage_dir.parent, int(match.group(1))) if match else None


def best_checkpoint(stage_dir: Path) -> tuple[Path, float | None]:
    """The best checkpoint a finished stage recorded in its last.ckpt, copied to `stage_dir/best.ckpt`, and its
    score by the monitored metric (None where none was recorded)."""
    target = stage_dir / "best.ckpt"
    last = stage_dir / "checkpoints" / "last.ckpt"
    if not last.is_file():
        if target.is_file():
            return target, None
        raise MedvolError(f"cascade: {stage_dir} has no checkpoints/last.ckpt; the stage did not finish an epoch")
    state = load_checkpoint(last, "cascade", "a stage's checkpoints/last.ckpt written by medvol")
    # A checkpoint callback's state is found by its content, not its class name: subclasses of
    # ModelCheckpoint (medvol's StepCheckpoint) store theirs under their own name.
    best, score = next(
        ((s["best_model_path"], s.get("best_model_score")) for s in state.get("callbacks", {}).values()
         if isinstance(s, dict) and s.get("monitor") and s.get("best_model_path")),
        (None, None),
    )
    found = bool(best) and Path(best).is_file()
    if best and not found:
        # Handing on last.ckpt instead would give the next stage weights other than the ones validation chose.
        raise MedvolError(
            f"cascade: stage {stage_dir.name}'s best checkpoint {best} (recorded in {last}) does not exist; "
            "restore it, or re-run the stage"
        )
    if not best:
        log.info("cascade: %s recorded no best checkpoint (no monitored metric): handing on %s", stage_dir.name, last)
    source = Path(best) if found else last
    shutil.copyfile(source, target.with_suffix(".tmp"))
    target.with_suffix(".tmp").replace(target)
    return target, float(score) if found and score is not None else None


# Where the runner writes what stage k gets from the earlier stages (`cascade.handoff`; a null key: not given):
# its number, the best checkpoints of stages 1..k-1, stage k-1's best to start from (not when resuming), and
# stage k-1's best always (a latent model's first stage). The defaults are a progressive cascade's (X-ray-to-CT).
HANDOFF = {"stage": "model.stage", "previous_stages": "model.previous_stages", "init_from": "model.init_from",
           "previous_best": None}


def handoff_keys(cfg: DictConfig) -> dict[str, str | None]:
    given = cfg.cascade.get("handoff") or {}
    unknown = sorted(set(given) - set(HANDOFF))
    if unknown:
        raise MedvolError(f"`cascade.handoff.{unknown[0]}` is not a hand-off; expected some of {sorted(HANDOFF)}")
    return {**HANDOFF, **{k: (None if v is None else str(v)) for k, v in given.items()}}


def with_stage_settings(cfg: DictConfig, settings: DictConfig) -> DictConfig:
    """`cfg` with a stage's settings merged on top; a stage `model` naming another `_target_` replaces the model."""
    model = settings.get("model")
    replaces = model is not None and model.get("_target_") not in (None, cfg.model.get("_target_"))
    merged = OmegaConf.merge(cfg, {k: v for k, v in settings.items() if not (replaces and k == "model")})
    if replaces:
        with open_dict(merged):
            merged.model = model
    assert isinstance(merged, DictConfig)
    return merged


def _stage_config(cfg: DictConfig, stage: int, stage_dir: Path, ckpt_path: str | None) -> DictConfig:
    settings = cfg.cascade.get(f"stage{stage}")
    if settings is None:
        raise MedvolError(f"`cascade.stages` lists stage {stage} but `cascade.stage{stage}` is not configured")
    handoff = handoff_keys(cfg)
    stage_cfg = with_stage_settings(cfg, settings)
    with open_dict(stage_cfg):
        del stage_cfg["cascade"]
        stage_cfg.paths.output_dir = str(stage_dir)
        if handoff["stage"]:
            OmegaConf.update(stage_cfg, handoff["stage"], stage, force_add=True)
        if handoff["previous_best"] and stage > 1:
            # Known once stage k-1 has finished; its settings are checked then (null passes the config checks).
            OmegaConf.update(stage_cfg, handoff["previous_best"], None, force_add=True)
        stage_cfg.ckpt_path = ckpt_path
        # One split for the whole cascade: every stage trains and validates on the same subjects.
        if "split_file" in stage_cfg.dataset:
            stage_cfg.dataset.split_file = str(stage_dir.parent / "split.json")
    return stage_cfg


def _check_sizes(cfg: DictConfig, stages: list[int]) -> None:
    sizes = []
    for stage in stages:
        settings = cfg.cascade.get(f"stage{stage}") or {}
        size = with_stage_settings(cfg, settings).model.get("size")
        if size is None:
            return  # stages that do not grow a volume (an autoencoder, then a model of its latents)
        sizes.append([int(size)] * 3 if isinstance(size, int) else [int(s) for s in size])
    pairs = list(zip(stages, sizes, strict=True))
    for (a, size_a), (b, size_b) in zip(pairs, pairs[1:], strict=False):
        if any(y <= x for x, y in zip(size_a, size_b, strict=True)):
            raise MedvolError(
                f"`cascade.stage{b}` volume size {size_b} does not grow from stage {a}'s {size_a}; "
                "each stage must be larger on every axis"
            )


def run_cascade(
    cfg: DictConfig, run_stage: Callable[[DictConfig], dict[str, float]], check_stage: Callable[[DictConfig], Any]
) -> dict[str, float]:
    """Run the stages that `cfg.cascade.stages` lists, in order; return every stage's metrics, prefixed `stage<k>/`.

    Every stage's config is checked (`check_stage`) before the first stage starts, so a bad value in
    stage 3 stops the command before stage 1 trains.
    """
    root, stages, resume_stage = stages_to_run(cfg)
    _check_sizes(cfg, sorted(int(s) for s in cfg.cascade.stages))
    previous = earlier_best_checkpoints(cfg, root, stages[0])
    stage_configs = {}
    for stage in stages:
        ckpt_path = cfg.ckpt_path if stage == resume_stage else None
        stage_configs[stage] = _stage_config(cfg, stage, root / f"stage{stage}", ckpt_path)
        check_stage(stage_configs[stage])
    check_stages_together(stage_configs)

    metrics: dict[str, float] = {}
    summary: dict[str, dict] = {}
    for stage in stages:
        stage_dir = root / f"stage{stage}"
        # The earlier stages' best checkpoints exist only now.
        stage_cfg = with_handoff(cfg, stage_configs[stage], previous)
        if handoff_keys(cfg)["previous_best"] and previous:
            check_stage(stage_cfg)
        if cfg.get("preflight"):
            # A named card's preflight: the first stage's line, nothing written. A later stage is built from the
            # earlier stages' best checkpoints, so it is predicted when it starts, once they have trained.
            run_stage(stage_cfg)
            later = stages[stages.index(stage) + 1:]
            if later:
                log.info("preflight: stages %s are predicted as each starts (each is built from the earlier stages' "
                         "best checkpoints)", later)
            return {}
        stage_dir.mkdir(parents=True, exist_ok=True)
        OmegaConf.save(stage_cfg, stage_dir / "config.yaml", resolve=False)
        log.info("cascade: stage %d of %s in %s", stage, stages, stage_dir)
        stage_metrics = run_stage(stage_cfg)
        best, score = best_checkpoint(stage_dir) if stage_cfg.get("train", True) else (stage_dir / "best.ckpt", None)
        previous.append(best)
        metrics.update({f"stage{stage}/{k}": v for k, v in stage_metrics.items()})
        summary[f"stage{stage}"] = {"best_checkpoint": str(best), "best_score": score, "metrics": stage_metrics,
                                    "optimized_metric": str(stage_cfg.get("optimized_metric") or "")}
    metrics.update({k: v for k, v in stage_metrics.items()})
    write_summary(root, summary)
    return metrics


def check_stages_together(stage_configs: dict[int, DictConfig]) -> None:
    """Each family's check of its stages' settings side by side (`check_cascade`: X-ray-to-CT's stages see the same
    radiographs), before the first stage starts."""
    families: dict[str, dict[int, DictConfig]] = {}
    for stage, stage_cfg in stage_configs.items():
        families.setdefault(str(stage_cfg.model._target_), {})[stage] = stage_cfg.model
    for target, stages in families.items():
        target_class(target).check_cascade(stages)


def stages_to_run(cfg: DictConfig) -> tuple[Path, list[int], int | None]:
    """The cascade run's folder, the stages to run and the stage `ckpt_path` resumes (None: a fresh run); a resume
    runs from its stage on, in the run its checkpoint belongs to."""
    stages = sorted(int(s) for s in cfg.cascade.stages)
    if not stages or stages[0] < 1:
        raise MedvolError(f"`cascade.stages` must list stage numbers from 1, got {list(cfg.cascade.stages)}")
    resumed = stage_of_checkpoint(cfg.get("ckpt_path"))
    if cfg.get("ckpt_path") and resumed is None:
        raise MedvolError(
            f"`ckpt_path` {cfg.ckpt_path} is not a cascade stage's checkpoint; expected "
            "<run>/stage<k>/checkpoints/<file>"
        )
    if resumed is None:
        return Path(str(cfg.paths.output_dir)), stages, None
    root, resume_stage = resumed
    stages = [s for s in stages if s >= resume_stage]
    if not stages or stages[0] != resume_stage:
        raise MedvolError(
            f"`ckpt_path` resumes stage {resume_stage}, "
            f"which `cascade.stages` {list(cfg.cascade.stages)} does not run"
        )
    return root, stages, resume_stage


def earlier_best_checkpoints(cfg: DictConfig, root: Path, first: int) -> list[Path]:
    """The best.ckpt of every stage before `first`, from `cascade.from_run` or this run; one line for a missing one."""
    earlier = Path(str(cfg.cascade.from_run)) if cfg.cascade.get("from_run") else root
    previous: list[Path] = []
    for stage in range(1, first):
        best = earlier / f"stage{stage}" / "best.ckpt"
        if not best.is_file():
            raise MedvolError(
                f"stage {first} needs stage {stage}'s best.ckpt, but {best} does not exist; "
                f"run stage {stage} first or set `cascade.from_run` to a cascade run that has it"
            )
        previous.append(best)
    return previous


def with_handoff(cfg: DictConfig, stage_cfg: DictConfig, previous: list[Path]) -> DictConfig:
    """`stage_cfg` given the earlier stages' best checkpoints under the keys `cascade.handoff` names."""
    handoff = handoff_keys(cfg)
    given = {
        "previous_stages": [str(p) for p in previous],
        "init_from": str(previous[-1]) if previous and not stage_cfg.ckpt_path else None,
        "previous_best": str(previous[-1]) if previous else None,
    }
    with open_dict(stage_cfg):
        for name, value in given.items():
            if handoff[name] and (value is not None or name != "previous_best"):
                OmegaConf.update(stage_cfg, handoff[name], value, force_add=True)
    return stage_cfg


def write_summary(root: Path, summary: dict[str, dict]) -> None:
    """`cascade_summary.json` and a line per stage with its best epoch's score (the metrics hold the last epoch's)."""
    (root / "cascade_summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    for stage, entry in summary.items():
        score = "not recorded" if entry["best_score"] is None else f"{entry['best_score']:.4f}"
        log.info("cascade: %s best %s = %s (%s)", stage, entry["optimized_metric"], score, entry["best_checkpoint"])
