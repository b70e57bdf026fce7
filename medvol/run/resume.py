"""A command that names a checkpoint inside a run (`ckpt_path=<run>/checkpoints/last.ckpt`: a resume, or a test of
that run's checkpoint) continues that run: its record (`medvol.run.run_record`) with this command's overrides on top.

What the command changes is found by composing medvol's own config groups twice, with the run's recorded overrides
and with those followed by the command's (a key the command repeats counts once, the command's value): the values
that differ are the command's, and they replace the record's. So `python train.py ckpt_path=<run>/checkpoints/last.ckpt`
alone continues the run as it was configured, and `trainer.max_epochs=20` beside it wins.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from hydra.core.hydra_config import HydraConfig
from hydra.core.override_parser.overrides_parser import OverridesParser
from omegaconf import DictConfig, OmegaConf, open_dict

from medvol.core.config_targets import own_targets
from medvol.core.errors import MedvolError
from medvol.run.resolvers import run_dir_of_checkpoint
from medvol.run.run_record import RECORD_FILE, Record, command_overrides, legacy_record, read_record, settings

CONF_DIR = Path(__file__).resolve().parents[2] / "conf"
# Not the run's settings: where this machine keeps things, and Hydra's own node.
UNCOMPARED = ("hydra", "paths")


def run_record(
    run_dir: Path, paths: dict[str, str], own: Mapping[str, str] | None = None
) -> tuple[Record, Path] | None:
    """The record of the run in `run_dir` and the file it came from (`run.json`, or an old run's converted
    `.hydra/config.yaml`); None where the folder holds neither. `own`: the command's own class paths, which the
    record may name at the same keys (a callback of the user's own that the command names again)."""
    record = read_record(run_dir, own)
    if record is not None:
        return record, run_dir / RECORD_FILE
    config_file = run_dir / ".hydra" / "config.yaml"
    if config_file.is_file():
        return legacy_record(config_file, run_dir, paths, own), config_file
    return None


def _key(override: str) -> str:
    return OverridesParser.create().parse_override(override).key_or_group


def _composed(overrides: list[str], paths: dict[str, Any]) -> DictConfig:
    """medvol's `train` config composed with `overrides` (checked ones: a recorded override passed
    `medvol.run.run_record.check_override`), without Hydra's node, `paths` this command's."""

    def placed(cfg: DictConfig) -> DictConfig:
        with open_dict(cfg):
            cfg.pop("hydra", None)
            cfg.paths = paths
        return cfg

    try:
        if GlobalHydra.instance().is_initialized():
            return placed(compose(config_name="train", overrides=overrides))
        with initialize_config_dir(version_base="1.3", config_dir=str(CONF_DIR), job_name="train"):
            return placed(compose(config_name="train", overrides=overrides))
    except MedvolError:
        raise
    except Exception as err:  # noqa: BLE001 - Hydra's composition errors, each a reason the overrides do not compose
        reason = str(err).strip().splitlines()[0][:200] if str(err).strip() else type(err).__name__
        raise MedvolError(
            f"`ckpt_path`: the run's recorded overrides {overrides} do not compose here ({reason})"
        ) from None


def _resolved(cfg: DictConfig) -> dict[str, Any]:
    tree = OmegaConf.to_container(cfg, resolve=True)
    assert isinstance(tree, dict)
    return tree


def _changes(after: Any, before: Any, key: list[str]) -> list[tuple[list[str], Any]]:
    """(key, value) for every value of `after` that differs from `before`; value `...` where `after` drops the key."""
    if isinstance(after, dict) and isinstance(before, dict):
        found = [c for name in after for c in _changes(after[name], before.get(name, ...), [*key, str(name)])]
        return found + [([*key, str(name)], ...) for name in before if name not in after]
    return [] if after == before else [(key, after)]


def _apply(cfg: DictConfig, changes: list[tuple[list[str], Any]]) -> None:
    with open_dict(cfg):
        for key, value in changes:
            node = cfg
            for part in key[:-1]:
                if not isinstance(node.get(part), DictConfig):
                    node[part] = {}
                node = node[part]
            if value is ...:
                node.pop(key[-1], None)
            else:
                node[key[-1]] = value


def resumed(cfg: DictConfig) -> tuple[DictConfig, Path | None]:
    """(the config to run, the record it came from): the run's record with this command's changes where `cfg`'s
    `ckpt_path` lies in a run of this Hydra job's making; else (`cfg`, None)."""
    run_dir = run_dir_of_checkpoint(cfg.get("ckpt_path"))
    if run_dir is None or not HydraConfig.initialized():
        return cfg, None
    paths = OmegaConf.to_container(cfg.paths, resolve=True)
    assert isinstance(paths, dict)
    found = run_record(run_dir, {str(k): str(v) for k, v in paths.items()}, own_targets(cfg))
    if found is None:
        return cfg, None
    record, source = found
    own = command_overrides()
    typed = {_key(o) for o in own}
    kept = [o for o in record.overrides if _key(o) not in typed]
    command = _composed([*kept, *own], paths)
    if "cascade" in record.config:
        # A cascade's stages take their settings by merging them into the job's config, through its interpolations
        # (a stage's `dataset.size` gives its `model.size`): it resumes from its recorded overrides, composed.
        return command, source
    changes = [
        change for change in _changes(_resolved(command), _resolved(_composed(record.overrides, paths)), [])
        if change[0][0] not in UNCOMPARED
    ]
    settled = settings(record, {str(k): str(v) for k, v in paths.items()}, source)
    _apply(settled, changes)
    return settled, source
