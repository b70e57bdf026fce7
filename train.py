"""medvol's entry point: `python train.py model=vqgan dataset=synthetic ...` (see `--help`)."""

from __future__ import annotations

import logging
import sys
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig

from medvol.core.console import quiet_console
from medvol.core.errors import MedvolError
from medvol.run.override_check import answer_at_once

CONF_DIR = Path(__file__).resolve().parent / "conf"
log = logging.getLogger("medvol")


def _to_log_file_only(record: logging.LogRecord) -> None:
    """Write a record to the run's train.log only (the console has already shown it, or Hydra will)."""
    for handler in logging.getLogger().handlers:
        if isinstance(handler, logging.FileHandler):
            handler.handle(record)


@hydra.main(version_base="1.3", config_path="conf", config_name="train")
def main(cfg: DictConfig) -> float | None:
    # Imported here, not above: a typo or `--help` is answered before torch and Lightning load.
    from medvol.run.refusal import RunDirectoryBefore
    from medvol.run.resolvers import run_dir_of_checkpoint
    from medvol.run.training import run, sweep_objective
    from medvol.run.world import global_rank

    hydra_cfg = HydraConfig.get()
    output_dir = hydra_cfg.runtime.output_dir
    before = RunDirectoryBefore.record(
        output_dir,
        hydra_cfg.output_subdir,
        str(Path(output_dir) / f"{hydra_cfg.job.name}.log"),
        resumed=run_dir_of_checkpoint(cfg.get("ckpt_path")) is not None,
    )
    quiet_console()
    try:
        # run() prints the config once every check has passed: a refused command prints only its error line.
        metrics = run(cfg)
    except MedvolError as err:
        if global_rank() == 0 and not before.take_back():
            _to_log_file_only(log.makeRecord(log.name, logging.ERROR, __file__, 0, "medvol: error: %s", (err,), None))
        if hydra_cfg.mode == RunMode.MULTIRUN:
            # A sweep's job: the sweep's summary gives its line as the job's row, and the other jobs go on.
            raise
        # One write: with PYTHONUNBUFFERED (common in batch jobs) print() writes the newline separately,
        # and the same line from another rank would land in between.
        sys.stderr.write(f"medvol: error: {err}\n")
        sys.stderr.flush()
        sys.exit(2)
    except Exception as err:
        _to_log_file_only(
            log.makeRecord(log.name, logging.ERROR, __file__, 0, "run ended by %r", (err,), sys.exc_info())
        )
        raise
    if cfg.get("preflight") and global_rank() == 0:
        # A named card's preflight answers a question and runs nothing: what Hydra made for it (the run folder, or a
        # resumed run's `.hydra/resume-<stamp>` and the lines added to its train.log) is taken back.
        before.take_back()
    return sweep_objective(metrics, cfg.get("optimized_metric"), str(cfg.get("optimized_mode", "max")))


def _linked_run(argv: list[str]) -> None:
    from medvol.run.resume import refuse_a_linked_run
    from medvol.run.training import command_ckpt_path

    refuse_a_linked_run(command_ckpt_path(argv))


if __name__ == "__main__":
    # Hydra would report a misspelt key or option, or a plugin that is not installed, in several lines with exit code 1.
    answer_at_once(CONF_DIR, "train", sys.argv[1:], also=_linked_run)
    main()
