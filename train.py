"""medvol's entry point: `python train.py model=vqgan dataset=synthetic ...` (see `--help`)."""

from __future__ import annotations

import logging
import sys

import hydra
from omegaconf import DictConfig

import medvol.resolvers  # noqa: F401 - registers the run-directory resolvers before Hydra composes
from medvol.errors import MedvolError
from medvol.training import run

log = logging.getLogger("medvol")


@hydra.main(version_base="1.3", config_path="conf", config_name="train")
def main(cfg: DictConfig) -> float | None:
    try:
        metrics = run(cfg)
    except MedvolError as err:
        # One line for the user; the console handler of Hydra's job logging would print a second copy.
        log.debug("medvol: error: %s", err)
        # One write: with PYTHONUNBUFFERED (common in batch jobs) print() writes the newline separately,
        # and the same line from another rank would land in between.
        sys.stderr.write(f"medvol: error: {err}\n")
        sys.stderr.flush()
        sys.exit(2)
    metric = cfg.get("optimized_metric")
    return metrics.get(metric) if metric else None


if __name__ == "__main__":
    main()
