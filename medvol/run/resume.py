"""A command that names a checkpoint inside a run (`ckpt_path=<run>/checkpoints/last.ckpt`: a resume, or a test of
that run's checkpoint) continues that run: its record (`medvol.run.run_record`) with this command's overrides on top.

The record's choices and this command's overrides compose medvol's own config groups; the record's values are set on
it, and what the command types (and what follows from it) wins. So `python train.py ckpt_path=<run>/...last.ckpt`
alone continues the run as it was configured, and `trainer.max_epochs=20` beside it wins. Where the run writes comes
from this command's config, never from the record.
"""

from __future__ import annotations

from pathlib import Path

from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf

from medvol.core.run_files import refuse_links
from medvol.run.resolvers import run_dir_of_checkpoint
from medvol.run.run_record import RECORD_FILE, Record, command_overrides, legacy_record, read_record, settled


def run_record(run_dir: Path, paths: dict[str, str]) -> tuple[Record, Path] | None:
    """The record of the run in `run_dir` and the file it came from (`run.json`, or an old run's converted
    `.hydra/config.yaml`); None where the folder holds neither."""
    record = read_record(run_dir)
    if record is not None:
        return record, run_dir / RECORD_FILE
    config_file = run_dir / ".hydra" / "config.yaml"
    if config_file.is_file():
        return legacy_record(config_file, run_dir, paths), config_file
    return None


def resumed(cfg: DictConfig) -> tuple[DictConfig, Path | None]:
    """(the config to run, the record it came from): the run's record with this command's changes where `cfg`'s
    `ckpt_path` lies in a run of this Hydra job's making; else (`cfg`, None)."""
    run_dir = run_dir_of_checkpoint(cfg.get("ckpt_path"))
    if run_dir is not None:
        # A run folder holding a symbolic link anywhere is refused before anything is written (`refuse_a_linked_run`).
        refuse_links(run_dir)
    if run_dir is None or not HydraConfig.initialized():
        return cfg, None
    tree = OmegaConf.to_container(cfg.paths, resolve=True)
    assert isinstance(tree, dict)
    paths = {str(k): str(v) for k, v in tree.items()}
    found = run_record(run_dir, paths)
    if found is None:
        return cfg, None
    record, source = found
    return settled(record, paths, source, command=command_overrides(), builds_all=True, folder=run_dir), source


def refuse_a_linked_run(ckpt_path: str | None) -> None:
    """A resume continues a run folder that may come from someone else: one that holds a symbolic link anywhere is
    refused in one line before anything is written (`medvol.core.run_files`), as every writer refuses one too."""
    run_dir = run_dir_of_checkpoint(ckpt_path)
    if run_dir is not None:
        refuse_links(run_dir)
