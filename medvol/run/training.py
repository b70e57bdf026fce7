"""`run(cfg)`: build everything from the composed config, train, optionally test, return the metrics.

A run goes through its stages one after the other, each taking what the one before gave: a resumed run's record and
this command's changes (`medvol.run.resume`), a cascade's stages (`medvol.run.cascade`, each run as below), the GPU
preflight (`medvol.run.preflight`), the checks that need nothing built (`medvol.run.run_check`), the data planned
before any rank starts (`medvol.run.run_data`), then the model fitted, validated and tested (`medvol.run.fitting`).
"""

from __future__ import annotations

import logging
import math

import pytorch_lightning as pl
from omegaconf import DictConfig

from medvol.core.checkpoint_read import TRUST_KEY, checkpoints_trusted
from medvol.core.process_group import release_at_exit, run_started
from medvol.run.cascade import run_cascade
from medvol.run.fitting import fit_run
from medvol.run.launch import local_ranks
from medvol.run.preflight import preflight
from medvol.run.resume import resumed
from medvol.run.run_check import check_config, checked_config
from medvol.run.run_data import planned_data
from medvol.run.run_record import write_run_record
from medvol.run.world import global_rank, starts_own_ranks

log = logging.getLogger("medvol")


def sweep_objective(metrics: dict[str, float], metric: str | None, mode: str = "max") -> float | None:
    """What a Hydra sweeper receives: `metric`'s value, or the worst value for `mode` where it is undefined.

    A sweeper given NaN fails the trial (Optuna) or ranks it at random; an undefined metric (the AUROC
    of a one-class validation set) is the worst result a trial can have.
    """
    if not metric or metric not in metrics:
        return None
    value = float(metrics[metric])
    if not math.isnan(value):
        return value
    log.warning(
        "`%s` is undefined (NaN) for this run: the sweeper receives %s", metric, "-inf" if mode == "max" else "inf"
    )
    return -math.inf if mode == "max" else math.inf


def run(cfg: DictConfig, settled: bool = False) -> dict[str, float]:
    """Train (and optionally test) as the config says; return the final metrics as floats.

    With `trainer.devices=N > 1` on one node and no external launcher, this process becomes
    rank 0 and starts the other ranks itself (see `medvol.run.launch`). A config with a `cascade`
    node runs its stages one after another (see `medvol.run.cascade`). Checkpoints are read as data unless the
    command says `trust_checkpoints=true` (`medvol.core.checkpoint_read`). A `ckpt_path` inside a run continues
    that run: its record with this command's overrides on top (`medvol.run.resume`). `settled`: `cfg` is rank 0's
    planned config (ranks 1..N-1 of `medvol.run.launch`): planned and fitted already, as a record is.
    """
    with checkpoints_trusted(cfg.get(TRUST_KEY, False)):
        cfg, record = resumed(cfg)
        return _stages_or_run(cfg, recorded=settled or record is not None)


def command_ckpt_path(argv: list[str]) -> str | None:
    """The `ckpt_path=` a command line gives (the last one), before Hydra composes: Hydra opens a resumed run's
    train.log and writes its `.hydra/resume-<stamp>/` first."""
    given = [value for key, _, value in (a.partition("=") for a in argv) if key.lstrip("+") == "ckpt_path"]
    return given[-1].strip("'\"") if given else None


def _stages_or_run(cfg: DictConfig, recorded: bool = False) -> dict[str, float]:
    if cfg.get("cascade"):
        if global_rank() == 0 and not cfg.get("preflight"):
            write_run_record(cfg)
        return run_cascade(cfg, _stages_or_run, check_config)
    checked = preflight(cfg, recorded)
    if checked.stop:
        return {}
    world, checkpoint = checked_config(cfg)
    if global_rank() != 0:
        # Rank 0 alone prints; the others still report warnings and errors.
        logging.getLogger().setLevel(logging.WARNING)
        log.setLevel(logging.WARNING)
    if cfg.get("seed") is not None:
        pl.seed_everything(int(cfg.seed), workers=True, verbose=False)
    prepared = planned_data(cfg, world, recorded, checked)
    if prepared is None:
        return {}
    cfg, datamodule, plan_lines = prepared
    if starts_own_ranks(cfg.get("strategy"), world):
        with local_ranks(cfg, world.devices):
            return fit_run(cfg, world, datamodule, plan_lines, checkpoint)
    run_started()
    metrics = fit_run(cfg, world, datamodule, plan_lines, checkpoint)
    # Gloo's threads abort a process whose group outlives the interpreter (see medvol.core.process_group).
    release_at_exit()
    return metrics
